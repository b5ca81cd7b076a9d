"""Which errors are the user's: a bad input, named in one line, where any other error is a bug shown with its
traceback. Here, below the engine, so that the CLI and the engine process (which loads the server's model) draw
the line alike without the engine importing the CLI."""

from __future__ import annotations

import sys

# Looked up where they are defined, only once that module is loaded: an error of the kind can only have been raised
# from there, and importing model code (jax) just to ask would slow every `jaxinfer --help`.
_DEFINED_IN = (
    ("jaxinfer.types", "RequestsFailedError"),  # the engine's reason for each: a line, not a traceback
    ("jaxinfer.device", "DeviceUnavailableError"),
    ("jaxinfer.model.protocol", "ProtocolError"),
)


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that name a bad input (a path, a setting, a file that is not a model, a device that is not
    there). The library raises ValueError (and its kinds: unsupported configs, checkpoints, tokenizers, meshes) for
    what it was given and OSError (a missing model file among them) for what it could not read or write."""
    kinds: list[type[BaseException]] = [ValueError, OSError]
    for module, name in _DEFINED_IN:
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return tuple(kinds)
