"""OpenAI-compatible HTTP server (FastAPI + uvicorn): `python serve.py`, or `build_app(ServerArgs(...))`.

Lazy: the engine's process imports `jaxinfer.cli` again (multiprocessing's spawn re-runs the `jaxinfer` script), and
through it `jaxinfer.server.args`; importing the app here would make it load fastapi and every handler (~0.4 s)
before it can start its own imports.
"""

from typing import Any

__all__ = ["ServerArgs", "build_app", "parse_args"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from jaxinfer.server.app import build_app

        return build_app
    if name in ("ServerArgs", "parse_args"):
        from jaxinfer.server import args

        return getattr(args, name)
    raise AttributeError(f"module 'jaxinfer.server' has no attribute {name!r}")
