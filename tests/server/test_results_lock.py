"""While the thread that detokenizes (MPAsyncEngine's results reader, AsyncEngine's engine thread) is inside the
tokenizer, a handler is not stalled: it can count the pending streams and start a new one at once. The tokenizer
here blocks until released (or 5 s), so a handler waiting on a lock the detokenizing thread holds would take
seconds instead of milliseconds."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.stream_queue import StreamLimits
from tests.server.test_slow_reader import FRONTS

GATE_S = 5.0


class _GatedTokenizer:
    """The real tokenizer, whose decode blocks (once armed) until released: detokenization caught in the act."""

    def __init__(self, inner):
        self._inner = inner
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def decode(self, *args, **kwargs):
        if self.armed and threading.current_thread() is not threading.main_thread():
            self.entered.set()
            self.release.wait(GATE_S)
        return self._inner.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("front", FRONTS)
def test_a_handler_is_not_stalled_while_the_results_thread_detokenizes(tokenizer, front):
    f = FRONTS[front](tokenizer, StreamLimits())
    engine = f.engine
    gated = _GatedTokenizer(engine.processor.tokenizer)
    engine.processor.tokenizer = gated  # detokenizers made from now on decode through it
    try:

        async def main():
            busy = engine.generate([5], SamplingParams(max_tokens=200), "busy")
            await busy.__anext__()  # its detokenizer exists: the next decode is the results' detokenization
            gated.armed = True
            assert await asyncio.to_thread(gated.entered.wait, 10), "the detokenizer never ran"
            t0 = time.monotonic()
            assert engine.num_pending() == 1
            # The synchronous part of generate(): validation and registering the stream, up to its first wait.
            other = engine.generate([7], SamplingParams(max_tokens=3), "other")
            started = asyncio.ensure_future(other.__anext__())
            await asyncio.sleep(0.05)
            assert engine.num_pending() == 2
            waited = time.monotonic() - t0
            gated.release.set()
            assert waited < 1.0, f"a handler waited {waited:.2f}s on the detokenizing thread"
            await started
            await busy.aclose()
            async for _ in other:
                pass

        asyncio.run(main())
    finally:
        gated.release.set()
        f.close()


def test_a_long_prompt_is_validated_off_the_event_loop(tokenizer):
    """Checking every id of a long prompt takes milliseconds: generate() does it on a worker thread."""
    from jaxinfer.engine.async_engine import VALIDATE_ON_LOOP_TOKENS

    f = FRONTS["engine-process"](tokenizer, StreamLimits())
    engine = f.engine
    threads = []
    validate = engine.validate

    def recording(prompt_ids, params):
        threads.append(threading.current_thread() is threading.main_thread())
        return validate(prompt_ids, params)

    engine.validate = recording
    try:

        async def main():
            for n in (8, VALIDATE_ON_LOOP_TOKENS + 1):
                async for _ in engine.generate([5] * n, SamplingParams(max_tokens=2), f"p{n}"):
                    pass

        asyncio.run(main())
        assert threads == [True, False]  # the short one on the loop (no thread hop), the long one off it
    finally:
        f.close()
