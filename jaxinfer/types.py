"""Host-only vocabulary shared by the scheduler, engine and server (no jax import)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, named as vLLM names them. Only settings we honour exist here."""

    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, drawn by the engine when params.seed is None
    output_token_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    group: str | None = None  # the n > 1 samples of one prompt share a group, and so the prompt's pages
    block_hashes: list[int] = field(default_factory=list)  # hashes of the leading full pages, as registered
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        return [self.token(i) for i in range(start, stop)]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str = ""
