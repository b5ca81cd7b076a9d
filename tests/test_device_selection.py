"""`--dtype auto` per backend and checkpoint, `--kv-cache-dtype`, and the error for a requested accelerator that jax
did not initialise (jaxinfer/device.py)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.cache.sizing import format_bytes
from jaxinfer.config import ModelConfig
from jaxinfer.device import (
    DeviceUnavailableError,
    auto_dtype,
    check_device,
    requested_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.runner import ModelRunner, kv_bytes_per_token
from jaxinfer.model import init_params
from jaxinfer.model_files import smollm2_gguf
from jaxinfer.startup import WarmupReport, summary
from jaxinfer.weights import checkpoint_dtype, load_weights


@pytest.mark.parametrize(
    "backend,stored,expected",
    [
        ("cpu", "bfloat16", "float32"),  # XLA:CPU: no fast bf16 matmuls, whatever the checkpoint holds
        ("cpu", None, "float32"),  # GGUF on CPU
        ("gpu", "bfloat16", "bfloat16"),  # HF bf16 checkpoint: its own dtype
        ("tpu", "float16", "float16"),
        ("gpu", "float32", "bfloat16"),  # fp32 checkpoint on an accelerator: half precision, as vLLM
        ("gpu", None, "bfloat16"),  # dequantized GGUF on GPU
        ("tpu", None, "bfloat16"),  # ... and on TPU
    ],
)
def test_auto_dtype_per_backend_and_checkpoint(backend, stored, expected):
    assert auto_dtype(backend, stored) == expected
    assert resolve_dtype("auto", backend, stored) == expected
    assert resolve_dtype("float16", backend, stored) == "float16"  # an explicit dtype is kept


def test_unknown_dtype_names_the_parameter():
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "gpu", None)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int4", "float32")


@pytest.mark.parametrize(
    "asked, model, backend, pool",
    [("auto", "bfloat16", "cpu", "float32"), (None, "float16", "cpu", "float32"),
     ("auto", "float32", "cpu", "float16"), (None, "float32", "cpu", "float16"),
     ("float32", "float32", "cpu", "float32"), ("auto", "float32", "gpu", "float32"),
     ("auto", "bfloat16", "gpu", "bfloat16"), ("auto", "bfloat16", "tpu", "bfloat16"),
     ("bfloat16", "bfloat16", "cpu", "bfloat16"), ("bfloat16", "float32", "gpu", "bfloat16")],
)  # fmt: skip
def test_kv_pool_dtype_on_cpu_is_float16_for_a_float32_model_and_float32_for_a_16_bit_one(asked, model, backend, pool):
    """On CPU a float32 model's pool is float16 (the numba kernel reads half the bytes; XLA:CPU writes it in
    place), a 16-bit model's float32: XLA:CPU rewrote a whole bfloat16 pool at every step's K/V write
    (`LLM(dtype="bfloat16")` took 23 s for 12 tokens, a 256 MiB pool, where a float32 pool takes under a second).
    Asked for, any dtype is kept; elsewhere the pool follows the model."""
    assert resolve_kv_cache_dtype(asked, model, backend) == pool


def test_checkpoint_dtype_reads_hf_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float16"}))  # transformers 5
    assert checkpoint_dtype(tmp_path) == "float16"
    nested = {"model_type": "gemma3", "text_config": {"torch_dtype": "bfloat16"}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert checkpoint_dtype(smollm2_gguf()) is None  # quantized: auto picks per backend


@pytest.fixture(scope="module")
def hf_bf16_dir(tmp_path_factory):
    from tests.model.hf_reference import build

    path = tmp_path_factory.mktemp("hf")
    build("qwen3", path)
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("backend,expected", [("cpu", "float32"), ("gpu", "bfloat16"), ("tpu", "bfloat16")])
def test_load_weights_auto_follows_the_backend(hf_bf16_dir, monkeypatch, backend, expected):
    # The backend is what jax reports; the weights themselves still load on this CPU in the chosen dtype.
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    cfg, params, _ = load_weights(hf_bf16_dir)
    assert cfg.dtype == expected
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(expected)}


TINY = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8)  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
def test_kv_cache_dtype_sets_the_pool_and_its_size(kv_cache_dtype, caplog):
    cc = CacheConfig(block_size=8, num_pages=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                     kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="jaxinfer.engine.runner"):
        runner = ModelRunner(TINY, init_params(TINY), cc)
    expected = jnp.dtype(kv_cache_dtype or TINY.dtype)
    assert all(k.dtype == expected and v.dtype == expected for k, v in runner.kv)
    assert kv_bytes_per_token(TINY, kv_cache_dtype) == 2 * 2 * 2 * 8 * expected.itemsize
    # The start-up lines name the backend, the device, the mesh and both attention choices.
    text = caplog.text
    assert f"backend {jax.default_backend()}" in text and "mesh none" in text
    assert f"KV cache dtype {expected.name}" in text
    # On CPU the dispatcher runs the numba kernel for a float32 pool, else the jnp path and says why.
    kind = "cpu_numba" if expected == jnp.float32 else "cpu_jnp; cpu_numba declined: q is bfloat16"
    assert f"attention: decode {kind}" in text and f"| mixed {kind}" in text
    # The ready summary counts the pool at its own dtype, as the pool's line does (it counted the model's).
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv)
    assert pool_bytes == 128 * kv_bytes_per_token(TINY, kv_cache_dtype)  # 16 pages of 8 tokens
    lines = summary(SimpleNamespace(runner=runner, cc=cc), "tiny", 1.0, WarmupReport(1.0, 1)).splitlines()
    assert f"(16 pages x 8, {format_bytes(pool_bytes)})" in next(line for line in lines if "KV cache" in line)


def test_a_page_counts_the_pools_padded_rows(monkeypatch, caplog):
    """Where the pools pad each stored row (to 128 lanes on TPU; forced here on CPU), a page's bytes, the pool's
    start-up line and the host tier's blocks count the padding: a page copied to the host takes that much. They
    counted the model's KV heads only, so on TPU the host tier held up to 2x its byte cap."""
    import kernels_pallas
    from jaxinfer.engine.engine import Engine

    monkeypatch.setitem(kernels_pallas.POOL_LANE_MULTIPLE, "cpu", 128)
    cc = CacheConfig(block_size=8, num_pages=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                     host_kv_cache_memory=1 << 20)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="jaxinfer.engine.runner"):
        runner = ModelRunner(TINY, init_params(TINY), cc)
    padded = 2 * TINY.num_layers * 8 * 128 * 4  # K and V of each layer, 8 tokens of 128 floats (2 heads x 8 used)
    assert runner.page_bytes == padded == 8 * kv_bytes_per_token(TINY) * 8
    assert f"({16 * padded / 2**20:.1f} MiB in all)" in caplog.text
    host = Engine._host_tier(SimpleNamespace(runner=runner), cc)
    assert host.block_bytes == padded and host.max_blocks == (1 << 20) // padded


