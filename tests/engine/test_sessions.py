"""Conversations that keep their KV, on a tiny random-weight model: with a session id every later turn of a
20-turn conversation prefills only its new message; after the device cache is forced out, the host tier serves
the prefix; greedy tokens equal a run that recomputes everything; nothing compiles while serving; every pinned
page comes back. The data-parallel front keeps a session on its replica (in a child process with 2 CPU devices)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import compile_count
from jaxinfer.model import init_params
from tests.eight_devices import child_only

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=512)  # fmt: skip
TURNS = 20
HOST = 1 << 20  # 1 MiB of host tier: 1024 pages of this model


def _cache(**kw) -> CacheConfig:
    # 20 turns reach ~240 tokens = 60 pages: the session cap (default a quarter of the pool) must hold them.
    base = dict(
        block_size=4,
        num_pages=128,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        session_cache_pages=80,
    )
    return CacheConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0, std=0.5)


def _messages() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(2, 64, int(rng.integers(3, 9))).tolist() for _ in range(TURNS)]


def _evict_device_cache(eng: Engine) -> None:
    """Forces every cached page off the device: pinned sessions are released, then other traffic takes the pool."""
    eng.release_sessions()
    rng = np.random.default_rng(1)
    filler = [rng.integers(2, 64, 4 * eng.allocator.num_pages // 3).tolist() for _ in range(3)]
    eng.generate(filler, SamplingParams(max_tokens=1, temperature=0))
    assert eng.allocator.num_free == eng.allocator.num_pages


def _converse(
    eng: Engine, session: str | None, evict: bool = False, turns: int = TURNS
) -> tuple[list[list[int]], list[int]]:
    """Runs the conversation: each turn's prompt is the previous prompt, its reply and a new message. Returns every
    turn's greedy tokens and prompt tokens computed."""
    prompt: list[int] = []
    outputs, prefilled = [], []
    for msg in _messages()[:turns]:
        prompt = prompt + msg
        before = eng.num_prefilled_tokens
        sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, session_id=session)
        ((req,),) = eng.generate([prompt], sp)
        prefilled.append(eng.num_prefilled_tokens - before)
        outputs.append(req.output_token_ids)
        prompt = prompt + req.output_token_ids
        if evict:
            _evict_device_cache(eng)
    return outputs, prefilled


@pytest.fixture(scope="module")
def reference(params):
    """No session and no prefix cache: every turn recomputes its whole prompt."""
    eng = Engine(CFG, params, _cache(enable_prefix_caching=False), seed=0)
    outputs, prefilled = _converse(eng, None)
    total = 0
    for msg, out, n in zip(_messages(), outputs, prefilled, strict=True):
        total += len(msg)
        assert n == total  # the whole prompt
        total += len(out)
    return outputs


def test_each_turn_prefills_only_its_new_message(params, reference):
    eng = Engine(CFG, params, _cache(), seed=0)
    outputs, prefilled = _converse(eng, "chat-1")
    assert outputs == reference
    # Turn 1 prefills its prompt; every later turn its new message plus the previous reply's last token, whose
    # K/V was never computed (it was sampled, not fed).
    assert prefilled == [len(_messages()[0])] + [len(m) + 1 for m in _messages()[1:]]
    stats = eng.cache_stats()
    assert stats["session_hits"] == TURNS - 1 and stats["sessions"] == 1 and stats["session_pinned_pages"] > 0
    eng.release_sessions()
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_without_a_prefix_cache_sessions_still_work(params, reference):
    eng = Engine(CFG, params, _cache(enable_prefix_caching=False), seed=0)
    outputs, prefilled = _converse(eng, "chat-1")
    assert outputs == reference and prefilled[1:] == [len(m) + 1 for m in _messages()[1:]]


def test_host_tier_serves_after_forced_device_eviction(params, reference):
    eng = Engine(CFG, params, _cache(host_kv_cache_memory=HOST), seed=0)
    assert eng.host is not None
    eng.runner.warmup(advanced=False)
    compiles = compile_count()
    outputs, prefilled = _converse(eng, "chat-1", evict=True)
    assert compile_count() == compiles  # the page copies were compiled at warm-up too
    assert outputs == reference  # identical greedy tokens with the host tier on
    stats = eng.cache_stats()
    assert stats["host_kv_spills"] > 0 and stats["host_kv_hits"] > 0 and stats["session_hits"] == 0
    ps = eng.allocator.page_size
    # Every later turn finds its whole prefix in whole pages: it recomputes at most a page's worth besides.
    for msg, n in zip(_messages()[1:], prefilled[1:], strict=True):
        assert n <= len(msg) + ps
    assert sum(prefilled) < sum(len(m) for m in _messages()) + TURNS * ps
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_without_the_host_tier_eviction_means_recompute(params, reference):
    eng = Engine(CFG, params, _cache(host_kv_cache_memory=0), seed=0)
    outputs, prefilled = _converse(eng, "chat-1", evict=True)
    assert eng.host is None and outputs == reference
    assert prefilled[-1] > sum(len(m) for m in _messages()[:-1])  # the whole conversation again


def _raise(*args, **kwargs):
    raise RuntimeError("injected copy failure")


def test_a_failed_spill_costs_a_recompute_never_a_token(params, reference, monkeypatch):
    eng = Engine(CFG, params, _cache(host_kv_cache_memory=HOST), seed=0)
    monkeypatch.setattr(eng.runner, "gather_pages", _raise)
    outputs, _ = _converse(eng, "chat-1", evict=True, turns=4)
    assert outputs == reference[:4] and eng.cache_stats()["host_kv_spills"] == 0


