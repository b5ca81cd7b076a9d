"""A caller that stops taking its outputs is cut off: its request is aborted in the engine process (pages back),
what was queued for it is dropped, and it finds SlowReaderError when it reads again; the other streams go on.
MPAsyncEngine on the fake core (no model), so the timing is the engine's, not a model's."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.server.test_engine_process import _fake_build


def test_a_stalled_reader_is_cut_off_and_the_others_go_on():
    from jaxinfer import SamplingParams
    from jaxinfer.engine.mp_engine import MPAsyncEngine, SlowReaderError
    from jaxinfer.server.args import ServerArgs

    args = ServerArgs(model="fake", max_stream_buffer=64)
    engine = MPAsyncEngine(args, build=_fake_build)
    try:
        engine.wait_ready(60)

        async def main():
            slow = [engine.generate([5], SamplingParams(max_tokens=400), f"slow{i}") for i in range(5)]
            for s in slow:
                await s.__anext__()  # one output each, then the readers stall
            steady = [o async for o in engine.generate([5], SamplingParams(max_tokens=60), "steady")]
            assert steady[-1].finished and len(steady[-1].outputs[0].token_ids) == 60
            deadline = time.monotonic() + 20
            while engine.stats().pages_used:  # the fake engine holds one page per live sequence
                assert time.monotonic() < deadline, engine.stats()
                await asyncio.sleep(0.05)
            for s in slow:
                assert max(q.qsize() for q in [st.queue for st in engine._streams.values()]) <= 65
                with pytest.raises(SlowReaderError):
                    async for _ in s:
                        pass

        asyncio.run(main())
    finally:
        engine.shutdown()
