"""Bring your own model: a user nnx.Module that is none of the built-in families, served by the paged engine.

Its greedy output through `LLM` (paged KV, continuous batching, chunked prefill, prefix cache) equals the module's
own contiguous forward loop, which calls it without the engine: the whole sequence each step, with a plain causal
attention written here. A module missing part of the protocol fails at load time, naming the part.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer import LLM, RequestsFailedError, SamplingParams
from jaxinfer.engine.build import build_engine, cache_config
from jaxinfer.engine.config import EngineArgs
from jaxinfer.model.protocol import ProtocolError, check_model
from tests.model.byo_model import CONFIG, ParallelLM, model

TOKENIZER = "smollm2-135m-instruct"
SETTINGS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=8, num_kv_tokens=256,
                enable_compilation_cache=False)  # fmt: skip
NEW = 8


def _causal_attend(i, q, k, v, cache):
    """Plain causal GQA over the whole sequence (no cache): q f[B,T,H,Dh], k, v f[B,T,Hkv,Dh]."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * CONFIG.scale
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v), cache


@nnx.jit
def _all_logits(model: ParallelLM, tokens: jax.Array) -> jax.Array:
    """f32[L, V] for a right-padded sequence i32[1, L] (causal: padding never reaches the real tokens)."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    hidden, _ = model(tokens, positions, [None] * CONFIG.num_layers, _causal_attend)
    return model.logits(hidden[0])


def own_greedy_loop(model: ParallelLM, prompt: list[int], n: int) -> list[int]:
    """The module's own contiguous forward pass, recomputed over the whole sequence for every new token (padded
    to the context length, so one compiled program serves every step)."""
    ids = list(prompt)
    for _ in range(n):
        tokens = np.zeros((1, SETTINGS["max_model_len"]), np.int32)
        tokens[0, : len(ids)] = ids
        ids.append(int(jnp.argmax(_all_logits(model, tokens)[len(ids) - 1])))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def llm():
    with LLM(model(), tokenizer=TOKENIZER, **SETTINGS) as llm:
        yield llm


def test_user_module_paged_greedy_equals_its_own_loop(llm):
    rng = np.random.default_rng(0)
    # Lengths straddle page edges (8) and one exceeds the step's token budget (16), so it is prefilled in chunks;
    # the repeated prompt hits the prefix cache.
    prompts = [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (1, 8, 9, 27)]
    prompts.append(prompts[3])
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
    ref = model()
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.outputs[0].token_ids) == own_greedy_loop(ref, p, NEW)


def test_entry_point_string_loads_the_module():
    """What `serve.py --model tests.model.byo_model:build` does: the server's builder is `build_engine`."""
    engine, tok = build_engine(EngineArgs("tests.model.byo_model:build", **SETTINGS))  # build() names its tokenizer
    assert engine.runner.cfg == CONFIG
    assert isinstance(engine.runner.model_def.merge(engine.runner.weights), ParallelLM)
    with pytest.raises(ProtocolError, match="no_such_module"):
        build_engine(EngineArgs("no_such_module:build", tokenizer=tok, **SETTINGS))


def test_an_entry_point_is_found_in_the_current_directory(tmp_path, monkeypatch):
    """`jaxinfer serve mymodels.lm:build` run from the folder that holds mymodels/: the script's folder is first on
    sys.path, not the current one, so the import failed (uvicorn searches the current directory for its app)."""
    from jaxinfer.model.protocol import load_entry_point

    (tmp_path / "cwd_models").mkdir()
    (tmp_path / "cwd_models" / "__init__.py").write_text("")
    (tmp_path / "cwd_models" / "lm.py").write_text("from tests.model.byo_model import build\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    module, tokenizer = load_entry_point("cwd_models.lm:build")
    assert isinstance(module, ParallelLM) and tokenizer is not None


def test_settings_that_do_not_apply_to_a_module_are_errors_and_a_tokenizer_path_works():
    from jaxinfer.model_files import smollm2_gguf

    engine, tok = build_engine(EngineArgs(model(), tokenizer=smollm2_gguf(), **SETTINGS))  # a pathlib.Path
    assert tok.eos_token_ids
    with pytest.raises(TypeError, match="tokenizer: expected a model name or path"):
        build_engine(EngineArgs(model(), tokenizer=object(), **SETTINGS))
    with pytest.raises(ValueError, match="dtype: 'bfloat16', but a module of your own"):
        build_engine(EngineArgs(model(), tokenizer=TOKENIZER, dtype="bfloat16", **SETTINGS))


def test_a_config_subclass_crosses_to_the_api_side(llm):
    """`serve.py` runs the engine in its own process: the API side rebuilds the config from the engine's facts."""
    import dataclasses

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.core_process import engine_facts, pack, unpack
    from jaxinfer.engine.engine import Engine
    from jaxinfer.engine.mp_engine import _Validator

    @dataclasses.dataclass(frozen=True)
    class MyConfig(ModelConfig):
        parallel_residual: bool = True

    base = {f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(ModelConfig)}
    m = ParallelLM(MyConfig(**base), rngs=nnx.Rngs(0))
    engine = Engine(m.config, m, cache_config(EngineArgs(m, **SETTINGS), m.config))
    validator = _Validator(unpack(pack(engine_facts(engine, llm.tokenizer))))
    assert validator.cfg == CONFIG and validator.validate([1, 2, 3], SamplingParams()) == [1, 2, 3]


# ---------------------------------------------------------------------------------------------- the caller's module

PROMPT = list(range(5, 30))  # three pages and a part: a prefix the cache keeps


def test_closing_an_llm_leaves_the_module_whole():
    m = model()
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = own_greedy_loop(m, PROMPT, NEW)
    first, second = LLM(m, tokenizer=TOKENIZER, **SETTINGS), LLM(m, tokenizer=TOKENIZER, **SETTINGS)
    first.generate([PROMPT], greedy, use_tqdm=False)
    first.close()  # the engine's KV pools go; the module's arrays, shared by both engines, stay
    assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(m)))
    assert list(second.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids) == want
    del second  # dropped, not closed: __del__ closes it
    assert own_greedy_loop(m, PROMPT, NEW) == want


