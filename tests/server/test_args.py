"""serve.py's flags: vLLM's names, defaults, the API key from the environment."""

from __future__ import annotations

import pytest

from jaxinfer.model_files import DEFAULT_MODEL
from jaxinfer.server.args import API_KEY_ENV, parse_args


def test_defaults(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    a = parse_args([])
    assert (a.model, a.host, a.port, a.api_key, a.max_waiting) == (DEFAULT_MODEL, "127.0.0.1", 8000, None, None)
    assert a.model_names == [DEFAULT_MODEL] and a.enable_prefix_caching


def test_vllm_flags(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    argv = (
        "--model m.gguf --served-model-name a b --max-model-len 1024 --dtype bfloat16 --max-num-seqs 8 "
        "--max-num-batched-tokens 128 --num-kv-tokens 2048 --block-size 32 --gpu-memory-utilization 0.9 "
        "--max-waiting 5 --no-enable-prefix-caching --tensor-parallel-size 1 --data-parallel-size 1"
    )
    a = parse_args(argv.split())
    assert a.model_names == ["a", "b"] and a.api_key == "from-env"
    assert (a.max_model_len, a.dtype, a.max_num_seqs, a.max_num_batched_tokens) == (1024, "bfloat16", 8, 128)
    assert (a.num_kv_tokens, a.block_size, a.gpu_memory_utilization, a.max_waiting) == (2048, 32, 0.9, 5)
    assert not a.enable_prefix_caching
    assert parse_args(["--api-key", "flag"]).api_key == "flag"
    # a model of one's own whose build() returns no tokenizer names one
    a = parse_args(["--model", "my_pkg.my_model:build", "--tokenizer", "smollm2-135m-instruct"])
    assert (a.model, a.tokenizer) == ("my_pkg.my_model:build", "smollm2-135m-instruct")


@pytest.mark.parametrize(
    "argv",
    [["--tensor-parallel-size", "0"], ["--data-parallel-size", "-4"], ["--max-num-seqs", "0"],
     ["--gpu-memory-utilization", "1.5"], ["--max-waiting", "-1"], ["--max-waiting", "0"], ["--bogus"],
     # an empty key would turn authentication off; one with spaces around it could never match
     ["--api-key", ""], ["--api-key", " sk-a "]],
)  # fmt: skip
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
