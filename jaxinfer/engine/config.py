"""The engine's settings: one frozen dataclass each, every default written once, under vLLM's names.

- `CacheConfig`: what the runner and scheduler need (KV pool, batch and token budgets). Built by `build_engine`;
  tests and benchmarks construct it directly.
- `EngineArgs`: everything a user sets to build an engine, as `LLM(**settings)` takes it; the server's
  `ServerArgs` extends it with the HTTP flags, and the command-line parser reads its defaults from these classes.

Host-only (no jax): the HTTP process validates requests against these without importing the runner or kernels.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from jaxinfer.model_files import DEFAULT_MODEL
from jaxinfer.types import is_integer

LAYER_LOOPS = ("auto", "scan", "unroll")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # explicit pool size; else sized by jaxinfer.cache.sizing
    gpu_memory_utilization: float = 0.5  # of the device memory left free after the weights
    kv_cache_memory: int | None = None  # KV bytes per device at most (CPU default: sizing.CPU_DEFAULT_BUDGET)
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256  # token budget of a mixed step
    enable_prefix_caching: bool = True
    max_logprobs: int = 20  # top alternatives computed every step
    logit_bias_capacity: int = 512  # logit_bias entries per request, min_tokens' stop-id bans included
    kv_cache_dtype: str | None = None  # the KV pool's dtype; None: the model's
    # Conversations that keep their KV (jaxinfer.cache.sessions): how long a finished turn's pages stay pinned,
    # and how many pages all sessions may pin together (None: a quarter of the pool; 0: sessions off).
    session_ttl: float = 300.0
    session_cache_pages: int | None = None
    # Host memory for KV pages the pool gives up (jaxinfer.cache.host_tier), bytes per replica; None: 1 GiB on
    # GPU/TPU, off on CPU (where host and device memory are the same); 0: off.
    host_kv_cache_memory: int | None = None
    # How a step runs the layers: "scan" (one loop body over stacked weights and KV pools), "unroll", or "auto"
    # (measured per backend: jaxinfer.engine.runner.choose_layer_loop).
    layer_loop: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_model_len < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_model_len and max_num_seqs must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if not self.session_ttl > 0:
            raise ValueError(f"session_ttl must be > 0 seconds, got {self.session_ttl}")
        if self.session_cache_pages is not None and self.session_cache_pages < 0:
            raise ValueError(f"session_cache_pages must be >= 0, got {self.session_cache_pages}")
        if self.host_kv_cache_memory is not None and self.host_kv_cache_memory < 0:
            raise ValueError(f"host_kv_cache_memory must be >= 0 bytes, got {self.host_kv_cache_memory}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got {self.layer_loop!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode needs a token slot)")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


# The model's own context length is used up to this many tokens when max_model_len is not given.
DEFAULT_MAX_MODEL_LEN_CAP = 4096
# Per backend, when not given: (max_num_seqs, max_num_batched_tokens: the token budget of a mixed step, raised to
# max_num_seqs when that is set higher). CPU: XLA:CPU's dots at the default model's shapes run ~25% faster at 128
# rows than at 64 (and 64 than 32), so wide decode steps pay: on the default model's offline workload (256
# requests) 128 rows ran 1.10x faster than 64, and 64 with 512 tokens 1.15x faster than 32 with 256, with the
# default KV budget (benchmarks/README.md). A step of 128 rows holds no more KV than the pool has: the scheduler
# admits and preempts by free pages.
BATCH_DEFAULTS: dict[str, tuple[int, int]] = {"cpu": (128, 512), "gpu": (32, 256), "tpu": (32, 256)}


def batch_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None, backend: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the given ones, else this backend's defaults (an unknown backend
    gets the GPU row). A default never contradicts a given value: the default token budget grows to a given
    max_num_seqs, and the default max_num_seqs shrinks to a given token budget (every decode needs a token slot)."""
    seqs, tokens = BATCH_DEFAULTS.get(backend, BATCH_DEFAULTS["gpu"])
    seqs = max_num_seqs or min(seqs, max_num_batched_tokens or seqs)
    return seqs, max_num_batched_tokens or max(tokens, seqs)


GENERATION_CONFIGS = ("auto", "vllm")


