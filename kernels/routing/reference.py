"""Pure-jnp reference of the routing operation: the truth every kernel is compared with.

Dimension letters: T tokens, E experts, K top_k.

Conventions (identical in every implementation):
  * Math in float32 whatever the logits' dtype.
  * Scores (:class:`Scoring`, ``score_func``): ``"softmax"`` (below) or ``"sigmoid"`` (DeepSeek-V3,
    GLM-4.5; see "Sigmoid scores and group limits" below).
  * Softmax: probabilities are the softmax over all E experts. The K experts with the largest
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
  * ``routed_scaling_factor`` (``Scoring.scale``) multiplies the gates once, after any
    renormalisation (Hugging Face DeepSeek-V2/V3, GLM-4.5); 1.0 by default (no multiply at all).

Sigmoid scores and group limits (Hugging Face transformers 5.24 ``DeepseekV3TopkRouter``,
``Glm4MoeTopkRouter`` and ``DeepseekV2TopkRouter``, "noaux_tc" and
"group_limited_greedy"; DeepSeek-V3 technical report, Liu et al. 2024, sec. 2.1.2, eqs. 15-16):

  * ``score_func="sigmoid"``: the scores are ``s = sigmoid(logits)`` (float32). Experts are chosen
    on ``s + bias`` (one float add; ``bias`` is then in score units, the aux-loss-free correction
    bias ``e_score_correction_bias``), and the gates are the chosen ``s`` without bias,
    renormalised as ``s / (sum of the K chosen s + 1e-20)`` (``norm_topk_prob``) or as they are,
    then times the scaling factor.
  * ``num_groups`` G > 1 (HF ``n_group``): the E experts form G groups of E/G consecutive experts.
    A group's score is, for ``"sigmoid"``, the sum of its two largest ``s + bias`` (V3/GLM
    noaux_tc), for ``"softmax"`` its largest probability (V2 group_limited_greedy; computed here,
    exactly, as the largest ``logits + bias`` of the group: the softmax is monotonic within a
    token). The ``topk_groups`` (HF ``topk_group``) best groups are kept (ties: the lower group
    index), and the choice scores of every expert of the other groups are replaced by ``-inf``
    before the top-k, so an expert of a dropped group is never chosen, whatever the sign of the
    biased scores. DeepSeek-V3's own gate and transformers' ``DeepseekV3TopkRouter`` /
    ``Glm4MoeTopkRouter`` (``masked_fill(~score_mask, float("-inf"))``) do the same; a 0.0 fill would let
    a dropped expert outrank every kept expert whose ``s + bias`` is negative, which the
    aux-loss-free bias reaches for overloaded experts. DeepSeek-V2's ``group_limited_greedy``
    fills 0.0 into softmax *probabilities*, never above a kept expert's, so ``-inf`` in logit
    units chooses the same experts. (A kept expert's choice score is finite for finite logits and
    bias; one of ``-inf`` would tie with the dropped experts, the lower index first.)
  * G = 1 is exactly no group limit (GLM-4.5, Kimi K2 configs); so is ``topk_groups == G``.
  * Exactness: softmax choices are made on ``logits + bias`` (one exact add), identical on every
    backend. Sigmoid choices go through ``exp``: the reference and the Pallas interpreter run the
    same XLA op (bitwise equal, tested), the Triton interpreter NumPy's ``exp`` (equal on the tested
    cases), but a compiled GPU kernel's ``exp`` may differ from XLA:GPU's in the last bit, so there
    two experts whose biased scores are within an ulp may be chosen in the other order (not yet
    measured on a GPU).
  * Statistics for sigmoid scores: ``prob_sum`` sums the affinities normalised over all experts,
    ``s / sum_j s_j`` (DeepSeek-V3 sec. 2.1.2, eqs. 19-20, the complementary sequence-wise
    balance loss), so :func:`moefast.routing.load_balancing_loss` keeps its meaning; ``z_sum`` is
    logsumexp(logits)² as for softmax (ST-MoE's z-loss on the router logits).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["POLICIES", "SCORE_FUNCS", "RoutingResult", "Scoring", "chosen_probs", "choice_scores", "differentiable_outputs", "finish",
           "position_ranks", "route_reference", "select_topk", "validate"]

POLICIES = ("position", "priority")
SCORE_FUNCS = ("softmax", "sigmoid")


class Scoring(NamedTuple):
    """How scores, group limits and gate scaling are computed (static, hashable; see the module
    docstring). The default is moefast's softmax routing, bit for bit as before these options.

    Fields: ``score_func`` ``"softmax"`` or ``"sigmoid"``; ``num_groups`` G >= 1 expert groups
    (HF ``n_group``; 1: no group limit); ``topk_groups`` groups kept per token, in [1, G] (HF
    ``topk_group``); ``scale`` the gates' dimensionless multiplier (HF ``routed_scaling_factor``).
    """

    score_func: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0

    @property
    def grouped(self) -> bool:
        """Whether the group limit removes any expert (G > 1 and fewer than G groups kept)."""
        return self.num_groups > 1 and self.topk_groups < self.num_groups

    def check(self, num_experts: int, top_k: int) -> None:
        """Raises ValueError unless these options fit E = ``num_experts`` and K = ``top_k``."""
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r} is not one of {SCORE_FUNCS}")
        g = self.num_groups
        if not (isinstance(g, int) and g >= 1 and num_experts % g == 0):
            raise ValueError(f"num_groups={g} must be an int >= 1 dividing num_experts={num_experts}")
        if not 1 <= self.topk_groups <= g:
            raise ValueError(f"topk_groups={self.topk_groups} must be in [1, num_groups={g}]")
        if self.score_func == "sigmoid" and self.grouped and num_experts // g < 2:
            raise ValueError(f"num_groups={g} leaves {num_experts // g} expert per group: a sigmoid group's score "
                             "is the sum of its two best experts (DeepSeek-V3), so groups need >= 2 experts")
        if self.grouped and top_k > self.topk_groups * (num_experts // g):
            raise ValueError(f"top_k={top_k} is more than the {self.topk_groups * (num_experts // g)} experts of "
                             f"the topk_groups={self.topk_groups} groups kept")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"routed_scaling_factor={self.scale} must be a finite number > 0")


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


def validate(logits, top_k: int, capacity: int, policy: str, mask, bias, capacity_limit,
             scoring: Scoring = Scoring()):
    """Checks arguments at trace time; returns (float32 logits, bool mask [T]).

    Raises:
      ValueError: logits not [T, E], top_k outside [1, E], capacity < 1, an unknown policy, a
        mask / bias / capacity_limit of the wrong shape, or ``scoring`` not fitting E and K
        (:meth:`Scoring.check`).
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
    scoring.check(e, top_k)
    return logits.astype(jnp.float32), mask.astype(bool)