def test_a_failed_copy_back_stops_the_engine(params, monkeypatch):
    from jaxinfer.engine.engine import EngineFatalError

    eng = Engine(CFG, params, _cache(host_kv_cache_memory=HOST), seed=0)
    _converse(eng, "chat-1", evict=True, turns=2)  # the conversation's pages now live in the host tier only
    monkeypatch.setattr(eng.runner, "scatter_pages", _raise)
    prompt = _messages()[0] + [9] * 12  # the first turn's prompt, then more: its full page comes from the host
    with pytest.raises(EngineFatalError, match="host tier"):
        eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0))


def test_ttl_expiry_returns_the_pages(params):
    eng = Engine(CFG, params, _cache(session_ttl=0.2), seed=0)
    eng.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=3, temperature=0, session_id="s"))
    assert eng.cache_stats()["sessions"] == 1 and eng.allocator.num_free < eng.allocator.num_pages
    eng.expire_sessions()
    assert eng.cache_stats()["sessions"] == 1  # not yet
    time.sleep(0.3)
    eng.expire_sessions()
    assert eng.cache_stats()["sessions"] == 0 and eng.allocator.num_free == eng.allocator.num_pages


def test_session_cap_zero_turns_sessions_off(params):
    eng = Engine(CFG, params, _cache(session_cache_pages=0), seed=0)
    eng.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=3, temperature=0, session_id="s"))
    assert eng.cache_stats()["sessions"] == 0 and eng.allocator.num_free == eng.allocator.num_pages


def test_engine_core_loop_expires_and_releases_sessions(params):
    """The engine process's loop (EngineCore, fed over ZeroMQ as in serving): a pinned session times out while the
    loop idles, and "shutdown" releases what is still pinned; the pool is full again both times."""
    import threading

    import zmq

    from jaxinfer.engine.core_process import EngineCore, outputs_to_wire, pack, params_to_wire, unpack
    from jaxinfer.engine.outbox import ResultsOutbox

    eng = Engine(CFG, params, _cache(session_ttl=0.5), seed=0)
    ctx = zmq.Context()
    commands_in, commands = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    results, results_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    commands_in.bind("inproc://commands")
    commands.connect("inproc://commands")
    results.bind("inproc://results")
    results_out.connect("inproc://results")
    core = EngineCore(eng, commands_in, ResultsOutbox(results_out, pack, outputs_to_wire))
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    sp = params_to_wire(SamplingParams(max_tokens=3, temperature=0, session_id="s"))

    def turn(rid: str) -> dict:
        commands.send(pack(["add", rid, [5, 6, 7, 8, 9, 10], sp]))
        while True:
            assert loop.is_alive() and results.poll(30_000), "the engine core loop stopped sending"
            msg = unpack(results.recv())
            if any(u[0] == rid and u[3] for u in msg["u"]):
                return msg["s"]["cache"]

    try:
        assert turn("a")["sessions"] == 1
        deadline = time.monotonic() + 10
        while eng.cache_stats()["sessions"] and time.monotonic() < deadline:  # idle: the TTL runs out
            time.sleep(0.1)
        assert eng.cache_stats()["sessions"] == 0 and eng.allocator.num_free == eng.allocator.num_pages
        assert turn("b")["sessions"] == 1
        commands.send(pack(["shutdown"]))
        loop.join(10)
        assert not loop.is_alive()
        assert eng.cache_stats()["sessions"] == 0 and eng.allocator.num_free == eng.allocator.num_pages
    finally:
        for sock in (commands_in, commands, results, results_out):
            sock.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------------------------------------- data parallel


@child_only
def test_dp_front_keeps_sessions_on_their_replica(params, reference):
    import jax

    from jaxinfer.engine.dp import DataParallelEngine, replica_meshes
    from jaxinfer.sharding import make_mesh

    assert jax.device_count() >= 2  # in the 8-device child (tests/eight_devices.py)
    mesh = make_mesh(1, 2)
    placed = jax.device_put(params, jax.sharding.NamedSharding(replica_meshes(mesh)[0], jax.sharding.PartitionSpec()))
    eng = DataParallelEngine(CFG, placed, mesh, _cache(host_kv_cache_memory=HOST), seed=0)
    # Two conversations at once, turn by turn: each stays on the replica that holds its pages.
    msgs = _messages()[:6]
    prompts = {"a": [], "b": []}
    homes: dict[str, set] = {"a": set(), "b": set()}
    prefilled = {"a": [], "b": []}
    outs = {"a": [], "b": []}
    for msg in msgs:
        rids = {}
        for sid in prompts:
            prompts[sid] = prompts[sid] + msg
            rids[sid] = eng.add_request(prompts[sid], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                                     session_id=sid))  # fmt: skip
            homes[sid].add(id(eng._owner[rids[sid]]))
        seqs = {sid: eng._owner[rid].seqs[rid] for sid, rid in rids.items()}
        before = {sid: eng._owner[rid].num_prefilled_tokens for sid, rid in rids.items()}
        owners = {sid: eng._owner[rid] for sid, rid in rids.items()}
        while eng.has_unfinished():
            eng.step()
        for sid, req in seqs.items():
            prefilled[sid].append(owners[sid].num_prefilled_tokens - before[sid])
            outs[sid].append(req.output_token_ids)
            prompts[sid] = prompts[sid] + req.output_token_ids
    assert all(len(h) == 1 for h in homes.values()) and homes["a"] != homes["b"]
    assert outs["a"] == outs["b"] == reference[: len(msgs)]
    stats = eng.cache_stats()
    assert stats["session_hits"] == 2 * (len(msgs) - 1) and stats["sessions"] == 2
    eng.release_sessions()
    assert all(e.allocator.num_free == e.allocator.num_pages for e in eng.replicas)
