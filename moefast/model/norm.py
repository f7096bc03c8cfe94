"""Normalisation layers shared by the model's blocks.

RMSNorm (Zhang and Sennrich 2019, eq. 4): ``x / sqrt(mean(x**2) + eps) * scale``, in float32. The
zero-centred variant (Qwen3-Next, Qwen3.5; ``model.zero_centered_norm``) stores ``w`` and applies
``1 + w``, so weight decay pulls the scale towards 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["ZeroCenteredRMSNorm", "gated_rms_norm", "rms", "rms_norm"]


def rms(x, eps: float, scale=None):
    """RMSNorm of ``x`` [..., N] in float32 (any float dtype in), times ``scale`` [N] if given
    (without one: Gemma 4's weightless value and router norms)."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return x if scale is None else x * scale.reshape((1,) * (x.ndim - 1) + (-1,))


class ZeroCenteredRMSNorm(nnx.Module):
    """RMSNorm whose scale parameter ``scale`` [N] (logical axis ``norm``, starting at 0) is applied
    as ``1 + scale``; float32 in and out (callers cast to the compute dtype)."""

    def __init__(self, num_features: int, *, epsilon: float, rngs: nnx.Rngs):
        del rngs
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.zeros((num_features,), jnp.float32), logical_axes=("norm",))

    def __call__(self, x):
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
        return x * (1.0 + self.scale[...]).reshape((1,) * (x.ndim - 1) + (-1,))


def rms_norm(d_model: int, eps: float, dtype, rngs: nnx.Rngs, *, zero_centered: bool = False):
    """RMSNorm over the last axis of width ``d_model`` computed in float32 (its scale's gradient
    sums tokens in float32); callers cast the result to the compute dtype. ``zero_centered``: the
    ``1 + w`` form (:class:`ZeroCenteredRMSNorm`)."""
    del dtype
    if zero_centered:
        return ZeroCenteredRMSNorm(d_model, epsilon=eps, rngs=rngs)
    return nnx.RMSNorm(d_model, epsilon=eps, dtype=jnp.float32, scale_metadata={"logical_axes": ("norm",)},
                       rngs=rngs)


def gated_rms_norm(x, gate, scale, eps: float, dtype):
    """Gated DeltaNet's output norm (transformers' ``Qwen3NextRMSNormGated``): ``RMSNorm(x)``
    (float32) rounded to ``dtype``, times ``scale`` and ``SiLU(gate)`` in float32, in ``dtype``.

    Args:
      x, gate: [..., N] any float dtype; scale: [N] float32 (a plain scale, starting at 1).
      eps: RMSNorm epsilon; dtype: the compute dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(dtype)
    scale = scale.reshape((1,) * (x.ndim - 1) + (-1,))
    return (scale * normed.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)
