"""Mixture-of-experts feed-forward layer (SwiGLU experts, top-k token-choice routing).

Dimension letters: B batch, T tokens, D d_model, F d_ff, E experts, K top_k, C capacity.

Routing is local: when a mesh with a ``data`` axis of size > 1 is set (``jax.set_mesh``), the layer
runs inside ``jax.shard_map`` so each device routes only its own tokens (a routing group is the
tokens of one device) and never lets the partitioner wrap the cumsum/scatter/gather in collectives.
The per-expert statistics are summed over the ``data`` axis, so the load-balancing and z-losses are
those of the global batch whatever the mesh.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moefast import routing

__all__ = ["MoELayer", "MoEStats"]

DATA_AXIS = "data"


class MoEStats(NamedTuple):
    """Routing statistics of one MoE layer over the whole (global) batch."""

    tokens_per_expert: jax.Array  # [E] int32, assignments per expert before capacity
    aux_loss: jax.Array  # [] float32, Switch load-balancing loss (before its coefficient)
    z_loss: jax.Array  # [] float32, ST-MoE router z-loss (before its coefficient)
    dropped_fraction: jax.Array  # [] float32, dropped assignments / routed assignments


class MoELayer(nnx.Module):
    """Top-k routed SwiGLU experts.

    Parameters: ``router`` [D, E] (float32, used in float32), ``w_in`` [E, D, 2F] (gate and up
    projections fused), ``w_out`` [E, F, D].
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *,
                 capacity_factor: float, min_capacity: int, dtype=jnp.float32,
                 init_std: float = 0.02, out_std: float | None = None, rngs: nnx.Rngs):
        self.num_experts, self.top_k, self.d_ff = num_experts, top_k, d_ff
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.dtype = dtype
        init = jax.nn.initializers.normal(init_std)
        self.router = nnx.Param(init(rngs.params(), (d_model, num_experts), jnp.float32))
        self.w_in = nnx.Param(init(rngs.params(), (num_experts, d_model, 2 * d_ff), jnp.float32))
        out_init = jax.nn.initializers.normal(out_std or init_std)
        self.w_out = nnx.Param(out_init(rngs.params(), (num_experts, d_ff, d_model), jnp.float32))

    def __call__(self, x_btd: jax.Array, mask_bt: jax.Array, *, drop_tokens: bool = True
                 ) -> tuple[jax.Array, MoEStats]:
        """Applies the experts.

        Args:
          x_btd: [B, T, D] normalised hidden states (batch sharded over ``data`` if a mesh is set).
          mask_bt: [B, T] bool, False for padding (never routed, counted nowhere).
          drop_tokens: True: capacity from ``capacity_factor`` (assignments beyond it are dropped and
            give exactly 0). False: capacity = tokens in the group, so nothing drops and each
            token's output does not depend on the rest of the batch (evaluation, generation).

        Returns:
          ``(y_btd, stats)``: [B, T, D] in ``x_btd.dtype`` and :class:`MoEStats`.
        """
        weights = (self.router[...], self.w_in[...], self.w_out[...])
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or DATA_AXIS not in mesh.axis_names or mesh.shape[DATA_AXIS] == 1:
            y, stats = self._local(x_btd, mask_bt, *weights, drop_tokens=drop_tokens, axis=None)
        else:
            fn = lambda x, m, *w: self._local(x, m, *w, drop_tokens=drop_tokens, axis=DATA_AXIS)
            y, stats = jax.shard_map(
                fn, in_specs=(P(DATA_AXIS), P(DATA_AXIS), P(), P(), P()),
                out_specs=(P(DATA_AXIS), P()))(x_btd, mask_bt, *weights)
        return y, stats

    def _local(self, x_btd, mask_bt, router_de, w_in_edf, w_out_efd, *, drop_tokens: bool,
               axis: str | None):
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        mask_t = mask_bt.reshape(b * t)
        num_tokens = b * t
        if drop_tokens:
            capacity = routing.compute_capacity(num_tokens, self.num_experts, self.top_k,
                                                self.capacity_factor, self.min_capacity)
        else:
            capacity = num_tokens
        logits_te = x_td.astype(jnp.float32) @ router_de
        r = routing.route(logits_te, top_k=self.top_k, capacity=capacity, mask_t=mask_t)

        x_ecd = routing.dispatch(x_td, r, self.num_experts, capacity)
        h_ecf = jnp.einsum("ecd,edf->ecf", x_ecd, w_in_edf.astype(self.dtype))
        gate_ecf, up_ecf = jnp.split(h_ecf, 2, axis=-1)
        y_ecd = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate_ecf) * up_ecf, w_out_efd.astype(self.dtype))
        y_td = routing.combine(y_ecd, r)

        sums = (r.tokens_per_expert, r.prob_sum, r.z_sum, r.num_tokens, r.num_dropped)
        if axis is not None:
            sums = jax.lax.psum(sums, axis)
        tokens_per_expert, prob_sum, z_sum, n, dropped = sums
        stats = MoEStats(
            tokens_per_expert=tokens_per_expert,
            aux_loss=routing.load_balancing_loss(tokens_per_expert, prob_sum, n, self.top_k),
            z_loss=routing.router_z_loss(z_sum, n),
            dropped_fraction=dropped.astype(jnp.float32) / jnp.maximum(n * self.top_k, 1.0),
        )
        return y_td.reshape(b, t, d).astype(x_btd.dtype), stats
