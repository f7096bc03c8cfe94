"""Pallas kernel of the chunked gated delta rule (forward): one program per (row, head, value block),
a loop over the chunks inside it with the state in registers. A decay per head (g [B, T, H], Gated
DeltaNet) or per key channel (g [B, T, H, K], Kimi Delta Attention). The backward kernels are in
:mod:`.pallas_bwd`; the custom VJP joining them in :mod:`.ops`.

Dimension letters: B batch, T tokens, H heads, K key width, V value width, C tokens per chunk
(``chunk_size``), Tp = N·C the padded length, Kp and Vp the widths padded to powers of two (>= 16,
Triton's smallest dot), Vb value columns per program (``block_v``).

The math is :mod:`.chunked`'s, chunk by chunk (same segmented decay, same-run masks, the incoming
state read only by the run that continues it, the carried state built from the last run), for one
head and Vb of the V value columns. Per chunk, in float32 whatever the inputs' dtype
(:func:`_chunk_decays`):

1. ``G`` (segmented cumulative decay: it restarts at each document start inside the chunk) as a
   masked row sum over the chunk ([C]; per channel a 0/1-matrix product, [C, Kp]);
2. the decayed products ``QK_ij = sum_kappa q_i k_j D_ij`` and ``KK_ij`` with ``D_ij = exp(G_i -
   G_j)`` on same-run pairs j <= i, the exponent masked to 0 elsewhere *before* the exp and the
   result masked to 0 after. A decay per head: D is one [C, C] tile and QK = (q k^T) * D. Per key
   channel D is [C, C, Kp], too big for a program's registers, and ``e^{G_i} e^{-G_j}`` overflows
   once a channel's decay within a chunk passes about -88 (float32's exp range; a channel at -6 a
   token gets there in 15 tokens): the kernel forms D one column j at a time, ``exp(G - G_j)``
   [C, Kp] masked to i >= j in j's run (exponents <= 0 for g <= 0), and reduces it against the
   keys (C iterations per chunk, about C·C·Kp exps);
3. ``A = beta_i KK_ij`` strictly below the diagonal, and ``T = (I + A)^-1`` by forward
   substitution: C - 1 row updates of a [C, C] tile held in registers (the row of A picked by a
   masked sum), as fla's first Triton WY kernels did (T is recomputed by every value block of a
   head: it depends on k, g and beta only);
4. ``U = T (beta v)``, ``W = T (beta c e^G k)``, ``delta = U - W S``,
   ``o = (c e^G q) S + QK delta`` stored for the chunk's tokens, and
   ``S <- c_last e^{G_last} S + (k * m e^{G_last - G})^T delta`` (per channel, e^G and the carry
   per key row; e^G <= 1 and ``G_last - G <= 0`` on the last run, masked before the exp).

Every product is a float32 ``dot`` at ``Precision.HIGHEST`` (IEEE on the Triton backend, not TF32),
so the kernel equals the chunked jnp form to float32 rounding; Triton then emits them as float32
FMAs, not tensor-core MMAs (a TF32 or bfloat16 product mode would be faster and less exact).
Compiled through the Pallas Triton backend (``plt.CompilerParams``; deprecated since jax 0.11 in
favour of Mosaic GPU, still shipped); ``interpret=True`` runs it in the Pallas interpreter on CPU.
Status: tested in the interpreter and lowered for CUDA from a CPU machine (both decays); the
per-head forward's Triton IR was once compiled by hand to an sm_90a cubin with triton 3.9 and
ptxas 12.9 without a GPU; never run or timed on a GPU. The offline ptxas reports heavy register
spills at K = V = 128 (as it does for the routing kernel, so the offline figures are not
trusted); block sizes and warps are untuned guesses.

``states=True`` (:func:`gated_delta_rule_blocks`) runs the same loop without the outputs and
stores the state entering each chunk instead: the backward pass's forward recompute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..platform import target_platform
from ..vma import out_struct as _out_struct, vary_together
from .chunked import chunk_prep
from .reference import HIGHEST

__all__ = ["check_pallas_chunk_size", "check_vary", "compiler_params", "default_interpret", "gated_delta_rule_blocks",
           "input_specs", "padded_width", "prepare"]


def padded_width(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (Triton dots need every side >= 16)."""
    return max(16, 1 << (n - 1).bit_length())


