"""Rotary position embeddings (RoPE; Su et al. 2021, RoFormer sec. 3.4.2).

The cos/sin table is computed once per (max_seq_len, head_dim, base) in float64 with NumPy and
returned as a NumPy constant: under ``jit`` it is folded into the program, so no step computes a
sine or cosine for positions, and every layer shares the one table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["apply_rope", "check_positions", "rope_table"]


@functools.lru_cache(maxsize=16)
def rope_table(max_seq_len: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``position * base**(-2i/head_dim)``.

    Args:
      max_seq_len: S, positions 0..S-1.
      head_dim: per-head width (even).
      base: wavelength base (10000 in RoFormer).

    Returns:
      ``(cos, sin)``, each float32 [S, head_dim // 2]; the phase is computed in float64. The arrays
      are read-only (they are shared).
    """
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for RoPE")
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    phase = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(phase).astype(np.float32), np.sin(phase).astype(np.float32)
    cos.flags.writeable = False
    sin.flags.writeable = False
    return cos, sin


def check_positions(positions, max_seq_len: int) -> None:
    """Raises ``ValueError`` when concrete positions fall outside ``[0, max_seq_len)``.

    JAX gathers clamp out-of-range indices silently; this check makes the mistake loud for eager
    calls. Under ``jit`` (traced positions) :func:`apply_rope` instead yields NaN for such positions,
    so the loss becomes NaN rather than silently wrong.
    """
    if isinstance(positions, jax.core.Tracer):
        return
    p = np.asarray(positions)
    if p.size and (p.min() < 0 or p.max() >= max_seq_len):
        raise ValueError(f"positions must be in [0, model.max_seq_len={max_seq_len}), got range "
                         f"[{p.min()}, {p.max()}]; raise model.max_seq_len or shorten the sequence")


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, max_seq_len: int, base: float) -> jax.Array:
    """Rotates query/key features by their positions (rotate-half layout).

    Args:
      x_bthd: [B, T, H, head_dim] queries or keys, any float dtype.
      positions_bt: [B, T] int, in [0, max_seq_len).
      max_seq_len: length of the table.
      base: RoPE base.

    Returns:
      [B, T, H, head_dim] in ``x_bthd.dtype`` (the rotation is computed in float32). Positions out of
      range give NaN (see :func:`check_positions`).
    """
    cos, sin = rope_table(max_seq_len, x_bthd.shape[-1], float(base))
    cos_btf = jnp.take(cos, positions_bt, axis=0, mode="fill", fill_value=jnp.nan)[:, :, None, :]
    sin_btf = jnp.take(sin, positions_bt, axis=0, mode="fill", fill_value=jnp.nan)[:, :, None, :]
    x = x_bthd.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos_btf - x2 * sin_btf, x2 * cos_btf + x1 * sin_btf], axis=-1)
    return out.astype(x_bthd.dtype)
