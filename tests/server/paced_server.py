"""The real server (engine core in its own process, the default) on the fake engine paced like a device, for tests
that measure the server's processes from outside (memory, latency) without a model:

    python -m tests.server.paced_server [server flags...]      # --model is "fake"; the step time is STEP_S

Its connections have a small kernel send buffer (SNDBUF): Linux grows a loopback connection's to megabytes, so a
client that stops reading would otherwise stall the server's writes only after thousands of events; with it, after
a few hundred, as a remote client's full window would.
"""

from __future__ import annotations

import socket
import sys

import jaxinfer.engine.mp_engine as mp_engine
from jaxinfer.server.app import build_app
from jaxinfer.server.args import parse_args
from jaxinfer.server.http import DrainingServer, uvicorn_config
from tests.server.test_slow_reader import _paced_build

SNDBUF = 8192


class _PacedEngineProcess(mp_engine.MPAsyncEngine):
    def __init__(self, args, on_death=None, build=None):
        super().__init__(args, on_death, build or _paced_build)


def main(argv: list[str]) -> int:
    args = parse_args(["--model", "fake", *argv])
    # The server starts its engine process through this name: the core builds the paced fake engine.
    mp_engine.MPAsyncEngine = _PacedEngineProcess  # type: ignore[misc]
    app = build_app(args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)  # accepted connections inherit it
    sock.bind((args.host, args.port))
    config = uvicorn_config(app, args, timeout_graceful_shutdown=1)
    DrainingServer(config, app.state.ctx.state, args.graceful_shutdown_timeout).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
