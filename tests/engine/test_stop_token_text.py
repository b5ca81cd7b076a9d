"""A sequence the engine ends on a stop token (EOS, stop_token_ids) shows that token's text only with
include_stop_str_in_output, as vLLM v1 does; the token stays in token_ids and logprobs. Through `OutputProcessor`
with scripted engine updates (the default model's tokenizer, no model)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.engine.output import OutputAccumulator, OutputProcessor
from jaxinfer.model_files import smollm2_gguf
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.types import CompletionOutput, SamplingParams, SeqUpdate


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_gguf())


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _run(tok, params: SamplingParams, tokens: list[int], end: tuple[str, int | None], per_update: int = 1):
    """Feeds `tokens` in updates of `per_update` tokens, the last one ending with `end` (reason, stop_reason), as
    the engine reports them; the whole output, and the stop strings the processor asked the engine to end on."""
    proc, whole, stopped = OutputProcessor(tok), OutputAccumulator(), []
    proc.add("r", None, _ids(tok, "The capital of France is"), dataclasses.replace(params, logprobs=0))
    for k in range(0, len(tokens), per_update):
        chunk = tokens[k : k + per_update]
        last = k + per_update >= len(tokens)
        lps = [{t: -1.0} for t in chunk]
        update = SeqUpdate("r", chunk, lps, last, end[0] if last else None, end[1] if last else None)
        for out in proc.process([update], lambda *stop: stopped.append(stop)):
            whole.add(out)
    return whole.result().outputs[0], stopped


def _check_kept(c: CompletionOutput, tokens: list[int]) -> None:
    assert c.token_ids == tokens and len(c.logprobs) == len(tokens)
    assert c.cumulative_logprob == pytest.approx(-1.0 * len(tokens))


@pytest.mark.parametrize("per_update", [1, 3])
@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id(tok, include, per_update):
    period = _ids(tok, ".")[0]
    tokens = [*_ids(tok, " Paris is big"), period]
    params = SamplingParams(stop_token_ids=[period], include_stop_str_in_output=include)
    c, _ = _run(tok, params, tokens, ("stop", period), per_update)
    assert (c.text, c.finish_reason, c.stop_reason) == (tok.decode(tokens if include else tokens[:-1]), "stop", period)
    assert c.text == (" Paris is big." if include else " Paris is big")
    _check_kept(c, tokens)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_eos(tok, include, skip):
    eos = tok.eos_token_ids[0]
    tokens = [*_ids(tok, " Paris."), eos]
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include)
    c, _ = _run(tok, params, tokens, ("stop", None))
    shown = " Paris.<|im_end|>" if include and not skip else " Paris."
    assert (c.text, c.finish_reason, c.stop_reason) == (shown, "stop", None)
    _check_kept(c, tokens)


def test_stop_token_after_an_unfinished_character(tok):
    """The held piece of a character comes out as a full decode of the tokens shows it (U+FFFD)."""
    period = _ids(tok, ".")[0]
    cat = _ids(tok, "🐱")
    tokens = [*_ids(tok, " a"), cat[0], period]
    c, _ = _run(tok, SamplingParams(stop_token_ids=[period]), tokens, ("stop", period))
    assert c.text == tok.decode(tokens[:-1]) == " a\ufffd"


def test_stop_token_while_a_stop_string_prefix_is_held(tok):
    """Text held back as a possible stop string is released at the stop token; the stop token does not complete
    the stop string (its text is not part of the output)."""
    period = _ids(tok, ".")[0]
    tokens = [*_ids(tok, " Paris is big"), period]
    params = SamplingParams(stop=["big."], stop_token_ids=[period])
    c, stopped = _run(tok, params, tokens, ("stop", period))
    assert (c.text, c.stop_reason, stopped) == (" Paris is big", period, [])
    params = SamplingParams(stop=["big."], stop_token_ids=[period], include_stop_str_in_output=True)
    c, _ = _run(tok, params, tokens, ("stop", period))
    assert (c.text, c.stop_reason) == (" Paris is big.", "big.")


def test_other_endings_keep_the_last_token(tok):
    """max_tokens ("length") and a token that is a stop token only with ignore_eos off: its text stays."""
    eos = tok.eos_token_ids[0]
    tokens = [*_ids(tok, " Paris"), eos]
    params = SamplingParams(max_tokens=2, ignore_eos=True, skip_special_tokens=False)
    c, _ = _run(tok, params, tokens, ("length", None))
    assert (c.text, c.finish_reason) == (" Paris<|im_end|>", "length")
    c, _ = _run(tok, SamplingParams(max_tokens=2), _ids(tok, " Paris."), ("length", None))
    assert c.text == " Paris."
