"""A cache of serialized compiled steps, so a warm start skips tracing and lowering as well as XLA compilation.

jax's persistent compilation cache only skips the XLA compile: every start still traces and lowers each bucket of
the unrolled model (most of a warm start's warm-up). Here each compiled step is serialized
(`jax.experimental.serialize_executable`) into a file named by a hash of everything that changes the program:
jax/jaxlib versions, backend and devices, the target (on CPU, the host's instruction set), compile-affecting flags,
the treedef/shapes/dtypes/shardings of every dynamic argument (params pytree, KV pools, step buffers: generic over
how params are held), the static arguments (model config, layout, flags, kernel choice, mesh), the caller's extra key
(the cache config) and a hash of this package's own source files (a code change invalidates every entry). A warm
start deserializes and loads it.

Files live in `<cache dir>/jaxinfer-exec/<version>/`, jax's own persistent cache in its `jax/` folder
(`jax_cache_dir`), so `--compilation-cache-dir` moves them and `--no-compilation-cache` turns both off;
`JAXINFER_EXEC_CACHE=0` turns off only this layer. (A jax cache folder the caller set itself holds
`jaxinfer-exec/<version>/`.) Writes are atomic (temporary file + rename). An unreadable, corrupt or mismatched
entry logs one warning and compiles normally.
`<version>` names the jax/jaxlib versions and this package's source: no entry of another version can ever load,
so a process that stores entries deletes the folders of all versions but the most recently written other one
(an upgrade, or a checkout's every edit, would otherwise leave ~100 MB of dead entries each time).

Only executables XLA compiled in this process are stored. One that jax read back from its own persistent cache (the
exec entry is missing but jax's is not: after an upgrade changed the source hash, say) serializes incompletely on
XLA:CPU: the copy loads, then fails at its first run with "Function ... not found". So does the same executable when
jax's in-memory cache hands it out again for an identical program later in the process (a second engine with the
same settings, a second data-parallel replica), and that reports no event at all. So a step is stored only when
jax reported a persistent-cache miss for its compile, on the compiling thread; any other step is used, not stored.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax import monitoring
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = 3  # bump when the file layout below changes (2: format 1 entries may hold incomplete executables;
# 3: entries name the devices their executable runs on)
SUBDIR = "jaxinfer-exec"
JAX_SUBDIR = "jax"  # jax's persistent cache, inside a version folder (jax_cache_dir)
VERSION_CHARS = 16
KEEP_OTHER_VERSIONS = 1  # besides this version's folder: a downgrade or a switched checkout still starts warm
_PACKAGES = ("jaxinfer", "kernels_pallas")  # whose source is part of every key

# What deserialisation raises on a corrupt, truncated or foreign file (pickle and the runtime's loader).
LOAD_ERRORS = (
    OSError,
    EOFError,
    pickle.UnpicklingError,
    ValueError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    jax.errors.JaxRuntimeError,
)


# Persistent-cache misses on each thread (an XLA compile whose executable serializes whole), counted from jax's
# monitoring events: compiles report on their own thread.
_MISS = "/jax/compilation_cache/cache_misses"
_misses = threading.local()


def _on_event(event: str, **kwargs) -> None:
    if event == _MISS:
        _misses.count = getattr(_misses, "count", 0) + 1


monitoring.register_event_listener(_on_event)


def _persistent_misses() -> int:
    return getattr(_misses, "count", 0)


@functools.cache
def source_hash() -> str:
    """sha256 over the .py files of this package and its kernels: a code change invalidates every entry."""
    import importlib

    h = hashlib.sha256()
    for name in _PACKAGES:
        root = Path(importlib.import_module(name).__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def version() -> str:
    """The folder of this jax and this source: entries of any other version never load (their keys differ)."""
    parts = (FORMAT, jax.__version__, jaxlib.__version__, source_hash())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:VERSION_CHARS]


def default_folder() -> Path:
    """jaxinfer's own compilation cache folder, where `runner.enable_compilation_cache` puts both caches unless told
    otherwise (`--compilation-cache-dir`, $JAXINFER_COMPILE_CACHE)."""
    return Path.home() / ".cache" / "jaxinfer" / "xla"


def jax_cache_dir(base: str | os.PathLike) -> Path:
    """Where `runner.enable_compilation_cache` keeps jax's persistent cache under the cache folder `base`: inside this
    version's folder. A new version (an upgrade, an edit) then starts with jax's cache empty too, so XLA compiles
    each step afresh and the step is stored here. Were jax's cache shared between versions, it would hand an unchanged
    step out from an older version's entry, which is never stored (see the module's docstring), and every later
    start would trace, lower and read it again. Pruning a version's folder prunes its jax entries with it."""
    return Path(base) / SUBDIR / version() / JAX_SUBDIR


