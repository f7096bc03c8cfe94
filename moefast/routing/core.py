"""Token-choice top-k routing: capacity, gates, slots and the router losses.

Dimension letters: T tokens of one routing group, E experts, K top_k, C capacity, D d_model.

Conventions (identical in every implementation):
  * Router math is float32 whatever the input dtype.
  * Probabilities are the softmax over all E experts; the K largest are chosen (ties: the lower
    expert index wins) and their gates are renormalised to sum to 1 over the K chosen
    (Mixtral / ST-MoE convention). The load-balancing loss uses the full softmax.
  * Slots follow GShard's position order (Lepikhin et al. 2020, Algorithm 1): all first choices in
    token order, then all second choices, and so on; so a token's k-th choice never displaces
    another token's earlier choice. An assignment whose slot is >= capacity is dropped (slot -1).
  * Masked tokens (padding) are never routed: they take no slot, count nowhere, and contribute
    nothing (not even a zero-weighted NaN) to the losses or their gradients.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "RouteOutput",
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


class RouteOutput(NamedTuple):
    """Result of :func:`route` for one routing group."""

    expert_index: jax.Array  # [T, K] int32, chosen experts, best first
    gates: jax.Array  # [T, K] float32, renormalised over the K chosen; 0 for masked tokens
    slot: jax.Array  # [T, K] int32, position in the expert's buffer, -1 if dropped or masked
    tokens_per_expert: jax.Array  # [E] int32, assignments routed to each expert before capacity
    prob_sum: jax.Array  # [E] float32, sum over unmasked tokens of the full softmax probability
    z_sum: jax.Array  # [] float32, sum over unmasked tokens of logsumexp(logits)**2
    num_tokens: jax.Array  # [] float32, unmasked tokens
    num_dropped: jax.Array  # [] int32, unmasked assignments dropped for lack of capacity


def route(logits_te: jax.Array, *, top_k: int, capacity: int,
          mask_t: jax.Array | None = None) -> RouteOutput:
    """Top-k routing with capacity, in GShard position order (pure jnp reference).

    Args:
      logits_te: router logits [T, E], any float dtype (computed in float32).
      top_k: K, experts per token, in [1, E].
      capacity: C, slots per expert (see :func:`compute_capacity`).
      mask_t: [T] bool, True for real tokens; ``None`` means all real.

    Returns:
      A :class:`RouteOutput`.

    Raises:
      ValueError: logits not 2-D, top_k outside [1, E], capacity < 1, or a mask of the wrong shape.
    """
    if logits_te.ndim != 2:
        raise ValueError(f"logits must be [tokens, num_experts], got shape {logits_te.shape}")
    num_tokens, num_experts = logits_te.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    if mask_t is None:
        mask_t = jnp.ones((num_tokens,), bool)
    elif mask_t.shape != (num_tokens,):
        raise ValueError(f"mask must have shape [tokens]={(num_tokens,)}, got {mask_t.shape}")
    mask_t = mask_t.astype(bool)

    logits = logits_te.astype(jnp.float32)
    probs_te = jax.nn.softmax(logits, axis=-1)
    top_p_tk, expert_index_tk = jax.lax.top_k(probs_te, top_k)  # ties: lower index first
    gates_tk = top_p_tk / jnp.sum(top_p_tk, axis=-1, keepdims=True)
    gates_tk = jnp.where(mask_t[:, None], gates_tk, 0.0)

    # Position-order slots: flatten choices as [K, T] so all first choices come first; a cumulative
    # count per expert gives each assignment its position in that expert's buffer. No sort.
    onehot_kte = jax.nn.one_hot(expert_index_tk.T, num_experts, dtype=jnp.int32)
    onehot_kte = onehot_kte * mask_t[None, :, None].astype(jnp.int32)
    position_kte = jnp.cumsum(onehot_kte.reshape(top_k * num_tokens, num_experts), axis=0)
    position_kt = jnp.sum(position_kte.reshape(top_k, num_tokens, num_experts) * onehot_kte,
                          axis=-1) - 1  # -1 for masked tokens
    kept_kt = (position_kt >= 0) & (position_kt < capacity)
    slot_tk = jnp.where(kept_kt, position_kt, -1).T.astype(jnp.int32)

    tokens_per_expert = jnp.sum(onehot_kte, axis=(0, 1)).astype(jnp.int32)
    maskf = mask_t.astype(jnp.float32)
    prob_sum = jnp.sum(jnp.where(mask_t[:, None], probs_te, 0.0), axis=0)
    lse_t = jax.nn.logsumexp(logits, axis=-1)
    z_sum = jnp.sum(jnp.where(mask_t, jnp.square(lse_t), 0.0))
    num_valid = jnp.sum(maskf)
    num_dropped = (jnp.sum(mask_t.astype(jnp.int32)) * top_k - jnp.sum(kept_kt.astype(jnp.int32)))
    return RouteOutput(
        expert_index=expert_index_tk.astype(jnp.int32),
        gates=gates_tk,
        slot=slot_tk,
        tokens_per_expert=tokens_per_expert,
        prob_sum=prob_sum,
        z_sum=z_sum,
        num_tokens=num_valid,
        num_dropped=num_dropped.astype(jnp.int32),
    )


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
