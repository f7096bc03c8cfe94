"""The gated delta rule in chunks: the WY/UT form in plain jnp (the training path on CPU).

Dimension letters: B batch, T tokens, H heads, K key width, V value width, N chunks, C tokens per
chunk (``chunk_size``), Tp = N·C the padded length.

The chunked form of Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, arXiv:2412.06464, sec. 3.3;
the UT transform of Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length", sec. 3), as fla's ``chunk_gated_delta_rule`` and transformers'
``torch_chunk_gated_delta_rule`` compute it, extended to packed documents. Within a chunk, tokens
are grouped into *runs* (maximal stretches of one segment id, :func:`.reference.run_ids`); token i
*continues* the chunk's incoming state (c_i = 1) iff it is in the run that was live before the
chunk. With

* G_i = sum of g_j over j <= i of i's run inside the chunk (a segmented cumulative decay: it restarts
  at each document start, so no decay ever spans two documents and nothing huge is subtracted);
* D_ij = exp(G_i - G_j) for j <= i in the same run, else 0 (the decay from token j to token i);
* A_ij = beta_i (k_i . k_j) D_ij for j < i (strictly lower), T = (I + A)^-1, computed with
  matmuls only as (I - A)(I + A^2)(I + A^4)... (A is nilpotent, A^C = 0: ceil(log2 C) - 1 squarings;
  :func:`unit_lower_inverse`);
* U = T (beta v) [C, V] and W = T (beta c e^G k) [C, K]  (transformers' ``new_values`` and
  ``k_cumdecay``),

the chunk maps its incoming state S [K, V] to::

    delta = U - W S                                  # [C, V], the delta-rule corrections
    o     = scale * ((c e^G q) S + (q k^T * D) delta) # [C, V], the diagonal (j = i) included
    S'    = c_last e^{G_last} S + (k * m e^{G_last - G})^T delta

where ``m`` marks the chunk's last run: the carried state is built only from that run (and reads
S only if that run continues the incoming one).

KDA (a decay per key channel, ``g`` [B, T, H, K]): G, D and every ``e^G`` gain the key axis, and
the key products weigh each channel by its own decay, ``A_ij = beta_i sum_kappa k_i k_j
D_ij[kappa]`` and ``(q k^T * D)_ij = sum_kappa q_i k_j D_ij[kappa]``; the carried state's rows decay
by ``e^{G_last}`` each. D is formed as ``exp(G_i - G_j)`` over [C, C, K] with the exponent masked to
<= 0 before ``exp`` (j <= i in one run), never as ``e^{G_i} e^{-G_j}``: that factorisation
overflows once a chunk's decay passes about -88 in a channel (float32's exp range), which a
strongly decaying channel reaches within a 64-token chunk. The previous state is read only by tokens with
c_i = 1. Chunks are folded with ``jax.lax.scan``. T need not divide C: the row is padded with
tokens of g = 0, beta = 0, k = v = 0 in the last token's run, which leave the state unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import HIGHEST, run_ids, validate

__all__ = ["chunk_prep", "chunked_core", "gated_delta_rule_chunked", "unit_lower_inverse"]


def unit_lower_inverse(a):
    """``(I + A)^-1`` for strictly lower triangular ``a`` [..., C, C] (zero on and above the
    diagonal), float32, by matmuls only: A is nilpotent (A^C = 0), so
    ``(I + A)^-1 = sum_j (-A)^j = (I - A)(I + A^2)(I + A^4)...`` up to the power >= C.

    Not ``jax.scipy.linalg.solve_triangular``: on XLA:CPU (jaxlib 0.10.2) its LAPACK custom call,
    inside a whole hybrid model's train step, stalled the program's second execution with every
    thread idle (the step of ``configs/tiny_qwen3_next.yaml`` at 128 tokens); the matmul form is
    also what GPUs run well.
    """
    c = a.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(c, dtype=a.dtype), a.shape)
    inv, power, reach = eye - a, a, 2  # inv = sum of (-A)^j for j < reach
    while reach < c:
        power = jnp.einsum("...ij,...jk->...ik", power, power, precision=HIGHEST)  # A^reach
        inv = jnp.einsum("...ij,...jk->...ik", inv, eye + power, precision=HIGHEST)
        reach *= 2
    return inv

def _pad_tokens(x, tp: int, axis: int, mode: str = "constant"):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, tp - x.shape[axis])
    return jnp.pad(x, pad, mode=mode) if tp != x.shape[axis] else x


def chunk_prep(run_bt, b: int, t: int, chunk_size: int):
    """``(tp, run [B, Tp] int32 padded with the last token's run)`` for chunks of ``chunk_size``."""
    tp = -(-t // chunk_size) * chunk_size
    return tp, _pad_tokens(run_bt, tp, 1, mode="edge")


def chunked_core(q, k, v, g, beta, run_bt, s0, *, scale: float, chunk_size: int):
    """The chunked recurrence on checked inputs.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or [B, T, H, K] (KDA); beta: [B, T, H]
        (any float dtypes).
      run_bt: [B, T] int32 run ids (:func:`.reference.run_ids`).
      s0: [B, H, K, V] float32 initial state.
      scale: query scale; chunk_size: C >= 1.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``.
    """
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    c = chunk_size
    tp, run = chunk_prep(run_bt, b, t, c)
    n = tp // c

    def chunks(x, feat: bool):  # [B, T, H(, F)] -> float32 [B, H, N, C(, F)], zero-padded
        x = _pad_tokens(x.astype(jnp.float32), tp, 1)
        x = jnp.moveaxis(x, 1, 2)  # [B, H, Tp(, F)]
        return x.reshape(b, h, n, c, *x.shape[3:]) if feat else x.reshape(b, h, n, c)

    per_channel = g.ndim == 4  # KDA: a decay per key channel
    qc, kc, vc = chunks(q, True) * scale, chunks(k, True), chunks(v, True)
    gc, bc = chunks(g, per_channel), chunks(beta, False)
    run = run.reshape(b, 1, n, c)  # shared by the heads
    prev_run = jnp.concatenate([jnp.zeros((b, 1, 1), jnp.int32), run[:, :, :-1, -1]], axis=2)  # [B, 1, N]
    cont = (run == prev_run[..., None]).astype(jnp.float32)  # [B, 1, N, C]: continues the incoming state

    i_idx = jnp.arange(c).reshape(1, 1, 1, c, 1)
    j_idx = jnp.arange(c).reshape(1, 1, 1, 1, c)
    same = run[..., :, None] == run[..., None, :]  # [B, 1, N, C, C]
    incl = same & (i_idx >= j_idx)  # j <= i, same run
    strict = same & (i_idx > j_idx)
    # the channel axis (KDA's K, or one for a decay per head) last: G [B, H, N, C, 1 or K]
    gk = gc if per_channel else gc[..., None]
    seg_decay = jnp.sum(jnp.where(incl[..., None], gk[..., None, :, :], 0.0), axis=-2)
    diff = seg_decay[..., :, None, :] - seg_decay[..., None, :, :]  # [B, H, N, C, C, 1 or K]
    decay = jnp.where(incl[..., None], jnp.exp(jnp.where(incl[..., None], diff, 0.0)), 0.0)  # D, masked before exp

    def weighted(x, y):  # sum_kappa x_i y_j D_ij[kappa]: [B, H, N, C, C]
        if per_channel:
            return jnp.einsum("bhnik,bhnjk,bhnijk->bhnij", x, y, decay, precision=HIGHEST)
        return jnp.einsum("bhnik,bhnjk->bhnij", x, y, precision=HIGHEST) * decay[..., 0]

    a = jnp.where(strict, bc[..., :, None] * weighted(kc, kc), 0.0)
    e_g = jnp.exp(seg_decay)  # [B, H, N, C, 1 or K]
    rhs = jnp.concatenate([bc[..., None] * vc, (bc * cont)[..., None] * e_g * kc], axis=-1)
    sol = jnp.einsum("bhnij,bhnjd->bhnid", unit_lower_inverse(a), rhs, precision=HIGHEST)  # (I + A)^-1 rhs
    u, w = sol[..., :vd], sol[..., vd:]
    attn = weighted(qc, kc)
    q_in = cont[..., None] * e_g * qc  # reads the incoming state

    last = run[..., -1:]  # [B, 1, N, 1]
    in_last = (run == last)[..., None]
    g_last = seg_decay[..., -1:, :]  # [B, H, N, 1, 1 or K]
    k_out = jnp.where(in_last, jnp.exp(jnp.where(in_last, g_last - seg_decay, 0.0)), 0.0) * kc
    carry_decay = cont[..., -1, None] * jnp.exp(g_last[..., 0, :])  # [B, H, N, 1 or K]: the state's rows

    def step(s, x):
        u_n, w_n, attn_n, q_n, k_n, cd_n = x
        delta = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s, precision=HIGHEST)
        o_n = (jnp.einsum("bhck,bhkv->bhcv", q_n, s, precision=HIGHEST)
               + jnp.einsum("bhij,bhjv->bhiv", attn_n, delta, precision=HIGHEST))
        s = cd_n[..., None] * s + jnp.einsum("bhck,bhcv->bhkv", k_n, delta, precision=HIGHEST)
        return s, o_n

    over_n = lambda x: jnp.moveaxis(x, 2, 0)
    s, o = jax.lax.scan(step, s0, tuple(map(over_n, (u, w, attn, q_in, k_out, carry_decay))))
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, tp, vd)[:, :, :t]  # [B, H, T, V]
    return jnp.moveaxis(o, 1, 2).astype(v.dtype), s


