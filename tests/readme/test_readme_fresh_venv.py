"""README.md, followed literally in a fresh virtual environment: `bash scripts/install.sh && python serve.py`, one
chat completion through the `openai` client (the README's snippet), then stop.

Opt-in (`JAXINFER_README_TEST=1 pytest tests/readme`): a fresh install unpacks ~1 GB (jax, jaxlib, flax, orbax,
...) and the first start compiles every bucket of the default model; together several minutes, far over the CI
budget. pip's own download cache (~/.cache/pip) is used as any user's would be: that saves the downloads but not
the install. `--system-site-packages` would not be literal (the README promises a working install from nothing),
so the venv is bare. The checkout is copied first (tracked and untracked-but-not-ignored files), so the editable
install writes nothing into the working tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("JAXINFER_README_TEST") != "1", reason="opt-in: set JAXINFER_README_TEST=1 (installs ~1 GB)"
)


def _copy_checkout(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")  # fmt: skip
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def test_readme_install_serve_chat(tmp_path):
    src, env_dir = tmp_path / "jaxinfer", tmp_path / "venv"
    _copy_checkout(src)
    venv.create(env_dir, with_pip=True)
    # "Activating" the venv: python3 and python in scripts/install.sh and the README are the venv's.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir),
            "JAX_PLATFORMS": "cpu"}  # fmt: skip
    subprocess.run(["bash", "-c", "bash scripts/install.sh"], cwd=src, env=env, check=True, timeout=1800)

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(["bash", "-c", f"exec python serve.py --port {port}"], cwd=src, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", tmp_path / "serve.log")
    try:
        wait_ready(server, timeout=1800)
        from openai import OpenAI  # the README's snippet, with its placeholder key (no --api-key given)

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-local")
        r = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi!"}], max_tokens=32
        )
        assert r.choices[0].message.content.strip()
    finally:
        server.stop()
    assert proc.returncode == 0, server.log_tail()
