"""The OpenAI API through the official `openai` client against a real server: shapes, sampling knobs, usage."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _stream_text(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Joins streamed completion/chat chunks: (text per choice, finish_reason per choice, usage)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in reasons, "finish_reason sent twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 512


def test_completion_usage_matches_tokens(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # ignore_eos: exactly max_tokens tokens, finish_reason length.
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    texts, reasons, usage = _stream_text(chunks)
    assert texts == {0: full.choices[0].text}
    assert reasons == {0: full.choices[0].finish_reason}
    assert usage.model_dump() == full.usage.model_dump()


def test_continuous_usage_stats_and_obfuscation_option(client):
    """vLLM's continuous_usage_stats: every chunk carries the usage so far. OpenAI's include_obfuscation: this
    server never pads chunks, so it is accepted either way."""
    for create, kw in ((client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": CHAT})):  # fmt: skip
        chunks = list(create(model=MODEL, max_tokens=6, temperature=0, stream=True, **kw,
                             stream_options={"include_usage": True, "include_obfuscation": False},
                             extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True,
                                                            "include_obfuscation": False}}))  # fmt: skip
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 6
        assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_chat_and_system_prompt(client, tokenizer):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True),
                                  add_special_tokens=False)  # fmt: skip
    assert full.usage.prompt_tokens == len(prompt_ids)
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    texts, reasons, usage = _stream_text(chunks)
    assert texts == {0: msg.content} and reasons == {0: full.choices[0].finish_reason}
    # The same prompt again: every full 16-token page but the last token's comes from the prefix cache, and usage
    # says so as OpenAI does (the first call may have found them cached by an earlier test already).
    cached = (len(prompt_ids) - 1) // 16 * 16
    assert cached > 0 and usage.prompt_tokens_details.cached_tokens == cached
    assert full.usage.prompt_tokens_details.cached_tokens in (0, cached)
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == full.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    # Without max_tokens a chat request may use the rest of the context.
    out = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=3)
    assert out.usage.completion_tokens <= 3


def test_chat_continues_the_final_message(client, http, tokenizer):
    """vLLM's continue_final_message: the prompt ends inside the begun assistant answer and the completion goes on
    from it, as a completion of that text does; /tokenize renders the same prompt; chat_template_kwargs win over
    the flags."""
    begun = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    prompt = tokenizer.apply_chat_template(CHAT) + "The answer is"
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    out = client.chat.completions.create(model=MODEL, messages=begun, max_tokens=5, temperature=0, extra_body=flags)
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert out.choices[0].message.content == ref.choices[0].text
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    r = http.post("/tokenize", json={"messages": begun, "chat_template_kwargs": flags})
    assert r.json()["tokens"] == tokenizer.encode(prompt, add_special_tokens=False), r.text
    for body in ({"continue_final_message": True}, {"chat_template_kwargs": {"continue_final_message": True}}):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": begun, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                 "chat_template_kwargs": {"messages": []}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_n_samples(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=5, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=6, temperature=1.0,
                                            seed=3, stream=True)  # fmt: skip
    texts, reasons, _ = _stream_text(chunks)
    assert set(texts) == {0, 1} and set(reasons) == {0, 1}
    same = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=6, temperature=1.0, seed=3)
    assert {c.index: c.message.content for c in same.choices} == texts


def test_several_prompts_and_token_ids(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=4,
                                    temperature=0)  # fmt: skip
    by_index = {c.index: c.text for c in out.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: the n samples agree
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(ids)
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert from_ids.choices[0].text == by_index[2]
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4, temperature=0, stream=True)
    texts, reasons, _ = _stream_text(batch)
    assert texts[0] == by_index[2] and set(reasons) == {0, 1}


def test_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    cut = base[: base.index(stop)]
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "@@@"], stream=stream,
                  extra_body={"ignore_eos": True})  # fmt: skip
        if stream:
            texts, reasons, _ = _stream_text(client.completions.create(**kw))
            text, reason = texts[0], reasons[0]
        else:
            choice = client.completions.create(**kw).choices[0]
            text, reason = choice.text, choice.finish_reason
            assert choice.model_extra["stop_reason"] == stop
        assert (text, reason) == (cut, "stop")
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].text == cut + stop


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text  # fmt: skip

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and tok in top
        assert tok_lp <= 0 and tok_lp == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2)  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.token == item.top_logprobs[0].token and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True)  # fmt: skip
    streamed = [t.token for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert streamed == [item.token for item in content]


def test_stop_token_text_and_text_offset(client, tokenizer):
    """As reported on this model: "." as a stop token shows in the text only with include_stop_str_in_output (it
    stays in the logprobs); text_offset places tokens in the text, a held-back stop string or an emoji split in
    byte tokens included, the same streamed and whole."""
    period = tokenizer.encode(".", add_special_tokens=False)[0]
    for include in (False, True):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                  extra_body={"stop_token_ids": [period], "include_stop_str_in_output": include})  # fmt: skip
        whole = client.completions.create(**kw).choices[0]
        assert whole.logprobs.tokens[-1] == "." and whole.model_extra["stop_reason"] == period
        assert whole.text == "".join(whole.logprobs.tokens[: None if include else -1])
        assert _stream_text(client.completions.create(**kw, stream=True))[0][0] == whole.text
    for prompt, stop in ((PROMPT, ["aris is"]), ("Cute animals: 🐱🐶🐱🐶🐱", None)):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0, stop=stop)
        whole = client.completions.create(**kw).choices[0]
        offsets = whole.logprobs.text_offset
        assert offsets == sorted(offsets) and offsets[-1] <= len(whole.text)
        chunks = client.completions.create(**kw, stream=True)
        assert [at for ch in chunks for c in ch.choices if c.logprobs for at in c.logprobs.text_offset] == offsets


def test_chat_logprobs_bytes_join_into_the_text(client):
    messages = [{"role": "user", "content": "Reply with only three cat emoji: 🐱🐱🐱"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True)
    choice = out.choices[0]
    assert "🐱" in choice.message.content
    items = choice.logprobs.content[: -1 if choice.finish_reason == "stop" else None]  # EOS: no text, its logprob
    joined = bytes(b for item in items for b in item.bytes)
    assert joined.decode("utf-8", errors="replace") == choice.message.content


def test_vllm_sampling_extras(client, tokenizer):
    period = tokenizer.encode(".", add_special_tokens=False)[0]
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 4, "ignore_eos": False,
              "skip_special_tokens": True, "stop_token_ids": [period]}  # fmt: skip
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.7, seed=1,
                                    presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"11": -100},
                                    user="someone", extra_body=extras)  # fmt: skip
    assert 4 <= out.usage.completion_tokens <= 10


def test_tokenize_detokenize(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    r = http.post("/tokenize", json={"messages": CHAT, "return_token_strs": True})
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    assert r.json()["tokens"] == chat_ids and len(r.json()["token_strs"]) == len(chat_ids)
    r = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == PROMPT
    # The chat template's markers come back too (vLLM's): /tokenize then /detokenize is a round trip.
    r = http.post("/detokenize", json={"tokens": chat_ids})
    assert r.json()["prompt"] == tokenizer.apply_chat_template(CHAT)


def test_api_key(server):
    url = f"{server.url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Probes and monitoring stay open.
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200
    assert httpx.post(url, json=body, headers=server.headers, timeout=60).status_code == 200
