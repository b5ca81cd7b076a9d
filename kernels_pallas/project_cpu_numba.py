"""The numba side of kernels_pallas/project_cpu.py: a float32 projection of any number of rows whose every output is
summed in the order XLA:CPU's library dot (YNNPACK) sums it for any number of rows from 2 up, and its XLA FFI
handler.

That order, measured on jax 0.10.2 for x f32[M, K] times a kernel stored f32[N, K], N a multiple of 16
(tests/kernels/test_project_cpu.py holds the kernel to it): each output is one chain of fused multiply-adds over k in
order, from zero, in blocks of inputs whose chains are then added in order. The block is each call's operand: 2048
on the AVX2 EPYC, 512 on an AVX-512 one (znver4) for N a multiple of 64 (kernels_pallas/project_cpu.py probes
which). XLA:CPU's one-row forms (a fused loop, Eigen's GEMV) sum in other orders, and YNNPACK itself, handed a
one-row product, ran it 2x slower than the fused loop (it repacks the kernel every call).

Two kernels, one chain of vector FMAs per output either way:
- 2 rows and more (`_block_function`): the rows in the lanes of a vector of 8, 16 or 32 (padded; more rows in
  chunks of the widest, each chunk's results transposed in registers into row-major rows), eight outputs at
  a time: per kernel element one broadcast load and one FMA per vector register;
- one row (`_row1_function`): eight outputs in the lanes, each 8 x 8 tile of kernel rows transposed in registers;
  two such chains over 16 rows side by side on AVX-512 hosts.
Both stream each kernel row from memory once, a block of rows at a time, and fetch the next block ahead in memory
order. XLA's thread pool runs them on every core (`_run_function`). Measured on the 2-core AVX2 EPYC: one row ran
at 0.85-0.87x the pace of XLA's fused loop on SmolLM2's projections (the fused loop reads one row at a time; a
chain needs eight rows side by side), eight rows 1.2-1.3x faster than YNNPACK's weight-left form. On the AVX-512
znver4 EPYC the one-row step runs at XLA's pace, and steps of 12-32 rows 1.3-1.8x faster than with YNNPACK's dots
(benchmarks/README.md).

Imported on first use only; the handler is compiled once per machine into numba's cache (`__pycache__` beside this
file, or NUMBA_CACHE_DIR), about 7 s on 2 cores, then loads in a fraction of a second.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core.extending import intrinsic

from kernels_pallas.numba_ffi import compiles_for_avx512, jit_helpers, start_threads
from kernels_pallas.project_cpu import ROW_LANES  # (a change there: clear numba's cache)
from kernels_pallas.ragged_cpu_numba import _IRLoop  # the IR loop emitter (a change there: clear numba's cache)

start_threads()  # before the cached parallel code below loads
_h = jit_helpers()
answer_non_execute, buffer, data, dim, null = _h.answer_non_execute, _h.buffer, _h.data, _h.dim, _h.null

LANES = 8  # float32 lanes of an AVX2 vector: the one-row kernel's outputs per chain
# 2 and more rows: outputs per pass over k, eight independent FMA chains (four ran at the FMA's latency), the rows in
# the lanes of a vector of one of `ROW_LANES` widths (kernels_pallas/project_cpu.py picks it).
_OUTPUTS = 8
_FN = "jaxinfer_project_rows"


# The settings below were measured per CPU class (benchmarks/README.md): the 2-core AVX2 EPYC, and the AVX-512
# znver4 EPYC whose settings AVX-512 hosts take.
_AVX512 = compiles_for_avx512()
# The cache level the next block of kernel rows is fetched into (llvm.prefetch's locality: 3 is L1, 1 is L2 on these
# parts). Fetched into L1, a block of 8 or 16 rows of a 576-wide kernel (18 or 36 KB) evicted the block being read
# from the 32 KB L1 on znver4: into L2, 2-8 rows took 0.54x XLA's time against 0.70x, and two one-row chains read
# 33 GB/s on one core against 12.
_LOCALITY = 1 if _AVX512 else 3
# One row: chains of eight outputs (lanes) per pass. A chain runs at the FMA's latency, 8 FMAs per 8 x 8 tile (~28
# GB/s on one core with the kernel in cache on znver4), so AVX-512 hosts, with 32 vector registers, run two over 16
# rows side by side (~48 GB/s in cache, 33 from memory against 21; the one-row step 0.97x XLA's forms against
# 1.20x). On AVX2 (16 registers) one chain measured fastest (two from memory: 12 GB/s against 16).
_ROW1_CHAINS = 2 if _AVX512 else 1
_ROW1_OUTPUTS = LANES * _ROW1_CHAINS
_ROW1_FN = "jaxinfer_project_row1"


def _block_function(module, lanes: int):
    """Emits `void block(xT, w, out, k, k0, k1, first, stride)` into the module once per lane count: for the
    `_OUTPUTS` kernel rows at w (f32[_OUTPUTS, k], row-major), the sums over inputs k0..k1-1 of w[o, i] *
    xT[i, :lanes] (xT: input i's `lanes` rows side by side, `stride` floats from input i - 1's), one FMA chain per
    output and row from zero, stored to out (f32[_OUTPUTS, lanes]) when `first`, else added to it. A vector of 16
    or 32 lanes is one or two AVX-512 registers (LLVM splits it)."""
    name = f"{_FN}_{lanes}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vec, veci, fp = ir.VectorType(f32, lanes), ir.VectorType(i32, lanes), f32.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [fp, fp, fp, i64, i64, i64, i64, i64]), name)
    fn.linkage = "internal"
    xt, w, out, k, k0, k1, first, stride = fn.args
    fma = module.declare_intrinsic(f"llvm.fma.v{lanes}f32", fnty=ir.FunctionType(vec, [vec, vec, vec]))
    i8p = ir.IntType(8).as_pointer()
    prefetch = module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    entry = fn.append_basic_block("entry")
    loop, tail = fn.append_basic_block("k"), fn.append_basic_block("store")
    b = ir.IRBuilder(entry)
    zero = ir.Constant(vec, [0.0] * lanes)
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(k0, entry)
    accs = [b.phi(vec) for _ in range(_OUTPUTS)]
    for a in accs:
        a.add_incoming(zero, entry)
    x = b.load(b.bitcast(b.gep(xt, [b.mul(i, stride)]), vec.as_pointer()), align=4)
    # Every 16 inputs, fetch the next 512 bytes of the next outputs' kernel rows, in memory order: by the end of a
    # pass the next block is in cache. Eight rows read side by side, each a line at a time, outran the hardware's
    # prefetchers (16 GB/s, against 27 for XLA's loop over one row at a time).
    at_line = b.icmp_signed("==", b.and_(i, ir.Constant(i64, 15)), ir.Constant(i64, 0))
    with b.if_then(at_line):
        ahead = b.add(b.mul(k, ir.Constant(i64, _OUTPUTS)), b.mul(i, ir.Constant(i64, _OUTPUTS)))
        for line in range(_OUTPUTS):
            at = b.gep(w, [b.add(ahead, ir.Constant(i64, 16 * line))])
            locality = ir.Constant(i32, _LOCALITY)
            b.call(prefetch, [b.bitcast(at, i8p), ir.Constant(i32, 0), locality, ir.Constant(i32, 1)])
    new = []
    for o, a in enumerate(accs):
        s = b.load(b.gep(w, [b.add(b.mul(ir.Constant(i64, o), k), i)]))
        s = b.insert_element(ir.Constant(vec, ir.Undefined), s, ir.Constant(i32, 0))
        s = b.shuffle_vector(s, s, ir.Constant(veci, [0] * lanes))
        new.append(b.call(fma, [s, x, a]))  # w * x + acc, rounded once, as YNNPACK's kernel
    nxt = b.add(i, ir.Constant(i64, 1))
    i.add_incoming(nxt, b.block)
    for a, n in zip(accs, new, strict=True):
        a.add_incoming(n, b.block)
    b.cbranch(b.icmp_signed("<", nxt, k1), loop, tail)
    b.position_at_end(tail)
    is_first = b.icmp_signed("!=", first, ir.Constant(i64, 0))
    for o, n in enumerate(new):
        dst = b.bitcast(b.gep(out, [ir.Constant(i64, o * lanes)]), vec.as_pointer())
        b.store(b.select(is_first, n, b.fadd(b.load(dst, align=4), n)), dst, align=4)
    b.ret_void()
    return fn


def _transpose8(b, rows):
    """8 vectors of 8 floats (vector j: row j) -> 8 vectors (vector t: element t of rows 0-7), in shuffles."""
    v8i = ir.VectorType(ir.IntType(32), LANES)

    def shuf(x, y, idx):
        return b.shuffle_vector(x, y, ir.Constant(v8i, idx))

    t = []
    for j in range(0, 8, 2):
        t += [shuf(rows[j], rows[j + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
              shuf(rows[j], rows[j + 1], [2, 10, 3, 11, 6, 14, 7, 15])]  # fmt: skip
    u = []
    for j in (0, 4):
        u += [shuf(t[j], t[j + 2], [0, 1, 8, 9, 4, 5, 12, 13]), shuf(t[j], t[j + 2], [2, 3, 10, 11, 6, 7, 14, 15]),
              shuf(t[j + 1], t[j + 3], [0, 1, 8, 9, 4, 5, 12, 13]),
              shuf(t[j + 1], t[j + 3], [2, 3, 10, 11, 6, 7, 14, 15])]  # fmt: skip
    lo, hi = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    return [shuf(u[j], u[j + 4], lo) for j in range(4)] + [shuf(u[j], u[j + 4], hi) for j in range(4)]


def _row1_function(module):
    """Emits `void row1(x, w, out, k, k0, k1, first)` into the module once: for the `_ROW1_OUTPUTS` kernel rows at w
    (f32[_ROW1_OUTPUTS, k], row-major), the sums over inputs k0..k1-1 of w[o, i] * x[i] (x f32[k]), one FMA chain per
    output from zero, outputs in lanes, stored to out (f32[_ROW1_OUTPUTS]) when `first`, else added to it.

    One row fills one lane of the rows-in-lanes kernel: a broadcast load and an FMA per kernel element. Here each
    kernel row is read eight inputs at a time and every 8 x 8 tile is transposed in registers, so that a lane holds
    one output and the FMAs over k go in order, eight outputs a vector; `_ROW1_CHAINS` vectors' chains
    interleaved."""
    fn = module.globals.get(_ROW1_FN)
    if fn is not None:
        return fn
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    v8, v8i, fp = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES), f32.as_pointer()
    i8p = ir.IntType(8).as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [fp, fp, fp, i64, i64, i64, i64]), _ROW1_FN)
    fn.linkage = "internal"
    x, w, out, k, k0, k1, first = fn.args
    fma = module.declare_intrinsic("llvm.fma.v8f32", fnty=ir.FunctionType(v8, [v8, v8, v8]))
    prefetch = module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def c64(v):
        return ir.Constant(i64, v)

    def shuf(a, c, idx):
        return b.shuffle_vector(a, c, ir.Constant(v8i, idx))

    def splat(ptr):
        v = b.insert_element(ir.Constant(v8, ir.Undefined), b.load(ptr), ir.Constant(i32, 0))
        return shuf(v, v, [0] * LANES)

    def row_ptr(o, i):  # &w[o, i]
        return b.gep(w, [b.add(b.mul(c64(o), k), i)])

    chains = range(_ROW1_CHAINS)
    zero = ir.Constant(v8, [0.0] * LANES)
    whole = b.add(k0, b.mul(b.sdiv(b.sub(k1, k0), c64(8)), c64(8)))  # k0 + the whole tiles' inputs
    entry = b.block
    loop, rest_bb = fn.append_basic_block("tiles"), fn.append_basic_block("rest")
    b.cbranch(b.icmp_signed("<", k0, whole), loop, rest_bb)
    b.position_at_end(loop)
    i, accs = b.phi(i64), [b.phi(v8) for _ in chains]
    i.add_incoming(k0, entry)
    for a in accs:
        a.add_incoming(zero, entry)
    # Every other tile (16 inputs: a 64-byte line of each row), fetch the next outputs' kernel rows in memory order:
    # by the end of a pass the next block is in cache (rows read side by side outran the hardware's prefetchers).
    with b.if_then(b.icmp_signed("==", b.and_(i, c64(15)), c64(0))):
        ahead = b.add(b.mul(k, c64(_ROW1_OUTPUTS)), b.mul(i, c64(_ROW1_OUTPUTS)))
        for line in range(_ROW1_OUTPUTS):
            at = b.gep(w, [b.add(ahead, c64(16 * line))])
            locality = ir.Constant(i32, _LOCALITY)
            b.call(prefetch, [b.bitcast(at, i8p), ir.Constant(i32, 0), locality, ir.Constant(i32, 1)])
    tiles = [_transpose8(b, [b.load(b.bitcast(row_ptr(LANES * c + j, i), v8.as_pointer()), align=4)
                             for j in range(LANES)]) for c in chains]  # fmt: skip
    new = list(accs)
    for t in range(8):  # the tile's inputs in order; the chains interleaved, each at the FMA's latency
        xt = splat(b.gep(x, [b.add(i, c64(t))]))
        new = [b.call(fma, [tiles[c][t], xt, new[c]]) for c in chains]
    nxt = b.add(i, c64(8))
    i.add_incoming(nxt, b.block)
    for a, n in zip(accs, new, strict=True):
        a.add_incoming(n, b.block)
    loop_end = b.block
    b.cbranch(b.icmp_signed("<", nxt, whole), loop, rest_bb)
    b.position_at_end(rest_bb)  # the last k1 - whole inputs, one at a time (lanes gathered)
    tiled = [b.phi(v8) for _ in chains]
    for c in chains:
        tiled[c].add_incoming(zero, entry)
        tiled[c].add_incoming(new[c], loop_end)
    rest_entry = b.block
    one, end_bb = fn.append_basic_block("one"), fn.append_basic_block("store")
    b.cbranch(b.icmp_signed("<", whole, k1), one, end_bb)
    b.position_at_end(one)
    j, cur = b.phi(i64), [b.phi(v8) for _ in chains]
    j.add_incoming(whole, rest_entry)
    upd = []
    for c in chains:
        cur[c].add_incoming(tiled[c], rest_entry)
        col = ir.Constant(v8, ir.Undefined)
        for lane in range(LANES):
            col = b.insert_element(col, b.load(row_ptr(LANES * c + lane, j)), ir.Constant(i32, lane))
        upd.append(b.call(fma, [col, splat(b.gep(x, [j])), cur[c]]))
    nj = b.add(j, c64(1))
    j.add_incoming(nj, b.block)
    for c in chains:
        cur[c].add_incoming(upd[c], b.block)
    b.cbranch(b.icmp_signed("<", nj, k1), one, end_bb)
    b.position_at_end(end_bb)
    finals = [b.phi(v8) for _ in chains]
    is_first = b.icmp_signed("!=", first, c64(0))
    for c, final in enumerate(finals):
        final.add_incoming(tiled[c], rest_entry)
        final.add_incoming(upd[c], one)
        dst = b.bitcast(b.gep(out, [c64(LANES * c)]), v8.as_pointer())
        b.store(b.select(is_first, final, b.fadd(b.load(dst, align=4), final)), dst, align=4)
    b.ret_void()
    return fn


def _block_intrinsic(lanes: int):
    """An intrinsic that calls `_row1_function` (one row: `stride` unused) or `_block_function` (emitted into the
    caller's module once); the arrays as addresses."""

    @intrinsic
    def block(typingctx, x, w, out, k, k0, k1, first, stride):
        sig = types.void(types.uintp, types.uintp, types.uintp, *([types.int64] * 5))

        def codegen(context, builder, signature, args):
            fn = _row1_function(builder.module) if lanes == 1 else _block_function(builder.module, lanes)
            ptr = fn.function_type.args[0]
            builder.call(fn, [builder.inttoptr(a, ptr) for a in args[:3]] + list(args[3 : len(fn.args)]))
            return context.get_dummy_value()

        return sig, codegen

    return block


# The shared state of one call, i64 words: the next claim, the claims done, the references held (the caller and
# each task), the number of claims, xT, w, out (addresses), K, the number of blocks of `_OUTPUTS` outputs, the
# block of inputs whose chains are summed apart; then, for rows in lanes, xT's stride (floats from one input's rows
# to the next's), the chunks of `lanes` rows, the rows, and N (out's row length).
_NEXT, _DONE, _REFS, _CLAIMS, _XT, _W, _OUT, _K, _BLOCKS, _KB, _STRIDE, _CHUNKS, _ROWS, _N = range(14)
_WORDS = _N + 1
# Blocks of outputs per claim (32 outputs: 74 KB of a 576-wide kernel): small enough that a projection of a few
# hundred outputs still spreads over two threads.
_CLAIM = 4
# One row on AVX-512 hosts: 16 blocks (256 outputs). A thread's first block of a claim arrives unfetched (its
# prefetch ran on the other core, or not at all), and the one-row step measured 0.97x XLA's forms against 1.03x
# with claims of 4.
_ROW1_CLAIM = 16 if _AVX512 else _CLAIM
# XLA_FFI_Api words (jaxlib's include/xla/ffi/api/c_api.h): struct_size, extension_start, the 3-word api_version and
# internal_api come first, then the functions in order: Error_Destroy is word 8, ThreadPool_Schedule 17,
# ThreadPool_NumThreads 18. An older API (a smaller struct) has no thread pool: the caller works alone.
_API_ERROR_DESTROY, _API_SCHEDULE, _API_NUM_THREADS = 8, 17, 18


def _run_function(module, lanes: int):  # noqa: C901 (one straight IR emitter)
    """Emits `void run(api, ctx, xt, w, out, blocks, k, k_block, stride, chunks, rows, n)` into the module once per
    lane count: every full block of outputs through `_row1_function` (lanes 1: x f32[K], out f32[N]) or
    `_block_function` (rows in lanes: `chunks` chunks of `lanes` rows, chunk c's input i at xT[i * stride + c *
    lanes]; out f32[rows, n], row-major), shared with XLA's own threads. For rows in lanes each block of outputs
    is summed into a tile f32[_OUTPUTS, lanes] per chunk, which is then transposed in registers into the chunk's
    rows of out: XLA's transposes of an f32[N, lanes] result and the concatenation of chunks made a 64- and 128-row
    decode step 2-4% slower on znver4 (benchmarks/README.md). A block's kernel rows stay in cache over the chunks.
    The caller schedules a task per other thread of XLA's pool (XLA_FFI_ThreadPool_Schedule: the threads that run
    XLA's loops and library dots, idle while this call runs; numba's own threads fought them for the two cores, and
    a 7 MB kernel's row ran 1.4x slower than on one thread).
    Caller and tasks claim `_CLAIM` blocks (one row: `_ROW1_CLAIM`) at a time from a shared counter until none is
    left; the caller then waits for the claims in progress only. A task that starts after that finds nothing to
    claim, so the caller never waits for a thread that is busy elsewhere. The state lives on the heap; whoever
    leaves it last frees it.
    api = 0: the caller alone (a direct call, in tests)."""
    base = _ROW1_FN if lanes == 1 else f"{_FN}_{lanes}"
    name = base + "_run"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    block = _row1_function(module) if lanes == 1 else _block_function(module, lanes)
    outputs, claim = (_ROW1_OUTPUTS, _ROW1_CLAIM) if lanes == 1 else (_OUTPUTS, _CLAIM)
    f32, i64, i8p, void = ir.FloatType(), ir.IntType(64), ir.IntType(8).as_pointer(), ir.VoidType()
    i64p, fp, v8p = i64.as_pointer(), f32.as_pointer(), ir.VectorType(f32, LANES).as_pointer()

    def c64(x):
        return ir.Constant(i64, x)

    def extern(fname, fnty):
        f = module.globals.get(fname)
        return f if f is not None else ir.Function(module, fnty, fname)

    malloc, free = extern("malloc", ir.FunctionType(i8p, [i64])), extern("free", ir.FunctionType(void, [i8p]))

    # work(state): claims until none is left
    work = ir.Function(module, ir.FunctionType(void, [i64p]), base + "_work")
    work.linkage = "internal"
    b = ir.IRBuilder(work.append_basic_block("entry"))
    st = work.args[0]
    word = [b.gep(st, [c64(i)]) for i in range(_WORDS)]
    claims, blocks, k, k_block = b.load(word[_CLAIMS]), b.load(word[_BLOCKS]), b.load(word[_K]), b.load(word[_KB])
    stride, chunks, rows, n = (b.load(word[i]) for i in (_STRIDE, _CHUNKS, _ROWS, _N))
    xt, w, out = (b.inttoptr(b.load(word[i]), fp) for i in (_XT, _W, _OUT))
    if lanes > 1:  # a thread's tile, f32[_OUTPUTS, lanes]
        slot = b.alloca(ir.ArrayType(f32, _OUTPUTS * lanes))
        slot.align = 64
        tile = b.bitcast(slot, fp)
    k_blocks = b.sdiv(b.sub(b.add(k, k_block), c64(1)), k_block)
    claim_bb, do_bb, done_bb = (work.append_basic_block(n) for n in ("claim", "do", "done"))
    b.branch(claim_bb)
    b.position_at_end(claim_bb)
    c = b.atomic_rmw("add", word[_NEXT], c64(1), "monotonic")
    b.cbranch(b.icmp_signed("<", c, claims), do_bb, done_bb)
    b.position_at_end(do_bb)
    first = b.mul(c, c64(claim))
    last = b.add(first, c64(claim))
    last = b.select(b.icmp_signed("<", last, blocks), last, blocks)
    blk = _IRLoop(b, work, first, last, "block")
    o = b.mul(blk.i, c64(outputs))
    wo = b.gep(w, [b.mul(o, k)])

    def sum_blocks(x, dst, *extra):  # every block of inputs into dst: stored by the first, added by the others
        kb = _IRLoop(b, work, c64(0), k_blocks, "kblock")
        k0 = b.mul(kb.i, k_block)
        k1 = b.add(k0, k_block)
        k1 = b.select(b.icmp_signed("<", k1, k), k1, k)
        b.call(block, [x, wo, dst, k, k0, k1, b.zext(b.icmp_signed("==", kb.i, c64(0)), i64), *extra])
        kb.close()

    if lanes == 1:
        sum_blocks(xt, b.gep(out, [o]))
    else:
        chunk = _IRLoop(b, work, c64(0), chunks, "chunk")
        row0 = b.mul(chunk.i, c64(lanes))
        sum_blocks(b.gep(xt, [row0]), tile, stride)
        count = b.sub(rows, row0)  # the chunk's rows to store (the last chunk's padding rows are not)
        dst = b.gep(out, [b.add(b.mul(row0, n), o)])
        for r0 in range(0, lanes, _OUTPUTS):  # the tile's rows r0..r0+7 of its eight outputs, transposed
            rows8 = _transpose8(b, [b.load(b.bitcast(b.gep(tile, [c64(j * lanes + r0)]), v8p), align=4)
                                    for j in range(_OUTPUTS)])  # fmt: skip
            for j, row in enumerate(rows8):
                with b.if_then(b.icmp_signed("<", c64(r0 + j), count)):
                    b.store(row, b.bitcast(b.gep(dst, [b.mul(c64(r0 + j), n)]), v8p), align=4)
        chunk.close()
    blk.close()
    b.atomic_rmw("add", word[_DONE], c64(1), "release")
    b.branch(claim_bb)
    b.position_at_end(done_bb)
    b.ret_void()

    def release(b, state):  # drops one reference; the last frees the state
        left = b.atomic_rmw("sub", b.gep(state, [c64(_REFS)]), c64(1), "acq_rel")
        with b.if_then(b.icmp_signed("==", left, c64(1))):
            b.call(free, [b.bitcast(state, i8p)])

    # task(data): XLA_FFI_Task
    task = ir.Function(module, ir.FunctionType(void, [i8p]), base + "_task")
    task.linkage = "internal"
    b = ir.IRBuilder(task.append_basic_block("entry"))
    state = b.bitcast(task.args[0], i64p)
    b.call(work, [state])
    release(b, state)
    b.ret_void()

    # run(api, ctx, xt, w, out, blocks, k, k_block, stride, chunks, rows, n)
    fn = ir.Function(module, ir.FunctionType(void, [i64] * 12), name)
    fn.linkage = "internal"
    api, ctx, xt_a, w_a, out_a, blocks, k, k_block, stride, chunks, rows, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    threads = b.alloca(i64)
    args = b.alloca(ir.ArrayType(i64, 5))
    claims = b.sdiv(b.add(blocks, c64(claim - 1)), c64(claim))
    state = b.bitcast(b.call(malloc, [c64(8 * _WORDS)]), i64p)
    values = {_NEXT: c64(0), _DONE: c64(0), _REFS: c64(1), _CLAIMS: claims, _XT: xt_a, _W: w_a, _OUT: out_a, _K: k,
              _BLOCKS: blocks, _KB: k_block, _STRIDE: stride, _CHUNKS: chunks, _ROWS: rows, _N: n}  # fmt: skip
    for i, v in values.items():
        b.store(v, b.gep(state, [c64(i)]))
    api_p = b.inttoptr(api, i64p)

    def call_api(b, index, words):  # API function `index` on an args struct of these words -> its XLA_FFI_Error*
        slots = b.bitcast(args, i64p)
        for i, v in enumerate(words):
            b.store(v, b.gep(slots, [c64(i)]))
        api_fn = b.inttoptr(b.load(b.gep(api_p, [c64(index)])), ir.FunctionType(i8p, [i64p]).as_pointer())
        return b.call(api_fn, [slots])

    has_pool = b.and_(b.icmp_signed("!=", api, c64(0)),
                      b.icmp_signed(">", b.load(api_p), c64(8 * _API_NUM_THREADS)))  # fmt: skip
    with b.if_then(has_pool):
        b.store(c64(1), threads)
        err = call_api(b, _API_NUM_THREADS, [c64(32), c64(0), ctx, b.ptrtoint(threads, i64)])
        with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(err, i64), c64(0))):
            call_api(b, _API_ERROR_DESTROY, [c64(24), c64(0), b.ptrtoint(err, i64)])
            b.store(c64(1), threads)
        tasks = b.sub(b.load(threads), c64(1))
        tasks = b.select(b.icmp_signed("<", tasks, b.sub(claims, c64(1))), tasks, b.sub(claims, c64(1)))
        b.store(b.add(tasks, c64(1)), b.gep(state, [c64(_REFS)]))
        t = _IRLoop(b, fn, c64(0), tasks, "schedule")
        err = call_api(b, _API_SCHEDULE, [c64(40), c64(0), ctx, b.ptrtoint(task, i64), b.ptrtoint(state, i64)])
        with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(err, i64), c64(0))):  # not scheduled: its reference goes
            call_api(b, _API_ERROR_DESTROY, [c64(24), c64(0), b.ptrtoint(err, i64)])
            b.atomic_rmw("sub", b.gep(state, [c64(_REFS)]), c64(1), "acq_rel")
        t.close()
    b.call(work, [state])
    wait_bb, after_bb = fn.append_basic_block("wait"), fn.append_basic_block("after")
    b.branch(wait_bb)
    b.position_at_end(wait_bb)
    done = b.load_atomic(b.gep(state, [c64(_DONE)]), "acquire", 8)
    b.cbranch(b.icmp_signed("<", done, claims), wait_bb, after_bb)
    b.position_at_end(after_bb)
    release(b, state)
    b.ret_void()
    return fn


