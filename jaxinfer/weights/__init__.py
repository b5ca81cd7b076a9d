"""Turn a model name or path into (config, params, tokenizer): HF directories, GGUF files, orbax checkpoints.

GGUF files are dequantized once and cached as an orbax checkpoint (keyed by the file's path, size and mtime and
the dtype), so the second start restores instead of converting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxinfer.config import FLOAT16_UNSTABLE, ModelConfig, UnsupportedConfigError, from_gguf_metadata
from jaxinfer.device import resolve_dtype
from jaxinfer.gguf_file import read_gguf
from jaxinfer.model.transformer import Params, abstract_model
from jaxinfer.model_files import resolve_model_path
from jaxinfer.weights.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    is_checkpoint,
    read_config,
    restore_checkpoint,
    save_checkpoint,
)
from jaxinfer.weights.gguf_loader import load_gguf
from jaxinfer.weights.hf import load_hf, read_hf_config

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Any  # jaxinfer.tokenizer.Tokenizer, or None when the checkpoint carries none
    path: Path  # where the weights were read from


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer")) / "converted"


def _cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    """The conversion cache folder: `cache_dir` (text or a path), else the default."""
    return Path(cache_dir or default_cache_dir())


def _conversion_path(path: Path, dtype: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `load_weights` keeps (and `read_model_config` looks for) the conversion of GGUF file `path` to dtype."""
    return _cache_folder(cache_dir) / _cache_key(path, dtype)


def _cache_key(path: Path, dtype: str) -> str:
    st = path.stat()
    # The checkpoint format is part of the key: caches are shared by every jaxinfer on the machine, and one
    # written in another layout must never be read (or deleted as damaged) by this one.
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}|v{FORMAT_VERSION}"
    return f"{path.stem}-{dtype}-v{FORMAT_VERSION}-{hashlib.sha1(raw.encode()).hexdigest()[:12]}"


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype the weights are stored in: an HF config.json's `torch_dtype` (transformers 5: `dtype`), a jaxinfer
    checkpoint's; None for GGUF (quantized blocks, dequantized on load) or when the checkpoint does not say."""
    if is_checkpoint(path):
        return read_config(path).dtype
    if path.is_dir() and (path / "config.json").exists():
        try:
            raw = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError:
            return None  # read_hf_config reports the broken file with its name
        for cfg in (raw, raw.get("text_config") or {}):  # multimodal wrappers may keep it on the text tower only
            value = cfg.get("torch_dtype") or cfg.get("dtype")
            if value:
                return str(value).removeprefix("torch.")
    return None


