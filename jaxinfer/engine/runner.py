"""The model runner: owns the device KV pools and the compiled steps, one per shape bucket.

Only this module moves data between host and device. Two kinds of compiled step:
- decode: every sequence brings exactly one token (T == S), attention by `paged_decode_attention`;
- mixed: prefill chunks and decodes packed on one token axis, attention by `ragged_paged_attention`.
Both write the new K/V into the donated pools in place and sample on device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import kernels_pallas
from jaxinfer.cache.sizing import PoolSize, page_bytes_per_device, size_kv_pool
from jaxinfer.config import CUSTOM_ARCH, ModelConfig
from jaxinfer.device import attention_query_dtype
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.exec_cache import ExecutableCache, default_folder, jax_cache_dir, remove_jax_entries
from jaxinfer.engine.grammar import mask_words
from jaxinfer.engine.kv_copy import PageCopier
from jaxinfer.engine.timeline import StepTimeline
from jaxinfer.engine.transfer import Layout, from_flat, to_flat
from jaxinfer.host_memory import release_freed_memory
from jaxinfer.model import layers
from jaxinfer.model.functional import ModelDef, split_model
from jaxinfer.model.scanned import ScannedTransformer, scan_unsupported
from jaxinfer.model.transformer import Params
from jaxinfer.sampling import (
    RowSampling,
    SampleOutput,
    SamplingTensors,
    build_sampling_tensors,
    compute_logprobs,
    needs_advanced,
    sample,
    target_ranks,
)
from jaxinfer.sharding import KV_POOL_AXES, MODEL, device_buffers, spec
from jaxinfer.step import StepInputs, StepPacker, bucket_table, pack, pick_bucket
from kernels_pallas import project_cpu

log = logging.getLogger(__name__)

# Per layer: (k, v) f[num_pages, page_size, W] (kernels_pallas.pool_shape: a token's heads side by side in one row,
# W = Hkv * Dh, padded to whole 128-lane rows on a TPU); with the scanned layer loop one pair for all layers, the
# layers stacked on the page axis: f[num_layers * num_pages, page_size, W] (layer i's pages start at i * P).
KVPools = list[tuple[jax.Array, jax.Array]]


# ---------------------------------------------------------------------------------------------- compile tracking

_compile_count = 0
_compile_lock = threading.Lock()


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _compile_count
    if event == "/jax/core/compile/backend_compile_duration":
        with _compile_lock:
            _compile_count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Backend compilations in this process so far (any jitted function): a steady workload adds none."""
    return _compile_count


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turns on jax's persistent compilation cache, and with it the executable cache, under the folder `path`, so a
    restart reuses compiled steps. jax's entries live in the executable cache's version folder
    (`jax_cache_dir`): after an upgrade the steps compile once and are stored again."""
    default = default_folder()
    path = Path(path or os.environ.get("JAXINFER_COMPILE_CACHE", default))
    jax_dir = jax_cache_dir(path)
    jax_dir.mkdir(parents=True, exist_ok=True)
    if path == default:  # jaxinfer's own folder: jax's entries of the layout before version folders are dead
        try:
            remove_jax_entries(path)
        except OSError as e:  # a clean-up: never a reason not to start
            log.warning("compilation cache: cannot delete jax's old entries in %s (%s)", path, e)
    jax.config.update("jax_compilation_cache_dir", str(jax_dir))
    # NOTE: on CPU nothing is written unless the threshold is 0 (compiles there are fast but still add up).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path


# ---------------------------------------------------------------------------------------------- the step


def _paged_attend(
    cfg: ModelConfig, inp: StepInputs, decode_only: bool, impl: str | None, mesh: Mesh | None, stacked: bool = False
):
    def layer_attention(window: int, q, k, v, kp, vp, slots, table, ctx, qsl, nseq):
        """q f[T, H, Dh]; k, v f[T, Hkv, Dh]; kp, vp f[P, page, W] -> (out f[T, H, Dh], kp, vp)."""
        if slots.shape[0] == 1:
            # XLA rewrites a one-row scatter (a batch-1 decode) as a dynamic-update-slice, and then copied whole
            # pools every layer (tests/engine/test_layer_loop.py): a second, dropped row keeps it a scatter, in place.
            k, v = (jnp.concatenate([a, jnp.zeros_like(a)]) for a in (k, v))
            slots = jnp.concatenate([slots, jnp.full((1,), -1, slots.dtype)])
        kp, vp = kernels_pallas.write_kv(kp, vp, k, v, slots)
        opts = dict(scale=cfg.scale, sliding_window=window, soft_cap=cfg.attn_logit_softcap, impl=impl)
        qk = q.astype(attention_query_dtype(q.dtype.name, kp.dtype.name, jax.default_backend()))
        opts["num_kv_heads"] = k.shape[1]  # the pools are stored rows (per shard under tensor parallelism)
        if decode_only:
            out = kernels_pallas.paged_decode_attention(qk, kp, vp, table, ctx, **opts)
        else:
            out = kernels_pallas.ragged_paged_attention(qk, kp, vp, table, ctx, qsl, nseq, **opts)
        return out.astype(q.dtype), kp, vp

    def attend_stacked(i: jax.Array, q, k, v, pools, /):
        """The scanned layer loop: `i` is the traced layer index, `pools` the (k, v) pools of every layer stacked on
        the page axis, f[L * P, page, W]: layer i's pages are i*P .. i*P + P-1, so the kernels and the
        in-place K/V write run unchanged on offset page ids and slots. (Stored flat: a reshape to and from
        [L, P, ...] inside the loop made XLA copy the whole pool.)"""
        kp, vp = pools
        num_pages, page_size = kp.shape[0] // cfg.num_layers, kp.shape[1]
        slots = jnp.where(inp.slot_mapping >= 0, inp.slot_mapping + i * (num_pages * page_size), -1)
        out, kp, vp = layer_attention(cfg.layer_windows[0], q[0], k[0], v[0], kp, vp, slots,
                                      inp.page_table + i * num_pages, inp.context_lens, inp.query_start_loc,
                                      inp.num_seqs)  # fmt: skip
        return out[None], (kp, vp)

    if stacked:
        return attend_stacked

    def attend(i: int, q, k, v, pools, /):
        fn = partial(layer_attention, cfg.layer_windows[i])
        if mesh is not None and mesh.shape[MODEL] > 1:
            # Heads are independent: each model shard attends with its own query heads over its own KV heads
            # (kernels run per shard; Pallas inside shard_map needs check_vma=False).
            heads, pool, rep = P(None, MODEL, None), P(None, None, MODEL), P()
            fn = jax.shard_map(
                fn, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, rep, rep, rep, rep, rep),
                out_specs=(heads, pool, pool), check_vma=False,
            )  # fmt: skip
        out, kp, vp = fn(q[0], k[0], v[0], pools[0], pools[1], inp.slot_mapping, inp.page_table, inp.context_lens,
                         inp.query_start_loc, inp.num_seqs)  # fmt: skip
        return out[None], (kp, vp)

    return attend


# The step's static arguments (a compiled program per combination); the rest are traced (see `Runner._dynamic`).
STEP_STATIC_ARGS = ("model_def", "cfg", "layout", "decode_only", "advanced", "num_logprobs", "impl", "mesh",
                    "prompt_logprobs")  # fmt: skip


@partial(jax.jit, static_argnames=STEP_STATIC_ARGS, donate_argnames=("kv",))
def paged_step(
    model_def: ModelDef,
    weights: list[jax.Array],
    cfg: ModelConfig,
    kv: KVPools,
    feed: jax.Array,
    flat: tuple[jax.Array, jax.Array],
    layout: Layout,
    decode_only: bool,
    advanced: bool,
    num_logprobs: int | None,
    impl: str | None = None,
    mesh: Mesh | None = None,
    prompt_logprobs: bool = False,
) -> tuple[SampleOutput, tuple | None, KVPools, jax.Array]:
    """One engine step: forward over the packed tokens, then one sampled token per sequence, on device.

    `feed` i32[max_num_seqs] holds the previous step's sampled tokens. A token id `-(i + 2)` in the inputs (token
    ids, and the penalty history) is a placeholder for row i's token of that step: with overlap scheduling the host
    dispatches this step before it has read them. Returns the new feed (this step's tokens, padded).
    With prompt_logprobs, also (logprob of target, top ids, top logprobs, rank of target) for every packed token:
    a separate program (compiled on first use) since it computes logits for all T tokens, not just S.
    The StepInputs and SamplingTensors arrive as `flat` buffers (see jaxinfer.engine.transfer).
    The model arrives split (jaxinfer.model.functional): merged here, at trace time, from its weight leaves."""
    model = model_def.merge(weights)
    inp, st = from_flat(flat, layout)
    token_ids = resolve_placeholders(inp.token_ids, feed)
    if advanced:
        st = dataclasses.replace(st, history=resolve_placeholders(st.history, feed),
                                 recent_output=resolve_placeholders(st.recent_output, feed))  # fmt: skip
    stacked = isinstance(model, ScannedTransformer)  # one pool pair for all layers, carried through the loop
    attend = _paged_attend(cfg, inp, decode_only, impl, mesh, stacked)
    # Over several devices the projections take XLA's dots: GSPMD would gather every kernel for a custom call.
    multi_device = mesh is not None and mesh.size > 1
    sharded = layers.sharded_step if multi_device else contextlib.nullcontext
    with sharded():
        hidden, kv = model(token_ids[None], inp.positions[None], kv[0] if stacked else kv, attend)
        lg = model.logits(hidden[0][inp.logits_indices])  # f32[S, V]
    kv = [kv] if stacked else kv
    if mesh is not None:
        # Gather the vocab-sharded logits; every device samples the same rows ([S, V] is small next to the weights).
        lg = jax.lax.with_sharding_constraint(lg, NamedSharding(mesh, P()))
    prompt_lp = None
    if prompt_logprobs:
        with sharded():
            lg_all = model.logits(hidden[0])  # f32[T, V]
        targets = jnp.maximum(inp.target_ids, 0)
        prompt_lp = (*compute_logprobs(lg_all, targets, num_logprobs or 0), target_ranks(lg_all, targets))
    out = sample(lg, st, advanced=advanced, num_logprobs=num_logprobs)
    return out, prompt_lp, kv, feed.at[: out.token_ids.shape[0]].set(out.token_ids)


def placeholder(row: int) -> int:
    """The token id that stands for row `row`'s sampled token of the step in flight (see `paged_step`)."""
    return -(row + 2)


def resolve_placeholders(ids: jax.Array, feed: jax.Array) -> jax.Array:
    """Replaces placeholders (ids <= -2) by the fed tokens; real ids and -1 padding pass through."""
    return jnp.where(ids <= -2, feed[jnp.clip(-ids - 2, 0, feed.shape[0] - 1)], ids)


# ---------------------------------------------------------------------------------------------- runner


# The layer loop "auto" picks, per backend, measured (benchmarks/README.md, layer loop): on XLA:CPU a scan ran the
# same step time as unrolled layers, compiled 5-6x faster and loaded a serialized step 30x faster; on an H100 a scan
# over stacked weights ran 3.2x slower (../shared/ANCHORS.md). TPU: unmeasured, unrolled as on GPU.
AUTO_LAYER_LOOP = {"cpu": "scan", "gpu": "unroll", "tpu": "unroll"}


def choose_layer_loop(requested: str, cfg: ModelConfig, mesh: Mesh | None, backend: str) -> tuple[str, str]:
    """("scan" or "unroll", why). An explicit "scan" the model or mesh cannot run raises ValueError."""
    reason = scan_unsupported(cfg)
    if reason is None and mesh is not None:
        reason = "the stacked pools are not sharded over a mesh yet"
    if requested == "scan":
        if reason is not None:
            raise ValueError(f"layer_loop='scan' is not available for this engine: {reason}")
        return "scan", "asked for"
    if requested == "unroll":
        return "unroll", "asked for"
    auto = AUTO_LAYER_LOOP.get(backend, "unroll")
    if auto == "scan" and reason is not None:
        return "unroll", f"auto; cannot scan: {reason}"
    return auto, f"auto on {backend}"


def kv_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str | None = None) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(kv_cache_dtype or cfg.dtype).itemsize


