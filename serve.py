"""OpenAI-compatible server for jaxinfer models: `python serve.py [--model NAME] [--port 8000] ...`.

The same as `jaxinfer serve`. Flags follow vLLM's names; `python serve.py --help` lists them with their defaults.
The model loads after the server listens: /health answers 503 until the model is loaded and every compiled step is
warm, then 200.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here, not above: the engine's process (multiprocessing's spawn) runs this file again as
    # `__mp_main__`, where the CLI is not needed (see jaxinfer/server/__init__.py for why that matters).
    from jaxinfer.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
