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

from moefast.config import MoEConfig
from moefast.model.norm import rms
from moefast.parallel.expert import MoEStats, RoutingSums, gated_unit, moe_ffn
from moefast.parallel.mesh import check_mesh_axes
from moefast.model.lora import expert_projection, is_nf4, project, recompute_dequantized
from moefast.parallel.precision import dense

__all__ = ["MoELayer", "MoEStats"]


class MoELayer(nnx.Module):
    """Top-k routed SwiGLU experts, with an optional shared expert.

    Routing follows ``moe`` whole: softmax or sigmoid scores (``moe.score_func``), an optional
    group-limited top-k (``moe.num_groups``, ``moe.topk_groups``), ``moe.norm_topk_prob`` and
    ``moe.routed_scaling_factor``, which scales the routed experts' gates once (inside the routing,
    :mod:`moefast.kernels.routing`) and never the shared expert.

    Parameters (float32, logical axes in brackets): ``router`` [D, E] (embed, router), ``w_in``
    [E, D, 2F] (expert, embed, mlp) — gate and up projections fused, gate first; [E, D, F], the up
    projection alone, with ``moe.expert_activation=relu2``, as the shared expert's — and ``w_out``
    [E, F, D] (expert, mlp, embed). With ``moe.shared_expert_d_ff`` = Fs > 0 also ``shared_w_in``
    [D, 2Fs] (embed, mlp), ``shared_w_out`` [Fs, D] (mlp, embed) and, with
    ``moe.shared_expert_gate``, ``shared_gate`` [D, 1] (embed, None). With ``moe.router_bias``:
    ``router_bias`` [E] (router); with ``moe.expert_bias``: ``b_in`` [E, 2F] (expert, mlp) and
    ``b_out`` [E, D] (expert, embed), zero-initialised (gpt-oss). With ``moe.branch_norms`` (Gemma
    4): ``shared_out_norm``, ``routed_in_norm``, ``routed_out_norm`` and ``router_scale`` [D]
    (norm), starting at 1; with ``moe.per_expert_scale``: ``expert_scale`` [E] (router), starting
    at 1. Every expert's gated unit, the shared one's included, is ``moe.expert_activation``'s
    (:func:`~moefast.parallel.expert.gated_unit`).

    Args:
      d_model: D.
      d_ff: F, hidden width of each routed expert.
      moe: every MoE option (:class:`~moefast.config.MoEConfig`), passed whole to
        :func:`~moefast.parallel.expert.moe_ffn`.
      dtype: compute dtype of the experts (the router is float32).
      init_std: normal initialiser std of ``router`` and the input projections.
      out_std: std of the output projections (default ``init_std``).
      norm_eps: epsilon of the RMSNorms of ``moe.branch_norms``.
      fp8: the routed and shared experts' GEMMs by the FP8 recipe (``model.precision: fp8``,
        :mod:`moefast.parallel.fp8_gemm`).
      rngs: parameter initialisation keys.

    Example::

        layer = MoELayer(256, 512, MoEConfig(num_experts=8, top_k=2), rngs=nnx.Rngs(0))
        y_btd, stats = layer(x_btd, mask_bt)
    """

    def __init__(self, d_model: int, d_ff: int, moe: MoEConfig, *, dtype=jnp.float32, init_std: float = 0.02,
                 out_std: float | None = None, norm_eps: float = 1e-6, fp8: bool = False, rngs: nnx.Rngs):
        if d_model < 1 or d_ff < 1:
            raise ValueError(f"MoELayer: d_model and d_ff must be >= 1, got {d_model} and {d_ff}")
        self.moe, self.d_ff, self.dtype, self.norm_eps, self.fp8 = moe, d_ff, dtype, norm_eps, fp8
        e = moe.num_experts
        init = jax.nn.initializers.normal(init_std)
        out_init = jax.nn.initializers.normal(out_std or init_std)
        self.router = nnx.Param(init(rngs.params(), (d_model, e)), logical_axes=("embed", "router"))
        up = 2 if moe.gated else 1  # a fused gate | up, or (relu2) the up projection alone
        de = moe.latent_size or d_model  # the width the routed experts work in
        if moe.latent_size:  # Nemotron 3's latent MoE: down before the experts, up after
            self.fc1_latent_proj = nnx.Param(init(rngs.params(), (d_model, de)), logical_axes=("embed", "lora"))
            self.fc2_latent_proj = nnx.Param(out_init(rngs.params(), (de, d_model)), logical_axes=("lora", "embed"))
        self.w_in = nnx.Param(init(rngs.params(), (e, de, up * d_ff)), logical_axes=("expert", "embed", "mlp"))
        self.w_out = nnx.Param(out_init(rngs.params(), (e, d_ff, de)), logical_axes=("expert", "mlp", "embed"))
        if moe.router_bias:
            self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=("router",))
        if moe.expert_bias:
            self.b_in = nnx.Param(jnp.zeros((e, up * d_ff), jnp.float32), logical_axes=("expert", "mlp"))
            self.b_out = nnx.Param(jnp.zeros((e, de), jnp.float32), logical_axes=("expert", "embed"))
        fs = moe.shared_expert_d_ff
        if fs:
            self.shared_w_in = nnx.Param(init(rngs.params(), (d_model, up * fs)), logical_axes=("embed", "mlp"))
            self.shared_w_out = nnx.Param(out_init(rngs.params(), (fs, d_model)), logical_axes=("mlp", "embed"))
            if moe.shared_expert_gate:
                self.shared_gate = nnx.Param(init(rngs.params(), (d_model, 1)), logical_axes=("embed", None))
        if moe.branch_norms:  # Gemma 4's block: the branches' own RMSNorms and the router's scale
            norm = lambda: nnx.Param(jnp.ones((d_model,), jnp.float32), logical_axes=("norm",))  # noqa: E731
            self.shared_out_norm, self.routed_in_norm, self.routed_out_norm = norm(), norm(), norm()
            self.router_scale = norm()
        if moe.per_expert_scale:
            self.expert_scale = nnx.Param(jnp.ones((e,), jnp.float32), logical_axes=("router",))

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts

    @property
    def top_k(self) -> int:
        return self.moe.top_k

    def __call__(self, x_btd: jax.Array, mask_bt: jax.Array, *, drop_tokens: bool = True,
                 bias_e: jax.Array | None = None, load_ema_e: jax.Array | None = None,
                 warmup_key: jax.Array | None = None, warmup_active: jax.Array | None = None,
                 reduce_stats: bool = True, residual_btd: jax.Array | None = None
                 ) -> tuple[jax.Array, MoEStats | RoutingSums]:
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
          warmup_key: expert warm-up noise key of this layer (see
            :func:`~moefast.parallel.expert.moe_ffn`); ``None``: no warm-up.
          warmup_active: [] bool, whether this step is in the warm-up (see
            :func:`~moefast.parallel.expert.moe_ffn`).
          reduce_stats: False: per-token-shard :class:`~moefast.parallel.expert.RoutingSums`
            instead of :class:`MoEStats` (see :func:`~moefast.parallel.expert.moe_ffn`).
          residual_btd: [B, T, D] the block's residual stream before its norm, which the router and
            the routed experts read with ``moe.branch_norms`` (required then; ``x_btd`` is the
            shared expert's input).

        Returns:
          ``(y_btd, stats)``: [B, T, D] in ``x_btd.dtype`` — the routed experts' gated sum plus the
          shared expert's output, if any — and :class:`MoEStats` (or ``RoutingSums``).

        Raises:
          ValueError: ``x_btd`` not float [B, T, D] with this layer's D, ``mask_bt`` not [B, T], a
            mesh axis moefast does not know, or see :func:`~moefast.parallel.expert.moe_ffn`.
        """
        d_model = self.router.shape[0]
        if x_btd.ndim != 3 or x_btd.shape[-1] != d_model:
            raise ValueError(f"MoELayer: x_btd must be [batch, tokens, d_model={d_model}], got shape {x_btd.shape}")
        if not jnp.issubdtype(x_btd.dtype, jnp.floating):
            raise ValueError(f"MoELayer: x_btd must be float hidden states (e.g. float32 or bfloat16), got "
                             f"{x_btd.dtype}; token ids go through an embedding first")
        check_mesh_axes(jax.sharding.get_abstract_mesh(), "MoELayer")
        if mask_bt is None or tuple(mask_bt.shape) != tuple(x_btd.shape[:2]):
            got = None if mask_bt is None else tuple(mask_bt.shape)
            raise ValueError(f"MoELayer: mask_bt must be a [batch, tokens] = {tuple(x_btd.shape[:2])} bool array "
                             f"(True for real tokens; jnp.ones(...) if every token is real), got {got}")
        routed_x, router_x = x_btd, None
        if self.moe.branch_norms:
            if residual_btd is None or residual_btd.shape != x_btd.shape:
                raise ValueError(f"MoELayer: moe.branch_norms reads the residual stream: pass residual_btd of shape "
                                 f"{tuple(x_btd.shape)}, got {None if residual_btd is None else residual_btd.shape}")
            eps = self.norm_eps
            routed_x = rms(residual_btd, eps, self.routed_in_norm[...]).astype(x_btd.dtype)
            router_x = rms(residual_btd, eps, self.router_scale[...]) * d_model ** -0.5  # float32
        if self.moe.latent_size:  # the router reads the full width, the experts the latent one
            router_x = routed_x if router_x is None else router_x
            routed_x = project(self, "fc1_latent_proj", routed_x, self.dtype, ("embed", "lora"), fp8=self.fp8)

        def routed(routed_x, router_x):
            bias = self.moe.expert_bias
            w_in = expert_projection(self, "w_in", self.b_in[...] if bias else None)
            w_out = expert_projection(self, "w_out", self.b_out[...] if bias else None)
            return moe_ffn(routed_x, mask_bt, self.router[...], w_in, w_out, self.moe, drop_tokens=drop_tokens,
                           dtype=self.dtype, fp8=self.fp8, bias_e=bias_e, load_ema_e=load_ema_e, warmup_key=warmup_key,
                           warmup_active=warmup_active, reduce_stats=reduce_stats,
                           router_bias_e=self.router_bias[...] if self.moe.router_bias else None,
                           router_x_btd=router_x,
                           expert_scale_e=self.expert_scale[...] if self.moe.per_expert_scale else None)

        # NF4 experts (lora.base_dtype: nf4): dequantized again in the backward pass, never kept
        y, stats = (recompute_dequantized(routed) if is_nf4(self) else routed)(routed_x, router_x)
        if self.moe.latent_size:
            y = project(self, "fc2_latent_proj", y.astype(self.dtype), self.dtype, ("lora", "embed"), fp8=self.fp8)
        return (self._with_shared(x_btd, y) if self.moe.shared_expert_d_ff else y), stats

    def _with_shared(self, x_btd, y_btd):
        """The routed output ``y_btd`` plus the shared expert's on ``x_btd`` (gated with
        ``moe.shared_expert_gate``; each branch normalised with ``moe.branch_norms``), [B, T, D]."""
        x = x_btd.astype(self.dtype)
        h = project(self, "shared_w_in", x, self.dtype, ("embed", "mlp"), fp8=self.fp8)
        act = gated_unit(h, self.moe.expert_activation, self.moe.swiglu_limit)
        shared = project(self, "shared_w_out", act, self.dtype, ("mlp", "embed"), fp8=self.fp8)
        if self.moe.shared_expert_gate:
            shared = jax.nn.sigmoid(dense(x, self.shared_gate[...], self.dtype, ("embed", None))) * shared
        if self.moe.branch_norms:
            y_btd = rms(y_btd, self.norm_eps, self.routed_out_norm[...]).astype(y_btd.dtype)
            shared = rms(shared, self.norm_eps, self.shared_out_norm[...])
        return y_btd + shared.astype(y_btd.dtype)
