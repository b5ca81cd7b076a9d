"""Content filters: a small plugin interface for checking prompts and generated text, the built-in blocklist
filter, and the `--filters-config` file that lists them.

A filter is a `ContentFilter`. `check_input(text)` sees each prompt (each chat message's content, or a completion
prompt) and returns why it is blocked, or None; a blocked prompt is a 400 with code `content_filter`.
`check_output(text, start, final)` sees the text a choice has generated so far and is streaming-aware: text before
`start` has passed already; it answers how far the text passes now (`release`). What lies past `release` is held
back, as text that may still grow into a stop string is, until a later call passes it; a filter holds what may
still become part of a match, and passes everything when `final` (the text is complete). A blocked choice ends at
`release` with finish_reason `content_filter`. Filters run on a thread pool (jaxinfer.server.output_gate), never
on the event loop nor in the engine, so a slow filter delays only the choices it checks.

The config file is JSON:

    {"filters": [
      {"type": "blocklist", "name": "words", "phrases": ["secret plan"], "patterns": ["\\\\bpass(word)?s?\\\\b"],
       "ignore_case": true, "max_match_chars": 64, "apply_to": ["input", "output"]},
      {"type": "python", "name": "mine", "class": "my_package.my_module:MyFilter", "options": {"threshold": 0.5}}
    ]}

`phrases` match literally; `patterns` are Python regular expressions, each match at most `max_match_chars` long
(output is checked as it streams, so a longer match can be missed: that many characters are held back at the end).
`python` filters are classes implementing ContentFilter, built with `options` as keyword arguments.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlocklistFilter", "ContentFilter", "Filters", "OutputVerdict", "load_filters"]

_STAGES = ("input", "output")


@dataclass(frozen=True)
class OutputVerdict:
    """`release`: the text passes up to here (start <= release <= len(text)). `blocked`: why the choice ends at
    `release`, or None."""

    release: int
    blocked: str | None = None


class ContentFilter:
    """The plugin interface. The defaults pass everything; a filter overrides what it checks. Methods are called
    from several threads at once (one request's calls are sequential): keep per-call state local."""

    name: str = "filter"

    def check_input(self, text: str) -> str | None:
        """Why `text` (a prompt, or one chat message) is blocked, or None."""
        return None

    def check_output(self, text: str, start: int, final: bool) -> OutputVerdict:
        """`text`: a choice's whole text so far, of which text[:start] passed already (context, e.g. for
        lookbehind). A match must begin at or after `start`."""
        return OutputVerdict(len(text))


class BlocklistFilter(ContentFilter):
    """Blocks literal phrases and regular expressions. Output holds only what may still become a match: the
    longest end of the text that begins a phrase and, when there are patterns, the last `max_match_chars` - 1
    characters and any pattern match that reaches the end of the text (more text may change it: `\\d+`, `\\b`)."""

    def __init__(self, name: str = "blocklist", phrases: Sequence[str] = (), patterns: Sequence[str] = (),
                 ignore_case: bool = True, max_match_chars: int = 64):  # fmt: skip
        self.name = name
        flags = re.IGNORECASE if ignore_case else 0
        phrases = [p for p in phrases if p]
        if not phrases and not patterns:
            raise ValueError(f"filter {name!r}: give phrases or patterns")
        if max_match_chars < 1:
            raise ValueError(f"filter {name!r}: max_match_chars must be >= 1")
        self._phrases = re.compile("|".join(re.escape(p) for p in phrases), flags) if phrases else None
        # Any proper, non-empty beginning of a phrase, at the very end of the text: the leftmost such match is
        # the longest end that may still grow into the phrase.
        self._partial = re.compile("|".join(f"(?:{_prefixes(p)})\\Z" for p in phrases), flags) if phrases else None
        self._patterns = None
        if patterns:
            try:
                self._patterns = re.compile("|".join(f"(?:{p})" for p in patterns), flags)
            except re.error as e:
                raise ValueError(f"filter {name!r}: bad pattern: {e}") from None
            if self._patterns.fullmatch(""):
                raise ValueError(f"filter {name!r}: a pattern matches the empty string")
        self._window = max_match_chars - 1 if patterns else 0

    def check_input(self, text: str) -> str | None:
        found = any(r is not None and r.search(text) for r in (self._phrases, self._patterns))
        return self.name if found else None

    def check_output(self, text: str, start: int, final: bool) -> OutputVerdict:
        end = len(text)
        blocked_at: int | None = None
        hold = end
        if self._phrases is not None and (m := self._phrases.search(text, start)) is not None:
            blocked_at = m.start()
        if self._patterns is not None and (m := self._patterns.search(text, start)) is not None:
            if final or m.end() < end:
                blocked_at = m.start() if blocked_at is None else min(blocked_at, m.start())
            else:
                hold = m.start()
        if blocked_at is not None:  # cut before it, and before a pattern match still in doubt
            return OutputVerdict(min(blocked_at, hold), self.name)
        if final:
            return OutputVerdict(end)
        if self._partial is not None and (m := self._partial.search(text, start)) is not None:
            hold = min(hold, m.start())
        return OutputVerdict(max(start, min(hold, end - self._window)))


def _prefixes(phrase: str) -> str:
    """A regex matching phrase[:1], phrase[:2], ... phrase[:-1] (nested optional groups)."""
    parts = [re.escape(c) for c in phrase[:-1]]
    out = ""
    for part in reversed(parts[1:]):
        out = f"(?:{part}{out})?"
    return parts[0] + out if parts else "(?!)"


@dataclass(frozen=True)
class _Entry:
    filter: ContentFilter
    stages: frozenset[str]


class Filters:
    """The configured filters, each applied to the stages (input, output) its entry names."""

    def __init__(self, entries: Sequence[tuple[ContentFilter, Sequence[str]]]):
        self._entries = [_Entry(f, frozenset(stages)) for f, stages in entries]
        self._input = [e.filter for e in self._entries if "input" in e.stages]
        self._output = [e.filter for e in self._entries if "output" in e.stages]

    @property
    def checks_output(self) -> bool:
        return bool(self._output)

    def check_input(self, text: str) -> str | None:
        for f in self._input:
            reason = f.check_input(text)
            if reason is not None:
                return reason
        return None

    def check_output(self, text: str, start: int, final: bool) -> OutputVerdict:
        """Every output filter's verdict together: the text passes as far as all of them pass it; blocked when one
        blocks (at the earliest point any of them holds, so nothing one of them still doubts is shown)."""
        release, blocked = len(text), None
        for f in self._output:
            v = f.check_output(text, start, final)
            if not start <= v.release <= len(text):
                raise ValueError(f"filter {f.name!r}: release {v.release} outside [{start}, {len(text)}]")
            release = min(release, v.release)
            blocked = blocked or v.blocked
        return OutputVerdict(release, blocked)


def _build(spec: dict, index: int) -> tuple[ContentFilter, list[str]]:
    where = f"filters[{index}]"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected an object")
    spec = dict(spec)
    kind = spec.pop("type", None)
    stages = spec.pop("apply_to", list(_STAGES))
    if not isinstance(stages, list) or not stages or any(s not in _STAGES for s in stages):
        raise ValueError(f"{where}.apply_to: a non-empty list of {list(_STAGES)}")
    name = spec.pop("name", kind)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}.name: a string, got {name!r}")
    try:
        if kind == "blocklist":
            _check_blocklist_fields(spec, where)
            return BlocklistFilter(name=name, **spec), stages
        if kind == "python":
            cls = _import(spec.pop("class", None), where)
            options = spec.pop("options", {})
            if spec:
                raise ValueError(f"unknown fields {sorted(spec)}")
            made = cls(**options)
            if not isinstance(made, ContentFilter):
                raise ValueError(f"{cls.__name__} is not a jaxinfer.server.filters.ContentFilter")
            made.name = name or made.name
            return made, stages
    except TypeError as e:  # unknown or missing keyword arguments
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    raise ValueError(f"{where}.type: one of 'blocklist', 'python', got {kind!r}")


