"""The fused MoE routing operation: top-k, gates, per-expert counts, slots and loss statistics.

``route(logits, top_k=..., capacity=..., policy=..., impl=...)`` returns a :class:`RoutingResult`.
Implementations (``impl``) share one contract, checked bitwise on indices, slots and counts:

* ``"reference"`` — plain jnp (:mod:`.reference`), the truth.
* ``"auto"`` — the fastest available on the current backend.
"""

from __future__ import annotations

import jax

from .reference import POLICIES, RoutingResult, route_reference

__all__ = ["IMPLS", "POLICIES", "RoutingResult", "route"]

IMPLS = ("reference", "auto")


def _resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "reference"
    return impl


def route(logits: jax.Array, *, top_k: int, capacity: int, policy: str = "position", impl: str = "auto",
          mask: jax.Array | None = None, bias: jax.Array | None = None,
          capacity_limit: jax.Array | None = None) -> RoutingResult:
    """Routes T tokens to their top-k of E experts with a capacity of C slots per expert.

    Args:
      logits: router logits [T, E], any float dtype (math in float32).
      top_k: K, experts per token, in [1, E].
      capacity: C >= 1, slots per expert (static).
      policy: ``"position"`` (GShard order) or ``"priority"`` (largest gates keep the slots).
      impl: one of :data:`IMPLS`.
      mask: [T] bool, False for padding (never routed, counted nowhere).
      bias: [E] float32 selection-only bias (aux-loss-free balancing, DeepSeek-V3).
      capacity_limit: [E] int32 dynamic per-expert limit <= C.

    Returns:
      :class:`RoutingResult` (see :mod:`.reference` for the exact conventions). Gradients flow
      from ``gates``, ``prob_sum`` and ``z_sum`` to ``logits``.

    Raises:
      ValueError: bad shapes, top_k, capacity, policy or impl (at trace time).
    """
    impl = _resolve(impl)
    return route_reference(logits, top_k=top_k, capacity=capacity, policy=policy, mask=mask, bias=bias,
                           capacity_limit=capacity_limit)
