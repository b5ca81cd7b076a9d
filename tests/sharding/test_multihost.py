"""Two processes on localhost (jax.distributed, CPU) serve generation together and match one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.weights.layout import build_on_mesh
from tests.sharding.multihost_common import CC, PROMPTS, SAMPLING, host_getter, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    cfg = tiny_config()
    c, params = build_on_mesh(cfg, host_getter(cfg), "float32")
    ref = [r[0].output_token_ids for r in Engine(c, params, CacheConfig(**CC)).generate(PROMPTS, SAMPLING)]

    out, port = tmp_path / "tokens.json", _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""}
    cmd = [sys.executable, str(ROOT / "tests" / "sharding" / "multihost_worker.py"), str(port)]
    procs = [subprocess.Popen([*cmd, str(i), str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]  # fmt: skip
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:  # a missing peer aborts the other: never leave one behind
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(log[-3000:] for log in logs)
    assert json.loads(out.read_text()) == ref
