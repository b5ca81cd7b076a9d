"""Session pins and the host tier's bookkeeping, host only (no device): what a session holds and hands over, and
that every pinned page comes back, on TTL expiry, on cap pressure, under memory pressure and on shutdown."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.cache.host_tier import HostTier, host_tier_bytes
from jaxinfer.cache.pages import PageAllocator
from jaxinfer.cache.sessions import SessionStore
from jaxinfer.engine.scheduler import Evicted, Load, Scheduler
from jaxinfer.types import Request, SamplingParams, Status

PS = 4


def _req(rid: str, prompt: list[int], session: str | None = "s", arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=8, session_id=session), seed=0, arrival_time=arrival)


def _run_turn(s: Scheduler, req: Request, outputs: list[int]) -> int:
    """Admits `req` and runs it as the engine would: each step that completes the known tokens samples the next
    output (the last one is never fed back); then it ends with "stop". Returns the prompt tokens it computed."""
    s.add(req)
    prefilled = None
    sampled = list(outputs)
    while True:
        x = next(x for x in s.schedule() if x.req is req)
        if prefilled is None:
            prefilled = len(req.prompt_token_ids) - req.num_computed
        req.num_computed += x.num_new
        s.commit(req)
        if x.samples:
            if not sampled:
                break
            req.output_token_ids.append(sampled.pop(0))
            if not sampled:
                break
    s.finish(req, "stop")
    return prefilled


def test_next_turn_starts_where_the_last_one_ended():
    alloc = PageAllocator(32, PS)
    store = SessionStore(alloc, max_pages=16, ttl=300)
    s = Scheduler(alloc, 4, 64, 256, sessions=store)
    prompt = list(range(1, 11))  # 10 tokens: 2 full pages and a partly filled one after the outputs
    _run_turn(s, _req("t0", prompt), [50, 51, 52])
    # The session holds prompt + outputs but the last output (never fed): 12 tokens = 3 pages.
    assert len(store) == 1 and store.pinned_pages == 3
    new = [60, 61, 62, 63, 64]
    second = _req("t1", prompt + [50, 51, 52] + new)
    prefilled = _run_turn(s, second, [70])
    assert prefilled == len(new) + 1  # the new message plus the previous turn's last token
    assert store.hits == 1 and store.hit_tokens == 12
    s.sessions.release_all()
    assert alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("shared", [False, True])
def test_a_prompt_diverging_inside_a_full_page(shared):
    """A re-rendered reply can part from the generated tokens inside a full page. Held by the session alone, the
    page goes to the new turn (out of the prefix cache first: it is about to be overwritten); held by anyone else,
    the match stops at the page's start."""
    alloc = PageAllocator(32, PS)
    store = SessionStore(alloc, max_pages=16, ttl=300)
    s = Scheduler(alloc, 4, 64, 256, sessions=store)
    _run_turn(s, _req("t0", list(range(1, 10))), [40, 41])  # 10 computed tokens: 2 full pages + 2 in the third
    held = list(store._sessions["s"].pages)
    if shared:
        alloc.share(held[1:2])  # another holder (e.g. a running request that matched it in the prefix cache)
    other = _req("t1", [1, 2, 3, 4, 5, 6, 99, 98, 97])  # parts at token 6, inside the second (full) page
    s.add(other)
    s.schedule()
    if shared:
        assert other.num_computed == PS and held[1] not in other.pages
        assert alloc.take_cached(alloc._block_of[held[1]][0], (5, 6, 7, 8)) == held[1]  # still cached, untouched
        alloc.free([held[1]] * 2)
    else:
        assert other.num_computed == 6 and other.pages[:2] == held[:2]
        assert held[1] not in alloc._block_of  # out of the prefix cache before anything overwrites it
    assert other.pages[0] == held[0]
    s.finish(other, "abort")  # aborted: pins nothing, the session is gone (consumed at admission)
    assert len(store) == 0 and alloc.num_free == alloc.num_pages


def _pin(store: SessionStore, alloc: PageAllocator, sid: str, num_pages: int, now: float) -> bool:
    """Pins `num_pages` fresh pages as a finished request would: the session shares them, the request lets go."""
    pages = alloc.allocate(num_pages)
    pinned = store.pin(sid, list(range(num_pages * PS)), pages, [], now=now)
    alloc.free(pages)
    return pinned


def test_ttl_expiry_and_the_cap_release_pins():
    alloc = PageAllocator(32, PS)
    store = SessionStore(alloc, max_pages=5, ttl=10)
    assert _pin(store, alloc, "a", 2, now=0.0) and _pin(store, alloc, "b", 2, now=5.0)
    assert store.pinned_pages == 4 and alloc.num_free == 28
    assert _pin(store, alloc, "c", 2, now=6.0)  # 6 > 5 pages: the least recently used ("a") goes
    assert "a" not in store and "b" in store and store.pinned_pages == 4
    assert not _pin(store, alloc, "huge", 6, now=6.0)  # alone above the cap
    assert alloc.num_free == 28
    store.expire(now=14.0)  # b idle for 9 s, c for 8 s: both stay
    assert len(store) == 2
    store.expire(now=15.5)
    assert "b" not in store and "c" in store
    store.release_all()  # shutdown
    assert len(store) == 0 and store.pinned_pages == 0 and alloc.num_free == alloc.num_pages


