"""`python -m tests.server.fake_server [server flags]`: the real server process (`jaxinfer.server.http.serve`: its
signal handling, SIGHUP included) in front of `FakeEngine`, for tests that must signal a server but need no model.
It prints nothing special: wait for /health as for serve.py."""

from __future__ import annotations

import logging
import os
import signal
import sys

from jaxinfer.model_files import smollm2_gguf
from jaxinfer.server.app import build_app
from jaxinfer.server.args import parse_args
from jaxinfer.server.http import serve
from jaxinfer.server.keys import defer_hangups
from jaxinfer.tokenizer import load_tokenizer
from tests.server.fake_engine import FakeEngine


def main(argv: list[str]) -> int:
    defer_hangups()  # as jaxinfer.cli's run_server
    args = parse_args(["--model", "fake", *argv])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tokenizer = load_tokenizer(smollm2_gguf())
    app = build_app(args, lambda _: (FakeEngine(tokenizer.vocab_size), tokenizer))
    if os.environ.get("FAKE_SERVER_HANGUP_AT_START") == "1":  # a supervisor's reload while the server starts
        os.kill(os.getpid(), signal.SIGHUP)
    return serve(app, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
