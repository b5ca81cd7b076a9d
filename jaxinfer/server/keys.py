"""API keys: `--api-key` (id `default`, no limits) and `--api-keys-file`, a JSON Lines file of keys with limits:

    {"id": "team-a", "key": "sk-...", "rpm": 60, "tpm": 40000, "max_concurrent": 4}

`id` names the key in /metrics and the access log (the key itself is never shown); `rpm` (requests per minute),
`tpm` (tokens per minute: prompt + completion) and `max_concurrent` (requests in flight) are optional, absent or
null meaning no limit. The file is read again on SIGHUP; a file that does not parse keeps the keys in use.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_early_hangup = threading.Event()


def defer_hangups() -> None:
    """Until the server's own SIGHUP handler is in place, a SIGHUP (a supervisor's reload) is remembered instead of
    killing the process, its default action; `take_deferred_hangup` tells the server to reload once it serves."""
    if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, lambda *_: _early_hangup.set())


def take_deferred_hangup() -> bool:
    """Whether a SIGHUP came before the server's handler was in place (cleared by asking)."""
    came = _early_hangup.is_set()
    _early_hangup.clear()
    return came


DEFAULT_KEY_ID = "default"
_LIMITS = ("rpm", "tpm", "max_concurrent")


@dataclass(frozen=True)
class APIKey:
    id: str
    key: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None

    def __repr__(self) -> str:  # never the key, not even in a traceback or a debug log
        return f"APIKey(id={self.id!r}, rpm={self.rpm}, tpm={self.tpm}, max_concurrent={self.max_concurrent})"

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) is not None for name in _LIMITS)


class KeyFileError(ValueError):
    """The keys file is missing or malformed; the message names the line (never a key)."""


def check_key(key: str, where: str) -> None:
    """A key a client can present: not empty (an empty --api-key would turn authentication off without a word),
    no surrounding whitespace (the server strips what a client sends, so such a key could never match)."""
    if not key.strip():
        raise KeyFileError(f"{where} is empty: give a key, or leave it out to serve without one")
    if key != key.strip():
        raise KeyFileError(f"{where} has spaces around it, which a client's key can never match")


def _parse_line(obj: object, where: str) -> APIKey:
    if not isinstance(obj, dict):
        raise KeyFileError(f"{where}: expected a JSON object")
    unknown = set(obj) - {"id", "key", *_LIMITS}
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {sorted(unknown)}")
    for name in ("id", "key"):
        if not isinstance(obj.get(name), str) or not obj[name].strip():
            raise KeyFileError(f"{where}: `{name}` must be a non-empty string")
    check_key(obj["key"], f"{where}: `key`")
    limits = {}
    for name in _LIMITS:
        v = obj.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise KeyFileError(f"{where}: `{name}` must be a positive integer or null")
        limits[name] = v
    return APIKey(obj["id"], obj["key"], **limits)


def load_keys(path: str | Path) -> list[APIKey]:
    """Parses a keys file; raises KeyFileError naming the first problem."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise KeyFileError(f"{path}: {e.strerror or e}") from None
    keys: list[APIKey] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise KeyFileError(f"{where}: not JSON ({e.msg})") from None
        keys.append(_parse_line(obj, where))
    return keys


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class KeyRing:
    """The keys in use. `lookup` compares the presented key with every known key in constant time (each
    comparison is of equal-length SHA-256 digests, and none stops early), so timing tells nothing about a key."""

    def __init__(self, api_key: str | None = None, keys_file: str | None = None):
        if api_key is not None:
            check_key(api_key, "--api-key")
        self.api_key = api_key
        self.keys_file = keys_file
        self._lock = threading.Lock()
        self._keys: list[tuple[bytes, APIKey]] = []
        self._set(self._read())

    @property
    def enabled(self) -> bool:
        """Whether requests must bring a key at all."""
        return bool(self.api_key or self.keys_file)

    def keys(self) -> list[APIKey]:
        with self._lock:
            return [k for _, k in self._keys]

    def _read(self) -> list[APIKey]:
        keys = [APIKey(DEFAULT_KEY_ID, self.api_key)] if self.api_key else []
        if self.keys_file:
            keys += load_keys(self.keys_file)
        ids = [k.id for k in keys]
        dup = next((i for i in ids if ids.count(i) > 1), None)
        if dup is not None:
            raise KeyFileError(f"{self.keys_file}: key id {dup!r} appears twice (`--api-key` is id {DEFAULT_KEY_ID!r})")
        if len({k.key for k in keys}) < len(keys):
            raise KeyFileError(f"{self.keys_file}: two entries share one key")
        return keys

    def _set(self, keys: list[APIKey]) -> None:
        entries = [(_digest(k.key), k) for k in keys]
        with self._lock:
            self._keys = entries

    def reload(self) -> bool:
        """Reads the keys file again; on error logs why and keeps the keys in use. Returns whether it loaded."""
        try:
            keys = self._read()
        except KeyFileError as e:
            log.error("API keys not reloaded, the previous ones stay in use: %s", e)
            return False
        self._set(keys)
        log.info("API keys reloaded: %d key(s) (%s)", len(keys), ", ".join(k.id for k in keys))
        return True

    def lookup(self, presented: str) -> APIKey | None:
        digest = _digest(presented)
        with self._lock:
            entries = self._keys
        found = None
        for known, key in entries:  # no early exit: every key is compared
            if hmac.compare_digest(digest, known):
                found = key
        return found
