"""Mixture-of-experts feed-forward layer (SwiGLU experts, top-k token-choice routing).

Dimension letters: B batch, T tokens, D d_model, F d_ff, E experts, K top_k.

The layer holds the parameters; the computation is :func:`moefast.parallel.expert.moe_ffn`, which
routes each device's tokens locally and, under a mesh with an ``expert`` axis, moves them to their
experts with ``all_to_all`` inside ``jax.shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moefast.parallel.expert import MoEStats, RoutingSpec, moe_ffn

__all__ = ["MoELayer", "MoEStats"]


class MoELayer(nnx.Module):
    """Top-k routed SwiGLU experts.

    Parameters (float32, logical axes in brackets): ``router`` [D, E] (embed, router), ``w_in``
    [E, D, 2F] (expert, embed, mlp) — gate and up projections fused — and ``w_out`` [E, F, D]
    (expert, mlp, embed).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *,
                 capacity_factor: float, min_capacity: int, policy: str = "position", impl: str = "auto",
                 capacity_mode: str = "static", capacity_factor_min: float = 0.5,
                 capacity_factor_max: float = 2.0, warmup_routing: str = "noise", warmup_noise: float = 1.0,
                 grouped_matmul: str = "auto", dispatch: str = "slot", overlap_chunks: int = 1,
                 overlap_chain: bool = False,
                 dtype=jnp.float32, init_std: float = 0.02,
                 out_std: float | None = None, rngs: nnx.Rngs):
        self.num_experts, self.top_k, self.d_ff = num_experts, top_k, d_ff
        self.spec = RoutingSpec(top_k=top_k, capacity_factor=capacity_factor, min_capacity=min_capacity,
                                policy=policy, impl=impl, capacity_mode=capacity_mode,
                                capacity_factor_min=capacity_factor_min, capacity_factor_max=capacity_factor_max,
                                warmup_routing=warmup_routing, warmup_noise=warmup_noise,
                                grouped_matmul=grouped_matmul, dispatch=dispatch, overlap_chunks=overlap_chunks,
                                overlap_chain=overlap_chain)
        self.dtype = dtype
        init = jax.nn.initializers.normal(init_std)
        out_init = jax.nn.initializers.normal(out_std or init_std)
        self.router = nnx.Param(init(rngs.params(), (d_model, num_experts)), logical_axes=("embed", "router"))
        self.w_in = nnx.Param(init(rngs.params(), (num_experts, d_model, 2 * d_ff)),
                              logical_axes=("expert", "embed", "mlp"))
        self.w_out = nnx.Param(out_init(rngs.params(), (num_experts, d_ff, d_model)),
                               logical_axes=("expert", "mlp", "embed"))

    def __call__(self, x_btd: jax.Array, mask_bt: jax.Array, *, drop_tokens: bool = True,
                 bias_e: jax.Array | None = None, load_ema_e: jax.Array | None = None,
                 warmup_key: jax.Array | None = None, warmup_active: jax.Array | None = None
                 ) -> tuple[jax.Array, MoEStats]:
        """Applies the experts.

        Args:
          x_btd: [B, T, D] normalised hidden states (batch split over the mesh's token axes if a
            mesh is set).
          mask_bt: [B, T] bool, False for padding (never routed, counted nowhere).
          drop_tokens: True: capacity from ``capacity_factor`` (assignments beyond it are dropped and
            give exactly 0). False: capacity = tokens per device, so nothing drops and each token's
            output does not depend on the rest of the batch (evaluation, generation).
          bias_e: [E] float32 aux-loss-free selection bias of this layer (train state).
          load_ema_e: [E] float32 load average of this layer (dynamic capacity; train state).
          warmup_key, warmup_active: expert warm-up noise key of this layer and [] bool flag (see
            :func:`~moefast.parallel.expert.moe_ffn`); ``None``: no warm-up.

        Returns:
          ``(y_btd, stats)``: [B, T, D] in ``x_btd.dtype`` and :class:`MoEStats`.
        """
        return moe_ffn(x_btd, mask_bt, self.router[...], self.w_in[...], self.w_out[...], self.spec,
                       drop_tokens=drop_tokens, dtype=self.dtype, bias_e=bias_e, load_ema_e=load_ema_e,
                       warmup_key=warmup_key, warmup_active=warmup_active)
