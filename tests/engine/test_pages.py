"""Page allocator and scheduler bookkeeping (host only, no device)."""

import pytest

from jaxinfer.cache.pages import OutOfPagesError, PageAllocator
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.types import Request, SamplingParams, Status


def test_allocate_free_and_share():
    a = PageAllocator(num_pages=4, page_size=16)
    assert a.pages_for(1) == 1 and a.pages_for(16) == 1 and a.pages_for(17) == 2
    p = a.allocate(3)
    assert len(set(p)) == 3 and a.num_free == 1
    a.share(p[:1])
    a.free(p)
    assert a.num_free == 3 and a.ref_count(p[0]) == 1
    a.free(p[:1])
    assert a.num_free == 4
    with pytest.raises(OutOfPagesError):
        a.allocate(5)
    with pytest.raises(ValueError, match="freed more often"):
        a.free(p[:1])


def _req(i: int, n: int) -> Request:
    return Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=32), seed=0, arrival_time=float(i))


@pytest.mark.parametrize("budget", [4, 8, 64])
def test_chunked_prefill_respects_budget(budget):
    s = Scheduler(PageAllocator(64, 4), max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=128)
    reqs = [_req(i, n) for i, n in enumerate([10, 3, 25])]
    for r in reqs:
        s.add(r)
    seen = 0
    while s.waiting or any(r.num_computed < r.num_tokens for r in s.running):
        batch = s.schedule()
        assert sum(x.num_new for x in batch) <= budget and len(batch) <= 4
        for x in batch:
            x.req.num_computed += x.num_new
            seen += x.num_new
    assert seen == 38
    assert all(r.status is Status.RUNNING for r in reqs)


def test_preempts_youngest_and_returns_pages():
    alloc = PageAllocator(6, 4)
    s = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    old, young = _req(0, 8), _req(1, 8)  # 2 pages each
    s.add(old)
    s.add(young)
    for x in s.schedule():
        x.req.num_computed += x.num_new
    # Grow `old` until the pool is exhausted: the youngest request must give its pages back.
    old.output_token_ids += list(range(9))
    batch = s.schedule()
    assert [x.req for x in batch] == [old]
    assert young.status is Status.WAITING and young.pages == [] and young.num_computed == 0
    assert young.num_preemptions == 1 and s.waiting[0] is young
    s.finish(old, "abort")
    assert alloc.num_free == 6


def test_long_prefill_does_not_starve_short_requests():
    s = Scheduler(PageAllocator(64, 4), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                  long_prefill_tokens=8)  # fmt: skip
    long, short = _req(0, 120), _req(1, 5)
    s.add(long)
    first = s.schedule()
    assert first[0].num_new == 32  # alone, the long prompt may use the whole budget
    first[0].req.num_computed += 32
    s.add(short)
    steps = 0
    while short.num_computed < short.num_tokens:
        batch = s.schedule()
        assert {x.req.request_id for x in batch} == {"r0", "r1"}
        for x in batch:
            x.req.num_computed += x.num_new
        steps += 1
    assert steps == 1 and long.num_computed < long.num_tokens  # the short prompt finished within the long one


# ---------------------------------------------------------------------------------------------- liveness


def _seq(rid: str, prompt_len: int, max_tokens: int, arrival: float, n: int = 1) -> list[Request]:
    """One request's sequences (n > 1: samples of one arrival time sharing a group, as the engine adds them)."""
    sp, prompt = SamplingParams(max_tokens=max_tokens, n=n), [(7 * i + len(rid)) % 900 + 1 for i in range(prompt_len)]
    if n == 1:
        return [Request(rid, prompt, sp, seed=0, arrival_time=arrival)]
    return [Request(f"{rid}#{i}", list(prompt), sp, seed=i, arrival_time=arrival, group=rid) for i in range(n)]


def _step(s: Scheduler, done: dict[str, int], step: int) -> None:
    """One engine step, as Engine.step drives the scheduler (overlap off): compute, sample, commit, finish."""
    for x in s.schedule():
        x.req.num_computed += x.num_new
        if x.samples:
            x.req.output_token_ids.append(500 + len(x.req.output_token_ids))
        s.commit(x.req)
        if x.samples and len(x.req.output_token_ids) == x.req.params.max_tokens:
            s.finish(x.req, "length")
            done[x.req.request_id] = step


def _run(s: Scheduler, reqs: list[Request], max_steps: int) -> dict[str, int]:
    """Adds `reqs` and steps until they are done (or `max_steps`): request id -> the step it finished at."""
    for r in reqs:
        s.add(r)
    done: dict[str, int] = {}
    for step in range(max_steps):
        if not s.has_work():
            break
        _step(s, done, step)
    return done


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_samples_that_fit_one_at_a_time_finish(prefix_cache):
    """n = 3 samples of 35 tokens in a 48-token pool: one runs at a time. Tied on arrival, each sample took itself
    for the newest and preempted itself, was admitted again in the same step, and the three never finished."""
    s = Scheduler(PageAllocator(6, 8, prefix_cache), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
    samples = _seq("r", 6, 29, 0.0, n=3)
    done = _run(s, samples, 300)
    assert len(done) == 3 and max(r.num_preemptions for r in samples) <= 6, [r.num_preemptions for r in samples]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_an_older_prefill_is_not_preempted_for_a_newer_decode(prefix_cache):
    """vLLM's FCFS: the newest running request gives way, even one scheduled earlier in the step (decodes go
    first). The older, still prefilling A used to preempt itself 8-36 times and finish after the newer B."""
    s = Scheduler(PageAllocator(10, 16, prefix_cache), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512)
    (a,), (b,) = _seq("A", 150, 8, 0.0), _seq("B", 40, 100, 1.0)
    done = _run(s, [a, b], 500)
    assert a.num_preemptions == 0 and done["A"] < done["B"] and done["A"] < 30, (done, b.num_preemptions)


def test_a_long_prompt_in_a_stream_of_short_ones_finishes():
    """A short request every 6 steps, and a long one that needs most of the pool: it used to be preempted by the
    shorts admitted behind it, 60+ times in 600 steps, never finishing while the queue grew."""
    s = Scheduler(PageAllocator(12, 16), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512)
    done: dict[str, int] = {}
    for step in range(400):
        if step % 6 == 0:
            s.add(_seq(f"s{step}", 10, 20, float(step))[0])
        if step == 30:
            (long,) = _seq("L", 150, 5, float(step))
            s.add(long)
        _step(s, done, step)
    assert done["L"] < 30 + 60 and long.num_preemptions <= 2 and len(s.waiting) <= 2, (done.get("L"), len(s.waiting))
