"""The numba side of kernels_pallas/ragged_cpu.py: the ragged paged attention kernel and its XLA FFI handler.

Imported on first use only (importing numba takes about half a second). Each handler (`handler(head_dim)`) is
compiled on first use, once per machine, into numba's cache (`__pycache__` beside this file, or NUMBA_CACHE_DIR):
about 10 s on 2 cores, then about a second to load.

The head dim is a compile-time constant for 64, the default model's (`SPECIALIZED`): its loops unroll, and the kernel
ran 10-15% faster than with the head dim read at run time. Every other size shares one handler that reads it from
the operands (a constant 128 measured 8% slower on a batch-128 decode and 8% faster at batch 1; 256, no
difference). Each handler compiles only when a model needs it: building both at once took 19.5 s on a new machine.

Full 16-key pages of decode tokens at head dim 64 go through a few hundred lines of LLVM vector IR
(`_page_function`) instead of the numba loops: see the comment above it. They add ~4 s to the 64 handler's build.

Each handler exists for float32 and for float16 pools (float16 is the CPU default for a float32 model,
`--kv-cache-dtype float32` the other: jaxinfer.device.resolve_kv_cache_dtype). numba has no float16 on CPU, so a
float16 pool is read as its bits (uint16) and every load of a K or V element widens it (`_kv`; F16C's vcvtph2ps
once vectorized); queries, scores and accumulators stay float32. Reading half the bytes, a 128-row decode's
attention ran 1.47x faster alone (30 layers' pools, cold) and 1.26x in the step (benchmarks/README.md).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.core.extending import intrinsic

from kernels_pallas.numba_ffi import jit_helpers, start_threads

start_threads()  # before the cached parallel code below loads
_h = jit_helpers()
answer_non_execute, buffer, data, dim, null = _h.answer_non_execute, _h.buffer, _h.data, _h.dim, _h.null

# Query rows (token x head pairs) per pass over the keys: each key (and value) loaded once feeds this many dot
# products (and accumulators). Rows past the item's last repeat it (computed, not stored). Four independent
# accumulators in the inner loops ran 1.3-1.8x faster than a loop over a [rows, D] accumulator.
_ROWS_PER_PASS = 4
# Keys per block of a decode token's P.V product (a whole page of this many keys takes the unrolled loop).
_KEY_BLOCK = 16
# Query tokens per work item of a prefill chunk: its rows share each pass over the keys (read from cache), and the
# items of a long chunk spread over the threads.
BLOCK_Q = 16
# Below this much work (query rows x keys, summed over a call's items) the items run on the calling thread: waking
# numba's threads costs more than it saves (a batch-1 decode step ran ~5% slower with them).
_SERIAL_WORK = 1 << 15


@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _kv(typingctx, x):
    """A pool element as float32: itself from a float32 pool; from a float16 pool (its bits, uint16: numba has no
    float16 on CPU) the half converted, which LLVM vectorizes into F16C's vcvtph2ps on x86."""
    if x == types.float32:
        return types.float32(x), lambda context, builder, signature, args: args[0]
    if x == types.uint16:

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(x), codegen
    return None


@intrinsic
def _prefetch_l2(typingctx, arr, index):
    """A hint to bring the cache line holding arr's flat element `index` into L2 (llvm.prefetch, read, locality 2:
    x86's prefetcht1). Into L1 (locality 3) the next page's 24 KB evicted the current page's rows: no gain."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=fnty)
        address = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, types.int64), codegen


@njit(fastmath=True, inline="always")
def _exp(x):
    """e**x for x <= 0 in float32 (relative error under 1e-7 on [-87, 0]; clamped at e**-87): written out so that LLVM
    vectorizes the softmax's loop, which calls to expf keep scalar (3.2x faster on a [288, 300] softmax)."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))  # x / ln 2, rounded
    # x - n ln 2 in two steps (Cody-Waite): ln 2's leading bits times n are exact in float32.
    f = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # in [-ln2/2, ln2/2]
    p = np.float32(1.0 / 5040.0)  # e**f by its Taylor series to f**7
    p = p * f + np.float32(1.0 / 720.0)
    p = p * f + np.float32(1.0 / 120.0)
    p = p * f + np.float32(1.0 / 24.0)
    p = p * f + np.float32(1.0 / 6.0)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    p = p * f + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@intrinsic
def _fmax(typingctx, a, b):
    """max(a, b) of two float32 as llvm.maxnum: LLVM vectorizes a loop's max over it, where numba's `max` (which
    orders NaNs) keeps the loop scalar (13x on a 256-key row)."""

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f32], ir.FunctionType(f32, [f32, f32]))
        return builder.call(fn, args, fastmath=("fast",))

    return types.float32(types.float32, types.float32), codegen


@njit(fastmath=True, inline="always")
def _softmax(x, scale, cap):
    """x <- softmax(x * scale), soft-capped when cap > 0 (cap * tanh(x * scale / cap)). x is a slice, so that every
    loop runs from 0: a loop from a runtime offset (range(lo, hi)) stays scalar, as numba cannot prove the index
    non-negative (4.2 -> 1.0 ns a key on a prefill block's rows)."""
    n = x.shape[0]
    if cap > 0:
        for t in range(n):
            x[t] = cap * np.tanh(x[t] * scale / cap)
    else:
        for t in range(n):
            x[t] = x[t] * scale
    m = x[0]
    for t in range(1, n):
        m = _fmax(m, x[t])
    total = np.float32(0.0)
    for t in range(n):
        e = _exp(x[t] - m)
        x[t] = e
        total += e
    inv = np.float32(1.0) / total
    for t in range(n):
        x[t] *= inv


