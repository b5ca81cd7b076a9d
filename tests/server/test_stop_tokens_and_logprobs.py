"""Stop tokens, text_offset and chat logprobs' bytes over HTTP, on an in-process app whose engine plays a script of
token ids (the default model's tokenizer): exact control of what the model "samples" (a stop token, EOS, the byte
pieces of an emoji), which the real model gives only by chance.

- A sequence ended by EOS or one of stop_token_ids keeps that token (usage, logprobs) but not its text, unless
  include_stop_str_in_output (vLLM's rule, as for stop strings); streamed and whole responses agree.
- Legacy text_offset: where each token's text starts in the (echo +) text, counted as the text's characters (the
  independent reference here: the length of what the tokens before it decode to, less a trailing unfinished
  character), clamped to the text; the same streamed and whole.
- Chat logprobs' `bytes`: a token's real bytes, so the bytes of an emoji's pieces join into the emoji.
"""

from __future__ import annotations

import pytest

from jaxinfer.types import SamplingParams, SeqTiming, SeqUpdate
from tests.server.conftest import in_process, sse_chunks
from tests.server.fake_engine import FakeEngine

REPLACEMENT = "\ufffd"


class ScriptedEngine(FakeEngine):
    """FakeEngine that makes `script`'s tokens, one a step, and ends a sequence as the real engine does
    (Engine._stop): on one of stop_token_ids ("stop", that id), on EOS ("stop", None) unless ignore_eos, at
    max_tokens or the script's end ("length"). Each token's logprobs: itself at -0.5 and `ALTERNATIVE` at -1.5."""

    ALTERNATIVE = 0

    def __init__(self, tokenizer):
        super().__init__(tokenizer.vocab_size)
        self.eos = tokenizer.eos_token_ids
        self.script: list[int] = []
        self.params: dict[str, SamplingParams] = {}

    def add_request(self, prompt_ids, params: SamplingParams, request_id: str) -> str:
        assert params.n == 1
        self.params[request_id] = params
        return super().add_request(prompt_ids, params, request_id)

    def step(self) -> list[SeqUpdate]:
        updates = []
        for sid, seq in list(self.seqs.items()):
            p = self.params[sid]
            tok = self.script[seq.made]
            seq.made += 1
            if tok in p.stop_token_ids:
                reason, stop_reason = "stop", tok
            elif not p.ignore_eos and tok in self.eos:
                reason, stop_reason = "stop", None
            elif seq.made >= p.max_tokens or seq.made == len(self.script):
                reason, stop_reason = "length", None
            else:
                reason, stop_reason = None, None
            if reason:
                self._drop(sid)
            lps = [{tok: -0.5, self.ALTERNATIVE: -1.5}] if seq.logprobs else []
            timing = SeqTiming(0.0, 0.0, 0, []) if seq.made == 1 else None
            updates.append(SeqUpdate(sid, [tok], lps, reason is not None, reason, stop_reason, timing=timing))
        return updates


