"""Pallas (Triton backend) backward kernel of top-k sparse attention: dq per query, dk and dv by
atomic adds into the selected keys' rows.

Dimension letters as in :mod:`.pallas` (B, T, S, H/Hp, D/Wd, Dv/Wv, K/Kp, Hb, Kb).

Same grid as the forward, ``(T, B, Hp / Hb)``: one program per query and head block. It loops over
the query's slot blocks, gathers the Kb selected keys and values again, recomputes the
probabilities from the saved log-sum-exp (FlashAttention-2, Dao 2023, Algorithm 2) and forms, in
float32, ``dP = dO vᵀ``, ``dS = P ∘ (dP − Δ)`` with ``Δ = rowsum(dO ∘ O) − dlse`` (computed
outside; the log-sum-exp's cotangent enters as ``∂lse/∂S = P``), then

* ``dq += dS k`` in registers, stored once per program ([Hb, Wd]);
* ``dk_slot = scale · dSᵀ q`` [Kb, Wd] and ``dv_slot = Pᵀ dO`` [Kb, Wv]: the contributions of the
  program's Hb heads to its Kb selected keys (the heads are summed by the products: all heads share
  one key). Different queries select the same key, so these are **scatter-added with atomics**
  (``jax.experimental.pallas.triton.atomic_add``, float32, at the gathered rows' addresses) into
  [B, S + 1, Wd] and [B, S + 1, Wv] float32 accumulators that start at zero (input-output aliases);
  the wrapper slices them to [B, S, D], [B, S, Dv] and casts. Unused slots are masked on GPU; the
  Pallas interpreter's atomic add takes no mask, so there they add zeros to the spare row S.

Atomics were chosen over writing per-(query, slot) contributions and scatter-adding them outside
the kernel: that would store B·T·K·(D + Dv) float32 (for DeepSeek-V3.2's K = 2048, D + Dv = 1088
and T = 4096: 36 GiB per row), while the accumulators hold B·(S + 1)·(Wd + Wv). Atomics make the
summation order of dk and dv, and so their last bits, vary from run to run on GPU. The interpreter's
atomic add is a read-modify-write of the gathered addresses: correct because a query's valid
indices are distinct (the contract) and the programs run one after another.

Cost per query: K·(D + Dv) elements gathered and K·(D + Dv) float32 atomic adds per head block,
2·H·K·(3·D + 2·Dv) FLOPs (five products: the logits again, dP, dq, dk, dv); O(K·D), not O(S·D).
Memory beyond inputs and outputs: the two accumulators, O(S·D) per row, nothing of size T × K.

Status: tested in the Pallas interpreter and lowered for CUDA from a CPU machine, and compiled for a
compile-only H100 through the CUDA PJRT plugin: the PTX holds ``atom.global.gpu.acq_rel.add.v4.f32``
(Pallas's ``atomic_add`` takes no memory order; relaxed would do). Offline ptxas 12.9 at MLA's
widths (bfloat16, Hb = Kb = 16, 8 warps): 255 registers a thread and 108 bytes of spills (likely
the [Hb, 1024] float32 dq accumulator). Never run or timed on a GPU (none was available); atomic
contention on popular keys (many queries select the same recent keys) is unmeasured.

Next steps, not done: with H > Hb (DeepSeek-V3.2's 128 heads, Hb = 16 at its widths) every head
block gathers the same keys and adds its own atomics (8x the atomic traffic of one program per
query); summing heads in one program (in shared memory) or splitting D = 512 + 64 into two blocks
instead of one of 1024 would cut both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .pallas import LOG2E, Static, gather, pow2, slot_block

__all__ = ["BACKWARD_NAME", "sparse_attention_bwd"]

BACKWARD_NAME = "moefast_sparse_attention_bwd"


def _backward_kernel(q_ref, k_ref, v_ref, idx_ref, do_ref, lse_ref, delta_ref, dk_in, dv_in, dq_ref, dk_ref, dv_ref,
                     *, c: Static):
    del dk_in, dv_in  # aliased to dk_ref, dv_ref
    wd, wv = q_ref.shape[-1], v_ref.shape[-1]
    dcols, vcols = jnp.arange(wd), jnp.arange(wv)
    dmask, vmask = (dcols < c.d)[None, :], (vcols < c.dv)[None, :]
    q = plt.load(q_ref, mask=dmask, other=0.0)  # [Hb, Wd]
    do = plt.load(do_ref, mask=vmask, other=0.0)  # [Hb, Wv]
    lse2 = lse_ref[...] * LOG2E
    lse2 = jnp.where(lse2 == -jnp.inf, 0.0, lse2)
    delta = delta_ref[...]

    def body(j, dq):
        valid, safe = slot_block(idx_ref, j, c.block_k, c.num_keys)
        k = gather(k_ref, safe, valid, c.d, wd)  # [Kb, Wd]
        v = gather(v_ref, safe, valid, c.dv, wv)  # [Kb, Wv]
        s = plt.dot(q, k.T) * (c.scale * LOG2E)  # [Hb, Kb]
        p = jnp.where(valid[None, :], jnp.exp2(s - lse2[:, None]), 0.0)
        ds = p * (plt.dot(do, v.T) - delta[:, None])  # [Hb, Kb]
        dk = plt.dot(ds.astype(q.dtype).T, q) * c.scale  # [Kb, Wd]
        dv = plt.dot(p.astype(do.dtype).T, do)  # [Kb, Wv]
        if c.interpret:  # no mask in the interpreter's atomic add: unused slots add zeros to row S
            rows = jnp.where(valid, safe, c.num_keys)[:, None]
            plt.atomic_add(dk_ref, (rows, dcols[None, :]), dk)
            plt.atomic_add(dv_ref, (rows, vcols[None, :]), dv)
        else:
            plt.atomic_add(dk_ref, (safe[:, None], dcols[None, :]), dk, mask=valid[:, None] & dmask)
            plt.atomic_add(dv_ref, (safe[:, None], vcols[None, :]), dv, mask=valid[:, None] & vmask)
        return dq + plt.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, idx_ref.shape[0] // c.block_k, body, jnp.zeros(q.shape, jnp.float32))
    plt.store(dq_ref, (dq * c.scale).astype(dq_ref.dtype), mask=dmask)


def sparse_attention_bwd(q, k, v, indices, o, lse, do, dlse, c: Static):
    """The backward kernel on the forward's prepared operands.

    Args:
      q, k, v, indices: as :func:`.pallas.sparse_attention_fwd` took them.
      o: [B, T, Hp, Dv], lse: [B, T, Hp] float32: its outputs; do, dlse: their cotangents.

    Returns:
      ``(dq [B, T, Hp, D] in q's dtype, dk [B, S, D] float32, dv [B, S, Dv] float32)``.
    """
    b, t, hp, _ = q.shape
    s, kp = k.shape[1], indices.shape[-1]
    wd, wv, bh = pow2(c.d), pow2(c.dv), c.block_h
    delta = jnp.einsum("bthv,bthv->bth", do.astype(jnp.float32), o.astype(jnp.float32)) - dlse
    rows = pl.BlockSpec((None, None, bh), lambda ti, bi, hi: (bi, ti, hi))
    acc = lambda w: pl.BlockSpec((None, s + 1, w), lambda ti, bi, hi: (bi, 0, 0))
    dq, dk, dv = pl.pallas_call(
        lambda *refs: _backward_kernel(*refs, c=c),
        grid=(t, b, hp // bh),
        in_specs=[pl.BlockSpec((None, None, bh, wd), lambda ti, bi, hi: (bi, ti, hi, 0)),
                  pl.BlockSpec((None, s, wd), lambda ti, bi, hi: (bi, 0, 0)),
                  pl.BlockSpec((None, s, wv), lambda ti, bi, hi: (bi, 0, 0)),
                  pl.BlockSpec((None, None, kp), lambda ti, bi, hi: (bi, ti, 0)),
                  pl.BlockSpec((None, None, bh, wv), lambda ti, bi, hi: (bi, ti, hi, 0)),
                  rows, rows, acc(wd), acc(wv)],
        out_specs=[pl.BlockSpec((None, None, bh, wd), lambda ti, bi, hi: (bi, ti, hi, 0)), acc(wd), acc(wv)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, s + 1, wd), jnp.float32),
                   jax.ShapeDtypeStruct((b, s + 1, wv), jnp.float32)],
        input_output_aliases={7: 1, 8: 2},
        compiler_params=plt.CompilerParams(num_warps=c.num_warps, num_stages=2),
        interpret=c.interpret, name=BACKWARD_NAME,
    )(q, k, v, indices, do, lse, delta, jnp.zeros((b, s + 1, wd), jnp.float32), jnp.zeros((b, s + 1, wv), jnp.float32))
    return dq, dk[:, :s, :c.d], dv[:, :s, :c.dv]
