"""/v1/completions with echo and logprobs (OpenAI's legacy completions, as vLLM serves them): the choice's logprobs
cover the echoed prompt tokens first (the first one unscored: None), then the completion's, streaming or not. And
vLLM's `prompt_logprobs` (completions and chat): each prompt token's logprob and rank, with its top alternatives.

In-process app (starlette's TestClient) on a tiny random-weight model, checked against `LLM` on the same engine
(run before the server takes the engine over) and a plain forward pass of the model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer.types import SamplingParams
from tests.server.conftest import in_process, metric, sse_chunks
from tests.tiny_model import SETTINGS, settings_flags, write_tiny_model

PROMPTS = ["The capital of France is", "def add(a, b):"]
K = 3  # logprobs
MAX_TOKENS = 5
BODY = {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": K}


def _forward_logprobs(runner, prompt: list[int]) -> np.ndarray:
    """log-softmax of the model's logits at every prompt position, on the contiguous (non-paged) path."""
    import jax

    from jaxinfer.generate import run_step
    from jaxinfer.model.attention import init_contiguous_cache

    t = len(prompt)
    tokens = np.asarray([prompt], np.int32)
    pos = np.arange(t, dtype=np.int32)[None]
    lg, _ = run_step(runner.family_params(), runner.cfg, tokens, pos, pos < t, init_contiguous_cache(runner.cfg, 1, t),
                     all_logits=True)  # fmt: skip
    return np.asarray(jax.nn.log_softmax(lg[0], axis=-1))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(TestClient, tokenizer, LLM reference outputs for BODY, forward-pass logprobs per prompt, the runner)."""
    from jaxinfer import LLM

    path = tmp_path_factory.mktemp("tiny-echo") / "ck"
    write_tiny_model(path)
    llm = LLM(str(path), **SETTINGS)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=K, prompt_logprobs=K)
        refs = llm.generate(PROMPTS, params, use_tqdm=False)
        forward = [_forward_logprobs(llm.engine.runner, r.prompt_token_ids) for r in refs]
        with in_process(llm.engine, llm.tokenizer) as client:
            yield client, llm.tokenizer, refs, forward, llm.engine.runner
    finally:
        llm.close()


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _joined(chunks: list[dict]) -> dict[int, dict]:
    """Streamed choices joined per index: text and the four logprobs lists concatenated."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            acc = out.setdefault(c["index"], {"text": "", "logprobs": {k: [] for k in c["logprobs"]}})
            acc["text"] += c["text"]
            for k, v in c["logprobs"].items():
                acc["logprobs"][k] += v
            acc["finish_reason"] = c["finish_reason"]
    return out


def _check_offsets(text: str, lp: dict) -> None:
    offsets, tokens = lp["text_offset"], lp["tokens"]
    assert offsets[0] == 0
    for j in range(len(tokens) - 1):
        assert offsets[j + 1] == offsets[j] + len(tokens[j])  # monotonic, continuing across prompt and completion
    assert offsets[-1] + len(tokens[-1]) == len(text)


