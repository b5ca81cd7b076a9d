"""jaxinfer.detokenizer: streaming text equals a full decode, no broken characters, stop strings never leak."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import gguf
import pytest

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.model_files import ModelNotFoundError, gemma3_270m_gguf, smollm2_gguf
from jaxinfer.tokenizer import Tokenizer, load_tokenizer

REPLACEMENT = "\ufffd"

TEXTS = {
    "plain": "The quick brown fox jumps over the lazy dog.",
    "leading_spaces": "   leading spaces and  double  spaces",
    "leading_space_word": " Paris",
    "newlines": "line one\nline two\n\n\nline five\n",
    "tabs_crlf": "\ttab\tseparated\r\nwindows\r\n",
    "accents": "Café naïve résumé über façade",
    "cyrillic": " Привет, как дела? хорошо",
    "cjk": "日本語のテキストと中文字符，還有𠀋𡈽。",
    "emoji": "Emoji 😀👍🏽 hi 👋 and 🎉🎉",
    "zwj_family": "family 👨\u200d👩\u200d👧\u200d👦 and 🏳️\u200d🌈 done",
    "flags": "flags 🇫🇷🇯🇵🇺🇸 end",
    "rare_chars": "𓀀𓁐 hieroglyphs, math 𝔸𝔹 and \u2028 separator",
    "python": "def f(x):\n    if x > 0:\n        return x * 2  # double\n    return -x\n",
    "numbers": "3.14159 1,000,000 2024-01-31",
    "mixed": "Mixed: ñ 你好 😀 \n\t end",
}

PROMPT = "Repeat the following text exactly:\n"


def _gguf_path(name: str) -> Path:
    locate = {"smollm2": smollm2_gguf, "gemma3": gemma3_270m_gguf}[name]
    try:
        return locate()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


# Loading Gemma's 262k vocabulary takes a few seconds: once per module.
@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return load_tokenizer(_gguf_path(request.param))


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_tokenizer(_gguf_path("smollm2"))


@pytest.fixture(scope="module")
def gemma3() -> Tokenizer:
    return load_tokenizer(_gguf_path("gemma3"))


def _enc(tk: Tokenizer, text: str) -> list[int]:
    return tk.encode(text, add_special_tokens=False)


def _stream(det: IncrementalDetokenizer, ids: Sequence[int], *, flush: bool = True) -> list[str]:
    """Feeds ids one by one; checks the invariants that hold after every step. Returns the deltas (flush last)."""
    deltas = []
    for i in ids:
        delta = det.add(i)
        assert isinstance(delta, str)
        delta.encode("utf-8")  # no lone surrogates or other unencodable halves
        deltas.append(delta)
        assert "".join(deltas) == det.text
    if flush:
        deltas.append(det.flush())
        assert "".join(deltas) == det.text
    return deltas


# ---- streaming equals decoding at once ---------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["chat", "bos_only", "none"])
@pytest.mark.parametrize("key", sorted(TEXTS))
def test_stream_matches_full_decode(tok: Tokenizer, key: str, prompt: str) -> None:
    gen = _enc(tok, TEXTS[key])
    prompt_ids = {
        "chat": tok.encode(PROMPT),
        "bos_only": [tok.bos_token_id],
        "none": [],
    }[prompt]
    det = IncrementalDetokenizer(tok, prompt_ids)
    deltas = _stream(det, gen)

    full = tok.decode(gen)
    assert REPLACEMENT not in full  # the texts are valid, so any U+FFFD in a delta would be a torn character
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == det.text == full
    # Same as the generated part of decoding prompt and output together.
    with_prompt = tok.decode([*prompt_ids, *gen])
    prompt_text = tok.decode(prompt_ids)
    assert with_prompt.startswith(prompt_text) and with_prompt[len(prompt_text) :] == full
    assert det.flush() == "" and not det.stopped and det.stop_reason is None


def test_text_is_streamed_early(tok: Tokenizer) -> None:
    """Text comes out as soon as it is final, not only at flush."""
    gen = _enc(tok, TEXTS["plain"])
    det = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    deltas = _stream(det, gen, flush=False)
    assert all(deltas) and det.flush() == ""


class _RecordingTokenizer:
    """Delegates to a Tokenizer and records how many ids each decode call gets."""

    def __init__(self, tk: Tokenizer) -> None:
        self.tk = tk
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self.tk, name)


def test_decode_window_stays_small(tok: Tokenizer) -> None:
    """Per-token cost is O(1): each step decodes a few tokens, however long the output grows."""
    gen = _enc(tok, " ".join(TEXTS.values()) * 3)
    assert len(gen) > 300
    rec = _RecordingTokenizer(tok)
    det = IncrementalDetokenizer(rec, tok.encode(PROMPT))  # type: ignore[arg-type]
    _stream(det, gen)
    assert det.text == tok.decode(gen)
    assert max(rec.lengths) <= 16
    assert len(rec.lengths) <= 2 * len(gen) + 8


def _byte_token(tk: Tokenizer, value: int) -> int:
    return next(i for i in range(tk.vocab_size) if tk.token_bytes(i) == bytes([value]))


@pytest.mark.parametrize("tail", ["", "😀"])
def test_bytes_no_character_can_complete_are_final(tok: Tokenizer, tail: str) -> None:
    """Byte-level BPE: a stray continuation byte decodes to a U+FFFD that no later token can complete, so it is
    final text and the window moves on past it (it used to wait forever, each step decoding every token since:
    quadratic). Sentencepiece byte fallback renders a run of byte pieces as a whole, so there the run is held
    until it ends (a later byte may turn it all to U+FFFD): the text is right, the window not bounded."""
    gen = [_byte_token(tok, 0x80)] * 400 + _enc(tok, "ok" + tail) + [_byte_token(tok, 0xBF)] * 3
    rec = _RecordingTokenizer(tok)
    det = IncrementalDetokenizer(rec, tok.encode(PROMPT))  # type: ignore[arg-type]
    deltas = _stream(det, gen, flush=False)
    assert det.text + det.flush() == tok.decode(gen)
    if tok.id_to_token(gen[0]) != "<0x80>":  # byte-level
        assert sum(map(len, deltas)) >= 400  # streamed as it came, not held to the end
        assert max(rec.lengths) <= 16


def test_a_byte_fallback_run_is_final_only_when_it_ends(gemma3: Tokenizer) -> None:
    """Sentencepiece renders a run of byte pieces as a whole: <0xCF><0x8F> is 'Ϗ', but <0x80> after it turns
    the run to three U+FFFD. Nothing of a run is emitted until a non-byte token ends it (the stream once held 'Ϗ',
    which the full decode does not); a run of stray bytes costs O(1) a token all the same."""
    gen = [_byte_token(gemma3, b) for b in (0xCF, 0x8F, 0x80)] + _enc(gemma3, "x") + [_byte_token(gemma3, 0x80)] * 300
    rec = _RecordingTokenizer(gemma3)
    det = IncrementalDetokenizer(rec, gemma3.encode(PROMPT))  # type: ignore[arg-type]
    deltas = _stream(det, gen[:4], flush=False)
    assert "".join(deltas) == gemma3.decode(gen[:4]) == "\ufffd" * 3 + "x"
    later = [det.add(i) for i in gen[4:]]
    assert not any(later) and det.text + det.flush() == gemma3.decode(gen)
    assert max(rec.lengths) <= 16 + 300  # the run's one decode at the end


# ---- characters split across tokens ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "char"),
    [
        ("smollm2", "a😀b", "😀"),  # byte-level BPE: F0 9F | 98 | 80
        ("smollm2", "語", "語"),
        ("smollm2", "ok 👨\u200d👩\u200d👧 ok", "👩"),
        ("gemma3", "x𓀀y", "𓀀"),  # sentencepiece byte fallback: <0xF0> <0x93> <0x80> <0x80>
        ("gemma3", " 𠀋 ", "𠀋"),
    ],
)
def test_multibyte_character_split_across_tokens(
    name: str, text: str, char: str, request: pytest.FixtureRequest
) -> None:
    tk: Tokenizer = request.getfixturevalue(name)
    char_ids = _enc(tk, char)
    assert len(char_ids) > 1, "the character must span several tokens for this test to mean anything"
    assert all(REPLACEMENT in tk.decode([i]) for i in char_ids)

    gen = _enc(tk, text)
    det = IncrementalDetokenizer(tk, tk.encode(PROMPT))
    deltas = _stream(det, gen)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == tk.decode(gen) == text
    # The character arrives whole, in one delta.
    assert any(char in d for d in deltas)


def test_token_with_a_whole_and_a_partial_character(smollm2: Tokenizer) -> None:
    """'ĠÐ' is a space plus the first byte of 'П': the space is final at once, the partial byte waits."""
    gen = _enc(smollm2, " Привет")
    assert smollm2.decode(gen[:1]) == " " + REPLACEMENT
    det = IncrementalDetokenizer(smollm2, smollm2.encode(PROMPT))
    assert det.add(gen[0]) == " "
    assert det.add(gen[1]) == "П"
    assert "".join(det.add(i) for i in gen[2:]) + det.flush() == "ривет"
    assert det.text == " Привет"


def test_unfinished_character_at_the_end_is_flushed(smollm2: Tokenizer) -> None:
    """A stream cut inside a character: flush releases what decoding everything shows (U+FFFD)."""
    gen = _enc(smollm2, "hi 😀")[:-1]
    det = IncrementalDetokenizer(smollm2, [])
    deltas = _stream(det, gen, flush=False)
    assert "".join(deltas) == "hi "
    assert det.flush() == REPLACEMENT
    assert det.text == smollm2.decode(gen) and det.text.endswith(REPLACEMENT)


@pytest.mark.parametrize(
    ("name", "text"),
    [("smollm2", "Say: Привет мир 😀 ok 語"), ("gemma3", "x𓀀y 𠀋 z")],  # byte-level BPE; sentencepiece byte fallback
)
def test_a_prompt_cut_inside_a_character(name: str, text: str, request: pytest.FixtureRequest) -> None:
    """A token-id prompt (or echo's continuation) may end in the first bytes of a character the generated tokens
    complete. The prompt's text shows U+FFFD there; the output starts with the whole character, so the two together
    read as the full decode. Taking the prompt's U+FFFD as context used to swallow the character."""
    tk: Tokenizer = request.getfixturevalue(name)
    ids = _enc(tk, text)
    cut_inside = 0
    for cut in range(1, len(ids)):
        prompt_text = tk.decode(ids[:cut])
        cut_inside += prompt_text.endswith(REPLACEMENT)
        deltas = _stream(IncrementalDetokenizer(tk, ids[:cut]), ids[cut:])
        assert all(REPLACEMENT not in d for d in deltas), cut
        assert prompt_text.rstrip(REPLACEMENT) + "".join(deltas) == tk.decode(ids) == text, cut
    assert cut_inside >= 3, "the text must have cuts inside characters for this test to mean anything"


# ---- sentencepiece leading space ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_prefix_tok() -> Tokenizer:
    """A tiny llama-style (sentencepiece BPE) vocabulary with the dummy-prefix space, whose decoder strips the
    leading space of the first token, as Llama/Mistral tokenizers do. (The packaged Gemma GGUF has no prefix.)"""
    # Every prefix of a word is a piece too, so BPE can build the word one character at a time.
    words = ["▁The", "▁Paris", "▁is", "▁capital", "▁of", "▁France", "▁a", "▁city", "."]
    pieces = sorted({p for w in words for p in (w, *w[1:])} | {"▁"} | {w[:k] for w in words for k in range(2, len(w))})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces)
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [float(len(p)) for p in pieces],
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": True,
    }
    return Tokenizer.from_gguf(meta)


