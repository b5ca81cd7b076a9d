"""The executable cache: a fresh process loads serialized steps with no compiles and the same tokens; a corrupt
entry falls back to a compile with a warning; anything that changes the program changes the key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import exec_cache
from jaxinfer.engine.exec_cache import ExecutableCache, entry_key

REPO = Path(__file__).resolve().parents[2]


def _child(
    cache_dir: Path, norm_eps: float = 1e-6, defer: bool = False, devices: int = 1, source: str | None = None
) -> tuple[dict, str]:
    """`source`: the child's source hash instead of this checkout's (another version of jaxinfer)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("EXEC_CACHE_CHILD_SOURCE", None)
    if source is not None:
        env["EXEC_CACHE_CHILD_SOURCE"] = source
    if devices > 1:  # the engine runs on one of them
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env.pop("JAXINFER_EXEC_CACHE", None)
    cmd = [sys.executable, "-m", "tests.engine.exec_cache_child", str(cache_dir), str(norm_eps)]
    cmd += ["defer"] if defer else []
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def _entries(cache_dir: Path) -> Path:
    """Where a process of this jax and this source keeps its entries under `cache_dir`."""
    return cache_dir / exec_cache.SUBDIR / exec_cache.version()


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """One cold start on an empty cache dir: it compiles every step and stores each."""
    cache_dir = tmp_path_factory.mktemp("xla")
    out, _ = _child(cache_dir)
    return cache_dir, out


def test_fresh_process_loads_steps_without_compiling(cold):
    cache_dir, first = cold
    assert first["loaded"] == 0 and first["compiled"] == first["step_compiles"] > 0
    assert len(list(_entries(cache_dir).glob("*.exec"))) == first["compiled"]
    warm, _ = _child(cache_dir)
    assert warm["step_compiles"] == 0  # no backend compile (nor persistent-cache read) for any step
    assert warm["loaded"] == first["compiled"] and warm["compiled"] == 0
    assert warm["tokens"] == first["tokens"]


def test_a_process_that_sees_more_devices_than_its_steps_loads_them(tmp_path):
    """An engine on one device of two (or a replica's mesh among eight): its loaded steps ran on every local device,
    and failed at the first call ("Expected args to execute_sharded_on_local_devices to have 2 shards") or XLA
    aborted the process. Each entry now names its devices."""
    first, _ = _child(tmp_path, devices=2)
    warm, _ = _child(tmp_path, devices=2)
    assert warm["loaded"] == first["compiled"] > 0 and warm["compiled"] == 0
    assert warm["tokens"] == first["tokens"]


