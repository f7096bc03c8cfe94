"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 / Qwen3.6 MoE.

Dimension letters: B batch, T tokens, D d_model, Hk key heads, Hv value heads (a multiple of Hk),
K key head dim, V value head dim, W conv kernel width, C = 2·Hk·K + Hv·V conv channels.

Per token (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks", arXiv:2412.06464, eq. 10;
transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet``):

1. ``q | k | v = x W_qkv`` (C channels), then a depthwise causal convolution of width W over the
   tokens of the same document, then SiLU;
2. q and k L2-normalised per head (eps 1e-6, float32), each key head serving Hv / Hk value heads;
3. ``beta = sigmoid(x W_b)``, the log decay ``g = -exp(A_log) · softplus(x W_a + dt_bias)``;
4. the gated delta rule (:func:`moefast.kernels.gated_delta_rule.gated_delta_rule`) with the state
   reset at every document start, read by ``q · K**-0.5``;
5. a gated RMSNorm per value head, ``RMSNorm(o) · w · SiLU(x W_z)``, then ``W_out``.

With a generation cache the layer carries, per layer, the last W - 1 convolution inputs
``conv`` [B, W-1, C] and the recurrent state ``state`` [B, Hv, K, V] float32 instead of keys and
values: a prompt and each decoded token continue them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moefast.kernels.gated_delta_rule import gated_delta_rule, resolve
from moefast.model.norm import gated_rms_norm
from moefast.parallel.context import context_size
from moefast.parallel.linear_context import context_causal_conv, context_delta_rule
from moefast.parallel.mesh import on_own_rows
from moefast.model.lora import project

__all__ = ["GatedDeltaNet", "causal_conv", "delta_rule", "init_state", "short_conv"]

L2_EPS = 1e-6  # q/k L2 normalisation epsilon (fla and transformers: x * rsqrt(sum(x**2) + 1e-6))
# Tokens per chunk of the chunked and Pallas forms. The chunked (XLA) form inverts each chunk's
# C x C triangular system by matmuls, O(C^2) per token: on CPU at the tiny hybrid's heads (K = V =
# 32, T = 1024) chunks of 16 ran fwd + bwd 2.6x faster than the token-by-token recurrence, 64 no
# faster (docs/perf.md); the Pallas kernel keeps 64 (GPU tiles).
CHUNK = {"pallas": 64, "chunked": 16}


def init_state(model_cfg, batch: int, dtype) -> dict[str, jax.Array]:
    """A Gated DeltaNet layer's zeroed decoding state for a :class:`~moefast.config.ModelConfig`:
    ``conv`` [B, W-1, C] in ``dtype`` (the last convolution inputs) and ``state`` [B, Hv, K, V]
    float32 (the recurrent state)."""
    m = model_cfg
    channels = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
    return {"conv": jnp.zeros((batch, m.linear_conv_kernel_dim - 1, channels), dtype),
            "state": jnp.zeros((batch, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim),
                               jnp.float32)}


