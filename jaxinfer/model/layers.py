"""The shared layers every family is built from, as Flax NNX modules, and the pure functions behind them.

Every parameter names its logical axes in Flax sharding metadata (`out_sharding`); `jaxinfer.sharding` maps those
names to mesh axes with a rules table. Parameters are created with `eager_sharding=False`: the module only names
axes, placement happens once, when the weights are loaded onto a mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import RopeConfig, rope_inv_freq
from kernels_pallas import project_cpu

Initializer = Callable[..., jax.Array]


_ABSTRACT = contextvars.ContextVar("jaxinfer_abstract_params", default=False)


@contextlib.contextmanager
def abstract_params() -> Iterator[None]:
    """Modules built inside hold shape-only parameters (`jax.ShapeDtypeStruct`, as `nnx.eval_shape` gives) and run
    no initializer. `nnx.eval_shape` traced every initializer instead: 0.6 s for SmolLM2's 273 parameters, on every
    start (this builds the same graphdef and state in a tenth of that; tested)."""
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def param(rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], axes: tuple[str, ...], dtype) -> nnx.Param:
    """A parameter of `shape` whose logical axis names travel with it as Flax sharding metadata."""
    assert len(axes) == len(shape), (shape, axes)
    dtype = jnp.dtype(dtype)
    value = jax.ShapeDtypeStruct(shape, dtype) if _ABSTRACT.get() else init(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def pairwise_sum(x: jax.Array) -> jax.Array:
    """x f[..., D] summed over its last axis in one fixed order whatever the leading axes hold, -> f[..., 1]: padded
    with zeros to a power of two, then halves added until one is left. XLA:CPU's own reduction of a row changed with
    the rows around it in a step (another fusion, another vector order): a row's norm, and so its tokens, depended
    on its batch. A tree of elementwise adds leaves XLA no order to choose."""
    width = x.shape[-1]
    padded = 1 << max(width - 1, 0).bit_length()
    if padded != width:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - width)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32 (as HF does), scaled by (offset + w); Gemma stores w with offset 1. On XLA:CPU the
    mean of squares is a `pairwise_sum`, so that a row's norm does not depend on the rows beside it."""
    xf = x.astype(jnp.float32)
    if target_platform() == "cpu":
        mean = pairwise_sum(xf * xf) * (1.0 / xf.shape[-1])
    else:
        mean = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(mean + eps)
    return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, scaled by (offset + scale). The scale starts at the identity (1 - offset)."""

    def __init__(self, dim: int, eps: float, offset: float, axis: str, *, dtype, rngs: nnx.Rngs):
        self.eps, self.offset = eps, offset
        self.scale = param(rngs, nnx.initializers.constant(1.0 - offset), (dim,), (axis,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


TPU_LANES = 128


def target_platform() -> str:
    """The platform a step traced now is compiled for: the default device's (`jax.default_device`, which also the
    ahead-of-time compiles for TPU topologies set: tests/aot), else the default backend."""
    device = getattr(jax.config, "jax_default_device", None)
    if isinstance(device, jax.Device):
        return device.platform
    return device if isinstance(device, str) else jax.default_backend()


def lookup(
    table: jax.Array,  # f[V, D]
    tokens: jax.Array,  # i32[...]
    one_hot: bool = False,
) -> jax.Array:  # f[..., D]
    """Rows of `table`. `one_hot`: as a one-hot matmul, which reads the table where it lies. On a TPU a table whose
    width is not a whole number of 128 lanes (SmolLM2: 576) gets the least-padded default layout, vocab minor, and
    a row gather made XLA copy all of it into row-major order every step (56 MB for SmolLM2; tests/aot). Exact: each
    output is one product with 1.0, accumulated in f32 at full precision."""
    if not one_hot:
        return jnp.take(table, tokens, axis=0)
    hot = tokens[..., None] == jnp.arange(table.shape[0], dtype=tokens.dtype)
    out = jnp.matmul(hot.astype(table.dtype), table, precision=jax.lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)  # fmt: skip
    return out.astype(table.dtype)


class Embed(nnx.Module):
    """Token embedding f[V, D]; `scale` multiplies by sqrt(D) (Gemma); `attend` gives tied logits."""

    def __init__(self, vocab: int, dim: int, scale: bool, *, dtype, std: float = 0.02, rngs: nnx.Rngs):
        self.scale = scale
        self.embedding = param(rngs, nnx.initializers.normal(std), (vocab, dim), ("vocab", "embed"), dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.embedding[...]
        x = lookup(table, tokens, one_hot=target_platform() == "tpu" and table.shape[1] % TPU_LANES != 0)
        if self.scale:
            # HF Gemma casts the normalizer to the activation dtype before multiplying.
            x = x * jnp.asarray(x.shape[-1] ** 0.5, dtype=x.dtype)
        return x


# XLA:CPU puts the weight on the left of the dot for 9..128 rows and a result of at most 8 MiB (`project`): the LM
# head's 6 MB at 32 rows gained 1.36x, its 25 MB at 128 rows cost 7.8 ms to transpose.
WEIGHT_LEFT_MAX_ROWS = 128
WEIGHT_LEFT_MAX_OUT_BYTES = 8 << 20
# The weight-left form sums in x @ W^T's order only for whole multiples of this many rows (benchmarks/README.md).
WEIGHT_LEFT_ROWS_MULTIPLE = 16
# Up to this many rows, float32 projections on CPU take kernels_pallas.project_cpu (at most its max_rows(): 8, or 32
# on AVX-512). 0: XLA's own forms, which are not batch-invariant at one row or eight (`ab_step --variants
# layers.PROJECTION_KERNEL_ROWS=0`).
PROJECTION_KERNEL_ROWS = 32
# Where the kernel takes 32 rows (AVX-512), 33 up to this many rows with a result of at most
# WEIGHT_LEFT_MAX_OUT_BYTES go through it in chunks of 32 rows (one call). On znver4 a decode step of 40-128 rows ran
# 1.08-1.18x faster that way than with YNNPACK's x @ W^T; 256 and 512 rows ran 0.8-0.9x (the library at its peak
# there), and so did the LM head's 25 MB at 128 rows (benchmarks/README.md).
PROJECTION_CHUNK_ROWS = 128
# The same where the kernel takes 8 rows (AVX2): 8 is none. 9-128 rows in chunks of 8 against the weight-left form was
# not measured on an AVX2 host (`ab_step --variants default,layers.NARROW_CHUNK_ROWS=128` there).
NARROW_CHUNK_ROWS = 8

_SHARDED = contextvars.ContextVar("jaxinfer_sharded_step", default=False)


@contextlib.contextmanager
def sharded_step() -> Iterator[None]:
    """Projections traced inside take XLA's dots only, none of the CPU kernel's custom calls: those have no sharding
    rule, and over a mesh GSPMD would gather every kernel onto every device to run them."""
    token = _SHARDED.set(True)
    try:
        yield
    finally:
        _SHARDED.reset(token)


def project(x: jax.Array, w: jax.Array | StackedSelect, num_in: int, out_dtype=None, *,
            in_branch: bool = False) -> jax.Array:  # fmt: skip
    """x f[..., *in] times a kernel stored output-major, w f[*out, *in] (PyTorch's Linear layout), -> f[..., *out].

    On XLA:CPU a row's result does not depend on how many rows share the product (batch invariance: a seeded
    request samples the same tokens alone and batched; tests/engine/test_llm.py, tests/model/test_project.py). XLA's
    library dot (YNNPACK) sums every output of x @ W^T in one order for 2 rows and more, given an output count that is a
    multiple of 16, and so do the forms below (benchmarks/README.md, "batch-invariant projections"):
    - 1-8 rows of float32 (1-32 on AVX-512): `kernels_pallas.project_cpu`, a kernel that sums in that order, at
      the pace the weights stream from memory (XLA's one-row forms, a fused loop and Eigen's GEMV, sum in other
      orders; YNNPACK itself runs one row 2x slower than them; on znver4 a decode step of 12-32 rows took 1.3-1.8x
      as long with the library's dots as with the kernel); on AVX-512 also 33-128 rows with a small result, in
      chunks of 32 rows in one call (`PROJECTION_CHUNK_ROWS`; AVX2's 8-row chunks, `NARROW_CHUNK_ROWS`, are off);
    - one row the kernel does not take (another dtype, an output count not a multiple of 16, no numba, or a
      sharded step), as before the kernel, not batch-invariant: the vector times W's transpose, which XLA:CPU fuses
      with the vector's producers (the norm) and with the slice of a stacked kernel into one loop over W's rows,
      split across the cores (the memory's pace). Two exceptions take Eigen's GEMV (W @ x): inside a conditional's
      branch (`in_branch`, `LayerSelect`), where XLA:CPU splits no loop (7.4 GB/s), and a kernel with several input
      axes, whose flattening costs the fused loop a gather per element (9 GB/s);
    - 2-128 rows with a small result: W @ x^T with the result transposed, the rows padded to a multiple of 16 (an
      8-row remainder takes another of YNNPACK's kernels, which sums in another order). YNNPACK ran this form
      1.1-1.5x faster than x @ W^T at 8-64 rows. The optimization barrier keeps XLA from folding the transpose into
      the dot (it would hand the dot both operands transposed, a slower path);
    - a prompt's many rows, a large result (the LM head's at 128 rows: 25 MB costs more to transpose than it
      gains), or anything else: x @ W^T, as on accelerators.
    Those orders were measured on the AVX2 EPYC. Each process checks them once (`project_cpu.library_k_block`,
    `weight_left_sums_as_library`). A 2-core AVX-512 EPYC (znver4) sums in blocks of 512 inputs, which the kernel
    takes as an operand, for output counts that are multiples of 64, and otherwise in orders the kernel lacks: there
    the kernel's rows take the library's x @ W^T (one row padded to two, 2x slower than the kernel). Its weight-left
    form sums otherwise at 16 rows, so it is not used there. Either way a row's bits do not depend on its batch."""
    stack = w if isinstance(w, StackedSelect) else None
    shape = stack.stack.shape[1:] if stack is not None else w.shape
    lead, num_out = x.shape[: x.ndim - num_in], len(shape) - num_in
    rows, k, n = math.prod(lead), math.prod(x.shape[x.ndim - num_in :]), math.prod(shape[:num_out])
    x2 = x.reshape(rows, k)
    contract = (((1,), (1,)), ((), ()))
    out_bytes = rows * n * jnp.dtype(out_dtype or x.dtype).itemsize
    cpu = target_platform() == "cpu" and not _SHARDED.get()
    kernel = stack.stack.reshape(-1, n, k) if stack is not None else w.reshape(n, k)
    invariant_n = n % WEIGHT_LEFT_ROWS_MULTIPLE == 0
    wide = min(PROJECTION_KERNEL_ROWS, project_cpu.max_rows()) if cpu and invariant_n else 0  # the kernel's rows
    kernel_rows = wide > 0 and rows <= wide
    chunk_rows = PROJECTION_CHUNK_ROWS if wide == project_cpu.ROW_LANES[-1] else NARROW_CHUNK_ROWS
    chunks = wide > 0 and rows <= chunk_rows and out_bytes <= WEIGHT_LEFT_MAX_OUT_BYTES
    if (kernel_rows or chunks) and project_cpu.supported(x2, kernel):
        y = project_cpu.project_rows(x2, kernel, stack.index if stack is not None else None)
        return y.astype(out_dtype or x.dtype).reshape(*lead, *shape[:num_out])
    # The kernel's rows where the library sums in an order the kernel lacks (project_cpu.library_k_block): the library's
    # own x @ W^T, one row padded to two, sums every row alike.
    by_library = (kernel_rows and x2.dtype == kernel.dtype == jnp.float32 and project_cpu.unavailable() is None
                  and project_cpu.library_k_block(n) is None)  # fmt: skip
    if stack is not None:  # the other forms read the layer's slice
        w = jax.lax.dynamic_index_in_dim(stack.stack, stack.index, keepdims=False)
    w2 = w.reshape(n, k)
    if by_library:
        xp = jnp.pad(x2, ((0, 1), (0, 0))) if rows == 1 else x2
        y = jax.lax.dot_general(xp, w2, contract, preferred_element_type=out_dtype)[:rows]
    elif cpu and rows == 1 and not in_branch and num_in == 1:
        # Spelled with the transpose: XLA:CPU rewrites a dot over W's own layout into a GEMV library call first.
        y = jnp.matmul(x2, w2.T, preferred_element_type=out_dtype)
    elif cpu and rows == 1:
        y = jnp.matmul(w2, x2[0], preferred_element_type=out_dtype)[None]
    elif (cpu and 1 < rows <= WEIGHT_LEFT_MAX_ROWS and out_bytes <= WEIGHT_LEFT_MAX_OUT_BYTES
          and weight_left_sums_as_library()):  # fmt: skip
        pad = -rows % WEIGHT_LEFT_ROWS_MULTIPLE
        xp = jnp.pad(x2, ((0, pad), (0, 0))) if pad else x2
        y = jax.lax.optimization_barrier(jax.lax.dot_general(w2, xp, contract, preferred_element_type=out_dtype))
        y = y.T[:rows]
    else:
        y = jax.lax.dot_general(x2, w2, contract, preferred_element_type=out_dtype)
    return y.reshape(*lead, *shape[:num_out])


@functools.cache
def weight_left_sums_as_library() -> bool:
    """Whether W @ x^T over whole multiples of 16 rows sums each output as x @ W^T does, bit for bit, on this
    machine, probed at SmolLM2's square projection for 16 and 128 rows. It did on the AVX2 EPYC where `project`'s
    forms were measured; on a 2-core AVX-512 EPYC (znver4) 16 and 32 rows took other kernels of YNNPACK, and there
    `project` runs x @ W^T. Runs once per process, in one compiled program (eagerly, even inside a trace); on CPU."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 576), dtype=np.float32)
    w = rng.standard_normal((576, 576), dtype=np.float32)

    def same(x: jax.Array, w: jax.Array) -> jax.Array:
        want = project_cpu.library_dot(x, w)
        weight_left = [jax.lax.optimization_barrier(project_cpu.library_dot(w, x[:rows])).T for rows in (16, 128)]
        return project_cpu.same_bits(weight_left[0], want[:16]) & project_cpu.same_bits(weight_left[1], want)

    return bool(project_cpu.run_probe(same, x, w))


def probe_cpu_forms() -> None:
    """Runs `project`'s checks of this machine's library orders now (3 small programs, once per process), so that a
    step's trace compiles nothing but the step. The engine calls it on CPU before it traces or loads a step."""
    project_cpu.library_k_block(64)
    project_cpu.library_k_block(16)
    weight_left_sums_as_library()


class LayerKernel:
    """One layer's kernel chosen inside a loop over layers by a traced index, which `Linear` takes in place of an
    array (`jaxinfer.model.scanned` builds them) and projects with (`project`)."""

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError(f"a {type(self).__name__} is read whole ([...]) by Linear")
        return self  # what `Param[...]` hands to Linear

    def project(self, x: jax.Array, num_in: int) -> jax.Array:
        raise NotImplementedError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedSelect(LayerKernel):
    """One layer's kernel inside a loop over layers, as the whole stack f[L, *shape] and the traced layer index: the
    CPU projection kernel reads the layer in place, where XLA would copy the slice out before a custom call reads it
    (every attention projection of every layer, each step); the other forms slice it (`project`)."""

    stack: jax.Array
    index: jax.Array  # i32[]

    def project(self, x: jax.Array, num_in: int) -> jax.Array:
        return project(x, self, num_in)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSelect(LayerKernel):
    """One layer's kernel inside a loop over layers: per-layer arrays and the traced layer index.

    A loop over stacked weights slices each layer's kernel out of the stack, and XLA:CPU copies a dynamic slice
    before a matmul reads it (unrolled layers ran a batch-1 decode step 1.16x faster, benchmarks/README.md). A
    `lax.switch` over the layers' own arrays runs each matmul on the parameter buffer itself."""

    arrays: tuple[jax.Array, ...]
    index: jax.Array  # i32[]

    def project(self, x: jax.Array, num_in: int) -> jax.Array:
        branches = [lambda x, w=w: project(x, w, num_in, in_branch=True) for w in self.arrays]
        return jax.lax.switch(self.index, branches, x)


class Linear(nnx.Module):
    """A projection whose kernel is stored output-major, f[*out, *in] (heads kept as their own axes), with an
    optional bias over its output axes."""

    def __init__(
        self,
        out_shape: tuple[int, ...],
        in_shape: tuple[int, ...],
        axes: tuple[str, ...],
        *,
        bias: bool = False,
        dtype,
        std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        """axes: logical names of the kernel's axes, output axes first."""
        self.num_in = len(in_shape)
        shape = (*out_shape, *in_shape)
        self.kernel = param(rngs, nnx.initializers.normal(std), shape, axes, dtype)
        out_axes = axes[: len(out_shape)]
        self.bias = param(rngs, nnx.initializers.normal(std), out_shape, out_axes, dtype) if bias else None

    @classmethod
    def of(cls, kernel: jax.Array, num_in: int, axes: tuple[str, ...], bias: jax.Array | None = None) -> Linear:
        """A Linear holding these arrays: kernel f[*out, *in], bias f[*out] (built abstract, nothing drawn)."""
        out_shape, in_shape = kernel.shape[: kernel.ndim - num_in], kernel.shape[kernel.ndim - num_in :]
        lin = nnx.eval_shape(lambda: cls(out_shape, in_shape, axes, bias=bias is not None, dtype=kernel.dtype,
                                         rngs=nnx.Rngs(0)))  # fmt: skip
        lin.kernel.set_value(kernel)
        if bias is not None:
            lin.bias.set_value(bias)
        return lin

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel[...]
        y = w.project(x, self.num_in) if isinstance(w, LayerKernel) else project(x, w, self.num_in)
        return y if self.bias is None else y + self.bias[...]


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.gelu(x, approximate=False)


class GatedMLP(nnx.Module):
    """SwiGLU / GeGLU: down(act(gate(x)) * up(x)). x f[B, T, D].

    `fuse_projections` puts gate and up into one kernel f[2, F, D] (`gate_up`): one matmul instead of two, the
    layout the CPU engine's scanned layers run (`jaxinfer.model.scanned`). Under tensor parallelism the pair axis
    stays whole and F splits, so every shard holds its gate rows beside their up rows."""

    def __init__(self, dim: int, hidden: int, act: str, use_bias: bool, *, dtype, std: float, rngs: nnx.Rngs):
        self.act = act
        kw = dict(dtype=dtype, std=std, rngs=rngs)
        self.gate = Linear((hidden,), (dim,), ("mlp", "embed"), bias=use_bias, **kw)
        self.up = Linear((hidden,), (dim,), ("mlp", "embed"), bias=use_bias, **kw)
        self.down = Linear((dim,), (hidden,), ("embed", "mlp"), bias=use_bias, **kw)
        self.gate_up: Linear | None = nnx.data(None)  # set by fuse_projections

    def fuse_projections(self) -> None:
        """gate and up -> gate_up (copies); `unfuse_projections` is the inverse."""
        kernel = jnp.stack([self.gate.kernel[...], self.up.kernel[...]])
        bias = None if self.gate.bias is None else jnp.stack([self.gate.bias[...], self.up.bias[...]])
        self.gate_up = Linear.of(kernel, 1, ("fused", "mlp", "embed"), bias)
        self.gate = self.up = None

    def unfuse_projections(self) -> None:
        kernel, bias = self.gate_up.kernel[...], self.gate_up.bias
        self.gate, self.up = (Linear.of(kernel[i], 1, ("mlp", "embed"), None if bias is None else bias[...][i])
                              for i in range(2))  # fmt: skip
        self.gate_up = None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_up is not None:
            y = self.gate_up(x)  # f[B, T, 2, F]
            return self.down(activation(self.act, y[..., 0, :]) * y[..., 1, :])
        return self.down(activation(self.act, self.gate(x)) * self.up(x))


def rope_tables(rope: RopeConfig, head_dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[..., head_dim] for integer positions i32[...] (rotate-half layout, as HF)."""
    inv_freq, scale = rope_inv_freq(rope, head_dim)
    inv = jnp.asarray(np.asarray(inv_freq, dtype=np.float32))
    angles = positions.astype(jnp.float32)[..., None] * inv  # f32[..., head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x f[B, T, H, D]; cos/sin f32[B, T, D]. Rotation in f32, result in x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)
