"""FP8 (e4m3) values with fine-grained scales (DeepSeek-V3, Liu et al. 2024, sec. 3.3.1: activations
quantized in 1 x 128 tiles and weights in 128 x 128 blocks, each scaled by its max-abs onto e4m3's
range): the expert exchange's dispatch (``moe.dispatch_dtype: float8_e4m3fn``) and the FP8 GEMMs'
operands (``model.precision: fp8``, :mod:`moefast.parallel.fp8_gemm`).

A tile's scale is ``max|x| / 448`` (448: the largest finite e4m3), at least the smallest normal
float32 (a tile of tiny values never divides by 0) and 1 for an all-zero tile; the scaled values
are clipped to [-448, 448] before the cast (e4m3fn has no infinity: an overflowing cast would give
NaN), so no finite input yields a NaN or an infinity. The scale is computed as ``max|x|`` times
float32 ``1 / 448`` and the values are multiplied by the scale's float32 reciprocal, as XLA
computes a division by a constant or a broadcast scale: every path (eager, jitted, the GPU
quantizer kernels) has the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FP8_BLOCK", "FP8_MAX", "fake_quantize_blocks", "fake_quantize_tiles", "fp8_dequantize", "fp8_pack",
           "fp8_quantize", "fp8_unpack", "quantize_blocks", "quantize_tiles"]

QUANTIZE_SCOPE = "moefast_fp8_quantize"  # the XLA quantizers' named scope (moefast.bench.gpu_schedule reads it)
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
    with jax.named_scope(QUANTIZE_SCOPE):  # what moefast bench gpu-compile counts as quantization
        t = x_ecd.astype(jnp.float32).reshape(*lead, d // FP8_BLOCK, FP8_BLOCK)
        scale = _scale(jnp.max(jnp.abs(t), axis=-1))
        return _cast(t * (1.0 / scale)[..., None]).reshape(*lead, d), scale


def _scale(amax: jax.Array) -> jax.Array:
    """A tile's float32 scale from its max-abs (module docstring), as ``amax * float32(1 / 448)``:
    what XLA computes for ``amax / 448`` (its simplifier turns a division by a constant into a
    product with the constant's float32 reciprocal), written out so that the GPU quantizer
    (:func:`moefast.kernels.fp8_matmul.quantize`) computes the same bits."""
    return jnp.where(amax > 0, jnp.maximum(amax * jnp.float32(1.0 / FP8_MAX), jnp.finfo(jnp.float32).tiny), 1.0)


def _cast(t: jax.Array) -> jax.Array:
    """Scaled values to e4m3, saturating (round to nearest even; never NaN from a finite value)."""
    return jnp.clip(t, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def _padded(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``x`` zero-padded at the end of ``axes`` to multiples of :data:`FP8_BLOCK`."""
    pad = [(0, 0)] * x.ndim
    for a in axes:
        pad[a] = (0, -x.shape[a] % FP8_BLOCK)
    return jnp.pad(x, pad) if any(p for _, p in pad) else x


def quantize_tiles(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """1 x 128 tiles along the last axis (activations, gradients), any length.

    Args:
      x: [..., K] float.

    Returns:
      ``(q, scale)``: q [..., Kp] float8_e4m3fn, Kp = K rounded up to a multiple of 128 (the
      padding is zeros), and scale [..., Kp / 128] float32 with ``x ≈ q * scale`` per tile.
    """
    return fp8_quantize(_padded(x, (x.ndim - 1,)))


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """128 x 128 blocks over the last two axes (weights), any sizes.

    Args:
      w: [..., I, O] float.

    Returns:
      ``(q, scale)``: q [..., Ip, Op] float8_e4m3fn (I, O rounded up to multiples of 128, zeros in
      the padding) and scale [..., Ip / 128, Op / 128] float32, one per block.
    """
    with jax.named_scope(QUANTIZE_SCOPE):
        wp = _padded(w.astype(jnp.float32), (w.ndim - 2, w.ndim - 1))
        *lead, i, o = wp.shape
        b = wp.reshape(*lead, i // FP8_BLOCK, FP8_BLOCK, o // FP8_BLOCK, FP8_BLOCK)
        scale = _scale(jnp.max(jnp.abs(b), axis=(-3, -1)))
        return _cast(b * (1.0 / scale)[..., :, None, :, None]).reshape(*lead, i, o), scale


def fake_quantize_tiles(x: jax.Array) -> jax.Array:
    """``x`` [..., K] through :func:`quantize_tiles` and back: float32 [..., K], each value the e4m3
    value times its tile's scale (what an FP8 GEMM multiplies; exact in float32)."""
    q, scale = quantize_tiles(x)
    return fp8_dequantize(q, scale, jnp.float32)[..., :x.shape[-1]]


def fake_quantize_blocks(w: jax.Array) -> jax.Array:
    """``w`` [..., I, O] through :func:`quantize_blocks` and back: float32 [..., I, O]."""
    q, scale = quantize_blocks(w)
    *lead, i, o = q.shape
    b = q.astype(jnp.float32).reshape(*lead, i // FP8_BLOCK, FP8_BLOCK, o // FP8_BLOCK, FP8_BLOCK)
    back = (b * scale[..., :, None, :, None]).reshape(*lead, i, o)
    return back[..., :w.shape[-2], :w.shape[-1]]


def fp8_dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Inverse of :func:`fp8_quantize`: [..., D] in ``dtype``."""
    *lead, d = q.shape
    with jax.named_scope(QUANTIZE_SCOPE):
        t = q.astype(jnp.float32).reshape(*lead, d // FP8_BLOCK, FP8_BLOCK) * scale[..., None]
        return t.reshape(*lead, d).astype(dtype)


def fp8_pack(q: jax.Array, scale: jax.Array) -> jax.Array:
    """e4m3 values [..., D] and their float32 scales [..., D/128] as one uint8 array
    [..., D + 4·D/128] (the bytes of both: one collective moves a row with its scales, as DeepEP
    does, instead of a second small collective paying its own launch and round trips)."""
    with jax.named_scope(QUANTIZE_SCOPE):
        u = jax.lax.bitcast_convert_type(q, jnp.uint8)
        us = jax.lax.bitcast_convert_type(scale, jnp.uint8)  # [..., D/128, 4]
        return jnp.concatenate([u, us.reshape(*us.shape[:-2], -1)], axis=-1)


def fp8_unpack(packed: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`fp8_pack` for rows of ``d`` values."""
    with jax.named_scope(QUANTIZE_SCOPE):
        q = jax.lax.bitcast_convert_type(packed[..., :d], jnp.float8_e4m3fn)
        s = packed[..., d:].reshape(*packed.shape[:-1], d // FP8_BLOCK, 4)
        return q, jax.lax.bitcast_convert_type(s, jnp.float32)
