"""Load a GGUF file: config from its metadata, tensors dequantized with the `gguf` package (the header is read by
jaxinfer.gguf_file, many times faster than gguf.GGUFReader).

Two conventions of llama.cpp's converter are undone here:
- llama-arch Q/K weights are permuted so llama.cpp can use interleaved RoPE; we use HF's rotate-half layout.
- Gemma norm weights are stored as (1 + w); our Gemma norms compute (1 + w) themselves.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig, from_gguf_metadata, rope_inv_freq
from jaxinfer.gguf_file import read_gguf
from jaxinfer.model.transformer import Params
from jaxinfer.weights.layout import build_on_mesh

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _gguf_name(cfg: ModelConfig, hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    if rest == "post_attention_layernorm.weight":
        # Llama's post_attention_layernorm is its pre-MLP norm; Gemma's is a true post-attention norm.
        rest_gguf = "post_attention_norm.weight" if cfg.sandwich_norm else "ffn_norm.weight"
    else:
        rest_gguf = _LAYER_NAMES[rest]
    return f"blk.{i}.{rest_gguf}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation (interleaved pairs -> rotate-half halves), per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path, dtype: str = "float32", mesh: Mesh | None = None) -> tuple[ModelConfig, Params]:
    file = read_gguf(path)
    meta, tensors = file.metadata, file.tensors
    cfg = from_gguf_metadata(meta, dtype=dtype)
    cfg = cfg.replace(tie_word_embeddings="output.weight" not in tensors)
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:  # Llama 3.1+: llama.cpp's converter writes the rope scaling as per-frequency divisors
        factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float64).ravel().tolist()
        cfg = cfg.replace(rope=dataclasses.replace(cfg.rope, freq_factors=tuple(factors)))
        rope_inv_freq(cfg.rope, cfg.head_dim)  # raises naming a count that does not fit the heads
    llama_permuted = meta.get("general.architecture") == "llama"
    bar = tqdm(total=len(tensors), desc=f"Converting {Path(path).name}", unit="tensor", disable=None)

    def get(hf: str) -> np.ndarray | None:
        name = _gguf_name(cfg, hf)
        t = tensors.get(name)
        if t is None:
            return None
        bar.update(1)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(reversed([int(n) for n in t.shape])))
        if llama_permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif llama_permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        if cfg.norm_offset and name.endswith("norm.weight"):
            w = w - cfg.norm_offset
        return w

    with bar:
        return build_on_mesh(cfg, get, dtype, mesh)
