"""Structured outputs (vLLM's StructuredOutputsParams) on SmolLM2: greedy takes the best token the grammar allows
under the model's own logits, with the grammar's masks computed by an llguidance matcher built here from the
tokenizer's own JSON (the engine builds its own from each token's bytes); samples never leave the language; a
plain request beside a constrained one is unchanged; overlap scheduling changes nothing."""

from __future__ import annotations

import json
import re

import jax
import llguidance
import numpy as np
import pytest

from jaxinfer import LLM, RequestsFailedError, SamplingParams, StructuredOutputsParams
from jaxinfer.engine.core_process import params_from_wire, params_to_wire
from jaxinfer.engine.grammar import JSON_WHITESPACE
from jaxinfer.model_files import smollm2_gguf
from tests.tiny_model import SMOLLM2_SETTINGS

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol():
    with LLM(str(smollm2_gguf()), **SMOLLM2_SETTINGS) as llm:
        yield llm


def _chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _reference_matcher(llm: LLM, so: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A matcher that shares nothing with the engine's: llguidance reads the tokenizer's HF JSON here."""
    tk = llm.tokenizer._backend.tk
    ll = llguidance.LLTokenizer(tk.to_str(), n_vocab=llm.tokenizer.vocab_size, eos_token=list(llm.engine.eos_token_ids))
    if so.json is not None or so.json_object:
        options = (
            {"whitespace_flexible": False} if so.disable_any_whitespace else {"whitespace_pattern": JSON_WHITESPACE}
        )
        grammar = llguidance.LLMatcher.grammar_from_json_schema(so.json or '{"type": "object"}', defaults=options)
    elif so.choice is not None:
        grammar = llguidance.grammar_from("choice", json.dumps(list(so.choice)))
    else:
        grammar = llguidance.grammar_from("regex" if so.regex else "grammar", so.regex or so.grammar)
    return llguidance.LLMatcher(ll, grammar)


def _logits(llm: LLM, ids: list[int]) -> np.ndarray:
    """The contiguous (non-paged) forward pass's logits at every position."""
    from jaxinfer.generate import run_step
    from jaxinfer.model.attention import init_contiguous_cache

    runner, t = llm.engine.runner, len(ids)
    pos = np.arange(t, dtype=np.int32)[None]
    lg, _ = run_step(runner.family_params(), runner.cfg, np.asarray([ids], np.int32), pos, pos < t,
                     init_contiguous_cache(runner.cfg, 1, t), all_logits=True)  # fmt: skip
    return np.asarray(jax.device_get(lg[0]), np.float32)


@pytest.mark.parametrize(
    "so, question",
    [
        (StructuredOutputsParams(json=SCHEMA), "Describe a person as JSON."),
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}, [0-9]{2}"), "Name a city and a number."),
    ],
    ids=["json", "regex"],
)
def test_greedy_takes_the_best_token_the_grammar_allows(smol, so, question):
    """Each greedy token is the argmax of the model's logits over the tokens a reference matcher allows at that
    point, the output is in the grammar's language, and it ends with EOS ("stop")."""
    prompt = _chat_ids(smol, question)
    params = SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=so)
    out = smol.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smol.engine.eos_token_ids
    if so.json is not None:
        assert "\n\n\n" not in out.text and " " * 21 not in out.text  # whitespace bounded as llama.cpp bounds it
        value = json.loads(out.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 12
    else:
        assert re.fullmatch(so.regex, out.text), out.text
    lg = _logits(smol, prompt + out.token_ids)
    ref = _reference_matcher(smol, so)
    plain_best = 0
    for i, tok in enumerate(out.token_ids):
        allowed = np.unpackbits(np.frombuffer(ref.compute_bitmask(), np.uint8), bitorder="little").astype(bool)
        row = lg[len(prompt) - 1 + i]
        masked = np.where(allowed[: row.size], row, -np.inf)
        best, second = np.sort(masked)[::-1][:2]
        if best - second > 1e-2:  # beyond the float16 pool's rounding
            assert tok == int(np.argmax(masked)), (i, tok, smol.tokenizer.decode(out.token_ids[:i]))
        plain_best += int(np.argmax(row)) == tok
        assert ref.consume_token(tok), (i, tok)
    assert ref.is_stopped()
    assert plain_best < len(out.token_ids)  # the grammar overrode the model somewhere: the masks are exercised


@pytest.mark.parametrize(
    "so, accepts",
    [
        (StructuredOutputsParams(choice=["red", "green", "light blue"]), lambda t: t in ("red", "green", "light blue")),
        (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        (StructuredOutputsParams(grammar='start: "A" ("b" | "cc"){1,3} "!"'),
         lambda t: re.fullmatch(r"A(b|cc){1,3}!", t)),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9]{1,4} "y"'), lambda t: re.fullmatch(r"x[0-9]{1,4}y", t)),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
         lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["choice", "regex", "lark", "gbnf", "json_object"],
)  # fmt: skip
def test_samples_stay_in_the_language(smol, so, accepts):
    """n = 4 samples at temperature 1 of every kind of constraint: each one's tokens are a prefix a reference matcher
    accepts; each ended by EOS ("stop") is a whole word of the language (only JSON objects may run to the length)."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=4, structured_outputs=so)
    outs = smol.generate(["Answer: "], params, use_tqdm=False)[0].outputs
    for c in outs:
        ref = _reference_matcher(smol, so)
        assert ref.consume_tokens(c.token_ids), (c.text, ref.get_error())
        assert c.finish_reason == "stop" or (so.json_object and c.finish_reason == "length"), c
        if c.finish_reason == "stop":
            assert ref.is_stopped() and accepts(c.text), c.text
    assert len({c.text for c in outs}) > 1  # samples, not one answer four times


def test_a_plain_request_beside_a_constrained_one_is_unchanged_and_overlap_changes_nothing(smol):
    """A constrained request and plain ones in one batch: the plain ones give what they give alone; the
    constrained one gives the same tokens with overlap scheduling off (its masks follow the tokens before them)."""
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so)
    plain = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11)
    prompts = ["Describe a person as JSON:", "The capital of France is", "def add(a, b):"]
    together = smol.generate(prompts, [constrained, plain, plain], use_tqdm=False)
    alone = smol.generate(prompts[1:], plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together[1:]] == [o.outputs[0].token_ids for o in alone]
    assert smol.engine.overlap
    smol.engine.overlap = False
    try:
        sync = smol.generate(prompts[:1], constrained, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        smol.engine.overlap = True
    assert together[0].outputs[0].token_ids == sync
    assert smol.engine.allocator.num_free == smol.engine.allocator.num_pages


def test_ignore_eos_ends_a_complete_grammar_at_its_eos(smol):
    """With ignore_eos, a complete grammar still allows nothing but EOS: the sequence ends there ("stop")."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))  # fmt: skip
    out = smol.generate(["Is the sky blue? Answer:"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] in smol.engine.eos_token_ids and len(out.token_ids) < 20


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"json": '{"type": "nope"}'}, "structured_outputs.json: "),
        ({"json": "{not json"}, "structured_outputs.json: "),
        ({"regex": "a["}, "structured_outputs.regex: .*unclosed character class"),
        ({"grammar": "start: ("}, "structured_outputs.grammar: "),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"regex": "a", "choice": ["b"]}, "needs exactly one of .* got regex, choice"),
        ({}, "needs exactly one of .* got none"),
    ],
)
def test_bad_constraints_name_the_field(smol, fields, message):
    with pytest.raises(ValueError, match=message):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**fields)), use_tqdm=False)
    assert not smol.engine.has_unfinished()


