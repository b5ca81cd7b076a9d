"""The offline API for research code and notebooks, shaped like vLLM's:

    from jaxinfer import LLM, SamplingParams
    with LLM("smollm2-135m-instruct") as llm:
        outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32, temperature=0.8, seed=0))
        print(outs[0].outputs[0].text)

`close()` (or leaving the `with` block) frees every device buffer the model held, so a notebook can load another
model without restarting.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from tqdm.auto import tqdm

from jaxinfer.cache.sizing import parse_bytes, parse_size
from jaxinfer.device import check_device, resolve_kv_cache_dtype
from jaxinfer.engine.dp import DataParallelEngine, replica_meshes
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.output import OutputAccumulator, OutputProcessor
from jaxinfer.engine.runner import CacheConfig, enable_compilation_cache
from jaxinfer.model.protocol import check_model, is_entry_point, load_entry_point
from jaxinfer.model_files import DEFAULT_MODEL, resolve_model_path
from jaxinfer.sharding import make_mesh, place_module
from jaxinfer.tokenizer import Tokenizer, load_tokenizer
from jaxinfer.types import RequestOutput, SamplingParams
from jaxinfer.weights import load_model

PromptType = str | list[int] | dict[str, Any]


def build_engine(
    model: str | nnx.Module = DEFAULT_MODEL,
    *,
    tokenizer: Tokenizer | str | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    device: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    num_kv_tokens: int | None = None,
    gpu_memory_utilization: float = 0.5,
    kv_cache_memory: int | str | None = None,
    enable_prefix_caching: bool = True,
    max_logprobs: int = 20,
    seed: int | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    attn_impl: str | None = None,
    compilation_cache: bool | str = True,
    overlap_scheduling: bool = True,
    session_ttl: float = 300.0,
    session_cache_pages: int | None = None,
    host_kv_cache_memory: int | str | None = None,
) -> tuple[Engine | DataParallelEngine, Tokenizer]:
    """The engine and tokenizer behind `LLM` and the server, from vLLM-named settings. `compilation_cache` may
    be a directory for jax's persistent compilation cache. `overlap_scheduling` dispatches each step before the
    previous one's tokens are read on the host (same outputs; turn it off to debug the plain loop). `dtype` "auto"
    is float32 on CPU and the checkpoint's half precision (or bfloat16) on GPU/TPU; `kv_cache_dtype` "auto" follows
    it. `device` ("auto", "cpu", "gpu", "tpu"; default $JAXINFER_DEVICE, else what $JAX_PLATFORMS asks for) raises
    `jaxinfer.device.DeviceUnavailableError` when jax initialised another backend.
    `kv_cache_memory` caps the KV pool's bytes per device (an int, or text like "4GiB"); see jaxinfer.cache.sizing
    for the defaults (on CPU: what the scheduler can address, at most 1.5 GiB).
    A request whose SamplingParams name a `session_id` keeps its pages pinned when it ends, for `session_ttl`
    seconds, so the conversation's next turn prefills only what is new; all sessions together pin at most
    `session_cache_pages` pages (default a quarter of the pool; 0 turns sessions off). `host_kv_cache_memory` (bytes
    or text like "8GiB"; default 1 GiB on GPU/TPU, off on CPU; 0: off) keeps prefix pages the pool gives up in host
    memory and copies them back on a hit (jaxinfer.cache.host_tier).
    `model` may also be your own nnx.Module following jaxinfer.model.protocol, or `"my_pkg.my_module:build"`
    naming a function that returns one (or (module, tokenizer)); `tokenizer` (a Tokenizer, or a model name or path
    to read one from) is then required, and overrides the model's own otherwise."""
    check_device(device)
    if compilation_cache:
        # A second start then restores the compiled steps instead of compiling them again.
        enable_compilation_cache(compilation_cache if isinstance(compilation_cache, str) else None)
    mesh = None
    if tensor_parallel_size > 1 or data_parallel_size > 1 or jax.process_count() > 1:
        if data_parallel_size > 1 and jax.process_count() > 1:
            raise ValueError("data_parallel_size: data parallelism across processes is not supported")
        mesh = make_mesh(tensor_parallel_size, data_parallel_size)
    cfg, params, tokenizer = _load(model, tokenizer, dtype, mesh, data_parallel_size)
    max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's context length {cfg.max_position_embeddings}"
        )
    cache = CacheConfig(
        page_size=block_size,
        num_pages=-(-num_kv_tokens // block_size) if num_kv_tokens else None,
        memory_fraction=gpu_memory_utilization,
        kv_cache_memory=parse_bytes(kv_cache_memory),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(256, max_num_seqs),
        enable_prefix_cache=enable_prefix_caching,
        max_logprobs=max_logprobs,
        kv_cache_dtype=None if kv_cache_dtype in (None, "auto") else resolve_kv_cache_dtype(kv_cache_dtype, cfg.dtype),
        session_ttl=session_ttl,
        session_cache_pages=session_cache_pages,
        host_kv_cache_memory=parse_size(host_kv_cache_memory, "host_kv_cache_memory"),
    )
    eos = tokenizer.eos_token_ids
    if data_parallel_size > 1:
        return DataParallelEngine(cfg, params, mesh, cache, eos, attn_impl, seed, overlap_scheduling), tokenizer
    engine = Engine(cfg, params, cache, eos, attn_impl, seed, mesh, overlap_scheduling)
    if jax.process_count() > 1:
        from jaxinfer.distributed import attach_followers

        attach_followers(engine.runner)  # the lead broadcasts every step; followers run `distributed.follow`
    return engine, tokenizer


def _load(model: str | nnx.Module, tokenizer: Tokenizer | str | None, dtype: str, mesh, dp: int) -> tuple:
    """(config, params or user module, tokenizer) for a model name/path, a user module or an entry point."""
    if isinstance(model, str) and not is_entry_point(model):
        loaded = load_model(model, dtype=dtype, mesh=replica_meshes(mesh)[0] if mesh is not None else None)
        tokenizer = _tokenizer(tokenizer) or loaded.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {model!r} has no tokenizer")
        return loaded.config, loaded.params, tokenizer
    module, built_tokenizer = load_entry_point(model) if isinstance(model, str) else (model, None)
    cfg = check_model(module)  # raises naming the missing part of the protocol
    tokenizer = _tokenizer(tokenizer or built_tokenizer)
    if tokenizer is None:
        raise ValueError("tokenizer: a user model needs one, e.g. LLM(my_module, tokenizer='smollm2-135m-instruct')")
    if dp > 1:
        raise ValueError("data_parallel_size: not supported for user models yet (tensor parallelism is)")
    if mesh is not None:
        module = place_module(cfg, module, mesh)
    return cfg, module, tokenizer


def _tokenizer(tokenizer: Tokenizer | str | None) -> Tokenizer | None:
    return load_tokenizer(resolve_model_path(tokenizer)) if isinstance(tokenizer, str) else tokenizer


class LLM:
    def __init__(self, model: str | nnx.Module = DEFAULT_MODEL, *, warmup: bool = False, **settings: Any):
        """`model`: a preset, a GGUF file, an HF directory, a checkpoint, or your own nnx.Module (see
        jaxinfer.model.protocol; pass `tokenizer=` with it). `settings` are `build_engine`'s: tokenizer, dtype,
        kv_cache_dtype, device, max_model_len, max_num_seqs, max_num_batched_tokens, block_size, num_kv_tokens,
        gpu_memory_utilization, kv_cache_memory,
        enable_prefix_caching, max_logprobs, seed, tensor_parallel_size, data_parallel_size, attn_impl,
        compilation_cache, overlap_scheduling, session_ttl, session_cache_pages, host_kv_cache_memory."""
        self.model = model
        self.engine, self.tokenizer = build_engine(model, **settings)
        self.processor = OutputProcessor(self.tokenizer)
        self._counter = 0
        self.warmup_seconds = None
        if warmup:
            from jaxinfer.startup import warm_up

            self.warmup_seconds = warm_up(self.engine).seconds

    def _replicas(self) -> list[Engine]:
        return getattr(self.engine, "replicas", [self.engine])

    # ------------------------------------------------------------------------------------------ API

    def get_tokenizer(self):
        return self.tokenizer

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("prompts: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompts: expected text, a list of token ids or a dict, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt (continuously batched); outputs in prompt order."""
        if self.engine is None:
            raise RuntimeError("this LLM is closed")
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        sampling_params = sampling_params or SamplingParams()
        plist = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(plist) != len(prompts):
            raise ValueError(f"sampling_params: got {len(plist)} for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt does not leave the others half-submitted.
        items = []
        for p, sp in zip(prompts, plist, strict=True):
            text, ids = self._prompt_ids(p)
            items.append((text, self.engine.validate(ids, sp), sp))
        rids = []
        for text, ids, sp in items:
            rid = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(ids, sp, rid)
            self.processor.add(rid, text, ids, sp)
            rids.append(rid)
        return self._run(rids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, through the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            # The template already holds BOS where the model wants it.
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, rids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wholes = {rid: OutputAccumulator() for rid in rids}  # the processor's outputs are deltas
        pending = set(rids)
        bar = tqdm(total=len(rids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            while pending:
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"engine stopped with {len(pending)} requests unfinished")
                outs, to_stop = self.processor.process(self.engine.step())
                for sid, reason in to_stop:
                    self.engine.finish_sequence(sid, "stop", reason)
                for out in outs:
                    if out.request_id not in pending:
                        continue
                    wholes[out.request_id].add(out)
                    if out.finished:
                        final[out.request_id] = wholes.pop(out.request_id).result()
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for rid in pending:  # an interrupted call (Ctrl-C in a notebook) must not leave pages behind
                self.engine.abort(rid)
                self.processor.forget(rid)
            raise
        finally:
            bar.close()
        return [final[r] for r in rids]

    # ------------------------------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Frees the weights, the KV pools and the compiled steps. The object cannot generate afterwards."""
        if self.engine is None:
            return
        self.engine.release_sessions()
        for e in self._replicas():
            if e.host is not None:
                e.host.clear()
            for x in jax.tree.leaves((e.runner.params, e.runner.kv)):
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
            e.runner.params = e.runner.kv = None
        self.engine = None
        jax.clear_caches()
        gc.collect()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