@nnx.jit(donate_argnums=0)
def _train_step(m: ParallelLM) -> None:
    """Stands for an optimizer step: new values for every parameter, the old arrays donated (deleted)."""
    nnx.update(m, jax.tree.map(lambda p: -1.5 * p, nnx.state(m, nnx.Param)))


def test_update_weights_after_a_donating_train_step():
    from jaxinfer.engine.runner import compile_count

    m = model()
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with LLM(m, tokenizer=TOKENIZER, **SETTINGS) as llm:
        before = list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        assert before == own_greedy_loop(model(), PROMPT, NEW)  # an equal module: m's arrays go to the train step
        _train_step(m)
        with pytest.raises(RequestsFailedError, match="1 of 1 requests failed.*update_weights") as failed:
            llm.generate([PROMPT], greedy, use_tqdm=False)
        (out,) = failed.value.outputs
        assert out.outputs[0].finish_reason == "error" and "update_weights" in out.error
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
        compiles = compile_count()
        llm.update_weights(m)
        after = list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        # The prompt's blocks were cached under the old weights: a stale hit would return the old model's tokens.
        assert after == own_greedy_loop(m, PROMPT, NEW) != before
        assert compile_count() == compiles
        half = model()
        half.blocks[1].up.kernel.set_value(half.blocks[1].up.kernel.get_value().astype(jnp.bfloat16))
        with pytest.raises(ValueError, match=r"update_weights: .*blocks.*1.*up.*bfloat16\[32, 64\]"):
            llm.update_weights(half)
        with pytest.raises(ValueError, match="not the engine's model"):
            llm.update_weights(ParallelLM(CONFIG.replace(intermediate_size=32), rngs=nnx.Rngs(0)))
        assert list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids) == after


class _CtrlC:
    """A progress bar whose first update is the user's Ctrl-C: generate is interrupted with requests in flight."""

    def __init__(self, **kwargs):
        pass

    def update(self, n: int) -> None:
        raise KeyboardInterrupt

    def close(self) -> None:
        pass


def test_update_weights_after_an_interrupted_generate():
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with LLM(model(), tokenizer=TOKENIZER, **SETTINGS) as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT[:3], PROMPT, PROMPT[:9]], greedy, use_tqdm=_CtrlC)
        other = ParallelLM(rngs=nnx.Rngs(7))
        llm.update_weights(other)
        assert list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids) == own_greedy_loop(
            other, PROMPT, NEW
        )
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


# ---------------------------------------------------------------------------------------------- broken modules

SMALL = CONFIG.replace(vocab_size=16)


class NoConfig(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(2))


class NoLogits(ParallelLM):
    logits = None


class SkipsALayer(ParallelLM):
    def __call__(self, token_ids, positions, kv_cache, attend):
        def only_layer_0(i, q, k, v, cache):
            return attend(i, q, k, v, cache) if i == 0 else (q, cache)

        return super().__call__(token_ids, positions, kv_cache, only_layer_0)


class AttendsByKeyword(ParallelLM):
    """Passed the check, whose stand-in named the argument `cache`, then failed every request in the engine (whose
    attend names it otherwise): now both take it positionally."""

    def __call__(self, token_ids, positions, kv_cache, attend):
        return super().__call__(token_ids, positions, kv_cache, lambda i, q, k, v, c: attend(i, q, k, v, cache=c))


class NoPositions(ParallelLM):
    def __call__(self, token_ids, kv_cache, attend):
        return super().__call__(token_ids, None, kv_cache, attend)


class ReturnsNoCache(ParallelLM):
    def __call__(self, token_ids, positions, kv_cache, attend):
        return super().__call__(token_ids, positions, kv_cache, attend)[0]


class ForgetsCache(ParallelLM):
    def __call__(self, token_ids, positions, kv_cache, attend):
        return super().__call__(token_ids, positions, kv_cache, attend)[0], kv_cache