def load_weights(
    model: str | Path,
    dtype: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    mesh: Mesh | None = None,
) -> tuple[ModelConfig, Params, Path]:
    """(config, params, path of the original weights). With a mesh, params are placed shard by shard and the
    config is the one they fit (see `jaxinfer.sharding.sharded_config`). `dtype` "auto": see
    `jaxinfer.device.auto_dtype` (float32 on CPU; the checkpoint's half precision, or bfloat16, on GPU/TPU)."""
    path, kind = _locate(model)
    backend = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    asked, dtype = dtype, resolve_dtype(dtype, backend, checkpoint_dtype(path) if dtype == "auto" else None)
    # What the metadata alone can refuse is refused before a GGUF is converted (seconds).
    meta = read_model_config(path, dtype) if dtype == "float16" or mesh is not None else None
    if dtype == "float16" and meta.arch in FLOAT16_UNSTABLE:
        if asked != "auto":  # as vLLM: refused, not served as NaN (every token then <pad>, every logprob -inf)
            raise UnsupportedConfigError(f"dtype float16: {meta.arch} models' activations overflow float16 (their "
                                         "outputs become NaN); use bfloat16 or float32")  # fmt: skip
        dtype = "bfloat16"  # a float16 checkpoint: its own precision is the one it cannot run in
    if mesh is not None:  # an impossible mesh
        from jaxinfer.sharding import MODEL, check_tensor_parallel

        check_tensor_parallel(meta, mesh.shape[MODEL])
    if kind == "checkpoint":
        cfg, params, source = _restore(path, dtype, mesh)
        # `jaxinfer convert` copies the source's tokenizer (an HF directory's files; a GGUF's as
        # `Tokenizer.save_pretrained` writes it, or as tokenizer.gguf before that): the checkpoint then stands
        # on its own.
        own = any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer.gguf"))
        return cfg, params, path if own else Path(source.get("path", path))
    if kind == "hf":
        cfg, params = load_hf(path, dtype, mesh)
        return cfg, params, path
    if not use_cache:
        cfg, params = load_gguf(path, dtype, mesh)
        return cfg, params, path
    cached = _conversion_path(path, dtype, cache_dir)
    if not is_checkpoint(cached):
        shutil.rmtree(cached, ignore_errors=True)  # our own entry, damaged (its jaxinfer.json lost): rebuilt
        cfg, params = load_gguf(path, dtype)
        try:
            save_checkpoint(cached, cfg, params, source={"kind": "gguf", "path": str(path)})
        except OSError as e:
            log.warning("could not write conversion cache %s: %s", cached, e)
        if mesh is None:
            return cfg, params, path
        del params
    try:
        cfg, params, _ = _restore(cached, dtype, mesh)
    except (CheckpointError, ValueError) as e:  # a damaged or stale cache entry is rebuilt once, never trusted
        # The first line only: orbax's message quotes the whole TensorStore spec (thousands of lines).
        log.warning("ignoring damaged conversion cache %s: %s", cached, str(e).strip().split("\n", 1)[0][:500])
        shutil.rmtree(cached, ignore_errors=True)
        cfg, params = load_gguf(path, dtype)
        save_checkpoint(cached, cfg, params, source={"kind": "gguf", "path": str(path)})
        del params
        cfg, params, _ = _restore(cached, dtype, mesh)  # a second failure is a bug, not damage: it raises
    return cfg, params, path


def _locate(model: str | Path) -> tuple[Path, str]:
    """The weights' path and kind ("checkpoint", "hf" or "gguf"); raises for anything else."""
    path = resolve_model_path(str(model))
    if is_checkpoint(path):
        return path, "checkpoint"
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is neither an HF model directory (config.json) nor a jaxinfer checkpoint")
        return path, "hf"
    if path.suffix != ".gguf":
        raise ValueError(f"don't know how to load {path}: expected a .gguf file, an HF directory or a checkpoint")
    return path, "gguf"


def read_model_config(model: str | Path, dtype: str = "auto") -> ModelConfig:
    """The model's config as `load_weights(model, dtype)` reads it on one device, from its metadata alone (no tensor
    is read: a GGUF file's `tie_word_embeddings`, which its tensors decide, is left at the default, unless a converted
    copy in the default cache gives it, in ~1 ms instead of the header's ~60). Tens of ms at most, so that a caller
    can start what depends on the model's shape (a kernel's build) while the weights load."""
    path, kind = _locate(model)
    dtype = resolve_dtype(dtype, jax.default_backend(), checkpoint_dtype(path) if dtype == "auto" else None)
    if kind == "checkpoint":
        return read_config(path, dtype)
    if kind == "hf":
        return read_hf_config(path, dtype)
    cached = _conversion_path(path, dtype)
    if is_checkpoint(cached):  # converted before (load_weights' cache): its config, without parsing the GGUF's header
        with contextlib.suppress(CheckpointError, ValueError):  # a damaged one, which load_weights rebuilds
            return read_config(cached, dtype)
    return from_gguf_metadata(read_gguf(path, tensors=False).metadata, dtype=dtype)