def check_pallas_chunk_size(chunk_size) -> None:
    """Raises ValueError unless ``chunk_size`` is a power of two >= 16 (a Triton block side)."""
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16
            or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a power of two >= 16 for impl='pallas' (Triton block sides), "
                         f"got {chunk_size!r}")


def default_interpret() -> bool:
    """Interpret mode by default when compiling for CPU (:func:`~moefast.kernels.platform.target_platform`),
    where Pallas Triton kernels cannot be compiled."""
    return target_platform() == "cpu"


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """``a @ b`` (``a^T``, ``b^T`` as asked) in float32 at full precision."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


def _row(x, j, rows):
    """Row ``j`` (traced) of the register tile ``x`` [C, F] as [F], by a masked sum (Triton has no
    dynamic indexing of a tile); ``rows`` is the row iota of ``x``'s shape."""
    return jnp.sum(jnp.where(rows == j, x, 0.0), axis=0)


def _col(x, j, cols):
    """Column ``j`` (traced) of the [C, C] tile ``x`` as [C]; ``cols`` its column iota."""
    return jnp.sum(jnp.where(cols == j, x, 0.0), axis=1)


def _chunk_decays(q, k, g, beta, run, prev_run, *, per_channel: bool, with_qk: bool = True):
    """The chunk's quantities that do not depend on v or the state (one head, float32).

    Args:
      q: [C, Kp] scaled queries; k: [C, Kp] keys; g: [C] (a decay per head) or [C, Kp] (per key
        channel) log decays; beta: [C]; run: [C] int32 run ids; prev_run: the run id of the token
        before the chunk (int32 scalar; 0 before the row); ``with_qk``: form QK (``False``: None;
        the states pass has no outputs to compute).

    Returns:
      A dict: ``incl``, ``strict`` [C, C] bool (j <= i, j < i, same run); ``G`` [C] or [C, Kp] (the
      segmented cumulative decay); ``qk``, ``kk`` [C, C] (``sum_kappa x_i k_j D_ij[kappa]`` on
      ``incl``); ``decay`` D [C, C] (scalar decay only, else None); ``a`` A [C, C]; ``t`` T = (I +
      A)^-1 [C, C]; ``e_in`` [C] or [C, Kp] (``c e^G``, how token i reads the incoming state);
      ``k_fac`` [C] or [C, Kp] (``m e^{G_last - G}``); ``carry`` (``c_last e^{G_last}``, a scalar
      or [Kp]); ``rows``, ``cols``, ``pos``, ``is_last`` iotas and masks.
    """
    c = run.shape[0]
    f32 = jnp.float32
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)  # i
    cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)  # j
    pos = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)
    is_last = pos == c - 1
    same = run[:, None] == run[None, :]
    incl = same & (rows >= cols)
    strict = same & (rows > cols)
    if per_channel:
        # G_i[kappa] = sum of g_l[kappa] over l <= i in i's run: a 0/1 matrix product
        seg_decay = _dot(incl.astype(f32), g)  # [C, Kp]
        rows_ck = jax.lax.broadcasted_iota(jnp.int32, k.shape, 0)

        def column(j, carry):  # column j of QK and KK: x_i . (k_j * exp(G_i - G_j)) over i >= j in j's run
            qk, kk = carry
            k_j, g_j = _row(k, j, rows_ck), _row(seg_decay, j, rows_ck)  # [Kp]
            run_j = jnp.sum(jnp.where(pos == j, run, 0))
            m = ((run == run_j) & (pos >= j))[:, None]  # [C, 1]: D[:, j] is nonzero there
            ek = jnp.where(m, jnp.exp(jnp.where(m, seg_decay - g_j[None, :], 0.0)), 0.0) * k_j[None, :]
            if with_qk:
                qk = jnp.where(cols == j, jnp.sum(q * ek, axis=1)[:, None], qk)
            kk = jnp.where(cols == j, jnp.sum(k * ek, axis=1)[:, None], kk)
            return qk, kk

        zeros = jnp.zeros((c, c), f32)
        qk, kk = jax.lax.fori_loop(0, c, column, (zeros, zeros))
        qk = qk if with_qk else None
        decay = None
        g_last = _row(seg_decay, c - 1, rows_ck)  # [Kp]
        g_last_b = g_last[None, :]
    else:
        seg_decay = jnp.sum(jnp.where(incl, g[None, :], 0.0), axis=1)  # G [C]
        diff = seg_decay[:, None] - seg_decay[None, :]
        decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)  # D [C, C], masked before the exp
        qk = _dot(q, k, trans_b=True) * decay if with_qk else None
        kk = _dot(k, k, trans_b=True) * decay
        g_last = jnp.sum(jnp.where(is_last, seg_decay, 0.0))
        g_last_b = g_last
    a = jnp.where(strict, beta[:, None] * kk, 0.0)

    def substitute(i, t):  # row i of T = (I + A)^-1: e_i - sum_{j < i} A_ij T_j
        a_i = _row(a, i, rows)  # [C], A[i, :]
        t_i = jnp.where(pos == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * t, axis=0)
        return jnp.where(rows == i, t_i[None, :], t)

    t = jax.lax.fori_loop(1, c, substitute, (rows == cols).astype(f32))
    cont = (run == prev_run).astype(f32)  # [C]: continues the incoming state
    run_last = jnp.sum(jnp.where(is_last, run, 0))
    in_last = run == run_last
    cont_last = jnp.sum(jnp.where(is_last, cont, 0.0))
    if per_channel:
        e_in = cont[:, None] * jnp.exp(seg_decay)
        m = in_last[:, None]
        k_fac = jnp.where(m, jnp.exp(jnp.where(m, g_last_b - seg_decay, 0.0)), 0.0)
    else:
        e_in = cont * jnp.exp(seg_decay)
        k_fac = jnp.where(in_last, jnp.exp(jnp.where(in_last, g_last_b - seg_decay, 0.0)), 0.0)
    return dict(incl=incl, strict=strict, G=seg_decay, qk=qk, kk=kk, decay=decay, a=a, t=t, e_in=e_in,
                k_fac=k_fac, carry=cont_last * jnp.exp(g_last), run_last=run_last, rows=rows, cols=cols,
                pos=pos, is_last=is_last)


