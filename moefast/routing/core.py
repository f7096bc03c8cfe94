"""Routing policy around the kernel: capacity and the router losses.

The routing operation itself (top-k, gates, slots, statistics) is :mod:`moefast.kernels.routing`,
whose reference documents the conventions: float32 math, softmax over all experts then top-k with
renormalised gates (ties: lower expert index), GShard position-order slots (or gate priority),
assignments over capacity dropped, padding never routed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moefast.kernels import routing as kernel_routing
from moefast.kernels.routing import RoutingResult

__all__ = [
    "RoutingResult",
    "compute_capacity",
    "load_balancing_loss",
    "route",
    "router_z_loss",
]


def compute_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float,
                     min_capacity: int = 1) -> int:
    """Slots per expert: ``ceil(capacity_factor * num_tokens * top_k / num_experts)``.

    The result is clamped to ``[min_capacity, num_tokens]`` (an expert can receive each token at
    most once, so more than ``num_tokens`` slots are never useful, and at least one slot keeps
    single-token decoding from dropping). A static Python int computed from static shapes only.

    Args:
      num_tokens: T, tokens in the routing group (>= 1).
      num_experts: E (>= 1).
      top_k: K, in [1, E].
      capacity_factor: dimensionless multiplier, > 0 (GShard sec. 2.2; Switch Transformer sec. 2.2).
      min_capacity: lower bound, in slots (>= 1).

    Returns:
      Capacity C in slots, with 1 <= C <= num_tokens.

    Raises:
      ValueError: a non-positive size or capacity factor, or top_k outside [1, num_experts].
    """
    if num_tokens < 1 or num_experts < 1 or min_capacity < 1:
        raise ValueError(f"num_tokens={num_tokens}, num_experts={num_experts} and "
                         f"min_capacity={min_capacity} must all be >= 1")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ValueError(f"capacity_factor={capacity_factor} must be a finite number > 0 "
                         "(0 would mean dropless routing, which is not available here)")
    cap = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    return int(min(max(cap, min_capacity), num_tokens))


def route(logits_te: jax.Array, *, top_k: int, capacity: int, mask_t: jax.Array | None = None,
          policy: str = "position", impl: str = "auto", bias: jax.Array | None = None,
          capacity_limit: jax.Array | None = None, renormalize: bool = True) -> RoutingResult:
    """Top-k routing with capacity: :func:`moefast.kernels.routing.route` (see there for the
    conventions and implementations).

    Args:
      logits_te: router logits [T, E], any float dtype (computed in float32).
      top_k: K, experts per token, in [1, E].
      capacity: C, slots per expert (see :func:`compute_capacity`).
      mask_t: [T] bool, True for real tokens; ``None`` means all real.
      policy: ``"position"`` or ``"priority"``.
      impl: kernel implementation (``"auto"``: the fastest available).
      bias: [E] float32 selection bias (aux-loss-free balancing).
      capacity_limit: [E] int32 dynamic per-expert limit <= capacity.
      renormalize: renormalise the K gates to sum to 1 (``moe.norm_topk_prob``).

    Returns:
      A :class:`RoutingResult`.

    Raises:
      ValueError: logits not 2-D, top_k outside [1, E], capacity < 1, a bad policy/impl, or a mask
        of the wrong shape.
    """
    return kernel_routing.route(logits_te, top_k=top_k, capacity=capacity, policy=policy, impl=impl,
                                mask=mask_t, bias=bias, capacity_limit=capacity_limit, renormalize=renormalize)


def load_balancing_loss(tokens_per_expert: jax.Array, prob_sum: jax.Array, num_tokens: jax.Array,
                        top_k: int) -> jax.Array:
    """Switch Transformer load-balancing loss, ``E * sum_i f_i * P_i`` (Fedus et al. 2021, eq. 4).

    ``f_i`` is the fraction of routed assignments that chose expert i (normalised by ``top_k`` so the
    fractions sum to 1) and ``P_i`` the mean full-softmax probability of expert i, both over unmasked
    tokens. Perfectly balanced routing gives 1.0. ``f`` carries no gradient; ``P`` does.

    Args:
      tokens_per_expert: [E] int, assignments per expert before capacity.
      prob_sum: [E] float32, summed probabilities over unmasked tokens.
      num_tokens: [] float32, unmasked tokens (the loss is 0 when there are none).
      top_k: K.

    Returns:
      [] float32, dimensionless (not yet multiplied by ``aux_loss_coef``).
    """
    num_experts = prob_sum.shape[-1]
    denom = jnp.maximum(num_tokens, 1.0)
    f = tokens_per_expert.astype(jnp.float32) / (denom * top_k)
    p = prob_sum / denom
    return num_experts * jnp.sum(jax.lax.stop_gradient(f) * p)


def router_z_loss(z_sum: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: mean over unmasked tokens of ``logsumexp(logits)**2`` (Zoph et al. 2022, eq. 5).

    Args:
      z_sum: [] float32, sum of squared logsumexp over unmasked tokens.
      num_tokens: [] float32, unmasked tokens (the loss is 0 when there are none).

    Returns:
      [] float32 (not yet multiplied by ``z_loss_coef``).
    """
    return z_sum / jnp.maximum(num_tokens, 1.0)
