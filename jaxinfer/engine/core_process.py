"""The engine core in a process of its own: the device loop never shares a GIL with HTTP, JSON or detokenization.

`MPAsyncEngine` (jaxinfer.engine.mp_engine) starts `run_core` with multiprocessing's *spawn* context (jax is not
fork-safe) and binds two ipc:// sockets in a temporary directory; the core connects to both:

    API --PUSH--> commands --PULL--> core      ["add", rid, prompt_ids, params] | ["abort", rid] |
                                               ["finish", seq_id, reason, stop_reason] | ["shutdown"]
    API <--PULL-- results  <--PUSH-- core      {"t": "ready", ...facts} | {"t": "failed", "type", "error"} |
                                               {"t": "out", "u": [update, ...], "s": stats} |
                                               {"t": "err", "rid", "error"} | {"t": "dead", "type", "error"}

Every message is one msgpack frame. An update is [seq_id, new_token_ids, new_logprobs, finished, finish_reason,
stop_reason, prompt_logprobs, error, timing] (a `SeqUpdate`: only what the step added, never the whole output
again; timing, a `SeqTiming` as a list, only with the first token);
stats are the gauges and counters /metrics shows. "ready" also
carries what the API side needs without the model: the limits `Engine.validate` checks and the tokenizer (pickled
bytes inside that one frame; everything else is plain data).

Neither side ever blocks on a send, so neither can wait for the other: back-pressure without deadlock. Both
sockets have high-water marks (RESULTS_HWM, COMMANDS_HWM messages). When the API side falls behind, the core keeps
what it cannot send in its outbox (outbox.py) and merges each later step's updates into it, so what waits is
bounded by the tokens the live sequences made (a delta per sequence), not by the steps; when the core falls
behind, the API side keeps its commands in a local queue, sent in order before any later one (mp_engine.py). The
core reads commands without blocking while it has work (blocking only when idle, and then only for a few
milliseconds while its outbox holds something). It ignores SIGINT/SIGTERM (the API
server drains first, then sends "shutdown") and exits by itself when its parent process goes away.

Spawn re-imports the parent's main module in the child: a script that starts the server must keep that under
`if __name__ == "__main__":` (serve.py does).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from jaxinfer.config import ModelConfig
from jaxinfer.engine.outbox import RESULTS_HWM, ResultsOutbox
from jaxinfer.errors import user_errors
from jaxinfer.host_memory import freeze_for_good, gc_paused
from jaxinfer.startup import compile_deferred, pending_compiles, prepare_grammars
from jaxinfer.types import SamplingParams, SeqTiming, SeqUpdate

log = logging.getLogger(__name__)

# How often the core checks that the API server (its parent) is still there.
PARENT_POLL_S = 0.5
# How long a closing socket may keep trying to deliver its last messages (the failure that ends the core).
LINGER_MS = 2000
COMMANDS_HWM = 1024  # commands queued towards the core before the API side keeps them in its own queue
IDLE_RETRY_MS = 5  # while idle with results the API side has not taken yet: how often the core retries


# ---------------------------------------------------------------------------------------------- wire format


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # Logprob dicts are keyed by token id: int map keys must be allowed.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def params_to_wire(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


def params_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**d)  # lists become tuples again in __post_init__


def update_to_wire(u: SeqUpdate) -> list:
    return [u.request_id, u.new_token_ids, u.new_logprobs, u.finished, u.finish_reason, u.stop_reason,
            u.prompt_logprobs, u.prompt_ranks, u.error,
            u.timing.to_wire() if u.timing is not None else None]  # fmt: skip


def outputs_to_wire(updates: list[SeqUpdate], stats: dict) -> bytes:
    return pack({"t": "out", "u": [update_to_wire(u) for u in updates], "s": stats})


def update_from_wire(w: list) -> SeqUpdate:
    rid, toks, lps, finished, reason, stop_reason, prompt_lps, prompt_ranks, error, timing = w
    return SeqUpdate(rid, toks, lps or [], finished, reason, stop_reason, prompt_lps, prompt_ranks, error,
                     SeqTiming.from_wire(timing) if timing is not None else None)  # fmt: skip


def engine_stats(engine: Any) -> dict:
    """The gauges and counters /metrics shows (DataParallelEngine sums its replicas the same way)."""
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "pages_used": engine.allocator.num_used,
        "pages_total": engine.allocator.num_pages,
        "hit_rate": engine.allocator.hit_rate,
        "prefilled_tokens": engine.num_prefilled_tokens,
        "generated_tokens": engine.num_generated_tokens,
        "steps": engine.num_steps,
        "compiles": compile_count(),
        "pending_compiles": pending_compiles(engine),
        "cache": engine.cache_stats(),  # sessions and host tier (Engine.cache_stats)
        **timeline_stats(engine),
    }


def compile_count() -> int:
    """XLA compilations in this process so far (0 where jax was never imported): serving must add none."""
    runner = sys.modules.get("jaxinfer.engine.runner")
    return runner.compile_count() if runner is not None else 0


def timeline_stats(engine: Any) -> dict:
    """Device busy/idle and host time per step over the recent steps, when a StepTimeline records them."""
    timeline = getattr(getattr(getattr(engine, "replicas", [engine])[0], "runner", None), "timeline", None)
    if timeline is None:
        return {}
    s = timeline.live_summary()  # never waits for the step in flight
    if not s.get("steps"):
        return {}
    return {"idle_share": s["idle_share"], "device_ms": s["device_ms"], "host_ms": s["host_ms"]}


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def engine_facts(engine: Any, tokenizer: Any) -> dict:
    """What the API side needs from the engine: `Engine.validate`'s inputs, the limits the handlers check."""
    # DataParallelEngine: the API side checks the largest replica's limits; the core routes to one that fits.
    first = engine.largest()
    return {
        # A user module's own ModelConfig subclass: the API side reads only the base fields (and imports no module).
        "config": {k: v for k, v in first.cfg.to_dict().items() if k in _CONFIG_FIELDS},
        "cache": dataclasses.asdict(first.cc),
        "num_kv_tokens": first.runner.num_kv_tokens,
        "eos_token_ids": list(first.eos_token_ids),
        "max_model_len": engine.cc.max_model_len,
        "max_logprobs": engine.cc.max_logprobs,
        "sampling_defaults": engine.sampling_defaults,
        "tokenizer": pickle.dumps(tokenizer),
        "stats": engine_stats(engine),
        "pid": os.getpid(),
    }