def _per_token(x, per_channel: bool):
    """A per-token factor [C] or [C, Kp] as a [C, 1 or Kp] multiplier of a [C, Kp] tile."""
    return x if per_channel else x[:, None]


def _state_rows(x, per_channel: bool):
    """The carried decay (scalar or [Kp]) as a multiplier of the state [Kp, Vb]."""
    return x[:, None] if per_channel else x


def _gated_delta_rule_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, s0_ref, *out_refs, scale: float,
                             chunk_size: int, num_chunks: int, per_channel: bool, states: bool):
    """One (row, head, value block): refs q, k [Tp, Kp]; v [Tp, Vb]; g [Tp] or [Tp, Kp] and beta [Tp]
    float32; run [Tp] int32; s0 [Kp, Vb] float32. Outputs: ``states=False``: o [Tp, Vb] and s (the
    final state) [Kp, Vb] float32; ``states=True``: the state entering every chunk, [N·Kp, Vb]
    float32 (chunk n at rows n·Kp .. n·Kp + Kp - 1), for the backward pass."""
    c = chunk_size
    f32 = jnp.float32
    kp = q_ref.shape[-1]

    def chunk(n, carry):
        s, prev_run = carry  # [Kp, Vb] float32; run id of the token before the chunk
        at = pl.ds(pl.multiple_of(n * c, c), c)
        if states:
            out_refs[0][pl.ds(pl.multiple_of(n * kp, kp), kp), :] = s
        q = q_ref[at, :].astype(f32) * scale  # [C, Kp]
        k = k_ref[at, :].astype(f32)  # [C, Kp]
        v = v_ref[at, :].astype(f32)  # [C, Vb]
        g = g_ref[at, :] if per_channel else g_ref[at]  # [C, Kp] or [C]
        beta = beta_ref[at]  # [C]
        x = _chunk_decays(q, k, g, beta, run_ref[at], prev_run, per_channel=per_channel, with_qk=not states)
        e_in = _per_token(x["e_in"], per_channel)
        u = _dot(x["t"], beta[:, None] * v)  # [C, Vb]
        w = _dot(x["t"], beta[:, None] * e_in * k)  # [C, Kp]
        delta = u - _dot(w, s)
        if not states:
            o = _dot(e_in * q, s) + _dot(x["qk"], delta)
            o_ref = out_refs[0]
            o_ref[at, :] = o.astype(o_ref.dtype)
        k_out = _per_token(x["k_fac"], per_channel) * k
        s = _state_rows(x["carry"], per_channel) * s + _dot(k_out, delta, trans_a=True)
        return s, x["run_last"]

    s, _ = jax.lax.fori_loop(0, num_chunks, chunk, (s0_ref[...].astype(f32), jnp.int32(0)))
    if not states:
        out_refs[1][...] = s


