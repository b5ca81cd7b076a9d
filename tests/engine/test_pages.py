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
