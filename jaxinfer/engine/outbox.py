"""The engine core's results on their way to the API process, without ever blocking the device loop.

The results socket has a high-water mark (RESULTS_HWM messages queued towards the API process): when the API side
falls that far behind (its reader starved of CPU, a burst), a send would block. The core never waits: what it
could not send stays here, and each later step's updates are merged into the newest message not sent yet (a
sequence's new tokens appended to its pending ones, the latest stats kept), so what waits is bounded by the
tokens the live sequences made, not by the number of steps. The loop retries at every turn, and every few
milliseconds while idle. Messages keep their order; only consecutive step outputs merge.

No deadlock: the core never blocks on a send and drains its commands every turn; the API side never blocks on a
send either (mp_engine.py) and its reader only receives.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

import zmq

from jaxinfer.types import SeqUpdate

RESULTS_HWM = 256  # messages (one per step) queued towards the API process before the core coalesces


class _Outputs:
    """A step output not sent yet: updates by sequence id (in order of arrival), the latest stats."""

    def __init__(self, updates: list[SeqUpdate], stats: dict):
        self.updates: dict[str, SeqUpdate] = {}
        self._owned: set[str] = set()  # sequences whose token and logprob lists here are ours to extend
        self.stats = stats
        self.add(updates, stats)

    def add(self, updates: list[SeqUpdate], stats: dict) -> None:
        """Merges each sequence's update into the one waiting: the tokens of both, everything else the newer
        one's. In place, so that merging stays linear in the tokens however far behind the API side is."""
        for u in updates:
            sid = u.request_id
            old = self.updates.get(sid)
            if old is None:
                self.updates[sid] = u
                continue
            tokens, logprobs = old.new_token_ids, old.new_logprobs or []
            if sid not in self._owned:  # the engine's lists: copied once, then extended
                tokens, logprobs = list(tokens), list(logprobs)
                self._owned.add(sid)
            tokens.extend(u.new_token_ids)
            logprobs.extend(u.new_logprobs or [])
            self.updates[sid] = dataclasses.replace(
                u, new_token_ids=tokens, new_logprobs=logprobs,
                # What only the first token's update carries is kept from it.
                prompt_logprobs=old.prompt_logprobs if old.prompt_logprobs is not None else u.prompt_logprobs,
                prompt_ranks=old.prompt_ranks if old.prompt_ranks is not None else u.prompt_ranks,
                timing=old.timing if old.timing is not None else u.timing,
                error=u.error if u.error is not None else old.error,
            )  # fmt: skip
        self.stats = stats


class ResultsOutbox:
    def __init__(self, socket: zmq.Socket, encode: Callable[[dict], bytes],
                 encode_outputs: Callable[[list[SeqUpdate], dict], bytes]):  # fmt: skip
        """`encode`: a message -> one frame; `encode_outputs`: (updates, stats) -> an "out" message's frame (the
        wire format lives in core_process.py)."""
        self.socket = socket
        self._encode, self._encode_outputs = encode, encode_outputs
        self._queue: deque[dict | _Outputs] = deque()

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def outputs(self, updates: list[SeqUpdate], stats: dict) -> None:
        """A step's updates (and the engine's stats): merged into the newest output not sent yet, if any."""
        tail = self._queue[-1] if self._queue else None
        if isinstance(tail, _Outputs):
            tail.add(updates, stats)
        else:
            self._queue.append(_Outputs(updates, stats))
        self.flush()

    def message(self, msg: dict) -> None:
        """Any other message ("err", ...): sent in order, never merged."""
        self._queue.append(msg)
        self.flush()

    def flush(self) -> None:
        """Sends what waits, oldest first, until the socket would block."""
        while self._queue:
            if not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                return  # full: asked first, so that a large merged message is not encoded for nothing each step
            head = self._queue[0]
            if isinstance(head, _Outputs):
                data = self._encode_outputs(list(head.updates.values()), head.stats)
            else:
                data = self._encode(head)
            try:
                self.socket.send(data, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._queue.popleft()

    def drain(self, timeout_ms: int) -> bool:
        """Blocks up to `timeout_ms` to send everything (the core is ending); whether it all went."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLOUT)
        deadline = time.monotonic() + timeout_ms / 1000
        self.flush()
        while self._queue:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not poller.poll(left_ms):
                return False
            self.flush()
        return True
