"""Dispatch and combine: the data movement around the experts.

Dimension letters: T tokens, E experts, K top_k, C capacity, D d_model.

By slot (``moe.dispatch: slot``, the default): ``dispatch`` builds an [E, C] table of token indices
from the slots (a scatter of T*K ints, no one-hot [T, E, C] tensor) and gathers the tokens into
per-expert buffers; ``combine`` gathers every assignment's expert output back and sums them
weighted by the gates. Both are linear in T; gradients flow to the tokens through the gather and to
the gates through the combine.

One-hot (``moe.dispatch: onehot``, the baseline of ``moefast bench train --ablate``): GShard's
dispatch and combine tensors (Lepikhin et al. 2020, sec. 2.2 and its algorithm 1): a 0/1 mask
[T, E, C] and the gate-weighted [T, E, C] combine weights, applied with two einsums, the way most
JAX MoE code moves tokens. Their cost is O(T * E * C * D), quadratic in the tokens per group.
Same routing and the same results as by slot (the one-hot einsums add exact zeros; the sums may
round differently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moefast.routing.core import RoutingResult

__all__ = ["combine", "combine_onehot", "combine_rows", "dispatch", "dispatch_onehot", "onehot_masks"]


def dispatch(x_td: jax.Array, r: RoutingResult, num_experts: int, capacity: int) -> jax.Array:
    """Gathers tokens into per-expert capacity buffers.

    Args:
      x_td: tokens [T, D], any dtype.
      r: routing of these tokens (``r.slot`` [T, K] < capacity or -1).
      num_experts: E.
      capacity: C.

    Returns:
      [E, C, D] in ``x_td.dtype``; empty slots hold zeros.
    """
    num_tokens, top_k = r.slot.shape
    token_id_tk = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], (num_tokens, top_k))
    slot_tk = jnp.where(r.slot >= 0, r.slot, capacity)  # out of range -> dropped by the scatter
    table_ec = jnp.full((num_experts, capacity), num_tokens, jnp.int32)  # index T = the zero row
    table_ec = table_ec.at[r.expert_index.reshape(-1), slot_tk.reshape(-1)].set(
        token_id_tk.reshape(-1), mode="drop", unique_indices=True)
    x_pad = jnp.concatenate([x_td, jnp.zeros((1, x_td.shape[-1]), x_td.dtype)], axis=0)
    return x_pad[table_ec]


def combine(y_ecd: jax.Array, r: RoutingResult) -> jax.Array:
    """Sums each token's expert outputs weighted by its gates.

    Args:
      y_ecd: expert outputs [E, C, D].
      r: the routing used by :func:`dispatch`.

    Returns:
      [T, D] in ``y_ecd.dtype``; exactly 0 for tokens whose assignments were all dropped or masked.
      The weighted sum is taken in float32.
    """
    num_experts, capacity, d = y_ecd.shape
    return combine_rows(y_ecd.reshape(num_experts * capacity, d), r.expert_index * capacity + r.slot, r)


def combine_rows(y_nd: jax.Array, row_tk: jax.Array, r: RoutingResult) -> jax.Array:
    """Gate-weighted sum of each token's output rows.

    Args:
      y_nd: expert outputs, one row per routed assignment, [N, D].
      row_tk: [T, K] int, the row of each assignment (ignored where ``r.slot`` is -1).
      r: the routing (``slot`` -1 marks dropped or masked assignments, which contribute exactly 0).

    Returns:
      [T, D] in ``y_nd.dtype``, summed in float32.
    """
    kept_tk = r.slot >= 0
    y_tkd = y_nd[jnp.where(kept_tk, row_tk, 0)]
    w_tk = jnp.where(kept_tk, r.gates, 0.0)
    out = jnp.sum(jnp.where(kept_tk[..., None], y_tkd.astype(jnp.float32) * w_tk[..., None], 0.0), axis=1)
    return out.astype(y_nd.dtype)


def onehot_masks(r: RoutingResult, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """GShard's dispatch mask and combine weights of a routing.

    Args:
      r: the routing (``r.slot`` [T, K] < capacity, -1 for dropped or masked assignments).
      num_experts: E.
      capacity: C.

    Returns:
      ``(dispatch_tec, combine_tec)``: float32 [T, E, C]; ``dispatch`` is 1 where token t holds
      slot c of expert e, ``combine`` is that assignment's gate there; both 0 elsewhere.
    """
    kept_tk = r.slot >= 0
    expert_tke = jax.nn.one_hot(r.expert_index, num_experts, dtype=jnp.float32)
    slot_tkc = jax.nn.one_hot(jnp.where(kept_tk, r.slot, -1), capacity, dtype=jnp.float32)  # -1: all zeros
    dispatch_tec = jnp.einsum("tke,tkc->tec", expert_tke, slot_tkc)
    combine_tec = jnp.einsum("tke,tkc,tk->tec", expert_tke, slot_tkc, jnp.where(kept_tk, r.gates, 0.0))
    return dispatch_tec, combine_tec


def dispatch_onehot(x_td: jax.Array, dispatch_tec: jax.Array) -> jax.Array:
    """Per-expert buffers by one-hot einsum: [T, D] tokens and the [T, E, C] mask of
    :func:`onehot_masks` -> [E, C, D] in ``x_td.dtype`` (empty slots hold zeros)."""
    return jnp.einsum("tec,td->ecd", dispatch_tec.astype(x_td.dtype), x_td)


def combine_onehot(y_ecd: jax.Array, combine_tec: jax.Array) -> jax.Array:
    """Gate-weighted sum by one-hot einsum: [E, C, D] expert outputs and the [T, E, C] combine
    weights of :func:`onehot_masks` -> [T, D] in ``y_ecd.dtype``, summed in float32."""
    out = jnp.einsum("tec,ecd->td", combine_tec, y_ecd.astype(jnp.float32))
    return out.astype(y_ecd.dtype)
