"""The gated delta rule token by token: the oracle every faster form is tested against.

Dimension letters: B batch, T tokens, H heads, K key/query head width, V value head width.

Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", arXiv:2412.06464, eq. 10), as transformers' ``torch_recurrent_gated_delta_rule``
(Qwen3-Next) computes it. Per row and head, with a state S [K, V] in float32, for t = 0 .. T-1::

    S     = exp(g_t) * S                    # gated decay (KDA: diag(exp(g_t)) S)
    kv    = k_t^T S                         # [V], what the state predicts for k_t
    delta = beta_t * (v_t - kv)             # the delta rule's correction
    S     = S + outer(k_t, delta)
    o_t   = (scale * q_t)^T S               # [V]

q and k arrive L2-normalised (the caller does that); ``scale`` defaults to K**-0.5.

Kimi Delta Attention (KDA; Kimi Linear, arXiv 2510.26692, eq. 1; transformers'
``recurrent_kimi_delta_attention``) is the same rule with a decay per key channel: ``g`` [B, T, H, K]
instead of [B, T, H], each row kappa of S scaled by ``exp(g_t[kappa])``.

Packed documents: ``segment_ids`` [B, T] mark documents; wherever a token's id differs from the
previous token's, the state is reset to zero before that token (so a document's outputs do not
depend on what precedes it in the row). The initial state applies to the row's first segment, the
one token 0 belongs to; the final state is the state after the row's last token, i.e. the state of
its last segment. Only changes of id matter: ids 1, 2, 1 are three documents.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

__all__ = ["HIGHEST", "gated_delta_rule_reference", "run_ids", "validate"]

HIGHEST = jax.lax.Precision.HIGHEST  # float32 products on every backend (no TF32 on GPU)


def validate(q, k, v, g, beta, segment_ids=None, initial_state=None, scale=None) -> None:
    """Checks shapes and dtypes at trace time (``_validate_args`` of the house style).

    Args: see :func:`gated_delta_rule_reference`.

    Raises:
      ValueError: naming the first bad argument: ``q`` not a float [B, T, H, K] with T >= 1 and
        K >= 1; ``k`` not q's shape; ``v`` not a float [B, T, H, V]; ``g`` not a float [B, T, H]
        or [B, T, H, K]; ``beta`` not a float [B, T, H]; ``segment_ids`` not an integer [B, T];
        ``initial_state`` not a float [B, H, K, V]; ``scale`` not a real number.
    """
    def floating(x):
        return jnp.issubdtype(x.dtype, jnp.floating)

    if q.ndim != 4 or not floating(q) or q.shape[1] < 1 or q.shape[3] < 1:
        raise ValueError(f"q must be a float [batch, tokens >= 1, heads, key_dim >= 1] array, got "
                         f"{q.dtype}{list(q.shape)}")
    b, t, h, kd = q.shape
    if k.shape != q.shape or not floating(k):
        raise ValueError(f"k must be a float array of q's shape [B, T, H, K]={list(q.shape)}, got "
                         f"{k.dtype}{list(k.shape)} (repeat key heads for grouped value heads first)")
    if v.ndim != 4 or v.shape[:3] != (b, t, h) or v.shape[3] < 1 or not floating(v):
        raise ValueError(f"v must be a float [B, T, H, V] array with [B, T, H]={[b, t, h]}, got "
                         f"{v.dtype}{list(v.shape)}")
    if g.shape not in ((b, t, h), (b, t, h, kd)) or not floating(g):
        raise ValueError(f"g must be a float [B, T, H]={[b, t, h]} (a decay per head: Gated DeltaNet) or "
                         f"[B, T, H, K]={[b, t, h, kd]} (per key channel: KDA) array, got {g.dtype}{list(g.shape)}")
    if beta.shape != (b, t, h) or not floating(beta):
        raise ValueError(f"beta must be a float [B, T, H]={[b, t, h]} array, got {beta.dtype}{list(beta.shape)}")
    if segment_ids is not None and (segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype,
                                                                                       jnp.integer)):
        raise ValueError(f"segment_ids must be an integer [B, T]={[b, t]} array, got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}")
    if initial_state is not None and (initial_state.shape != (b, h, kd, v.shape[3]) or not floating(initial_state)):
        raise ValueError(f"initial_state must be a float32 [B, H, K, V]={[b, h, kd, v.shape[3]]} array, got "
                         f"{initial_state.dtype}{list(initial_state.shape)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise ValueError(f"scale must be a static real number (a Python or NumPy float) or None (K**-0.5), "
                         f"got {scale!r}")


def run_ids(segment_ids, b: int, t: int) -> jax.Array:
    """[B, T] int32 run ids: 0 at token 0, +1 at every token whose segment id differs from the
    previous token's (``None``: all 0). Two tokens share a state history iff they share a run id."""
    if segment_ids is None:
        return jnp.zeros((b, t), jnp.int32)
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def gated_delta_rule_reference(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                               scale: float | None = None):
    """The recurrence of the module docstring, one token per ``jax.lax.scan`` step, in float32.

    Args:
      q: [B, T, H, K] queries, any float dtype, L2-normalised per head.
      k: [B, T, H, K] keys, any float dtype, L2-normalised per head.
      v: [B, T, H, V] values, any float dtype.
      g: [B, T, H] log decay (<= 0), or [B, T, H, K] one per key channel (KDA), any float dtype.
      beta: [B, T, H] write strength in (0, 1), any float dtype.
      segment_ids: [B, T] int document ids or ``None`` (one document per row).
      initial_state: [B, H, K, V] float32 state before token 0 (of the row's first segment), or
        ``None``: zeros.
      scale: query scale (dimensionless); ``None``: K**-0.5.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``. Differentiable (plain
      jnp) with respect to every float argument.

    Raises:
      ValueError: see :func:`validate`.
    """
    validate(q, k, v, g, beta, segment_ids, initial_state, scale)
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    scale = kd ** -0.5 if scale is None else float(scale)
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major for the scan
    starts = jnp.moveaxis(run_ids(segment_ids, b, t), 1, 0)
    starts = jnp.concatenate([jnp.zeros((1, b), bool), starts[1:] != starts[:-1]], axis=0)  # [T, B]
    s0 = jnp.zeros((b, h, kd, vd), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, x):
        q_t, k_t, v_t, g_t, beta_t, start_t = x  # [B, H, K] x2, [B, H, V], [B, H(, K)], [B, H], [B]
        s = jnp.where(start_t[:, None, None, None], 0.0, s)  # a new document starts from zero
        s = s * (jnp.exp(g_t)[..., None] if g_t.ndim == 3 else jnp.exp(g_t)[..., None, None])
        kv = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=HIGHEST)
        delta = beta_t[..., None] * (v_t - kv)
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhk,bhkv->bhv", q_t * scale, s, precision=HIGHEST)

    s, o = jax.lax.scan(step, s0, (f32(q), f32(k), f32(v), f32(g), f32(beta), starts))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), s