def _check_prompt_part(lp: dict, tokenizer, ids: list[int], ref_lps: list, forward: np.ndarray, prompt: str) -> None:
    n = len(ids)
    assert lp["tokens"][:n] == [_text(tokenizer, t) for t in ids]
    assert "".join(lp["tokens"][:n]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        entry = ref_lps[p]
        assert lp["token_logprobs"][p] == pytest.approx(entry[ids[p]], abs=1e-5)
        assert lp["token_logprobs"][p] == pytest.approx(float(forward[p - 1, ids[p]]), abs=1e-4)
        top = lp["top_logprobs"][p]
        # The K most likely plus the prompt token when it is not among them.
        assert len(top) == len(entry) and len(top) in (K, K + 1)
        assert top == pytest.approx({_text(tokenizer, t): v for t, v in entry.items()}, abs=1e-5)
        best = np.argsort(-forward[p - 1])[:K]
        assert {_text(tokenizer, int(t)) for t in best} <= set(top)


def test_echo_logprobs(served):
    client, tokenizer, refs, forward, _ = served
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for prompt, ref, fwd, choice in zip(PROMPTS, refs, forward, body["choices"], strict=True):
        ids, gen = ref.prompt_token_ids, ref.outputs[0]
        n = len(ids)
        lp = choice["logprobs"]
        assert choice["text"] == prompt + gen.text
        assert len(lp["tokens"]) == n + len(gen.token_ids) == n + MAX_TOKENS
        _check_prompt_part(lp, tokenizer, ids, ref.prompt_logprobs, fwd, prompt)
        # Then the completion, as without echo.
        assert lp["tokens"][n:] == [_text(tokenizer, t) for t in gen.token_ids]
        for j, (tok, entry) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
            assert lp["token_logprobs"][n + j] == pytest.approx(entry[tok], abs=1e-5)
            assert len(lp["top_logprobs"][n + j]) in (K, K + 1)
        if gen.text.isascii():
            _check_offsets(choice["text"], lp)
        else:  # a random model's tokens may be partial characters: offsets still count from the echo's end
            assert lp["text_offset"][n] == len(prompt)
            assert lp["text_offset"] == sorted(lp["text_offset"])
    assert body["usage"]["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in refs)
    assert body["usage"]["completion_tokens"] == 2 * MAX_TOKENS

    # Without echo (or without logprobs) nothing about the prompt changes.
    plain = client.post("/v1/completions", json={**BODY, "echo": False}).json()
    for choice, ref in zip(plain["choices"], refs, strict=True):
        assert (
            choice["logprobs"]["tokens"]
            == body["choices"][choice["index"]]["logprobs"]["tokens"][len(ref.prompt_token_ids) :]
        )
        assert choice["logprobs"]["text_offset"][0] == 0
    no_lp = client.post("/v1/completions", json={**BODY, "logprobs": None}).json()
    assert [c["text"] for c in no_lp["choices"]] == [c["text"] for c in body["choices"]]
    assert all(c["logprobs"] is None for c in no_lp["choices"])


def test_stream_equals_non_stream(served):
    client, tokenizer, refs, _, _ = served
    full = client.post("/v1/completions", json=BODY).json()
    chunks = sse_chunks(client, "/v1/completions", BODY)
    joined = _joined(chunks)
    assert set(joined) == {0, 1}
    for choice in full["choices"]:
        got = joined[choice["index"]]
        assert got["text"] == choice["text"] and got["finish_reason"] == choice["finish_reason"]
        assert got["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
        assert got["logprobs"]["text_offset"] == choice["logprobs"]["text_offset"]
        assert got["logprobs"]["token_logprobs"][0] is None and got["logprobs"]["top_logprobs"][0] is None
        assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:],
                                                                      abs=1e-5)  # fmt: skip
        for a, b in zip(got["logprobs"]["top_logprobs"][1:], choice["logprobs"]["top_logprobs"][1:], strict=True):
            assert a == pytest.approx(b, abs=1e-5)
    # The first chunk of each choice carries the whole echoed prompt with its logprobs (as vLLM sends it).
    for i, ref in enumerate(refs):
        first = next(c for chunk in chunks for c in chunk["choices"] if c["index"] == i)
        n = len(ref.prompt_token_ids)
        assert first["text"].startswith(PROMPTS[i])
        assert first["logprobs"]["tokens"][:n] == [_text(tokenizer, t) for t in ref.prompt_token_ids]
        assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) > n


def test_n_samples_each_echo_the_scored_prompt(served):
    client, tokenizer, refs, forward, _ = served
    ids = refs[1].prompt_token_ids
    body = {
        "prompt": ids,
        "max_tokens": 3,
        "temperature": 1.0,
        "seed": 0,
        "n": 2,
        "echo": True,
        "logprobs": 1,
        "ignore_eos": True,
    }
    for choices in (
        client.post("/v1/completions", json=body).json()["choices"],
        _joined(sse_chunks(client, "/v1/completions", body)),
    ):
        choices = choices if isinstance(choices, list) else [{**v, "index": k} for k, v in sorted(choices.items())]
        assert [c["index"] for c in choices] == [0, 1]
        prompt_parts = []
        for c in choices:
            lp = c["logprobs"]
            assert c["text"].startswith(PROMPTS[1]) and len(lp["tokens"]) == len(ids) + 3
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for p in range(1, len(ids)):
                assert lp["token_logprobs"][p] == pytest.approx(float(forward[1][p - 1, ids[p]]), abs=1e-4)
                assert len(lp["top_logprobs"][p]) in (1, 2)
            prompt_parts.append([lp[k][: len(ids)] for k in ("tokens", "token_logprobs", "text_offset")])
        assert prompt_parts[0] == prompt_parts[1]


