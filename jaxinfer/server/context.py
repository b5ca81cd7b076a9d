"""What every handler needs: the flags, the server state, the metrics, and a few lookups over them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from jaxinfer.server.args import ServerArgs
from jaxinfer.server.errors import APIError
from jaxinfer.server.logprobs import TokenText
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.state import ServerState
from jaxinfer.tokenizer import Tokenizer


@dataclass
class ServingContext:
    args: ServerArgs
    state: ServerState
    metrics: Metrics
    _token_text: TokenText | None = field(default=None, init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        names = self.args.model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")
        return requested

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.state.tokenizer is not None, "used before the model was loaded"
        return self.state.tokenizer

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    @property
    def context_tokens(self) -> int:
        """Most tokens (prompt + output) one sequence can hold: the context length, or the whole KV pool."""
        return min(self.state.max_model_len, self.state.kv_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
