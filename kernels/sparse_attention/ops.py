"""The Pallas sparse attention with a custom VJP: the differentiable wrapper of :mod:`.pallas`
(forward kernel) and :mod:`.pallas_bwd` (backward kernel).

Dimension letters as in :mod:`.pallas`. Pallas kernels have no reverse-mode rule, so the kernel
call is wrapped in :func:`jax.custom_vjp`. The forward saves its inputs, outputs and log-sum-exp
(no [T, K] probabilities); the backward is one kernel (dq stored, dk and dv atomically added) plus
an XLA einsum for ``Δ``. The indices get no gradient (a float0 cotangent). Forward-mode AD
(``jax.jvp``) is not supported through the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .pallas import Static, default_interpret, pow2, sparse_attention_fwd
from .pallas_bwd import sparse_attention_bwd
from .reference import validate

__all__ = ["BLOCK_H", "BLOCK_K", "sparse_attention_pallas"]

BLOCK_H = 64  # at most this many heads per program (fewer, a power of two >= 16, for fewer heads)
BLOCK_K = 32  # slots per loop step


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _core(q, k, v, indices, c: Static):
    return sparse_attention_fwd(q, k, v, indices, c)


def _core_fwd(q, k, v, indices, c):
    o, lse, mx = sparse_attention_fwd(q, k, v, indices, c)
    return (o, lse, mx), (q, k, v, indices, o, lse)


def _core_bwd(c, residuals, cotangents):
    q, k, v, indices, o, lse = residuals
    do, dlse, _ = cotangents  # the largest logits are not differentiated
    dq, dk, dv = sparse_attention_bwd(q, k, v, indices, o, lse, do, dlse, c)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), np.zeros(indices.shape, jax.dtypes.float0)


_core.defvjp(_core_fwd, _core_bwd)


def blocks(num_heads: int, width: int, block_h: int | None, block_k: int | None, top_k: int) -> tuple[int, int]:
    """``(Hb, Kb)``: heads per program and slots per loop step. Defaults: the heads' next power of
    two (>= 16, Triton's smallest dot side) up to :data:`BLOCK_H`, 32 slots, both halved to 16 for
    widths above 256 (registers: an [Hb, Wd] query block and a [Kb, Wd] key block; untuned)."""
    wide = width > 256
    bh = block_h or min(BLOCK_H // (4 if wide else 1), pow2(num_heads))
    bk = block_k or min(BLOCK_K // (2 if wide else 1), pow2(top_k))
    for name, x in (("block_h", bh), ("block_k", bk)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a Triton block side), got {x}")
    return bh, bk


def sparse_attention_pallas(q_bthd: jax.Array, k_bsd: jax.Array, v_bsd: jax.Array, indices_btk: jax.Array, *,
                            scale: float, return_lse: bool = False, return_max: bool = False,
                            block_h: int | None = None,
                            block_k: int | None = None, interpret: bool | None = None):
    """Top-k sparse attention by the Pallas kernels (same contract as
    :func:`.reference.sparse_attention_reference`, equal to it to float rounding).

    Args:
      q_bthd: [B, T, H, D]; k_bsd: [B, S, D]; v_bsd: [B, S, Dv]: one float dtype.
      indices_btk: [B, T, K] int, -1 (anything outside [0, S)) unused; the valid indices of a query
        must be distinct (an indexer's top-k is): on GPU a repeated index would be counted twice by
        the forward and atomically added twice, in the interpreter its key gradient would be wrong.
      scale: logit scale (dimensionless), static.
      return_lse: also return the [B, T, H] float32 natural log-sum-exp (differentiable).
      return_max: also return the [B, T, H] float32 largest logit ``q·k·scale`` over the query's
        valid slots (-inf where none): the forward kernel's running maximum, not differentiated.
      block_h: heads per program (Hb), a power of two >= 16; ``None``: :func:`blocks`.
      block_k: slots per loop step (Kb), a power of two >= 16; ``None``: :func:`blocks`.
      interpret: run in the Pallas interpreter; ``None``: when compiling for CPU.

    Returns:
      [B, T, H, Dv] in q's dtype, then the log-sum-exp when ``return_lse``, then the largest
      logits when ``return_max`` (a tuple when either is asked for). Differentiable
      (``jax.grad``/``jax.vjp``, not ``jax.jvp``) with respect to q, k, v.

    Raises:
      ValueError: see :func:`.reference.validate`; a block size that is no power of two >= 16.
    """
    validate(q_bthd, k_bsd, v_bsd, indices_btk, scale)
    b, t, h, d = q_bthd.shape
    s, dv, top_k = k_bsd.shape[1], v_bsd.shape[-1], indices_btk.shape[-1]
    bh, bk = blocks(h, max(pow2(d), pow2(dv)), block_h, block_k, top_k)
    if interpret is None:
        interpret = default_interpret()
    hp, kp = -(-h // bh) * bh, -(-top_k // bk) * bk
    q = jnp.pad(q_bthd, ((0, 0), (0, 0), (0, hp - h), (0, 0))) if hp != h else q_bthd
    idx = indices_btk.astype(jnp.int32)
    if kp != top_k:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, kp - top_k)), constant_values=-1)
    c = Static(float(scale), d, dv, s, bh, bk, bool(interpret), num_warps=8 if max(d, dv) > 128 else 4)
    o, lse, mx = _core(q, k_bsd, v_bsd, idx, c)
    if hp != h:
        o, lse, mx = o[:, :, :h], lse[:, :, :h], mx[:, :, :h]
    out = (o, *((lse,) if return_lse else ()), *((jax.lax.stop_gradient(mx),) if return_max else ()))
    return out if len(out) > 1 else o
