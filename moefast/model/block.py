"""The decoder block (:class:`Block`: attention, then a dense or MoE feed-forward, pre-norm) and
its dense SwiGLU MLP, and the sequence slices' tables (``model.sequence_slices``); the model that
stacks them is :mod:`moefast.model.transformer`.

Dimension letters: B batch, T tokens, S key length (cache), D d_model, F d_ff.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from moefast.config import ExperimentConfig
from moefast.model.attention import Attention
from moefast.model.gated_deltanet import GatedDeltaNet
from moefast.model.kda import KimiDeltaAttention
from moefast.model.mamba2 import Mamba2
from moefast.model.kv_cache import _DTYPES
from moefast.model.mla import MLAttention
from moefast.model.moe import MoELayer
from moefast.model.norm import rms_norm
from moefast.model.positional import Yarn
from moefast.model import lora
from moefast.model.lora import project

__all__ = ["DEFAULT_ROPE", "FULL_ROPE", "SLICE_SITE", "Block", "DenseMLP"]


def _dropout(x, rate: float, key, site: int):
    """Inverted dropout with the mask drawn from ``fold_in(key, site)``; identity without a key."""
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(jax.random.fold_in(key, site), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class DenseMLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020), gate and up projections fused into one [D, 2F] matrix; or,
    with ``activation="relu2"`` (``model.dense_activation``; Nemotron-H), ``relu(x W_in)² W_out`` with
    one up projection [D, F]."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, init_std: float, out_std: float, fp8: bool = False,
                 activation: str = "silu", rngs: nnx.Rngs):
        self.dtype, self.fp8, self.activation = dtype, fp8, activation  # fp8: model.precision == "fp8"
        up = 1 if activation == "relu2" else 2
        self.w_in = nnx.Param(jax.nn.initializers.normal(init_std)(rngs.params(), (d_model, up * d_ff)),
                              logical_axes=("embed", "mlp"))
        self.w_out = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (d_ff, d_model)),
                               logical_axes=("mlp", "embed"))

    def __call__(self, x_btd):
        h = project(self, "w_in", x_btd, self.dtype, ("embed", "mlp"), fp8=self.fp8)
        if self.activation == "relu2":
            return project(self, "w_out", jnp.square(jax.nn.relu(h)), self.dtype, ("mlp", "embed"), fp8=self.fp8)
        gate, up = jnp.split(h, 2, axis=-1)
        return project(self, "w_out", jax.nn.silu(gate) * up, self.dtype, ("mlp", "embed"), fp8=self.fp8)


DEFAULT_ROPE, FULL_ROPE = "default", "full_attention"
"""Names of the rotary tables the model passes its blocks as a mapping when its full-attention
layers have RoPE of their own (``model.global_rope_base`` / ``global_rotary_fraction``): the
model's, and the full layers'."""

LORA_SITE = 1 << 29
"""Layer i's adapters are drawn from ``fold_in(params key, LORA_SITE + i)`` (``lora``)."""

SLICE_SITE = 1 << 30
"""Sequence slice i's random draws use ``fold_in(step_key, SLICE_SITE + i)`` as their step key
(``model.sequence_slices`` > 1); far above any ``3 * layer + site``."""