def prepare(q, k, v, g, beta, run, s0, *, chunk_size: int, block_v: int | None):
    """The kernels' padded inputs (shared by the forward and backward calls).

    Returns:
      ``(arrays, dims)``: arrays q, k [B, Tp, H, Kp] (their dtypes); v [B, Tp, H, Vp]; g [B, Tp, H]
      or [B, Tp, H, Kp] and beta [B, Tp, H] float32; run [B, Tp] int32; s0 [B, H, Kp, Vp] float32 —
      tokens padded with zeros (g = beta = 0, k = v = 0: the state is left alone) in the last
      token's run, widths with zeros; dims ``dict(t, kd, vd, tp, kp, vp, vb)``.

    Raises:
      ValueError: ``block_v`` not a power of two.
    """
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    tp, run = chunk_prep(run.astype(jnp.int32), b, t, chunk_size)
    kp, vp = padded_width(kd), padded_width(vd)
    if block_v is None:
        block_v = 32 if kp >= 128 else 64
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    vb = min(block_v, vp)

    def pad(x, width=None):  # tokens to Tp, features to width
        widths = [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2)
        if width is not None:
            widths[-1] = (0, width - x.shape[-1])
        return jnp.pad(x, widths) if any(w for _, w in widths) else x

    q, k, v = pad(q, kp), pad(k, kp), pad(v, vp)
    g = pad(g.astype(jnp.float32), kp if g.ndim == 4 else None)
    beta = pad(beta.astype(jnp.float32))
    s0 = s0.astype(jnp.float32)
    if (kp, vp) != (kd, vd):
        s0 = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - kd), (0, vp - vd)))
    return (q, k, v, g, beta, run, s0), dict(t=t, kd=kd, vd=vd, tp=tp, kp=kp, vp=vp, vb=vb)


def check_vary(arrays, interpret: bool):
    """``arrays`` made to vary together (:func:`..vma.vary_together`).

    Raises:
      NotImplementedError: interpret mode on arrays varying over mesh axes (inside
        ``jax.shard_map(check_vma=True)``).
    """
    arrays, axes = vary_together(*arrays)
    if axes and interpret:
        raise NotImplementedError(
            f"the Pallas interpreter cannot run inside jax.shard_map(check_vma=True) on arrays varying over "
            f"{sorted(axes, key=str)}: use impl='chunked' on CPU, or shard_map(..., check_vma=False)")
    return arrays


def input_specs(tp: int, kp: int, vb: int, per_channel: bool):
    """BlockSpecs of q, k, v, g, beta, run and an [Kp, Vb] state block over the (B, H, Vp / Vb) grid."""
    qk_spec = pl.BlockSpec((None, tp, None, kp), lambda bi, hi, vi: (bi, 0, hi, 0))
    v_spec = pl.BlockSpec((None, tp, None, vb), lambda bi, hi, vi: (bi, 0, hi, vi))
    gb_spec = pl.BlockSpec((None, tp, None), lambda bi, hi, vi: (bi, 0, hi))
    g_spec = qk_spec if per_channel else gb_spec
    run_spec = pl.BlockSpec((None, tp), lambda bi, hi, vi: (bi, 0))
    s_spec = pl.BlockSpec((None, None, kp, vb), lambda bi, hi, vi: (bi, hi, 0, vi))
    return dict(q=qk_spec, v=v_spec, g=g_spec, beta=gb_spec, run=run_spec, s=s_spec)


