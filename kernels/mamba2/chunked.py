"""Mamba-2's SSD scan in chunks: the block decomposition in plain jnp (the training path on CPU).

Dimension letters: B batch, T tokens, H heads, P head dim, G groups, R = H / G heads per group,
N state size, Q tokens per chunk (``chunk_size``), Z chunks, Tp = Z·Q the padded length. Einsum
strings use the same letters in lower case, l and s for the target and source positions inside a
chunk.

The SSD algorithm of Dao and Gu 2024 ("Transformers are SSMs", arXiv:2405.21060, sec. 6, the block
decomposition of the semiseparable matrix; ``ssd_minimal`` of mamba_ssm; transformers'
``mamba2_chunk_scan``), extended to packed documents as the gated delta rule's chunked form is
(:mod:`moefast.kernels.gated_delta_rule.chunked`). With a_t = dt_t A_h the log decay of token t
and xd_t = dt_t x_t, tokens inside a chunk are grouped into *runs* (maximal stretches of one
segment id, :func:`.reference.run_ids`); token l *continues* the chunk's incoming state (c_l = 1)
iff it is in the run that was live before the chunk. With

* L_ls = exp(a_{s+1} + ... + a_l) for s <= l in the same run, else 0 (the decay from token s to
  token l: transformers' ``exp(segment_sum(A))``, the sums taken directly, not as differences of
  cumulative sums, so no precision is lost to a large cumulative decay; masked to 0 across a
  document start);
* G_l = a_0 + ... + a_l, the cumulative decay of the chunk's first run, read only where that run
  continues the incoming state (c_l = 1; a cumulative sum of a masked to that run, so a later
  document's decay never enters it);

each chunk maps its incoming state S [P, N] to::

    y  = ((C B^T) * L) xd + (c e^G) * (C S^T)          # [Q, P]: diagonal block + the state's read
    S' = c_last e^{G_last} S + sum_s L_{Q-1,s} outer(xd_s, B_s)      # [P, N]

L_{Q-1,s} is 0 outside the chunk's last run: the carried state is built only from that run (and
reads S only if that run continues the incoming one). The intra-chunk outputs and each chunk's
own state are batched einsums over all chunks; only the inter-chunk state
passing, ``S_{z+1} = c e^{G_last} S_z + dS_z``, is a ``jax.lax.scan`` over the Z chunks, and the
states entering the chunks are read back by one batched einsum (the paper's steps 1-4). Heads of
a group share B and C: the einsums keep the group axis, nothing is repeated per head.

T need not divide Q: the row is padded with tokens of dt = 0 (so a = 0 and xd = 0) in the last
token's run, which leave the state unchanged. Gradients by JAX autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import HIGHEST, run_ids, validate

__all__ = ["check_chunk_size", "chunk_prep", "chunked_core", "ssd_chunked"]


def _pad_tokens(x, tp: int, axis: int, mode: str = "constant"):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, tp - x.shape[axis])
    return jnp.pad(x, pad, mode=mode) if tp != x.shape[axis] else x


def chunk_prep(run_bt, b: int, t: int, chunk_size: int):
    """``(tp, run [B, Tp] int32 padded with the last token's run)`` for chunks of ``chunk_size``."""
    tp = -(-t // chunk_size) * chunk_size
    return tp, _pad_tokens(run_bt, tp, 1, mode="edge")


def check_chunk_size(chunk_size) -> None:
    """Raises ValueError unless ``chunk_size`` is a positive int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")


def chunked_core(x, dt, a, B, C, run_bt, s0, *, chunk_size: int):
    """The chunked scan on checked inputs, given the log decay (the Pallas core's arguments:
    :func:`.ops` differentiates the same ``(x, dt, a, B, C, s0)``).

    Args:
      x: [B, T, H, P]; dt: [B, T, H]; B, C: [B, T, G, N] (any float dtypes).
      a: [B, T, H] float32 log decays dt·A (<= 0).
      run_bt: [B, T] int32 run ids (:func:`.reference.run_ids`).
      s0: [B, H, P, N] float32 initial state.
      chunk_size: Q >= 1.

    Returns:
      ``(y [B, T, H, P] in x's dtype, final_state [B, H, P, N] float32)``.
    """
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g
    q = chunk_size
    tp, run = chunk_prep(run_bt, b, t, q)
    z = tp // q
    f32 = jnp.float32

    def chunks(a, *inner):  # [B, T, ...] -> float32 [B, Z, Q, *inner], zero-padded
        return _pad_tokens(a.astype(f32), tp, 1).reshape(b, z, q, *inner)

    xd = chunks(x, g, r, p) * chunks(dt, g, r)[..., None]  # dt_t x_t [B, Z, Q, G, R, P]
    a = chunks(a, g, r)  # log decay per token, <= 0 [B, Z, Q, G, R]
    bc, cc = chunks(B, g, n), chunks(C, g, n)  # [B, Z, Q, G, N]
    run = run.reshape(b, z, q)
    prev_run = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), run[:, :-1, -1]], axis=1)  # [B, Z]
    cont = (run == prev_run[..., None]).astype(f32)  # [B, Z, Q]: continues the incoming state

    pos_l = jnp.arange(q).reshape(1, 1, q, 1)
    pos_s = jnp.arange(q).reshape(1, 1, 1, q)
    incl = (run[..., :, None] == run[..., None, :]) & (pos_l >= pos_s)  # [B, Z, L, S]: s <= l, same run
    # segment sums sum_{s < k <= l} a_k, [B, Z, L, S, G, R]: a cumulative sum over k of a_k masked to k > s
    above = (pos_l > pos_s)[..., None, None]  # [1, 1, K, S, 1, 1]
    seg = jnp.cumsum(jnp.where(above, a[:, :, :, None, :, :], 0.0), axis=2)
    mask = incl[..., None, None]
    decay = jnp.where(mask, jnp.exp(jnp.where(mask, seg, 0.0)), 0.0)  # L, masked before the exp
    first = (cont > 0)[..., None, None]  # [B, Z, Q, 1, 1]
    read_decay = jnp.where(first, jnp.exp(jnp.cumsum(jnp.where(first, a, 0.0), axis=2)), 0.0)  # c e^G [B, Z, Q, G, R]

    # 1. the diagonal blocks: y_l += sum_s (C_l . B_s) L_ls xd_s
    scores = jnp.einsum("bzlgn,bzsgn->bzlsg", cc, bc, precision=HIGHEST)
    y = jnp.einsum("bzlsg,bzlsgr,bzsgrp->bzlgrp", scores, decay, xd, precision=HIGHEST)
    # 2. each chunk's own state: sum over its last run of L_{Q-1, s} outer(xd_s, B_s)
    to_end = decay[:, :, -1]  # [B, Z, S, G, R]: 0 outside the last run
    chunk_states = jnp.einsum("bzsgr,bzsgrp,bzsgn->bzgrpn", to_end, xd, bc, precision=HIGHEST)
    carry = read_decay[:, :, -1]  # [B, Z, G, R]: c_last e^{G_last}

    # 3. state passing between chunks: the state entering each chunk
    def step(s, inputs):
        carry_z, new_z = inputs  # [B, G, R], [B, G, R, P, N]
        return carry_z[..., None, None] * s + new_z, s

    over_z = lambda a_: jnp.moveaxis(a_, 1, 0)
    s, entering = jax.lax.scan(step, s0.reshape(b, g, r, p, n), (over_z(carry), over_z(chunk_states)))
    entering = jnp.moveaxis(entering, 0, 1)  # [B, Z, G, R, P, N]
    # 4. the incoming state's read: y_l += c_l e^{G_l} S C_l
    read = jnp.einsum("bzlgn,bzgrpn->bzlgrp", cc, entering, precision=HIGHEST)
    y = y + read_decay[..., None] * read
    y = y.reshape(b, tp, h, p)[:, :t]
    return y.astype(x.dtype), s.reshape(b, h, p, n)


def ssd_chunked(x, dt, A, B, C, *, segment_ids=None, initial_state=None, chunk_size: int = 128):
    """The SSD scan by chunks of ``chunk_size`` tokens (module docstring); equals
    :func:`.reference.ssd_reference` to float32 rounding.

    Args:
      x: [B, T, H, P] inputs, any float dtype.
      dt: [B, T, H] step sizes (softplus'd, biased and clamped by the caller: > 0), any float dtype.
      A: [H] decay rates (negative), any float dtype.
      B: [B, T, G, N] input projections, any float dtype; G divides H.
      C: [B, T, G, N] output projections, any float dtype.
      segment_ids: [B, T] int document ids (the state resets where the id changes) or ``None``.
      initial_state: [B, H, P, N] float32 state before the row's first segment, or ``None``: zeros.
      chunk_size: Q, tokens per chunk (>= 1; transformers' Nemotron-H uses 128); T need not be a
        multiple of it.

    Returns:
      ``(y [B, T, H, P] in x's dtype, final_state [B, H, P, N] float32)``; plain jnp, so
      differentiable in every way JAX offers.

    Raises:
      ValueError: see :func:`.reference.validate`, or ``chunk_size`` not a positive int.
    """
    validate(x, dt, A, B, C, segment_ids, initial_state)
    check_chunk_size(chunk_size)
    b, t, h, p = x.shape
    s0 = (jnp.zeros((b, h, p, B.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    a = dt.astype(jnp.float32) * A.astype(jnp.float32)[None, None, :]  # log decay, differentiated by JAX
    return chunked_core(x, dt, a, B, C, run_ids(segment_ids, b, t), s0, chunk_size=chunk_size)