def remove_jax_entries(folder: Path) -> int:
    """Deletes the files jax's persistent cache writes (`<module>-<key>-cache` and its `-atime`) directly in `folder`,
    nothing else; returns how many. jax's entries of every version lived there before `jax_cache_dir`, and no
    version reads them any more."""
    doomed = [p for p in folder.iterdir() if p.is_file() and p.name.endswith(("-cache", "-atime"))]
    for p in doomed:
        p.unlink(missing_ok=True)
    if doomed:
        log.info("compilation cache: deleted %d entries of jax's cache from before version folders", len(doomed))
    return len(doomed)


def target_fingerprint(devices: list) -> int | None:
    """What XLA compiles for, as jax's own cache keys carry it (the devices' topology): on CPU it covers the host's
    instruction set. XLA:CPU compiles for the host's features and loading an executable does not check them, so an
    entry written on an AVX-512 machine into a shared cache folder (an NFS home, a container image) would stop an
    AVX2 machine's engine at its first step with an illegal instruction. None where the backend has no topology
    (jax then keys on the devices, as this key does anyway)."""
    from jax._src.lib import xla_client  # jax's cache_key.py reads the topology the same way

    try:
        return xla_client.get_topology_for_devices(devices).fingerprint()
    except jax.errors.JaxRuntimeError:
        return None


def _environment() -> tuple:
    devices = jax.devices()
    return (
        FORMAT,
        jax.__version__,
        jaxlib.__version__,
        jax.default_backend(),
        devices[0].client.platform_version,
        tuple((d.id, d.device_kind, d.process_index) for d in devices),
        target_fingerprint(devices),
        jax.process_count(),
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        os.environ.get("XLA_FLAGS", ""),
        source_hash(),
    )


def _leaf_key(x: Any) -> tuple:
    return (tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None)), getattr(x, "committed", None))


def _static_key(v: Any) -> str:
    """repr of a static argument; a Mesh's repr omits its devices, so they are added."""
    if isinstance(v, jax.sharding.Mesh):
        return f"{v!r} devices={v.device_ids.tolist()}"
    return repr(v)