@pytest.fixture(scope="module")
def served(tokenizer):
    """(TestClient, the scripted engine, tokenizer)."""
    engine = ScriptedEngine(tokenizer)
    with in_process(engine, tokenizer, "scripted", timeout=30) as client:
        yield client, engine, tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(client, body: dict) -> tuple[dict, dict]:
    """(the whole choice, the streamed choice joined: text, logprobs lists concatenated, finish and stop reason)."""
    whole = _post(client, "/v1/completions", body)["choices"][0]
    joined: dict = {"text": "", "logprobs": None}
    for chunk in sse_chunks(client, "/v1/completions", body):
        for c in chunk["choices"]:
            joined["text"] += c["text"]
            if c["logprobs"] is not None:
                acc = joined["logprobs"] = joined["logprobs"] or {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    acc[k] += v
            if c["finish_reason"] is not None:
                joined["finish_reason"], joined["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return whole, joined


def _chat(client, body: dict) -> tuple[dict, dict]:
    """(the whole choice, the streamed choice joined: content, logprobs content, finish and stop reason)."""
    whole = _post(client, "/v1/chat/completions", body)["choices"][0]
    joined: dict = {"content": "", "logprobs": []}
    for chunk in sse_chunks(client, "/v1/chat/completions", body):
        for c in chunk["choices"]:
            joined["content"] += c["delta"].get("content") or ""
            joined["logprobs"] += (c["logprobs"] or {}).get("content") or []
            if c["finish_reason"] is not None:
                joined["finish_reason"], joined["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return whole, joined


def _reference_offsets(tokenizer, context: list[int], ids: list[int], text_len: int, base: int, skip: bool):
    """Where each token starts: the characters that the tokens before it decode to (after `context`), less a
    trailing unfinished character, at most `text_len`; plus `base`."""
    head = tokenizer.decode(context, skip_special_tokens=skip)
    out = []
    for i in range(len(ids)):
        text = tokenizer.decode([*context, *ids[:i]], skip_special_tokens=skip)
        assert text.startswith(head)
        out.append(base + min(len(text[len(head) :].rstrip(REPLACEMENT)), text_len))
    return out


# ---- stop tokens -----------------------------------------------------------------------------------------------

PROMPT = "The capital of France is"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked(served, include):
    client, engine, tok = served
    period = _ids(tok, ".")[0]
    engine.script = [*_ids(tok, " Paris"), period, *_ids(tok, " It is")]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1, "stop_token_ids": [period],
            "include_stop_str_in_output": include}  # fmt: skip
    whole, joined = _complete(client, body)
    text = " Paris." if include else " Paris"
    assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == (text, "stop", period)
    # The stop token still counts, and its logprob is there (as vLLM's), placed at the end of the text.
    lp = whole["logprobs"]
    assert lp["tokens"] == [" Paris", "."] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"] == [0, 6]
    usage = _post(client, "/v1/completions", body)["usage"]
    assert usage["completion_tokens"] == 2
    assert {k: whole[k] for k in joined} == joined


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_left_out_with_special_tokens_shown(served, include):
    client, engine, tok = served
    eos = tok.eos_token_ids[0]
    assert tok.decode([eos], skip_special_tokens=False) == "<|im_end|>"
    engine.script = [*_ids(tok, " Paris."), eos, *_ids(tok, " More")]
    extra = {"skip_special_tokens": False, "include_stop_str_in_output": include, "temperature": 0, "max_tokens": 16}
    text = " Paris.<|im_end|>" if include else " Paris."

    whole, joined = _complete(client, {"prompt": PROMPT, "logprobs": 0, **extra})
    assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == (text, "stop", None)
    assert whole["logprobs"]["tokens"] == [" Paris", ".", "<|im_end|>"]
    assert whole["logprobs"]["text_offset"] == [0, 6, 7]
    assert {k: whole[k] for k in joined} == joined

    messages = [{"role": "user", "content": "The capital of France?"}]
    whole, joined = _chat(client, {"messages": messages, "logprobs": True, **extra})
    assert (whole["message"]["content"], whole["finish_reason"], whole["stop_reason"]) == (text, "stop", None)
    assert [t["token"] for t in whole["logprobs"]["content"]] == [" Paris", ".", "<|im_end|>"]
    assert joined["content"] == text and joined["logprobs"] == whole["logprobs"]["content"]
    assert (joined["finish_reason"], joined["stop_reason"]) == ("stop", None)


def test_eos_ends_a_held_back_stop_string_prefix(served):
    """Text held for a possible stop string comes out when EOS ends the sequence; EOS's own text does not."""
    client, engine, tok = served
    engine.script = [*_ids(tok, " Paris is"), tok.eos_token_ids[0]]
    body = {"prompt": PROMPT, "max_tokens": 16, "stop": ["is big"], "skip_special_tokens": False, "logprobs": 0}
    whole, joined = _complete(client, body)
    assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == (" Paris is", "stop", None)
    assert whole["logprobs"]["text_offset"] == [0, 6, 9]
    assert {k: whole[k] for k in joined} == joined


# ---- text_offset ---------------------------------------------------------------------------------------------


def _check_offsets(tok, body: dict, whole: dict, joined: dict, gen: list[int]) -> None:
    lp = whole["logprobs"]
    text = whole["text"]
    n = len(lp["tokens"]) - len(gen)  # echoed prompt tokens first
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= at <= len(text) for at in offsets)
    prompt_ids = tok.encode(body["prompt"])
    echo = body["prompt"] if body.get("echo") else ""
    expected = _reference_offsets(tok, prompt_ids, gen, len(text) - len(echo), len(echo), True)
    if n:
        expected = _reference_offsets(tok, [], prompt_ids, len(echo), 0, False) + expected
    assert offsets == expected
    assert {k: whole[k] for k in joined} == joined  # streamed: same text, tokens and offsets


def test_offsets_past_a_held_stop_string(served):
    """The reported case: "." was placed at 2 when streamed (characters sent so far) while " aris" was held."""
    client, engine, tok = served
    gen = _ids(tok, " Paris. Paris is big")
    engine.script = gen
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0, "stop": ["aris is"]}
    whole, joined = _complete(client, body)
    assert whole["text"] == " Paris. P" and whole["stop_reason"] == "aris is"
    # " Paris", ".", " Paris", " is": the last one starts past the cut, at the text's end.
    assert whole["logprobs"]["text_offset"] == [0, 6, 7, 9]
    _check_offsets(tok, body, whole, joined, gen[:4])