def _run_intrinsic(lanes: int):
    """An intrinsic that calls `_run_function` (emitted into the caller's module once); addresses as integers."""

    @intrinsic
    def run(typingctx, api, ctx, x, w, out, blocks, k, k_block, stride, chunks, rows, n):
        sig = types.void(*([types.int64] * 12))

        def codegen(context, builder, signature, args):
            builder.call(_run_function(builder.module, lanes), list(args))
            return context.get_dummy_value()

        return sig, codegen

    return run


def _project_row1():
    """The projection of one row: out f32[N] = w f32[N, K] times x f32[K], each output summed in YNNPACK's order
    (module docstring). api, ctx: the FFI call frame's (XLA's thread pool takes part), or 0 (this thread alone)."""
    block, run = _block_intrinsic(1), _run_intrinsic(1)

    @njit
    def project(x, w, out, k_block, api=0, ctx=0):
        n, k = w.shape
        if k == 0:
            out[:] = 0.0
            return
        full = n // _ROW1_OUTPUTS
        if full:
            run(api, ctx, x.ctypes.data, w.ctypes.data, out.ctypes.data, full, k, k_block, 1, 1, 1, n)
        rest = n - full * _ROW1_OUTPUTS
        if rest:  # the last outputs through the same code: their kernel rows copied out, padded with zero rows
            w_rest = np.zeros((_ROW1_OUTPUTS, k), np.float32)
            out_rest = np.empty(_ROW1_OUTPUTS, np.float32)
            w_rest[:rest] = w[full * _ROW1_OUTPUTS :]
            for k0 in range(0, k, k_block):
                block(x.ctypes.data, w_rest.ctypes.data, out_rest.ctypes.data, k, k0, min(k, k0 + k_block), k0 == 0, 1)
            out[full * _ROW1_OUTPUTS :] = out_rest[:rest]

    return project


