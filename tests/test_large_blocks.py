"""host_memory.reuse_large_blocks: a freed block larger than a thread's own arena holds is reused from the heap, not
mapped again with every page faulting in (what XLA:CPU's per-call temporaries paid), and build_engine sets it up
before anything starts jax."""

from __future__ import annotations

import subprocess
import sys

import pytest

import jaxinfer.engine.build as build
from jaxinfer.engine.config import EngineArgs

# A thread allocates an 80 MB block with libc's malloc (as XLA's runtime does), touches it and frees it, three
# times (a 128-row decode step's temporaries are 75.6 MB, above the 64 MiB a thread's own arena holds), and prints
# the page faults of the last round.
_CHILD = """
import ctypes, ctypes.util, resource, sys, threading
from jaxinfer.host_memory import reuse_large_blocks
if sys.argv[1] == "reuse":
    assert reuse_large_blocks()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size, faults = 80_000_000, []
def rounds():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        libc.free(block)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(faults[-1])
"""


def _last_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings")
def test_a_freed_large_block_is_reused_without_faulting_its_pages_again():
    pages = 80_000_000 // 4096
    assert _last_round_faults("default") > pages // 2  # glibc's own settings: a fresh mapping every round
    assert _last_round_faults("reuse") < pages // 20


def test_build_engine_sets_it_up_before_jax_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "reuse_large_blocks", lambda: calls.append("reuse"))

    def check_device(device):
        calls.append("device")
        raise RuntimeError("stop here")

    monkeypatch.setattr(build, "check_device", check_device)
    with pytest.raises(RuntimeError, match="stop here"):
        build.build_engine(EngineArgs(model="unused"))
    assert calls == ["reuse", "device"]
