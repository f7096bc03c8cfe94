"""The bodies of the FP8 grouped GEMM kernels (:mod:`.triton`): plain functions over
``triton.language``, kept undecorated in a module that imports triton at the top so that
:func:`.triton._kernels` can wrap them with ``triton.jit`` for the compiler or for the Triton
interpreter; importing :mod:`.triton` never imports triton.

Parameter order is jax-triton's calling convention: the input arrays as passed to
``triton_call``, then one pointer per output, then the constexprs.
"""

import triton.language as tl

INV_MAX = tl.constexpr(0.0022321429569274187)  # float32(1 / 448): 448 is e4m3's largest finite value
TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal float32: no scale below it


def scaled_grouped_kernel(table_ptr, a_ptr, sa_ptr, b_ptr, sb_ptr, o_ptr, PAIRS: tl.constexpr, K: tl.constexpr,
                          N: tl.constexpr, STRIDE_BG: tl.constexpr, STRIDE_BK: tl.constexpr,
                          STRIDE_BN: tl.constexpr, STRIDE_SK: tl.constexpr, STRIDE_SN: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # one program per (row tile, group) pair of the table and BN-wide output tile: the pair's rows
    # of A (e4m3 [M, K], scales sa [M, K / BK]) times its group's B (e4m3, element (k, n) of group
    # g at g * STRIDE_BG + k * STRIDE_BK + n * STRIDE_BN; one scale per BK x BN block, block (kb, j)
    # of group g at g * (K / BK) * (N / BN) + kb * STRIDE_SK + j * STRIDE_SN); each BK-long piece
    # of the contraction is one tensor-core product (accumulated by the MMA for at most BK
    # products), then scaled and added in float32 (DeepSeek-V3 sec. 3.3.2's promotion)
    p = tl.program_id(0)
    j = tl.program_id(1)
    g = tl.load(table_ptr + p)
    row0 = tl.load(table_ptr + PAIRS + p)
    lo = tl.load(table_ptr + 2 * PAIRS + p)
    hi = tl.load(table_ptr + 3 * PAIRS + p)
    if g >= 0:
        rows = row0 + tl.arange(0, BM)
        keep = (rows >= lo) & (rows < hi)
        cols = j * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for kb in range(0, K // BK):
            a = tl.load(a_ptr + rows[:, None] * K + kb * BK + rk[None, :], mask=keep[:, None], other=0.0)
            b = tl.load(b_ptr + g * STRIDE_BG + (kb * BK + rk)[:, None] * STRIDE_BK + cols[None, :] * STRIDE_BN)
            sa = tl.load(sa_ptr + rows * (K // BK) + kb, mask=keep, other=0.0)
            sb = tl.load(sb_ptr + g * (K // BK) * (N // BN) + kb * STRIDE_SK + j * STRIDE_SN)
            acc += tl.dot(a, b, max_num_imprecise_acc=BK) * (sa * sb)[:, None]
        tl.store(o_ptr + rows[:, None] * N + cols[None, :], acc.to(o_ptr.dtype.element_ty), mask=keep[:, None])


def scaled_dw_kernel(bounds_ptr, xt_ptr, sxt_ptr, dyt_ptr, sdyt_ptr, dw_ptr, G: tl.constexpr, M: tl.constexpr,
                     K: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr):
    # one program per (group, BI rows of dw, BO columns): the sum over the group's rows of
    # x_row^T dy_row from the transposed operands (e4m3 xt [K, M], dyt [N, M], scales [K, M / BT]
    # and [N, M / BT]: BT tokens of one channel each), one BT-token tile at a time
    g = tl.program_id(0)
    a = tl.program_id(1)
    b = tl.program_id(2)
    start = tl.load(bounds_ptr + g)
    end = tl.load(bounds_ptr + G + g)
    ii = a * BI + tl.arange(0, BI)
    oo = b * BO + tl.arange(0, BO)
    acc = tl.zeros((BI, BO), tl.float32)
    for c in range(start // BT, (end + BT - 1) // BT):
        r = c * BT + tl.arange(0, BT)
        keep = (r >= start) & (r < end)
        xa = tl.load(xt_ptr + ii[:, None] * M + r[None, :], mask=keep[None, :], other=0.0)
        db = tl.load(dyt_ptr + oo[:, None] * M + r[None, :], mask=keep[None, :], other=0.0)
        sx = tl.load(sxt_ptr + ii * (M // BT) + c)
        sd = tl.load(sdyt_ptr + oo * (M // BT) + c)
        acc += tl.dot(xa, tl.trans(db), max_num_imprecise_acc=BT) * sx[:, None] * sd[None, :]
    tl.store(dw_ptr + g * K * N + ii[:, None] * N + oo[None, :], acc.to(dw_ptr.dtype.element_ty))


def quantize_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M: tl.constexpr, K: tl.constexpr, MP: tl.constexpr,
                    KP: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, B: tl.constexpr):
    # one program per B x B tile of x [M, K] (any float; read once, zeros past M and K): ROWS
    # writes its 1 x B tiles along K (e4m3 q [MP, KP], scales s [MP, KP / B]), COLS its B x 1
    # tiles along M, transposed (B tokens of one channel: e4m3 qt [KP, MP], scales st [KP, MP / B],
    # the weight gradient's layout). A tile's scale: max-abs times float32 1/448, at least the
    # smallest normal float32, 1 when all zero; values times the scale's IEEE-rounded reciprocal (as
    # XLA computes x / broadcast(s)), clipped to +-448 before the cast (moefast.parallel.fp8: the
    # same bits)
    i = tl.program_id(0)
    c = tl.program_id(1)
    r = i * B + tl.arange(0, B)
    k = c * B + tl.arange(0, B)
    x = tl.load(x_ptr + r[:, None] * K + k[None, :], mask=(r < M)[:, None] & (k < K)[None, :], other=0.0)
    x = x.to(tl.float32)
    ax = tl.abs(x)
    if ROWS:
        amax = tl.max(ax, axis=1)
        s = tl.where(amax > 0, tl.maximum(amax * INV_MAX, TINY), 1.0)
        v = x * tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, None]
        q = tl.minimum(tl.maximum(v, -448.0), 448.0).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + r[:, None] * KP + k[None, :], q)
        tl.store(s_ptr + r * (KP // B) + c, s)
    if COLS:
        amax = tl.max(ax, axis=0)
        s = tl.where(amax > 0, tl.maximum(amax * INV_MAX, TINY), 1.0)
        v = x * tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[None, :]
        q = tl.minimum(tl.maximum(v, -448.0), 448.0).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + k[None, :] * MP + r[:, None], q)
        tl.store(st_ptr + k * (MP // B) + i, s)


def quantize_blocks_kernel(w_ptr, q_ptr, s_ptr, K: tl.constexpr, N: tl.constexpr, KP: tl.constexpr,
                           NP: tl.constexpr, B: tl.constexpr):
    # one program per B x B block (g, kb, nb) of the weights w [G, K, N] (any float; read once,
    # zeros past K and N): its e4m3 values q [G, KP, NP] and one float32 scale s [G, KP / B, NP / B],
    # the scale and values as quantize_kernel's (moefast.parallel.fp8.quantize_blocks: the same bits)
    g = tl.program_id(0)
    kb = tl.program_id(1)
    nb = tl.program_id(2)
    k = kb * B + tl.arange(0, B)
    n = nb * B + tl.arange(0, B)
    w = tl.load(w_ptr + g * K * N + k[:, None] * N + n[None, :], mask=(k < K)[:, None] & (n < N)[None, :], other=0.0)
    w = w.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    s = tl.where(amax > 0, tl.maximum(amax * INV_MAX, TINY), 1.0)
    q = tl.minimum(tl.maximum(w * tl.math.div_rn(1.0, s), -448.0), 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + g * KP * NP + k[:, None] * NP + n[None, :], q)
    tl.store(s_ptr + (g * (KP // B) + kb) * (NP // B) + nb, s)