def test_sentencepiece_leading_space_comes_from_prompt_context(sp_prefix_tok: Tokenizer) -> None:
    tk = sp_prefix_tok
    prompt = tk.encode("The capital of France is")
    gen = _enc(tk, "Paris is a city.")
    assert tk.id_to_token(gen[0]) == "▁Paris"
    assert tk.decode(gen) == "Paris is a city."  # alone, the first token's space is stripped

    det = IncrementalDetokenizer(tk, prompt)
    deltas = _stream(det, gen)
    # After the prompt it is a word boundary: the space belongs in the output, as decoding all of it shows.
    assert det.text == " Paris is a city."
    assert tk.decode([*prompt, *gen]) == tk.decode(prompt) + det.text
    assert deltas[0] == " Paris"

    # With nothing before it (or only BOS, which decodes to nothing) it is the start of the text, as in decode().
    for prompt_ids in ([], [tk.bos_token_id]):
        det = IncrementalDetokenizer(tk, prompt_ids)
        _stream(det, gen)
        assert det.text == tk.decode(gen)


def test_sentencepiece_byte_fallback_after_context(sp_prefix_tok: Tokenizer) -> None:
    """Characters outside the tiny vocabulary decode through <0xXX> byte tokens."""
    tk = sp_prefix_tok
    gen = _enc(tk, "Paris é 😀 .")
    assert sum(tk.id_to_token(i).startswith("<0x") for i in gen) >= 6
    det = IncrementalDetokenizer(tk, tk.encode("The"))
    deltas = _stream(det, gen)
    assert all(REPLACEMENT not in d for d in deltas)
    assert det.text == " Paris é 😀 ."


