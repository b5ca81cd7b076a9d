"""The layer loop: a `lax.scan` over stacked weights and KV pools against unrolled layers, and the per-backend
choice. The paged-vs-contiguous tests (test_paged_engine.py) run the CPU default (scan) against the contiguous
generator on the real SmolLM2 weights; here the two loops are compared with each other on the same engine work."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig, EngineArgs
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_copy import PageCopier
from jaxinfer.engine.runner import choose_layer_loop, paged_step
from jaxinfer.engine.transfer import to_flat
from jaxinfer.model import init_params
from jaxinfer.types import SamplingParams
from kernels_pallas import project_cpu
from tests.aot.aot_tools import copies_of  # the compiled-HLO helper the TPU checks use

CFG = dict(arch="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
           num_kv_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip


def _engine(loop: str, num_pages: int = 40, **cfg_changes) -> Engine:
    cfg = ModelConfig(**{**CFG, **cfg_changes})
    cc = CacheConfig(block_size=4, num_pages=num_pages, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                     layer_loop=loop)  # fmt: skip
    return Engine(cfg, init_params(cfg, seed=3, std=0.3), cc)


def _compiled_step(eng: Engine, decode_only: bool, t: int, s: int) -> str:
    """The optimized HLO of the engine's step for a bucket of t tokens and s sequences."""
    r = eng.runner
    flat, layout = to_flat(r.padding_inputs(False, t, s))
    static = r.step_static(layout, decode_only, advanced=False, prompt_lp=False)
    return paged_step.lower(**static, **r._dynamic(flat)).compile().as_text()


def _work() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 128, 9).tolist()  # a common prefix: prefix-cache hits on full pages
    prompts = [shared + rng.integers(1, 128, n).tolist() for n in (1, 6, 14, 23)] + [rng.integers(1, 128, 3).tolist()]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3) for _ in prompts]
    params[1] = SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True, logprobs=3)
    return prompts, params


@pytest.mark.parametrize(
    "num_pages, biases",
    [(40, {}), (14, {}), (40, dict(mlp_bias=True, qkv_bias=True))],  # 14: too small for all at once: preemptions
)
def test_scan_equals_unroll(num_pages, biases):
    """The scan runs gate/up fused (scanned.FUSE_GATE_UP), bias included; unrolled layers keep them apart."""
    prompts, params = _work()
    runs = {}
    for loop in ("scan", "unroll"):
        eng = _engine(loop, num_pages, **biases)
        assert eng.runner.layer_loop == loop
        outs = [o[0] for o in eng.generate(prompts, params)]
        runs[loop] = outs
        assert eng.allocator.num_free == eng.allocator.num_pages
    for s, u in zip(runs["scan"], runs["unroll"], strict=True):
        assert s.output_token_ids == u.output_token_ids
        np.testing.assert_allclose([lp[t] for lp, t in zip(s.output_logprobs, s.output_token_ids, strict=True)],
                                   [lp[t] for lp, t in zip(u.output_logprobs, u.output_token_ids, strict=True)],
                                   atol=2e-5)  # fmt: skip
    if num_pages == 14:
        assert sum(r.num_preemptions for r in runs["scan"]) > 0


@pytest.mark.parametrize("biases", [{}, dict(mlp_bias=True)])
def test_scanned_pools_are_stacked_and_the_family_layout_comes_back(biases):
    """The scan's own layout (stacked pools and weights, gate/up fused) gives back the family's exactly."""
    eng = _engine("scan", **biases)
    ((k, v),), cfg = eng.runner.kv, eng.runner.cfg
    assert eng.runner.kv == [(k, v)]
    assert k.shape == v.shape == (cfg.num_layers * 40, 4, cfg.num_kv_heads * cfg.head_dim)  # layer l: pages l*40..
    unrolled = _engine("unroll", **biases)
    want = dict(unrolled.runner.params.flat_state())
    got = dict(eng.runner.family_params().flat_state())
    assert set(got) == set(want)
    for path, var in want.items():
        np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(var[...]))


