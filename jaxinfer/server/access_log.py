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
        """path: this app's own file, written through its own handler (the shared logger is left alone, so that
        several apps in one process, as in tests, keep their lines apart)."""
        self.enabled = enabled
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self._file: logging.Handler | None = None
        if enabled and path:
            self._file = logging.FileHandler(path)
            self._file.setFormatter(logging.Formatter("%(message)s"))
        elif enabled and self.logger.level == logging.NOTSET:
            self.logger.setLevel(logging.INFO)  # shown whatever --log-level says; --no-access-log turns it off

    def write(self, line: dict) -> None:
        if not self.enabled:
            return
        text = json.dumps({"time": round(time.time(), 3), **line}, ensure_ascii=False, separators=(",", ":"))
        if self._file is not None:
            self._file.handle(self.logger.makeRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, text, (), None))
        else:
            self.logger.info("%s", text)

    def request(self, rec: RequestRecord) -> None:
        self.write(record_line(rec))

    def refused(
        self, request_id: str | None, key_id: str | None, endpoint: str | None, status: int, code: str | None
    ) -> None:
        """endpoint None: the connection layer's answer to a head that never arrived whole (connections.py)."""
        self.write({"id": request_id, "key_id": key_id, "endpoint": endpoint, "status": status, "error": code})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
