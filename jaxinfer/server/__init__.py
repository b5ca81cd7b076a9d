"""OpenAI-compatible HTTP server (FastAPI + uvicorn): `python serve.py`, or `build_app(ServerArgs(...))`."""

from jaxinfer.server.app import build_app
from jaxinfer.server.args import ServerArgs, parse_args

__all__ = ["ServerArgs", "build_app", "parse_args"]
