"""Pallas (Triton backend) forward kernel of top-k sparse attention, gather form.

Dimension letters: B batch, T queries, S keys, H query heads (Hp padded to a multiple of the head
block), D query/key width, Dv value width (Wd, Wv: their next powers of two, >= 16), K selected
keys per query (Kp padded with -1 to a multiple of the slot block).

Grid ``(T, B, Hp / Hb)``: one program per query of a row and block of Hb heads. All heads of
a query attend to the same K keys (MLA absorbed: one latent key and value per token, shared by the
heads), so a program gathers each selected key once for its Hb heads and the heads are the rows of
its matrix products (``[Hb, Wd] x [Wd, Kb]``: tensor-core shaped for Hb >= 16). The program loops
over its query's Kp slots in blocks of Kb: it loads Kb indices, gathers those Kb rows of k
([Kb, Wd]) and of v ([Kb, Wv]) straight from the row's cache (a masked load at computed addresses;
-1 slots are masked, not loaded), and folds them into an online softmax (Milakov and Gimelshein
2018; FlashAttention, Dao et al. 2022, Algorithm 1) kept in registers: the running maximum,
denominator and [Hb, Wv] accumulator, float32. It stores the outputs and each head's natural
log-sum-exp (what the backward recomputes the probabilities from).

Cost per query (all heads): gathers K·(D + Dv) elements of k and v per head block (Hp / Hb
blocks: 1 for H <= Hb) and reads H·D of q, 2·H·K·(D + Dv) FLOPs (two products); memory beyond the
inputs and outputs: none (nothing of size S or T × K is stored). Dense attention would read
S·(D + Dv) and do 2·H·S·(D + Dv): the kernel's work is O(K·D), not O(S·D), per query, whatever S.

Widths are loaded in blocks of the next power of two with masks (nothing padded in memory): MLA's
D = 512 + 64 = 576 is computed in a block of 1024 (a split into a 512 and a 64 block would waste
less: not done). Block sizes are untuned guesses.

Status: tested in the Pallas interpreter (CPU), lowered for CUDA and compiled for a compile-only
H100 (sm_90a PTX through the CUDA PJRT plugin, ``.venv/gpu-compile``) from a CPU machine; never run
or timed on a GPU (none was available). At MLA's widths (D = 576, Dv = 512, bfloat16, Hb = Kb =
16, 8 warps) offline ptxas 12.9 reported 113 registers a thread and no spills for this kernel.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..platform import target_platform

__all__ = ["FORWARD_NAME", "Static", "default_interpret", "pow2", "sparse_attention_fwd"]

FORWARD_NAME = "moefast_sparse_attention_fwd"
LOG2E = math.log2(math.e)


def pow2(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (Triton dots need every side >= 16)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def default_interpret() -> bool:
    """The Pallas interpreter when compiling for CPU (:func:`~moefast.kernels.platform.target_platform`)."""
    return target_platform() == "cpu"


@dataclasses.dataclass(frozen=True)
class Static:
    """The kernels' static parameters (hashable: one non-differentiable argument of the custom VJP).

    ``d``, ``dv``: the real widths; ``block_h``: heads per program (Hb); ``block_k``: slots per
    loop step (Kb); ``num_keys``: S; ``interpret``: the Pallas interpreter."""
    scale: float
    d: int
    dv: int
    num_keys: int
    block_h: int
    block_k: int
    interpret: bool
    num_warps: int = 4


def gather(ref, idx, valid, width: int, cols_block: int):
    """Rows ``idx`` [Kb] of the [S, cols_block] block ``ref`` as [Kb, cols_block]: masked where a
    slot is unused or a column is past ``width`` (zeros there; nothing loaded)."""
    cols = jnp.arange(cols_block)
    return plt.load(ref.at[idx[:, None], cols[None, :]], mask=valid[:, None] & (cols < width)[None, :], other=0.0)


def slot_block(idx_ref, j, block_k: int, num_keys: int):
    """Slot block ``j``'s indices: ``(valid [Kb] bool, safe [Kb] int32)`` (unused slots -> row 0)."""
    idx = idx_ref[pl.ds(j * block_k, block_k)]
    valid = (idx >= 0) & (idx < num_keys)
    return valid, jnp.where(valid, idx, 0)