class Block(nnx.Module):
    def __init__(self, cfg: ExperimentConfig, layer: int, *, rngs: nnx.Rngs, is_moe: bool | None = None):
        m = cfg.model
        dtype = _DTYPES[m.dtype]
        fp8 = m.precision == "fp8"
        out_std = m.init_std / math.sqrt(2 * m.num_layers)
        self.dropout = m.dropout
        zc = m.zero_centered_norm
        # Nemotron-H's patterns (model.sublayers): a block is one sublayer, a mixer or a feed-forward
        self.has_mixer = not m.is_ffn_sublayer(layer)
        self.has_ffn = not m.sublayers or not self.has_mixer
        self.linear = m.layer_type(layer) == "linear_attention"
        if self.has_mixer:
            self.attn_norm = rms_norm(m.d_model, m.norm_eps, dtype, rngs, zero_centered=zc)
            if self.linear and m.linear_attention_kind == "mamba2":
                self.attn = Mamba2(m.d_model, num_heads=m.linear_num_value_heads, head_dim=m.linear_value_head_dim,
                                   num_groups=m.linear_num_key_heads, state_size=m.linear_key_head_dim,
                                   conv_width=m.linear_conv_kernel_dim, time_step_min=m.time_step_min, dtype=dtype,
                                   init_std=m.init_std, out_std=out_std, norm_eps=m.norm_eps,
                                   impl=m.linear_attention_impl, fp8=fp8, rngs=rngs)
            elif self.linear and m.linear_attention_kind == "kda":
                self.attn = KimiDeltaAttention(m.d_model, num_heads=m.linear_num_value_heads,
                                               head_dim=m.linear_value_head_dim, conv_width=m.linear_conv_kernel_dim,
                                               dtype=dtype, init_std=m.init_std, out_std=out_std, norm_eps=m.norm_eps,
                                               impl=m.linear_attention_impl, fp8=fp8, rngs=rngs)
            elif self.linear:
                self.attn = GatedDeltaNet(m.d_model, num_key_heads=m.linear_num_key_heads,
                                          num_value_heads=m.linear_num_value_heads, key_head_dim=m.linear_key_head_dim,
                                          value_head_dim=m.linear_value_head_dim, conv_width=m.linear_conv_kernel_dim,
                                          dtype=dtype, init_std=m.init_std, out_std=out_std, norm_eps=m.norm_eps,
                                          impl=m.linear_attention_impl, fp8=fp8, rngs=rngs)
            elif m.attention == "mla":
                yarn = Yarn.from_config(m)
                self.attn = MLAttention(m.d_model, m.num_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                                        qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                                        v_head_dim=m.v_head_dim, softmax_multiplier=yarn.softmax_multiplier if yarn else 1.0,
                                        dtype=dtype, init_std=m.init_std, out_std=out_std, fp8=fp8,
                                        index_topk=m.index_topk, index_n_heads=m.index_n_heads,
                                        index_head_dim=m.index_head_dim, indexer_stage=cfg.train.indexer_stage,
                                        rngs=rngs)
            else:
                kv_heads, head_dim = m.attention_shape(layer)
                full = m.layer_type(layer) == "full_attention"
                self.attn = Attention(m.d_model, m.num_heads, kv_heads, head_dim, dtype=dtype,
                                      init_std=m.init_std, out_std=out_std, bias=m.attention_bias, qk_norm=m.qk_norm,
                                      norm_eps=m.norm_eps, output_gate=m.attention_output_gate, zero_centered=zc,
                                      window=None if full else m.sliding_window, sinks=m.attention_sinks,
                                      k_eq_v=m.attention_k_eq_v and full, value_norm=m.value_norm,
                                      scale=m.attention_scale, fp8=fp8, rngs=rngs)
        # the rotary table this block reads (Transformer._rope_tables): the full layers' own, or the model's
        self.rope_table = FULL_ROPE if m.full_layer_rope and m.layer_type(layer) == "full_attention" else DEFAULT_ROPE
        self.sandwich = m.sandwich_norm
        if m.sandwich_norm:
            self.post_attn_norm = rms_norm(m.d_model, m.norm_eps, dtype, rngs, zero_centered=zc)
            self.post_ffn_norm = rms_norm(m.d_model, m.norm_eps, dtype, rngs, zero_centered=zc)
        self.has_layer_scalar = m.layer_scalar
        if m.layer_scalar:
            self.layer_scalar = nnx.Param(jnp.ones((1,), jnp.float32), logical_axes=(None,))
        self.is_moe = False
        if self.has_ffn:
            self.ffn_norm = rms_norm(m.d_model, m.norm_eps, dtype, rngs, zero_centered=zc)
            self.is_moe = m.is_moe_layer(layer) if is_moe is None else is_moe
            if self.is_moe:
                self.ffn = MoELayer(m.d_model, m.d_ff, cfg.moe, dtype=dtype, init_std=m.init_std, out_std=out_std,
                                    norm_eps=m.norm_eps, fp8=fp8, rngs=rngs)
            else:
                self.ffn = DenseMLP(m.d_model, m.dense_ff, dtype=dtype, init_std=m.init_std, out_std=out_std, fp8=fp8,
                                    activation=m.dense_activation, rngs=rngs)
        # adapters (lora.rank > 0) from a key of their own: the base's initial values do not depend on them
        lora_key = jax.random.fold_in(rngs.params.key[...], LORA_SITE + layer)
        if self.has_mixer:
            lora.attach(self.attn, cfg.lora, jax.random.fold_in(lora_key, 0))
        if self.has_ffn:
            lora.attach(self.ffn, cfg.lora, jax.random.fold_in(lora_key, 1))

    def __call__(self, x, layer, rope, attn_mask, token_mask, cache=None, cache_index=0, step_key=None,
                 routing_state=None, routing_warmup=None, *, drop_tokens=True, record_max=False):
        """One block; ``layer`` is its index (an int, or a traced int32 under ``scan_layers``),
        ``attn_mask`` the attention mask (or the fused kernel's segment ids), or the pair (that,
        the [B, T] segment ids that reset a Gated DeltaNet layer's states; ``None``: one document),
        the other arguments are :meth:`Transformer.__call__`'s, per layer. Returns ``(x, routing
        sums or None, new cache or None)``; the sums are per token shard
        (:class:`~moefast.parallel.expert.RoutingSums`), reduced by the model after its layers.

        Sequence slices (``model.sequence_slices`` = n > 1, no cache): ``x``, ``rope``, the mask
        (the first of the pair) and ``token_mask`` are n-tuples, one entry per slice in order;
        slice i attends to the keys of slices 0..i (each slice's keys and values computed once, in
        its own attention) and routes its own tokens; its random draws use ``step_key`` folded with
        ``SLICE_SITE + i``. Returns the n-tuple of slices and the sums over them.

        ``record_max``: a fourth result, what the attention records, ``{"max_logits": ...}``: its
        largest pre-softmax logit per head of this block (over the batch, the queries and the
        slices), float32 [H], not differentiated (QK-clip: Kimi K2, arXiv 2507.20534, sec. 2.1),
        and, while a DSA indexer trains (``train.indexer_stage``), ``"indexer_loss"``: its KL
        summed over the real queries, float32 [] (:meth:`MLAttention.__call__`); ``None`` for a
        Gated DeltaNet block (no softmax) or with a cache."""
        if not isinstance(x, tuple):
            out = self._forward(x, layer, rope, attn_mask, token_mask, cache, cache_index, step_key, routing_state,
                                routing_warmup, drop_tokens, None, record_max)
            return out if record_max else out[:3]
        masks, segment_ids = attn_mask
        out, sums, prefix, max_h = [], None, (), None
        for i, x_i in enumerate(x):
            key_i = None if step_key is None else jax.random.fold_in(step_key, SLICE_SITE + i)
            x_i, s_i, prefix, m_i = self._forward(x_i, layer, rope[i] if rope is not None else None,
                                                  (masks[i], segment_ids), token_mask[i], None, cache_index, key_i,
                                                  routing_state, routing_warmup, drop_tokens, prefix, record_max)
            out.append(x_i)
            sums = s_i if sums is None else jax.tree.map(jnp.add, sums, s_i)  # every field is a sum
            max_h = m_i if max_h is None else jax.tree.map(jnp.maximum, max_h, m_i)
        return (tuple(out), sums, None, max_h) if record_max else (tuple(out), sums, None)

    def _forward(self, x, layer, rope, attn_mask, token_mask, cache, cache_index, step_key, routing_state,
                 routing_warmup, drop_tokens, kv_prefix, record_max=False):
        """One block on one [B, T, D] slice (:meth:`__call__`): ``(x, stats, cache, records or
        None)``; with a ``kv_prefix`` (a sequence slice) the third result is the keys and
        values for the next slice."""
        mask, segment_ids = attn_mask if isinstance(attn_mask, tuple) else (attn_mask, None)
        rec, stats, new_cache = None, None, cache  # a feed-forward sublayer keeps its (empty) cache entry
        if self.has_mixer:
            x, new_cache, rec = self._mixer(x, layer, rope, mask, segment_ids, token_mask, cache, cache_index,
                                            step_key, kv_prefix, record_max)
        if self.has_ffn:
            x, stats = self._ffn(x, layer, token_mask, step_key, routing_state, routing_warmup, drop_tokens)
        if self.has_layer_scalar:
            # in float32: the scalar's gradient sums every token's product in float32, then reduces
            x = (x.astype(jnp.float32) * self.layer_scalar[...].reshape(1, 1, 1)).astype(x.dtype)
        return x, stats, new_cache, rec

    def _mixer(self, x, layer, rope, mask, segment_ids, token_mask, cache, cache_index, step_key, kv_prefix,
               record_max):
        """The token mixer's pre-norm residual sublayer: ``(x, new cache, records or None)``."""
        xn = self.attn_norm(x).astype(x.dtype)
        rec = None
        if self.linear:  # no softmax: nothing to record
            a, new_cache = self.attn(xn, segment_ids, cache)
        else:
            if isinstance(rope, dict):
                rope = rope[self.rope_table]
            learns = getattr(self.attn, "indexer_stage", "none") != "none"  # DSA's indexer: its loss's queries
            a, new_cache, *found = self.attn(xn, rope, mask, cache, cache_index, kv_prefix, record_max=record_max,
                                             **({"token_mask": token_mask} if learns else {}))
            if found and found[0] is not None:
                rec = {"max_logits": found[0], **({"indexer_loss": found[1]} if len(found) > 1 else {})}
        if self.sandwich:
            a = self.post_attn_norm(a).astype(x.dtype)
        return x + _dropout(a, self.dropout, step_key, 3 * layer), new_cache, rec

    def _ffn(self, x, layer, token_mask, step_key, routing_state, routing_warmup, drop_tokens):
        """The feed-forward's pre-norm residual sublayer: ``(x, routing sums or None)``."""
        h = self.ffn_norm(x).astype(x.dtype)
        stats = None
        if self.is_moe:
            rs = routing_state or {}
            warm = step_key is not None and routing_warmup is not None
            f, stats = self.ffn(h, token_mask, drop_tokens=drop_tokens, bias_e=rs.get("bias"),
                                load_ema_e=rs.get("load_ema"), reduce_stats=False,
                                warmup_key=jax.random.fold_in(step_key, 3 * layer + 2) if warm else None,
                                warmup_active=routing_warmup if warm else None,
                                residual_btd=x if self.ffn.moe.branch_norms else None)
        else:
            f = self.ffn(h)
        if self.sandwich:
            f = self.post_ffn_norm(f).astype(x.dtype)
        return x + _dropout(f, self.dropout, step_key, 3 * layer + 1), stats