# ---- stop strings -----------------------------------------------------------------------------------------

STOP_TEXT = " The capital of France is Paris is a city. Paris is big."


def _stop_run(
    tk: Tokenizer, text: str, stop: Sequence[str] | str, include: bool = False, flush: bool = True
) -> tuple[IncrementalDetokenizer, list[str], list[int]]:
    gen = _enc(tk, text)
    det = IncrementalDetokenizer(tk, tk.encode(PROMPT), stop=stop, include_stop_str_in_output=include)
    deltas = _stream(det, gen, flush=flush)
    return det, deltas, gen


def _assert_never_leaked(deltas: Sequence[str], final: str) -> None:
    """Every streamed prefix is a prefix of the final text: nothing that was later cut was ever sent."""
    sent = ""
    for d in deltas:
        sent += d
        assert final.startswith(sent)
    assert sent == final


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    gen = _enc(tok, STOP_TEXT)
    pieces = [tok.decode([i]) for i in gen]
    assert not any("Paris is" in p for p in pieces), "the stop string must span several tokens"
    det, deltas, _ = _stop_run(tok, STOP_TEXT, ["Paris is"])
    assert det.stopped and det.stop_reason == "Paris is"
    assert det.text == " The capital of France is "
    _assert_never_leaked(deltas, det.text)
    assert not any("P" in d for d in deltas)  # "P" was held back until the match decided it


