"""A caller that stops taking its outputs is cut off: its request is aborted in the engine (pages back), what was
queued for it is dropped, and it finds SlowReaderError when it reads again; the other streams go on. The same
cutoff (jaxinfer/engine/stream_queue.py) on both fronts: AsyncEngine (engine thread) and MPAsyncEngine (engine
process), each on a fake engine paced like a device (no model), so the timing is the engine's."""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.output import OutputAccumulator
from jaxinfer.engine.stream_queue import SlowReaderError, StreamLimits
from tests.server.fake_engine import FakeEngine
from tests.server.test_engine_process import _fake_build

STEP_S = 0.004  # a paced producer: a stalled stream fills its buffer in a fraction of a second


def _paced_build(args: dict):
    """Runs in the spawned core: the fake engine, one step per STEP_S."""
    engine, tokenizer = _fake_build(args)
    engine.step_delay = STEP_S
    # Room for long streams (tests/server/test_stream_memory.py): 8192 tokens of context, 16384 in the pool.
    engine.cc.max_model_len = 8192
    engine.allocator.num_pages, engine.runner.num_kv_tokens = 1024, 16384
    return engine, tokenizer


class _InProcess:
    def __init__(self, tokenizer, limits: StreamLimits):
        from jaxinfer.engine.async_engine import AsyncEngine

        self.fake = FakeEngine(tokenizer.vocab_size)
        self.fake.step_delay = STEP_S
        self.engine = AsyncEngine(self.fake, tokenizer, limits=limits)

    def pages_used(self) -> int:
        return self.fake.allocator.num_used

    def close(self) -> None:
        self.engine.shutdown()


class _EngineProcess:
    def __init__(self, tokenizer, limits: StreamLimits):
        from jaxinfer.engine.mp_engine import MPAsyncEngine
        from jaxinfer.server.args import ServerArgs

        args = ServerArgs(model="fake", stream_stall_timeout=limits.stall_timeout, max_stream_buffer=limits.max_buffer)
        self.engine = MPAsyncEngine(args, build=_paced_build)
        self.engine.wait_ready(60)

    def pages_used(self) -> int:
        return self.engine.stats().pages_used

    def close(self) -> None:
        self.engine.shutdown()


FRONTS = {"in-process": _InProcess, "engine-process": _EngineProcess}


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("limit", ["buffer", "stall"])
def test_a_stalled_reader_is_cut_off_and_the_others_go_on(tokenizer, front, limit):
    # "buffer": 64 waiting outputs cut a stream; "stall": an output arriving after 1 s without a take does.
    limits = StreamLimits(stall_timeout=60.0, max_buffer=64) if limit == "buffer" else StreamLimits(1.0, 100_000)
    f = FRONTS[front](tokenizer, limits)
    engine = f.engine
    try:

        async def main():
            slow = [engine.generate([5], SamplingParams(max_tokens=400), f"slow{i}") for i in range(5)]
            for s in slow:
                await s.__anext__()  # one output each, then the readers stall
            whole = OutputAccumulator()
            async for o in engine.generate([5], SamplingParams(max_tokens=60), "steady"):
                whole.add(o)
            assert whole.result().finished and len(whole.result().outputs[0].token_ids) == 60
            deadline = time.monotonic() + 20
            while f.pages_used():  # the fake engine holds one page per live sequence
                assert time.monotonic() < deadline, "the stalled requests were not aborted"
                await asyncio.sleep(0.05)
            assert max(st.qsize() for st in engine._streams.values()) <= 1  # dropped: only the error waits
            for s in slow:
                with pytest.raises(SlowReaderError):
                    async for _ in s:
                        pass

        asyncio.run(main())
    finally:
        f.close()


def test_a_reader_that_falls_behind_takes_what_waits_in_one_output(tokenizer):
    """Deltas waiting for a reader that is slow but reading are merged: it catches up in one take, and the whole
    output is the same as a prompt reader's."""
    f = _InProcess(tokenizer, StreamLimits())
    try:

        async def main():
            fast, late = OutputAccumulator(), OutputAccumulator()
            async for o in f.engine.generate([5], SamplingParams(max_tokens=40), "fast"):
                fast.add(o)
            outputs = f.engine.generate([5], SamplingParams(max_tokens=40), "late")
            first = await outputs.__anext__()
            late.add(first)
            await asyncio.sleep(40 * STEP_S + 0.5)  # everything else is made meanwhile
            rest = [o async for o in outputs]
            assert len(rest) == 1 and rest[0].finished and len(rest[0].outputs[0].token_ids) > 1
            late.add(rest[0])
            assert late.result().outputs == fast.result().outputs

        asyncio.run(main())
    finally:
        f.close()