def _slices(a_bt: jax.Array, n: int) -> tuple[jax.Array, ...]:
    """[B, T, ...] -> n arrays [B, T / n, ...], in sequence order."""
    return tuple(jnp.split(a_bt, n, axis=1))


def _sliced_tables(attn_mask, rope, n: int):
    """The layers' tables for n sequence slices (:meth:`Block.__call__`): slice i's mask over the
    keys of slices 0..i — the [B, 1, T/n, (i+1) T/n] rows of a bool mask, or the segment ids of its
    queries ([B, T/n]; for i > 0 paired with the [B, (i+1) T/n] ids of its keys: the fused
    kernel's query offset) — and its rows of the rotary tables."""
    mask, segment_ids = attn_mask
    t = mask.shape[-1] if mask.ndim == 2 else mask.shape[-2]
    ts = t // n
    if mask.ndim == 2:
        masks = tuple(mask[:, :ts] if i == 0 else (mask[:, i * ts:(i + 1) * ts], mask[:, :(i + 1) * ts])
                      for i in range(n))
    else:
        masks = tuple(mask[..., i * ts:(i + 1) * ts, :(i + 1) * ts] for i in range(n))
    def rows(table, i):  # (cos, sin), or a mapping of named tables (Transformer._rope_tables)
        if isinstance(table, dict):
            return {k: rows(v, i) for k, v in table.items()}
        return tuple(r[:, i * ts:(i + 1) * ts] for r in table)

    ropes = None if rope is None else tuple(rows(rope, i) for i in range(n))
    return (masks, segment_ids), ropes
