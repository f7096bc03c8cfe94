"""The fused MoE routing operation: top-k, gates, per-expert counts, slots and loss statistics.

``route(logits, top_k=..., capacity=..., policy=..., impl=...)`` returns a :class:`RoutingResult`.
Implementations (``impl``) share one contract, checked bitwise on indices, slots and counts:

* ``"reference"`` — plain jnp (:mod:`.reference`), the truth.
* ``"pallas"`` — a Pallas kernel (:mod:`.pallas`, wrapped by :mod:`.ops`): one pass over the logits
  in token blocks, ranks from block counts without a sort. Compiled through the Pallas Triton
  backend on GPU; on CPU it runs in the Pallas interpreter (correct but slow: tests only).
* ``"triton"`` — the same one-pass kernel written in Triton (:mod:`.triton`), called through
  ``jax_triton.triton_call`` (the ``[gpu]`` extra); GPU only. Checked on CPU by running the kernel
  itself under the Triton interpreter (torch tensors) against the reference.
* ``"auto"`` — ``"pallas"`` when compiling for GPUs (:func:`~moefast.kernels.platform.target_platform`:
  the platform of the mesh, not the host's), ``"reference"`` elsewhere (the interpreter is for tests).
  Compiled for sm_90a the kernel takes 96 registers and spills none; ``scripts/gpu_check.py``
  checks it against the reference and times both on a GPU.

Every impl supports ``jax.grad``/``jax.vjp`` and ``jax.shard_map`` (the Pallas interpreter only
with ``check_vma=False``), and all but ``"triton"`` ``jax.vmap`` (jax-triton's call has no batching
rule; moefast never vmaps the routing); ``jax.jvp`` only ``"reference"`` (the kernels have a
custom VJP).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..platform import resolve_impl
from .ops import route_pallas, route_triton
from .reference import POLICIES, SCORE_FUNCS, RoutingResult, Scoring, raw_gates, route_reference

__all__ = ["IMPLS", "POLICIES", "SCORE_FUNCS", "RoutingResult", "Scoring", "resolve", "route"]

IMPLS = ("reference", "pallas", "triton", "auto")


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`): ``"auto"`` is ``"pallas"`` on GPU and
    ``"reference"`` elsewhere.

    Raises:
      ValueError: an unknown ``impl``.
    """
    return resolve_impl(impl, IMPLS, "reference", "routing", platform)


def route(logits: jax.Array, *, top_k: int, capacity: int, policy: str = "position", impl: str = "auto",
          mask: jax.Array | None = None, bias: jax.Array | None = None,
          capacity_limit: jax.Array | None = None, renormalize: bool = True, score_func: str = "softmax",
          num_groups: int = 1, topk_groups: int = 1, routed_scaling_factor: float = 1.0) -> RoutingResult:
    """Routes T tokens to their top-k of E experts with a capacity of C slots per expert.

    Args:
      logits: router logits [T, E], any float dtype (math in float32).
      top_k: K, experts per token, in [1, E].
      capacity: C >= 1, slots per expert (static).
      policy: ``"position"`` (GShard order) or ``"priority"`` (largest gates keep the slots).
      impl: one of :data:`IMPLS`.
      mask: [T] bool, False for padding (never routed, counted nowhere).
      bias: [E] float32 selection-only bias (aux-loss-free balancing, DeepSeek-V3 sec. 2.1.2 eq. 16),
        in the units of the scores chosen on: logits for softmax, sigmoid affinities for sigmoid
        (HF ``e_score_correction_bias``). Never part of a gate.
      capacity_limit: [E] int32 dynamic per-expert limit <= C.
      renormalize: gates are the chosen scores renormalised to sum to 1 over the K chosen
        (True: Mixtral, DeepSeek-V3; ``norm_topk_prob``; sigmoid scores divide by the sum
        ``+ 1e-20`` as HF does) or the chosen scores as they are (False: Switch, Qwen2-MoE, OLMoE,
        DeepSeek-V2). Choices, slots and statistics do not depend on it.
      score_func: ``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3, GLM-4.5): see :mod:`.reference`.
      num_groups: G >= 1 dividing E, expert groups of the group-limited top-k (HF ``n_group``;
        1: none). The group score follows ``score_func``: the sum of the two best biased sigmoid
        scores (DeepSeek-V3 noaux_tc) or the best softmax score (DeepSeek-V2 group_limited_greedy).
      topk_groups: groups each token may choose from, in [1, G] (HF ``topk_group``).
      routed_scaling_factor: dimensionless multiplier of the gates, applied once after any
        renormalisation (HF ``routed_scaling_factor``; 1.0: none).

    Returns:
      :class:`RoutingResult` (see :mod:`.reference` for the exact conventions). Gradients flow
      from ``gates``, ``prob_sum`` and ``z_sum`` to ``logits``.

    Raises:
      ValueError: bad shapes, top_k, capacity, policy or impl, or a score function, group limit or
        scaling factor that does not fit E and K (:meth:`.reference.Scoring.check`), at trace time.
    """
    impl = resolve(impl)
    scoring = Scoring(score_func, num_groups, topk_groups, float(routed_scaling_factor))
    route_fn = {"pallas": route_pallas, "triton": route_triton}.get(impl, route_reference)
    r = route_fn(logits, top_k=top_k, capacity=capacity, policy=policy, mask=mask, bias=bias,
                 capacity_limit=capacity_limit, scoring=scoring)
    if renormalize:
        return r
    # The kernels' renormalised gates are left unused (dead code under jit); the raw ones are the
    # scores of the logits at the chosen experts times the scale, differentiable as they are.
    m = jnp.ones(logits.shape[:1], bool) if mask is None else mask.astype(bool)
    return r._replace(gates=raw_gates(logits, r.expert_index, m, scoring))
