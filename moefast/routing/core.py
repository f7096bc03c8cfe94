"""Routing policy around the kernel: capacity and the router losses.

The routing operation itself (top-k, gates, slots, statistics) is :mod:`moefast.kernels.routing`,
whose reference documents the conventions: float32 math, softmax (or sigmoid, DeepSeek-V3) scores,
an optional group-limited top-k, gates renormalised (ties: lower expert index) and scaled once by
``routed_scaling_factor``, GShard position-order slots (or gate priority), assignments over capacity
dropped, padding never routed.
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
          capacity_limit: jax.Array | None = None, renormalize: bool = True, score_func: str = "softmax",
          num_groups: int = 1, topk_groups: int = 1, routed_scaling_factor: float = 1.0) -> RoutingResult:
    """Top-k routing with capacity: :func:`moefast.kernels.routing.route` (see there for the
    conventions and implementations).

    Args:
      logits_te: router logits [T, E], any float dtype (computed in float32).
      top_k: K, experts per token, in [1, E].
      capacity: C, slots per expert (see :func:`compute_capacity`).
      mask_t: [T] bool, True for real tokens; ``None`` means all real.
      policy: ``"position"`` or ``"priority"``.
      impl: kernel implementation (``"auto"``: the fastest available).
      bias: [E] float32 selection bias (aux-loss-free balancing), in the units of the scores chosen
        on (logits for softmax, sigmoid affinities for sigmoid); never part of a gate.
      capacity_limit: [E] int32 dynamic per-expert limit <= capacity.
      renormalize: renormalise the K gates to sum to 1 (``moe.norm_topk_prob``).
      score_func: ``"softmax"`` or ``"sigmoid"`` (``moe.score_func``).
      num_groups: group-limited top-k: G groups of experts (``moe.num_groups``; HF ``n_group``);
        1, with ``topk_groups`` 1: none.
      topk_groups: group-limited top-k: the groups kept per token (``moe.topk_groups``; HF
        ``topk_group``).
      routed_scaling_factor: dimensionless gate multiplier, applied once (``moe.routed_scaling_factor``).

    Returns:
      A :class:`RoutingResult`.

    Raises:
      ValueError: logits not 2-D, top_k outside [1, E], capacity < 1, a bad policy/impl, a mask
        of the wrong shape, or a group limit / scaling factor that does not fit E and K.
    """
    return kernel_routing.route(logits_te, top_k=top_k, capacity=capacity, policy=policy, impl=impl,
                                mask=mask_t, bias=bias, capacity_limit=capacity_limit, renormalize=renormalize,
                                score_func=score_func, num_groups=num_groups, topk_groups=topk_groups,
                                routed_scaling_factor=routed_scaling_factor)


def load_balancing_loss(tokens_per_expert: jax.Array, prob_sum: jax.Array, num_tokens: jax.Array,
                        top_k: int) -> jax.Array:
    """Switch Transformer load-balancing loss, ``E * sum_i f_i * P_i`` (Fedus et al. 2021, eq. 4).

    ``f_i`` is the fraction of routed assignments that chose expert i (normalised by ``top_k`` so the
    fractions sum to 1) and ``P_i`` the mean full-softmax probability of expert i, both over unmasked
    tokens. With sigmoid scores ``prob_sum`` holds the affinities normalised over the experts, and
    the loss is DeepSeek-V3's balance loss ``sum_i f_i P_i`` with ``f_i`` scaled by E (Liu et al.
    2024, sec. 2.1.2, eqs. 17-20), computed over the routing group rather than one sequence. Perfectly balanced routing gives 1.0. ``f`` carries no gradient; ``P`` does.

    Args:
      tokens_per_expert: [E] int, assignments per expert before capacity.
      prob_sum: [E] float32, summed probabilities (or normalised sigmoid affinities) over unmasked tokens.
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