def test_memory_pressure_releases_sessions_before_preempting():
    alloc = PageAllocator(8, PS)
    store = SessionStore(alloc, max_pages=8, ttl=300)
    s = Scheduler(alloc, 4, 64, 256, sessions=store)
    _run_turn(s, _req("t0", list(range(1, 20))), [30, 31])  # 20 computed tokens: 5 pages pinned
    assert store.pinned_pages == 5
    big = _req("big", list(range(100, 124)), session=None)  # needs 6 pages: the session must give way
    s.add(big)
    assert [x.req for x in s.schedule()] == [big]
    assert len(store) == 0 and big.status is Status.RUNNING and big.num_preemptions == 0
    s.finish(big, "abort")
    assert alloc.num_free == alloc.num_pages


def test_n_samples_and_aborts_pin_nothing():
    alloc = PageAllocator(16, PS)
    store = SessionStore(alloc, max_pages=8, ttl=300)
    s = Scheduler(alloc, 4, 64, 256, sessions=store)
    r = _req("t0", list(range(1, 9)))
    r.group = "g"  # one of n > 1 samples
    _run_turn(s, r, [9])
    assert len(store) == 0
    aborted = _req("t1", list(range(1, 9)))
    s.add(aborted)
    s.schedule()
    s.finish(aborted, "abort")
    assert len(store) == 0 and alloc.num_free == alloc.num_pages


def test_host_tier_lru_cap_and_collisions():
    block = np.zeros((2, 2, PS, 1, 2), np.float32)
    tier = HostTier(capacity_bytes=3 * block.nbytes, block_bytes=block.nbytes)
    for h in range(4):
        tier.put(h, (h,), block + h)
    assert tier.num_blocks == 3 and 0 not in tier and tier.evictions == 1
    assert tier.get(1, (1,))[0, 0, 0, 0, 0] == 1
    assert tier.get(1, (2,)) is None  # same hash, other tokens: a collision is a miss
    tier.put(4, (4,), block)  # 1 was just used: 2 goes
    assert 2 not in tier and 1 in tier
    assert (
        host_tier_bytes(None, "cpu") == 0 and host_tier_bytes(None, "gpu") == 2**30 and host_tier_bytes(5, "cpu") == 5
    )


def test_scheduler_records_evictions_and_loads_in_order():
    alloc = PageAllocator(4, PS)
    tier = HostTier(capacity_bytes=1 << 20, block_bytes=64)
    s = Scheduler(alloc, 4, 64, 256, host=tier)
    first = _req("a", list(range(1, 10)), session=None)  # 2 full pages registered
    _run_turn(s, first, [])
    assert s.take_kv_events() == []
    second = _req("b", list(range(50, 66)), session=None)  # 4 pages: evicts both cached blocks
    s.add(second)
    s.schedule()
    evicted = s.take_kv_events()
    assert [type(e) for e in evicted] == [Evicted, Evicted]
    for e in evicted:
        tier.put(e.block_hash, e.tokens, np.full(4, e.page))
    s.finish(second, "abort")
    again = _req("c", list(range(1, 10)), session=None)
    s.add(again)
    s.schedule()
    loads = [e for e in s.take_kv_events() if isinstance(e, Load)]
    assert len(loads) == 2 and again.num_computed == 2 * PS and tier.hits == 2
    s.finish(again, "abort")
    assert alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("bad", ["", "x" * 257, 5])
def test_session_id_is_checked(bad):
    with pytest.raises(ValueError, match="session_id"):
        SamplingParams(session_id=bad)


def test_a_page_two_sessions_share_is_pinned_once():
    """Conversations that start with the same system prompt share its full pages: the pool holds each once, and so
    do the pinned-page count (/metrics) and the cap."""
    alloc = PageAllocator(32, PS)
    store = SessionStore(alloc, max_pages=4, ttl=10)
    shared, own_a, own_b = alloc.allocate(2), alloc.allocate(1), alloc.allocate(1)
    tokens = list(range(3 * PS))
    assert store.pin("a", tokens, shared + own_a, [], now=0.0)
    assert store.pin("b", tokens, shared + own_b, [], now=1.0)
    alloc.free(shared + own_a + own_b)  # the requests let go: only the pins hold them
    assert store.pinned_pages == 4 == alloc.num_used  # 2 shared + 1 + 1, where a per-session sum says 6
    assert len(store) == 2  # both fit the cap of 4 distinct pages
    store.release("a")
    assert store.pinned_pages == 3 == alloc.num_used  # the shared pages stay for "b"
    store.release_all()
    assert store.pinned_pages == 0 and alloc.num_free == alloc.num_pages
