"""Beam search over the engine, as vLLM's `LLM.beam_search` runs it: one engine step per generated token.

Each round asks the engine for one greedy token of every live beam, with the 2 * beam_width most likely
alternatives (`logprobs`); every beam is extended by each alternative, and the beam_width best extensions of a
prompt go on. An extension ending in EOS (unless ignore_eos) is complete and stops there. At the end the live beams
join the complete ones, and the beam_width best of all are returned, best first. Beams are ranked by vLLM's score:
cumulative logprob / length ** length_penalty, the length counting the prompt and the tokens, a final EOS excepted
(with ignore_eos, EOS ends nothing and counts as any token).

As in vLLM and Hugging Face, only those 2 * beam_width alternatives of a beam are candidates: enough for beam_width
non-EOS extensions of a prompt, while an EOS less likely than all of them does not end the beam. Beams sharing a
prefix share its KV pages through the prefix cache:
each round computes a beam's last page or so, not its whole sequence. The logprobs are the raw model's (before any
sampling parameter), and a beam's logits do not depend on what else the engine batches with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jaxinfer.types import RequestOutput, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (without temperature: the scores are the raw logprobs, which it does not change)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        lp = self.length_penalty
        if not (isinstance(lp, int | float) and not isinstance(lp, bool) and math.isfinite(lp)):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's then the generated ones (as vLLM's); `logprobs` one dict per generated
    token (its alternatives, as SamplingParams.logprobs gives them); `text` the generated tokens' text."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens or the context)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # beam_width of them at most, best first


def score(seq: BeamSearchSequence, eos_token_ids: Sequence[int], length_penalty: float) -> float:
    """vLLM's get_beam_search_score: cumulative logprob / length ** length_penalty, EOS not counted."""
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (n**length_penalty)


@dataclass
class _Prompt:
    length: int
    beams: list[BeamSearchSequence]
    done: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(
    generate: Callable[[list[dict], SamplingParams], list[RequestOutput]],
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    context: int,
    decode: Callable[[list[int]], str],
) -> list[BeamSearchOutput]:
    """`generate(prompts, params)`: LLM.generate over token-id prompts. `context`: the most tokens a sequence may
    hold (a beam that reaches it ends with "length"). `decode`: generated token ids -> text."""
    eos = set() if params.ignore_eos else set(eos_token_ids)  # with ignore_eos an EOS is a token like any other
    width = params.beam_width
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    found = [_Prompt(len(p), [BeamSearchSequence(list(p))]) for p in prompts]
    for _ in range(params.max_tokens):
        live = [(f, b) for f in found for b in f.beams]
        if not live:
            break
        outs = generate([{"prompt_token_ids": b.tokens} for _, b in live], step)
        extended: dict[int, list[BeamSearchSequence]] = {id(f): [] for f in found}
        for (f, beam), out in zip(live, outs, strict=True):
            alternatives = out.outputs[0].logprobs[0]
            for tok, lp in alternatives.items():
                new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [alternatives], beam.cum_logprob + lp)
                if tok in eos:
                    new.finish_reason = "stop"
                    f.done.append(new)
                else:
                    extended[id(f)].append(new)
        for f in found:
            best = sorted(extended[id(f)], key=lambda s: score(s, eos, params.length_penalty), reverse=True)[:width]
            # A beam that filled the context can take no more tokens: it ends here.
            f.done += [b for b in best if len(b.tokens) >= context]
            f.beams = [b for b in best if len(b.tokens) < context]
    results = []
    for f in found:
        ranked = sorted(f.done + f.beams, key=lambda s: score(s, eos, params.length_penalty), reverse=True)[:width]
        for s in ranked:
            s.finish_reason = s.finish_reason or "length"
            s.text = decode(s.tokens[f.length :])
        results.append(BeamSearchOutput(ranked))
    return results
