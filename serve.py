"""OpenAI-compatible server for jaxinfer models: `python serve.py [--model NAME] [--port 8000] ...`.

Flags follow vLLM's names; `python serve.py --help` lists them. The model loads after the server listens:
/health answers 503 until the model is loaded and its compiled steps are warm, then 200.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from jaxinfer.server.app import build_app
from jaxinfer.server.args import parse_args
from jaxinfer.server.http import serve
from jaxinfer.server.loader import build_engine


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every restore step at info
    if args.num_processes > 1 or args.coordinator_address:
        from jaxinfer import distributed

        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        if not distributed.is_lead():
            # A follower serves no HTTP: it loads its shards and runs every step the lead announces.
            engine, _ = build_engine(args)
            distributed.follow(engine.runner)
            return 0
    return serve(build_app(args), args)


if __name__ == "__main__":
    sys.exit(main())
