"""Load an HF checkpoint directory: config.json plus *.safetensors (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from jaxinfer.config import ModelConfig, from_hf_config
from jaxinfer.model.transformer import Params
from jaxinfer.weights.layout import build_on_mesh

# Multimodal and wrapper checkpoints keep the text model under another prefix.
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.", ""),
)


def read_hf_config(path: Path, dtype: str = "float32") -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
    return from_hf_config(raw, dtype=dtype)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from e
        missing = {f for f in weight_map.values() if not (path / f).exists()}
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {sorted(missing)}")
        return {name: path / f for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    out = {}
    for f in files:
        with _opened(f, "numpy") as sf:
            out.update({k: f for k in sf.keys()})
    return out


def _opened(f: Path, framework: str):
    """safe_open, its errors naming the file (safetensors' own name none: "invalid header length")."""
    try:
        return safe_open(f, framework=framework)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f} is not a readable safetensors file: {e}") from e


def _canonical(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def load_hf(path: str | Path, dtype: str = "float32", mesh: Mesh | None = None) -> tuple[ModelConfig, Params]:
    path = Path(path)
    cfg = read_hf_config(path, dtype)
    files = {_canonical(k): (k, f) for k, f in _tensor_files(path).items()}
    if "lm_head.weight" not in files and not cfg.tie_word_embeddings:
        raise ValueError(f"{path}: config says tie_word_embeddings=False but the checkpoint has no lm_head.weight")
    handles: dict[Path, object] = {}

    def get(name: str) -> np.ndarray | None:
        if name not in files:
            return None
        key, f = files[name]
        if f not in handles:
            handles[f] = _opened(f, "flax")
        # NOTE: safetensors' numpy backend cannot read bf16; its flax backend can, so we read through it on
        # the host CPU device and keep a host array until `place` puts it (or only its shard) on a device.
        with jax.default_device(jax.devices("cpu")[0]):
            return np.asarray(handles[f].get_tensor(key))

    return build_on_mesh(cfg, get, dtype, mesh)
