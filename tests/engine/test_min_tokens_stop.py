"""min_tokens holds back stop strings as vLLM v1 does: none is checked until min_tokens tokens are out."""

from __future__ import annotations

import pytest

from jaxinfer.engine.output import OutputAccumulator, OutputProcessor
from jaxinfer.model_files import smollm2_gguf
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.types import SamplingParams, SeqUpdate


@pytest.mark.parametrize("min_tokens,text", [(0, " "), (1, " a b "), (3, " a b a b ")])
def test_stop_strings_wait_for_min_tokens(min_tokens, text):
    tok = load_tokenizer(smollm2_gguf())
    ids = tok.encode(" a b a b a b a", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids[:5]] == [" a", " b", " a", " b", " a"]
    proc, whole = OutputProcessor(tok), OutputAccumulator()
    proc.add("r", None, tok.encode("x", add_special_tokens=False),
             SamplingParams(max_tokens=20, stop=["a"], min_tokens=min_tokens))  # fmt: skip
    to_stop = []
    for t in ids:
        outs = proc.process([SeqUpdate("r", [t], [], False, None)], lambda *stop: to_stop.append(stop))
        for out in outs:
            whole.add(out)
        if to_stop:
            break
    c = whole.result().outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text, "stop", "a")
    assert len(c.token_ids) > min_tokens


@pytest.mark.parametrize("stop,min_tokens,text", [("s.", 1, " Pari"), ("s.", 0, " Pari"), ("is", 1, " Paris. Par")])
def test_stop_string_may_start_inside_min_tokens(stop, min_tokens, text):
    """vLLM v1 searches from a stop string's length before the new text: a match may start in the min_tokens
    window as long as it ends past it ("s." across " Paris" and "."), but one wholly inside the window is not one."""
    tok = load_tokenizer(smollm2_gguf())
    ids = tok.encode(" Paris. Paris is", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == [" Paris", ".", " Paris", " is"]
    proc, whole = OutputProcessor(tok), OutputAccumulator()
    proc.add("r", None, tok.encode("x", add_special_tokens=False),
             SamplingParams(max_tokens=20, stop=[stop], min_tokens=min_tokens))  # fmt: skip
    to_stop = []
    for t in ids:
        for out in proc.process([SeqUpdate("r", [t], [], False, None)], lambda *s: to_stop.append(s)):
            whole.add(out)
        if to_stop:
            break
    c = whole.result().outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text, "stop", stop)
