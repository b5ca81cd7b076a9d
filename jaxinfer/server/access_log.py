"""The access log: one JSON object per request on the `jaxinfer.access` logger.

An admitted request's line says how it went (tokens, queue time, time to first token, end-to-end time, finish
reasons); a refused one's (401, 429, 400, ...) its status and error code. A key appears by its id, never itself.
Default: through the root logger (stderr, after the usual time/level prefix); `--access-log-file PATH`: bare JSON
lines in that file instead; `--no-access-log`: none.
"""

from __future__ import annotations

import json
import logging
import time

from jaxinfer.server.admission import RequestRecord

ACCESS_LOGGER = "jaxinfer.access"


def _seconds(value: float | None) -> float | None:
    return round(value, 6) if value is not None else None


def record_line(rec: RequestRecord) -> dict:
    return {
        "id": rec.request_id,
        "key_id": rec.key_id,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "stream": rec.stream,
        "status": rec.status,
        "error": rec.error,
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens,
        "output_tokens": rec.output_tokens,
        "queue_time_s": _seconds(rec.queue_time),
        "ttft_s": _seconds(rec.ttft),
        "e2e_s": _seconds(rec.e2e),
        "finish_reason": rec.finish_reasons,
    }


class AccessLog:
    def __init__(self, enabled: bool = True, path: str | None = None):
        self.enabled = enabled
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self._handler: logging.Handler | None = None
        if enabled and path:
            self._handler = logging.FileHandler(path)
            self._handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(self._handler)
            self.logger.propagate = False
        if enabled:
            self.logger.setLevel(logging.INFO)

    def write(self, line: dict) -> None:
        if self.enabled:
            line = {"time": round(time.time(), 3), **line}
            self.logger.info("%s", json.dumps(line, ensure_ascii=False, separators=(",", ":")))

    def request(self, rec: RequestRecord) -> None:
        self.write(record_line(rec))

    def refused(self, request_id: str | None, key_id: str | None, endpoint: str, status: int, code: str | None) -> None:
        self.write({"id": request_id, "key_id": key_id, "endpoint": endpoint, "status": status, "error": code})

    def close(self) -> None:
        if self._handler is not None:
            self.logger.removeHandler(self._handler)
            self.logger.propagate = True
            self._handler.close()
            self._handler = None
