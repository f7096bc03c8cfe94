"""Pure-jnp reference of the routing operation: the truth every kernel is compared with.

Dimension letters: T tokens, E experts, K top_k.

Conventions (identical in every implementation):
  * Math in float32 whatever the logits' dtype.
  * Probabilities are the softmax over all E experts. The K experts with the largest
    ``logits + bias`` are chosen — the same order as the probabilities when ``bias`` is zero, and
    computed with one exact float add, so every implementation chooses bitwise the same experts
    (``bias`` is the aux-loss-free selection bias in logit units, zero by default; ties: the lower
    expert index wins). Their gates are the chosen *probabilities* (without bias) renormalised to
    sum to 1 (Mixtral / ST-MoE convention; DeepSeek-V3 sec. 2.1.2 for a selection-only bias), or,
    with ``renormalize=False`` in :func:`moefast.kernels.routing.route`, the chosen probabilities
    themselves (Switch / Qwen2-MoE / OLMoE with ``norm_topk_prob=False``).
  * ``policy="position"``: slots follow GShard's position order (Lepikhin et al. 2020): all first
    choices in token order, then all second choices, ...; a token's k-th choice never displaces
    another token's earlier choice.
  * ``policy="priority"``: within each expert, assignments are ranked by their router probability
    (the gate before renormalisation, so top-1 routing is not a tie of 1.0s), largest first (ties:
    position order), and the first ``capacity`` keep their slots (batch-prioritised routing,
    Riquelme et al. 2021, V-MoE sec. 3.3).
  * An assignment whose rank is >= capacity (or >= ``capacity_limit[expert]``) is dropped: slot -1.
  * Masked tokens are never routed: no slot, counted nowhere, no contribution to any statistic.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["POLICIES", "RoutingResult", "chosen_probs", "differentiable_outputs", "finish",
           "position_ranks", "route_reference", "select_topk", "validate"]

POLICIES = ("position", "priority")


class RoutingResult(NamedTuple):
    """Routing of one group of T tokens over E experts (every field is an array; K = top_k).

    Fields: ``expert_index`` [T, K] int32 chosen experts, best first; ``gates`` [T, K] float32
    combine weights (renormalised over the K, or the raw probabilities; 0 for masked tokens);
    ``slot`` [T, K] int32 position in the expert's buffer of ``capacity`` slots, -1 if dropped or
    masked; ``tokens_per_expert`` [E] int32 assignments per expert before capacity; ``prob_sum``
    [E] float32 and ``z_sum`` [] float32 the sums behind the load-balancing and z losses;
    ``num_tokens`` [] float32 unmasked tokens; ``num_dropped`` [] int32 assignments dropped for
    lack of capacity.
    """

    expert_index: jax.Array  # [T, K] int32, chosen experts, best first
    gates: jax.Array  # [T, K] float32, renormalised over the K chosen (or raw probabilities); 0 for masked tokens
    slot: jax.Array  # [T, K] int32, position in the expert's buffer; -1 if dropped or masked
    tokens_per_expert: jax.Array  # [E] int32, assignments routed to each expert before capacity
    prob_sum: jax.Array  # [E] float32, sum over unmasked tokens of the full softmax probability
    z_sum: jax.Array  # [] float32, sum over unmasked tokens of logsumexp(logits)**2
    num_tokens: jax.Array  # [] float32, unmasked tokens
    num_dropped: jax.Array  # [] int32, unmasked assignments dropped for lack of capacity


def validate(logits, top_k: int, capacity: int, policy: str, mask, bias, capacity_limit):
    """Checks arguments at trace time; returns (float32 logits, bool mask [T]).

    Raises:
      ValueError: logits not [T, E], top_k outside [1, E], capacity < 1, an unknown policy, or a
        mask / bias / capacity_limit of the wrong shape.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [tokens, num_experts], got shape {logits.shape}")
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {POLICIES}")
    if mask is None:
        mask = jnp.ones((t,), bool)
    elif mask.shape != (t,):
        raise ValueError(f"mask must have shape [tokens]={(t,)}, got {mask.shape}")
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"bias must have shape [num_experts]={(e,)}, got {bias.shape}")
    if capacity_limit is not None and capacity_limit.shape != (e,):
        raise ValueError(f"capacity_limit must have shape [num_experts]={(e,)}, got {capacity_limit.shape}")
    return logits.astype(jnp.float32), mask.astype(bool)


def select_topk(logits, top_k: int, bias=None):
    """Expert choice: indices [T, K] int32 of the K largest ``logits + bias`` (float32)."""
    b = jnp.zeros(logits.shape[-1:], jnp.float32) if bias is None else bias.astype(jnp.float32)
    score = logits + b[None, :]
    # -0.0 -> +0.0 (a -0.0 logit plus a -0.0 bias entry stays -0.0): top_k orders -0.0 below +0.0,
    # the kernels' max/== treat them as equal, so equal scores must be the same bits everywhere
    # (an explicit select: XLA may fold ``x + 0.0`` into ``x``)
    score = jnp.where(score == 0.0, 0.0, score)
    _, index = jax.lax.top_k(score, top_k)  # stable: lower index first among equal scores
    return index.astype(jnp.int32)