# The sampling fields vLLM takes from generation_config.json, and transformers' GenerationConfig defaults: a value
# equal to the default is not an override (vLLM reads the file's diff against them).
_SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def sampling_defaults(model: str | Path) -> dict[str, float | int]:
    """The sampling settings a model's generation_config.json recommends (an HF directory's, or the copy a
    checkpoint converted from one holds): those of temperature, top_p, top_k, min_p and repetition_penalty that
    differ from transformers' defaults, and its max_new_tokens as `max_tokens` (vLLM's default output length for
    requests that set none). {} for a GGUF file or a directory without the file."""
    path, kind = _locate(model)
    file = path / "generation_config.json"
    if kind == "gguf" or not file.is_file():
        return {}
    try:
        gen = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not JSON: {e}") from e
    out = {}
    for name, default in _SAMPLING_FIELDS.items():
        value = gen.get(name) if isinstance(gen, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool) and value != default:
            out[name] = value
    cap = gen.get("max_new_tokens") if isinstance(gen, dict) else None
    if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1:
        out["max_tokens"] = cap
    return out


def _restore(path: Path, dtype: str, mesh: Mesh | None) -> tuple[ModelConfig, Params, dict]:
    """Restores a checkpoint onto one device, or onto a mesh: straight into the shards when no KV head needs
    replicating, else through the host."""
    if mesh is None:
        return restore_checkpoint(path, dtype=dtype)
    from jaxinfer.sharding import MODEL, check_tensor_parallel, kv_replication, place_state, state_shardings

    cfg = read_config(path, dtype)
    check_tensor_parallel(cfg, mesh.shape[MODEL])
    if kv_replication(cfg, mesh.shape[MODEL]) == 1:
        return restore_checkpoint(path, shardings=state_shardings(abstract_model(cfg)[1], mesh), dtype=dtype)
    with jax.default_device(jax.devices("cpu")[0]):
        cfg, params, source = restore_checkpoint(path, dtype=dtype)
    cfg, params = place_state(cfg, params, mesh)
    return cfg, params, source


def load_model(model: str | Path, dtype: str = "auto", with_tokenizer: bool = True, **kwargs: Any) -> LoadedModel:
    """Config, params and tokenizer for a model name (preset), GGUF file, HF directory or checkpoint.
    `with_tokenizer=False`: no tokenizer (None), for a caller that brings its own (the model may have none)."""
    cfg, params, path = load_weights(model, dtype, **kwargs)
    cache_dir = _cache_folder(kwargs.get("cache_dir")) if kwargs.get("use_cache", True) else None
    tokenizer = _load_tokenizer(path, cache_dir) if with_tokenizer else None
    return LoadedModel(cfg, params, tokenizer, path)


def _load_tokenizer(path: Path, cache_dir: Path | None) -> Any:
    """The tokenizer of the weights at `path`. A GGUF's is rebuilt from its vocabulary, which takes seconds for a large
    one (Gemma 3: ~3 s of a ~13 s warm start), so the first load keeps it in `cache_dir` as a Hugging Face tokenizer
    directory (`Tokenizer.save_pretrained`), read back in about a third of that. None: no cache (`use_cache=False`)."""
    from jaxinfer.tokenizer import load_tokenizer

    if path.suffix != ".gguf" or cache_dir is None:
        return load_tokenizer(path)
    saved = cache_dir / _tokenizer_cache_key(path)
    if (saved / "tokenizer.json").is_file():
        try:
            return load_tokenizer(saved)
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception for a damaged file): rebuilt below
            log.warning("ignoring damaged tokenizer cache %s: %s", saved, str(e).strip().split("\n", 1)[0][:500])
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer = load_tokenizer(path)
    try:
        tokenizer.save_pretrained(saved)
    except OSError as e:
        log.warning("could not write tokenizer cache %s: %s", saved, e)
    return tokenizer


def _tokenizer_cache_key(path: Path) -> str:
    """The GGUF file (path, size, mtime), and the code that rebuilds its tokenizer: a change to jaxinfer.tokenizer, to
    the GGUF metadata reader it reads the vocabulary with, or to the tokenizers library never reads a tokenizer that
    the previous code built."""
    import tokenizers

    import jaxinfer.gguf_file
    import jaxinfer.tokenizer

    code = hashlib.sha1()
    for module in (jaxinfer.tokenizer, jaxinfer.gguf_file):
        code.update(Path(module.__file__).read_bytes())
    return _cache_key(path, f"tokenizer-{code.hexdigest()[:12]}-tk{tokenizers.__version__}")
