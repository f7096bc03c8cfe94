"""Normalisation layers shared by the model's blocks."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

__all__ = ["rms_norm"]


def rms_norm(d_model: int, eps: float, dtype, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """RMSNorm computed in float32 (its scale's gradient sums tokens in float32); callers cast the
    result to the compute dtype."""
    del dtype
    return nnx.RMSNorm(d_model, epsilon=eps, dtype=jnp.float32, scale_metadata={"logical_axes": ("norm",)},
                       rngs=rngs)
