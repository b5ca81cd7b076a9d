"""fp32 logits of every family equal transformers', for prefill of a padded batch and for step-by-step decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer.generate import generate_tokens, run_step
from jaxinfer.model.attention import init_contiguous_cache
from jaxinfer.weights import load_weights
from tests.model.hf_reference import FAMILIES, build

PROMPT_LENS = (1, 7, 13, 20)
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, d)
    cfg, params, _ = load_weights(d)
    return hf, cfg, params


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENS]


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_prefill_batch_matches(pair):
    hf, cfg, params = pair
    prompts = _prompts(cfg.vocab_size)
    b, t = len(prompts), 32
    tokens = np.zeros((b, t), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    out, _ = run_step(params, cfg, tokens, pos, pos < lens[:, None], init_contiguous_cache(cfg, b, 64), all_logits=True)
    out = np.asarray(out)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(out[i, : len(p)], _hf_logits(hf, p), atol=TOL, rtol=0)


def test_step_by_step_decode_matches(pair):
    """Prefill a few tokens of each prompt, then feed the rest one token per step through the cache."""
    hf, cfg, params = pair
    prompts = [p for p in _prompts(cfg.vocab_size) if len(p) > 3]
    b, pre = len(prompts), 3
    cache = init_contiguous_cache(cfg, b, 32)
    tokens = np.array([p[:pre] for p in prompts], np.int32)
    pos = np.broadcast_to(np.arange(pre, dtype=np.int32), (b, pre))
    _, cache = run_step(params, cfg, tokens, pos, np.ones((b, pre), bool), cache)
    refs = [_hf_logits(hf, p) for p in prompts]
    for step in range(pre, max(len(p) for p in prompts)):
        alive = np.array([step < len(p) for p in prompts])
        tok = np.array([[p[step] if step < len(p) else 0] for p in prompts], np.int32)
        out, cache = run_step(params, cfg, tok, np.full((b, 1), step, np.int32), alive[:, None], cache)
        out = np.asarray(out)
        for i in np.flatnonzero(alive):
            np.testing.assert_allclose(out[i], refs[i][step], atol=TOL, rtol=0, err_msg=f"row {i} step {step}")


def test_greedy_generation_matches(pair):
    hf, cfg, params = pair
    prompts = _prompts(cfg.vocab_size)[1:3]
    ours = generate_tokens(params, cfg, prompts, 12)
    for p, o in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(p) :
            ].tolist()
        assert o == ref


def _llama_cpp_gguf(hf, path) -> None:
    """`hf` (a Llama with llama3 RoPE scaling) written as llama.cpp's converter writes it: Q/K rows permuted for its
    RoPE, and the scaling as a `rope_freqs.weight` tensor of per-frequency divisors, with no rope.scaling.type key."""
    import math

    import gguf

    c = hf.config
    rope, dim = c.rope_parameters, c.head_dim
    w = gguf.GGUFWriter(path, "llama")
    for add, value in [(w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_rope_freq_base, rope["rope_theta"]),
                       (w.add_key_length, dim), (w.add_value_length, dim)]:  # fmt: skip
        add(value)
    tokens = [f"t{i}" for i in range(c.vocab_size)]
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens)), w.add_token_merges([]), w.add_eos_token_id(2)
    factors = []
    low, high = (rope["original_max_position_embeddings"] / rope[k] for k in ("low_freq_factor", "high_freq_factor"))
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
            rope["high_freq_factor"] - rope["low_freq_factor"]
        )
        between = 1 / ((1 - smooth) / rope["factor"] + smooth)
        factors.append(1.0 if wavelen < high else rope["factor"] if wavelen > low else between)
    w.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
             "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down"}  # fmt: skip
    for key, t in hf.state_dict().items():
        t, parts = t.numpy().astype(np.float32), key.split(".")
        if key == "lm_head.weight":
            w.add_tensor("output.weight", t)
            continue
        name = names[parts[-2]]
        if parts[1] == "layers":
            name = f"blk.{parts[2]}.{name}"
            heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(parts[-2])
            if heads:  # llama.cpp's permutation: rotate-half halves -> interleaved pairs, per head
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(f"{name}.weight", t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_llama3_gguf_rope_freqs_match(tmp_path):
    """Llama 3.1+ GGUFs carry their RoPE scaling as rope_freqs.weight (read, the model was silently unscaled)."""
    hf = build("llama", tmp_path / "hf")
    _llama_cpp_gguf(hf, tmp_path / "llama3.gguf")
    cfg, params, _ = load_weights(tmp_path / "llama3.gguf", use_cache=False)
    assert cfg.rope.kind == "default" and cfg.rope.freq_factors is not None
    ids = _prompts(cfg.vocab_size)[-1]
    n = len(ids)
    logits, _ = run_step(params, cfg, np.array([ids], np.int32), np.arange(n, dtype=np.int32)[None],
                         np.ones((1, n), bool), init_contiguous_cache(cfg, 1, 32), all_logits=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(logits)[0, :n], _hf_logits(hf, ids), atol=TOL, rtol=0)
    # Converted, the checkpoint keeps the factors and a tokenizer of its own: it outlives the GGUF.
    from jaxinfer.weights import load_model
    from jaxinfer.weights.convert import convert

    convert(str(tmp_path / "llama3.gguf"), tmp_path / "ck")
    (tmp_path / "llama3.gguf").unlink()
    loaded = load_model(tmp_path / "ck")
    assert loaded.config == cfg
    assert loaded.tokenizer.decode([5, 7]) == "t5t7"
