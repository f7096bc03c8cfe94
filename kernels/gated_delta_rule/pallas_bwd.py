"""Pallas backward kernel of the chunked gated delta rule: dq, dk, dv, dg, dbeta and d(initial
state), for a decay per head (g [B, T, H]) and per key channel (KDA, g [B, T, H, K]).

Dimension letters as in :mod:`.pallas`: B batch, T tokens, H heads, K key width, V value width, C
tokens per chunk, N = Tp / C chunks, Kp and Vp the padded widths, Vb value columns per program, Nv
= Vp / Vb value blocks.

Design (the structure of fla's ``chunk_gated_delta_rule`` backward, written from the math of
:mod:`.chunked`; no fla code):

1. **Forward recompute** (:func:`.pallas.gated_delta_rule_blocks` with ``states=True``, the forward
   kernel without outputs): the state entering every chunk, S_n [Kp, Vb] per program, float32, to
   HBM: [B, H, N·Kp, Vp] in all (4·N·Kp·Vp bytes per row and head: 4 MiB at T = 4096, C = 64,
   K = V = 128).
2. **Reverse loop** (this module's kernel): one program per (row, head, value block), grid
   (B, H, Nv), chunks n = N-1 .. 0 with dS [Kp, Vb] (the cotangent of the state leaving chunk n)
   in registers, starting from d(final state). Per chunk it reloads S_n and the chunk's inputs,
   recomputes the chunk's v-free quantities (:func:`.pallas._chunk_decays`: G, D, A, T = (I + A)^-1,
   the decayed products QK and KK) and U, W, delta for its value columns, and back-propagates
   through (notation of :mod:`.chunked`; ``e_in = c e^G``, ``Kb = beta e_in k``,
   ``k_out = m e^{G_last - G} k``)::

       S' = c_last e^{G_last} S + k_out^T delta   o = (e_in q) S + QK delta
       delta = U - W S                            U = T (beta v),   W = T Kb,   T = (I + A)^-1

   giving, per chunk (all [C, C], [C, Kp] or [C, Vb] tiles)::

       d_delta = k_out dS + QK^T dO              dQK = dO delta^T (on j <= i, same run)
       dW = -d_delta S^T                         dT = d_delta (beta v)^T + dW Kb^T
       dA = -T^T dT T^T (strictly lower, same run)     dKK = beta_i dA_ij
       dS <- c_last e^{G_last} dS + (e_in q)^T dO - W^T d_delta

   and dq, dk, dbeta, dG from the products: with R_q = sum_j dQK_ij D_ij k_j, R_k = sum_j dKK_ij
   D_ij k_j and R_col = sum_i (dQK_ij q_i + dKK_ij k_i) D_ij (each [C, Kp], D per channel for KDA),
   ``dq += R_q``, ``dk += R_k + R_col`` and, since d D_ij / d G_i = D_ij = -d D_ij / d G_j,
   ``dG += q R_q + k (R_k - R_col)`` per channel (summed over channels for a decay per head);
   the ``e^G`` factors add ``e_in q dQs + Kb dKb - k_out d_kout`` to dG and their sums to dG_last.
   Finally dg = incl^T dG (the transpose of the segmented cumulative sum: a reverse cumulative sum
   within each run of the chunk). The initial state's gradient is dS after chunk 0: the first run
   reads S only through the c = 1 tokens, so later documents never reach it.

Value blocks: dv and d(initial state) belong to one value block; dq, dk, dg and dbeta sum over all
V columns. Every one of them is linear in the cotangents once the forward quantities are fixed, so
each program writes its value block's share ([Nv, B, Tp, H, ...] float32) and the wrapper sums
over Nv (Nv = 1 when Vp <= Vb; 4 at K = V = 128 with the default Vb = 32).

Decays kept in range: the decay between tokens j <= i of one run of a chunk is ``exp(G_i - G_j)``
with G the *segmented* cumulative sum (it restarts at a document start), and the exponent is
masked to 0 outside (j <= i, same run) before the exp, the result masked to 0 after; the state's
carry is ``exp(G_last)`` and ``exp(G_last - G_i)`` on the last run only (exponent <= 0 for
g <= 0). For a decay per key channel D is [C, C, Kp], which a Triton program cannot hold: the
kernels form it one column j at a time (``exp(G - G_j)`` [C, Kp], masked, C iterations per chunk),
never as ``e^{G_i} e^{-G_j}``, which overflows once a channel's decay in a chunk passes about -88.
Every product is a float32 ``dot`` at ``Precision.HIGHEST``, as in the forward kernel.

Status: tested in the Pallas interpreter against the chunked form's VJP and the recurrence, and
lowered for CUDA from a CPU machine (Pallas Triton backend); never run or timed on a GPU (none
was available). Block sizes and warps are untuned guesses; the per-channel column loop costs
about C·C·Kp exps per chunk and value block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..vma import out_struct as _out_struct
from .pallas import (_chunk_decays, _col, _dot, _per_token, _row, _state_rows, check_vary, compiler_params,
                     gated_delta_rule_blocks, input_specs, prepare)

__all__ = ["gated_delta_rule_bwd_blocks"]


def _decayed_products_bwd(q, k, x, d_qk, d_kk, *, per_channel: bool):
    """``(R_q, R_k, R_col)`` [C, Kp] each (module docstring): the cotangents that the decayed
    products QK = sum_kappa q_i k_j D_ij and KK = sum_kappa k_i k_j D_ij send to their factors."""
    if not per_channel:
        dqk_d, dkk_d = d_qk * x["decay"], d_kk * x["decay"]
        return (_dot(dqk_d, k), _dot(dkk_d, k),
                _dot(dqk_d, q, trans_a=True) + _dot(dkk_d, k, trans_a=True))
    cols, g = x["cols"], x["G"]
    rows_ck = jax.lax.broadcasted_iota(jnp.int32, k.shape, 0)
    incl_f = x["incl"].astype(jnp.float32)

    def column(j, carry):
        r_q, r_k, r_col = carry
        k_j, g_j = _row(k, j, rows_ck), _row(g, j, rows_ck)  # [Kp]
        m = (_col(incl_f, j, cols) > 0)[:, None]  # [C, 1]: i >= j in j's run
        e = jnp.where(m, jnp.exp(jnp.where(m, g - g_j[None, :], 0.0)), 0.0)  # D[:, j, :] [C, Kp]
        dqk_j, dkk_j = _col(d_qk, j, cols)[:, None], _col(d_kk, j, cols)[:, None]  # [C, 1]
        ek = e * k_j[None, :]
        r_q = r_q + dqk_j * ek
        r_k = r_k + dkk_j * ek
        col = jnp.sum(e * (dqk_j * q + dkk_j * k), axis=0)  # [Kp]
        return r_q, r_k, jnp.where(rows_ck == j, col[None, :], r_col)

    zeros = jnp.zeros(k.shape, jnp.float32)
    return jax.lax.fori_loop(0, k.shape[0], column, (zeros, zeros, zeros))


def _gated_delta_rule_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, states_ref, do_ref, ds_ref,
                                 dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, ds0_ref, *, scale: float,
                                 chunk_size: int, num_chunks: int, per_channel: bool):
    """One (row, head, value block), chunks in reverse: refs q, k [Tp, Kp]; v, do [Tp, Vb]; g [Tp]
    or [Tp, Kp]; beta [Tp]; run [Tp] int32; states [N·Kp, Vb]; ds (d final state) [Kp, Vb].
    Outputs (float32): dq, dk [Tp, Kp] (this value block's shares; dq with respect to the unscaled
    q); dv [Tp, Vb]; dg [Tp] or [Tp, Kp] and dbeta [Tp] (shares); ds0 [Kp, Vb]."""
    c = chunk_size
    f32 = jnp.float32
    kp = q_ref.shape[-1]
    pos = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)

    def chunk(i, ds):
        n = num_chunks - 1 - i
        at = pl.ds(pl.multiple_of(n * c, c), c)
        before = pl.ds(pl.multiple_of(jnp.maximum(n - 1, 0) * c, c), c)
        prev_run = jnp.where(n > 0, jnp.sum(jnp.where(pos == c - 1, run_ref[before], 0)), 0)
        s = states_ref[pl.ds(pl.multiple_of(n * kp, kp), kp), :]  # [Kp, Vb], entering the chunk
        q = q_ref[at, :].astype(f32) * scale
        k = k_ref[at, :].astype(f32)
        v = v_ref[at, :].astype(f32)
        do = do_ref[at, :].astype(f32)
        g = g_ref[at, :] if per_channel else g_ref[at]
        beta = beta_ref[at]
        x = _chunk_decays(q, k, g, beta, run_ref[at], prev_run, per_channel=per_channel)
        t = x["t"]
        e_in = _per_token(x["e_in"], per_channel)  # [C, 1 or Kp]
        k_fac = _per_token(x["k_fac"], per_channel)
        q_in, kb, k_out = e_in * q, beta[:, None] * e_in * k, k_fac * k
        bv = beta[:, None] * v
        w = _dot(t, kb)  # [C, Kp]
        delta = _dot(t, bv) - _dot(w, s)  # [C, Vb]

        # S' = carry S + k_out^T delta
        d_kout = _dot(delta, ds, trans_b=True)  # [C, Kp]
        d_delta = _dot(k_out, ds)  # [C, Vb]
        d_carry = jnp.sum(s * ds, axis=1) if per_channel else jnp.sum(s * ds)  # [Kp] or scalar
        ds_prev = _state_rows(x["carry"], per_channel) * ds
        # o = q_in S + QK delta
        ds_prev = ds_prev + _dot(q_in, do, trans_a=True)
        d_qin = _dot(do, s, trans_b=True)  # [C, Kp]
        d_qk = jnp.where(x["incl"], _dot(do, delta, trans_b=True), 0.0)  # [C, C]
        d_delta = d_delta + _dot(x["qk"], do, trans_a=True)
        # delta = T bv - W S
        ds_prev = ds_prev - _dot(w, d_delta, trans_a=True)
        d_w = -_dot(d_delta, s, trans_b=True)  # [C, Kp]
        d_t = _dot(d_delta, bv, trans_b=True) + _dot(d_w, kb, trans_b=True)  # [C, C]
        d_bv = _dot(t, d_delta, trans_a=True)  # [C, Vb]
        d_kb = _dot(t, d_w, trans_a=True)  # [C, Kp]
        # T = (I + A)^-1, A = beta_i KK_ij (strict)
        d_a = jnp.where(x["strict"], -_dot(_dot(t, d_t, trans_a=True), t, trans_b=True), 0.0)
        d_kk = beta[:, None] * d_a
        r_q, r_k, r_col = _decayed_products_bwd(q, k, x, d_qk, d_kk, per_channel=per_channel)

        dq = (e_in * d_qin + r_q) * scale
        dk = r_k + r_col + beta[:, None] * e_in * d_kb + k_fac * d_kout
        dbeta = (jnp.sum(d_a * x["kk"], axis=1) + jnp.sum(v * d_bv, axis=1)
                 + jnp.sum(e_in * k * d_kb, axis=1))
        p_out = k_out * d_kout  # [C, Kp]
        dg_tok = q * r_q + k * (r_k - r_col) + q_in * d_qin + kb * d_kb - p_out  # [C, Kp], per channel
        if per_channel:
            d_last = jnp.sum(p_out, axis=0) + x["carry"] * d_carry  # [Kp]: d G_last
            d_gcum = dg_tok + jnp.where(x["is_last"][:, None], d_last[None, :], 0.0)
            dg = _dot(x["incl"].astype(f32), d_gcum, trans_a=True)  # dg_l = sum_{i >= l, same run} dG_i
            dg_ref[at, :] = dg
        else:
            d_last = jnp.sum(p_out) + x["carry"] * d_carry
            d_gcum = jnp.sum(dg_tok, axis=1) + jnp.where(x["is_last"], d_last, 0.0)  # [C]
            dg_ref[at] = jnp.sum(jnp.where(x["incl"], d_gcum[:, None], 0.0), axis=0)
        dq_ref[at, :] = dq
        dk_ref[at, :] = dk
        dv_ref[at, :] = beta[:, None] * d_bv
        dbeta_ref[at] = dbeta
        return ds_prev

    ds0_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, ds_ref[...].astype(f32))


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret", "block_v", "num_warps",
                                             "num_stages"))
def gated_delta_rule_bwd_blocks(q, k, v, g, beta, run, s0, do, ds, *, scale: float, chunk_size: int = 64,
                                interpret: bool = True, block_v: int | None = None, num_warps: int | None = None,
                                num_stages: int | None = None):
    """The gradient of :func:`.pallas.gated_delta_rule_blocks`'s ``(o, final_state)``: two kernels,
    the forward recompute of the chunks' states and the reverse loop (module docstring).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or [B, T, H, K] (KDA); beta: [B, T, H]
        (any float dtypes); run: [B, T] int32 run ids; s0: [B, H, K, V] float32: the forward's
        arguments.
      do: [B, T, H, V] cotangent of o (any float dtype); ds: [B, H, K, V] cotangent of the final
        state (float32).
      scale, chunk_size, interpret, block_v, num_warps, num_stages: as the forward's
        (:func:`.pallas.gated_delta_rule_blocks`).

    Returns:
      ``(dq, dk [B, T, H, K], dv [B, T, H, V], dg (g's shape), dbeta [B, T, H], ds0 [B, H, K, V])``,
      all float32.

    Raises:
      ValueError: ``block_v`` not a power of two.
      NotImplementedError: ``interpret=True`` inside ``jax.shard_map(check_vma=True)`` on varying
        inputs.
    """
    b, t, h, kd = q.shape
    per_channel = g.ndim == 4
    states = gated_delta_rule_blocks(q, k, v, g, beta, run, s0, scale=scale, chunk_size=chunk_size,
                                     interpret=interpret, block_v=block_v, num_warps=num_warps,
                                     num_stages=num_stages, states=True)  # [B, H, N·Kp, Vp]
    arrays, d = prepare(q, k, v, g, beta, run, s0, chunk_size=chunk_size, block_v=block_v)
    q, k, v, g, beta, run, _ = arrays
    tp, kp, vp, vb, vd = d["tp"], d["kp"], d["vp"], d["vb"], d["vd"]
    do = jnp.pad(do, ((0, 0), (0, tp - t), (0, 0), (0, vp - vd)))
    ds = jnp.pad(ds.astype(jnp.float32), ((0, 0), (0, 0), (0, kp - kd), (0, vp - vd)))
    q, k, v, g, beta, run, states, do, ds = check_vary((q, k, v, g, beta, run, states, do, ds), interpret)
    n, nv = tp // chunk_size, vp // vb
    out_struct = functools.partial(_out_struct, q)
    sp = input_specs(tp, kp, vb, per_channel)
    share = lambda block: pl.BlockSpec((None, *block), lambda bi, hi, vi: (vi, bi, 0, hi) + (0,) * (len(block) - 3))
    gk = (kp,) if per_channel else ()
    kernel = functools.partial(_gated_delta_rule_bwd_kernel, scale=scale, chunk_size=chunk_size, num_chunks=n,
                               per_channel=per_channel)
    dq, dk, dv, dg, dbeta, ds0 = pl.pallas_call(
        kernel,
        grid=(b, h, nv),
        in_specs=[sp["q"], sp["q"], sp["v"], sp["g"], sp["beta"], sp["run"],
                  pl.BlockSpec((None, None, n * kp, vb), lambda bi, hi, vi: (bi, hi, 0, vi)), sp["v"], sp["s"]],
        out_specs=[share((None, tp, None, kp)), share((None, tp, None, kp)), sp["v"], share((None, tp, None, *gk)),
                   share((None, tp, None)), sp["s"]],
        out_shape=[out_struct((nv, b, tp, h, kp), jnp.float32), out_struct((nv, b, tp, h, kp), jnp.float32),
                   out_struct((b, tp, h, vp), jnp.float32), out_struct((nv, b, tp, h, *gk), jnp.float32),
                   out_struct((nv, b, tp, h), jnp.float32), out_struct((b, h, kp, vp), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params(interpret, num_warps, num_stages),
        name="gated_delta_rule_bwd",
    )(q, k, v, g, beta, run, states, do, ds)
    total = lambda x: jnp.sum(x, axis=0)[:, :t]  # the value blocks' shares, padded tokens dropped
    dq, dk, dg, dbeta = total(dq)[..., :kd], total(dk)[..., :kd], total(dg), total(dbeta)
    if per_channel:
        dg = dg[..., :kd]
    return dq, dk, dv[:, :t, :, :vd], dg, dbeta, ds0[:, :, :kd, :vd]
