"""Mamba-2's SSD scan token by token: the oracle every faster form is tested against.

Dimension letters: B batch, T tokens, H heads, P head dim, G groups (of heads sharing the input and
output projections), N state size. H is a multiple of G; head h reads group h // (H / G).

The selective state space of Mamba-2 (Dao and Gu 2024, "Transformers are SSMs: Generalized Models
and Efficient Algorithms Through Structured State Space Duality", arXiv:2405.21060, sec. 3 and
eq. 2, with a scalar times identity A per head), as transformers' Nemotron-H Mamba-2 mixer
(``models/nemotron_h``, ``mamba2_chunk_scan``) computes it between its input projection and its gated
norm. Per row and head, with a state S [P, N] in float32, for t = 0 .. T-1::

    S   = exp(dt_t * A) * S + dt_t * outer(x_t, B_t)    # decay, then write
    y_t = S @ C_t                                       # [P]

``dt`` arrives already softplus'd, biased and clamped (positive), ``A`` negative (``-exp(A_log)``),
so each step decays the state by exp(dt_t A) in (0, 1). The D skip connection, the gate and the
norm are the caller's.

Packed documents: ``segment_ids`` [B, T] mark documents; wherever a token's id differs from the
previous token's, the state is reset to zero before that token (so a document's outputs do not
depend on what precedes it in the row). The initial state applies to the row's first segment, the
one token 0 belongs to; the final state is the state after the row's last token, i.e. the state of
its last segment. Only changes of id matter: ids 1, 2, 1 are three documents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["HIGHEST", "run_ids", "ssd_reference", "validate"]

HIGHEST = jax.lax.Precision.HIGHEST  # float32 products on every backend (no TF32 on GPU)


def validate(x, dt, A, B, C, segment_ids=None, initial_state=None) -> None:
    """Checks shapes and dtypes at trace time (``_validate_args`` of the house style).

    Args: see :func:`ssd_reference`.

    Raises:
      ValueError: naming the first bad argument: ``x`` not a float [B, T, H, P] with T, H, P >= 1;
        ``dt`` not a float [B, T, H]; ``A`` not a float [H]; ``B`` not a float [B, T, G, N] with
        G >= 1 dividing H and N >= 1; ``C`` not a float array of B's shape; ``segment_ids`` not an
        integer [B, T]; ``initial_state`` not a float [B, H, P, N].
    """
    def floating(a):
        return jnp.issubdtype(a.dtype, jnp.floating)

    if x.ndim != 4 or not floating(x) or min(x.shape[1:]) < 1:
        raise ValueError(f"x must be a float [batch, tokens >= 1, heads >= 1, head_dim >= 1] array, got "
                         f"{x.dtype}{list(x.shape)}")
    b, t, h, p = x.shape
    if dt.shape != (b, t, h) or not floating(dt):
        raise ValueError(f"dt must be a float [B, T, H]={[b, t, h]} array (softplus'd, biased and clamped: > 0), "
                         f"got {dt.dtype}{list(dt.shape)}")
    if A.shape != (h,) or not floating(A):
        raise ValueError(f"A must be a float [H]={[h]} array (negative: -exp(A_log)), got {A.dtype}{list(A.shape)}")
    if (B.ndim != 4 or B.shape[:2] != (b, t) or B.shape[2] < 1 or B.shape[3] < 1 or h % B.shape[2]
            or not floating(B)):
        raise ValueError(f"B must be a float [B, T, G, N] array with [B, T]={[b, t]}, G >= 1 dividing H={h} "
                         f"and N >= 1, got {B.dtype}{list(B.shape)}")
    if C.shape != B.shape or not floating(C):
        raise ValueError(f"C must be a float array of B's shape [B, T, G, N]={list(B.shape)}, got "
                         f"{C.dtype}{list(C.shape)}")
    if segment_ids is not None and (segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype,
                                                                                       jnp.integer)):
        raise ValueError(f"segment_ids must be an integer [B, T]={[b, t]} array, got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}")
    n = B.shape[3]
    if initial_state is not None and (initial_state.shape != (b, h, p, n) or not floating(initial_state)):
        raise ValueError(f"initial_state must be a float32 [B, H, P, N]={[b, h, p, n]} array, got "
                         f"{initial_state.dtype}{list(initial_state.shape)}")


def run_ids(segment_ids, b: int, t: int) -> jax.Array:
    """[B, T] int32 run ids: 0 at token 0, +1 at every token whose segment id differs from the
    previous token's (``None``: all 0). Two tokens share a state history iff they share a run id."""
    if segment_ids is None:
        return jnp.zeros((b, t), jnp.int32)
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def ssd_reference(x, dt, A, B, C, *, segment_ids=None, initial_state=None):
    """The recurrence of the module docstring, one token per ``jax.lax.scan`` step, in float32.

    Args:
      x: [B, T, H, P] inputs (Mamba-2's x after the convolution), any float dtype.
      dt: [B, T, H] step sizes, already softplus'd, biased and clamped (> 0), any float dtype.
      A: [H] per-head decay rates (negative: ``-exp(A_log)``), any float dtype (float32 inside).
      B: [B, T, G, N] input projections (what each token writes), any float dtype.
      C: [B, T, G, N] output projections (what each token reads), any float dtype.
      segment_ids: [B, T] int document ids or ``None`` (one document per row).
      initial_state: [B, H, P, N] float32 state before token 0 (of the row's first segment), or
        ``None``: zeros.

    Returns:
      ``(y [B, T, H, P] in x's dtype, final_state [B, H, P, N] float32)``. Differentiable (plain
      jnp) with respect to every float argument.

    Raises:
      ValueError: see :func:`validate`.
    """
    validate(x, dt, A, B, C, segment_ids, initial_state)
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    f32 = lambda a: jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # time-major for the scan
    heads = lambda a: jnp.repeat(f32(a), h // g, axis=2)  # [T, B, G, N] -> [T, B, H, N]: head h reads group h // (H/G)
    starts = jnp.moveaxis(run_ids(segment_ids, b, t), 1, 0)
    starts = jnp.concatenate([jnp.zeros((1, b), bool), starts[1:] != starts[:-1]], axis=0)  # [T, B]
    s0 = jnp.zeros((b, h, p, n), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    a_h = A.astype(jnp.float32)[None, :]  # [1, H]

    def step(s, inputs):
        x_t, dt_t, b_t, c_t, start_t = inputs  # [B, H, P], [B, H], [B, H, N] x2, [B]
        s = jnp.where(start_t[:, None, None, None], 0.0, s)  # a new document starts from zero
        s = jnp.exp(dt_t * a_h)[..., None, None] * s + (dt_t[..., None] * x_t)[..., :, None] * b_t[..., None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, c_t, precision=HIGHEST)

    s, y = jax.lax.scan(step, s0, (f32(x), f32(dt), heads(B), heads(C), starts))
    return jnp.moveaxis(y, 0, 1).astype(x.dtype), s