# A blocklist's fields and the type each must have: JSON's "secret" for ["secret"] would otherwise block every
# text holding one of its letters, and "false" would be true.
_BLOCKLIST_FIELDS: dict[str, tuple[type, str]] = {
    "phrases": (list, "a list of strings"),
    "patterns": (list, "a list of strings"),
    "ignore_case": (bool, "true or false"),
    "max_match_chars": (int, "a positive integer"),
}


def _check_blocklist_fields(spec: dict, where: str) -> None:
    for field, value in spec.items():
        if field not in _BLOCKLIST_FIELDS:
            continue  # BlocklistFilter names an unknown field itself
        kind, what = _BLOCKLIST_FIELDS[field]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if ok and kind is list:
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            raise ValueError(f"{where}.{field}: {what}, got {value!r}")


def _import(target: object, where: str) -> type:
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"{where}.class: 'package.module:ClassName'")
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}.class: cannot import {target!r}: {e}") from None


def load_filters(path: str | Path) -> Filters:
    """The filters a --filters-config file lists; ValueError naming what is wrong with it."""
    try:
        config = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--filters-config: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--filters-config: {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("filters"), list) or set(config) != {"filters"}:
        raise ValueError(f'--filters-config: {path} must hold one object {{"filters": [...]}}')
    try:
        return Filters([_build(spec, i) for i, spec in enumerate(config["filters"])])
    except ValueError as e:
        raise ValueError(f"--filters-config {path}: {e}") from None