# ---------------------------------------------------------------------------------------------- the process


def _watch_parent(parent_pid: int, socket_dir: str) -> None:
    """Exits the process once the API server is gone (killed, crashed): a core must never outlive it."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                log.warning("the API server (pid %d) is gone: engine core exiting", parent_pid)
                shutil.rmtree(socket_dir, ignore_errors=True)  # the server had no chance to
                os._exit(1)

    threading.Thread(target=watch, name="jaxinfer-parent-watch", daemon=True).start()


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)  # fmt: skip
    if level != "debug":
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every restore step at info


def run_core(args: dict, commands_addr: str, results_addr: str, parent_pid: int, build: Callable | None = None) -> None:
    """The spawned process's entry point. `args` are the server's `ServerArgs` fields; `build(args)` -> (engine,
    tokenizer), warmed up (default: the server's loader, then every step shape compiled); tests pass their own."""
    # Ctrl-C reaches the whole process group and a supervisor may signal it too: the API server decides when the
    # core stops (after draining), or the core notices that the server is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _configure_logging(args.get("log_level", "info"))
    _watch_parent(parent_pid, os.path.dirname(commands_addr.removeprefix("ipc://")))
    # tqdm (the warm-up's progress bar) guards its writes with a multiprocessing lock, a named semaphore the parent's
    # resource tracker is told of; this process ends with os._exit, which skips unlinking it, and the server's exit
    # then warned of a "leaked semaphore". One process writes this bar: a thread lock is all it needs.
    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, COMMANDS_HWM)
    commands.connect(commands_addr)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.SNDHWM, RESULTS_HWM)  # past it, the outbox holds and merges: the loop never blocks
    results.setsockopt(zmq.LINGER, LINGER_MS)
    results.connect(results_addr)
    outbox = ResultsOutbox(results, pack, outputs_to_wire)
    code = 0
    try:
        try:
            engine, tokenizer = (build or _build)(args)
            facts = engine_facts(engine, tokenizer)
        except BaseException as e:
            # The server names the error in its one line ("exiting: loading the model failed: ..."): the traceback
            # too only for a bug, not for a bad model path or setting (--log-level debug shows it there as well).
            level = logging.DEBUG if isinstance(e, user_errors()) else logging.ERROR
            log.log(level, "loading the model failed", exc_info=True)
            outbox.message({"t": "failed", "type": type(e).__name__, "error": str(e)})
            code = 1
            return
        freeze_for_good()
        outbox.message({"t": "ready", **facts})
        try:
            EngineCore(engine, commands, outbox).run()
        except BaseException as e:
            log.exception("engine core died")
            outbox.message({"t": "dead", "type": type(e).__name__, "error": str(e)})
            code = 1
    finally:
        outbox.drain(LINGER_MS)  # the last outputs and the message that says why the core ends
        commands.close(linger=0)
        results.close()  # delivers what is queued, for up to LINGER_MS
        ctx.term()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a plain return: interpreter teardown under live XLA threads can abort; nothing is left to clean.
        os._exit(code)


