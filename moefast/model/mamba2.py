"""Mamba-2: the state-space token mixer of NVIDIA's Nemotron-H / Nemotron 3 (``model.linear_attention_kind:
mamba2``).

Dimension letters: B batch, T tokens, D d_model, H heads (``linear_num_value_heads``, HF
``mamba_num_heads``), P head dim (``linear_value_head_dim``, ``mamba_head_dim``), G groups
(``linear_num_key_heads``, ``n_groups``), N state size (``linear_key_head_dim``, ``ssm_state_size``),
W conv width (``linear_conv_kernel_dim``, ``conv_kernel``), C = H·P + 2·G·N conv channels.

Per token (Dao and Gu 2024, "Transformers are SSMs", arXiv:2405.21060, sec. 7 (the Mamba-2
block); transformers' ``NemotronHMamba2Mixer``):

1. ``z | xBC | dt = x W_in`` (H·P, C and H channels);
2. a depthwise causal convolution of width W with a bias over xBC, inside each document, then
   SiLU; xBC splits into x [H, P], B [G, N] and C [G, N] (head h reads group h // (H / G));
3. ``dt = max(softplus(dt + dt_bias), time_step_min)``, ``A = -exp(A_log)`` [H];
4. the SSD recurrence ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t`` per head
   (:func:`moefast.kernels.mamba2.ssd`; the state resets at every document start), plus the skip
   ``D x_t``;
5. a gated RMSNorm over G groups of H·P / G channels, the gate applied before the norm:
   ``RMSNorm_group(y · SiLU(z)) · w`` (float32), then ``W_out``.

With a generation cache the layer carries the last W - 1 convolution inputs ``conv`` [B, W-1, C]
and the state ``state`` [B, H, N, P] float32 (the layout of
:func:`moefast.model.gated_deltanet.init_state`, whose shapes it shares under the mapping above).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moefast.kernels.mamba2 import resolve, ssd
from moefast.model.gated_deltanet import short_conv
from moefast.model.lora import project
from moefast.parallel.mesh import on_own_rows

__all__ = ["Mamba2"]


class Mamba2(nnx.Module):
    """Mamba-2 token mixer (module docstring).

    Parameters (transformers' names, each ``nn.Linear`` weight transposed): ``in_proj`` [D, H·P + C
    + H] (embed, heads), the fused ``z | xBC | dt``; ``conv`` [W, C] (conv, heads) and ``conv_bias``
    [C] (heads); ``dt_bias``, ``A_log`` and ``D`` [H] (heads); ``norm`` [H·P] (norm), the gated
    norm's scale; ``out`` [H·P, D] (heads, embed).

    Raises:
      ValueError: H not a multiple of G.
    """

    def __init__(self, d_model: int, *, num_heads: int, head_dim: int, num_groups: int, state_size: int,
                 conv_width: int, time_step_min: float, dtype, init_std: float, out_std: float, norm_eps: float,
                 impl: str = "auto", fp8: bool = False, rngs: nnx.Rngs):
        if num_heads % num_groups:
            raise ValueError(f"Mamba2: {num_heads} heads do not divide into {num_groups} groups")
        self.h, self.p, self.g, self.n = num_heads, head_dim, num_groups, state_size
        self.conv_width, self.dtype, self.norm_eps, self.impl = conv_width, dtype, norm_eps, impl
        self.fp8 = fp8  # model.precision == "fp8": in_proj and out by the FP8 recipe
        self.time_step_min = time_step_min
        self.channels = num_heads * head_dim + 2 * num_groups * state_size
        init = jax.nn.initializers.normal(init_std)
        self.in_proj = nnx.Param(init(rngs.params(), (d_model, num_heads * head_dim + self.channels + num_heads)),
                                 logical_axes=("embed", "heads"))
        bound = conv_width ** -0.5  # PyTorch's Conv1d default (fan-in W for a depthwise kernel)
        self.conv = nnx.Param(jax.random.uniform(rngs.params(), (conv_width, self.channels), jnp.float32, -bound, bound),
                              logical_axes=("conv", "heads"))
        self.conv_bias = nnx.Param(jax.random.uniform(rngs.params(), (self.channels,), jnp.float32, -bound, bound),
                                   logical_axes=("heads",))
        # transformers' initialisation: A_log = log(1 .. H), D = 1, dt_bias = 1
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, num_heads + 1, dtype=jnp.float32)), logical_axes=("heads",))
        self.D = nnx.Param(jnp.ones((num_heads,), jnp.float32), logical_axes=("heads",))
        self.dt_bias = nnx.Param(jnp.ones((num_heads,), jnp.float32), logical_axes=("heads",))
        self.norm = nnx.Param(jnp.ones((num_heads * head_dim,), jnp.float32), logical_axes=("norm",))
        self.out = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (num_heads * head_dim, d_model)),
                             logical_axes=("heads", "embed"))

    def __call__(self, x_btd, segment_ids_bt, cache: dict | None):
        """``x_btd`` [B, T, D]; ``segment_ids_bt`` [B, T] int document ids (no cache) or ``None``;
        ``cache``: ``{"conv": [B, W-1, C], "state": float32 [B, H, N, P]}`` or ``None``. Returns
        ``([B, T, D] in the compute dtype, the updated cache or None)``."""
        b, t, _ = x_btd.shape
        h, p, g, n, c = self.h, self.p, self.g, self.n, self.channels
        proj = project(self, "in_proj", x_btd, self.dtype, ("embed", "heads"), fp8=self.fp8)
        z, xbc, dt = proj[..., : h * p], proj[..., h * p: h * p + c], proj[..., h * p + c:]
        xbc, conv_state = short_conv(xbc, self.conv[...], cache, segment_ids_bt, bias_c=self.conv_bias[...])
        x = xbc[..., : h * p].reshape(b, t, h, p)
        bg = xbc[..., h * p: h * p + g * n].reshape(b, t, g, n)
        cg = xbc[..., h * p + g * n:].reshape(b, t, g, n)
        dt = jnp.maximum(jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...][None, None]), self.time_step_min)
        a = -jnp.exp(self.A_log[...])
        impl = resolve(self.impl)
        if cache is not None:
            y, state = ssd(x, dt, a, bg, cg, initial_state=jnp.swapaxes(cache["state"], -1, -2), impl=impl)
        elif impl == "pallas" and segment_ids_bt is not None:  # training: the kernel on each device's rows
            y, state = on_own_rows(lambda x, dt, bg, cg, seg: ssd(x, dt, a, bg, cg, segment_ids=seg, impl=impl),
                                   x, dt, bg, cg, segment_ids_bt, where="Mamba-2")
        else:
            y, state = ssd(x, dt, a, bg, cg, segment_ids=segment_ids_bt, impl=impl)
        y = y.astype(jnp.float32) + x.astype(jnp.float32) * self.D[...][None, None, :, None]  # [B, T, H, P]
        y = y.reshape(b, t, h * p) * jax.nn.silu(z.astype(jnp.float32))  # the gate before the norm
        grouped = y.reshape(b, t, g, h * p // g)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(jnp.square(grouped), axis=-1, keepdims=True) + self.norm_eps)
        y = (grouped.reshape(b, t, h * p) * self.norm[...][None, None]).astype(self.dtype)
        out = project(self, "out", y, self.dtype, ("heads", "embed"), fp8=self.fp8)
        return out, (None if cache is None else {"conv": conv_state, "state": jnp.swapaxes(state, -1, -2)})