def test_constraints_cross_to_the_engine_process_and_a_plain_engine_refuses_them(smol):
    """SamplingParams with a constraint survive the engine process's wire; an Engine built without a tokenizer
    says why it cannot constrain."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert params_from_wire(params_to_wire(params)) == params
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")
    grammars, smol.engine.grammars = smol.engine.grammars, None
    try:
        with pytest.raises(ValueError, match="structured_outputs: this engine has no tokenizer"):
            smol.engine.add_request([1, 2], params)
    finally:
        smol.engine.grammars = grammars


def test_a_step_collected_early_reports_each_update_once(smol):
    """The step in flight is collected before the next is dispatched when it sampled a constrained sequence; what
    waited to be reported (a request failed meanwhile) goes out once, beside that step's tokens."""
    eng = smol.engine
    prompt = smol.tokenizer.encode("Pick one:")
    choice = StructuredOutputsParams(choice=["red", "blue"])
    a = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice))
    b = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seen = eng.step()
    assert eng._in_flight is not None and eng._in_flight[3]  # overlap: the constrained step is still running
    eng._fail(eng.seqs[b], "injected failure")
    while eng.has_unfinished():
        seen += eng.step()
    assert [u.finish_reason for u in seen if u.request_id == b] == ["error"]
    tokens = [t for u in seen if u.request_id == a for t in u.new_token_ids]
    assert smol.tokenizer.decode(tokens) in ("red", "blue")
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_chat_passes_tools_and_tool_history_to_the_template(smol):
    """LLM.chat's `tools` (vLLM's) reach the template as its `tools` variable, beside a history holding an
    assistant's tool call (content None) and the tool's result."""
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}<{{ m.role }}>"
        "{% for c in m.tool_calls or [] %}call {{ c.function.name }}{% endfor %}{{ m.content }}{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "noon"}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    out = smol.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template, tools=tools)[0]
    assert out.prompt == "[get_time]<user>Time?<assistant>call get_time<tool>noon"


