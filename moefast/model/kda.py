"""Kimi Delta Attention (KDA): the linear-attention token mixer of Kimi Linear.

Dimension letters: B batch, T tokens, D d_model, H heads, K head dim (keys, queries and values
alike), W conv kernel width, C = 3·H·K conv channels.

Per token (Kimi Team 2025, "Kimi Linear", arXiv 2510.26692, sec. 3; transformers'
``KimiLinearDeltaAttention``):

1. ``q | k | v = x W_qkv`` (three H·K projections), a depthwise causal convolution of width W over
   the tokens of one document, then SiLU;
2. q and k L2-normalised per head (eps 1e-6, float32);
3. ``beta = sigmoid(x W_b)`` per head, and a decay per key channel from a rank-K projection:
   ``g = -exp(A_log_h) · softplus(x W_fa W_fb + dt_bias)`` [B, T, H, K];
4. the gated delta rule with that per-channel decay
   (:func:`moefast.kernels.gated_delta_rule.gated_delta_rule`, ``g`` [B, T, H, K]), the state reset
   at every document start, read by ``q · K**-0.5``;
5. a gated RMSNorm per head in float32, ``RMSNorm(o) · w · sigmoid(x W_ga W_gb)`` (a sigmoid gate,
   where Gated DeltaNet's is SiLU), then ``W_out``.

With a generation cache the layer carries the last W - 1 convolution inputs ``conv`` [B, W-1, C]
and the recurrent state ``state`` [B, H, K, K] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moefast.model.gated_deltanet import _l2_normalize, delta_rule, short_conv
from moefast.model.lora import project

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(nnx.Module):
    """KDA token mixer (module docstring).

    Parameters (transformers' names in brackets, each HF ``nn.Linear`` weight transposed):
    ``qkv`` [D, 3·H·K] (embed, heads) [``q_proj | k_proj | v_proj``]; ``conv`` [W, C] (conv, heads)
    [``conv1d``]; ``f_a`` [D, K] (embed, None) and ``f_b`` [K, H·K] (None, heads) [``forget_gate.f_a_proj``,
    ``f_b_proj``]; ``dt_bias`` [H·K] (heads) and ``A_log`` [H] (heads) [``forget_gate``'s];
    ``b`` [D, H] (embed, heads) [``b_proj``]; ``g_a`` [D, K] and ``g_b`` [K, H·K] [``g_a_proj``,
    ``g_b_proj``]; ``norm`` [K] (norm) [``o_norm.weight``]; ``out`` [H·K, D] (heads, embed) [``o_proj``].
    """

    def __init__(self, d_model: int, *, num_heads: int, head_dim: int, conv_width: int, dtype, init_std: float,
                 out_std: float, norm_eps: float, impl: str = "auto", fp8: bool = False, rngs: nnx.Rngs):
        self.h, self.k_dim, self.conv_width = num_heads, head_dim, conv_width
        self.dtype, self.norm_eps, self.impl = dtype, norm_eps, impl
        # model.precision == "fp8": qkv and out by the FP8 recipe; the low-rank gate paths and beta
        # (outputs of head_dim or num_heads, padded to 128 they would mostly multiply zeros) stay bf16
        self.fp8 = fp8
        hk = num_heads * head_dim
        self.channels = 3 * hk
        init = jax.nn.initializers.normal(init_std)
        param = lambda shape, axes: nnx.Param(init(rngs.params(), shape), logical_axes=axes)
        self.qkv = param((d_model, 3 * hk), ("embed", "heads"))
        bound = conv_width ** -0.5  # PyTorch's Conv1d default (fan-in W for a depthwise kernel)
        taps = jax.random.uniform(rngs.params(), (conv_width, self.channels), jnp.float32, -bound, bound)
        self.conv = nnx.Param(taps, logical_axes=("conv", "heads"))
        self.f_a, self.f_b = param((d_model, head_dim), ("embed", None)), param((head_dim, hk), (None, "heads"))
        self.dt_bias = nnx.Param(jnp.ones((hk,), jnp.float32), logical_axes=("heads",))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (num_heads,), jnp.float32, 1.0, 16.0)),
                               logical_axes=("heads",))
        self.b = param((d_model, num_heads), ("embed", "heads"))
        self.g_a, self.g_b = param((d_model, head_dim), ("embed", None)), param((head_dim, hk), (None, "heads"))
        self.norm = nnx.Param(jnp.ones((head_dim,), jnp.float32), logical_axes=("norm",))
        self.out = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (hk, d_model)),
                             logical_axes=("heads", "embed"))

    def _low_rank(self, x_btd, a: str, b: str):
        """``x W_a W_b`` [B, T, H·K] in float32 (the forget and output gates' rank-K projections)."""
        mid = project(self, a, x_btd, self.dtype, ("embed", None))
        return project(self, b, mid, self.dtype, (None, "heads")).astype(jnp.float32)

    def __call__(self, x_btd, segment_ids_bt, cache: dict | None):
        """``x_btd`` [B, T, D]; ``segment_ids_bt`` [B, T] int document ids (no cache) or ``None``;
        ``cache``: ``{"conv": [B, W-1, C], "state": [B, H, K, K] float32}`` or ``None``. Returns
        ``([B, T, D] in the compute dtype, the updated cache or None)``."""
        b, t, _ = x_btd.shape
        h, kd, hk = self.h, self.k_dim, self.h * self.k_dim
        qkv = project(self, "qkv", x_btd, self.dtype, ("embed", "heads"), fp8=self.fp8)
        qkv, conv_state = short_conv(qkv, self.conv[...], cache, segment_ids_bt)
        q = _l2_normalize(qkv[..., :hk].reshape(b, t, h, kd))
        k = _l2_normalize(qkv[..., hk: 2 * hk].reshape(b, t, h, kd))
        v = qkv[..., 2 * hk:].reshape(b, t, h, kd)
        beta = jax.nn.sigmoid(project(self, "b", x_btd, self.dtype, ("embed", "heads")).astype(jnp.float32))
        decay_in = self._low_rank(x_btd, "f_a", "f_b") + self.dt_bias[...][None, None]
        rate = jnp.exp(self.A_log[...]).reshape(1, 1, h, 1)
        g = -rate * jax.nn.softplus(decay_in.reshape(b, t, h, kd))  # [B, T, H, K]: a decay per key channel
        o, state = delta_rule(self.impl, q, k, v, g, beta, segment_ids_bt, cache, where="KDA")
        gate = self._low_rank(x_btd, "g_a", "g_b").reshape(b, t, h, kd)
        o32 = o.astype(jnp.float32)  # transformers' KimiLinearRMSNormGated: float32 throughout
        normed = o32 * jax.lax.rsqrt(jnp.mean(jnp.square(o32), axis=-1, keepdims=True) + self.norm_eps)
        o = (normed * self.norm[...][None, None, None] * jax.nn.sigmoid(gate)).astype(self.dtype)
        out = project(self, "out", o.reshape(b, t, hk), self.dtype, ("heads", "embed"), fp8=self.fp8)
        return out, (None if cache is None else {"conv": conv_state, "state": state})