def _check_prompt_logprobs(scored: list, tokenizer, ids: list[int], forward: np.ndarray, k: int) -> None:
    """vLLM's prompt_logprobs for `ids` against the forward pass: {id: {logprob, rank, decoded_token}} per token."""
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        entry, row = scored[p], forward[p - 1]
        own = entry[str(ids[p])]
        assert own["logprob"] == pytest.approx(float(row[ids[p]]), abs=1e-4)
        assert own["decoded_token"] == _text(tokenizer, ids[p])
        # Its rank in the whole vocabulary: tokens within the tolerance of its logprob may fall either side.
        v = row[ids[p]]
        assert int(np.sum(row > v + 1e-4)) + 1 <= own["rank"] <= int(np.sum(row >= v - 1e-4))
        best = [int(t) for t in np.argsort(-row)[:k]]
        assert set(entry) == {str(t) for t in best} | {str(ids[p])}
        for place, t in enumerate(best, start=1):
            assert entry[str(t)]["logprob"] == pytest.approx(float(row[t]), abs=1e-4)
            assert entry[str(t)]["decoded_token"] == _text(tokenizer, t)
            if t != ids[p]:
                assert entry[str(t)]["rank"] == place


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs(served, k):
    """vLLM's prompt_logprobs: on each completions choice (both samples of a prompt alike), on a chat response, and
    beside echo's logprobs, each with its own number of alternatives."""
    client, tokenizer, refs, forward, runner = served
    body = {"prompt": PROMPTS, "max_tokens": 2, "n": 2, "seed": 0, "prompt_logprobs": k}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        i = c["index"] // 2
        _check_prompt_logprobs(c["prompt_logprobs"], tokenizer, refs[i].prompt_token_ids, forward[i], k)
        assert c["logprobs"] is None
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    # Not asked for: not there.
    assert "prompt_logprobs" not in client.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()[
        "choices"][0]  # fmt: skip

    # echo with logprobs 1 beside prompt_logprobs: each shows as many alternatives as it asked for.
    echoed = client.post("/v1/completions", json={**BODY, "prompt": PROMPTS[0], "logprobs": 1, "prompt_logprobs": k})
    choice = echoed.json()["choices"][0]
    _check_prompt_logprobs(choice["prompt_logprobs"], tokenizer, refs[0].prompt_token_ids, forward[0], k)
    assert all(len(t) in (1, 2) for t in choice["logprobs"]["top_logprobs"][1 : len(refs[0].prompt_token_ids)])

    # Chat: on the response, over the templated prompt's tokens.
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": k})
    assert chat.status_code == 200, chat.text
    ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    _check_prompt_logprobs(chat.json()["prompt_logprobs"], tokenizer, ids, _forward_logprobs(runner, ids), k)


def test_tokens_as_token_ids(served):
    """vLLM's return_tokens_as_token_ids: logprobs' tokens (and their alternatives) as "token_id:N", the same
    logprobs and text offsets otherwise; in chat, `bytes` are that text's."""
    client, tokenizer, refs, _, _ = served
    body = {**BODY, "prompt": PROMPTS[0], "logprobs": 2}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    ids = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    lp = ids["logprobs"]
    want = refs[0].prompt_token_ids + refs[0].outputs[0].token_ids
    assert lp["tokens"] == [f"token_id:{t}" for t in want]
    assert lp["token_logprobs"] == plain["token_logprobs"] and lp["text_offset"] == plain["text_offset"]
    for mine, theirs in zip(lp["top_logprobs"][1:], plain["top_logprobs"][1:], strict=True):
        assert sorted(mine.values()) == sorted(theirs.values())
        assert {tokenizer.decode([int(k.split(":")[1])], skip_special_tokens=False) for k in mine} == set(theirs)

    chat = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    plain = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    got = client.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True}).json()
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) == len(plain) == 4
    for mine, theirs in zip(content, plain, strict=True):
        tid = int(mine["token"].removeprefix("token_id:"))
        assert bytes(theirs["bytes"]) == tokenizer.token_bytes(tid) and mine["logprob"] == theirs["logprob"]
        assert mine["bytes"] == list(mine["token"].encode())
        assert [t["token"].startswith("token_id:") for t in mine["top_logprobs"]] == [True, True]


def test_allowed_token_ids(served):
    """allowed_token_ids restrict what completions and chat sample (read back as ids: return_tokens_as_token_ids)."""
    client, tokenizer, refs, _, _ = served
    allowed = sorted(set(refs[0].prompt_token_ids))[:3]
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "allowed_token_ids": allowed}  # fmt: skip
    got = set()
    for c in client.post("/v1/completions", json=body).json()["choices"]:
        got |= {int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]}
    chat = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "logprobs": True, "return_tokens_as_token_ids": True, "allowed_token_ids": allowed}  # fmt: skip
    r = client.post("/v1/chat/completions", json=chat)
    got |= {int(t["token"].removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["content"]}
    assert got <= set(allowed) and len(got) > 1


def test_bad_words(served):
    """bad_words reach the engine tokenized, from completions and chat: the greedy output's first word is banned."""
    client, tokenizer, refs, _, _ = served
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}  # fmt: skip

    def ids(r) -> list[int]:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        tokens = choice["logprobs"]["tokens"] if "tokens" in choice["logprobs"] else [
            t["token"] for t in choice["logprobs"]["content"]]  # fmt: skip
        return [int(t.removeprefix("token_id:")) for t in tokens]

    plain = ids(client.post("/v1/completions", json=body))
    word = next(w for w in (tokenizer.decode([t]).strip() for t in plain) if w.isalnum())
    banned = ids(client.post("/v1/completions", json={**body, "bad_words": [word]}))
    assert banned != plain and tokenizer.decode(banned).split().count(word) == 0
    chat = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "return_tokens_as_token_ids": True}  # fmt: skip
    plain = ids(client.post("/v1/chat/completions", json=chat))
    first = tokenizer.decode([plain[0]]).strip()
    if first:
        assert ids(client.post("/v1/chat/completions", json={**chat, "bad_words": [first]}))[0] != plain[0]