def test_the_engine_core_builds_the_grammar_tokenizer_while_idle(smol):
    """The engine process's loop (EngineCore, fed over ZeroMQ as in serving) builds what grammars read of the
    tokenizer once it is idle, so the first constrained request does not stall every stream for it."""
    import threading
    import time

    import zmq

    from jaxinfer.engine.core_process import EngineCore, outputs_to_wire, pack
    from jaxinfer.engine.grammar import GrammarCompiler
    from jaxinfer.engine.outbox import ResultsOutbox

    eng = smol.engine
    built, eng.grammars = eng.grammars, GrammarCompiler(smol.tokenizer, eng.cfg.vocab_size, eng.eos_token_ids)
    ctx = zmq.Context()
    commands_in, commands = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    results_out = ctx.socket(zmq.PUSH)
    commands_in.bind("inproc://grammar-commands")
    commands.connect("inproc://grammar-commands")
    results_out.bind("inproc://grammar-results")
    loop = threading.Thread(target=EngineCore(eng, commands_in, ResultsOutbox(results_out, pack, outputs_to_wire)).run,
                            daemon=True)  # fmt: skip
    try:
        assert not eng.grammars.prepared
        loop.start()
        deadline = time.monotonic() + 30
        while not eng.grammars.prepared and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.grammars.prepared and loop.is_alive()
        commands.send(pack(["shutdown"]))
        loop.join(10)
        assert not loop.is_alive()
    finally:
        eng.grammars = built
        for sock in (commands_in, commands, results_out):
            sock.close(linger=0)
        ctx.term()


def test_min_tokens_yield_to_a_complete_grammar_and_a_conflict_ends_only_its_request(smol):
    """min_tokens bans EOS until then, but a complete grammar allows nothing else: it ends the output ("stop").
    Rules that leave no token the grammar allows (allowed_token_ids outside it) end that request with an error
    naming structured_outputs; a request beside it finishes as usual."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=6, structured_outputs=choice)
    out = smol.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) < 6
    digit = smol.tokenizer.encode("7", add_special_tokens=False)
    bad = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=choice, allowed_token_ids=digit)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(RequestsFailedError, match="structured_outputs: token .* does not follow the grammar"):
        smol.generate(["Answer:", "Answer:"], [bad, plain], use_tqdm=False)
    assert smol.engine.allocator.num_free == smol.engine.allocator.num_pages and not smol.engine.has_unfinished()


def test_an_engine_whose_model_has_no_eos_has_nothing_to_prepare():
    """Without EOS nothing is built (constrained requests are refused, saying why): the idle engine core must not
    take preparing for work left, or it would spin instead of waiting for commands."""
    from types import SimpleNamespace

    from jaxinfer.engine.grammar import GrammarCompiler
    from jaxinfer.startup import prepare_grammars

    grammars = GrammarCompiler(SimpleNamespace(eos_token_ids=()), 64, ())
    assert grammars.prepared and not prepare_grammars(SimpleNamespace(grammars=grammars))
    with pytest.raises(ValueError, match="structured_outputs: the model has no EOS token"):
        grammars.grammar(StructuredOutputsParams(regex="a"))