def differentiable_outputs(logits, expert_index, mask):
    """The outputs that carry gradients, as functions of the logits for fixed choices.

    Returns:
      ``(gates [T, K], prob_sum [E], z_sum [])`` in float32.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    top_p = jnp.take_along_axis(probs, expert_index, axis=-1)
    gates = jnp.where(mask[:, None], top_p / jnp.sum(top_p, axis=-1, keepdims=True), 0.0)
    prob_sum = jnp.sum(jnp.where(mask[:, None], probs, 0.0), axis=0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    z_sum = jnp.sum(jnp.where(mask, jnp.square(lse), 0.0))
    return gates, prob_sum, z_sum


def raw_gates(logits, expert_index, mask):
    """Gates without renormalisation: the chosen experts' softmax probabilities [T, K] float32 (0 for
    masked tokens), differentiable in ``logits``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.where(mask[:, None], jnp.take_along_axis(probs, expert_index, axis=-1), 0.0)


def chosen_probs(logits, expert_index):
    """Router probabilities [T, K] of the chosen experts (the priority score; no gradient)."""
    probs = jax.nn.softmax(jax.lax.stop_gradient(logits), axis=-1)
    return jnp.take_along_axis(probs, expert_index, axis=-1)


def position_ranks(expert_index, mask, num_experts: int):
    """Rank of every assignment among those to the same expert, in position order (no sort).

    Returns:
      ``(rank [T, K] int32, -1 for masked tokens; tokens_per_expert [E] int32)``.
    """
    t, k = expert_index.shape
    onehot_kte = jax.nn.one_hot(expert_index.T, num_experts, dtype=jnp.int32)
    onehot_kte = onehot_kte * mask[None, :, None].astype(jnp.int32)
    position = jnp.cumsum(onehot_kte.reshape(k * t, num_experts), axis=0).reshape(k, t, num_experts)
    rank_kt = jnp.sum(position * onehot_kte, axis=-1) - 1
    return rank_kt.T.astype(jnp.int32), jnp.sum(onehot_kte, axis=(0, 1)).astype(jnp.int32)


def priority_ranks(expert_index, score, mask, num_experts: int):
    """Rank of every assignment among those to the same expert by ``score`` [T, K], largest first
    (ties: position order). Uses one sort of the T*K assignments.

    Returns:
      rank [T, K] int32, -1 for masked tokens.
    """
    t, k = expert_index.shape
    flat_e = jnp.where(mask[None, :], expert_index.T, num_experts).reshape(-1)  # [K*T], position order
    flat_g = score.T.reshape(-1)
    order = jnp.lexsort((jnp.arange(k * t), -flat_g, flat_e))  # by expert, gate desc, position
    sorted_e = flat_e[order]
    starts = jnp.searchsorted(sorted_e, jnp.arange(num_experts + 1), side="left")
    rank_sorted = jnp.arange(k * t) - starts[sorted_e]
    rank = jnp.zeros((k * t,), jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))
    rank = jnp.where(flat_e < num_experts, rank, -1)
    return rank.reshape(k, t).T


def finish(expert_index, gates, rank, tokens_per_expert, prob_sum, z_sum, mask, *, capacity: int,
           policy: str, capacity_limit=None, priority_score=None) -> RoutingResult:
    """Turns ranks into slots (applying the policy and capacity) and assembles the result.

    ``rank`` is the position-order rank; under ``policy="priority"`` it is replaced by the rank by
    ``priority_score`` [T, K] (see :func:`chosen_probs`). Shared by every implementation, so
    capacity handling is identical everywhere.
    """
    num_experts = prob_sum.shape[0]
    if policy == "priority":
        rank = priority_ranks(expert_index, priority_score, mask, num_experts)
    limit = jnp.full((num_experts,), capacity, jnp.int32)
    if capacity_limit is not None:
        limit = jnp.minimum(limit, capacity_limit.astype(jnp.int32))
    kept = (rank >= 0) & (rank < limit[expert_index])
    slot = jnp.where(kept, rank, -1).astype(jnp.int32)
    n = jnp.sum(mask.astype(jnp.int32))
    return RoutingResult(
        expert_index=expert_index, gates=gates, slot=slot, tokens_per_expert=tokens_per_expert,
        prob_sum=prob_sum, z_sum=z_sum, num_tokens=n.astype(jnp.float32),
        num_dropped=(n * expert_index.shape[1] - jnp.sum(kept.astype(jnp.int32))).astype(jnp.int32))


def route_reference(logits, *, top_k: int, capacity: int, policy: str = "position", mask=None, bias=None,
                    capacity_limit=None) -> RoutingResult:
    """Top-k routing with capacity (pure jnp; differentiable with ``jax.grad``).

    Args:
      logits: router logits [T, E], any float dtype.
      top_k: K in [1, E].
      capacity: C >= 1, slots per expert (the buffer size).
      policy: ``"position"`` or ``"priority"`` (see the module docstring).
      mask: [T] bool, True for real tokens; ``None``: all real.
      bias: [E] float32 selection bias (aux-loss-free balancing); ``None``: none.
      capacity_limit: [E] int32 per-expert limit <= C (dynamic capacity); ``None``: C for all.

    Returns:
      :class:`RoutingResult`.

    Raises:
      ValueError: see :func:`validate`.
    """
    logits, mask = validate(logits, top_k, capacity, policy, mask, bias, capacity_limit)
    index = select_topk(logits, top_k, bias)
    gates, prob_sum, z_sum = differentiable_outputs(logits, index, mask)
    rank, counts = position_ranks(index, mask, logits.shape[1])
    return finish(index, gates, rank, counts, prob_sum, z_sum, mask, capacity=capacity, policy=policy,
                  capacity_limit=capacity_limit,
                  priority_score=chosen_probs(logits, index) if policy == "priority" else None)
