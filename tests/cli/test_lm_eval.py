"""lm-evaluation-harness's `local-completions` model, in-process, against a live serve.py, offline (no tokenizer
download: it finds /tokenizer_info and /tokenize and uses the server's tokenizer).

A tiny local task (tests/cli/data/tiny_tasks.jsonl) is scored two ways: multiple choice (loglikelihood of every
choice, via /v1/completions with echo and logprobs) and generate_until. Each choice's loglikelihood must equal the
sum of the offline engine's prompt logprobs over the same continuation tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import pytest

from tests.cli.conftest import MODEL_NAME
from tests.server.conftest import API_KEY
from tests.tiny_model import SETTINGS

DATA = Path(__file__).parent / "data" / "tiny_tasks.jsonl"
BASE = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA)}}, "test_split": "test"}
MC_TASK = {**BASE, "task": "jaxinfer_tiny_mc", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
           "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": "",
           "metric_list": [{"metric": "acc"}]}  # fmt: skip
GEN_TASK = {**BASE, "task": "jaxinfer_tiny_gen", "output_type": "generate_until", "doc_to_text": "Q: {{question}}\nA:",
            "doc_to_target": "{{target}}", "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6},
            "metric_list": [{"metric": "exact_match"}]}  # fmt: skip


@pytest.fixture(scope="module")
def evaluated(live_server, monkeypatch_module):
    # No hub: a download attempt fails instead of hanging or succeeding behind the test's back.
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch_module.setenv(var, "1")
    monkeypatch_module.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer token
    model_args = {"model": MODEL_NAME, "base_url": f"{live_server.url}/v1/completions", "auth_token": API_KEY,
                  "max_length": SETTINGS["max_model_len"], "tokenizer_backend": "auto"}  # fmt: skip
    return lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=[MC_TASK, GEN_TASK], log_samples=True
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_tokenizer_info_in_vllm_shape_and_the_harness_uses_it(live_server, monkeypatch_module):
    import httpx
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.tokenizer import load_tokenizer

    tk = load_tokenizer(smollm2_gguf())  # the tiny model's tokenizer
    assert httpx.get(f"{live_server.url}/tokenizer_info").status_code == 401  # behind the API key, as /tokenize
    r = httpx.get(f"{live_server.url}/tokenizer_info", headers=live_server.headers)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] and info["model_max_length"] == SETTINGS["max_model_len"]
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (tk.bos_token, tk.eos_token, tk.pad_token)
    assert info["chat_template"] == tk.chat_template
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    lm = LocalCompletionsAPI(model=MODEL_NAME, base_url=f"{live_server.url}/v1/completions", auth_token=API_KEY)
    assert lm.tokenizer_backend == "remote"
    assert lm.tokenizer.encode("Hello, world!") == tk.encode("Hello, world!", add_special_tokens=False)
    assert lm.tokenizer.eos_token_id == tk.eos_token_ids[0]


def test_multiple_choice_loglikelihoods_equal_offline_prompt_logprobs(evaluated, tiny_model):
    from jaxinfer import LLM, SamplingParams

    samples = evaluated["samples"]["jaxinfer_tiny_mc"]
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(samples) == len(docs)
    with LLM(tiny_model, **SETTINGS) as llm:
        tk = llm.tokenizer
        for sample in samples:
            assert len(sample["resps"]) == len(docs[sample["doc_id"]]["choices"])
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
                # The harness's split: the continuation's tokens are what the whole text adds to the context's.
                ctx = tk.encode(context, add_special_tokens=False)
                whole = tk.encode(context + continuation, add_special_tokens=False)
                assert whole[: len(ctx)] == ctx
                out = llm.generate([whole], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                                   use_tqdm=False)[0]  # fmt: skip
                expected = sum(out.prompt_logprobs[p][whole[p]] for p in range(len(ctx), len(whole)))
                loglik, _is_greedy = resp[0]
                assert loglik == pytest.approx(expected, abs=1e-4), (context, continuation)


def test_generate_until_matches_greedy_completion(evaluated, live_server):
    import httpx

    for sample in evaluated["samples"]["jaxinfer_tiny_gen"]:
        context, gen_kwargs = sample["arguments"][0]
        body = {"model": MODEL_NAME, "prompt": context, "max_tokens": gen_kwargs["max_gen_toks"], "temperature": 0,
                "stop": gen_kwargs["until"]}  # fmt: skip
        r = httpx.post(f"{live_server.url}/v1/completions", json=body, headers=live_server.headers, timeout=120)
        assert r.status_code == 200, r.text
        assert sample["resps"][0][0] == r.json()["choices"][0]["text"]