class OneCacheForAll(ParallelLM):
    def __call__(self, token_ids, positions, kv_cache, attend):
        return super().__call__(token_ids, positions, [kv_cache[0]] * len(kv_cache), attend)


class WithDropout(ParallelLM):
    def __init__(self, cfg, rngs):
        super().__init__(cfg, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def logits(self, hidden):
        return super().logits(self.drop(hidden))


class BatchNormed(ParallelLM):
    def __init__(self, cfg, rngs):
        super().__init__(cfg, rngs=rngs)
        self.bn = nnx.BatchNorm(cfg.hidden_size, rngs=rngs)

    def __call__(self, token_ids, positions, kv_cache, attend):
        hidden, cache = super().__call__(token_ids, positions, kv_cache, attend)
        return self.bn(hidden), cache


class Logits3D(ParallelLM):
    def logits(self, hidden):
        return jnp.einsum("btd,vd->btv", hidden, self.embed.embedding[...])


class BadMath(ParallelLM):
    def __call__(self, token_ids, positions, kv_cache, attend):
        hidden, cache = super().__call__(token_ids, positions, kv_cache, attend)
        return hidden @ jnp.ones((3, 3)), cache


class WrongHeads(ParallelLM):
    def __init__(self, rngs):
        super().__init__(SMALL, rngs=rngs)
        self.config = SMALL.replace(num_heads=2)


@pytest.mark.parametrize(
    "make, part",
    [
        (lambda: object(), "expected a flax.nnx.Module"),
        (NoConfig, r"NoConfig\.config"),
        (lambda: NoLogits(SMALL, rngs=nnx.Rngs(0)), r"NoLogits\.logits\(hidden\): missing"),
        (lambda: SkipsALayer(SMALL, rngs=nnx.Rngs(0)), "must call attend once per layer"),
        (lambda: ReturnsNoCache(SMALL, rngs=nnx.Rngs(0)), r"must return \(hidden, kv_cache\)"),
        (lambda: AttendsByKeyword(SMALL, rngs=nnx.Rngs(0)), r"AttendsByKeyword.__call__: attend takes .*positionally"),
        (lambda: NoPositions(SMALL, rngs=nnx.Rngs(0)), r"NoPositions\.__call__ does not take the contract's arguments"),
        # the module's own math: its error as it is, not a lecture on the signature
        (lambda: BadMath(SMALL, rngs=nnx.Rngs(0)), r"BadMath\.__call__ failed on abstract inputs .*TypeError: dot_gen"),
        (lambda: WrongHeads(nnx.Rngs(0)), r"attend\(q=\.\.\.\) got shape \(1, 2, 4, 8\)"),
        (lambda: ForgetsCache(SMALL, rngs=nnx.Rngs(0)), r"returned kv_cache\[0\] is not what attend returned"),
        (lambda: OneCacheForAll(SMALL, rngs=nnx.Rngs(0)), r"attend for layer 1 got kv_cache\[0\]"),
        # the classic: a module trained with dropout (or batch norm) and served without model.eval()
        (lambda: WithDropout(SMALL, nnx.Rngs(0)), r"change the module's state \(.*drop.*model\.eval\(\)"),
        (lambda: BatchNormed(SMALL, nnx.Rngs(0)), r"change the module's state \(.*bn.*mean"),
        (lambda: Logits3D(SMALL, rngs=nnx.Rngs(0)), r"Logits3D\.logits\(hidden f\[N, D\]\) failed"),
        # a built-in family's arch on a module of one's own: the engine would take it for its own Transformer
        (lambda: ParallelLM(SMALL.replace(arch="llama"), rngs=nnx.Rngs(0)), r"ParallelLM\.config\.arch: 'llama'"),
    ],
)
def test_protocol_violation_names_the_part(make, part):
    with pytest.raises(ProtocolError, match=part):
        check_model(make())


@pytest.mark.parametrize("make", [WithDropout, BatchNormed])
def test_a_module_in_eval_mode_passes(make):
    m = make(SMALL, nnx.Rngs(0))
    m.eval()
    assert check_model(m) == SMALL


def test_violation_fails_at_load_time(llm):
    with pytest.raises(ProtocolError, match=r"ReturnsNoCache\.__call__"):
        LLM(ReturnsNoCache(SMALL, rngs=nnx.Rngs(0)), tokenizer=llm.tokenizer, **SETTINGS)


def test_builtin_family_follows_the_protocol():
    from jaxinfer.model import Transformer

    cfg = CONFIG.replace(arch="llama", vocab_size=16)
    assert check_model(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))) == cfg


def test_a_tokenizer_larger_than_the_model_is_warned_of(llm, caplog):
    """The model here (4096 ids) uses a prefix of SmolLM2's 49152: allowed, said once at build, since a text that
    encodes to a later id is refused."""
    import logging

    with caplog.at_level(logging.WARNING, logger="jaxinfer.engine.build"):
        LLM(model(), tokenizer=llm.tokenizer, **SETTINGS).close()
    assert any("49152 tokens, more than the model's config.vocab_size=4096" in r.getMessage() for r in caplog.records)
