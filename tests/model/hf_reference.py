"""Small random-weight HF models of each family, saved to disk, as references for the parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

# One entry per family and per feature that changes the math; prompts in the tests are longer than the windows.
FAMILIES: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_bias_tied": dict(
        model_type="llama",
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        num_key_value_heads=4,
    ),
    "mistral_window": dict(
        model_type="mistral",
        sliding_window=6,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    ),
    "qwen2": dict(
        model_type="qwen2",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
    ),
    "qwen3": dict(
        model_type="qwen3",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # YaRN as DeepSeek-V3 writes it: no factor (max_position / original), mscale over mscale_all_dim.
    "llama_yarn_mscale": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": None,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        sliding_window=5,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=20.0,
        attn_logit_softcapping=5.0,  # Gemma 2's; Gemma 3's attention ignores it (transformers, Google's reference)
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
}


def build(family: str, out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Builds a random fp32 model, perturbs every weight (norms included, so (1+w) vs w matters) and saves it."""
    spec = dict(BASE) | FAMILIES[family]
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return model