@njit(fastmath=True, inline="always")
def _dot4(q0, q1, q2, q3, key, head_dim):
    """Four query rows' dot products with one key: the key is loaded once."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for d in range(head_dim):
        kd = _kv(key[d])
        a0 += q0[d] * kd
        a1 += q1[d] * kd
        a2 += q2[d] * kd
        a3 += q3[d] * kd
    return a0, a1, a2, a3


@njit(fastmath=True, inline="always")
def _axpy4(c0, c1, c2, c3, w0, w1, w2, w3, val, head_dim):
    """c_i += w_i * val for four accumulator rows: the value row is loaded once."""
    for d in range(head_dim):
        vd = _kv(val[d])
        c0[d] += w0 * vd
        c1[d] += w1 * vd
        c2[d] += w2 * vd
        c3[d] += w3 * vd


@njit(fastmath=True, inline="always")
def _page_pv(o, w, w0, v, page, head, head_dim):
    """o += w[w0:w0 + _KEY_BLOCK] . v[page, :, head] for a page of _KEY_BLOCK keys: a loop over the head dim with the
    keys unrolled inside, one store per output vector, where a loop over keys would load and store every
    accumulator at every key."""
    for d in range(head_dim):
        x = np.float32(0.0)
        for j in range(_KEY_BLOCK):
            x += w[w0 + j] * _kv(v[page, j, head, d])
        o[d] += x


@njit(fastmath=True, inline="always")
def _dim(head_dim, q):
    """The head dim the loops run to: head_dim, a compile-time constant in the specialized handlers, or (0) q's."""
    return head_dim if head_dim > 0 else q.shape[-1]


# ---- a decode item's full page as LLVM vector IR (head dim 64, 16-key pages, no soft-cap) ----------------------------
# The numba loops of _decode_item are compute-bound on this work: a per-score horizontal sum, and a P.V that loads
# and stores every accumulator at every key. This path takes a whole page of 16 keys for each KV head of an item, up
# to four of the head's query rows at a time (a GQA group shares each K and V row it loads):
# - Q.K: each key's K row is loaded (and widened from float16) once for the rows, and each row's products stay an
#   unreduced vector; one transposing reduction per 8 keys then gives a row's scores with the keys in lanes;
# - the online softmax runs on those two vectors per row (a running max and sum per row, the rescale of acc folded
#   into the P.V);
# - P.V: one 8-float slice of the head dim at a time, the rows' accumulators held in registers over the 16 keys
#   (two chains each), so acc is loaded and stored once a page.
# Keys are scored in memory order (each key's K rows for all the item's heads, then the next key's), and the next
# page's K and V rows are prefetched into L2 meanwhile: the pool is read cold (one layer's K/V is tens of MB), and
# with pages in allocation order a head-by-head walk over the page ran 0.84x. Against the form before it (rows in
# lanes, page p's K rows read beside page p - 1's V rows, acc loaded and stored at every key), paired in one
# process on the engine's recorded steps over a float16 pool: the attention 1.56x at 16 rows, 1.07x at 128; over a
# float32 pool 1.02x at 16 rows and 0.80x at 128, where reading K and V side by side streamed better
# (benchmarks/README.md). It is emitted here, in this file, because numba's cache is keyed by this file's contents.
_PAGE_D = 64  # the head dim the IR path is written for (the specialized handler's)
_PAGE_ROWS = 4  # query rows of a KV head taken at once (a group of more is taken four at a time)
_PROBS = _KEY_BLOCK * 8  # a row's scratch: 16 unreduced product vectors, then its probabilities, then the rescale
_PAGE_SCRATCH_ROW = _PROBS + _KEY_BLOCK + 8
_PAGE_FN = "jaxinfer_decode_page_d64"


class _IRLoop:
    """for i in range(start, stop) in IR: the body is what the builder emits between construction and close()."""

    def __init__(self, b, fn, start, stop, name):
        i64 = ir.IntType(64)
        self.b, self.stop = b, stop
        pre = b.block
        self.body, self.after = fn.append_basic_block(name), fn.append_basic_block(name + "_end")
        b.cbranch(b.icmp_signed("<", start, stop), self.body, self.after)
        b.position_at_end(self.body)
        self.i = b.phi(i64)
        self.i.add_incoming(start, pre)

    def close(self):
        b = self.b
        nxt = b.add(self.i, ir.Constant(self.i.type, 1))
        self.i.add_incoming(nxt, b.block)
        b.cbranch(b.icmp_signed("<", nxt, self.stop), self.body, self.after)
        b.position_at_end(self.after)