def test_params_and_limits(served):
    from jaxinfer.server.protocol import CompletionRequest
    from jaxinfer.server.sampling import completion_params

    def params(**kw) -> SamplingParams:
        return completion_params(CompletionRequest(prompt="x", **kw), 1, 128)

    # Prompt logprobs are asked of the engine only for echo with logprobs, or prompt_logprobs: they cost a full
    # prefill.
    assert params(echo=True, logprobs=2).prompt_logprobs == 2
    assert params(echo=True, logprobs=0).prompt_logprobs == 0
    assert params(logprobs=2).prompt_logprobs is None
    assert params(echo=True).prompt_logprobs is None
    # prompt_logprobs asks for them itself; beside echo's, the engine computes the larger number of alternatives.
    assert params(prompt_logprobs=1).prompt_logprobs == 1
    assert params(echo=True, logprobs=1, prompt_logprobs=3).prompt_logprobs == 3
    assert params(echo=True, logprobs=4, prompt_logprobs=0).prompt_logprobs == 4
    client = served[0]
    # max_tokens 0 with echo is vLLM's "score the prompt only" (tests/server/test_never_down.py checks the scores);
    # without echo it is a 400, as every max_tokens below 1 is.
    r = client.post("/v1/completions", json={**BODY, "max_tokens": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text
    # The token made while scoring is not shown, nor is how it would have ended the choice: stop_token_ids holding
    # it, or a stop string it begins, still give finish_reason "length" (vLLM's answer), not "stop".
    # Nor is it counted as generated (/metrics).
    first = served[2][0].outputs[0].token_ids[0]
    scored = {**BODY, "prompt": PROMPTS[0], "max_tokens": 0, "ignore_eos": False}
    generated = metric(client.get("/metrics").text, "jaxinfer:generation_tokens_total")
    for stop in ({"stop_token_ids": [first]}, {"stop": [served[1].decode([first])]}):
        for stream in (False, True):
            r = client.post("/v1/completions", json={**scored, **stop, "stream": stream})
            if stream:
                chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                ch = next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
            else:
                ch = r.json()["choices"][0]
            assert (ch["finish_reason"], ch["stop_reason"]) == ("length", None), (stop, stream, ch)
    assert metric(client.get("/metrics").text, "jaxinfer:generation_tokens_total") == generated
    r = client.post("/v1/completions", json={**BODY, "max_tokens": 0, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={**BODY, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    # logprobs 0 with echo: each scored prompt token shows just itself.
    lp = client.post("/v1/completions", json={**BODY, "prompt": PROMPTS[0], "logprobs": 0}).json()["choices"][0]
    tops = lp["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(t) == 1 for t in tops[1:])


def test_a_raised_logprobs_cap_is_honoured(tmp_path):
    """--max-logprobs above the default (20) reaches the engine: that many alternatives come back per token and one
    more is refused naming the parameter. (The live servers keep the default cap: a raised one compiles other
    steps. Their 400 for a request past the cap is tests/server/test_never_down.py's.)"""
    from jaxinfer import LLM
    from jaxinfer.server.args import parse_args

    write_tiny_model(tmp_path / "ck")
    args = parse_args(["--model", str(tmp_path / "ck"), "--max-logprobs", "30", *settings_flags()])
    settings = {k: getattr(args, k) for k in (*SETTINGS, "max_logprobs")}  # the server's engine fields
    with LLM(args.model, **settings) as llm:
        assert llm.engine.cc.max_logprobs == 30
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, logprobs=30), use_tqdm=False)[0].outputs[0]
        # The 30 most likely, plus the sampled token when it is not among them.
        assert all(len(e) in (30, 31) and tok in e for tok, e in zip(out.token_ids, out.logprobs, strict=True))
        with pytest.raises(ValueError, match="logprobs: at most 30"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, logprobs=31), use_tqdm=False)