def test_kv_cache_dtype_follows_the_model_unless_set():
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_kv_cache_dtype(None, "float32") == "float32"
    assert resolve_kv_cache_dtype("bfloat16", "float32") == "bfloat16"


def test_bf16_kv_cache_under_an_f32_model_decodes():
    """Queries are cast to the pool's dtype for attention and back: the steps run, and the first token (prefill
    attention over bf16-rounded K/V) matches the f32 contiguous generator."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.generate import generate_tokens
    from jaxinfer.types import SamplingParams

    cc = CacheConfig(block_size=8, num_pages=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                     kv_cache_dtype="bfloat16")  # fmt: skip
    params = init_params(TINY)
    prompts = [[1, 5, 9, 3], [7, 2, 4, 4]]
    outs = Engine(TINY, params, cc).generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    tokens = [o[0].output_token_ids for o in outs]
    assert all(len(t) == 3 for t in tokens)
    assert [t[0] for t in tokens] == [t[0] for t in generate_tokens(params, TINY, prompts, 1)]


@pytest.mark.parametrize(
    "env,arg,expected",
    [
        ({}, None, "auto"),
        ({"JAXINFER_DEVICE": "tpu"}, None, "tpu"),
        ({"JAX_PLATFORMS": "cuda,cpu"}, None, "gpu"),  # jax would fall back to CPU silently
        ({"JAX_PLATFORMS": "tpu"}, None, "tpu"),
        ({"JAXINFER_DEVICE": "gpu", "JAX_PLATFORMS": "cpu"}, None, "gpu"),
        ({"JAXINFER_DEVICE": "gpu"}, "auto", "auto"),  # the flag wins over the environment
    ],
)
def test_requested_device(monkeypatch, env, arg, expected):
    monkeypatch.delenv("JAXINFER_DEVICE", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert requested_device(arg) == expected


@pytest.mark.parametrize("want", ["gpu", "tpu"])
def test_asking_for_an_accelerator_and_getting_cpu_is_an_error(monkeypatch, want):
    if jax.default_backend() == want:
        pytest.skip(f"this machine has a {want}")
    with pytest.raises(DeviceUnavailableError, match=rf"device: {want} was requested but jax initialised"):
        check_device(want)
    monkeypatch.setenv("JAXINFER_DEVICE", want)
    with pytest.raises(DeviceUnavailableError, match=r"\[(cuda|tpu)\]"):  # names the install command
        check_device()


def test_a_platform_jax_cannot_start_is_named_with_its_install_command():
    """JAX_PLATFORMS=tpu (or cuda) alone, where that plugin is missing: jax fails its own start (RuntimeError, or a
    bare AssertionError for cuda), which escaped as its traceback. It is a DeviceUnavailableError naming the fix."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("this machine has libtpu")
    code = "from jaxinfer.device import check_device\ncheck_device()"
    env = {**os.environ, "JAX_PLATFORMS": "tpu"}
    env.pop("JAXINFER_DEVICE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("jaxinfer.device.DeviceUnavailableError: device: jax could not "
                                                  "start JAX_PLATFORMS='tpu'"), r.stderr  # fmt: skip
    assert "[tpu]" in last, last


