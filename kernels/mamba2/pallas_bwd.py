"""Pallas backward kernel of Mamba-2's chunked SSD scan: dx, d(dt), d(a), dB, dC and d(initial
state), where a = dt·A is the log decay (the wrapper in :mod:`.ops` turns d(a) into dA and the
rest of d(dt) by JAX autodiff of that product).

Dimension letters as in :mod:`.pallas`: B batch, T tokens, H heads, P head dim, G groups, R = H / G,
N state size, Q tokens per chunk, Z = Tp / Q chunks, Pp and Np the padded widths, Pb head-dim
columns per program, Nv = Pp / Pb head-dim blocks.

Design (the structure of the gated delta rule's Pallas backward,
:mod:`moefast.kernels.gated_delta_rule.pallas_bwd`, and of mamba_ssm's chunked backward, written
from the math of :mod:`.chunked`; no code copied):

1. **Forward recompute** (:func:`.pallas.ssd_blocks` with ``states=True``, the forward kernel
   without outputs): the state entering every chunk, S_z [Pb, Np] per program, float32, to HBM:
   [B, H, Nv·Z·Pb, Np] in all (4·Z·Pp·Np bytes per row and head: 2 MiB at T = 8192, Q = 128,
   P = 64, N = 128).
2. **Reverse loop** (this module's kernel): one program per (row, head, head-dim block), grid
   (B, H, Nv), chunks z = Z-1 .. 0 with dS [Pb, Np] (the cotangent of the state leaving chunk z)
   in registers, starting from d(final state). Per chunk it reloads S_z and the chunk's inputs,
   recomputes the decays (:func:`.pallas.chunk_decays`: L, ``q_in = c e^G``, ``k_fac`` = L's last
   row, ``carry = c_last e^{G_last}``) and ``CB = C B^T``, and back-propagates through::

       y  = (CB * L) xd + q_in (C S^T)          S' = carry S + (k_fac xd)^T B

   giving, per chunk (all [Q, Q], [Q, Pb] or [Q, Np] tiles)::

       dM    = dy xd^T (s <= l, same run)       dCB = dM * L,   dL = dM * CB (+ d k_fac on L's last row)
       dxd   = (CB * L)^T dy + k_fac (B dS^T)   d k_fac = sum_p xd (B dS^T)
       dB    = (k_fac xd) dS + dCB^T C          dC = q_in (dy S) + dCB B
       d q_in = sum_p dy (C S^T)                d carry = <S, dS>
       dS   <- carry dS + (q_in dy)^T C

   and the decays' gradient through the segmented cumulative decay G (L_ls = e^{G_l - G_s} on
   one run, q_in = c e^G, carry = c_last e^{G_last}): with Pm = dL * L,
   ``dG = rowsum(Pm) - colsum(Pm) + d q_in * q_in (+ d carry * carry at the last token)`` and
   ``da = incl^T dG`` (a reverse cumulative sum within each run of the chunk: da_k = sum of dG_l
   over l >= k in k's run). Finally dx = dxd·dt and d(dt) = sum_p dxd·x. The initial state's
   gradient is dS after chunk 0: the first run reads S only through the c = 1 tokens, so later
   documents never reach it.

Head-dim blocks and groups: dx and d(initial state) belong to one (head, block); d(dt) and d(a)
sum over the head's Nv blocks, dB and dC over its blocks and over the R heads of its group. Each
is linear in the cotangents once the forward quantities are fixed, so each program writes its
share ([Nv, B, Tp, H, ...] float32) and the wrapper sums the shares (deterministic: no atomics).
The dB and dC shares cost 2·Nv·H/G times the size of B in float32 transiently (16x for
Nemotron-H's P = 64 in blocks of 32 and 8 heads a group): float32 atomic adds into [B, Tp, G, Np]
would avoid that, at the price of a run-to-run varying summation order.

The products are the forward kernel's (float32 operands, three-pass TF32 when compiled, exact
float32 in the interpreter; chunks of at most 64 tokens: at 128 this kernel asks for 256 KiB of
shared memory and does not compile for an H100). Status: tested in the Pallas interpreter against
the chunked form's VJP and the recurrence's gradients, lowered for CUDA and compiled to sm_90a PTX
for a compile-only H100 from a CPU machine (offline ptxas: 255 registers a thread and 5,552 bytes
of spill stores at Nemotron-H's widths, 8 warps); never run or timed on a GPU (none was
available). Block sizes and warps are untuned guesses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..vma import out_struct as _out_struct
from .pallas import _dot, check_vary, chunk_decays, compiler_params, dot_precision, input_specs, prepare, ssd_blocks

__all__ = ["BACKWARD_NAME", "NUM_WARPS", "ssd_bwd_blocks"]

BACKWARD_NAME = "moefast_ssd_bwd"
NUM_WARPS = 8  # the reverse loop's default (the states recompute: pallas.NUM_WARPS)


def _ssd_bwd_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, run_ref, states_ref, dy_ref, ds_ref,
                    dx_ref, ddt_ref, da_ref, db_ref, dc_ref, ds0_ref, *, chunk_size: int, num_chunks: int,
                    precision):
    """One (row, head, head-dim block), chunks in reverse, states transposed as in the forward
    kernel: refs x, dy [Tp, Pb]; dt, a [Tp] float32; b, c [Tp, Np] (the head's group); run [Tp]
    int32; states [Z·Np, Pb]; ds (d final state) [Np, Pb]. Outputs (float32): dx [Tp, Pb]; ddt, da
    [Tp] and db, dc [Tp, Np] (this program's shares); ds0 [Np, Pb]."""
    q = chunk_size
    f32 = jnp.float32
    np_ = b_ref.shape[-1]
    pos = jax.lax.broadcasted_iota(jnp.int32, (q,), 0)

    def chunk(i, ds):
        z = num_chunks - 1 - i
        at = pl.ds(pl.multiple_of(z * q, q), q)
        before = pl.ds(pl.multiple_of(jnp.maximum(z - 1, 0) * q, q), q)
        prev_run = jnp.where(z > 0, jnp.sum(jnp.where(pos == q - 1, run_ref[before], 0)), 0)
        s = states_ref[pl.ds(pl.multiple_of(z * np_, np_), np_), :]  # S^T [Np, Pb], entering the chunk
        x = x_ref[at, :].astype(f32)
        dt = dt_ref[at]
        xd = x * dt[:, None]  # [Q, Pb]
        dy = dy_ref[at, :].astype(f32)  # [Q, Pb]
        d = chunk_decays(a_ref[at], run_ref[at], prev_run)
        decay, q_in, k_fac, carry = d["decay"], d["q_in"], d["k_fac"], d["carry"]
        # in an order that ends each [Q, Np] tile's life early (dC, then dB, stored at once)
        bm = b_ref[at, :].astype(f32)  # [Q, Np]
        cm = c_ref[at, :].astype(f32)
        cb = _dot(cm, bm, precision, trans_b=True)  # [Q, Q]
        # y = (CB * L) xd + q_in (C S^T)
        d_m = jnp.where(d["incl"], _dot(dy, xd, precision, trans_b=True), 0.0)  # dM [Q, Q]
        d_cb = d_m * decay
        dy_in = q_in[:, None] * dy
        dc_ref[at, :] = _dot(dy_in, s, precision, trans_b=True) + _dot(d_cb, bm, precision)  # [Q, Np]
        d_qin = jnp.sum(dy * _dot(cm, s, precision), axis=1)  # [Q]
        ds_prev = carry * ds + _dot(cm, dy_in, precision, trans_a=True)  # [Np, Pb]
        # S'^T = carry S^T + B^T (k_fac xd)
        d_xk = _dot(bm, ds, precision)  # [Q, Pb]
        db_ref[at, :] = (_dot(k_fac[:, None] * xd, ds, precision, trans_b=True)
                         + _dot(d_cb, cm, precision, trans_a=True))  # [Q, Np]
        d_carry = jnp.sum(s * ds)
        d_xd = _dot(cb * decay, dy, precision, trans_a=True) + k_fac[:, None] * d_xk  # [Q, Pb]
        # the decays: L (k_fac is its last row), q_in = c e^G, carry = c_last e^{G_last}
        d_kfac = jnp.sum(xd * d_xk, axis=1)  # [Q]
        # dL * L off the diagonal (L_ll = 1 whatever a: its rowsum and colsum terms cancel exactly,
        # and summed in float32 they would leave rounding of dL's size where the true d(a) is tiny)
        strict = d["incl"] & (d["rows"] > d["cols"])
        pm = jnp.where(strict, (d_m * cb + jnp.where(d["rows"] == q - 1, d_kfac[None, :], 0.0)) * decay, 0.0)
        d_cum = (jnp.sum(pm, axis=1) - jnp.sum(pm, axis=0) + d_qin * q_in
                 + jnp.where(d["is_last"], d_carry * carry, 0.0))  # dG [Q]
        da_ref[at] = jnp.sum(jnp.where(d["incl"], d_cum[:, None], 0.0), axis=0)  # da_k = sum_{l >= k, same run} dG_l
        dx_ref[at, :] = d_xd * dt[:, None]
        ddt_ref[at] = jnp.sum(d_xd * x, axis=1)
        return ds_prev

    ds0_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, ds_ref[...].astype(f32))


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "block_p", "num_warps", "num_stages"))
def ssd_bwd_blocks(x, dt, a, B, C, run, s0, dy, ds, *, chunk_size: int = 128, interpret: bool = True,
                   block_p: int | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """The gradient of :func:`.pallas.ssd_blocks`'s ``(y, final_state)``: two kernels, the forward
    recompute of the chunks' states and the reverse loop (module docstring).

    Args:
      x: [B, T, H, P]; dt: [B, T, H]; a: [B, T, H] float32 (dt·A); B, C: [B, T, G, N] (any float
        dtypes); run: [B, T] int32 run ids; s0: [B, H, P, N] float32: the forward's arguments.
      dy: [B, T, H, P] cotangent of y (any float dtype); ds: [B, H, P, N] cotangent of the final
        state (float32).
      chunk_size, interpret, block_p, num_stages: as the forward's (:func:`.pallas.ssd_blocks`).
      num_warps: Triton warps of both kernels; ``None``: :data:`.pallas.NUM_WARPS` for the states
        recompute and :data:`NUM_WARPS` for the reverse loop.

    Returns:
      ``(dx [B, T, H, P], ddt [B, T, H], da [B, T, H], dB, dC [B, T, G, N], ds0 [B, H, P, N])``,
      all float32; ddt is the gradient through xd = dt·x only (not through a).

    Raises:
      ValueError: ``block_p`` not a power of two.
      NotImplementedError: ``interpret=True`` inside ``jax.shard_map(check_vma=True)`` on varying
        inputs.
    """
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    states = ssd_blocks(x, dt, a, B, C, run, s0, chunk_size=chunk_size, interpret=interpret, block_p=block_p,
                        num_warps=num_warps, num_stages=num_stages, states=True)  # [B, H, Z·Np, Pp]
    arrays, d = prepare(x, dt, a, B, C, run, s0, chunk_size=chunk_size, block_p=block_p)
    x, dt, a, B, C, run, _ = arrays
    tp, pp, np_, pb = d["tp"], d["pp"], d["np"], d["pb"]
    dy = jnp.pad(dy, ((0, 0), (0, tp - t), (0, 0), (0, pp - p)))
    ds = jnp.pad(jnp.swapaxes(ds.astype(jnp.float32), 2, 3), ((0, 0), (0, 0), (0, np_ - n), (0, pp - p)))
    x, dt, a, B, C, run, states, dy, ds = check_vary((x, dt, a, B, C, run, states, dy, ds), interpret)
    z, nv = tp // chunk_size, pp // pb
    out_struct = functools.partial(_out_struct, x)
    sp = input_specs(tp, np_, pb, d["r"], z)
    share = lambda *block: pl.BlockSpec((None, None, tp, None, *block),
                                        lambda bi, hi, pi: (pi, bi, 0, hi) + (0,) * len(block))
    kernel = functools.partial(_ssd_bwd_kernel, chunk_size=chunk_size, num_chunks=z,
                               precision=dot_precision(interpret))
    dx, ddt, da, db, dc, ds0 = pl.pallas_call(
        kernel,
        grid=(b, h, nv),
        in_specs=[sp["x"], sp["th"], sp["th"], sp["bc"], sp["bc"], sp["run"], sp["states"], sp["x"], sp["s"]],
        out_specs=[sp["x"], share(), share(), share(np_), share(np_), sp["s"]],
        out_shape=[out_struct((b, tp, h, pp), jnp.float32), out_struct((nv, b, tp, h), jnp.float32),
                   out_struct((nv, b, tp, h), jnp.float32), out_struct((nv, b, tp, h, np_), jnp.float32),
                   out_struct((nv, b, tp, h, np_), jnp.float32), out_struct((b, h, np_, pp), jnp.float32)],
        interpret=interpret,
        compiler_params=compiler_params(interpret, num_warps, num_stages, default_warps=NUM_WARPS),
        name=BACKWARD_NAME,
    )(x, dt, a, B, C, run, states, dy, ds)
    total = lambda arr: jnp.sum(arr, axis=0)[:, :t]  # the head-dim blocks' shares, padded tokens dropped
    per_group = lambda arr: total(arr).reshape(b, t, g, h // g, np_).sum(axis=3)[..., :n]  # the group's heads
    return (dx[:, :t, :, :p], total(ddt), total(da), per_group(db), per_group(dc),
            jnp.swapaxes(ds0[:, :, :n, :p], 2, 3))
