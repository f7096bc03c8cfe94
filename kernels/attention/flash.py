"""Fused (flash) causal attention over packed documents: JAX's Pallas Triton kernel, fitted to moefast's
shapes.

Dimension letters: B batch, T tokens, H query heads, G key/value heads, Hd head dimension of queries
and keys, Hv of values.

The kernel is :func:`jax.experimental.pallas.ops.gpu.attention.mha` (online softmax over key blocks,
Dao et al. 2022, FlashAttention, Algorithm 1; causal key blocks past the query block skipped; a
fused backward kernel recomputing the probabilities from the saved log-sum-exp). Its memory is
linear in T: nothing of size T × T is ever stored. It needs equal head counts for queries and keys
and T a multiple of its block, so this wrapper

* repeats each key/value head for its H / G query heads (grouped-query attention; AD sums the
  repeated heads' gradients back into their key/value head);
* pads T at the end up to a multiple of the block. The padded keys come after every real query, so
  the causal mask hides them; the padded queries attend to themselves only and are cut off (their
  cotangent is 0, so they add nothing to the gradients).
* pads the narrower of the query/key and value widths with zero features when they differ (MLA:
  Hd = 192 against Hv = 128 in DeepSeek-V3): zero query/key features add nothing to a logit (the
  scale stays that of the real Hd), zero value features are cut off the output.

On GPU the kernel is compiled by Triton; on CPU it runs in the Pallas interpreter (slow: for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pallas_attention

from ..platform import target_platform
from .reference import validate

__all__ = ["flash_attention", "padded_length"]

BLOCK = 128  # query and key rows per forward block (the kernel's default)


def padded_length(t: int, block: int = BLOCK) -> tuple[int, int]:
    """``(block rows, padded T)``: a power-of-two block of at most ``block`` rows (at least 16, for
    the tensor cores) and T rounded up to a multiple of it."""
    rows = min(block, max(16, 1 << (t - 1).bit_length()))
    return rows, -(-t // rows) * rows


def flash_attention(q_bthd: jax.Array, k_btgd: jax.Array, v_btgd: jax.Array, segment_ids_bt: jax.Array, *,
                    sm_scale: float | None = None, block: int = BLOCK, interpret: bool | None = None) -> jax.Array:
    """Causal grouped-query attention inside each packed document, without a [T, T] matrix.

    Args:
      q_bthd: [B, T, H, Hd] queries, float16/bfloat16/float32.
      k_btgd: [B, T, G, Hd] keys, v_btgd: [B, T, G, Hv] values, in the queries' dtype (H divisible
        by G; Hv may differ from Hd: MLA).
      segment_ids_bt: [B, T] int document ids: query t sees key s <= t of the same id.
      sm_scale: logit scale; ``None``: ``Hd ** -0.5``.
      block: rows of the forward kernel's query and key blocks (a power of two).
      interpret: run in the Pallas interpreter; ``None``: when compiling for CPU
        (:func:`~moefast.kernels.platform.target_platform`).

    Returns:
      [B, T, H, Hv] in the queries' dtype; differentiable (``jax.grad``/``jax.vjp``; not
      ``jax.jvp``) with respect to q, k and v. Equals :func:`.reference.attention_reference` to
      float rounding.

    Raises:
      ValueError: bad shapes (:func:`.reference.validate`), q/k/v not of one float dtype, T = 0, or
        ``block`` not a power of two >= 16.
    """
    validate(q_bthd, k_btgd, v_btgd, segment_ids_bt)
    if not jnp.issubdtype(q_bthd.dtype, jnp.floating) or not q_bthd.dtype == k_btgd.dtype == v_btgd.dtype:
        raise ValueError(f"q, k and v must share one float dtype, got {q_bthd.dtype}, {k_btgd.dtype}, {v_btgd.dtype}")
    if q_bthd.shape[1] < 1 or block < 16 or block & (block - 1):
        raise ValueError(f"flash attention needs T >= 1 and a power-of-two block >= 16; got T={q_bthd.shape[1]}, "
                         f"block={block}")
    b, t, h, hd = q_bthd.shape
    g = k_btgd.shape[2]
    if interpret is None:
        interpret = target_platform() == "cpu"
    rows, tp = padded_length(t, block)
    k = jnp.repeat(k_btgd, h // g, axis=2) if g != h else k_btgd
    v = jnp.repeat(v_btgd, h // g, axis=2) if g != h else v_btgd
    q, seg = q_bthd, segment_ids_bt.astype(jnp.int32)
    hv = v.shape[-1]
    if hv != hd:  # one width for the kernel: zero features change no logit and are cut off the output
        width = max(hd, hv)
        feat = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - x.shape[-1])))
        q, k, v = feat(q), feat(k), feat(v)
    if tp != t:
        pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        seg = jnp.pad(seg, ((0, 0), (0, tp - t)), constant_values=-1)
    sizes = pallas_attention.BlockSizes(block_q=rows, block_k=rows, block_q_dkv=min(32, rows),
                                        block_kv_dkv=min(32, rows), block_q_dq=min(32, rows),
                                        block_kv_dq=min(32, rows))
    o = pallas_attention.mha(q, k, v, seg, sm_scale=hd ** -0.5 if sm_scale is None else sm_scale, causal=True,
                             block_sizes=sizes, interpret=interpret)
    o = o[:, :t] if tp != t else o
    return o[..., :hv] if hv != hd else o
