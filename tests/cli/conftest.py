"""One live server (serve.py in a subprocess) shared by the client tests: `jaxinfer chat`/`complete` and
lm-evaluation-harness. The model is a tiny random-weight Llama with SmolLM2's tokenizer, so start-up compiles in
seconds; it and its settings are tests/tiny_model.py's, as every other live server's: they share compiled steps."""

from __future__ import annotations

import os

import pytest

from tests.server.conftest import API_KEY, REPO, ServerProcess, start_server, wait_ready
from tests.tiny_model import settings_flags, write_tiny_model

MODEL_NAME = "tiny"
# Subprocesses import this checkout's jaxinfer, on CPU.
REPO_ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    write_tiny_model(path)
    return str(path)


@pytest.fixture(scope="package")
def live_server(tmp_path_factory, tiny_model: str) -> ServerProcess:
    # Later flags win in argparse: these replace start_server's default model and sizes.
    srv = start_server(tmp_path_factory.mktemp("cli-server") / "server.log", "--model", tiny_model,
                       "--served-model-name", MODEL_NAME, "--api-key", API_KEY, *settings_flags())  # fmt: skip
    try:
        wait_ready(srv)
        yield srv
    finally:
        srv.stop()