def _positive_zero(x):
    # -0.0 -> +0.0 (a -0.0 logit plus a -0.0 bias entry stays -0.0): top_k orders -0.0 below +0.0,
    # the kernels' max/== treat them as equal, so equal scores must be the same bits everywhere
    # (an explicit select: XLA may fold ``x + 0.0`` into ``x``)
    return jnp.where(x == 0.0, 0.0, x)


def sigmoid(x):
    """``1 / (1 + exp(-x))`` in float32, written out so that every implementation computes the
    same expression (the kernels use this function or its Triton transcription)."""
    return 1.0 / (1.0 + jnp.exp(-x))


def group_limit(score, scoring: Scoring):
    """Choice scores [T, E] with the experts outside each token's ``topk_groups`` best groups
    replaced by ``-inf`` (module docstring: never chosen, for sigmoid and softmax scores alike)."""
    if not scoring.grouped:
        return score
    t, e = score.shape
    g = scoring.num_groups
    by_group = score.reshape(t, g, e // g)
    if scoring.score_func == "sigmoid":
        top2, _ = jax.lax.top_k(by_group, 2)
        group_score = top2[..., 0] + top2[..., 1]
    else:
        group_score = jnp.max(by_group, axis=-1)
    _, keep_g = jax.lax.top_k(group_score, scoring.topk_groups)  # stable: lower group first among equals
    kept = jnp.any(jax.nn.one_hot(keep_g, g, dtype=bool), axis=1)  # [T, G]
    kept_te = jnp.repeat(kept, e // g, axis=1)
    return jnp.where(kept_te, score, -jnp.inf)


def choice_scores(logits, bias=None, scoring: Scoring = Scoring()):
    """What experts are chosen on, [T, E] float32: ``logits + bias`` (softmax) or
    ``sigmoid(logits) + bias`` (sigmoid), group-limited (:func:`group_limit`); -0.0 made +0.0."""
    b = jnp.zeros(logits.shape[-1:], jnp.float32) if bias is None else bias.astype(jnp.float32)
    base = sigmoid(logits) if scoring.score_func == "sigmoid" else logits
    return group_limit(_positive_zero(base + b[None, :]), scoring)


def select_topk(logits, top_k: int, bias=None, scoring: Scoring = Scoring()):
    """Expert choice: indices [T, K] int32 of the K largest :func:`choice_scores` (float32)."""
    _, index = jax.lax.top_k(choice_scores(logits, bias, scoring), top_k)  # stable: lower index first
    return index.astype(jnp.int32)


def scores(logits, scoring: Scoring = Scoring()):
    """Router scores [T, E] float32: the softmax probabilities or the sigmoid affinities."""
    return sigmoid(logits) if scoring.score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)


def _scaled(gates, scoring: Scoring):
    return gates if scoring.scale == 1.0 else gates * jnp.float32(scoring.scale)


def differentiable_outputs(logits, expert_index, mask, scoring: Scoring = Scoring()):
    """The outputs that carry gradients, as functions of the logits for fixed choices.

    Gates: the chosen scores renormalised over the K (softmax: ``p / sum``; sigmoid:
    ``s / (sum + 1e-20)``, HF DeepSeek-V3), times ``scoring.scale``; ``prob_sum``: the softmax
    probabilities, or the sigmoid scores normalised over all experts (module docstring).

    Returns:
      ``(gates [T, K], prob_sum [E], z_sum [])`` in float32.
    """
    s = scores(logits, scoring)
    top_p = jnp.take_along_axis(s, expert_index, axis=-1)
    total = jnp.sum(top_p, axis=-1, keepdims=True)
    if scoring.score_func == "sigmoid":
        total = total + 1e-20
        s = s / jnp.sum(s, axis=-1, keepdims=True)
    gates = jnp.where(mask[:, None], _scaled(top_p / total, scoring), 0.0)
    prob_sum = jnp.sum(jnp.where(mask[:, None], s, 0.0), axis=0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    z_sum = jnp.sum(jnp.where(mask, jnp.square(lse), 0.0))
    return gates, prob_sum, z_sum


def raw_gates(logits, expert_index, mask, scoring: Scoring = Scoring()):
    """Gates without renormalisation: the chosen experts' scores (softmax probabilities or sigmoid
    affinities) times ``scoring.scale``, [T, K] float32 (0 for masked tokens), differentiable in
    ``logits``."""
    s = scores(logits.astype(jnp.float32), scoring)
    return jnp.where(mask[:, None], _scaled(jnp.take_along_axis(s, expert_index, axis=-1), scoring), 0.0)


def chosen_probs(logits, expert_index, scoring: Scoring = Scoring()):
    """Router scores [T, K] of the chosen experts (the priority score; no gradient)."""
    s = scores(jax.lax.stop_gradient(logits), scoring)
    return jnp.take_along_axis(s, expert_index, axis=-1)


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
                    capacity_limit=None, scoring: Scoring = Scoring()) -> RoutingResult:
    """Top-k routing with capacity (pure jnp; differentiable with ``jax.grad``).

    Args:
      logits: router logits [T, E], any float dtype.
      top_k: K in [1, E].
      capacity: C >= 1, slots per expert (the buffer size).
      policy: ``"position"`` or ``"priority"`` (see the module docstring).
      mask: [T] bool, True for real tokens; ``None``: all real.
      bias: [E] float32 selection bias (aux-loss-free balancing); ``None``: none.
      capacity_limit: [E] int32 per-expert limit <= C (dynamic capacity); ``None``: C for all.
      scoring: score function, group limit and gate scaling (:class:`Scoring`; default softmax).

    Returns:
      :class:`RoutingResult` (gates renormalised over the K chosen, times ``scoring.scale``).

    Raises:
      ValueError: see :func:`validate`.
    """
    logits, mask = validate(logits, top_k, capacity, policy, mask, bias, capacity_limit, scoring)
    index = select_topk(logits, top_k, bias, scoring)
    gates, prob_sum, z_sum = differentiable_outputs(logits, index, mask, scoring)
    rank, counts = position_ranks(index, mask, logits.shape[1])
    return finish(index, gates, rank, counts, prob_sum, z_sum, mask, capacity=capacity, policy=policy,
                  capacity_limit=capacity_limit,
                  priority_score=chosen_probs(logits, index, scoring) if policy == "priority" else None)