def test_stop_string_include_in_output(tok: Tokenizer) -> None:
    det, deltas, _ = _stop_run(tok, STOP_TEXT, ["Paris is"], include=True)
    assert det.stopped and det.text == " The capital of France is Paris is"
    _assert_never_leaked(deltas, det.text)


def test_stop_string_inside_a_token(tok: Tokenizer) -> None:
    gen = _enc(tok, STOP_TEXT)
    assert any("ari" in tok.decode([i]) for i in gen)
    det, deltas, _ = _stop_run(tok, STOP_TEXT, "ari")  # a bare string is one stop string, as in OpenAI's API
    assert det.stopped and det.stop_reason == "ari"
    assert det.text == " The capital of France is P"
    _assert_never_leaked(deltas, det.text)


@pytest.mark.parametrize(
    ("stop", "reason", "expected"),
    [
        (["France", "capital"], "capital", " The "),  # the one that comes first in the text wins, not list order
        (["Paris is", "is"], "is", " The capital of France "),
        # Both complete at the same character: the longer (earlier) match is cut.
        (["France is Paris", "is Paris"], "France is Paris", " The capital of "),
        # "s P" ends before "is Paris" does, so a character-by-character stream would stop there first.
        (["is Paris", "s P"], "s P", " The capital of France i"),
        (["London", "city."], "city.", " The capital of France is Paris is a "),
    ],
)
def test_several_stop_strings(tok: Tokenizer, stop: list[str], reason: str, expected: str) -> None:
    det, deltas, _ = _stop_run(tok, STOP_TEXT, stop)
    assert det.stopped and det.stop_reason == reason
    assert det.text == expected
    _assert_never_leaked(deltas, det.text)


def test_stop_string_never_appears(tok: Tokenizer) -> None:
    """A partial stop string at the end is held while streaming and released by flush."""
    text = " Greetings from Lond"
    det, deltas, gen = _stop_run(tok, text, ["London", "\n\n"], flush=False)
    streamed = "".join(deltas)
    assert not det.stopped and det.stop_reason is None
    assert streamed == " Greetings from " and "L" not in streamed
    assert det.flush() == "Lond"
    assert det.text == tok.decode(gen) == text
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.add(gen[0])


