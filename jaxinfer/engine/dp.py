"""Data-parallel replicas in one process: one Engine per slice of the ("data", "model") mesh.

Small models then use every chip: each replica holds a full copy of the weights (sharded over its own `model`
devices) and its own KV pool and scheduler. A request goes to the replica with the least outstanding work and
stays there. A step dispatches every replica's work before waiting for any, so the devices run concurrently.
A request naming a session goes to the replica that holds the session's pinned pages, when that replica can take
it. Each replica has its own host tier, with an equal share of `host_kv_cache_memory`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxinfer.cache.host_tier import host_tier_bytes
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.model.transformer import Params
from jaxinfer.sharding import DATA, MODEL
from jaxinfer.types import SamplingParams, SeqUpdate


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, tp) mesh per row of the data axis."""
    return [Mesh(mesh.devices[i : i + 1], (DATA, MODEL), axis_types=mesh.axis_types) for i in range(mesh.shape[DATA])]


def copy_to_mesh(params: Params, mesh: Mesh) -> Params:
    """The same params, sharded the same way, on another mesh of the same shape (a device-to-device copy)."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, x.sharding.spec)), params)


class DataParallelEngine:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        mesh: Mesh,
        cache: CacheConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        attn_impl: str | None = None,
        seed: int | None = None,
        overlap: bool = True,
    ):
        """`params` must be placed on the first replica's mesh (`replica_meshes(mesh)[0]`)."""
        meshes = replica_meshes(mesh)
        cache = cache or CacheConfig()
        host = host_tier_bytes(cache.host_kv_cache_memory, jax.default_backend())
        cache = dataclasses.replace(cache, host_kv_cache_memory=host // len(meshes))
        self.replicas = [
            Engine(
                cfg,
                params if i == 0 else copy_to_mesh(params, m),
                cache,
                eos_token_ids,
                attn_impl,
                None if seed is None else seed + i,
                m,
                overlap,
            )  # fmt: skip
            for i, m in enumerate(meshes)
        ]
        # The largest replica's: a replica's context is its pool's size where that is below max_model_len.
        self.cfg, self.cc = cfg, self.largest().cc
        self.sampling_defaults: dict[str, float | int] = {}  # as Engine's
        self.driver: object | None = None  # as Engine's
        self._owner: dict[str, Engine] = {}
        self._ids = itertools.count()

    def recover(self) -> bool:
        """`Engine.recover` on every replica."""
        return any([e.recover() for e in self.replicas])

    def update_weights(self, params: Params | nnx.Module) -> None:
        """`Engine.update_weights` on every replica: a module, or a state placed as at construction (the first
        replica's mesh)."""
        if self.has_unfinished():
            raise RuntimeError("update_weights: requests are still running; update the weights between them")
        # Every replica's copy before any replica changes: one that fails leaves them all serving the old weights.
        # A module each replica places on its own mesh from its logical axes; a placed state is copied across.
        module = isinstance(params, nnx.Module)
        news = [
            params if module or i == 0 else copy_to_mesh(params, e.runner.mesh) for i, e in enumerate(self.replicas)
        ]
        for e, new in zip(self.replicas, news, strict=True):
            e.update_weights(new)

    def reset_prefix_cache(self) -> None:
        """`Engine.reset_prefix_cache` on every replica."""
        for e in self.replicas:
            e.reset_prefix_cache()

    def largest(self) -> Engine:
        """The replica with the largest KV pool: the one whose limits the API side checks first."""
        return max(self.replicas, key=lambda e: e.allocator.num_pages)

    def _fitting(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> tuple[list[Engine], list[int]]:
        """The replicas that can hold the request (each checks its own capacity: pools may differ), and the prompt.
        ValueError (the largest replica's) when none can: a 400, never a request that waits forever."""
        fits, prompt = [], None
        for e in self.replicas:
            try:
                prompt = e.validate(prompt_token_ids, params)
                fits.append(e)
            except ValueError:
                continue
        if not fits:
            self.largest().validate(prompt_token_ids, params)  # raises with the largest replica's message
            raise ValueError("prompt: the request fits no replica")  # every replica refused, yet the largest not
        return fits, prompt

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return self._fitting(prompt_token_ids, params)[1]

    def _load(self, e: Engine) -> int:
        return sum(r.num_tokens - r.num_computed + r.params.max_tokens for r in e.seqs.values())

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request_id {rid!r} is already in use")
        fits, prompt = self._fitting(prompt_token_ids, params)
        sid = params.session_id
        home = [e for e in fits if sid is not None and sid in e.sessions]
        engine = home[0] if home else min(fits, key=self._load)  # the session's replica, else the least loaded
        engine.add_request(prompt, params, rid)
        self._owner[rid] = engine
        return rid

    def abort(self, request_id: str) -> None:
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            engine.abort(request_id)

    def finish_sequence(self, seq_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        # A sample of an n > 1 request is "<request id>#<index>"; a request id may hold '#' itself.
        engine = self._owner.get(seq_id) or self._owner.get(seq_id.rpartition("#")[0])
        if engine is not None:
            engine.finish_sequence(seq_id, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.replicas)

    def step(self) -> list[SeqUpdate]:
        started = [e.start_step() for e in self.replicas]
        updates: list[SeqUpdate] = []
        for e, s in zip(self.replicas, started, strict=True):
            updates += e.finish_step(e.swap_in_flight(s))
        # Forget requests no replica holds any more (finished, stopped by a stop string, or aborted there).
        live = {rid for e in self.replicas for rid in e.groups}
        for rid in [r for r in self._owner if r not in live]:
            del self._owner[rid]
        return updates

    def cache_stats(self) -> dict[str, float]:
        """Each replica's counters summed (the hit rate over all replicas' lookups)."""
        stats = [e.cache_stats() for e in self.replicas]
        out = {k: sum(s[k] for s in stats) for k in stats[0]}
        out["prefix_cache_hit_rate"] = self.allocator.hit_rate
        return out

    def expire_sessions(self) -> None:
        for e in self.replicas:
            e.expire_sessions()

    def release_sessions(self) -> None:
        for e in self.replicas:
            e.release_sessions()

    @property
    def allocator(self) -> _PoolView:
        return _PoolView([e.allocator for e in self.replicas])

    @property
    def scheduler(self) -> _QueueView:
        return _QueueView([e.scheduler for e in self.replicas])

    def __getattr__(self, name: str):
        # Counters (num_generated_tokens, num_prefilled_tokens, num_steps) summed over the replicas.
        if name.startswith("num_"):
            return sum(getattr(e, name) for e in self.replicas)
        raise AttributeError(name)


class _PoolView:
    """The replicas' page pools seen as one, for metrics."""

    def __init__(self, allocs: list):
        self._a = allocs

    num_pages = property(lambda self: sum(a.num_pages for a in self._a))
    num_used = property(lambda self: sum(a.num_used for a in self._a))
    num_free = property(lambda self: sum(a.num_free for a in self._a))
    hit_tokens = property(lambda self: sum(a.hit_tokens for a in self._a))
    queried_tokens = property(lambda self: sum(a.queried_tokens for a in self._a))
    hit_rate = property(lambda self: self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0)


class _QueueView:
    def __init__(self, scheds: list):
        self._s = scheds

    running = property(lambda self: [r for s in self._s for r in s.running])
    waiting = property(lambda self: [r for s in self._s for r in s.waiting])
