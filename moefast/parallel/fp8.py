"""FP8 (e4m3) rows with fine-grained scales for the expert exchange's dispatch
(``moe.dispatch_dtype: float8_e4m3fn``; DeepSeek-V3, Liu et al. 2024, sec. 3.3.1: activations
quantized in 1 x 128 tiles, each scaled by its max-abs onto e4m3's range)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FP8_BLOCK", "FP8_MAX", "fp8_dequantize", "fp8_pack", "fp8_quantize", "fp8_unpack"]

FP8_BLOCK = 128  # channels sharing one scale (DeepSeek-V3 sec. 3.3.1: 1 x 128 activation tiles)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_quantize(x_ecd: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row, per-128-channel scaled e4m3 (module docstring).

    Args:
      x_ecd: [..., D] float, D divisible by :data:`FP8_BLOCK`.

    Returns:
      ``(q, scale)``: q [..., D] float8_e4m3fn and scale [..., D / 128] float32 with
      ``x ≈ q * scale`` per tile (relative error at most 2^-4 of a tile's max-abs per element;
      an all-zero tile has scale 1 and stays exactly 0).
    """
    *lead, d = x_ecd.shape
    t = x_ecd.astype(jnp.float32).reshape(*lead, d // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(t), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (t / scale[..., None]).astype(jnp.float8_e4m3fn)
    return q.reshape(*lead, d), scale


def fp8_dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Inverse of :func:`fp8_quantize`: [..., D] in ``dtype``."""
    *lead, d = q.shape
    t = q.astype(jnp.float32).reshape(*lead, d // FP8_BLOCK, FP8_BLOCK) * scale[..., None]
    return t.reshape(*lead, d).astype(dtype)


def fp8_pack(q: jax.Array, scale: jax.Array) -> jax.Array:
    """e4m3 values [..., D] and their float32 scales [..., D/128] as one uint8 array
    [..., D + 4·D/128] (the bytes of both: one collective moves a row with its scales, as DeepEP
    does, instead of a second small collective paying its own launch and round trips)."""
    u = jax.lax.bitcast_convert_type(q, jnp.uint8)
    us = jax.lax.bitcast_convert_type(scale, jnp.uint8)  # [..., D/128, 4]
    return jnp.concatenate([u, us.reshape(*us.shape[:-2], -1)], axis=-1)


def fp8_unpack(packed: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`fp8_pack` for rows of ``d`` values."""
    q = jax.lax.bitcast_convert_type(packed[..., :d], jnp.float8_e4m3fn)
    s = packed[..., d:].reshape(*packed.shape[:-1], d // FP8_BLOCK, 4)
    return q, jax.lax.bitcast_convert_type(s, jnp.float32)
