"""Dense reference of causal attention over packed documents: the truth the kernels are tested against.

Dimension letters: B batch, T queries, S keys (S = T but for a query slice), H query heads, G
key/value heads (H divisible by G), Hd head dimension of queries and keys, Hv of values (equal to
Hd but in MLA).

Query t of row b attends to key s when ``s <= q_offset + t`` and the two tokens' segment ids are
equal (documents packed into one row never see each other; padding, any id shared by the padding
tokens, attends only to padding), and, in a sliding window of W, ``q_offset + t - s < W``. Scaled
dot-product attention, Vaswani et al. 2017, eq. 1; with sinks, a learned logit per head joins each
softmax's denominator (gpt-oss: the softmax over the logits and the sink, the sink's column then
dropped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["attention_reference", "validate", "validate_options"]


def validate(q_bthd: jax.Array, k_bsgd: jax.Array, v_bsgd: jax.Array, segment_ids_bt: jax.Array,
             kv_segment_ids_bs: jax.Array | None = None) -> None:
    """Checks shapes at trace time.

    Raises:
      ValueError: q not [B, T, H, Hd], k not [B, S, G, Hd] and v not [B, S, G, Hv] with H divisible
        by G, segment ids not an integer [B, T] (queries) and [B, S] (keys; S = T when the keys'
        ids are not given).
    """
    if q_bthd.ndim != 4 or k_bsgd.shape[:3] != v_bsgd.shape[:3] or k_bsgd.ndim != 4 or v_bsgd.ndim != 4:
        raise ValueError(f"q must be [batch, tokens, heads, head_dim], k [batch, keys, kv_heads, head_dim] and v "
                         f"[batch, keys, kv_heads, v_head_dim]; got q {q_bthd.shape}, k {k_bsgd.shape}, v {v_bsgd.shape}")
    b, t, h, hd = q_bthd.shape
    s = t if kv_segment_ids_bs is None else k_bsgd.shape[1]
    if kv_segment_ids_bs is None and k_bsgd.shape[1] != t:
        raise ValueError(f"{k_bsgd.shape[1]} keys for {t} queries: pass the keys' document ids as kv_segment_ids_bs "
                         "[batch, keys] (and q_offset, the keys' position of query 0)")
    if k_bsgd.shape[:2] != (b, s) or k_bsgd.shape[3] != hd or h % k_bsgd.shape[2]:
        raise ValueError(f"k and v must be [batch={b}, keys={s}, kv_heads dividing {h}, head_dim={hd}], "
                         f"got {k_bsgd.shape}")
    for name, ids, shape in (("segment_ids", segment_ids_bt, (b, t)), ("kv_segment_ids", kv_segment_ids_bs, (b, s))):
        if ids is not None and (ids.shape != shape or not jnp.issubdtype(ids.dtype, jnp.integer)):
            raise ValueError(f"{name} must be an integer [batch, tokens] = {shape} array, got "
                             f"{ids.dtype}{list(ids.shape)}")


def validate_options(num_heads: int, q_offset, window, sinks_h) -> None:
    """Checks the static options of :func:`attention_reference` and the fused kernel.

    Raises:
      ValueError: ``q_offset`` not a Python int >= 0 (a traced value cannot set the kernels'
        masks: it is static), ``window`` neither ``None`` nor an int >= 1, ``sinks_h`` not a float
        array of shape [H].
    """
    for name, v, least in (("q_offset", q_offset, 0), ("window", window, 1)):
        if name == "window" and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name} must be a static Python int (it sets the kernels' masks and loop bounds at "
                             f"trace time), got {type(v).__name__} {v!r}")
        if v < least:
            raise ValueError(f"{name} must be >= {least}" + (" (None: no window)" if name == "window" else "")
                             + f", got {v}")
    if sinks_h is not None and (not hasattr(sinks_h, "shape") or sinks_h.shape != (num_heads,)
                                or not jnp.issubdtype(sinks_h.dtype, jnp.floating)):
        got = f"{sinks_h.dtype}{list(sinks_h.shape)}" if hasattr(sinks_h, "shape") else type(sinks_h).__name__
        raise ValueError(f"sinks must be one float logit per query head, a [{num_heads}] array; got {got}")


def attention_reference(q_bthd: jax.Array, k_bsgd: jax.Array, v_bsgd: jax.Array, segment_ids_bt: jax.Array,
                        *, kv_segment_ids_bs: jax.Array | None = None, q_offset: int = 0, window: int | None = None,
                        sinks_h: jax.Array | None = None, return_lse: bool = False, return_max: bool = False,
                        sm_scale: float | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """Causal grouped-query attention inside each packed document, on the full [T, S] matrix.

    Args:
      q_bthd: [B, T, H, Hd] queries.
      k_bsgd: [B, S, G, Hd] keys; v_bsgd: [B, S, G, Hv] values (Hv may differ from Hd: MLA), the
        queries' dtype.
      segment_ids_bt: [B, T] int document ids of the queries.
      kv_segment_ids_bs: [B, S] int document ids of the keys; ``None``: the queries' (S = T).
      q_offset: the keys' position of query 0.
      window: W, the sliding window (the W latest keys); ``None``: all.
      sinks_h: [H] sink logits (unscaled), or ``None``.
      return_lse: also return the [B, H, T] float32 natural log-sum-exp of the scaled logits and
        the sink (−inf for a query that sees no key and has no sink).
      return_max: also return the [B, H, T] float32 largest scaled logit of each query over the
        keys it sees (the sink excluded; −inf where it sees none), not differentiated.
      sm_scale: logit scale; ``None``: ``Hd ** -0.5``.

    Returns:
      [B, T, H, Hv] in the queries' dtype (logits, softmax and the weighted sum in float32; 0 for a
      query that sees no key), then the log-sum-exp when ``return_lse``, then the largest logits
      when ``return_max``.
    """
    validate(q_bthd, k_bsgd, v_bsgd, segment_ids_bt, kv_segment_ids_bs)
    validate_options(q_bthd.shape[2], q_offset, window, sinks_h)
    b, t, h, hd = q_bthd.shape
    s_len, g = k_bsgd.shape[1], k_bsgd.shape[2]
    kv_ids = segment_ids_bt if kv_segment_ids_bs is None else kv_segment_ids_bs
    scale = hd ** -0.5 if sm_scale is None else sm_scale
    q = q_bthd.astype(jnp.float32).reshape(b, t, g, h // g, hd) * scale
    s = jnp.einsum("btgrd,bsgd->bgrts", q, k_bsgd.astype(jnp.float32))
    dist = q_offset + jnp.arange(t)[:, None] - jnp.arange(s_len)[None, :]
    causal = (dist >= 0) & (dist < window) if window else dist >= 0
    same = segment_ids_bt[:, :, None] == kv_ids[:, None, :]
    mask = (causal[None] & same)[:, None, None]
    masked = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(masked, axis=-1)  # [B, G, R, T]
    if sinks_h is not None:
        lse = jnp.logaddexp(lse, sinks_h.astype(jnp.float32).reshape(g, h // g)[None, :, :, None])
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, v_bsgd.astype(jnp.float32))
    o = o.reshape(b, t, h, v_bsgd.shape[-1]).astype(q_bthd.dtype)
    out = (o, *((lse.reshape(b, h, t),) if return_lse else ()),
           *((jax.lax.stop_gradient(jnp.max(masked, axis=-1)).reshape(b, h, t),) if return_max else ()))
    return out if len(out) > 1 else o