def compiler_params(interpret: bool, num_warps: int | None, num_stages: int | None):
    """Triton compiler parameters (``None`` in interpret mode); warps 4 and stages 1 by default."""
    return None if interpret else plt.CompilerParams(
        num_warps=4 if num_warps is None else num_warps, num_stages=1 if num_stages is None else num_stages)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret", "block_v", "num_warps",
                                             "num_stages", "states"))
def gated_delta_rule_blocks(q, k, v, g, beta, run, s0, *, scale: float, chunk_size: int = 64,
                            interpret: bool = True, block_v: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, states: bool = False):
    """Runs the forward kernel over a (B, H, Vp / Vb) grid (no custom VJP: see :mod:`.ops`).

    Args:
      q: [B, T, H, K] and k: [B, T, H, K], any float dtype (upcast in the kernel).
      v: [B, T, H, V], any float dtype; the output takes its dtype.
      g: [B, T, H] log decay (one per head) or [B, T, H, K] (one per key channel, KDA), any float
        dtype (float32 in the kernel).
      beta: [B, T, H], any float dtype (float32 in the kernel).
      run: [B, T] int32 run ids (:func:`.reference.run_ids`).
      s0: [B, H, K, V] float32 initial state.
      scale: query scale (dimensionless).
      chunk_size: C, a power of two >= 16 (checked by the caller); T need not be a multiple of it.
      interpret: run in the Pallas interpreter (CPU) instead of compiling.
      block_v: Vb, value columns per program, a power of two; ``None``: 32 for Kp >= 128, else 64
        (capped at Vp).
      num_warps, num_stages: Triton compiler parameters (compiled mode only); ``None``: 4 and 1.
      states: return the state entering every chunk instead (the backward pass's forward recompute).

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``; ``states=True``: the
      padded states entering each chunk, [B, H, N·Kp, Vp] float32 (chunk n at rows n·Kp ..
      n·Kp + Kp - 1; N = ceil(T / C), Kp, Vp the padded widths).

    Raises:
      ValueError: ``block_v`` not a power of two.
      NotImplementedError: ``interpret=True`` inside ``jax.shard_map(check_vma=True)`` on varying
        inputs (the Pallas interpreter cannot run there; the compiled kernel can).
    """
    b, _, h, _ = q.shape
    per_channel = g.ndim == 4
    arrays, d = prepare(q, k, v, g, beta, run, s0, chunk_size=chunk_size, block_v=block_v)
    q, k, v, g, beta, run, s0 = check_vary(arrays, interpret)
    tp, kp, vp, vb = d["tp"], d["kp"], d["vp"], d["vb"]
    n = tp // chunk_size
    out_struct = functools.partial(_out_struct, q)
    kernel = functools.partial(_gated_delta_rule_kernel, scale=scale, chunk_size=chunk_size, num_chunks=n,
                               per_channel=per_channel, states=states)
    sp = input_specs(tp, kp, vb, per_channel)
    if states:
        out_specs = [pl.BlockSpec((None, None, n * kp, vb), lambda bi, hi, vi: (bi, hi, 0, vi))]
        out_shape = [out_struct((b, h, n * kp, vp), jnp.float32)]
    else:
        out_specs = [sp["v"], sp["s"]]
        out_shape = [out_struct((b, tp, h, vp), v.dtype), out_struct((b, h, kp, vp), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, vp // vb),
        in_specs=[sp["q"], sp["q"], sp["v"], sp["g"], sp["beta"], sp["run"], sp["s"]],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params(interpret, num_warps, num_stages),
        name="gated_delta_rule_states" if states else "gated_delta_rule",
    )(q, k, v, g, beta, run, s0)
    if states:
        return outs[0]
    o, s = outs
    return o[:, :d["t"], :, :d["vd"]], s[:, :, :d["kd"], :d["vd"]]
