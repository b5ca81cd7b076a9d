"""The one builder: `EngineArgs` -> (engine, tokenizer). `LLM`, `serve.py` (through the engine process or the
in-process server) and the CLI all call it, so a setting means the same thing everywhere."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import jax
from flax import nnx

import kernels_pallas
from jaxinfer.cache.sizing import parse_bytes, parse_size
from jaxinfer.config import ModelConfig
from jaxinfer.device import check_device, resolve_kv_cache_dtype
from jaxinfer.engine.config import DEFAULT_MAX_MODEL_LEN_CAP, CacheConfig, EngineArgs, batch_limits
from jaxinfer.engine.dp import DataParallelEngine, replica_meshes
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.grammar import GrammarCompiler
from jaxinfer.engine.runner import enable_compilation_cache
from jaxinfer.engine.timeline import StepTimeline
from jaxinfer.host_memory import gc_paused, release_freed_memory, reuse_large_blocks
from jaxinfer.model.protocol import check_model, is_entry_point, load_entry_point
from jaxinfer.model_files import ModelNotFoundError, resolve_model_path
from jaxinfer.sharding import make_mesh, place_module
from jaxinfer.tokenizer import Tokenizer, load_tokenizer
from jaxinfer.weights import load_model, read_model_config, sampling_defaults

log = logging.getLogger(__name__)

TIMELINE_WINDOW = 512  # steps the /metrics timeline gauges summarise


@gc_paused()  # its objects live as long as the engine: automatic collections would only walk them
def build_engine(args: EngineArgs) -> tuple[Engine | DataParallelEngine, Tokenizer]:
    """The engine and tokenizer for `args` (see EngineArgs for each setting). `device` raises
    `jaxinfer.device.DeviceUnavailableError` when jax initialised another backend; a user module that does not
    follow jaxinfer.model.protocol raises naming the missing part."""
    t0 = time.perf_counter()
    reuse_large_blocks()  # before jax starts its CPU client's threads: a step's temporaries are then not remapped
    check_device(args.device)
    template = read_chat_template(args.chat_template) if args.chat_template is not None else None  # before loading
    if args.enable_compilation_cache:
        # A second start then restores the compiled steps instead of compiling them again.
        enable_compilation_cache(args.compilation_cache_dir)
    mesh = None
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if tp > 1 or dp > 1 or jax.process_count() > 1:
        if dp > 1 and jax.process_count() > 1:
            raise ValueError("data_parallel_size: data parallelism across processes is not supported")
        mesh = make_mesh(tp, dp)
    if isinstance(args.model, str) and not is_entry_point(args.model):
        # What the metadata can refuse (max_model_len past the model's context) is refused before the weights load:
        # after, a notebook's traceback of the failed cell held them.
        meta = read_model_config(args.model, args.dtype)
        _prepare_kernels(args.attn_impl, meta, cache_config(args, meta))
    cfg, params, tokenizer = _load(args.model, args.tokenizer, args.dtype, mesh, dp)
    if template is not None:  # before the engine takes the stop ids: its end-of-turn marker joins them
        tokenizer = tokenizer.with_chat_template(template)
    cache = cache_config(args, cfg)
    eos = tokenizer.eos_token_ids
    if dp > 1:
        engine = DataParallelEngine(cfg, params, mesh, cache, eos, args.attn_impl, args.seed, args.overlap_scheduling)
    else:
        # Weights loaded here are the engine's alone: it may free what it copies (a user's module stays whole).
        engine = Engine(cfg, params, cache, eos, args.attn_impl, args.seed, mesh, args.overlap_scheduling,
                        donate_params=not isinstance(params, nnx.Module))  # fmt: skip
        if jax.process_count() > 1:
            from jaxinfer.distributed import attach_followers

            attach_followers(engine.runner)  # the lead broadcasts every step; followers run `distributed.follow`
    grammars = GrammarCompiler(tokenizer, cfg.vocab_size, eos)  # structured outputs: the tokenizer's tokens
    for e in getattr(engine, "replicas", [engine]):
        e.grammars = grammars
    # The replicas hold their own (on CPU, for the scanned loop, stacked) copies of the weights now: drop the
    # loaded ones and give their memory back, so a notebook's RSS is what the engine uses.
    del params
    release_freed_memory()
    if args.generation_config == "auto" and isinstance(args.model, str) and not is_entry_point(args.model):
        engine.sampling_defaults = sampling_defaults(args.model)
        if engine.sampling_defaults:  # as vLLM says it: requests that leave these unset sample differently
            log.info("sampling defaults from the model's generation_config.json (--generation-config vllm: the "
                     "built-in ones): %s", engine.sampling_defaults)  # fmt: skip
    if args.step_timeline:
        for e in getattr(engine, "replicas", [engine]):
            e.runner.timeline = StepTimeline(max_steps=TIMELINE_WINDOW)
    log.info("model %s loaded in %.1fs", args.model, time.perf_counter() - t0)
    return engine, tokenizer


def read_chat_template(given: str) -> str:
    """--chat-template's value: a file's text, or the template itself (vLLM tells them apart the same way)."""
    path = Path(given).expanduser()
    if "{" not in given and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{%" in given or "{{" in given:
        return given
    raise ValueError(f"chat_template: {given!r} is neither a file nor a Jinja template")


def _prepare_kernels(attn_impl: str | None, meta: ModelConfig, cache: CacheConfig) -> None:
    """Starts what the attention kernel needs for this model (`meta`: its config from the metadata; `cache`: the
    pool it will get) before its weights load, so the two overlap: on a CPU machine that has not built the numba
    kernel yet, its build (9-10 s on 2 cores) runs in a child process."""

    def model_shape() -> tuple[int, str, str]:
        return meta.head_dim, meta.dtype, cache.kv_cache_dtype or meta.dtype

    if kernels_pallas.prepare(attn_impl, model_shape):
        log.info("building the CPU attention kernel in a child process while the weights load")
    from kernels_pallas import project_cpu

    if project_cpu.applies(meta.dtype):  # where the runner loads it
        project_cpu.prepare()


def cache_config(args: EngineArgs, cfg) -> CacheConfig:
    """The runner's CacheConfig for `args` and the loaded model's config."""
    max_model_len = args.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's context length {cfg.max_position_embeddings}"
        )
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, cfg.dtype, jax.default_backend())
    max_num_seqs, max_num_batched_tokens = batch_limits(args.max_num_seqs, args.max_num_batched_tokens,
                                                        jax.default_backend())  # fmt: skip
    return CacheConfig(
        block_size=args.block_size,
        num_pages=-(-args.num_kv_tokens // args.block_size) if args.num_kv_tokens else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=parse_bytes(args.kv_cache_memory),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        max_logprobs=args.max_logprobs,
        kv_cache_dtype=None if kv_dtype == cfg.dtype else kv_dtype,
        session_ttl=args.session_ttl,
        session_cache_pages=args.session_cache_pages,
        host_kv_cache_memory=parse_size(args.host_kv_cache_memory, "host_kv_cache_memory"),
        layer_loop=args.layer_loop,
    )


def _load(model: str | nnx.Module, tokenizer: Tokenizer | str | None, dtype: str, mesh, dp: int) -> tuple:
    """(config, params or user module, tokenizer) for a model name/path, a user module or an entry point."""
    if isinstance(model, str) and not is_entry_point(model):
        tokenizer = _tokenizer(tokenizer)  # given: the model's own is not read (it may have none)
        mesh0 = replica_meshes(mesh)[0] if mesh is not None else None
        loaded = load_model(model, dtype=dtype, with_tokenizer=tokenizer is None, mesh=mesh0)
        tokenizer = tokenizer or loaded.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {model!r} has no tokenizer")
        return loaded.config, loaded.params, tokenizer
    module, built_tokenizer = load_entry_point(model) if isinstance(model, str) else (model, None)
    cfg = check_model(module)  # raises naming the missing part of the protocol
    if dtype not in ("auto", cfg.dtype):
        raise ValueError(
            f"dtype: {dtype!r}, but a module of your own runs in the dtype of its arrays (its config.dtype is "
            f"{cfg.dtype!r}, the KV cache's): cast its parameters and set config.dtype, or leave dtype 'auto'"
        )
    tokenizer = _tokenizer(tokenizer or built_tokenizer)
    if tokenizer is None:
        # Said for the Python API and the command line alike: the same module may be served or run offline.
        raise ValueError(
            "tokenizer: a user model needs one: LLM(my_module, tokenizer=NAME_OR_PATH), --tokenizer NAME_OR_PATH"
            " (e.g. smollm2-135m-instruct), or a build() that returns (module, tokenizer)"
        )
    if tokenizer.vocab_size > cfg.vocab_size:  # allowed (a model trained on a prefix of a tokenizer's ids), but
        # a text can then encode to ids the model has no row for, and those requests are refused
        log.warning("the tokenizer has %d tokens, more than the model's config.vocab_size=%d: a prompt holding ids "
                    "past %d is refused", tokenizer.vocab_size, cfg.vocab_size, cfg.vocab_size - 1)  # fmt: skip
    if dp > 1:
        raise ValueError("data_parallel_size: not supported for user models yet (tensor parallelism is)")
    if mesh is not None:
        module = place_module(cfg, module, mesh)
    return cfg, module, tokenizer


def _tokenizer(tokenizer: Tokenizer | str | os.PathLike | None) -> Tokenizer | None:
    if isinstance(tokenizer, str | os.PathLike):
        try:
            path = resolve_model_path(os.fspath(tokenizer))
        except ModelNotFoundError as e:  # it said "model path '/x' does not exist" of the tokenizer flag's path
            raise ModelNotFoundError(f"tokenizer: {e}") from None
        return load_tokenizer(path)
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer: expected a model name or path (or a jaxinfer.tokenizer.Tokenizer), got "
            f"{type(tokenizer).__name__}"
        )
    return tokenizer