def test_stop_string_in_prompt_is_not_matched(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, tok.encode("Say Paris:"), stop=["Paris"])
    _stream(det, _enc(tok, " Lyon"))
    assert not det.stopped and det.text == " Lyon"


def test_tokens_after_stop_are_ignored(tok: Tokenizer) -> None:
    det, _, gen = _stop_run(tok, STOP_TEXT, ["France"], flush=False)
    assert det.stopped and det.text == " The capital of "
    assert det.add(gen[0]) == "" and det.flush() == "" and det.text == " The capital of "


def test_stop_string_on_a_split_character(smollm2: Tokenizer) -> None:
    """A stop string that is a character split over byte tokens matches once the character is whole."""
    text = "hi 😀 there 😀"
    assert len(_enc(smollm2, "😀")) > 1
    det, deltas, _ = _stop_run(smollm2, text, ["😀"])
    assert det.stopped and det.text == "hi "
    _assert_never_leaked(deltas, det.text)
    assert all(REPLACEMENT not in d for d in deltas)


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_substrings(tok: Tokenizer, include: bool) -> None:
    """Stop strings cut from the text at random places (mid-token, across tokens, multi-byte) stop exactly there."""
    text = TEXTS["plain"] + " " + TEXTS["mixed"] + " " + TEXTS["cjk"] + TEXTS["emoji"]
    gen = _enc(tok, text)
    full = tok.decode(gen)
    rng = random.Random(0)
    for _ in range(30):
        start = rng.randrange(len(full) - 1)
        stop = full[start : start + rng.randint(1, 8)]
        det = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=[stop], include_stop_str_in_output=include)
        deltas = _stream(det, gen)
        cut = full.find(stop)
        expected = full[: cut + len(stop)] if include else full[:cut]
        assert det.stopped and det.stop_reason == stop, stop
        assert det.text == expected, stop
        _assert_never_leaked(deltas, expected)
        assert all(REPLACEMENT not in d for d in deltas)


def test_stop_holds_back_only_possible_starts(tok: Tokenizer) -> None:
    """Text that cannot start a stop string is not delayed (vLLM would hold len(stop) - 1 characters)."""
    gen = _enc(tok, " The capital of France")
    det = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["\n\nUser:"])
    _stream(det, gen, flush=False)
    assert det.text == " The capital of France"


def test_empty_stop_strings_are_ignored(tok: Tokenizer) -> None:
    det, _, gen = _stop_run(tok, "abc", ["", "zzz"])
    assert not det.stopped and det.text == tok.decode(gen)


# ---- special tokens ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "skipped"),
    [
        ("smollm2", "<|im_start|>assistant\nHi there<|im_end|>", "assistant\nHi there"),
        ("gemma3", "<start_of_turn>model\nHi there<end_of_turn>", "model\nHi there"),
    ],
)
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(name: str, text: str, skipped: str, skip: bool, request: pytest.FixtureRequest) -> None:
    tk: Tokenizer = request.getfixturevalue(name)
    gen = _enc(tk, text)
    assert tk.is_special(gen[0]) and tk.is_special(gen[-1])
    det = IncrementalDetokenizer(tk, tk.encode(PROMPT), skip_special_tokens=skip)
    deltas = _stream(det, gen)
    assert det.text == tk.decode(gen, skip_special_tokens=skip) == (skipped if skip else text)
    assert all(REPLACEMENT not in d for d in deltas)


def test_special_token_as_stop_string(smollm2: Tokenizer) -> None:
    """With special tokens kept, their text can be a stop string; skipped, it never shows up to match."""
    text = "Hi<|im_end|>more"
    gen = _enc(smollm2, text)
    det = IncrementalDetokenizer(smollm2, [], skip_special_tokens=False, stop=["<|im_end|>"])
    _stream(det, gen)
    assert det.stopped and det.text == "Hi"
    det = IncrementalDetokenizer(smollm2, [], skip_special_tokens=True, stop=["<|im_end|>"])
    _stream(det, gen)
    assert not det.stopped and det.text == "Himore"
