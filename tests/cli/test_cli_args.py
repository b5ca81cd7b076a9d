"""The `jaxinfer` command line: every flag of every subcommand documents its default in --help, `serve MODEL` is
`--model MODEL` under the server's own validation, and `env` reports the backend."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from jaxinfer.cli import DefaultsFormatter, main, make_cli_parser, server_args
from tests.cli.conftest import REPO_ENV

SUBCOMMANDS = ["serve", "generate", "chat", "complete", "bench", "convert", "env"]


def _subparser(name: str) -> argparse.ArgumentParser:
    for action in make_cli_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("no subcommands")


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_flag_documents_its_default(name: str):
    sub = _subparser(name)
    formatter = DefaultsFormatter(prog="x")
    flags = [a for a in sub._actions if a.dest != "help" and a.option_strings]
    for action in flags:
        text = formatter._get_help_string(action)
        assert "default" in text.lower(), f"{name} {action.option_strings}: {text!r}"
        assert "default" in sub.format_help() and action.option_strings[-1] in sub.format_help()


def test_serve_model_positional_is_the_model_flag():
    assert server_args(["some/model.gguf", "--port", "9"]).model == "some/model.gguf"
    assert server_args(["--port", "9"]).port == 9
    with pytest.raises(SystemExit):
        server_args(["a.gguf", "--model", "b.gguf"])  # both: ambiguous
    with pytest.raises(SystemExit):
        server_args(["--gpu-memory-utilization", "2"])  # the server's own validation still runs


def test_bench_needs_a_kind():
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])


def test_env_reports_backend_and_versions():
    out = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "env", "--json"], env=REPO_ENV, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    info = json.loads(out.stdout)
    assert info["backend"] == "cpu" and info["devices"][0]["platform"] == "cpu"
    assert {"jax", "jaxlib", "jaxinfer"} <= set(info["packages"])
