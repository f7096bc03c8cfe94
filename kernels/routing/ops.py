"""Routing with the Pallas kernel: global ranks from block counts, capacity, and a custom VJP.

Dimension letters: T tokens, E experts, K top_k, B token blocks.

The kernel (:mod:`.pallas`) returns, per token block, the counts [B, K, E] and each assignment's
rank within its block. GShard position order visits all first choices in token order, then all
second choices, ...; so the assignments before block b's k-th choices to expert e are exactly those
of the (k', b') pairs that precede (k, b) in (k, block) order. Their number is an exclusive prefix
sum of the counts over the flattened (k, block) axis, and

    position rank = offset[k, block(t), e] + within-block rank

with no sort. Capacity, ``capacity_limit`` and the priority policy are then applied by the shared
:func:`.reference.finish`, identical for every implementation.

Pallas kernels have no reverse-mode rule, so the kernel call is wrapped in :func:`jax.custom_vjp`:
the backward pass is the VJP of :func:`.reference.differentiable_outputs` (gates, prob_sum and
z_sum as functions of the logits for the chosen experts), which is exactly the gradient of the
reference. Forward-mode AD (``jax.jvp``) is not supported through the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .pallas import check_block_tokens, default_interpret, routing_blocks
from .reference import RoutingResult, Scoring, chosen_probs, differentiable_outputs, finish, validate

__all__ = ["route_pallas", "route_triton"]


def _position_ranks(block_rank, counts, expert_index, block_tokens: int):
    """Global position-order ranks [T, K] (-1 for masked) and tokens_per_expert [E] from block results."""
    nb, k, e = counts.shape
    counts_kbe = jnp.transpose(counts, (1, 0, 2)).reshape(k * nb, e)  # (k, block) order
    offsets = (jnp.cumsum(counts_kbe, axis=0) - counts_kbe).reshape(k, nb, e)  # exclusive prefix sum
    t = expert_index.shape[0]
    block_of_token = (jnp.arange(t, dtype=jnp.int32) // block_tokens)[:, None]
    choice = jnp.arange(k, dtype=jnp.int32)[None, :]
    rank = jnp.where(block_rank >= 0, offsets[choice, block_of_token, expert_index] + block_rank, -1)
    return rank.astype(jnp.int32), jnp.sum(counts_kbe, axis=0).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _route_core(logits, mask, bias, top_k, block_tokens, interpret, rank_method, num_warps, kernel, scoring):
    """``kernel``: ``"pallas"`` or ``"triton"`` (through jax-triton, GPU only)."""
    if kernel == "triton":
        from . import triton as triton_kernel

        out = triton_kernel.routing_blocks(logits, mask, bias, top_k=top_k, block_tokens=block_tokens,
                                           num_warps=num_warps, scoring=scoring)
    else:
        out = routing_blocks(logits, mask, bias, top_k=top_k, block_tokens=block_tokens, interpret=interpret,
                             rank_method=rank_method, num_warps=num_warps, scoring=scoring)
    rank, tokens_per_expert = _position_ranks(out.block_rank, out.counts, out.expert_index, block_tokens)
    return (out.expert_index, out.gates, rank, tokens_per_expert, jnp.sum(out.prob_sum, axis=0),
            jnp.sum(out.z_sum))


def _route_core_fwd(logits, mask, bias, top_k, block_tokens, interpret, rank_method, num_warps, kernel, scoring):
    outs = _route_core(logits, mask, bias, top_k, block_tokens, interpret, rank_method, num_warps, kernel, scoring)
    return outs, (logits, outs[0], mask, bias)


def _route_core_bwd(top_k, block_tokens, interpret, rank_method, num_warps, kernel, scoring, residuals,
                    cotangents):
    del top_k, block_tokens, interpret, rank_method, num_warps, kernel
    logits, expert_index, mask, bias = residuals
    _, g_gates, _, _, g_prob_sum, g_z_sum = cotangents  # int outputs carry float0 cotangents
    _, vjp = jax.vjp(lambda lg: differentiable_outputs(lg.astype(jnp.float32), expert_index, mask, scoring),
                     logits)
    (g_logits,) = vjp((g_gates, g_prob_sum, g_z_sum))
    # The mask is boolean (float0 cotangent); the bias only selects experts, so its gradient is zero,
    # as in the reference (top-k indices carry no derivative).
    return g_logits, np.zeros(mask.shape, jax.dtypes.float0), jnp.zeros_like(bias)


_route_core.defvjp(_route_core_fwd, _route_core_bwd)


def route_triton(logits: jax.Array, *, top_k: int, capacity: int, policy: str = "position",
                 mask: jax.Array | None = None, bias: jax.Array | None = None,
                 capacity_limit: jax.Array | None = None, block_tokens: int = 128,
                 num_warps: int | None = None, scoring: Scoring = Scoring()) -> RoutingResult:
    """:func:`route_pallas` with the Triton kernel (:mod:`.triton`) called through jax-triton: the
    same contract, custom VJP, capacity and policies. GPU only.

    Raises:
      ValueError: see :func:`.reference.validate` and a bad ``block_tokens``.
      RuntimeError: jax-triton missing or not on a GPU (:func:`.triton.available`).
    """
    from . import triton as triton_kernel

    logits32, mask = validate(logits, top_k, capacity, policy, mask, bias, capacity_limit, scoring)
    check_block_tokens(block_tokens)
    why = triton_kernel.available()
    if why:
        raise RuntimeError(why)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        logits = logits32
    bias_e = jnp.zeros((logits.shape[1],), jnp.float32) if bias is None else bias.astype(jnp.float32)
    index, gates, rank, tokens_per_expert, prob_sum, z_sum = _route_core(
        logits, mask, bias_e, top_k, block_tokens, False, "cumsum", num_warps, "triton", scoring)
    return finish(index, gates, rank, tokens_per_expert, prob_sum, z_sum, mask, capacity=capacity,
                  policy=policy, capacity_limit=capacity_limit,
                  priority_score=chosen_probs(logits32, index, scoring) if policy == "priority" else None)


def route_pallas(logits: jax.Array, *, top_k: int, capacity: int, policy: str = "position",
                 mask: jax.Array | None = None, bias: jax.Array | None = None,
                 capacity_limit: jax.Array | None = None, block_tokens: int = 128,
                 interpret: bool | None = None, rank_method: str = "cumsum",
                 num_warps: int | None = None, scoring: Scoring = Scoring()) -> RoutingResult:
    """Top-k routing with capacity, computed by the Pallas kernel in one pass over the logits.

    Same contract as :func:`.reference.route_reference`: ``expert_index``, ``slot``,
    ``tokens_per_expert`` and ``num_dropped`` are bitwise equal to the reference (except where two
    router probabilities of one token are within an ulp of each other, see :mod:`.pallas`); the float
    outputs agree to float32 rounding.

    Args:
      logits: router logits [T, E], any float dtype (read once by the kernel, math in float32).
      top_k: K in [1, E].
      capacity: C >= 1, slots per expert.
      policy: ``"position"`` or ``"priority"``. Under ``"priority"`` the score is recomputed from
        the logits by :func:`.reference.chosen_probs` (a second read of the logits) so that the
        priority order is the reference's bit for bit.
      mask: [T] bool, True for real tokens; ``None``: all real.
      bias: [E] float32 selection bias; ``None``: none. Receives a zero gradient.
      capacity_limit: [E] int32 per-expert limit <= C; ``None``: C for all.
      block_tokens: tokens per kernel grid step, a power of two (Triton block shapes are powers of
        two). T need not be a multiple of it.
      interpret: run the kernel with the Pallas interpreter; ``None``: True on a CPU default backend.
      rank_method: ``"cumsum"`` or ``"matmul"``, how the kernel counts within-block ranks (see
        :mod:`.pallas`); same results.
      num_warps: Triton warps per block (compiled mode); ``None``: 4 for small blocks, else 8.
      scoring: score function, group limit and gate scaling (:class:`.reference.Scoring`); the
        kernel computes all three in its one pass.

    Returns:
      :class:`.reference.RoutingResult`. Gradients (``jax.grad``/``jax.vjp``) flow from ``gates``,
      ``prob_sum`` and ``z_sum`` to ``logits``; ``jax.jvp`` is not supported.

    Raises:
      ValueError: see :func:`.reference.validate`; also a ``block_tokens`` that is not a positive
        power of two (>= 16 for ``"matmul"``) or an unknown ``rank_method``.
      NotImplementedError: interpret mode inside ``jax.shard_map(check_vma=True)`` on varying
        inputs (see :func:`.pallas.routing_blocks`).
    """
    logits32, mask = validate(logits, top_k, capacity, policy, mask, bias, capacity_limit, scoring)
    check_block_tokens(block_tokens, rank_method)
    if interpret is None:
        interpret = default_interpret()
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        logits = logits32
    bias_e = jnp.zeros((logits.shape[1],), jnp.float32) if bias is None else bias.astype(jnp.float32)
    index, gates, rank, tokens_per_expert, prob_sum, z_sum = _route_core(
        logits, mask, bias_e, top_k, block_tokens, bool(interpret), rank_method, num_warps, "pallas", scoring)
    return finish(index, gates, rank, tokens_per_expert, prob_sum, z_sum, mask, capacity=capacity,
                  policy=policy, capacity_limit=capacity_limit,
                  priority_score=chosen_probs(logits32, index, scoring) if policy == "priority" else None)