def test_corrupt_entry_falls_back_with_a_warning(cold, tmp_path):
    cache_dir, first = cold
    entries = sorted(_entries(cache_dir).glob("*.exec"))
    broken = tmp_path / "xla"
    _entries(broken).mkdir(parents=True)
    for i, f in enumerate(entries):  # a copy: the warm test above must see intact files
        data = f.read_bytes()
        (_entries(broken) / f.name).write_bytes(data[: len(data) // 2] if i == 0 else data)
    out, err = _child(broken)
    assert "executable cache: cannot load" in err
    assert out["compiled"] == 1 and out["loaded"] == len(entries) - 1
    assert out["tokens"] == first["tokens"]
    # The fallback rewrote the entry: the next start loads all of them.
    again, _ = _child(broken)
    assert again["loaded"] == len(entries) and again["step_compiles"] == 0


def test_a_start_defers_the_rarer_variants_and_a_warm_one_loads_them(cold, tmp_path):
    """The server core's warm-up (`defer`): cold, only the plain buckets compile before ready and the advanced and
    prompt-logprobs variants wait; a request needing one before it compiled gets it compiled on the spot; once
    every deferred one is compiled, nothing compiles again. Warm (the same cache), the plain buckets load before
    ready and the rarer variants are deferred too, then load from the cache: nothing compiles."""
    _, plain = cold
    first, _ = _child(tmp_path, defer=True)
    assert first["ready_programs"] == plain["compiled"] and first["deferred"] > 0, first
    assert first["tokens"] == plain["tokens"]  # the deferral changes no output
    assert first["compiles_after_deferred"] == 0 and first["rare_same"], first
    assert first["compiled"] == first["ready_programs"] + first["deferred"]
    warm, _ = _child(tmp_path, defer=True)
    assert warm["deferred"] == first["deferred"] and warm["ready_programs"] == first["ready_programs"], warm
    assert warm["loaded"] == first["compiled"] and warm["compiled"] == 0, warm  # the deferred ones loaded after
    assert warm["step_compiles"] == 0 and warm["tokens"] == plain["tokens"] and warm["rare_same"], warm


@jax.jit
def _double(x):
    return 2 * x


def _key(**change):
    dynamic = {"params": {"w": change.get("w", jnp.ones((4, 4), jnp.float32))}, "x": jnp.ones(3)}
    static = {"cfg": change.get("cfg", ("llama", 1e-6)), "bucket": change.get("bucket", 8), "impl": None}
    return entry_key(dynamic, static, change.get("extra", "cache-config"))


@pytest.mark.parametrize(
    "change",
    [
        {"cfg": ("llama", 1e-5)},  # same shapes, different program
        {"bucket": 16},
        {"extra": "other-cache-config"},
        {"w": jnp.ones((4, 4), jnp.bfloat16)},
        {"w": jnp.ones((4, 8), jnp.float32)},
        {"w": {"nested": jnp.ones((4, 4), jnp.float32)}},  # another params tree structure
    ],
    ids=["config", "bucket", "cache-config", "dtype", "shape", "tree"],
)
def test_anything_that_changes_the_program_changes_the_key(change):
    assert _key() == _key()
    assert _key(**change) != _key()


def test_versions_and_source_change_the_key(monkeypatch):
    base = _key()
    monkeypatch.setattr(jax, "__version__", "0.0.0")
    assert _key() != base
    monkeypatch.undo()
    monkeypatch.setattr(exec_cache, "source_hash", lambda: "edited")
    assert _key() != base


def test_an_entry_of_another_instruction_set_is_not_loaded(monkeypatch):
    """XLA:CPU compiles for the host's instruction set and does not check it when it loads: a cache folder shared
    with a machine of other features (an NFS home, a container image) must not hand its entries over. The key
    carries the target's fingerprint, which on CPU follows the instruction set XLA compiles for."""
    base = _key()
    monkeypatch.setattr(exec_cache, "target_fingerprint", lambda devices: 12345)
    assert _key() != base

    code = "import jax; from jaxinfer.engine import exec_cache; print(exec_cache.target_fingerprint(jax.devices()))"

    def fingerprint(xla_flags: str) -> str:
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout.split()[-1]

    host, sse = fingerprint(""), fingerprint("--xla_cpu_max_isa=SSE4_2")  # SSE4.2: as a CPU without AVX would
    assert host.isdigit() and sse.isdigit() and host != sse


def test_mismatched_entry_is_refused(tmp_path, caplog):
    """A file whose stored key differs from its name (renamed, or a hash collision) is never run."""
    cache = ExecutableCache(tmp_path)
    # A length no earlier run used: jax's persistent cache (on in this process when an earlier test enabled it)
    # must not serve this compile, or the step is not stored (see test_steps_read_from_jax_cache_are_not_stored).
    x = jnp.arange(float(np.random.default_rng().integers(10, 10**6)))
    fn = cache.load_or_compile(_double, {"x": x}, {})
    key = entry_key({"x": x}, {})
    np.testing.assert_array_equal(fn(x=x), 2 * np.asarray(x))
    other = {"x": jnp.arange(4.0)}
    cache.path(key).rename(cache.path(entry_key(other, {})))
    with caplog.at_level("WARNING"):
        fn = cache.load_or_compile(_double, other, {})
    assert "key mismatch" in caplog.text and cache.compiled == 2 and cache.loaded == 0
    np.testing.assert_array_equal(fn(**other), 2 * np.arange(4.0))


def test_steps_read_from_jax_cache_are_not_stored(cold, tmp_path):
    """The exec entries gone but jax's cache warm (deleted by hand, or filled with JAXINFER_EXEC_CACHE=0): jax reads
    each step back from its cache, and such an executable serializes incompletely on XLA:CPU (its copy failed at the
    first run with "Function ... not found"). It is used but not stored, so the next start reads jax's cache again
    instead of crashing, with the same tokens. Runs on the cold dir itself, its exec entries moved aside and back."""
    cache_dir, first = cold
    entries, aside = _entries(cache_dir), tmp_path / "aside"
    aside.mkdir()
    for f in entries.glob("*.exec"):
        f.rename(aside / f.name)
    try:
        assert (entries / exec_cache.JAX_SUBDIR).is_dir()
        second, _ = _child(cache_dir)
        assert second["loaded"] == 0 and second["not_stored"] == second["compiled"] == first["compiled"], second
        assert not list(entries.glob("*.exec"))
        third, _ = _child(cache_dir)
        assert third["tokens"] == second["tokens"] == first["tokens"]
    finally:
        for f in aside.glob("*.exec"):
            f.rename(entries / f.name)


def test_a_new_version_compiles_its_unchanged_steps_afresh_and_stores_them(cold, tmp_path):
    """An upgrade that leaves the steps' programs as they were: jax's cache of the old version held them, handed
    them out, and they were never stored, so every later start traced, lowered and read them again. Each version
    keeps jax's cache in its own folder: the new version's first start compiles and stores every step, its second
    loads them all; the old version's folder is kept (the latest other version) until a third one comes."""
    cache_dir, first = cold
    shutil.copytree(cache_dir, tmp_path / "xla")
    upgraded, _ = _child(tmp_path / "xla", source="upgraded")
    assert upgraded["loaded"] == 0 and upgraded["not_stored"] == 0 and upgraded["compiled"] == first["compiled"]
    warm, _ = _child(tmp_path / "xla", source="upgraded")
    assert warm["loaded"] == first["compiled"] and warm["compiled"] == 0 and warm["step_compiles"] == 0
    assert warm["tokens"] == upgraded["tokens"] == first["tokens"]
    versions = sorted(p.name for p in (tmp_path / "xla" / exec_cache.SUBDIR).iterdir())
    assert exec_cache.version() in versions and len(versions) == 2
    _child(tmp_path / "xla", source="upgraded again")
    versions_after = sorted(p.name for p in (tmp_path / "xla" / exec_cache.SUBDIR).iterdir())
    assert exec_cache.version() not in versions_after and len(versions_after) == 2  # the oldest, jax's cache with it


def test_jax_entries_of_the_layout_before_version_folders_go_from_the_default_folder_only(tmp_path, monkeypatch):
    from jaxinfer.engine.runner import enable_compilation_cache

    def fill(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("jit_step-00ff-cache", "jit_step-00ff-atime", "notes.txt", "x-cache.json"):
            (folder / name).write_text("x")

    default, mine = tmp_path / "home" / ".cache" / "jaxinfer" / "xla", tmp_path / "mine"
    fill(default)
    fill(mine)
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "home")
    monkeypatch.delenv("JAXINFER_COMPILE_CACHE", raising=False)
    before = jax.config.jax_compilation_cache_dir
    try:
        enable_compilation_cache(mine)  # a folder the caller named may be shared with other jax programs: kept
        assert sorted(p.name for p in mine.iterdir() if p.is_file()) == sorted(
            ["jit_step-00ff-cache", "jit_step-00ff-atime", "notes.txt", "x-cache.json"]
        )
        enable_compilation_cache()
        assert sorted(p.name for p in default.iterdir()) == ["jaxinfer-exec", "notes.txt", "x-cache.json"]
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_jax_cache_lives_in_the_version_folder(tmp_path, monkeypatch):
    """enable_compilation_cache's layout, and the executable cache found from jax's setting either way."""
    from jaxinfer.engine.runner import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        enable_compilation_cache(tmp_path)
        assert Path(jax.config.jax_compilation_cache_dir) == _entries(tmp_path) / exec_cache.JAX_SUBDIR
        assert ExecutableCache.from_jax_config().directory == _entries(tmp_path)
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # set by the caller
        assert ExecutableCache.from_jax_config().directory == _entries(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_a_program_jax_hands_out_again_in_process_is_not_stored(tmp_path):
    """jax's in-memory cache hands an identical program's executable out again and reports no event at all. After a
    persistent-cache read that is the executable that serializes incompletely: a second engine with the same
    settings stored it, and the next start's first step failed with "Function ... not found". Only a compile that
    jax reported as a persistent-cache miss is stored."""
    x = jnp.arange(float(np.random.default_rng().integers(10, 10**6)))  # a new length: jax's caches lack it
    fresh = ExecutableCache(tmp_path / "fresh")
    fresh.load_or_compile(_double, {"x": x}, {})  # XLA compiles it
    assert fresh.not_stored == 0 and len(list(fresh.directory.glob("*.exec"))) == 1
    jax.clear_caches()
    read = ExecutableCache(tmp_path / "read")
    read.load_or_compile(_double, {"x": x}, {})  # from jax's persistent cache
    again = ExecutableCache(tmp_path / "again")
    fn = again.load_or_compile(_double, {"x": x}, {})  # from jax's in-memory cache: the executable just read
    assert read.not_stored == again.not_stored == 1
    assert not list(read.directory.glob("*.exec")) and not list(again.directory.glob("*.exec"))
    np.testing.assert_array_equal(fn(x=x), 2 * np.asarray(x))


def test_storing_deletes_all_other_versions_but_the_latest(tmp_path):
    """Entries of another jax or another source never load: the first store of a process deletes their folders
    (and the files of the flat layout before versions), keeping the most recently written other version."""
    root = tmp_path / exec_cache.SUBDIR
    newest, older, oldest = ("0123456789abcde" + c for c in "abc")  # names as version() makes them
    for age, name in enumerate([newest, older, oldest, "not-a-version"]):
        (root / name).mkdir(parents=True)
        (root / name / "k.exec").write_bytes(b"x")
        os.utime(root / name, (1e9 - age, 1e9 - age))
    (root / "flat.exec").write_bytes(b"x")
    (root / "notes.txt").write_bytes(b"x")
    cache = ExecutableCache(root / exec_cache.version())
    x = jnp.arange(float(np.random.default_rng().integers(10, 10**6)))  # a new length: jax's cache cannot serve it
    cache.load_or_compile(_double, {"x": x}, {})
    kept = sorted([exec_cache.version(), newest, "not-a-version", "notes.txt"])  # never what it did not write
    assert sorted(p.name for p in root.iterdir()) == kept
    assert len(list((root / exec_cache.version()).glob("*.exec"))) == 1


def test_a_cache_on_a_folder_of_the_callers_deletes_nothing_beside_it(tmp_path):
    (tmp_path / "0123456789abcdef").mkdir()
    (tmp_path / "other.exec").write_bytes(b"x")
    cache = ExecutableCache(tmp_path / "mine")
    x = jnp.arange(float(np.random.default_rng().integers(10, 10**6)))
    cache.load_or_compile(_double, {"x": x}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0123456789abcdef", "mine", "other.exec"]


def test_the_version_folder_changes_with_jax_and_the_source(monkeypatch):
    base = exec_cache.version()
    monkeypatch.setattr(jax, "__version__", "0.0.0")
    assert exec_cache.version() != base
    monkeypatch.undo()
    monkeypatch.setattr(exec_cache, "source_hash", lambda: "edited")
    assert exec_cache.version() != base