def entry_key(dynamic: Mapping[str, Any], static: Mapping[str, Any], extra: Any = None) -> str:
    """The hex digest naming a compiled step's file. Builds no program: cheap next to tracing."""
    leaves, treedef = jax.tree.flatten(dict(dynamic))
    parts = (
        _environment(),
        str(treedef),
        tuple(_leaf_key(x) for x in leaves),
        tuple((k, _static_key(static[k])) for k in sorted(static)),
        repr(extra),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ExecutableCache:
    """Loads a compiled step from `directory` or compiles and stores it. Counts hits/misses for the start-up log."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.loaded = 0
        self.compiled = 0
        self.not_stored = 0  # compiled steps jax took from one of its caches: not serializable whole
        self._lock = threading.Lock()
        self._pruned = False

    @classmethod
    def from_jax_config(cls) -> ExecutableCache | None:
        """The cache under jax's persistent compilation cache dir, or None where that is off (or with several
        processes, whose executables span hosts) or JAXINFER_EXEC_CACHE=0."""
        base = jax.config.jax_compilation_cache_dir
        if not base or os.environ.get("JAXINFER_EXEC_CACHE", "1") == "0" or jax.process_count() > 1:
            return None
        jax_dir = Path(base)
        if len(jax_dir.parents) > 2 and jax_cache_dir(jax_dir.parents[2]) == jax_dir:
            return cls(jax_dir.parent)  # enable_compilation_cache's layout: jax's cache inside this version's folder
        return cls(jax_dir / SUBDIR / version())  # a jax cache folder set by the caller

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.exec"

    def load_or_compile(
        self, jitted: Callable, dynamic: Mapping[str, Any], static: Mapping[str, Any], extra: Any = None
    ) -> Callable:
        """A jax Compiled for `jitted(**dynamic, **static)`, to be called as `fn(**dynamic)`."""
        key = entry_key(dynamic, static, extra)
        path = self.path(key)
        if path.exists():
            try:
                fn = self._load(path, key)
                with self._lock:
                    self.loaded += 1
                return fn
            except LOAD_ERRORS as e:
                log.warning("executable cache: cannot load %s (%s: %s); compiling", path.name, type(e).__name__, e)
        misses = _persistent_misses()
        fn = jitted.lower(**dynamic, **static).compile()
        stored = _persistent_misses() > misses  # XLA compiled it just now (see the module's docstring)
        with self._lock:  # warm-up loads and compiles buckets on several threads
            self.compiled += 1
            self.not_stored += not stored
        if stored:
            self._store(path, key, fn)
        else:
            log.debug("executable cache: %s came from one of jax's caches; not stored", path.name)
        return fn

    @staticmethod
    def _load(path: Path, key: str) -> Callable:
        with path.open("rb") as f:
            stored_key, payload, in_tree, out_tree, device_ids = pickle.load(f)
        if stored_key != key:  # a renamed or colliding file: never run a program built for something else
            raise ValueError("key mismatch")
        # The devices it was compiled for, in its order: left out, jax loads it onto every local device, and a step
        # of one device (or one replica's mesh) in a process that sees more failed at its first call, or XLA aborted
        # the process (a sharding of 3 tiles on 8 devices). The key holds the device ids already.
        devices = {d.id: d for d in jax.local_devices()}
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=[devices[i] for i in device_ids]
        )

    def _store(self, path: Path, key: str, fn: Any) -> None:
        """Atomic: a concurrent reader sees the old file, the new one, or none; never a partial one."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(fn)
            device_ids = [d.id for d in fn.runtime_executable().local_devices()]
            data = pickle.dumps((key, payload, in_tree, out_tree, device_ids), protocol=pickle.HIGHEST_PROTOCOL)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except (OSError, pickle.PicklingError, TypeError, jax.errors.JaxRuntimeError) as e:
            # Not fatal: this start has its program; the next one compiles again.
            log.warning("executable cache: cannot store %s (%s: %s)", path.name, type(e).__name__, e)
            return
        with self._lock:
            prune, self._pruned = not self._pruned, True
        if prune:
            try:
                prune_other_versions(self.directory)
            except OSError as e:  # not fatal either: the dead entries stay
                log.warning("executable cache: cannot delete other versions' entries (%s: %s)", type(e).__name__, e)


def prune_other_versions(directory: Path, keep: int = KEEP_OTHER_VERSIONS) -> list[Path]:
    """Where `directory` is a version folder under `jaxinfer-exec/`: deletes its sibling version folders but the
    `keep` most recently modified, and the `.exec` files of the flat layout before versions; nothing else. Returns
    what it deleted. A process of another version still running then misses its entries and compiles (its loads
    and stores handle a vanished file)."""
    if directory.parent.name != SUBDIR or not _is_version(directory.name):
        return []  # a cache made on a folder of the caller's: never delete what it did not write
    siblings = [p for p in directory.parent.iterdir() if p != directory]
    folders = sorted((p for p in siblings if p.is_dir() and _is_version(p.name)), key=_mtime, reverse=True)
    doomed = folders[keep:] + [p for p in siblings if p.is_file() and p.suffix == ".exec"]
    for p in doomed:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if doomed:
        log.info("executable cache: deleted the entries of %d other version(s) in %s", len(doomed), directory.parent)
    return doomed


def _is_version(name: str) -> bool:
    return len(name) == VERSION_CHARS and all(c in "0123456789abcdef" for c in name)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:  # deleted meanwhile by another process's pruning
        return 0.0