def _project_rows(lanes: int):
    """The projection of rows row0..row0 + rows - 1 in `chunks` chunks of `lanes` rows: out[row0 + r] = w f32[N, K]
    times row r, each output summed in YNNPACK's order (module docstring). xT f32[K, stride] holds the rows in
    columns (row0's in column row0, padding rows past the last); out f32[M, N]. api, ctx: as `_project_row1`."""
    block, run = _block_intrinsic(lanes), _run_intrinsic(lanes)

    @njit
    def project(xt, row0, chunks, rows, w, out, k_block, api=0, ctx=0):
        n, k = w.shape
        stride = xt.shape[1]
        if k == 0:
            out[row0 : row0 + rows] = 0.0
            return
        x0 = xt.ctypes.data + row0 * 4
        full = n // _OUTPUTS
        if full:
            run(api, ctx, x0, w.ctypes.data, out.ctypes.data + row0 * n * 4, full, k, k_block, stride, chunks, rows, n)
        rest = n - full * _OUTPUTS
        if rest:  # the last outputs through the same code: their kernel rows copied out, padded with zero rows
            w_rest = np.zeros((_OUTPUTS, k), np.float32)
            tile = np.empty((_OUTPUTS, lanes), np.float32)
            w_rest[:rest] = w[full * _OUTPUTS :]
            for c in range(chunks):
                for k0 in range(0, k, k_block):
                    block(x0 + c * lanes * 4, w_rest.ctypes.data, tile.ctypes.data, k, k0, min(k, k0 + k_block),
                          k0 == 0, stride)  # fmt: skip
                for r in range(min(lanes, rows - c * lanes)):
                    for j in range(rest):
                        out[row0 + c * lanes + r, full * _OUTPUTS + j] = tile[j, r]

    return project