def test_matching_or_auto_device_passes(monkeypatch):
    monkeypatch.delenv("JAXINFER_DEVICE", raising=False)
    assert check_device(jax.default_backend()) == jax.default_backend()
    assert check_device("auto") == jax.default_backend()
    with pytest.raises(ValueError, match="device"):
        check_device("npu")


def test_server_flags_default_to_auto():
    from jaxinfer.server.args import parse_args

    args = parse_args([])
    assert (args.dtype, args.kv_cache_dtype, args.device) == ("auto", "auto", None)
    args = parse_args(["--dtype", "bfloat16", "--kv-cache-dtype", "float32", "--device", "tpu"])
    assert (args.dtype, args.kv_cache_dtype, args.device) == ("bfloat16", "float32", "tpu")


def test_startup_attention_line_names_kernels_and_reasons():
    from jaxinfer.device import describe_attention

    # The default model's layout (9 query / 3 KV heads of 64) takes both TPU kernels at the engine's defaults.
    line = describe_attention(9, 3, 64, "bfloat16", "bfloat16", 20000, 16, 32, 256, "pallas_tpu", 256)
    assert line == "attention: decode pallas_tpu | mixed pallas_tpu"
    # 512 sequences of 32k tokens: the page table no longer fits SMEM, and the line says so.
    line = describe_attention(9, 3, 64, "bfloat16", "bfloat16", 20000, 16, 512, 1024, "pallas_tpu", 2048)
    assert line.startswith("attention: decode reference; pallas_tpu declined: SMEM")
    assert "mixed reference; pallas_tpu declined: SMEM" in line


@pytest.mark.parametrize(
    "model, kv, backend, query",
    [("float32", "float16", "cpu", "float32"), ("float32", "float16", "gpu", "float16"),
     ("float32", "bfloat16", "cpu", "bfloat16"), ("bfloat16", "float32", "cpu", "float32")],
)  # fmt: skip
def test_float32_queries_attend_over_a_float16_pool_on_cpu(model, kv, backend, query):
    """The queries attend in the pool's dtype, except float32 ones over a float16 pool on CPU: the numba kernel
    widens the pool's halves and keeps the queries' precision."""
    from jaxinfer.device import attention_query_dtype

    assert attention_query_dtype(model, kv, backend) == query


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel")
def test_startup_attention_line_names_the_cpu_kernel_for_a_float16_pool():
    """`--kv-cache-dtype float16` on CPU: the line names the numba kernel (asked with the queries' dtype, float32),
    which also registers its handler before a warm start loads stored steps that call it."""
    from jaxinfer.device import describe_attention
    from kernels_pallas import numba_ffi, ragged_cpu

    line = describe_attention(9, 3, 64, "float16", "float32", 2000, 16, 128, 512, None, 256)
    assert line == "attention: decode cpu_numba | mixed cpu_numba"
    assert numba_ffi.registered(ragged_cpu.target(64, "float16"))