def _forward_kernel(q_ref, k_ref, v_ref, idx_ref, o_ref, lse_ref, max_ref, *, c: Static):
    wd, wv = q_ref.shape[-1], v_ref.shape[-1]
    dmask = (jnp.arange(wd) < c.d)[None, :]
    q = plt.load(q_ref, mask=dmask, other=0.0)  # [Hb, Wd]
    qk_scale = c.scale * LOG2E  # base-2 logits: exp2 in the loop

    def body(j, carry):
        o, m, l = carry
        valid, safe = slot_block(idx_ref, j, c.block_k, c.num_keys)
        k = gather(k_ref, safe, valid, c.d, wd)  # [Kb, Wd]
        s = plt.dot(q, k.T) * qk_scale  # [Hb, Kb]
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid slot yet: exp2(-inf), not NaN
        p = jnp.where(valid[None, :], jnp.exp2(s - m_safe[:, None]), 0.0)
        correction = jnp.exp2(m - m_safe)
        v = gather(v_ref, safe, valid, c.dv, wv)  # [Kb, Wv]
        o = correction[:, None] * o + plt.dot(p.astype(v.dtype), v)
        return o, m_new, correction * l + p.sum(axis=-1)

    bh = q_ref.shape[0]
    carry = (jnp.zeros((bh, wv), jnp.float32), jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32))
    o, m, l = lax.fori_loop(0, idx_ref.shape[0] // c.block_k, body, carry)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o = jnp.where(seen[:, None], o / l_safe[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(l_safe)) / LOG2E, -jnp.inf)  # natural
    max_ref[...] = jnp.where(seen, m / LOG2E, -jnp.inf)  # the largest scaled logit q·k·scale
    plt.store(o_ref, o.astype(o_ref.dtype), mask=(jnp.arange(wv) < c.dv)[None, :])


def sparse_attention_fwd(q, k, v, indices, c: Static):
    """The forward kernel on prepared operands.

    Args:
      q: [B, T, Hp, D] (Hp a multiple of ``c.block_h``); k: [B, S, D]; v: [B, S, Dv], one dtype.
      indices: [B, T, Kp] int32 (Kp a multiple of ``c.block_k``; -1 unused).

    Returns:
      ``(o [B, T, Hp, Dv] in q's dtype, lse [B, T, Hp] float32 natural log-sum-exp, max [B, T, Hp]
      float32 largest logit q·k·scale over the valid slots, -inf where none)``.
    """
    b, t, hp, _ = q.shape
    s, kp = k.shape[1], indices.shape[-1]
    wd, wv, bh = pow2(c.d), pow2(c.dv), c.block_h
    return pl.pallas_call(
        lambda *refs: _forward_kernel(*refs, c=c),
        grid=(t, b, hp // bh),
        in_specs=[pl.BlockSpec((None, None, bh, wd), lambda ti, bi, hi: (bi, ti, hi, 0)),
                  pl.BlockSpec((None, s, wd), lambda ti, bi, hi: (bi, 0, 0)),
                  pl.BlockSpec((None, s, wv), lambda ti, bi, hi: (bi, 0, 0)),
                  pl.BlockSpec((None, None, kp), lambda ti, bi, hi: (bi, ti, 0))],
        out_specs=[pl.BlockSpec((None, None, bh, wv), lambda ti, bi, hi: (bi, ti, hi, 0)),
                   pl.BlockSpec((None, None, bh), lambda ti, bi, hi: (bi, ti, hi)),
                   pl.BlockSpec((None, None, bh), lambda ti, bi, hi: (bi, ti, hi))],
        out_shape=[jax.ShapeDtypeStruct((b, t, hp, c.dv), q.dtype), jax.ShapeDtypeStruct((b, t, hp), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, hp), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=c.num_warps, num_stages=2),
        interpret=c.interpret, name=FORWARD_NAME,
    )(q, k, v, indices)