project_row1 = _project_row1()
project_rows8 = _project_rows(ROW_LANES[0])
# AVX2 hosts take 8 rows at most (project_cpu.max_rows()): the handler's wider branches never run there. Pointed at
# the 8-lane form, they build nothing more: a new machine's handler build took ~7 s instead of ~9.
project_rows16, project_rows32 = (
    (_project_rows(ROW_LANES[1]), _project_rows(ROW_LANES[2])) if _AVX512 else (project_rows8, project_rows8)
)


@njit(inline="always")
def _rows_in_lanes(xt, row0, chunks, rows, w, out, k_block, lanes, api, ctx):
    if lanes == 8:
        project_rows8(xt, row0, chunks, rows, w, out, k_block, api, ctx)
    elif lanes == 16:
        project_rows16(xt, row0, chunks, rows, w, out, k_block, api, ctx)
    else:
        project_rows32(xt, row0, chunks, rows, w, out, k_block, api, ctx)


def _handle(frame_ptr):
    """Operands: x f32[K] (one row) or xT f32[K, P] (M rows in columns, padded: see project_cpu.row_layout); the
    kernel, f32[N, K] or a stack of them f32[L, N, K]; i32[3], which of the stack's kernels (read in place, where a
    slice would be a copy), the block of inputs whose chains are summed apart, and the rows per chunk (8, 16 or
    32). Result f32[N] or f32[M, N]: whole chunks of that many rows, then the rest in one chunk of P - whole."""
    frame = carray(frame_ptr, (15,), dtype=np.int64)
    if answer_non_execute(frame):
        return null()
    bx, bw, bl, bo = buffer(frame, 0, False), buffer(frame, 1, False), buffer(frame, 2, False), buffer(frame, 0, True)
    stacked = bw[4] == 3
    n, k = dim(bw, 1 if stacked else 0), dim(bw, 2 if stacked else 1)
    index = carray(data(bl), (3,), dtype=np.int32)
    layer = index[0] if stacked else 0
    k_block = np.int64(max(index[1], 1))
    w = carray(data(bw), (layer + 1, n, k), dtype=np.float32)[layer]
    if bx[4] == 1:  # rank 1: one row
        project_row1(carray(data(bx), (k,), dtype=np.float32), w, carray(data(bo), (n,), dtype=np.float32),
                     k_block, frame[2], frame[3])  # fmt: skip
        return null()
    rows, padded, lanes = dim(bo, 0), dim(bx, 1), np.int64(index[2])
    xt, out = carray(data(bx), (k, padded), dtype=np.float32), carray(data(bo), (rows, n), dtype=np.float32)
    whole = rows // lanes
    if whole:
        _rows_in_lanes(xt, np.int64(0), whole, whole * lanes, w, out, k_block, lanes, frame[2], frame[3])
    if rows > whole * lanes:
        row0 = whole * lanes
        _rows_in_lanes(xt, row0, np.int64(1), rows - row0, w, out, k_block, padded - row0, frame[2], frame[3])
    return null()


_SIGNATURE = types.voidptr(types.voidptr)  # XLA_FFI_Error* handler(XLA_FFI_CallFrame*)


def handler():
    """The XLA FFI handler (a numba cfunc), compiled, or loaded from numba's cache. Its caller keeps it
    (kernels_pallas.numba_ffi.register): XLA calls its machine code."""
    return cfunc(_SIGNATURE, cache=True)(_handle)
