"""The side child: heavy, self-contained test files run in a child pytest beside the main one (tests/children.py).

What runs here is what the main process would have run: when the launcher (tests/test_side_child.py) is collected,
the main process hands over its collected tests of FILES (shown as deselected there) by node id, and the child
runs exactly those. These files were picked because they spend their time on one core (numba builds, compiles in
child processes, transformers' GGUF parsing and tokenizer conversion), share no fixtures with other files, and time
nothing. Together they took ~330 s of a 19-minute main process on the 2-core CI class.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests import children, eight_devices

NAME = "side"
_IDS = "JAXINFER_SIDE_CHILD"  # in the child: the file listing the node ids it runs
CHILD = _IDS in os.environ

# In the order they run: the kernel's float16 and any-head-dim handlers are built first, which the main process's
# engine tests load from numba's cache later.
FILES = (
    "tests/kernels/test_ragged_cpu.py",
    "tests/engine/test_exec_cache.py",
    "tests/test_tokenizer.py",
    "tests/model/test_gguf_models.py",
    "tests/model/test_checkpoint.py",
    "tests/notebooks/test_notebooks.py",
    # Engines compiled lazily, bucket by bucket, on one core: 70-75 s each file on a cold cache (2026-12-07), when
    # the main process was the run's long pole (the launcher never waited on this child).
    "tests/engine/test_layer_loop.py",
    "tests/engine/test_overlap.py",
)
LAUNCHER = "tests/test_side_child.py"

_handed_over: list[str] = []


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest_collection_modifyitems: in the main process, with the launcher collected, hands the collected tests of
    FILES over to the child; in the child, keeps the tests handed over."""
    if CHILD:
        with open(os.environ[_IDS], encoding="utf-8") as f:
            wanted = set(f.read().split("\n"))
        items[:] = [i for i in items if i.nodeid in wanted]
        return
    if eight_devices.CHILD or not children.collected(items, LAUNCHER):
        return
    handed = [i for i in items if _file(i) in FILES]
    if handed:
        items[:] = [i for i in items if _file(i) not in FILES]
        config.hook.pytest_deselected(items=handed)
        _handed_over[:] = [i.nodeid for i in handed]


def start_with_session() -> None:
    """Starts the child over the tests handed over, if any (after `select`)."""
    if not _handed_over or children.has_started(NAME):
        return
    ids = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8")
    with ids:
        ids.write("\n".join(_handed_over))
    files = [f for f in FILES if any(n.startswith(f + "::") for n in _handed_over)]
    children.start(NAME, files, {_IDS: ids.name}, temp=ids.name)


def handed_over() -> bool:
    return bool(_handed_over)