def causal_conv(x_btc: jax.Array, w_wc: jax.Array, prev_bwc: jax.Array | None,
                segment_ids_bt: jax.Array | None,
                prev_segment_ids_bw: jax.Array | None = None, bias_c: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution over tokens, then SiLU, never across a document start.

    ``out[t, c] = silu(sum_i w[i, c] * x[t - (W - 1) + i, c] + bias[c])`` (no bias: 0; Mamba-2 has
    one), the taps before the row's start
    taken from ``prev`` (the cache) or zero, and taps in another document (``segment_ids``) zero.

    Args:
      x_btc: [B, T, C] inputs, any float dtype; w_wc: [W, C] float32 taps (HF ``conv1d.weight``
        [C, 1, W], transposed).
      prev_bwc: [B, W-1, C] the inputs before this call's first token (generation cache), or
        ``None``: zeros.
      segment_ids_bt: [B, T] int document ids, or ``None``: one document.
      prev_segment_ids_bw: [B, W-1] the document ids of ``prev`` (context parallelism: the previous
        device's last tokens), or ``None``: no document (its taps are zeroed wherever
        ``segment_ids_bt`` is given).

    Returns:
      ``(out [B, T, C] in x's dtype, the last W-1 inputs [B, W-1, C] for the next call)``.
    """
    b, t, c = x_btc.shape
    w = w_wc.shape[0]
    if prev_bwc is None:
        prev_bwc = jnp.zeros((b, w - 1, c), x_btc.dtype)
    ext = jnp.concatenate([prev_bwc.astype(x_btc.dtype), x_btc], axis=1)  # [B, W-1+T, C]
    acc = jnp.zeros((b, t, c), jnp.float32)
    if segment_ids_bt is not None:  # the ids of ext's tokens (-1: none, before the row)
        if prev_segment_ids_bw is None:
            prev_segment_ids_bw = jnp.full((b, w - 1), -1, segment_ids_bt.dtype)
        ext_ids = jnp.concatenate([prev_segment_ids_bw.astype(segment_ids_bt.dtype), segment_ids_bt], axis=1)
    for i in range(w):  # static: W taps; tap i reads x[t - lag]
        lag = w - 1 - i
        xi = ext[:, i: i + t].astype(jnp.float32)
        if segment_ids_bt is not None and lag:
            xi = jnp.where((ext_ids[:, i: i + t] == segment_ids_bt)[..., None], xi, 0.0)
        acc = acc + xi * w_wc[i].astype(jnp.float32)[None, None]
    if bias_c is not None:
        acc = acc + bias_c.astype(jnp.float32)[None, None]
    return jax.nn.silu(acc).astype(x_btc.dtype), ext[:, t:]


def short_conv(x_btc: jax.Array, w_wc: jax.Array, cache: dict | None,
               segment_ids_bt: jax.Array | None, bias_c: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """A linear-attention layer's :func:`causal_conv`: continuing ``cache["conv"]`` (generation),
    or over training's rows, split along a ``context`` axis or not (with one: each device's pieces
    continuing their predecessors', :func:`~moefast.parallel.linear_context.context_causal_conv`);
    ``bias_c`` [C]: :func:`causal_conv`'s.
    Returns ``(out [B, T, C], the last W-1 inputs [B, W-1, C], or None on a context axis)``."""
    conv = causal_conv if bias_c is None else functools.partial(causal_conv, bias_c=bias_c)
    if cache is not None:
        return conv(x_btc, w_wc, cache["conv"], None)
    if context_size() > 1:
        b, t = x_btc.shape[:2]
        seg = jnp.ones((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt
        return context_causal_conv(conv, x_btc, w_wc, seg), None
    return conv(x_btc, w_wc, None, segment_ids_bt)


def delta_rule(impl: str, q, k, v, g, beta, segment_ids_bt: jax.Array | None, cache: dict | None, *,
               where: str) -> tuple[jax.Array, jax.Array | None]:
    """A linear-attention layer's gated delta rule (:func:`gated_delta_rule`'s arguments and shapes)
    with ``impl`` resolved for the platform compiled for (``"auto"``: the Pallas kernel on GPUs),
    the chunk size that suits it (:data:`CHUNK`), and training's rows placed: each device on its
    own rows for the kernel, the state passed along a ``context`` axis
    (:func:`~moefast.parallel.linear_context.context_delta_rule`). With a ``cache`` its ``state``
    continues (generation). Returns ``(o [B, T, H, V], the final state or None on a context axis)``."""
    impl = resolve(impl)
    run = functools.partial(gated_delta_rule, impl=impl, chunk_size=CHUNK.get(impl, 64))
    if cache is not None:
        return run(q, k, v, g, beta, initial_state=cache["state"])
    if context_size() > 1:
        seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt
        return context_delta_rule(run, q, k, v, g, beta, seg), None
    if impl == "pallas" and segment_ids_bt is not None:  # training: the kernel on each device's rows
        return on_own_rows(lambda *a: run(*a[:5], segment_ids=a[5]), q, k, v, g, beta, segment_ids_bt, where=where)
    return run(q, k, v, g, beta, segment_ids=segment_ids_bt)


def _l2_normalize(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + L2_EPS)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet token mixer (module docstring).

    Parameters: ``in_proj`` [D, C + Hv·V + 2·Hv] (embed, heads), the fused projections
    ``q | k | v`` (C channels: Hk·K, Hk·K, Hv·V, heads in order), ``z`` (the output gate, Hv·V),
    ``b`` (beta, Hv) and ``a`` (decay input, Hv); ``conv`` [W, C] (conv, heads); ``A_log`` and
    ``dt_bias`` [Hv] (heads); ``norm`` [V] (norm), the gated norm's scale (starting at 1); ``out``
    [Hv·V, D] (heads, embed).
    """

    def __init__(self, d_model: int, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_width: int, dtype, init_std: float, out_std: float, norm_eps: float,
                 impl: str = "auto", fp8: bool = False, rngs: nnx.Rngs):
        self.hk, self.hv, self.k_dim, self.v_dim = num_key_heads, num_value_heads, key_head_dim, value_head_dim
        self.conv_width, self.dtype, self.norm_eps, self.impl = conv_width, dtype, norm_eps, impl
        self.fp8 = fp8  # model.precision == "fp8": in_proj and out by the FP8 recipe
        self.channels = 2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim
        width = self.channels + num_value_heads * value_head_dim + 2 * num_value_heads
        init = jax.nn.initializers.normal(init_std)
        self.in_proj = nnx.Param(init(rngs.params(), (d_model, width)), logical_axes=("embed", "heads"))
        bound = conv_width ** -0.5  # PyTorch's Conv1d default (fan-in W for a depthwise kernel)
        self.conv = nnx.Param(jax.random.uniform(rngs.params(), (conv_width, self.channels), jnp.float32, -bound, bound),
                              logical_axes=("conv", "heads"))
        # transformers' initialisation: A uniform in [0.01, 16] (stored as its log), dt_bias 1
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (num_value_heads,), jnp.float32, 0.01, 16.0)),
                               logical_axes=("heads",))
        self.dt_bias = nnx.Param(jnp.ones((num_value_heads,), jnp.float32), logical_axes=("heads",))
        self.norm = nnx.Param(jnp.ones((value_head_dim,), jnp.float32), logical_axes=("norm",))
        self.out = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (num_value_heads * value_head_dim,
                                                                                  d_model)),
                             logical_axes=("heads", "embed"))

    def __call__(self, x_btd, segment_ids_bt, cache: dict | None):
        """``x_btd`` [B, T, D]; ``segment_ids_bt`` [B, T] int document ids (no cache) or ``None``;
        ``cache``: :func:`init_state`'s dict or ``None``. Returns ``([B, T, D] in the compute dtype,
        the updated cache or None)``."""
        b, t, _ = x_btd.shape
        hk, hv, kd, vd, c = self.hk, self.hv, self.k_dim, self.v_dim, self.channels
        proj = project(self, "in_proj", x_btd, self.dtype, ("embed", "heads"), fp8=self.fp8)
        qkv, z = proj[..., :c], proj[..., c: c + hv * vd]
        beta_in, a = proj[..., c + hv * vd: c + hv * vd + hv], proj[..., c + hv * vd + hv:]
        qkv, conv_state = short_conv(qkv, self.conv[...], cache, segment_ids_bt)
        q = _l2_normalize(qkv[..., : hk * kd].reshape(b, t, hk, kd))
        k = _l2_normalize(qkv[..., hk * kd: 2 * hk * kd].reshape(b, t, hk, kd))
        v = qkv[..., 2 * hk * kd:].reshape(b, t, hv, vd)
        if hv != hk:  # key head h serves value heads h * r .. h * r + r - 1
            q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
        beta = jax.nn.sigmoid(beta_in.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...])[None, None] * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...][None, None])
        o, state = delta_rule(self.impl, q, k, v, g, beta, segment_ids_bt, cache, where="Gated DeltaNet")
        o = gated_rms_norm(o, z.reshape(b, t, hv, vd), self.norm[...], self.norm_eps, self.dtype)
        out = project(self, "out", o.reshape(b, t, hv * vd), self.dtype, ("heads", "embed"), fp8=self.fp8)
        return out, (None if cache is None else {"conv": conv_state, "state": state})