def gated_delta_rule_chunked(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                             scale: float | None = None, chunk_size: int = 64):
    """The gated delta rule by chunks of ``chunk_size`` tokens (module docstring); equals
    :func:`.reference.gated_delta_rule_reference` to float32 rounding.

    Args:
      q: [B, T, H, K] queries, any float dtype, L2-normalised per head.
      k: [B, T, H, K] keys, any float dtype, L2-normalised per head.
      v: [B, T, H, V] values, any float dtype.
      g: [B, T, H] log decay (<= 0), or [B, T, H, K] one per key channel (KDA), any float dtype.
      beta: [B, T, H] write strength in (0, 1), any float dtype.
      segment_ids: [B, T] int document ids (the state resets where the id changes) or ``None``.
      initial_state: [B, H, K, V] float32 state before the row's first segment, or ``None``: zeros.
      scale: query scale (dimensionless); ``None``: K**-0.5.
      chunk_size: C, tokens per chunk (>= 1); T need not be a multiple of it.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``; plain jnp, so
      differentiable in every way JAX offers.

    Raises:
      ValueError: see :func:`.reference.validate`, or ``chunk_size`` not a positive int.
    """
    validate(q, k, v, g, beta, segment_ids, initial_state, scale)
    check_chunk_size(chunk_size)
    b, t, h, kd = q.shape
    s0 = (jnp.zeros((b, h, kd, v.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    return chunked_core(q, k, v, g, beta, run_ids(segment_ids, b, t), s0,
                        scale=kd ** -0.5 if scale is None else float(scale), chunk_size=chunk_size)


def check_chunk_size(chunk_size) -> None:
    """Raises ValueError unless ``chunk_size`` is a positive int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
