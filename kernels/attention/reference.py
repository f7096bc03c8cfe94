"""Dense reference of causal attention over packed documents: the truth the kernels are tested against.

Dimension letters: B batch, T tokens, H query heads, G key/value heads (H divisible by G), Hd head
dimension of queries and keys, Hv of values (equal to Hd but in MLA).

Query t of row b attends to key s when ``s <= t`` and ``segment_ids[b, s] == segment_ids[b, t]``
(documents packed into one row never see each other; padding, any id shared by the padding
tokens, attends only to padding). Scaled dot-product attention, Vaswani et al. 2017, eq. 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["attention_reference", "validate"]


def validate(q_bthd: jax.Array, k_btgd: jax.Array, v_btgd: jax.Array, segment_ids_bt: jax.Array) -> None:
    """Checks shapes at trace time.

    Raises:
      ValueError: q not [B, T, H, Hd], k not [B, T, G, Hd] and v not [B, T, G, Hv] with H divisible
        by G, or segment ids not an integer [B, T].
    """
    if q_bthd.ndim != 4 or k_btgd.shape[:3] != v_btgd.shape[:3] or k_btgd.ndim != 4 or v_btgd.ndim != 4:
        raise ValueError(f"q must be [batch, tokens, heads, head_dim], k [batch, tokens, kv_heads, head_dim] and v "
                         f"[batch, tokens, kv_heads, v_head_dim]; got q {q_bthd.shape}, k {k_btgd.shape}, v {v_btgd.shape}")
    b, t, h, hd = q_bthd.shape
    if k_btgd.shape[:2] != (b, t) or k_btgd.shape[3] != hd or h % k_btgd.shape[2]:
        raise ValueError(f"k and v must be [batch={b}, tokens={t}, kv_heads dividing {h}, head_dim={hd}], "
                         f"got {k_btgd.shape}")
    if segment_ids_bt.shape != (b, t) or not jnp.issubdtype(segment_ids_bt.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an integer [batch, tokens] = {(b, t)} array, got "
                         f"{segment_ids_bt.dtype}{list(segment_ids_bt.shape)}")


def attention_reference(q_bthd: jax.Array, k_btgd: jax.Array, v_btgd: jax.Array, segment_ids_bt: jax.Array,
                        *, sm_scale: float | None = None) -> jax.Array:
    """Causal grouped-query attention inside each packed document, on the full [T, T] matrix.

    Args:
      q_bthd: [B, T, H, Hd] queries.
      k_btgd: [B, T, G, Hd] keys; v_btgd: [B, T, G, Hv] values (Hv may differ from Hd: MLA), the
        queries' dtype.
      segment_ids_bt: [B, T] int document ids.
      sm_scale: logit scale; ``None``: ``Hd ** -0.5``.

    Returns:
      [B, T, H, Hv] in the queries' dtype (logits, softmax and the weighted sum in float32).
    """
    validate(q_bthd, k_btgd, v_btgd, segment_ids_bt)
    b, t, h, hd = q_bthd.shape
    g = k_btgd.shape[2]
    scale = hd ** -0.5 if sm_scale is None else sm_scale
    q = q_bthd.astype(jnp.float32).reshape(b, t, g, h // g, hd) * scale
    s = jnp.einsum("btgrd,bsgd->bgrts", q, k_btgd.astype(jnp.float32))
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    s = jnp.where((causal[None] & same)[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, v_btgd.astype(jnp.float32))
    return o.reshape(b, t, h, v_btgd.shape[-1]).astype(q_bthd.dtype)