def _page_function(module, half: bool):  # noqa: C901 (one straight IR emitter)
    """Emits `void page(q, k, v, acc, run_max, run_sum, scratch, k_next, v_next, heads, group, key_stride, prefetch)`
    into the module (once per pool dtype): one full page of 16 keys for `heads` KV heads of `group` query rows each.

    q f32[heads * group, 64] (scaled), acc f32[heads * group, 64], run_max and run_sum f32[heads * group] (the
    online softmax's running max and sum per row); scratch f32[heads * group * _PAGE_SCRATCH_ROW]. k and v point at
    the page's first key row, at the item's first head, in the pools (f16* as i16* when `half`), a key row
    `key_stride` elements long; k_next and v_next the same for the next page, whose rows are prefetched when
    `prefetch` is nonzero."""
    name = _PAGE_FN + ("_f16" if half else "")
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    v8, v8i = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
    fp, i8p = f32.as_pointer(), ir.IntType(8).as_pointer()
    pool = ir.IntType(16).as_pointer() if half else fp
    args = [fp, pool, pool, fp, fp, fp, fp, pool, pool, i64, i64, i64, i64]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)
    fn.linkage = "internal"
    q, k, v, acc, run_max, run_sum, scratch, k_next, v_next, heads, group, ks, pf = fn.args
    fma = module.declare_intrinsic("llvm.fma.v8f32", fnty=ir.FunctionType(v8, [v8, v8, v8]))
    vmax = module.declare_intrinsic("llvm.maxnum.v8f32", fnty=ir.FunctionType(v8, [v8, v8]))
    vfloor = module.declare_intrinsic("llvm.floor.v8f32", fnty=ir.FunctionType(v8, [v8]))
    prefetch = module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fast = ("fast",)
    lines = 2 if half else 4  # 64-byte lines of one head's K (or V) row

    def c64(x):
        return ir.Constant(i64, x)

    def c8(x):
        return ir.Constant(v8, [x] * 8)

    def shuf(x, y, idx):
        return b.shuffle_vector(x, y, ir.Constant(v8i, idx))

    def at(ptr, *offsets):
        return b.gep(ptr, [offsets[0] if len(offsets) == 1 else b.add(*offsets)])

    def vload(ptr):
        return b.load(b.bitcast(ptr, v8.as_pointer()), align=4)

    def vload_kv(ptr):  # 8 pool elements as floats
        if not half:
            return vload(ptr)
        h8 = b.load(b.bitcast(ptr, ir.VectorType(ir.IntType(16), 8).as_pointer()), align=2)
        return b.fpext(b.bitcast(h8, ir.VectorType(ir.HalfType(), 8)), v8)

    def vstore(x, ptr):
        b.store(x, b.bitcast(ptr, v8.as_pointer()), align=4)

    def splat(x):  # a float -> 8 lanes of it
        x = b.insert_element(ir.Constant(v8, ir.Undefined), x, ir.Constant(i32, 0))
        return shuf(x, x, [0] * 8)

    def lane0(x):
        return b.extract_element(x, ir.Constant(i32, 0))

    def vexp(x):  # _exp on 8 lanes
        x = b.call(vmax, [x, c8(-87.0)], fastmath=fast)
        n = b.call(vfloor, [b.fadd(b.fmul(x, c8(1.4426950408889634), flags=fast), c8(0.5), flags=fast)])
        f = b.fsub(x, b.fmul(n, c8(0.693359375), flags=fast), flags=fast)
        f = b.fadd(f, b.fmul(n, c8(2.12194440e-4), flags=fast), flags=fast)
        p = c8(1.0 / 5040.0)
        for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
            p = b.call(fma, [p, f, c8(c)])
        bits = b.shl(b.add(b.fptosi(n, v8i), ir.Constant(v8i, [127] * 8)), ir.Constant(v8i, [23] * 8))
        return b.fmul(p, b.bitcast(bits, v8), flags=fast)

    def hadd(x, y):  # pairwise sums of x and y, per 128-bit half (vhaddps)
        return b.fadd(shuf(x, y, [0, 2, 8, 10, 4, 6, 12, 14]), shuf(x, y, [1, 3, 9, 11, 5, 7, 13, 15]), flags=fast)

    def lane_sums(vectors):  # 8 vectors -> one whose lane i is the sum of vectors[i]
        t = [hadd(vectors[0], vectors[1]), hadd(vectors[2], vectors[3]), hadd(vectors[4], vectors[5]),
             hadd(vectors[6], vectors[7])]  # fmt: skip
        u0, u1 = hadd(t[0], t[1]), hadd(t[2], t[3])
        return b.fadd(shuf(u0, u1, [0, 1, 2, 3, 8, 9, 10, 11]), shuf(u0, u1, [4, 5, 6, 7, 12, 13, 14, 15]), flags=fast)

    def across(x, op):  # every lane: op over x's 8 lanes
        for idx in ([4, 5, 6, 7, 0, 1, 2, 3], [2, 3, 0, 1, 6, 7, 4, 5], [1, 0, 3, 2, 5, 4, 7, 6]):
            x = op(x, shuf(x, x, idx))
        return x

    def vmax2(x, y):
        return b.call(vmax, [x, y], fastmath=fast)

    def vadd2(x, y):
        return b.fadd(x, y, flags=fast)

    def row_scratch(r, offset):  # row r's scratch: 16 unreduced product vectors, 16 probabilities, the rescale
        return at(scratch, b.mul(r, c64(_PAGE_SCRATCH_ROW)), c64(offset))

    def subgroups(name, body):  # body(head, its rows) for each KV head, up to _PAGE_ROWS of its rows at a time
        head = _IRLoop(b, fn, c64(0), heads, name)
        sub = _IRLoop(b, fn, c64(0), b.sdiv(b.add(group, c64(_PAGE_ROWS - 1)), c64(_PAGE_ROWS)), name + "_sub")
        first = b.add(b.mul(head.i, group), b.mul(sub.i, c64(_PAGE_ROWS)))
        n = b.sub(group, b.mul(sub.i, c64(_PAGE_ROWS)))
        n = b.select(b.icmp_signed(">", n, c64(_PAGE_ROWS)), c64(_PAGE_ROWS), n)
        done = fn.append_basic_block(name + "_done")
        switch = b.switch(n, done)
        for count in range(1, _PAGE_ROWS + 1):  # the row count, unrolled
            block = fn.append_basic_block(f"{name}{count}")
            switch.add_case(c64(count), block)
            b.position_at_end(block)
            body(head.i, [b.add(first, c64(i)) for i in range(count)])
            b.branch(done)
        b.position_at_end(done)
        sub.close()
        head.close()

    # Q.K, keys in memory order (each key's K rows of all the item's heads, then the next key's): each K row loaded
    # once for its head's rows; a row's products with key j stay unreduced (row_scratch(r, 8 j)).
    keys = _IRLoop(b, fn, c64(0), c64(_KEY_BLOCK), "qk")
    jo = b.mul(keys.i, ks)
    with b.if_then(b.icmp_signed("!=", pf, c64(0))):
        fetch = _IRLoop(b, fn, c64(0), b.mul(heads, c64(lines)), "prefetch")  # the next page's key j, K and V
        for nxt in (k_next, v_next):
            line = b.bitcast(at(nxt, jo, b.mul(fetch.i, c64(32 if half else 16))), i8p)
            b.call(prefetch, [line, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        fetch.close()

    def qk(h, rows):
        kr = at(k, jo, b.mul(h, c64(_PAGE_D)))
        kvec = [vload_kv(at(kr, c64(c))) for c in range(0, _PAGE_D, 8)]
        for r in rows:
            qr = at(q, b.mul(r, c64(_PAGE_D)))
            # two chains of four: eight dependent FMAs would be latency-bound
            a0 = b.fmul(vload(qr), kvec[0], flags=fast)
            a1 = b.fmul(vload(at(qr, c64(8))), kvec[1], flags=fast)
            for c in range(2, _PAGE_D // 8, 2):
                a0 = b.call(fma, [vload(at(qr, c64(8 * c))), kvec[c], a0])
                a1 = b.call(fma, [vload(at(qr, c64(8 * c + 8))), kvec[c + 1], a1])
            vstore(b.fadd(a0, a1, flags=fast), at(row_scratch(r, 0), b.mul(keys.i, c64(8))))

    subgroups("qk_head", qk)
    keys.close()
    # the online softmax per row, keys in lanes: scores, new max, probabilities, the running sum, the rescale
    each = _IRLoop(b, fn, c64(0), b.mul(heads, group), "softmax")
    r = each.i
    s0 = lane_sums([vload(row_scratch(r, 8 * j)) for j in range(8)])
    s1 = lane_sums([vload(row_scratch(r, 8 * j)) for j in range(8, 16)])
    m_old = splat(b.load(at(run_max, r)))
    m_new = vmax2(m_old, across(vmax2(s0, s1), vmax2))
    e0, e1 = vexp(b.fsub(s0, m_new, flags=fast)), vexp(b.fsub(s1, m_new, flags=fast))
    vstore(e0, row_scratch(r, _PROBS))
    vstore(e1, row_scratch(r, _PROBS + 8))
    corr = vexp(b.fsub(m_old, m_new, flags=fast))  # 1 where the max holds; ~0 on the first page
    vstore(corr, row_scratch(r, _PROBS + _KEY_BLOCK))
    total = across(b.fadd(e0, e1, flags=fast), vadd2)
    b.store(lane0(b.call(fma, [splat(b.load(at(run_sum, r))), corr, total])), at(run_sum, r))
    b.store(lane0(m_new), at(run_max, r))
    each.close()

    # P.V: acc = acc * rescale + p . V, an 8-float slice of the head dim at a time, the rows' accumulators held in
    # registers over the page's keys (two chains each)
    def pv(h, rows):
        dims = _IRLoop(b, fn, c64(0), c64(_PAGE_D // 8), "pv_dims")
        d0 = b.mul(dims.i, c64(8))
        arow = [at(acc, b.mul(r, c64(_PAGE_D)), d0) for r in rows]
        rescale = [vload(row_scratch(r, _PROBS + _KEY_BLOCK)) for r in rows]
        even = [b.fmul(vload(a), c, flags=fast) for a, c in zip(arow, rescale, strict=True)]
        odd = [c8(0.0)] * len(rows)
        vh = at(v, b.mul(h, c64(_PAGE_D)), d0)
        for j in range(_KEY_BLOCK):
            val = vload_kv(at(vh, b.mul(c64(j), ks)))
            chains = even if j % 2 == 0 else odd
            for i, r in enumerate(rows):
                chains[i] = b.call(fma, [splat(b.load(row_scratch(r, _PROBS + j))), val, chains[i]])
        for i, a in enumerate(arow):
            vstore(b.fadd(even[i], odd[i], flags=fast), a)
        dims.close()

    subgroups("pv_head", pv)
    b.ret_void()
    return fn


@intrinsic
def _decode_page(typingctx, pool, q, k, v, acc, run_max, run_sum, scratch, k_next, v_next, heads, group, ks, pf):
    """Calls `_page_function` (emitted into the caller's module once) for `pool`'s dtype (the K pool, for its type
    only). The arrays as addresses (`a.ctypes.data`)."""
    half = pool.dtype == types.uint16
    sig = types.void(pool, *([types.uintp] * 9), types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = _page_function(builder.module, half)
        types_ = fn.function_type.args
        builder.call(fn, [builder.inttoptr(x, t) if isinstance(t, ir.PointerType) else x
                          for x, t in zip(args[1:], types_, strict=True)])  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=True, nogil=True, cache=True)
def _prefill_item(q, k, v, table, rows_pos, head, out, scale, window, cap, scores, head_dim):
    """Query rows of one sequence and one KV head: q f32[R, head_dim] (R = tokens x group heads, token-major),
    rows_pos i64[R] each row's absolute position (its keys: causal, within the window) -> out f32[R, head_dim].
    scores f32[>= R, >= keys] is scratch. head_dim: see _dim."""
    head_dim = _dim(head_dim, q)
    rows = q.shape[0]
    num_pages, page_size = k.shape[0], k.shape[1]
    last_key = min(rows_pos.max(), table.shape[0] * page_size - 1)  # keys past the table do not exist
    lo = np.empty(rows, np.int64)
    for r in range(rows):
        lo[r] = max(rows_pos[r] - window + 1, 0) if window > 0 else 0
    first = lo.min()
    if last_key < first or rows_pos.max() < 0:
        out[:, :] = 0.0
        return
    first_page, end_page = first // page_size, last_key // page_size + 1
    for r0 in range(0, rows, _ROWS_PER_PASS):
        n1, n2, n3 = min(r0 + 1, rows - 1), min(r0 + 2, rows - 1), min(r0 + 3, rows - 1)
        q0, q1, q2, q3 = q[r0], q[n1], q[n2], q[n3]
        for pi in range(first_page, end_page):
            page = min(max(table[pi], 0), num_pages - 1)  # a bad table entry must not read outside the pool
            for j in range(max(first - pi * page_size, 0), min(page_size, last_key + 1 - pi * page_size)):
                a0, a1, a2, a3 = _dot4(q0, q1, q2, q3, k[page, j, head], head_dim)
                t = pi * page_size + j
                scores[r0, t], scores[n1, t], scores[n2, t], scores[n3, t] = a0, a1, a2, a3
    for r in range(rows):
        row = scores[r]
        hi = min(rows_pos[r], last_key) + 1  # this row's keys: [lo[r], hi)
        row[first : lo[r]] = 0.0
        row[max(hi, first) : last_key + 1] = 0.0
        if hi > lo[r]:
            _softmax(row[lo[r] : hi], scale, cap)
    out[:, :] = 0.0
    for pi in range(first_page, end_page):
        page = min(max(table[pi], 0), num_pages - 1)
        j0, j1 = max(first - pi * page_size, 0), min(page_size, last_key + 1 - pi * page_size)
        t0 = pi * page_size
        if j1 - j0 == _KEY_BLOCK and page_size == _KEY_BLOCK:
            for r in range(rows):
                _page_pv(out[r], scores[r], t0, v, page, head, head_dim)
        else:
            for j in range(j0, j1):
                val = v[page, j, head]
                for r in range(rows):
                    w, o = scores[r, t0 + j], out[r]
                    for d in range(head_dim):
                        o[d] += w * _kv(val[d])


@njit(fastmath=True, inline="always")
def _pass_rows(r0, end, pad):
    """Rows 2-4 of a pass that starts at row r0 of a group ending at `end`: past the end, scratch rows pad + 1 ..
    pad + 3, which take what the pass computes for its padding rows."""
    return (r0 + 1 if r0 + 1 < end else pad + 1, r0 + 2 if r0 + 2 < end else pad + 2,
            r0 + 3 if r0 + 3 < end else pad + 3)  # fmt: skip


@njit(fastmath=True, nogil=True, cache=True)
def _decode_item(q, group, k, v, table, pos, h0, out, window, cap, s, acc, run_max, run_sum, head_dim, scratch):
    """One decode token's query rows for KV heads h0, h0 + 1, ...: q f32[rows, head_dim] (scaled; each KV head's
    `group` rows together), the token at position pos -> out f32[rows, head_dim].

    Full pages of 16 keys at head dim 64 without soft-cap go through `_page_function` (the IR path), with scratch
    f32[rows * _PAGE_SCRATCH_ROW]; the pages it does not take (a window's or the context's partial ones), the
    loops below. Both keep the same running max, sum and acc per row.

    One pass over the pages in order, each page's K rows then its V rows for all these heads (a page's K or V rows
    of consecutive heads are one contiguous block, read once), with an online softmax: a running max and sum per
    row (run_max, run_sum), acc rescaled when the max grows. s f32[>= rows + 4, page_size] and acc f32[>= rows + 4,
    head_dim] are scratch; the rows past `rows` take a pass's padding rows. head_dim: see _dim."""
    head_dim = _dim(head_dim, q)
    rows = q.shape[0]
    num_pages, page_size = k.shape[0], k.shape[1]
    last = min(pos, table.shape[0] * page_size - 1)  # keys past the table do not exist
    first = max(pos - window + 1, 0) if window > 0 else 0
    if last < first or pos < 0:
        out[:, :] = 0.0
        return
    acc[:rows, :] = 0.0
    for r in range(rows):
        run_max[r] = np.float32(-3.0e38)
        run_sum[r] = 0.0
    ir_path = head_dim == _PAGE_D and page_size == _KEY_BLOCK and cap <= 0
    num_kv_heads = k.shape[2]
    key_stride = np.int64(num_kv_heads * head_dim)
    base = h0 * head_dim * k.itemsize  # bytes from a page's first key row to the item's first head
    row_bytes = page_size * key_stride * k.itemsize
    pad = rows  # past it, scratch rows for a pass's padding rows (_pass_rows)
    for pi in range(first // page_size, last // page_size + 1):
        page = min(max(table[pi], 0), num_pages - 1)  # a bad table entry must not read outside the pool
        j0, j1 = max(first - pi * page_size, 0), min(page_size, last + 1 - pi * page_size)
        n = j1 - j0
        # The next page's K and V rows for these heads are prefetched into L2 while this page's keys are scored,
        # a few lines per key: the pool is read cold (one layer's K/V is tens of MB), and a decode step's
        # attention ran 1.65x faster with it (spread over the keys; all lines at the page's start gained 1.15x).
        has_next = pi + 1 <= last // page_size
        nxt = min(max(table[pi + 1], 0), num_pages - 1) if has_next else page
        if ir_path and n == _KEY_BLOCK:
            _decode_page(k, q.ctypes.data, k.ctypes.data + page * row_bytes + base,
                         v.ctypes.data + page * row_bytes + base, acc.ctypes.data, run_max.ctypes.data,
                         run_sum.ctypes.data, scratch.ctypes.data, k.ctypes.data + nxt * row_bytes + base,
                         v.ctypes.data + nxt * row_bytes + base, np.int64(rows // group), np.int64(group),
                         key_stride, np.int64(has_next))  # fmt: skip
            continue
        for j in range(j0, j1):
            jj = j - j0
            for hh in range(rows // group):
                if has_next:
                    line = ((nxt * page_size + j) * k.shape[2] + h0 + hh) * head_dim
                    for x in range(0, head_dim, 64 // k.itemsize):  # a 64-byte line
                        _prefetch_l2(k, line + x)
                        _prefetch_l2(v, line + x)
                key = k[page, j, h0 + hh]
                end = (hh + 1) * group
                for r0 in range(hh * group, end, _ROWS_PER_PASS):
                    q0, q1, q2, q3 = q[r0], q[min(r0 + 1, end - 1)], q[min(r0 + 2, end - 1)], q[min(r0 + 3, end - 1)]
                    r1, r2, r3 = _pass_rows(r0, end, pad)
                    s[r0, jj], s[r1, jj], s[r2, jj], s[r3, jj] = _dot4(q0, q1, q2, q3, key, head_dim)
        for r in range(rows):
            row = s[r]
            if cap > 0:
                for jj in range(n):
                    row[jj] = cap * np.tanh(row[jj] / cap)
            top = row[0]
            for jj in range(1, n):
                top = _fmax(top, row[jj])
            new_max = max(run_max[r], top)
            total = np.float32(0.0)
            for jj in range(n):
                e = _exp(row[jj] - new_max)
                row[jj] = e
                total += e
            if new_max > run_max[r] and run_sum[r] > 0:
                corr = _exp(run_max[r] - new_max)
                run_sum[r] *= corr
                ar = acc[r]
                for d in range(head_dim):
                    ar[d] *= corr
            run_sum[r] += total
            run_max[r] = new_max
        for r in range(rows, rows + _ROWS_PER_PASS):  # padding rows: no weight
            for jj in range(n):
                s[r, jj] = 0.0
        if n == _KEY_BLOCK and page_size == _KEY_BLOCK:
            for r in range(rows):
                _page_pv(acc[r], s[r], 0, v, page, h0 + r // group, head_dim)
        else:
            for j in range(j0, j1):
                jj = j - j0
                for hh in range(rows // group):
                    val = v[page, j, h0 + hh]
                    end = (hh + 1) * group
                    for r0 in range(hh * group, end, _ROWS_PER_PASS):
                        r1, r2, r3 = _pass_rows(r0, end, pad)
                        c0, c1, c2, c3 = acc[r0], acc[r1], acc[r2], acc[r3]
                        _axpy4(c0, c1, c2, c3, s[r0, jj], s[r1, jj], s[r2, jj], s[r3, jj], val, head_dim)
    for r in range(rows):
        inv = np.float32(1.0) / run_sum[r]
        for d in range(head_dim):
            out[r, d] = acc[r, d] * inv


@njit(fastmath=True, inline="always")
def _attend(q, k, v, table, context_lens, query_start_loc, num_seqs, out, scale, window, cap, threads, head_dim):
    """q f32[T, Hq, D] packed query tokens -> out f32[T, Hq, D]; tokens of no sequence get zeros. head_dim: D as a
    compile-time constant, or 0 (D read from q)."""
    num_tokens, num_q_heads = q.shape[0], q.shape[1]
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    keys = table.shape[1] * k.shape[1]
    num_seqs = min(max(num_seqs, 0), table.shape[0])
    # Query blocks: (sequence, up to BLOCK_Q query tokens), a decode row being a block of one token. Per block: its
    # sequence, first token, tokens, and the first token's position (the sequence's new tokens end its context).
    blk_seq = np.empty(num_tokens + num_seqs, np.int64)
    blk_start = np.empty(num_tokens + num_seqs, np.int64)
    blk_len = np.empty(num_tokens + num_seqs, np.int64)
    blk_pos = np.empty(num_tokens + num_seqs, np.int64)
    n = 0
    decodes = 0
    longest_block = 1  # query tokens of the largest block
    longest_context = 1  # keys of the longest live sequence (a scores row), at most the table's
    work = 0  # query rows x keys
    for s in range(num_seqs):
        start = min(max(query_start_loc[s], 0), num_tokens)
        end = min(max(query_start_loc[s + 1], start), num_tokens)
        if end > start:
            longest_block = max(longest_block, min(BLOCK_Q, end - start))
            longest_context = max(longest_context, min(context_lens[s], keys))
            work += (end - start) * num_q_heads * min(max(context_lens[s], 1), keys)
        for b in range(start, end, BLOCK_Q):
            blk_seq[n], blk_start[n], blk_len[n] = s, b, min(BLOCK_Q, end - b)
            blk_pos[n] = context_lens[s] - (end - start) + (b - start)
            decodes += blk_len[n] == 1  # a decode, or a chunk's last token alone
            n += 1
    # The blocks in item order: the decode blocks first, then the prefill blocks, each in sequence order.
    order = np.empty(n, np.int64)
    nd, npf = 0, decodes
    for i in range(n):
        if blk_len[i] == 1:
            order[nd] = i
            nd += 1
        else:
            order[npf] = i
            npf += 1
    out[:] = 0.0  # padding tokens (past query_start_loc[num_seqs]) stay zero
    # Work items: a decode token with all its KV heads (one pass over each page's K and V blocks), or, with fewer
    # decodes than two per thread, a decode token with one KV head; a prefill block with one KV head.
    workers = 1 if work < _SERIAL_WORK else max(1, threads)  # a small call: no thread hand-off
    decode_heads = num_kv_heads if workers == 1 or decodes >= 2 * workers else 1
    items = decodes * (num_kv_heads // decode_heads) + (n - decodes) * num_kv_heads
    if workers == 1:
        _run_items(np.int64(0), np.int64(1), items, decode_heads, q, k, v, table, blk_seq, blk_start, blk_len,
                   blk_pos, order, np.int64(decodes), out, scale, window, cap, np.int64(longest_block * group),
                   np.int64(longest_context), head_dim)  # fmt: skip
        return
    workers = min(workers, items)
    # Items dealt round-robin (prange alone hands each thread one contiguous range): decodes and prefill blocks,
    # rows of different lengths, balance over the threads.
    for w in prange(workers):
        _run_items(np.int64(w), workers, items, decode_heads, q, k, v, table, blk_seq, blk_start, blk_len, blk_pos,
                   order, np.int64(decodes), out, scale, window, cap, np.int64(longest_block * group),
                   np.int64(longest_context), head_dim)  # fmt: skip


# numba compiles a specialization for each set of argument types a call site gives: the call sites pass every integer
# as a run-time np.int64 (constants and the prange index's uint64 had made 7 specializations, a 37 s build), except
# head_dim, a constant in the 64 handler by design.
@njit(fastmath=True, nogil=True, cache=True)
def _run_items(w, workers, items, decode_heads, q, k, v, table, blk_seq, blk_start, blk_len, blk_pos, order, decodes,
               out, scale, window, cap, rows_max, longest_context, head_dim):  # fmt: skip
    """Items w, w + workers, ... of one call: the decode blocks' items first (order[:decodes], by block, then KV
    head range), then the prefill blocks' (order[decodes:], by block, then KV head). Scratch is sized by the
    call's largest item, not the table's width: a decode step at 300 keys needs a 4 KB scores row, where BLOCK_Q
    rows of max_model_len keys would be an mmap and fresh page faults every call. head_dim: see _dim."""
    num_q_heads, hd = q.shape[1], _dim(head_dim, q)  # hd: head_dim's value
    num_kv_heads, page_size = k.shape[2], k.shape[1]
    group = num_q_heads // num_kv_heads
    rows_max = max(rows_max, num_q_heads)
    scores = np.empty((rows_max + _ROWS_PER_PASS, max(longest_context, page_size)), np.float32)
    acc = np.empty((rows_max + _ROWS_PER_PASS, hd), np.float32)
    qb = np.empty((rows_max, hd), np.float32)
    ob = np.empty((rows_max, hd), np.float32)
    pos = np.empty(rows_max, np.int64)
    run_max = np.empty(rows_max, np.float32)
    run_sum = np.empty(rows_max, np.float32)
    page_scratch = np.empty(rows_max * _PAGE_SCRATCH_ROW, np.float32)
    decode_splits = num_kv_heads // decode_heads
    decode_items = decodes * decode_splits
    for item in range(w, items, workers):
        if item < decode_items:
            i = order[item // decode_splits]
            h0 = (item % decode_splits) * decode_heads
            rows = decode_heads * group
            t = blk_start[i]
            for r in range(rows):
                for d in range(hd):
                    qb[r, d] = q[t, h0 * group + r, d] * scale
            _decode_item(qb[:rows], group, k, v, table[blk_seq[i]], blk_pos[i], h0, ob[:rows], window, cap, scores,
                         acc, run_max, run_sum, head_dim, page_scratch)  # fmt: skip
            for r in range(rows):
                for d in range(hd):
                    out[t, h0 * group + r, d] = ob[r, d]
            continue
        j = item - decode_items
        i, h = order[decodes + j // num_kv_heads], j % num_kv_heads
        s, start, length, first_pos = blk_seq[i], blk_start[i], blk_len[i], blk_pos[i]
        rows = length * group
        for ti in range(length):
            for g in range(group):
                for d in range(hd):
                    qb[ti * group + g, d] = q[start + ti, h * group + g, d]
                pos[ti * group + g] = first_pos + ti
        _prefill_item(qb[:rows], k, v, table[s], pos[:rows], h, ob[:rows], scale, window, cap, scores, head_dim)
        for ti in range(length):
            for g in range(group):
                for d in range(hd):
                    out[start + ti, h * group + g, d] = ob[ti * group + g, d]


@njit(fastmath=True, inline="always")
def _handle(frame_ptr, head_dim, kv_dtype):
    """Operands: q f32[T, Hq, D], k and v [P, page, Hkv, D] of float32 or float16 (kv_dtype: np.float32, or
    np.uint16 for float16's bits), page_table i32[S, W], context_lens i32[S], query_start_loc i32[S + 1], num_seqs
    i32[1], settings f32[4] (scale, window, soft-cap, threads); result f32[T, Hq, D] (declared f32[T, Hq * D] by the
    caller: the same bytes). head_dim: D as a constant, or 0."""
    frame = carray(frame_ptr, (15,), dtype=np.int64)
    if answer_non_execute(frame):
        return null()
    bq, bk, bv = buffer(frame, 0, False), buffer(frame, 1, False), buffer(frame, 2, False)
    bt, bc, bl = buffer(frame, 3, False), buffer(frame, 4, False), buffer(frame, 5, False)
    bn, bs = buffer(frame, 6, False), buffer(frame, 7, False)
    num_tokens, num_q_heads, size = dim(bq, 0), dim(bq, 1), dim(bq, 2)
    num_pages, page_size, num_kv_heads = dim(bk, 0), dim(bk, 1), dim(bk, 2)
    max_seqs, width = dim(bt, 0), dim(bt, 1)
    pool = (num_pages, page_size, num_kv_heads, size)
    q = carray(data(bq), (num_tokens, num_q_heads, size), dtype=np.float32)
    k = carray(data(bk), pool, dtype=kv_dtype)
    v = carray(data(bv), pool, dtype=kv_dtype)
    table = carray(data(bt), (max_seqs, width), dtype=np.int32)
    context_lens = carray(data(bc), (max_seqs,), dtype=np.int32)
    query_start_loc = carray(data(bl), (max_seqs + 1,), dtype=np.int32)
    num_seqs = carray(data(bn), (1,), dtype=np.int32)[0]
    settings = carray(data(bs), (4,), dtype=np.float32)
    out = carray(data(buffer(frame, 0, True)), (num_tokens, num_q_heads, size), dtype=np.float32)
    _attend(q, k, v, table, context_lens, query_start_loc, num_seqs, out, settings[0], np.int64(settings[1]),
            settings[2], np.int64(settings[3]), head_dim)  # fmt: skip
    return null()


# The handlers' Python functions, one per compile-time head dim (0: any other head dim) and pool dtype. The constant
# reaches the loops because _handle and _attend are inlined here: passed as an argument into the parallel loop's body
# (the prange), it would arrive as a run-time int64. Module-level functions, so that numba caches each handler under
# its own name.
def _handle_d64(frame_ptr):
    return _handle(frame_ptr, 64, np.float32)


def _handle_any(frame_ptr):
    return _handle(frame_ptr, np.int64(0), np.float32)


def _handle_d64_f16(frame_ptr):
    return _handle(frame_ptr, 64, np.uint16)


def _handle_any_f16(frame_ptr):
    return _handle(frame_ptr, np.int64(0), np.uint16)


_HANDLERS = {(64, "float32"): _handle_d64, (0, "float32"): _handle_any, (64, "float16"): _handle_d64_f16,
             (0, "float16"): _handle_any_f16}  # fmt: skip
SPECIALIZED = tuple(sorted({d for d, _ in _HANDLERS if d}))


def variant(head_dim: int) -> int:
    """The handler a head dim runs on: itself where specialized, else 0 (any)."""
    return head_dim if head_dim in SPECIALIZED else 0


_SIGNATURE = types.voidptr(types.voidptr)  # XLA_FFI_Error* handler(XLA_FFI_CallFrame*)


def handler(head_dim: int, kv_dtype: str = "float32"):
    """The XLA FFI handler (a numba cfunc) for `variant(head_dim)` over `kv_dtype` pools, compiled, or loaded from
    numba's cache. Its caller keeps it (kernels_pallas.numba_ffi.register): XLA calls its machine code."""
    return cfunc(_SIGNATURE, fastmath=True, parallel=True, cache=True)(_HANDLERS[variant(head_dim), kv_dtype])


def cached(head_dim: int, kv_dtype: str = "float32") -> bool:
    """Whether numba's cache holds `handler(head_dim)` for this machine and this source, so that it loads in about a
    second instead of building. Asks the cache's index the way the cfunc's own load does (numba's FunctionCache,
    keyed by signature, CPU name and features, and bytecode). Where numba's internals differ from the ones this
    was written against, or numba finds no folder to cache in (RuntimeError), answers True: nothing is built ahead,
    and the handler's first use meets the same cache as ever."""
    from numba.core.caching import FunctionCache
    from numba.core.registry import cpu_target

    try:
        cache = FunctionCache(_HANDLERS[variant(head_dim), kv_dtype])
        key = cache._index_key(_SIGNATURE, cpu_target.target_context.codegen())
        return key in cache._cache_file._load_index()
    except (AttributeError, TypeError, RuntimeError):
        return True
