"""A family's nnx state saved and restored with orbax, so a second start skips dequantization and conversion.

A checkpoint directory holds `jaxinfer.json` (format version, ModelConfig, where the weights came from) and
`params/` (an orbax StandardCheckpointer tree of the state's pure dict, `nnx.State.to_pure_dict()`). Restoring
takes the expected shapes (and logical axes) from the abstract module of the config, so a checkpoint that does
not match its own config, or that is truncated, fails loudly.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.model.transformer import Params, abstract_model, check_params

# 4: the output projection's kernel f[D, H*Dh] (3 had f[D, H, Dh]); 3: kernels output-major, f[*out, *in] (2 had them
# input-major; 1 was the dict-of-arrays layout before Flax NNX).
FORMAT_VERSION = 4
META_FILE = "jaxinfer.json"


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or corrupt."""


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).exists()


def save_checkpoint(path: str | Path, cfg: ModelConfig, params: Params, source: dict[str, Any] | None = None) -> None:
    """Writes atomically: into a temporary sibling, then renamed, so a crash never leaves a half checkpoint.
    The sibling is this process's own: processes converting the same file at once (the shared GGUF conversion
    cache) never write into one another's directory."""
    path = Path(path).absolute()
    if path.exists() and not is_checkpoint(path) and not (path.is_dir() and not any(path.iterdir())):
        # Replaced whole below: only a checkpoint (a conversion cache entry, a convert run again) or nothing.
        raise CheckpointError(f"{path} exists and is not a jaxinfer checkpoint: not overwritten")
    check_params(cfg, params)
    _remove_abandoned_siblings(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / "params", nnx.to_pure_dict(params))
        ckptr.wait_until_finished()
        meta = {"format_version": FORMAT_VERSION, "config": cfg.to_dict(), "source": source or {}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    except BaseException:  # Ctrl-C or a full disk: a model's worth of half-written files is not left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    try:
        tmp.rename(path)
    except OSError:
        if not is_checkpoint(path):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same checkpoint first


# A temporary sibling this old belongs to a writer that was killed (SIGKILL, a power cut): a conversion takes seconds.
_ABANDONED_AFTER_S = 3600.0


def _remove_abandoned_siblings(path: Path) -> None:
    """Deletes the temporary siblings of `path` that killed writers left (each a model's size), when their process
    is gone from this host and they have not changed for an hour (a cache shared by hosts: another's may be live)."""
    for tmp in path.parent.glob(f"{glob.escape(path.name)}.tmp-*-*"):
        pid = tmp.name.rsplit("-", 2)[-2]
        try:
            old = time.time() - tmp.stat().st_mtime > _ABANDONED_AFTER_S
        except OSError:
            continue  # gone meanwhile
        if old and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    meta_file = path / META_FILE
    if not meta_file.exists():
        raise CheckpointError(f"{path} is not a jaxinfer checkpoint (no {META_FILE})")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file} is corrupt: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {meta.get('format_version')!r}; this jaxinfer reads {FORMAT_VERSION}"
        )
    return meta


def read_config(path: str | Path, dtype: str | None = None) -> ModelConfig:
    cfg = _config(path, read_meta(path))
    return cfg if dtype is None else cfg.replace(dtype=dtype)


def _config(path: str | Path, meta: dict[str, Any]) -> ModelConfig:
    """The checkpoint's config; CheckpointError naming the checkpoint for one no ModelConfig takes (edited)."""
    try:
        return ModelConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{META_FILE} of {path} holds no valid config: {type(e).__name__}: {e}") from e


def _default_device() -> jax.Device:
    """The device a new array lands on: `jax.default_device`'s where one is set, else this process's first."""
    device = jax.config.jax_default_device
    if isinstance(device, str):  # the setting also takes a platform name
        return jax.local_devices(backend=device)[0]
    return device or jax.local_devices()[0]


def restore_checkpoint(
    path: str | Path, shardings: Any = None, dtype: str | None = None
) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Returns (config, params, source). `shardings`, an nnx state of jax.sharding.Sharding with the params'
    structure (see `jaxinfer.sharding.state_shardings`), restores every array straight into its shards."""
    path = Path(path).absolute()
    meta = read_meta(path)
    cfg = _config(path, meta)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path} is incomplete: the params/ directory is missing")
    abstract = abstract_model(cfg)[1]
    sh = dict(shardings.flat_state()) if shardings is not None else {}
    # Without a sharding orbax places each array as it was saved, and refuses ("Topology mismatch") where that
    # differs from now: a cache written from the CPU and read on a GPU host under `jax.default_device(cpu)`, seen on
    # an H200. So one device is always named: the one new arrays land on here.
    device = jax.sharding.SingleDeviceSharding(_default_device())
    target = nnx.map_state(
        lambda p, v: v.replace(jax.ShapeDtypeStruct(v.shape, cfg.dtype, sharding=sh[p].get_value() if sh else device)),
        abstract,
    )
    try:
        restored = ocp.StandardCheckpointer().restore(path / "params", nnx.to_pure_dict(target))
    except Exception as e:  # orbax raises many types for truncated/foreign data
        raise CheckpointError(f"checkpoint at {path} is corrupt or incomplete: {type(e).__name__}: {e}") from e
    params = jax.tree.map(lambda x: x, abstract)  # a copy to fill
    nnx.replace_by_pure_dict(params, restored)
    check_params(cfg, params)
    return cfg, params, meta.get("source", {})