@dataclass(frozen=True)
class EngineArgs:
    """What `build_engine` builds from. `model`: a preset, a GGUF file, an HF directory, a checkpoint (a path as
    text or a pathlib.Path), an entry point `"pkg.module:build"`, or your own nnx.Module (jaxinfer.model.protocol;
    `tokenizer` is then required). `tokenizer`: a Tokenizer, or a model name or path to read one from (overrides the
    model's own)."""

    model: Any = DEFAULT_MODEL
    tokenizer: Any = None
    # A Jinja chat template, or a path to a file holding one, used instead of the model's (vLLM's --chat-template).
    chat_template: str | None = None
    # "auto": float32 on CPU, the checkpoint's half precision (or bfloat16) on GPU/TPU. The KV cache follows it, but
    # on CPU is float16 for a float32 model and float32 for a 16-bit one (jaxinfer.device.resolve_kv_cache_dtype).
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str | None = None  # None: $JAXINFER_DEVICE, else what $JAX_PLATFORMS asks for, else auto
    max_model_len: int | None = None  # None: the model's, capped at DEFAULT_MAX_MODEL_LEN_CAP
    max_num_seqs: int | None = None  # None: per backend (BATCH_DEFAULTS: 128 on CPU, 32 on GPU and TPU)
    max_num_batched_tokens: int | None = None  # None: per backend (BATCH_DEFAULTS), at least max_num_seqs
    block_size: int = CacheConfig.block_size
    num_kv_tokens: int | None = None  # explicit KV pool size in tokens (overrides gpu_memory_utilization)
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    kv_cache_memory: int | str | None = None  # KV bytes per device at most: an int, or text like "4GiB"
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    max_logprobs: int = CacheConfig.max_logprobs
    seed: int | None = None  # for requests that bring none
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    attn_impl: str | None = None  # None: the dispatcher's choice per backend
    enable_compilation_cache: bool = True  # jax's persistent cache and the executable cache
    compilation_cache_dir: str | None = None  # None: $JAXINFER_COMPILE_CACHE or ~/.cache/jaxinfer/xla
    overlap_scheduling: bool = True  # dispatch each step before the previous one's tokens are read on the host
    step_timeline: bool = False  # timestamp every step (device busy/idle, host time) for /metrics
    # A request whose SamplingParams name a `session_id` keeps its pages pinned when it ends, for `session_ttl`
    # seconds, so the conversation's next turn prefills only what is new; all sessions together pin at most
    # `session_cache_pages` pages (None: a quarter of the pool; 0 turns sessions off).
    session_ttl: float = CacheConfig.session_ttl
    session_cache_pages: int | None = CacheConfig.session_cache_pages
    # Prefix pages the pool gives up are kept in host memory and copied back on a hit (jaxinfer.cache.host_tier):
    # bytes, or text like "8GiB", shared equally by data-parallel replicas; None: 1 GiB on GPU/TPU, off on CPU; 0: off.
    host_kv_cache_memory: int | str | None = None
    layer_loop: str = CacheConfig.layer_loop  # "auto" (per backend), "scan" or "unroll"
    # "auto": a request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset takes the model's
    # generation_config.json values, and its max_new_tokens caps an unset max_tokens (vLLM's --generation-config
    # auto); "vllm": the built-in defaults.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        """Raises ValueError naming the first setting of the wrong type or range: `LLM(max_num_seqs=0)` fell back to
        the default (`x or default`), `enable_prefix_caching="no"` was truthy, and `max_logprobs=-1` built an
        engine that failed every request."""
        if isinstance(self.model, os.PathLike):  # a pathlib.Path to the weights was taken for a user's module
            object.__setattr__(self, "model", os.fspath(self.model))
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_tokens"):
            _check_int(self, name, 1, optional=True)
        for name in ("block_size", "tensor_parallel_size", "data_parallel_size"):
            _check_int(self, name, 1)
        _check_int(self, "max_logprobs", 0)
        _check_int(self, "session_cache_pages", 0, optional=True)
        _check_int(self, "seed", None, optional=True)
        for name in ("gpu_memory_utilization", "session_ttl"):  # numbers: a string failed deep in CacheConfig
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name}: must be a number, got {value!r}")
        for name in ("enable_prefix_caching", "enable_compilation_cache", "overlap_scheduling", "step_timeline"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config: one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        # Sizes as text are parsed when the pool is sized, after the weights load: checked here, before them.
        from jaxinfer.cache.sizing import parse_bytes, parse_size

        parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        parse_size(self.host_kv_cache_memory, "host_kv_cache_memory")

    @staticmethod
    def from_mapping(settings: Mapping[str, Any]) -> EngineArgs:
        """The engine's settings among `settings` (parsed flags, or the server's args as a dict); others ignored."""
        return EngineArgs(**{f.name: settings[f.name] for f in fields(EngineArgs) if f.name in settings})


def _check_int(args: EngineArgs, name: str, low: int | None, optional: bool = False) -> None:
    value = getattr(args, name)
    if value is None and optional:
        return
    if not is_integer(value):
        raise ValueError(f"{name}: must be an integer{' or None' if optional else ''}, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
