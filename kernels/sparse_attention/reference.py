"""Top-k sparse attention in plain jnp (gather form): the oracle the Pallas kernels are tested against.

Dimension letters: B batch, T queries, S keys, H query heads, D query/key width, Dv value width,
K selected keys per query (top_k of DeepSeek Sparse Attention's indexer).

Query t of row b attends, in every head, to the keys ``indices[b, t, :]`` of its row (one key and
one value per token shared by all heads: MLA in its absorbed, multi-query form). Slots holding -1
(or any index outside ``[0, S)``) are unused. ``o = softmax(scale · q kᵀ) v`` over the valid slots
(Vaswani et al. 2017, eq. 1, restricted to the selected keys; DeepSeek-V3.2-Exp, "DeepSeek Sparse
Attention", sec. 2.1, eq. 2), the softmax in float32; a query with no valid slot gives 0 and a
log-sum-exp of -inf. Each selected key is counted once per slot: indices are meant to be unique per
query (an indexer's top-k is); a repeated index would weigh its key twice here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["gather_rows", "sparse_attention_reference", "valid_slots", "validate"]


def validate(q_bthd: jax.Array, k_bsd: jax.Array, v_bsd: jax.Array, indices_btk: jax.Array, scale) -> None:
    """Checks shapes and dtypes at trace time.

    Raises:
      ValueError: q not [B, T, H, D], k not [B, S, D], v not [B, S, Dv], indices not an integer
        [B, T, K] array with K >= 1, q/k/v not of one float dtype, S = 0, or ``scale`` not a real
        number (a Python or NumPy scalar: it is static).
    """
    if q_bthd.ndim != 4 or k_bsd.ndim != 3 or v_bsd.ndim != 3:
        raise ValueError(f"q must be [batch, tokens, heads, width], k [batch, keys, width] and v [batch, keys, "
                         f"v_width]; got q {q_bthd.shape}, k {k_bsd.shape}, v {v_bsd.shape}")
    b, t, h, d = q_bthd.shape
    if k_bsd.shape[0] != b or k_bsd.shape[2] != d or v_bsd.shape[:2] != k_bsd.shape[:2] or k_bsd.shape[1] == 0:
        raise ValueError(f"k must be [batch={b}, keys>0, width={d}] and v [batch={b}, same keys, v_width]; got k "
                         f"{k_bsd.shape}, v {v_bsd.shape}")
    if (indices_btk.ndim != 3 or indices_btk.shape[:2] != (b, t) or indices_btk.shape[2] == 0
            or not jnp.issubdtype(indices_btk.dtype, jnp.integer)):
        raise ValueError(f"indices must be an integer [batch={b}, tokens={t}, top_k>=1] array, got "
                         f"{indices_btk.dtype}{list(indices_btk.shape)}")
    if not (q_bthd.dtype == k_bsd.dtype == v_bsd.dtype) or not jnp.issubdtype(q_bthd.dtype, jnp.floating):
        raise ValueError(f"q, k and v must share one float dtype, got {q_bthd.dtype}, {k_bsd.dtype}, {v_bsd.dtype}")
    if isinstance(scale, (bool, jax.core.Tracer)):
        raise ValueError(f"scale must be a static real number (a Python float), got {scale!r}")
    try:
        float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a static real number (a Python float), got {scale!r}") from None


def valid_slots(indices_btk: jax.Array, num_keys: int) -> tuple[jax.Array, jax.Array]:
    """``(valid [B, T, K] bool, safe [B, T, K] int32)``: the slots holding a key of ``[0, S)``, and
    the indices with every other slot replaced by 0 (safe to gather)."""
    valid = (indices_btk >= 0) & (indices_btk < num_keys)
    return valid, jnp.where(valid, indices_btk, 0).astype(jnp.int32)


def gather_rows(x_bsf: jax.Array, idx_btk: jax.Array) -> jax.Array:
    """``x[b, idx[b, t, k]]`` as [B, T, K, F]."""
    return jax.vmap(lambda xb, ib: xb[ib])(x_bsf, idx_btk)


def sparse_attention_reference(q_bthd: jax.Array, k_bsd: jax.Array, v_bsd: jax.Array, indices_btk: jax.Array, *,
                               scale: float, return_lse: bool = False,
                               return_max: bool = False) -> jax.Array | tuple[jax.Array, ...]:
    """Attention of every query to its K selected keys, by gathering them ([B, T, K, D] in memory).

    Args:
      q_bthd: [B, T, H, D] queries; k_bsd: [B, S, D] keys and v_bsd: [B, S, Dv] values, one per
        token shared by every head; one float dtype.
      indices_btk: [B, T, K] int keys of each query's row, -1 (anything outside [0, S)) unused.
      scale: logit scale (dimensionless), static.
      return_lse: also return the [B, T, H] float32 natural log-sum-exp of each query's scaled
        logits over its valid slots (-inf where it has none).

    Returns:
      [B, T, H, Dv] in q's dtype (0 where a query has no valid slot), then the log-sum-exp when
      ``return_lse``, then (``return_max``) each head's largest logit ``q·k·scale`` over the valid
      slots (-inf where none, not differentiated). Differentiable with respect to q, k, v.

    Raises:
      ValueError: see :func:`validate`.
    """
    validate(q_bthd, k_bsd, v_bsd, indices_btk, scale)
    valid, safe = valid_slots(indices_btk, k_bsd.shape[1])
    k = gather_rows(k_bsd.astype(jnp.float32), safe)  # [B, T, K, D]
    v = gather_rows(v_bsd.astype(jnp.float32), safe)  # [B, T, K, Dv]
    logits = jnp.einsum("bthd,btkd->bthk", q_bthd.astype(jnp.float32), k,
                        precision=jax.lax.Precision.HIGHEST) * float(scale)
    mask = valid[:, :, None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), jax.lax.stop_gradient(m), 0.0)
    p = jnp.where(mask, jnp.exp(jnp.where(mask, logits - m, 0.0)), 0.0)
    l = jnp.sum(p, axis=-1)  # [B, T, H]
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o = jnp.einsum("bthk,btkv->bthv", p, v, precision=jax.lax.Precision.HIGHEST) / l_safe[..., None]
    o = jnp.where(seen[..., None], o, 0.0).astype(q_bthd.dtype)
    out = (o, *((jnp.where(seen, m[..., 0] + jnp.log(l_safe), -jnp.inf),) if return_lse else ()),
           *((jax.lax.stop_gradient(jnp.max(logits, axis=-1)),) if return_max else ()))
    return out if len(out) > 1 else o
