"""Command-line flags of the OpenAI-compatible server, under vLLM's names where vLLM has one."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxinfer.model_files import DEFAULT_MODEL

API_KEY_ENV = "JAXINFER_API_KEY"


@dataclass
class ServerArgs:
    model: str = DEFAULT_MODEL
    served_model_name: list[str] = field(default_factory=list)  # empty: the --model string
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.5
    num_kv_tokens: int | None = None
    kv_cache_memory: int | None = None  # KV bytes per device at most (see jaxinfer.cache.sizing)
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int | None = None
    api_key: str | None = None
    max_waiting: int | None = None
    log_level: str = "info"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int | None = None
    graceful_shutdown_timeout: float = 30.0
    compilation_cache_dir: str | None = None
    enable_compilation_cache: bool = True
    max_body_bytes: int = 4 * 2**20
    engine_process: bool = True  # the engine core in its own process (ignored with an injected loader)
    overlap_scheduling: bool = True  # dispatch each step before reading the previous one's tokens
    step_timeline: bool = False  # time every step (device busy / idle, host) for /metrics

    @property
    def model_names(self) -> list[str]:
        return self.served_model_name or [self.model]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _byte_size(text: str) -> int:
    from jaxinfer.cache.sizing import parse_bytes

    try:
        return int(parse_bytes(text, "--kv-cache-memory"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve.py", description="OpenAI-compatible HTTP server for jaxinfer models.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name, .gguf file, HF directory or checkpoint")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="name(s) clients use in the `model` field (default: the --model string)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="context length (default: the model's, capped at 4096)",
    )
    p.add_argument("--max-num-seqs", type=_positive_int, default=32, help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, help="token budget of one step")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="fraction of the free device memory given to the KV cache",
    )
    p.add_argument(
        "--num-kv-tokens",
        type=_positive_int,
        default=None,
        help="explicit KV pool size in tokens (overrides --gpu-memory-utilization)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=_byte_size,
        default=None,
        help="most KV cache bytes per device, e.g. 4GiB or 2000000000 (CPU default: what the scheduler can "
        "address, at most 1.5GiB)",
    )
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV page")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--max-logprobs", type=int, default=20, help="most top alternatives a request may ask for")
    p.add_argument("--seed", type=int, default=None, help="seed for requests that bring none")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require `Authorization: Bearer KEY` on /v1 and /(de)tokenize (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="requests that may wait for a first token; more get 429 (default: no bound)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1, help="devices each replica spans")
    p.add_argument("--data-parallel-size", type=_positive_int, default=1, help="model replicas in this process")
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: HOST:PORT of process 0 (with --num-processes and --process-id)")  # fmt: skip
    p.add_argument("--num-processes", type=_positive_int, default=1, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None,
                   help="multi-host: this process's rank (0 serves HTTP); found by jax on TPU pods, SLURM")  # fmt: skip
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core (scheduler, device steps) in its own process, away from HTTP and detokenization;"
        " --no-engine-process runs it on a thread of the server process (multi-host always does)",
    )
    p.add_argument(
        "--overlap-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="dispatch each step before the previous step's tokens reach the host, so scheduling, detokenization and"
        " streaming overlap the device (same outputs; --no-overlap-scheduling runs the plain loop, for debugging)",
    )
    p.add_argument(
        "--step-timeline",
        action="store_true",
        help="timestamp every step (a watcher thread waits on each step's outputs) and report the device's busy"
        " and idle time per step on /metrics (jaxinfer:device_idle_share, jaxinfer:step_*_ms)",
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    p.add_argument(
        "--compilation-cache-dir",
        default=None,
        help="persistent XLA cache (default: $JAXINFER_COMPILE_CACHE or ~/.cache/jaxinfer/xla)",
    )
    p.add_argument(
        "--no-compilation-cache",
        dest="enable_compilation_cache",
        action="store_false",
        help="compile every step afresh at start-up",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    ns = make_parser().parse_args(argv)
    if ns.max_waiting is not None and ns.max_waiting < 0:
        make_parser().error("--max-waiting must be >= 0")
    if not 0 < ns.gpu_memory_utilization <= 1:
        make_parser().error("--gpu-memory-utilization must be in (0, 1]")
    return ServerArgs(**vars(ns))
