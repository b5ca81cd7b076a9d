"""Incremental detokenization of generated tokens for streaming, with OpenAI/vLLM-style stop strings.

Decoding each token on its own is wrong for two reasons: byte-level BPE and sentencepiece byte-fallback tokens can
hold part of a UTF-8 character (the rest comes with later tokens), and sentencepiece decoders strip the leading
space of whatever token comes first. Decoding the whole output every step is right but costs O(n) per token.

`IncrementalDetokenizer` decodes a short window instead (the technique vLLM and TGI use): a few already-emitted
tokens give context, and the text the window decodes to beyond what they decode to is the new text. The window
starts in the prompt, so the first generated token is decoded with the context it was generated in. A prompt that
ends in the first bytes of a character leaves them pending: the output starts with the whole character once a
generated token completes it (the prompt's own text shows U+FFFD there, as decoding it alone does).

Stop strings are matched on the text, not the tokens, since one can span tokens or end inside one. Text that could
be the start of a stop string is held back until it is clear whether the stop string completes.

Host-side only: no jax here.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Prompt tokens the first window starts with (vLLM uses 5 too): enough context for sentencepiece's leading-space
# handling and for a prompt that ends in special tokens that decode to nothing.
_PROMPT_CONTEXT_TOKENS = 5
# How much further back the first window may start to avoid beginning inside a multi-byte character: a UTF-8
# character has at most 4 bytes, so at most 3 byte tokens of it can precede a cut.
_PROMPT_CONTEXT_MAX_EXTRA = 4
# Tokens before the window are dropped once this many pile up, so memory stays bounded on long generations.
_TRIM_AT = 256


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text deltas safe to stream.

    Guarantees: a delta never holds a broken character (a U+FFFD that the final text would not have); the
    concatenation of every `add()` result and `flush()` equals `text`; without stop strings `text` is what decoding
    all generated tokens after the prompt gives; once a stop string shows up, `stopped` is set, `text` ends right
    before it (or right after it with include_stop_str_in_output) and further tokens are ignored.

    Stop strings follow OpenAI/vLLM semantics: they are searched in the generated text only (not the prompt), and
    when several could match, the one completed first (earliest end, then earliest start) wins, which is what a
    character-by-character stream would see regardless of how the text is tokenized.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        stop_armed: bool = True,
    ) -> None:
        if isinstance(stop, str):  # a bare string would otherwise become one stop string per character
            stop = (stop,)
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # An empty stop string would match before any text; OpenAI-style APIs treat it as absent.
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop_str_in_output
        # False until `arm_stop` (min_tokens): text that could start a stop string is held back, but none may end.
        self._stop_armed = stop_armed

        # Token window: ids[prefix_offset:read_offset] is context already emitted, ids[read_offset:] is pending.
        self._ids: list[int] = self._prompt_context([int(i) for i in prompt_ids])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # What decode(ids[prefix_offset:]) has contributed to the output so far, context included. It is longer
        # than the context's own text when a pending tail is held for an unfinished character.
        self._window_text = self._decode(self._ids)

        # Where the run of sentencepiece byte-fallback pieces the tokens end in starts, if they end in one: such a
        # run renders as a whole (valid UTF-8, or U+FFFD for every byte), so a later byte can still change it all.
        self._byte_run: int | None = None
        unfinished = self._unfinished_prompt_character()
        if unfinished is not None:
            # The prompt ends inside a character that generated tokens may complete (a token-id prompt cut anywhere,
            # or echo's continuation): its first bytes stay pending, so the token that completes it emits the whole
            # character. Taken as context, the prompt's U+FFFD for it would swallow the character.
            self._read_offset = unfinished
            self._window_text = self._window_text.rstrip(_REPLACEMENT)
            if self._tokenizer.is_byte_piece(self._ids[unfinished]):
                self._byte_run = unfinished

        # Decoded text not emitted yet because it could be the start of a stop string.
        self._held = ""
        self._parts: list[str] = []  # emitted deltas; joined lazily by `text`
        self._finished = False
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas returned by `add` and `flush`)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def arm_stop(self) -> None:
        """From the next token on a stop string may end (min_tokens: vLLM v1 checks none before it). One may start
        in the text held back before, as vLLM's search reaches back a stop string's length into older text."""
        self._stop_armed = True

    def add(self, token_id: int) -> str:
        """Feeds one generated token; returns the text that became final with it ('' if none did).

        Tokens after a stop string are ignored (returns ''): a batched engine may already have sampled them.
        """
        if self.stopped:
            return ""
        if self._finished:
            raise RuntimeError("add() after flush(): the held-back text has been released already")
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._tokenizer.is_byte_piece(token_id):
            if self._byte_run is None:
                self._byte_run = len(self._ids) - 1
        elif not self._skipped(token_id):  # a skipped special token: the run goes on
            self._byte_run = None
        return self._on_text(self._decode_step(), final=False)

    def flush(self) -> str:
        """Ends the stream: returns whatever was held back (an unfinished character, a partial stop string).

        A stop string completed by this tail still stops and is cut, so the result never contains one.
        """
        if self.stopped or self._finished:
            return ""
        self._finished = True
        # Decode the pending tokens as they are: an unfinished character stays U+FFFD, as a full decode shows it.
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = _suffix_after(new_text, self._window_text)
        return self._on_text(delta, final=True)

    # ---- tokens -> text ------------------------------------------------------------------------------------

    def _skipped(self, token_id: int) -> bool:
        """Whether the token decodes to nothing: a special token, with skip_special_tokens."""
        return self._skip_special_tokens and self._tokenizer.is_special(token_id)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last few prompt tokens, starting at a character boundary when the prompt allows it.

        A window starting inside a character decodes to a leading U+FFFD; worse, with byte fallback a run of byte
        tokens that starts mid-character decodes to nothing but U+FFFD, however it continues.
        """
        start = max(0, len(prompt_ids) - _PROMPT_CONTEXT_TOKENS)
        lowest = max(0, start - _PROMPT_CONTEXT_MAX_EXTRA)
        while start > lowest and self._decode(prompt_ids[start:]).startswith(_REPLACEMENT):
            start -= 1
        return prompt_ids[start:]

    def _unfinished_prompt_character(self) -> int | None:
        """Where the prompt context's unfinished last character starts, if it ends in the first bytes of one that
        later tokens may complete: the index of the token holding its lead byte, or for sentencepiece byte fallback
        the start of the run of byte pieces it ends in (the run renders as a whole). None when the context ends
        at a character boundary."""
        if not self._window_text.endswith(_REPLACEMENT):
            return None
        ids, tail = self._ids, b""
        # A character's bytes span at most 4 tokens; skipped special tokens among them decode to nothing.
        spanned = [j for j in reversed(range(len(ids))) if not self._skipped(ids[j])][:4]
        for j in spanned:
            tail = self._tokenizer.token_bytes(ids[j]) + tail
            if len(tail) < 4 and all(b & 0xC0 == 0x80 for b in tail):
                continue  # continuation bytes only so far: the lead byte is further back
            if not _incomplete_utf8_tail(tail):
                return None
            while j > 0 and self._tokenizer.is_byte_piece(ids[j]) and self._tokenizer.is_byte_piece(ids[j - 1]):
                j -= 1
            return j
        return None

    def _decode_step(self) -> str:
        """New final text after the latest token; moves the window forward when its text ends cleanly."""
        if self._byte_run is not None:
            # Only the text before an open byte-fallback run is final; the window waits for the run to end.
            return self._emit_stable(self._decode(self._ids[self._prefix_offset : max(self._byte_run,
                                                                                     self._read_offset)]))  # fmt: skip
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT) and self._ends_mid_character():
            # The tail holds an unfinished character. Text before it is final (byte-level decoding is left to
            # right), so emit that much and keep the window where it is until the character completes.
            return self._emit_stable(new_text.rstrip(_REPLACEMENT))
        if len(new_text) <= len(self._window_text):
            # Nothing new (e.g. a skipped special token). The window keeps its start, so the context that decides
            # e.g. a sentencepiece leading space is still there for the next token.
            return ""
        delta = _suffix_after(new_text, self._window_text)
        # The text ends at a character boundary: the tokens decoded so far become the next window's context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._window_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

    def _emit_stable(self, stable: str) -> str:
        """`stable`: the window's text up to what may still change. Returns its part not emitted yet."""
        if len(stable) > len(self._window_text) and stable.startswith(self._window_text):
            delta = stable[len(self._window_text) :]
            self._window_text = stable
            return delta
        return ""

    def _ends_mid_character(self) -> bool:
        """Whether the pending tokens end in the first bytes of a UTF-8 character that later tokens may complete.
        A U+FFFD that nothing can complete (byte-level BPE: a stray continuation byte, a broken sequence) is final
        text: waiting on it would keep the window from moving, and every later token would decode all the tokens
        since (quadratic)."""
        pending = [i for i in self._ids[self._read_offset :] if not self._skipped(i)]
        return not pending or _incomplete_utf8_tail(b"".join(self._tokenizer.token_bytes(i) for i in pending[-4:]))

    # ---- stop strings ----------------------------------------------------------------------------------------

    def _on_text(self, delta: str, *, final: bool) -> str:
        """Takes newly final text through the stop-string check; returns what may be emitted now."""
        if not self._stop:
            return self._emit(delta)
        # A match must end in the new text. (Armed from the start, the held text is a proper prefix of a stop
        # string at most; held while unarmed, it may hold one stop string that prefixes a longer one.)
        pending = self._held + delta
        match = self._first_stop(pending, len(self._held) + 1) if self._stop_armed else None
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self._include_stop else start
            self.stopped = True
            self.stop_reason = stop_str
            self._held = ""
            return self._emit(pending[:end])
        keep = 0 if final else self._partial_stop_len(pending)
        self._held = pending[len(pending) - keep :]
        return self._emit(pending[: len(pending) - keep])

    def _first_stop(self, text: str, min_end: int) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in `text` at `min_end` or later; ties go to the longer
        (earlier) one."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = text.find(s, max(0, min_end - len(s)))  # the first occurrence is also the earliest-ending one
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with (and does not equal).

        Only that suffix can still become part of a match, so only it is held back: less than vLLM's fixed
        (longest stop string - 1) characters, and the same guarantee.
        """
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta


def _incomplete_utf8_tail(data: bytes) -> bool:
    """Whether `data` ends with a UTF-8 lead byte followed by fewer continuation bytes than it announces."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: its lead byte is further back
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return need > back
    return False


def _suffix_after(new_text: str, old_text: str) -> str:
    """new_text beyond old_text.

    The window decode normally extends the context's text. A decoder that rewrites earlier text given later tokens
    (e.g. WordPiece's clean-up of " 's") breaks that; the text already streamed cannot be taken back, so fall back
    to the characters past its length, as vLLM does.
    """
    return new_text[len(old_text) :]