@pytest.mark.parametrize("echo", [False, True])
def test_offsets_of_split_characters(served, echo):
    """Each emoji is three byte-level tokens: they share the offset where the emoji starts."""
    client, engine, tok = served
    gen = _ids(tok, "🐱🐶🐱")
    assert len(gen) == 9 and all(tok.decode([t]) == REPLACEMENT for t in gen)
    engine.script = gen
    prompt = "Cute animals: 🐱🐶🐱🐶🐱"
    body = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "logprobs": 1, "echo": echo}
    whole, joined = _complete(client, body)
    base = len(prompt) if echo else 0
    assert whole["text"] == (prompt if echo else "") + "🐱🐶🐱"
    assert whole["logprobs"]["text_offset"][-9:] == [base + i for i in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    _check_offsets(tok, body, whole, joined, gen)


def test_offsets_of_a_character_cut_by_max_tokens(served):
    """An unfinished character at the end shows as U+FFFD (as a full decode does); its pieces start at it."""
    client, engine, tok = served
    gen = _ids(tok, " a🐱")
    engine.script = gen
    body = {"prompt": PROMPT, "max_tokens": len(gen) - 1, "temperature": 0, "logprobs": 0}
    whole, joined = _complete(client, body)
    assert whole["text"] == " a" + REPLACEMENT and whole["finish_reason"] == "length"
    assert whole["logprobs"]["text_offset"] == [0, 2, 2]
    _check_offsets(tok, body, whole, joined, gen[:-1])


# ---- chat bytes ------------------------------------------------------------------------------------------------


def test_chat_bytes_join_into_the_text(served):
    client, engine, tok = served
    gen = _ids(tok, "Cats: 🐱, dogs: 🐶 and 日本")
    engine.script = [*gen, tok.eos_token_ids[0]]
    messages = [{"role": "user", "content": "Cute animals?"}]
    body = {"messages": messages, "max_tokens": 64, "logprobs": True, "top_logprobs": 1}
    whole, joined = _chat(client, body)
    text = whole["message"]["content"]
    assert text == "Cats: 🐱, dogs: 🐶 and 日本" and joined["content"] == text
    content = whole["logprobs"]["content"]
    assert joined["logprobs"] == content
    # EOS ends it: its entry is last (its text is not in the content), with its own bytes.
    assert content[-1]["token"] == "<|im_end|>" and bytes(content[-1]["bytes"]) == b"<|im_end|>"
    assert bytes(b for item in content[:-1] for b in item["bytes"]).decode("utf-8") == text
    # `token` stays the token decoded alone: U+FFFD for a piece of a character, and never its bytes.
    pieces = [item for item in content if item["token"] == REPLACEMENT]
    assert len(pieces) >= 6 and all(item["bytes"] != list(REPLACEMENT.encode()) for item in pieces)
    for item in content:
        (top,) = item["top_logprobs"]
        assert (top["token"], top["bytes"]) == (item["token"], item["bytes"])
