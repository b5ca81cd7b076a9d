"""host_memory.gc_paused: the collector is off and the heap frozen inside, and both restored after, across nesting,
threads and exceptions; the engine's start-up phases run inside it."""

from __future__ import annotations

import gc
import threading

import pytest

import jaxinfer.engine.build as build
from jaxinfer.engine.config import EngineArgs
from jaxinfer.host_memory import gc_paused
from tests.tiny_model import write_tiny_model


@pytest.fixture
def collector():
    """Starts unfrozen; leaves the collector as it found it, unfrozen, whatever a test did."""
    was = gc.isenabled()
    gc.unfreeze()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_inside_and_as_it_was_after(collector, enabled):
    (gc.enable if enabled else gc.disable)()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled() == enabled


def test_objects_from_before_are_frozen_inside_and_thawed_after(collector):
    older = [[] for _ in range(100)]
    with gc_paused():
        frozen = gc.get_freeze_count()
        assert frozen >= len(older)
        newer = [[] for _ in range(100)]  # made inside: not frozen, so an explicit collection still sees them
        # Not frozen: the count did not grow by them. (It may shrink: another thread can free a frozen object.)
        assert gc.get_freeze_count() < frozen + len(newer)
        cycle = [newer]
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # the phase's own cyclic garbage is still collected
    assert gc.get_freeze_count() == 0


def test_a_heap_someone_froze_stays_frozen(collector):
    gc.freeze()
    frozen = gc.get_freeze_count()
    newer = [[] for _ in range(100)]  # made after the freeze: a block that froze again would add them
    with gc_paused():
        pass
    # Still frozen (a thaw drops the count to 0), and not frozen again (that adds `newer`). The count may shrink a
    # little: another thread left by an earlier test can free a frozen object (CI saw 2 go).
    assert frozen - 1000 < gc.get_freeze_count() <= frozen
    del newer


def test_nested_and_concurrent_blocks_share_one_pause(collector):
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()  # the inner block did not resume it
        t = threading.Thread(target=other)
        t.start()
        inside.wait(10)
    assert not gc.isenabled()  # the other thread's block is still open
    leave.set()
    t.join(10)
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_an_exception_inside_restores(collector):
    gc.enable()
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("x")
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_build_engine_runs_with_the_collector_paused(tmp_path, monkeypatch, collector):
    gc.enable()
    write_tiny_model(tmp_path / "tiny")
    seen = []

    def load(*args):
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0))
        raise KeyError("stop")

    monkeypatch.setattr(build, "_load", load)
    with pytest.raises(KeyError):
        build.build_engine(EngineArgs(model=str(tmp_path / "tiny")))
    assert seen == [(False, True)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_warm_up_runs_with_the_collector_paused(collector):
    from types import SimpleNamespace

    from jaxinfer.startup import warm_up

    gc.enable()
    seen = []
    runner = SimpleNamespace(deferred=[], warmup=lambda **kw: seen.append((gc.isenabled(), gc.get_freeze_count() > 0)))
    warm_up(SimpleNamespace(runner=runner), show=False)
    assert seen == [(False, True)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_heap_frozen_freezes_without_pausing(collector):
    from jaxinfer.host_memory import heap_frozen

    gc.enable()
    with heap_frozen():
        assert gc.isenabled() and gc.get_freeze_count() > 0
        with gc_paused():  # inside it: one freeze, thawed by the outer block only
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_generate_runs_with_the_heap_frozen(tmp_path, monkeypatch, collector):
    from jaxinfer import LLM, SamplingParams
    from tests.tiny_model import SETTINGS

    write_tiny_model(tmp_path / "tiny")
    with LLM(str(tmp_path / "tiny"), **SETTINGS) as llm:
        seen = []
        step = llm.engine.step
        monkeypatch.setattr(llm.engine, "step", lambda: seen.append(gc.get_freeze_count() > 0) or step())
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert seen and all(seen)
    assert gc.get_freeze_count() == 0
