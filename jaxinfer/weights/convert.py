"""CLI: convert a GGUF file or HF directory into a jaxinfer orbax checkpoint that starts without conversion.

python -m jaxinfer.weights.convert SRC DST [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from jaxinfer.model_files import resolve_model_path
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.weights import load_weights
from jaxinfer.weights.checkpoint import CheckpointError, is_checkpoint, save_checkpoint

# Files of an HF directory (or of a checkpoint converted before) that the tokenizer loader reads; copied so the
# checkpoint stands on its own.
_TOKENIZER_FILES = (
    "tokenizer.gguf",  # a checkpoint converted from a GGUF before tokenizers were saved whole
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def convert(src: str, dst: str | Path, dtype: str = "float32") -> Path:
    """Writes `src` as a checkpoint at `dst`: a new or empty directory, or a checkpoint to replace (never the
    source, nor a directory holding anything else: CheckpointError)."""
    dst = Path(dst)
    if dst.exists() and resolve_model_path(src).resolve() == dst.resolve():
        raise CheckpointError(f"{dst} is the source: write the checkpoint elsewhere")
    cfg, params, path = load_weights(src, dtype=dtype, use_cache=False)
    kind = "gguf" if path.suffix == ".gguf" else "checkpoint" if is_checkpoint(path) else "hf"
    save_checkpoint(dst, cfg, params, source={"kind": kind, "path": str(path.resolve())})
    if kind != "gguf":
        for name in _TOKENIZER_FILES:
            if (path / name).exists():
                shutil.copy(path / name, dst / name)
    else:  # the rebuilt tokenizer itself, which a start reads back without rebuilding the GGUF's vocabulary
        load_tokenizer(path).save_pretrained(dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxinfer-convert", description=__doc__)
    ap.add_argument("src", help="preset name, GGUF file or HF directory")
    ap.add_argument("dst", help="output checkpoint directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = convert(args.src, args.dst, args.dtype)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