@pytest.mark.parametrize("donate", [False, True])
def test_scan_frees_what_it_copies_only_when_given_the_weights(donate):
    """`donate_params` (build_engine, for weights it loaded): the block arrays copied into the scan's layout (stacked
    attention weights, gate and up) are deleted, before the KV pool is allocated; those the scan reads in place
    (down, embedding) stay. Without it (a caller's own weights) nothing of the caller's is touched."""
    cfg = ModelConfig(**CFG)
    params = init_params(cfg, seed=3, std=0.3)
    cc = CacheConfig(block_size=4, num_pages=40, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                     layer_loop="scan")  # fmt: skip
    eng = Engine(cfg, params, cc, donate_params=donate)
    flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(params)}
    deleted = {name for name, x in flat.items() if x.is_deleted()}
    copied = {name for name in flat if "/attn/" in name or "/mlp/gate/" in name or "/mlp/up/" in name
              or name.endswith("_norm/scale") and name.startswith("layers/")}  # fmt: skip
    assert deleted == (copied if donate else set())
    assert not flat["layers/0/mlp/down/kernel"].is_deleted() and not flat["embedder/embedding"].is_deleted()
    prompts, sps = _work()
    want = [o[0].output_token_ids for o in _engine("unroll").generate(prompts, sps)]
    assert [o[0].output_token_ids for o in eng.generate(prompts, sps)] == want


def test_page_copies_round_trip_on_stacked_pools():
    """The host tier's gather/scatter programs on the scanned loop's pools: a page copied out holds every layer's K
    and V at that page, and copied back into another page it reads the same."""
    eng = _engine("scan")
    eng.generate([list(range(1, 30))], SamplingParams(max_tokens=1, temperature=0.0))  # pages now hold K/V
    runner = eng.runner
    runner.enable_page_copies()
    runner.kv = runner.copier.warmup(runner.kv)
    (block,) = runner.pages_to_host(runner.gather_pages([2]))
    layers = lambda a: np.asarray(a).reshape(3, 40, *a.shape[1:])  # noqa: E731  [layer, page, ...]
    k, v = (layers(a) for a in runner.kv[0])
    assert block.shape == (3, 2, 4, 2 * 8)  # [layer, K/V, page slot, a token's row]
    np.testing.assert_array_equal(block[:, 0], k[:, 2])
    np.testing.assert_array_equal(block[:, 1], v[:, 2])
    assert np.abs(block).sum() > 0
    before = k.copy()
    runner.scatter_pages([37], [block])
    k, v = (layers(a) for a in runner.kv[0])
    np.testing.assert_array_equal(k[:, 37], k[:, 2])
    np.testing.assert_array_equal(v[:, 37], v[:, 2])
    before[:, 37] = k[:, 37]
    np.testing.assert_array_equal(k, before)  # nothing else written (padding rows of the copy are dropped)
    assert isinstance(runner.copier, PageCopier)


WINDOWED = ModelConfig(**{**CFG, "layer_windows": (0, 8, 0)})


@pytest.mark.parametrize(
    "requested, cfg, mesh, backend, want",
    [
        ("auto", ModelConfig(**CFG), None, "cpu", "scan"),
        ("auto", ModelConfig(**CFG), None, "gpu", "unroll"),
        ("auto", ModelConfig(**CFG), None, "tpu", "unroll"),
        ("auto", WINDOWED, None, "cpu", "unroll"),  # Gemma 3's alternating local/global layers
        ("auto", ModelConfig(**CFG), "mesh", "cpu", "unroll"),
        ("unroll", ModelConfig(**CFG), None, "cpu", "unroll"),
        ("scan", ModelConfig(**CFG), None, "gpu", "scan"),
    ],
)
def test_choose_layer_loop(requested, cfg, mesh, backend, want):
    loop, why = choose_layer_loop(requested, cfg, mesh, backend)
    assert loop == want
    assert why


@pytest.mark.parametrize("cfg, mesh, reason", [(WINDOWED, None, "layers differ"), (ModelConfig(**CFG), "m", "mesh")])
def test_explicit_scan_that_cannot_run_names_the_setting(cfg, mesh, reason):
    with pytest.raises(ValueError, match=f"layer_loop.*{reason}"):
        choose_layer_loop("scan", cfg, mesh, "cpu")


def test_windowed_model_runs_unrolled_under_auto():
    eng = _engine("auto", layer_windows=(0, 8, 0))
    assert eng.runner.layer_loop == "unroll" and len(eng.runner.kv) == 3


def test_layer_loop_setting_is_checked_and_reaches_the_runner():
    with pytest.raises(ValueError, match="layer_loop"):
        CacheConfig(layer_loop="fused")
    from jaxinfer.engine.build import cache_config

    assert cache_config(EngineArgs(layer_loop="unroll"), ModelConfig(**CFG)).layer_loop == "unroll"