def pool_shape(cfg: ModelConfig, num_pages: int, page_size: int, mesh: Mesh | None = None,
               backend: str | None = None) -> tuple[int, int, int]:  # fmt: skip
    """One layer's K (or V) pool as this backend stores it (kernels_pallas.pool_shape), split by KV heads over the
    mesh's model axis."""
    lanes = kernels_pallas.POOL_LANE_MULTIPLE.get(backend or jax.default_backend(), 1)
    shards = mesh.shape[MODEL] if mesh is not None else 1
    return kernels_pallas.pool_shape(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, lanes, shards)


def _free_bytes(devices: list) -> list[int]:
    """Free memory of each device; CPU devices report none, so each gets an equal share of the host's available
    memory (forced host devices all live in it)."""
    out = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            import psutil

            return [int(psutil.virtual_memory().available) // max(1, len(jax.local_devices()))] * len(devices)
        out.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return out


def size_pool(cfg: ModelConfig, cc: CacheConfig, mesh: Mesh | None = None) -> PoolSize:
    """Number of pages of this runner's pool and why: explicit, else `jaxinfer.cache.sizing.size_kv_pool` over the
    devices that hold it (the replica's mesh), with a page's bytes on one device (KV heads split over `model`)."""
    if cc.num_pages is not None:
        return PoolSize(cc.num_pages, "num_pages / num_kv_tokens given explicitly")
    devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    kv_shards = mesh.shape[MODEL] if mesh is not None else 1
    itemsize = jnp.dtype(cc.kv_cache_dtype or cfg.dtype).itemsize
    lanes = kernels_pallas.POOL_LANE_MULTIPLE.get(devices[0].platform, 1)  # a stored row's padding (pool_shape)
    page_bytes = page_bytes_per_device(
        cc.block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, itemsize, kv_shards, lanes
    )
    return size_kv_pool(
        backend=devices[0].platform, page_bytes=page_bytes, page_size=cc.block_size, max_num_seqs=cc.max_num_seqs,
        max_model_len=cc.max_model_len, free_bytes_per_device=_free_bytes(devices),
        gpu_memory_utilization=cc.gpu_memory_utilization, budget=cc.kv_cache_memory,
    )  # fmt: skip


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params | nnx.Module,
        cache: CacheConfig,
        attn_impl: str | None = None,
        mesh: Mesh | None = None,
        donate_params: bool = False,
    ):
        """`params`: a family's nnx state, or any module following jaxinfer.model.protocol. On a mesh, it must
        already be placed on it (see jaxinfer.weights.load_weights(mesh=...)) and `cfg` be the config it fits.
        `donate_params`: the caller gives `params` up; arrays the runner copies into its own layout are deleted
        (`ScannedTransformer(donate=True)`)."""
        self.cfg, self.cc, self.attn_impl, self.mesh = cfg, cache, attn_impl, mesh
        # The caller's buffers, which `release` must not delete: the runner's weights share them where it made no
        # copy (`device_put` onto the device they are on returns a new array over the same buffer).
        self._borrowed = frozenset() if donate_params else device_buffers(params)
        sized = size_pool(cfg, cache, mesh)
        self.num_pages = sized.num_pages
        self.followers = None  # a jaxinfer.distributed.Followers on the lead process of a multi-process mesh
        self.timeline: StepTimeline | None = None  # set to record when each step ran (benchmarks, metrics)
        self.packer = StepPacker(cache.pages_per_seq, cache.block_size, cache.max_num_seqs)
        if jax.process_count() > 1:
            from jaxinfer.distributed import agree_on

            self.num_pages = agree_on(self.num_pages)  # free memory differs between hosts; the pools may not
        shape = pool_shape(cfg, self.num_pages, cache.block_size, mesh)
        self.layer_loop, why_loop = choose_layer_loop(cache.layer_loop, cfg, mesh, jax.default_backend())
        if self.layer_loop == "scan":
            shape = (cfg.num_layers * shape[0], *shape[1:])  # one pool pair for all layers, carried through the loop
        log.info("layer loop: %s (%s)", self.layer_loop, why_loop)
        self.model_def, self.weights = self._lay_out(params, donate_params)
        if mesh is None:
            self._replicated = jax.devices()[0]
            pool = SingleDeviceSharding(jax.devices()[0])
        else:
            self._replicated = NamedSharding(mesh, P())
            pool = NamedSharding(mesh, spec(KV_POOL_AXES, mesh))
        self.params = self.model_def.state(self.weights)  # the same arrays as the step's nnx state (close)
        kv_dtype = jnp.dtype(cache.kv_cache_dtype or cfg.dtype)
        zeros = jax.jit(lambda: jnp.zeros(shape, kv_dtype), out_shardings=pool)
        self._fresh_kv = lambda: [(zeros(), zeros()) for _ in range(1 if self.layer_loop == "scan" else cfg.num_layers)]
        self.kv: KVPools = self._fresh_kv()
        # One page's bytes in the pools as allocated: every layer's K and V, each stored row's padding included
        # (rows pad to 128 lanes on TPU, where `kv_bytes_per_token` counts the model's KV heads only). A page copied
        # to the host tier takes as much.
        self.page_bytes = sum(a.nbytes for a in jax.tree.leaves(self.kv)) // self.num_pages
        # The last step's sampled tokens, kept on device for the next step's placeholders (overlap scheduling).
        # Every process of a multi-process mesh runs the same steps, so each keeps the same feed.
        self.feed = self._fresh_feed()
        self.buckets = bucket_table(jax.default_backend(), cache.max_num_seqs, cache.max_num_batched_tokens)
        self.seq_buckets, self.token_buckets = self.buckets.seq_buckets, self.buckets.token_buckets
        # Serialized compiled steps (None: off): a warm start skips tracing and lowering. See exec_cache.
        self.exec_cache = ExecutableCache.from_jax_config()
        if project_cpu.applies(cfg.dtype):
            # A loaded step may call the CPU projection kernel (layers.project): XLA resolves its FFI target when
            # the step loads, and a warm start traces nothing that would register it first. The checks of the
            # library's orders that pick `project`'s forms compile their own small programs: here, not mid-warm-up.
            project_cpu.unavailable()
            if mesh is None or mesh.size == 1:  # over several devices `project` takes XLA's dots only
                layers.probe_cpu_forms()
        self._compiled: dict[tuple, Callable] = {}
        # Step variants `warmup(defer=True)` left for `compile_deferred` (its combos, in compile order).
        self.deferred: list[tuple] = []
        self.copier: PageCopier | None = None  # page copies to and from host memory (enable_page_copies)
        log.info(
            "KV pool: %d pages x %d tokens = %d tokens (%.1f MiB in all); up to %d sequences of %d tokens. "
            "Chosen: %s",
            self.num_pages, cache.block_size, self.num_pages * cache.block_size,
            self.num_pages * self.page_bytes / 2**20,
            cache.max_num_seqs, cache.max_model_len, sized.reason,
        )  # fmt: skip
        self._log_startup(kv_dtype.name)

    def _log_startup(self, kv_dtype: str) -> None:
        """Backend, devices, mesh and the attention implementation each step kind will use (and why a kernel
        declined), so a run on the wrong device or on the jnp reference is visible in the first lines."""
        from jaxinfer.device import describe_attention, describe_devices

        tp = 1 if self.mesh is None else self.mesh.shape[MODEL]
        log.info("%s; model dtype %s, KV cache dtype %s", describe_devices(self.mesh), self.cfg.dtype, kv_dtype)
        log.info(
            "%s",
            describe_attention(
                self.cfg.num_heads // tp, self.cfg.num_kv_heads // tp, self.cfg.head_dim, kv_dtype,
                attention_query_dtype(self.cfg.dtype, kv_dtype, jax.default_backend()), self.num_pages,
                self.cc.block_size, self.cc.max_num_seqs, self.cc.max_num_batched_tokens, self.attn_impl,
                self.cc.pages_per_seq,
            ),
        )  # fmt: skip

    def _lay_out(self, params: Params | nnx.Module, donate: bool) -> tuple[ModelDef, list[jax.Array]]:
        """The steps' (ModelDef, flat weight list) for `params`: stacked for the scanned layer loop, committed to the
        device. Split once: the steps take the weights as a flat list and merge inside (jaxinfer.model.functional)."""
        if self.layer_loop == "scan":
            from jaxinfer.model.transformer import merge

            model = params if isinstance(params, nnx.Module) else merge(self.cfg, params)
            params = ScannedTransformer(model, donate=donate)
            if donate:
                release_freed_memory()  # the deleted arrays' heap back to the OS before the pool is allocated
        model_def, weights = split_model(self.cfg, params)
        if self.mesh is None:
            # NOTE: arrays are committed to the device up front. A step's outputs are committed, and jit keys its
            # cache on committedness, so uncommitted first inputs would compile every bucket a second time.
            weights = jax.device_put(weights, jax.devices()[0])
        return model_def, weights

    def update_weights(self, params: Params | nnx.Module) -> None:
        """Runs the next steps on `params`: the same model with new values (a module after training steps, say), of
        the same structure, shapes, dtypes and placement, so every compiled step still fits. On a mesh a user module
        is placed from its logical axes; a family's state must already be placed (jaxinfer.weights.load_weights)."""
        if self.mesh is not None and isinstance(params, nnx.Module):
            from jaxinfer.sharding import place_module

            params = place_module(self.cfg, params, self.mesh)
        borrowed = device_buffers(params)
        model_def, weights = self._lay_out(params, donate=False)
        if (model_def.graphdef, model_def.treedef) != (self.model_def.graphdef, self.model_def.treedef):
            raise ValueError("update_weights: the new weights are not the engine's model (its modules or state differ)")
        for path, old, new in zip(jax.tree_util.tree_leaves_with_path(self.params), self.weights, weights, strict=True):
            if (old.shape, old.dtype, old.sharding) != (new.shape, new.dtype, new.sharding):
                raise ValueError(
                    f"update_weights: {jax.tree_util.keystr(path[0])} is {new.dtype}{list(new.shape)} on "
                    f"{new.sharding}, the engine's is {old.dtype}{list(old.shape)} on {old.sharding}"
                )
        self._delete_owned(self.weights)  # the old values the runner copied, not the caller's
        self.weights, self._borrowed = weights, borrowed
        self.params = self.model_def.state(weights)

    def _fresh_feed(self) -> jax.Array:
        return jax.device_put(np.zeros(self.cc.max_num_seqs, np.int32), self._replicated)

    def pools_lost(self) -> bool:
        """Whether the KV pools or the feed are gone: a step donated them, and an interrupt (Ctrl-C) struck before
        the runner kept the step's outputs."""
        return any(x.is_deleted() for x in jax.tree.leaves((self.kv, self.feed)))

    def reset_pools(self) -> None:
        """Fresh (zero) KV pools and feed, in place of lost ones: what they held is gone (callers drop it too)."""
        for x in jax.tree.leaves((self.kv, self.feed)):
            if not x.is_deleted():
                x.delete()
        self.kv, self.feed = self._fresh_kv(), self._fresh_feed()

    def release(self) -> None:
        """Deletes the device arrays the runner owns (KV pools, step feed, the weights it loaded or copied) and drops
        the rest: a caller's own module or weights stay usable. The runner cannot run steps afterwards."""
        self._delete_owned((self.params, self.weights, self.kv, self.feed))
        self.params = self.weights = self.kv = self.feed = None
        self._compiled.clear()

    def _delete_owned(self, tree: object) -> None:
        """Deletes the arrays of `tree` the runner owns: not those over a caller's buffers (`_borrowed`)."""
        for x in jax.tree.leaves(tree):
            if isinstance(x, jax.Array) and not x.is_deleted() and not device_buffers(x) & self._borrowed:
                x.delete()

    def family_params(self) -> Params:
        """The weights in the built-in family's own layout (`jaxinfer.model.transformer`), for the reference paths
        that run the unrolled model on a contiguous cache (a copy when the layers are stacked for the scan)."""
        if self.layer_loop == "scan":
            return self.model_def.merge(self.weights).unstacked_state()
        return self.params

    def enable_page_copies(self) -> None:
        """Sets up (and `warmup` then compiles) the page gather/scatter programs the host tier uses."""
        if self.copier is None:
            self.copier = PageCopier(
                self.kv, self.num_pages, self.cc.pages_per_seq, self._replicated, self.cfg.num_layers
            )

    def gather_pages(self, pages: list[int]) -> list:
        """Starts copying pages out of the pools (before any later step overwrites them); read with `pages_to_host`."""
        return self.copier.gather(self.kv, pages)

    @staticmethod
    def pages_to_host(pieces: list) -> list[np.ndarray]:
        return PageCopier.to_host(pieces)

    def scatter_pages(self, pages: list[int], blocks: list[np.ndarray]) -> None:
        """Writes host blocks into pages of the pools, before the next step reads them."""
        self.kv = self.copier.scatter(self.kv, pages, blocks)

    @property
    def num_kv_tokens(self) -> int:
        return self.num_pages * self.cc.block_size

    def bucket_for(
        self, num_seqs: int, num_tokens: int, prompt_logprobs: bool = False, advanced: bool = False
    ) -> tuple[bool, int, int]:
        """(decode_only, T, S) of the compiled step that serves this batch. A step that scores prompt tokens is a
        mixed one even when every row brings one token (a prompt's last chunk of one): the variants that score
        prompt tokens exist for the mixed buckets only, 12 programs fewer to compile at start-up. A mixed step runs
        on the fewest rows its token bucket compiles for (`BucketTable.mixed_rows`), except with the rarer sampling
        variants (`advanced`, prompt logprobs), which exist for the most rows only, and while warm-up's deferred
        list still holds the fewer-row program: its most-rows twin is compiled."""
        if num_tokens == num_seqs and not prompt_logprobs:
            s = pick_bucket(num_seqs, self.seq_buckets)
            return True, s, s
        t = pick_bucket(num_tokens, self.token_buckets)
        rows = self.buckets.mixed_rows(t)
        s = pick_bucket(num_seqs, rows)
        if advanced or prompt_logprobs or (False, False, False, t, s) in self.deferred:
            s = rows[-1]
        return False, t, s

    def dispatch(
        self, chunks: list, rows: list[RowSampling], prompt_logprobs: bool = False, host_start: float | None = None
    ) -> tuple:
        """Starts one step over SeqChunks with one RowSampling each; returns without waiting for the device
        (a pending handle for `collect`). `host_start`: when the caller began preparing the step (timeline)."""
        num_tokens = sum(len(c.token_ids) for c in chunks)
        advanced = needs_advanced(rows)
        decode_only, t, s = self.bucket_for(len(chunks), num_tokens, prompt_logprobs, advanced)
        inp = self.packer.pack(chunks, t, s)
        st = build_sampling_tensors(rows, s, self.cc.max_model_len, self.cc.logit_bias_capacity, advanced,
                                    self.mask_words)  # fmt: skip
        out, prompt_lp = self.launch(inp, st, decode_only, advanced, prompt_logprobs)
        if self.timeline is not None:
            kind = "decode" if decode_only else "mixed"
            self.timeline.dispatched(host_start or time.perf_counter(), kind, len(chunks), num_tokens, out.token_ids)
        return out, prompt_lp, len(chunks), t

    def launch(self, inp: StepInputs, st: SamplingTensors, decode_only: bool, advanced: bool, prompt_lp: bool):
        """Runs the compiled step on host inputs. With several processes (jax.distributed) the lead sends the
        inputs to every follower first, so all processes run the same step on the global mesh."""
        if self.followers is not None:
            inp, st = self.followers.send_step(inp, st, decode_only, advanced, prompt_lp)
        flat, layout = to_flat((inp, st))
        out, prompt_out, self.kv, self.feed = self._step(flat, layout, decode_only, advanced, prompt_lp)
        return out, prompt_out

    @staticmethod
    def collect(pending: tuple) -> tuple[SampleOutput, tuple | None]:
        """Waits for a dispatched step: the host SampleOutput (one row per chunk) and the per-token prompt
        logprobs (when asked for)."""
        out, prompt_lp, n, _ = pending
        # The step's one device-to-host transfer. Outputs are replicated: this process's first copy is all of it
        # (and the only part a process can read when the mesh spans several).
        out, prompt_lp = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), (out, prompt_lp))
        return SampleOutput(out.token_ids[:n], out.logprobs[:n], out.top_ids[:n], out.top_logprobs[:n]), prompt_lp

    def run(self, chunks: list, rows: list[RowSampling]) -> SampleOutput:
        return self.collect(self.dispatch(chunks, rows))[0]

    def _dynamic(self, flat: tuple[np.ndarray, np.ndarray]) -> dict:
        """The step's traced arguments: the weights, the KV pools (donated), the feed and the packed inputs.
        On one device the host buffers go to the step as they are: the call copies them in C++, where
        `jax.device_put` took ~0.45 ms of Python a step (a batch-1 step is ~20 ms, and the host's time is taken
        from the step's two cores). On a mesh they are placed replicated first."""
        if self.mesh is not None:
            flat = jax.device_put(flat, self._replicated)
        return dict(weights=self.weights, kv=self.kv, feed=self.feed, flat=flat)

    def _step(self, flat: tuple, layout: Layout, decode_only: bool, advanced: bool, prompt_lp: bool = False):
        dynamic = self._dynamic(flat)
        fn = self._executable(dynamic, layout, decode_only, advanced, prompt_lp)
        return fn(**dynamic)

    def _executable(self, dynamic: dict, layout: Layout, decode_only: bool, advanced: bool, prompt_lp: bool):
        """The step for these shapes and flags, as a function of `dynamic`: from the executable cache (loaded or
        compiled and stored), or the jitted `paged_step` where that cache is off."""
        static = self.step_static(layout, decode_only, advanced, prompt_lp)
        if not self.caches_executables:
            return partial(paged_step, **static)
        # --- executable cache hook: one compiled step per static combination, loaded from disk when stored ---
        key = (layout, decode_only, advanced, prompt_lp)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self.exec_cache.load_or_compile(paged_step, dynamic, static, self._cache_extra)
        return fn

    @property
    def _cache_extra(self) -> tuple:
        return (self.cc, self.num_pages)  # the pool's shape is in `kv`; the config names the rest

    def _combo_args(self, combo: tuple) -> tuple:
        """`_executable`'s arguments for a warm-up combo (advanced, prompt_lp, decode_only, T, S)."""
        adv, plp, decode_only, t, s = combo
        flat, layout = to_flat(self.padding_inputs(adv, t, s))
        return self._dynamic(flat), layout, decode_only, adv, plp

    def step_static(self, layout: Layout, decode_only: bool, advanced: bool, prompt_lp: bool) -> dict:
        """`paged_step`'s static arguments for this runner and these shapes and flags."""
        return dict(
            model_def=self.model_def, cfg=self.cfg, layout=layout, decode_only=decode_only, advanced=advanced,
            num_logprobs=self.cc.max_logprobs, impl=self.attn_impl, mesh=self.mesh, prompt_logprobs=prompt_lp,
        )  # fmt: skip

    def padding_inputs(self, advanced: bool, t: int, s: int) -> tuple[StepInputs, SamplingTensors]:
        """The host inputs of an all-padding step of T tokens and S rows (it writes nothing): what warm-up runs."""
        inp = pack([], t, s, self.cc.pages_per_seq, self.cc.block_size)
        st = build_sampling_tensors([], s, self.cc.max_model_len, self.cc.logit_bias_capacity, advanced,
                                    self.mask_words)  # fmt: skip
        return inp, st

    @property
    def mask_words(self) -> int:
        """The width of a structured output's token mask: a bit per token of the vocabulary."""
        return mask_words(self.cfg.vocab_size)

    @property
    def caches_executables(self) -> bool:
        # A user module's code is not in the cache key (only jaxinfer's source is): always trace it.
        return self.exec_cache is not None and self.cfg.arch != CUSTOM_ARCH

    def warmup(
        self,
        advanced: bool = True,
        prompt_logprobs: bool = False,
        progress: Callable[[int, int], None] | None = None,
        defer: bool = False,
    ) -> float:
        """Compiles every bucket (and the penalties/bias variant, and with `prompt_logprobs` the variant that
        scores every prompt token): through the executable cache, loaded or compiled and stored without running;
        where that cache is off, by running all-padding steps, which write nothing. Returns the seconds taken.
        `progress(done, total)` is called after each bucket compiles.

        `defer` (the server's engine core): the mixed steps of fewer rows (which only save time) and the variants a
        plain request never selects (advanced sampling, prompt logprobs) are not loaded or compiled now but left in
        `deferred`, for `compile_deferred` to load (the executable cache holds them: tens of ms each) or compile one
        at a time while the engine is idle. A start is then ready once the plain buckets of the most rows are (11
        of the default CPU server's 37 programs). Until then a mixed step of few sequences runs on the most rows; a
        step that needs a deferred sampling variant loads or compiles it when it runs, as a lazy engine does."""
        t0 = time.perf_counter()
        shapes = [(True, s, s) for s in self.seq_buckets] + [
            (False, t, s) for t in self.token_buckets for s in self.buckets.mixed_rows(t)
        ]
        most_rows = {(True, s, s) for s in self.seq_buckets} | {
            (False, t, self.buckets.mixed_rows(t)[-1]) for t in self.token_buckets
        }
        combos = [
            (adv, plp, *shape)
            for adv in ((False, True) if advanced else (False,))
            for plp in ((False, True) if prompt_logprobs else (False,))
            for shape in shapes
            # prompt tokens are scored in mixed steps only; the rarer variants run on the most rows (bucket_for)
            if not (plp and shape[0]) and (shape in most_rows or not (adv or plp))
        ]

        if self.caches_executables and self.followers is None:
            if defer:  # ready on the plain programs of the most rows; the fewer-row mixed steps are deferred first
                now = [c for c in combos if not (c[0] or c[1]) and c[2:] in most_rows]
                self.deferred = [c for c in combos if c not in now]
                combos = now

            # Loading (or compiling) is all a bucket needs: running an all-padding step of the mixed buckets costs
            # as much as a real one (most of a warm start's warm-up on CPU). Deserializing and compiling release the
            # GIL, so the buckets load in parallel.
            def prepare(combo: tuple) -> None:
                self._executable(*self._combo_args(combo))

            with ThreadPoolExecutor(max_workers=max(1, min(len(combos), os.cpu_count() or 1))) as pool:
                for done, _ in enumerate(pool.map(prepare, combos), 1):
                    if progress is not None:
                        progress(done, len(combos))
        else:  # jit compiles on the first call
            for done, (adv, plp, decode_only, t, s) in enumerate(combos, 1):
                self.launch(*self.padding_inputs(adv, t, s), decode_only, adv, plp)
                if progress is not None:  # the launch compiled the bucket before it returned
                    progress(done, len(combos))
        # A kernel whose build ran beside the compiles is loaded now, so that the first request does not wait for it
        # and a failed build fails the start, as a build at trace time did.
        kernels_pallas.finish_builds()
        if self.copier is not None:
            self.kv = self.copier.warmup(self.kv)
        jax.block_until_ready((self.kv, self.feed))
        release_freed_memory()  # the compilers' temporaries
        if self.exec_cache is not None:
            ec = self.exec_cache
            log.info("executable cache %s: %d steps loaded, %d compiled (%d of them read from jax's cache, not stored)",
                     ec.directory, ec.loaded, ec.compiled, ec.not_stored)  # fmt: skip
        return time.perf_counter() - t0

    def compile_deferred(self) -> int:
        """Loads (from the executable cache) or compiles (and stores) the next program `warmup(defer=True)` left,
        unless a step did already; returns how many are left."""
        if self.deferred:
            self._executable(*self._combo_args(self.deferred.pop(0)))
            if not self.deferred:
                release_freed_memory()  # the compilers' temporaries, as after warm-up
                log.info("every step variant is ready")
        return len(self.deferred)
