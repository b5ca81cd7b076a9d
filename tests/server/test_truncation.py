"""The context-window rule over HTTP, on an in-process server whose engine is `FakeEngine` (context 512 tokens,
and it records each prompt it is given): by default a request that does not fit is a 400 naming the limit; under
`--chat-truncation oldest` a long conversation loses its oldest turns (never the system prompt nor the last user
message) and usage reports them; completions' `truncate_prompt_tokens` keeps the prompt's last tokens."""

from __future__ import annotations

import json

import pytest

from tests.server.test_lifecycle import InProcessServer

LIMIT = 512  # FakeEngine's max_model_len
SYSTEM = {"role": "system", "content": "You are the ship's computer. Answer in one short sentence."}
LAST = {"role": "user", "content": "Final question: what is the current heading?"}


def _conversation(turns: int) -> list[dict]:
    msgs = [SYSTEM]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Turn {t}: please log that the weather over sector {t} is calm."})
        msgs.append({"role": "assistant", "content": f"Logged: sector {t} calm, visibility good, no traffic."})
    return [*msgs, LAST]


def _prompt_len(tokenizer, msgs: list[dict]) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True),
                                add_special_tokens=False))  # fmt: skip


@pytest.fixture(scope="module")
def servers(tokenizer):
    made = {"off": InProcessServer(tokenizer), "oldest": InProcessServer(tokenizer, chat_truncation="oldest")}
    for srv in made.values():
        srv.wait_ready()
    yield made
    for srv in made.values():
        srv.close()


def _last_prompt(srv: InProcessServer) -> list[int]:
    return list(srv.engine.prompts.values())[-1]


def _context_error(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert f"maximum context length is {LIMIT} tokens" in err["message"] or f"of {LIMIT} tokens" in err["message"]
    return err


def test_long_chat_is_a_400_naming_the_limit_without_the_policy(servers, tokenizer):
    msgs = _conversation(12)
    full = _prompt_len(tokenizer, msgs)
    assert full > LIMIT
    r = servers["off"].http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 16})
    err = _context_error(r, "messages")
    assert f"({full} in the prompt, 16 for the completion)" in err["message"]
    # A prompt that fits but leaves too little room for max_tokens is the same 400.
    short = _conversation(3)
    fits = _prompt_len(tokenizer, short)
    body = {"messages": short, "max_completion_tokens": LIMIT - fits + 1}
    _context_error(servers["off"].http.post("/v1/chat/completions", json=body), "messages")
    body["max_completion_tokens"] = LIMIT - fits
    assert servers["off"].http.post("/v1/chat/completions", json=body).status_code == 200
    # More completion tokens than the context holds: the completion's parameter is named.
    body["max_completion_tokens"] = LIMIT
    _context_error(servers["off"].http.post("/v1/chat/completions", json=body), "max_completion_tokens")


