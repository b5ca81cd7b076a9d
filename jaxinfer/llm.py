"""The offline API for research code and notebooks, shaped like vLLM's:

    from jaxinfer import LLM, SamplingParams
    with LLM("smollm2-135m-instruct") as llm:
        outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32, temperature=0.8, seed=0))
        print(outs[0].outputs[0].text)

`close()` (or leaving the `with` block) frees every device buffer the model held, so a notebook can load another
model without restarting.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxinfer.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxinfer.engine.build import build_engine
from jaxinfer.engine.config import EngineArgs
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.output import OutputAccumulator, OutputProcessor
from jaxinfer.host_memory import heap_frozen, release_freed_memory
from jaxinfer.model.transformer import Params
from jaxinfer.model_files import DEFAULT_MODEL
from jaxinfer.tokenizer import template_role
from jaxinfer.types import RequestOutput, RequestsFailedError, SamplingParams, is_integer, with_bad_words_ids

PromptType = str | list[int] | dict[str, Any]


class LLM:
    # None once closed, and on an object whose __init__ failed before building it (its __del__ still runs).
    engine: Engine | None = None

    def __init__(self, model: str | os.PathLike | nnx.Module = DEFAULT_MODEL, *, warmup: bool = False, **settings: Any):
        """`model`: a preset, a GGUF file, an HF directory, a checkpoint, or your own nnx.Module (see
        jaxinfer.model.protocol; pass `tokenizer=` with it). `settings` are the fields of
        `jaxinfer.engine.config.EngineArgs` (vLLM's names: max_model_len, max_num_seqs, block_size,
        gpu_memory_utilization, tensor_parallel_size, ...); an unknown one is a TypeError naming it."""
        self.model = model
        self.engine, self.tokenizer = build_engine(EngineArgs(model=model, **settings))
        self.processor = OutputProcessor(self.tokenizer)
        self._counter = 0
        self.warmup_seconds = None
        if warmup:
            from jaxinfer.startup import warm_up

            # Every program a request can select, prompt logprobs' too, as the server's warm-up.
            self.warmup_seconds = warm_up(self.engine, prompt_logprobs=True).seconds

    def _replicas(self) -> list[Engine]:
        return getattr(self.engine, "replicas", [self.engine])

    # ------------------------------------------------------------------------------------------ API

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: vLLM's defaults, with the model's
        generation_config.json values for temperature, top_p, top_k, min_p and repetition_penalty, and its
        max_new_tokens as max_tokens (unless `generation_config="vllm"`)."""
        if self.engine is None:
            raise RuntimeError("this LLM is closed")
        return SamplingParams(**self.engine.sampling_defaults)

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"}, key=str)
            if unknown:  # vLLM's multi_modal_data and the like: not ours to drop silently
                raise ValueError(f"prompts: unsupported key(s) {unknown} (a dict prompt takes 'prompt' and "
                                 "'prompt_token_ids')")  # fmt: skip
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("prompts: a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
        if _is_token_ids(prompt):
            return None, _token_ids(prompt)
        if isinstance(prompt, list | tuple | np.ndarray) and len(prompt) == 0:  # it said "got list"
            raise ValueError("prompts: an empty prompt (no token ids); a prompt needs at least one token")
        raise ValueError(f"prompts: expected text, a list of token ids or a dict, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt (continuously batched); outputs in prompt order."""
        if self.engine is None:
            raise RuntimeError("this LLM is closed")
        if isinstance(prompts, str | dict) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        elif isinstance(prompts, Iterable):
            prompts = list(prompts)  # a list, a tuple, a generator
        else:
            raise ValueError(f"prompts: expected a prompt or a list of them, got {type(prompts).__name__}")
        given = self.get_default_sampling_params() if sampling_params is None else sampling_params
        if isinstance(given, SamplingParams):
            plist = [given] * len(prompts)
        elif isinstance(given, list | tuple) and all(isinstance(x, SamplingParams) for x in given):
            plist = list(given)
        else:
            raise ValueError(f"sampling_params: expected a SamplingParams or a list of them, got {given!r:.80}")
        if len(plist) != len(prompts):
            raise ValueError(f"sampling_params: got {len(plist)} for {len(prompts)} prompts")
        if self.engine.driver is not None:
            raise RuntimeError(
                "an AsyncEngine drives this engine: shut it down (AsyncEngine.shutdown()) before LLM.generate"
            )
        # Validate everything before queueing anything, so a bad prompt does not leave the others half-submitted.
        items = []
        context = self.engine.largest().cc.max_model_len  # or the KV pool's size, where that is smaller
        for p, sp in zip(prompts, plist, strict=True):
            text, ids = self._prompt_ids(p)
            if sp.max_tokens is not None and len(ids) < context:
                # As vLLM's offline LLM: generation stops at the context length ("length") rather than refusing,
                # min_tokens or not.
                room = context - len(ids)
                sp = dataclasses.replace(sp, max_tokens=min(sp.max_tokens, room), min_tokens=min(sp.min_tokens, room))
            sp = with_bad_words_ids(sp, self.tokenizer)
            items.append((text, self.engine.validate(ids, sp), sp))
        rids: list[str] = []
        try:
            for text, ids, sp in items:
                rid = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(ids, sp, rid)
                self.processor.add(rid, text, ids, sp)
                rids.append(rid)
        except BaseException:  # Ctrl-C while a large batch is queued: none of it stays behind
            self._abort(rids)
            raise
        return self._run(rids, use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): for each prompt, the `beam_width` best sequences, best first
        (jaxinfer.beam_search). Needs 2 * beam_width <= max_logprobs (the engine's setting, 20 by default)."""
        if self.engine is None:
            raise RuntimeError("this LLM is closed")
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected a BeamSearchParams, got {params!r:.80}")
        limit = self.engine.largest().cc.max_logprobs
        if 2 * params.beam_width > limit:
            raise ValueError(f"beam_width: at most {limit // 2} with max_logprobs={limit} (each round ranks "
                             f"2 * beam_width alternatives of a beam); got {params.beam_width}")  # fmt: skip
        if isinstance(prompts, str | dict) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self._prompt_ids(p)[1] for p in prompts]
        engine = self.engine.largest()

        def generate(batch: list[dict], sp: SamplingParams) -> list[RequestOutput]:
            return self.generate(batch, sp, use_tqdm=False)

        return beam_search(generate, ids, params, engine.eos_token_ids, engine.cc.max_model_len,
                           lambda toks: self.tokenizer.decode(toks, skip_special_tokens=True))  # fmt: skip

    def _abort(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)
            self.processor.forget(rid)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, through the model's chat template. A message is
        {"role", "content"}: text, or OpenAI's content parts of type "text". `continue_final_message=True` (with
        `add_generation_prompt=False`) continues the last message instead of answering it, as vLLM's; the
        template's variables in `chat_template_kwargs` win over the arguments of the same name, as in vLLM.
        `chat_template`: Jinja text rendering these conversations instead of the model's; given to `LLM(...,
        chat_template=...)` instead, its end-of-turn marker also becomes a stop token. `tools`: OpenAI's tool dicts,
        the template's `tools` variable (vLLM's); a history may hold assistant `tool_calls` and "tool" messages."""
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError("messages: expected a conversation (a list of messages) or a list of conversations")
        convs = [messages] if isinstance(messages[0], dict) else messages
        template_kwargs = {
            **({"tools": tools} if tools is not None else {}),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            **(chat_template_kwargs or {}),
        }
        tokenizer = self.tokenizer if chat_template is None else self.tokenizer.with_chat_template(chat_template)
        prompts = []
        for i, conv in enumerate(convs):
            text = tokenizer.apply_chat_template(
                _conversation(conv, f"messages[{i}]" if len(convs) > 1 else "messages"), **template_kwargs
            )
            # The template already holds BOS where the model wants it.
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    @heap_frozen()  # the engine's and jax's objects out of full collections, which stalled the step loop
    def _run(self, rids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wholes = {rid: OutputAccumulator() for rid in rids}  # the processor's outputs are deltas
        pending = set(rids)
        bar = None
        try:
            # use_tqdm: a flag, or (as vLLM takes it) a progress-bar factory, called with vLLM's arguments.
            if callable(use_tqdm):
                bar = use_tqdm(total=len(rids), desc="Processed prompts", dynamic_ncols=True)
            else:
                bar = tqdm(total=len(rids), desc="Generating", disable=not use_tqdm, unit="req")
            while pending:
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"engine stopped with {len(pending)} requests unfinished")
                outs = self.processor.process(self.engine.step(), self.engine.finish_sequence)
                for out in outs:
                    if out.request_id not in pending:
                        continue
                    wholes[out.request_id].add(out)
                    if out.finished:
                        final[out.request_id] = wholes.pop(out.request_id).result()
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self._abort(pending)  # an interrupted call (Ctrl-C in a notebook) must not leave pages behind
            self.engine.recover()  # nor pools a step took just before the interrupt
            raise
        finally:
            if bar is not None:
                bar.close()
        results = [final[r] for r in rids]
        if any(r.error is not None for r in results):  # silent "" texts would pass for answers (vLLM raises too)
            raise RequestsFailedError(results)
        return results

    # ------------------------------------------------------------------------------------------ lifetime

    def update_weights(self, model: nnx.Module | Params) -> None:
        """Generates from new values of the same model from here on: your module after training steps (a jit that
        donates its arrays deletes the ones the engine holds), or a family's state as `jaxinfer.weights` loads it.
        Same structure, shapes and dtypes, so nothing compiles again; the prefix cache is dropped."""
        if self.engine is None:
            raise RuntimeError("this LLM is closed")
        if self.engine.driver is not None:  # its thread steps the engine: stepping it here too failed every request
            raise RuntimeError("update_weights: an AsyncEngine drives this LLM's engine; shut it down first")
        while self.engine.has_unfinished():  # a step an interrupted generate left in flight (its requests aborted)
            self.engine.step()
        self.engine.update_weights(model)

    def reset_prefix_cache(self) -> None:
        """Drops the KV cached for prompt prefixes (vLLM's `LLM.reset_prefix_cache`): the next `generate` computes
        every prompt in full, as a timed run that repeats its prompts must."""
        if self.engine is None:
            raise RuntimeError("this LLM is closed")
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Frees the weights, the KV pools and the compiled steps. The object cannot generate afterwards."""
        if self.engine is None:
            return
        if self.engine.driver is not None:  # its thread steps the engine: freeing under it would kill that loop
            raise RuntimeError("close: an AsyncEngine drives this LLM's engine; shut it down first")
        self.engine.release_sessions()
        for e in self._replicas():
            if e.host is not None:
                e.host.clear()
            # Deleted, not only dropped: a caller may still hold the engine (an AsyncEngine over it, a notebook name).
            # A module of the caller's own keeps its arrays.
            e.runner.release()
        self.engine = None
        jax.clear_caches()
        # glibc keeps the freed weights' and pool's blocks in its heap: without the trim a notebook's RSS stayed
        # ~150-450 MiB above what it held before LLM() after each close (the default model, 12 cycles).
        release_freed_memory()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self.engine is not None and self.engine.driver is not None:
            return  # an AsyncEngine over the engine lives on (a notebook's pattern); the engine goes with it
        try:
            self.close()
        except Exception:
            pass


def _is_token_ids(prompt: object) -> bool:
    """Whether `prompt` is one prompt of token ids (a list, tuple or 1-D array of ints), not a list of prompts."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1
    # a bool first still reads as token ids, so that `_token_ids` names the bad element
    return isinstance(prompt, list | tuple) and len(prompt) > 0 and isinstance(prompt[0], numbers.Integral)


def _token_ids(ids: object) -> list[int]:
    """`ids` as a list of ints; ValueError for anything else (a string, floats, bools), which int() would coerce."""
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
        return ids.tolist()
    if not isinstance(ids, list | tuple) or not all(is_integer(t) for t in ids):
        raise ValueError(f"prompts: prompt_token_ids must be a list of integers, got {ids!r:.80}")
    return [int(t) for t in ids]


def _conversation(conv: object, where: str) -> list[dict]:
    """A conversation as the chat template takes it: each message's role and text content checked, content parts
    (OpenAI's [{"type": "text", "text": ...}]) joined as the server joins them."""
    if not isinstance(conv, list | tuple) or not conv:
        raise ValueError(f"{where}: expected a non-empty list of messages, got {conv!r:.80}")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{j}]: a message is a dict with a 'role' and a 'content', got {m!r:.80}")
        content = m.get("content")
        if content is None and m.get("tool_calls"):  # an assistant turn that only called tools
            content = ""
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"{where}[{j}].content: expected text or a list of text parts, got {content!r:.80}")
        out.append({**m, "role": template_role(m["role"]), "content": content})
    return out
