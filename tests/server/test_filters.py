"""Content filters (--filters-config): the blocklist filter's holding on its own, then over HTTP on an in-process
server whose engine is `FakeEngine` (its tokens count up from the prompt's last one, so each prompt's text is
known in advance), and once through the engine process (the default) on its fake core.

The blocked phrase spans three tokens: it never reaches a client, neither in a stream's text nor in its logprobs,
the choice ends with finish_reason content_filter, and other streams and choices go on untouched, also while a
slow filter holds one of them."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxinfer.server.filters import BlocklistFilter, ContentFilter, Filters, OutputVerdict, load_filters
from tests.server.test_lifecycle import InProcessServer

BLOCKED_PROMPT, CLEAN_PROMPT = [8000], [3000]  # token-id prompts: their outputs are tokens 8001..., 3001...
PHRASE = "photoailable boys"  # tokens 8003 ' photo', 8004 'ailable', 8005 ' boys'
INPUT_ONLY = "forbidden topic"
SLOW_PROMPT = [5000]  # its text holds ' university' (token 5006): SlowFilter waits there
BROKEN_PROMPT = [12000]  # its text holds ' professors' (token 12004): BrokenFilter raises there


class SlowFilter(ContentFilter):
    """Blocks (waits on `release`) on any text holding ' university', until the test lets it go."""

    entered = threading.Event()
    release = threading.Event()

    def __init__(self, marker: str):
        self.marker = marker

    def check_output(self, text: str, start: int, final: bool) -> OutputVerdict:
        if self.marker in text[start:]:
            SlowFilter.entered.set()
            assert SlowFilter.release.wait(30)
        return OutputVerdict(len(text))


class BrokenFilter(ContentFilter):
    """Raises on any text holding its marker: a plugin with a bug."""

    def __init__(self, marker: str):
        self.marker = marker

    def check_output(self, text: str, start: int, final: bool) -> OutputVerdict:
        if self.marker in text:
            raise RuntimeError("bug in a filter")
        return OutputVerdict(len(text))


def _stream_release(f: Filters, pieces: list[str]) -> tuple[str, str | None]:
    """Feeds `pieces` as a stream would; returns (the text released, why blocked)."""
    text, released = "", 0
    for i, piece in enumerate(pieces):
        text += piece
        v = f.check_output(text, released, i == len(pieces) - 1)
        assert released <= v.release <= len(text)
        released = v.release
        if v.blocked:
            return text[:released], v.blocked
    return text[:released], None


def test_blocklist_holds_only_what_may_still_match():
    f = Filters([(BlocklistFilter("bl", phrases=["Secret Plan"]), ["output"])])
    assert f.check_output("the secr", 0, False) == OutputVerdict(4)  # "secr" may become the phrase
    assert f.check_output("the secret", 0, False) == OutputVerdict(4)
    assert f.check_output("the secret pl", 4, False) == OutputVerdict(4)
    assert f.check_output("the secret potion", 4, False) == OutputVerdict(17)
    assert f.check_output("the secr", 0, True) == OutputVerdict(8)  # complete: nothing more can come
    # Character by character and in uneven pieces: the phrase (any case) never comes out, the text before it does.
    text = "we share our SECRET PLAN tonight"
    for size in (1, 2, 3, 5, 40):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert _stream_release(f, pieces) == ("we share our ", "bl")
    # Patterns hold their window; their matches are found across pieces too.
    g = Filters([(BlocklistFilter("ssn", patterns=[r"\b\d{3}-\d{2}-\d{4}\b"], max_match_chars=11), ["output"])])
    assert g.check_output("call 555-12", 0, False) == OutputVerdict(1)
    assert _stream_release(g, list("id 123-45-6789 ok")) == ("id ", "ssn")
    assert _stream_release(g, list("id 123-45-67890 ok")) == ("id 123-45-67890 ok", None)


def test_config_errors_name_the_problem(tmp_path):
    cases = {
        "not json": "--filters-config",
        json.dumps({"filters": [{"type": "nope", "phrases": ["x"]}]}): "filters[0].type",
        json.dumps({"filters": [{"type": "blocklist"}]}): "give phrases or patterns",
        json.dumps({"filters": [{"type": "blocklist", "patterns": ["("]}]}): "bad pattern",
        json.dumps({"filters": [{"type": "blocklist", "phrases": ["x"], "apply_to": ["out"]}]}): "apply_to",
        json.dumps({"filters": [{"type": "blocklist", "phrases": ["x"], "colour": 1}]}): "colour",
        json.dumps({"filters": [{"type": "python", "class": "tests.server.test_filters:Nope"}]}): "cannot import",
        json.dumps({"filters": [{"type": "python", "class": "json:JSONDecoder"}]}): "not a jaxinfer",
        # Types: a string for a list would block every text holding one of its letters; "false" would be true.
        json.dumps({"filters": [{"type": "blocklist", "phrases": "secret plan"}]}): "filters[0].phrases: a list",
        json.dumps({"filters": [{"type": "blocklist", "phrases": [5]}]}): "filters[0].phrases: a list of strings",
        json.dumps({"filters": [{"type": "blocklist", "phrases": ["x"], "ignore_case": "false"}]}): "ignore_case",
        json.dumps({"filters": [{"type": "blocklist", "patterns": ["x"], "max_match_chars": "3"}]}): "max_match",
        json.dumps({"filters": [{"type": "blocklist", "phrases": ["x"], "name": 5}]}): "filters[0].name",
    }
    for i, (text, needle) in enumerate(cases.items()):
        path = tmp_path / f"f{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            load_filters(path)
    from jaxinfer.server.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--filters-config", str(tmp_path / "f0.json")])


@pytest.fixture(scope="module")
def srv(tokenizer, tmp_path_factory):
    config = tmp_path_factory.mktemp("filters") / "filters.json"
    config.write_text(json.dumps({"filters": [
        {"type": "blocklist", "name": "words", "phrases": [PHRASE.upper(), "victor"], "apply_to": ["input", "output"]},
        {"type": "blocklist", "name": "topics", "phrases": [INPUT_ONLY], "apply_to": ["input"]},
        {"type": "python", "name": "slow", "class": "tests.server.test_filters:SlowFilter",
         "options": {"marker": " university"}, "apply_to": ["output"]},
        {"type": "python", "class": "tests.server.test_filters:BrokenFilter", "options": {"marker": " professors"},
         "apply_to": ["output"]},
    ]}))  # fmt: skip
    server = InProcessServer(tokenizer, filters_config=str(config))
    server.wait_ready()
    yield server
    SlowFilter.release.set()
    server.close()


def _text(tokenizer, prompt: list[int], n: int) -> str:
    return tokenizer.decode(list(range(prompt[-1] + 1, prompt[-1] + 1 + n)))


def _sse(srv, path: str, body: dict) -> tuple[str, list[dict]]:
    with srv.http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    return raw, [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def _joined(events: list[dict]) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c["text"] if "text" in c else c["delta"].get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"] is not None:
                assert c["index"] not in reasons
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons


def test_blocked_phrase_never_reaches_a_stream(srv, tokenizer):
    full = _text(tokenizer, BLOCKED_PROMPT, 16)
    assert PHRASE in full and PHRASE not in _text(tokenizer, BLOCKED_PROMPT, 4)  # it spans tokens 3 to 5
    before = full[: full.index(PHRASE)]
    # Two prompts (choices 0, 1: blocked) and (2, 3: clean), n = 2, logprobs with their token strings.
    body = {"prompt": [BLOCKED_PROMPT, CLEAN_PROMPT], "max_tokens": 16, "n": 2, "logprobs": 1,
            "stream_options": {"include_usage": True}}  # fmt: skip
    raw, events = _sse(srv, "/v1/completions", body)
    assert "photoailable" not in raw.lower() and "ailable" not in raw  # neither in text nor in a logprobs token
    texts, reasons = _joined(events)
    clean = _text(tokenizer, CLEAN_PROMPT, 16)
    assert texts == {0: before, 1: before, 2: clean, 3: clean}
    assert reasons == {0: "content_filter", 1: "content_filter", 2: "length", 3: "length"}
    # Usage counts the tokens sent: the blocked choices' two before the phrase.
    assert events[-1]["usage"]["completion_tokens"] == 2 * 2 + 2 * 16
    # The whole response says the same.
    whole = srv.http.post("/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"}).json()
    assert [c["text"] for c in whole["choices"]] == [before, before, clean, clean]
    assert [c["finish_reason"] for c in whole["choices"]] == ["content_filter"] * 2 + ["length"] * 2
    assert whole["choices"][0]["stop_reason"] == "words"
    # Logprobs cover the tokens whose text is all shown (' photo' is not: its space is, its word is not).
    assert whole["choices"][0]["logprobs"]["tokens"] == [" sitting", " assigned"] and before == " sitting assigned "
    # The engine stopped generating the blocked prompt's request: every sequence is gone.
    deadline = time.monotonic() + 10
    while srv.engine.seqs:
        assert time.monotonic() < deadline, srv.engine.seqs
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_every_choice_ends_with_content_filter(srv, tokenizer, stream):
    srv.engine.first_token = BLOCKED_PROMPT[0] + 1
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "n": 3, "logprobs": True}
        if stream:
            raw, events = _sse(srv, "/v1/chat/completions", body)
            assert "ailable" not in raw
            texts, reasons = _joined(events)
        else:
            choices = srv.http.post("/v1/chat/completions", json=body).json()["choices"]
            texts = {c["index"]: c["message"]["content"] for c in choices}
            reasons = {c["index"]: c["finish_reason"] for c in choices}
    finally:
        srv.engine.first_token = None
    full = _text(tokenizer, BLOCKED_PROMPT, 16)
    assert texts == dict.fromkeys(range(3), full[: full.index(PHRASE)])
    assert reasons == dict.fromkeys(range(3), "content_filter")


def test_echo_of_the_prompt_alone_shows_no_generated_text(srv):
    """echo with max_tokens 0 returns the prompt alone: the token the engine made is not screened (not shown)."""
    before_victor = [8015]  # ' Special'; the engine's one token is 8016 ' Victor'
    r = srv.http.post("/v1/completions", json={"prompt": before_victor, "max_tokens": 1}).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (" ", "content_filter")
    r = srv.http.post("/v1/completions", json={"prompt": before_victor, "max_tokens": 0, "echo": True}).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (" Special", "length")


def test_blocked_input_is_a_400(srv, tokenizer):
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be nice."},
                                               {"role": "user", "content": f"Tell me about {INPUT_ONLY}s"}]},
         "messages.1.content"),
        ("/v1/completions", {"prompt": "what about PhotoAilable Boys?"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "so are " + INPUT_ONLY]}, "prompt.1"),
        ("/v1/completions", {"prompt": [INPUT_ONLY, "fine"]}, "prompt.0"),
        # Token ids are checked as the text they decode to.
        ("/v1/completions", {"prompt": tokenizer.encode("x " + INPUT_ONLY, add_special_tokens=False)}, "prompt"),
    ]  # fmt: skip
    for path, body, param in cases:
        r = srv.http.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "content_filter" and err["param"] == param, err
    # An output-only filter's subject is fine as input: the "slow" filter checks output only.
    assert srv.http.post("/v1/completions", json={"prompt": "a university", "max_tokens": 2}).status_code == 200


def test_a_slow_filter_stalls_no_other_stream(srv, tokenizer):
    SlowFilter.entered.clear()
    SlowFilter.release.clear()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_sse, srv, "/v1/completions", {"prompt": SLOW_PROMPT, "max_tokens": 12})
        assert SlowFilter.entered.wait(10)
        # While the filter holds that stream, others stream to their end.
        for _ in range(3):
            _, events = _sse(srv, "/v1/completions", {"prompt": CLEAN_PROMPT, "max_tokens": 16})
            assert _joined(events) == ({0: _text(tokenizer, CLEAN_PROMPT, 16)}, {0: "length"})
        assert not held.done()
        SlowFilter.release.set()
        _, events = held.result(30)
    assert _joined(events) == ({0: _text(tokenizer, SLOW_PROMPT, 12)}, {0: "length"})


def test_a_failing_filter_ends_only_its_request(srv, tokenizer):
    raw, events = _sse(srv, "/v1/completions", {"prompt": BROKEN_PROMPT, "max_tokens": 12})
    assert "professors" not in raw and raw.endswith("data: [DONE]\n\n")
    assert [e["error"]["code"] for e in events if "error" in e] == ["filter_error"]
    r = srv.http.post("/v1/completions", json={"prompt": BROKEN_PROMPT, "max_tokens": 12})
    assert r.status_code == 500 and r.json()["error"]["code"] == "filter_error"
    _, events = _sse(srv, "/v1/completions", {"prompt": CLEAN_PROMPT, "max_tokens": 4})
    assert _joined(events) == ({0: _text(tokenizer, CLEAN_PROMPT, 4)}, {0: "length"})


def test_engine_process_path():
    """The gate on MPAsyncEngine's outputs (the engine core in its own process, here the fake core): the blocked
    request ends early with content_filter and the core frees its sequences."""
    from jaxinfer import SamplingParams
    from jaxinfer.engine.mp_engine import MPAsyncEngine
    from jaxinfer.server.admission import Admission, PromptRecord, RequestRecord
    from jaxinfer.server.args import ServerArgs
    from jaxinfer.server.context import ServingContext
    from jaxinfer.server.generation import EngineRequest, run_request
    from jaxinfer.server.metrics import Metrics
    from jaxinfer.server.state import Phase, ServerState
    from tests.server.test_engine_process import _fake_build

    args = ServerArgs(model="fake")
    engine = MPAsyncEngine(args, build=_fake_build)
    try:
        engine.wait_ready(60)
        state = ServerState(args)
        state.engine, state.tokenizer, state.phase = engine, engine.tokenizer, Phase.READY
        filters = Filters([(BlocklistFilter("words", phrases=[PHRASE]), ["output"])])
        ctx = ServingContext(args, state, Metrics(state), filters)
        full = engine.tokenizer.decode(list(range(BLOCKED_PROMPT[0] + 1, BLOCKED_PROMPT[0] + 17)))

        async def main():
            params = SamplingParams(max_tokens=400, n=2)
            req = EngineRequest("mp", None, BLOCKED_PROMPT, params, gate=ctx.output_gate(BLOCKED_PROMPT, params))
            record = RequestRecord("mp", "/v1/completions", None, "fake", False, time.monotonic(), None,
                                   [PromptRecord(len(BLOCKED_PROMPT), 2)])  # fmt: skip
            admission = Admission(state.admit(1, 2), ctx.limiter.reserve(None, 0), record, ctx.access_log.request)
            outs = [o async for o in run_request(state, ctx.metrics, req, admission, 0)]
            assert outs[-1].finished and len(outs) < 20
            assert [(c.text, c.finish_reason) for c in outs[-1].outputs] == [(full[: full.index(PHRASE)],
                                                                               "content_filter")] * 2  # fmt: skip
            deadline = time.monotonic() + 10
            while engine.stats().pages_used:  # the fake engine holds one page per live sequence
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)

        asyncio.run(main())
        ctx.close()
    finally:
        engine.shutdown()