@pytest.mark.parametrize("stream", [False, True])
def test_oldest_keeps_system_and_last_message_and_reports_dropped_turns(servers, tokenizer, stream):
    srv = servers["oldest"]
    msgs = _conversation(12)
    max_tokens = 40
    # The reference: drop whole (user, assistant) turns from the oldest until the rest fits.
    dropped = next(k for k in range(13) if _prompt_len(tokenizer, [SYSTEM, *msgs[1 + 2 * k :]]) + max_tokens <= LIMIT)
    assert dropped > 0
    kept = [SYSTEM, *msgs[1 + 2 * dropped :]]
    body = {"messages": msgs, "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with srv.http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
        assert [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    else:
        r = srv.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    assert usage["truncated_messages"] == 2 * dropped
    assert usage["prompt_tokens"] == _prompt_len(tokenizer, kept) and usage["prompt_tokens"] + max_tokens <= LIMIT
    assert usage["truncated_prompt_tokens"] == _prompt_len(tokenizer, msgs) - usage["prompt_tokens"]
    assert usage["completion_tokens"] == max_tokens
    seen = tokenizer.decode(_last_prompt(srv))
    assert SYSTEM["content"] in seen and LAST["content"] in seen
    assert "sector 0 " not in seen and f"sector {dropped - 1} " not in seen and f"sector {dropped} " in seen


def test_oldest_reports_nothing_dropped_when_it_fits(servers, tokenizer):
    r = servers["oldest"].http.post("/v1/chat/completions", json={"messages": _conversation(2), "max_tokens": 4})
    usage = r.json()["usage"]
    assert usage["truncated_messages"] == usage["truncated_prompt_tokens"] == 0
    assert usage["prompt_tokens"] == _prompt_len(tokenizer, _conversation(2))
    # Without the policy usage has OpenAI's fields only.
    r = servers["off"].http.post("/v1/chat/completions", json={"messages": _conversation(2), "max_tokens": 4})
    assert set(r.json()["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


def test_oldest_never_drops_the_last_user_message(servers):
    huge = {"role": "user", "content": "word " * 700}
    r = servers["oldest"].http.post("/v1/chat/completions", json={"messages": [*_conversation(2), huge]})
    err = _context_error(r, "messages")
    assert "even with only the system prompt and the last user message" in err["message"]


def test_completion_truncate_prompt_tokens(servers):
    srv = servers["off"]
    prompt = [100 + i for i in range(600)]
    _context_error(srv.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12}), "prompt")
    # -1: as many of the last tokens as fit.
    r = srv.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "truncate_prompt_tokens": -1})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == LIMIT - 12 and usage["truncated_prompt_tokens"] == 600 - (LIMIT - 12)
    assert _last_prompt(srv) == prompt[-(LIMIT - 12) :]
    # N: the last N tokens; several prompts add up in usage.
    body = {"prompt": [prompt, prompt[:50]], "max_tokens": 4, "truncate_prompt_tokens": 100}
    usage = srv.http.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == 150 and usage["truncated_prompt_tokens"] == 500
    assert _last_prompt(srv) == prompt[:50]
    # Kept tokens that still leave no room for max_tokens: the limit is named.
    body = {"prompt": prompt, "max_tokens": 100, "truncate_prompt_tokens": 500}
    _context_error(srv.http.post("/v1/completions", json=body), "prompt")
    r = srv.http.post("/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    _context_error(srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10_000}), "max_tokens")
    # Chat has no such parameter (its policy is the server's flag).
    r = srv.http.post("/v1/chat/completions", json={"messages": [LAST], "truncate_prompt_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


def _punctuation(n: int) -> str:
    marks = "!#$%&()*+,-./:;<=>?@[]^_{|}~"
    return "".join(marks[(i * 7 + i // 5) % len(marks)] for i in range(n))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("chars", "says"), [(2_000_000, "whatever its tokens"), (40_000, "alone hold")])
def test_a_prompt_surely_over_the_context_is_refused_unread(servers, tokenizer, monkeypatch, path, chars, says):
    """Megabytes of prompt were encoded whole before the context rule refused them: seconds of CPU on the pool every
    request's tokenization shares. Now a text longer than the longest tokens could fit, or whose first part alone
    holds twice the context, is refused having encoded at most that part."""
    seen = []
    encode = type(tokenizer).encode
    monkeypatch.setattr(
        type(tokenizer), "encode", lambda self, text, *a, **k: seen.append(len(text)) or encode(self, text, *a, **k)
    )
    text = _punctuation(chars)
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    err = _context_error(
        servers["off"].http.post(path, json={**body, "max_tokens": 4}),
        "prompt" if "messages" not in body else "messages",
    )
    assert says in err["message"], err
    assert max(seen, default=0) <= 16 * (LIMIT + 64), seen  # never the whole text
    # Under a truncation rule any text may fit: it is encoded and truncated as before.
    if path == "/v1/completions":
        r = servers["off"].http.post(
            path, json={"prompt": text[:20_000], "max_tokens": 4, "truncate_prompt_tokens": -1}
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == LIMIT - 4, r.text


def test_refusing_unread_never_refuses_a_text_that_fits(tokenizer):
    """Texts of the longest tokens, of spaces and of ordinary words, each just within the context, pass."""
    from jaxinfer.server.errors import APIError
    from jaxinfer.server.truncation import refuse_surely_too_long

    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.token_bytes(i)))
    for unit in (tokenizer.token_bytes(longest).decode("utf-8", "replace"), " " * 64, "harbour lights ", "é"):
        text = unit
        while len(tokenizer.encode(text + unit, add_special_tokens=False)) <= LIMIT:
            text += unit
        refuse_surely_too_long(tokenizer, text, LIMIT, "prompt")  # fits: not refused
    with pytest.raises(APIError, match="whatever its tokens"):
        refuse_surely_too_long(tokenizer, "a" * (2 * tokenizer.max_token_bytes * LIMIT + 1), LIMIT, "prompt")