@pytest.mark.parametrize("loop", ["scan", "unroll"])
@pytest.mark.parametrize("decode_only, t, s", [(True, 1, 1), (True, 4, 4), (False, 16, 4)])
def test_step_updates_the_pools_in_place(loop, decode_only, t, s):
    """No copy of a pool in the compiled step: donated (and carried through the scan), they are written in place.
    (A one-row write, which XLA turns into a dynamic-update-slice, copied whole pools every layer in both loops
    before the runner padded it to two rows.) 41 pages: no gathered block has a pool's element count by chance."""
    eng = _engine(loop, num_pages=41)
    hlo = _compiled_step(eng, decode_only, t, s)
    assert not copies_of(hlo, eng.runner.kv[0][0].size), "the step copies a KV pool"


def _kernel_slices(hlo: str, sizes: set[int]) -> list[str]:
    """Lines of compiled HLO that dynamic-slice an array of one of these element counts."""
    found = []
    for ln in hlo.splitlines():
        m = re.match(r"\s*(ROOT )?%(\S+) = f32\[([\d,]+)\]\S* (\S+)\(", ln)
        if m and ("dynamic-slice" in m.group(2) or m.group(4) == "dynamic-slice"):
            if int(np.prod([int(n) for n in m.group(3).split(",")])) in sizes:
                found.append(ln.strip()[:160])
    return found


@pytest.mark.parametrize("decode_only, t, s", [(True, 1, 1), (False, 16, 4)])
def test_scanned_step_reads_the_kernels_in_place(decode_only, t, s):
    """The scan's MLP matmuls read each layer's kernel where it lives: no dynamic slice of an MLP kernel in the
    compiled step (sliced out of a stack, XLA:CPU copied each before its matmul, every layer of every step). An
    intermediate size of 72 gives the MLP kernels an element count nothing else in the step has."""
    eng = _engine("scan", num_pages=41, intermediate_size=72)
    hlo = _compiled_step(eng, decode_only, t, s)
    slices = _kernel_slices(hlo, {2 * 32 * 72, 32 * 72})  # gate/up fused, and down
    assert not slices, "the step slices kernels out of a stack:\n" + "\n".join(slices)
    sizes = [w.size for w in eng.runner.weights]  # the MLP kernels are the step's weights, one of each per layer
    assert sizes.count(2 * 32 * 72) == sizes.count(32 * 72) == 3


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the one-row forms are XLA:CPU's (layers.project)")
def test_one_row_step_reads_the_attention_kernels_in_place():
    """A batch-1 decode step reads each layer's attention kernels where they are stacked. q, k and v (32 and 16
    outputs, multiples of 16) go to the batch-invariant projection kernel, which takes the whole stack and the layer
    index (`StackedSelect`: a slice handed to a custom call is a copy). o (40 outputs, which the kernel does not take)
    is sliced inside the one-row dot that XLA:CPU fuses: copied, then Eigen's GEMV, the projections ran at ~19 GB/s;
    fused, split over the cores: ~33. A hidden size of 40 gives the kernels element counts nothing else has."""
    if project_cpu.library_k_block(16) is None:  # q's and k's counts: neither a multiple of 64
        pytest.skip("this machine's library sums 16 or 32 outputs in an order the kernel lacks: one row takes its dot")
    eng = _engine("scan", num_pages=41, hidden_size=40, intermediate_size=72)
    layers = eng.cfg.num_layers
    hlo = _compiled_step(eng, True, 1, 1)
    calls = [ln for ln in hlo.splitlines() if 'custom_call_target="jaxinfer_project' in ln]
    for stack in (f"f32[{layers},32,40]", f"f32[{layers},16,40]"):  # q; k and v
        assert sum(stack in ln for ln in calls) == (1 if "32," in stack else 2), (stack, calls)
    sliced = [c for c in hlo.split("\n\n") if _kernel_slices(c, {40 * 4 * 8})]
    assert len(sliced) == 1, f"expected o's slice in a fusion, found {len(sliced)}"
    assert re.search(r" dot\(", sliced[0]), (
        "o's kernel is sliced out of its stack apart from its dot:\n" + sliced[0][:600]
    )
    # The fused dot reads its vector through the operand's shape: the attention output f32[1, H, Dh] ran the o
    # projection 3x slower than f32[1, H*Dh] (kernels_pallas.ragged_cpu declares its result flat).
    assert "f32[1,4,8]{2,1,0} parameter" not in sliced[0], (
        "the o projection reads heads x head_dim:\n" + sliced[0][:600]
    )