@gc_paused()  # jax's and flax's imports too: they happen here, in this process
def _build(args: dict) -> tuple[Any, Any]:
    """The engine for the server's settings: the EngineArgs among them (the HTTP flags stay with the server)."""
    from jaxinfer.engine.build import build_engine
    from jaxinfer.engine.config import EngineArgs
    from jaxinfer.startup import seconds_since_start, summary, warm_up

    t0 = time.perf_counter()
    engine, tokenizer = build_engine(EngineArgs.from_mapping(args))
    load_s = time.perf_counter() - t0
    # Every program variant a request can select, prompt logprobs (echo + logprobs) included: the plain ones of the
    # most rows now, the fewer-row mixed steps and the rarer ones while the core is idle (EngineCore.run), so the
    # server is ready sooner.
    warm = warm_up(engine, prompt_logprobs=True, defer=True)
    log.info("compiled steps warmed up in %.1fs", warm.seconds)
    # Time to ready counts from the API server's start (our parent), as the user sees it.
    log.info("%s", summary(engine, args["model"], load_s, warm, seconds_since_start(os.getppid())))
    return engine, tokenizer


class EngineCore:
    """The loop: apply every queued command, run one step, send its updates. Blocks only when idle."""

    def __init__(self, engine: Any, commands: zmq.Socket, outbox: ResultsOutbox):
        self.engine = engine
        self.commands = commands
        self.outbox = outbox
        self.running = True

    def run(self) -> None:
        engine = self.engine
        while self.running:
            self.outbox.flush()
            if not engine.has_unfinished():  # idle: wait for a command (retrying the outbox meanwhile)
                if pending_compiles(engine) and not self.commands.poll(0):
                    compile_deferred(engine)  # a second or so: commands wait that long at most
                    self.outbox.outputs([], engine_stats(engine))  # /metrics sees the count go down
                    continue
                if not self.commands.poll(0) and prepare_grammars(engine):
                    continue
                if not self.commands.poll(IDLE_RETRY_MS if self.outbox.pending else 1000):
                    engine.expire_sessions()  # idle: pinned conversations still time out
                    continue
            changed = self._drain_commands()
            if not self.running:
                return
            if engine.has_unfinished():
                self.outbox.outputs(engine.step(), engine_stats(engine))
            elif changed:  # pages came back (aborts) without a step: /metrics must see it
                self.outbox.outputs([], engine_stats(engine))

    def _drain_commands(self) -> bool:
        """Applies every command already queued, without waiting; returns whether there was any."""
        n = 0
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return n > 0
            n += 1
            cmd = unpack(raw)
            op = cmd[0]
            if op == "add":
                _, rid, ids, params = cmd
                try:
                    self.engine.add_request(ids, params_from_wire(params), rid)
                except Exception as e:  # validated by the API side already; a race must not kill the loop
                    self.outbox.message({"t": "err", "rid": rid, "error": str(e)})
            elif op == "abort":
                self.engine.abort(cmd[1])
            elif op == "finish":
                _, sid, reason, stop_reason = cmd
                self.engine.finish_sequence(sid, reason, stop_reason)
            elif op == "shutdown":
                log.info("engine core: shutting down")
                self.engine.release_sessions()
                self.running = False
                return True
            else:
                log.warning("engine core: unknown command %r", op)
