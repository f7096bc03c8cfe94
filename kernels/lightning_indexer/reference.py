"""Lightning-indexer scores in plain jnp: the oracle the Pallas kernel is tested against.

Dimension letters: B batch, T queries, S keys (tokens of the row), Hi indexer heads, Di indexer
head width.

DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2-Exp tech report, sec. 2.1, eq. 1)
scores key s for query t as ``I[t, s] = sum_h w[t, h] · ReLU(scale · q[t, h] · k[s])``: Hi query
heads, one key per token shared by the heads, a per-query weight of each head. The caller folds
whatever factors it uses into ``w`` and ``scale`` (DeepSeek-V3.2 and transformers' indexer:
``w = weights_proj(x) · Hi^-0.5``, ``scale = Di^-0.5``). This form holds the float32 [B, T, Hi, S]
logits in memory (2 GiB for one row's block of 256 queries at S = 32768, Hi = 64): it is the
oracle and the CPU path, not the GPU one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["DTYPES", "lightning_indexer_scores_reference", "validate"]

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
"""The dtypes q and k may have (one of them, shared)."""


def validate(q_bthd: jax.Array, w_bth: jax.Array, k_bsd: jax.Array, scale) -> None:
    """Checks shapes and dtypes at trace time.

    Raises:
      ValueError: q not [B, T, Hi, Di] or k not [B, S, Di] (same B and Di) with Hi, Di, S >= 1;
        w not float32 [B, T, Hi]; q and k not of one dtype among float32, bfloat16, float16; or
        ``scale`` not a real number (a Python or NumPy scalar: it is static).
    """
    if q_bthd.ndim != 4 or k_bsd.ndim != 3:
        raise ValueError(f"q must be [batch, tokens, heads, width] and k [batch, keys, width]; got q {q_bthd.shape}, "
                         f"k {k_bsd.shape}")
    b, t, h, d = q_bthd.shape
    if h == 0 or d == 0:
        raise ValueError(f"q must have at least one head and a width >= 1, got q {q_bthd.shape}")
    if k_bsd.shape[0] != b or k_bsd.shape[2] != d or k_bsd.shape[1] == 0:
        raise ValueError(f"k must be [batch={b}, keys>0, width={d}], got k {k_bsd.shape}")
    if w_bth.shape != (b, t, h) or w_bth.dtype != jnp.float32:
        raise ValueError(f"w must be a float32 [batch={b}, tokens={t}, heads={h}] array, got "
                         f"{w_bth.dtype}{list(w_bth.shape)}")
    if q_bthd.dtype != k_bsd.dtype or q_bthd.dtype not in DTYPES:
        raise ValueError(f"q and k must share one dtype among float32, bfloat16, float16; got {q_bthd.dtype}, "
                         f"{k_bsd.dtype}")
    if isinstance(scale, (bool, jax.core.Tracer)):
        raise ValueError(f"scale must be a static real number (a Python float), got {scale!r}")
    try:
        float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a static real number (a Python float), got {scale!r}") from None


def lightning_indexer_scores_reference(q_bthd: jax.Array, w_bth: jax.Array, k_bsd: jax.Array, *,
                                       scale: float) -> jax.Array:
    """``scores[b, t, s] = sum_h w[b, t, h] · relu(scale · q[b, t, h] · k[b, s])`` by two einsums.

    Args:
      q_bthd: [B, T, Hi, Di] indexer queries; k_bsd: [B, S, Di] indexer keys (one per token,
        shared by the heads); one dtype (float32, bfloat16 or float16).
      w_bth: float32 [B, T, Hi] each head's weight per query (any sign).
      scale: logit scale (dimensionless), static.

    Returns:
      float32 [B, T, S]: products at ``Precision.HIGHEST`` in float32 (inputs upcast), the float32
      [B, T, Hi, S] logits in memory. Differentiable with respect to q, w and k (the public
      :func:`~moefast.kernels.lightning_indexer.lightning_indexer_scores` is not: use this one for
      a gradient).

    Raises:
      ValueError: see :func:`validate`.
    """
    validate(q_bthd, w_bth, k_bsd, scale)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bthd,bsd->bths", q_bthd.astype(jnp.float32), k_bsd.astype(jnp.float32),
                        precision=hi) * float(scale)
    return jnp.einsum("bth,bths->bts", w_bth, jax.nn.relu(logits), precision=hi)
