"""The generation cache: per-layer key/value (or MLA latent, or Gated DeltaNet state) buffers,
their shapes and bytes per token (:func:`init_cache`, :func:`cache_bytes_per_token`).

Dimension letters as :mod:`moefast.model.transformer`: B batch, S cache length, G key/value heads,
Hd head_dim.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from moefast.model.gated_deltanet import init_state

__all__ = ["KVCache", "cache_bytes_per_token", "init_cache"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

KVCache = list  # per layer: {"k": [B, S, G, Hd], "v": [B, S, G, Hd]} (GQA), {"kv": [B, S, C], "k_rope": [B, S, R]} (MLA)
# or, for a Gated DeltaNet layer, {"conv": [B, W-1, C], "state": [B, Hv, K, V]} (init_cache)


def _cache_widths(m, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Each cache entry's shape after [B, S] in block ``layer``: GQA's per-head keys and values (of
    the layer's own shape, :meth:`~moefast.config.ModelConfig.attention_shape`), or MLA's
    compressed KV and shared RoPE key."""
    if m.attention == "mla":
        sparse = {} if m.index_topk is None else {"index_k": (m.index_head_dim,)}  # DSA: the indexer's keys
        return {"kv": (m.kv_lora_rank,), "k_rope": (m.qk_rope_head_dim,), **sparse}
    g, hd = m.attention_shape(layer)
    return {"k": (g, hd), "v": (g, hd)}


def cache_bytes_per_token(model_cfg, dtype: Any = None, layer: int = 0) -> int:
    """Bytes the generation cache holds per token in block ``layer`` (default: the first; the
    layers of a model whose full-attention layers have their own shape, ``model.global_head_dim``,
    differ: sum over layers for the whole cache).

    GQA caches every key/value head: ``2 * G * Hd * bytes``. MLA caches the normalised compressed KV
    and the shared RoPE key only (DeepSeek-V2, sec. 2.1.2 and Table 1, ``(d_c + d_h^R)`` elements):
    ``(kv_lora_rank + qk_rope_head_dim) * bytes``. DeepSeek-V3 in bfloat16: (512 + 64) * 2 = 1,152
    bytes, against 2 * 128 * 192 * 2 = 98,304 for its 128 heads cached per head.

    Args:
      model_cfg: a :class:`~moefast.config.ModelConfig`.
      dtype: the cache's dtype; ``None``: ``model.dtype``.
    """
    itemsize = jnp.dtype(dtype or _DTYPES[model_cfg.dtype]).itemsize
    return sum(math.prod(w) for w in _cache_widths(model_cfg, layer).values()) * itemsize


def init_cache(model, batch: int, length: int, dtype: Any = None) -> KVCache:
    """Zeroed generation cache, one dict per layer: ``{"k", "v"}`` of shape [B, S, G, Hd]
    (``model.attention=gqa``), or ``{"kv": [B, S, kv_lora_rank], "k_rope": [B, S, qk_rope_head_dim]}``
    (``mla``: :class:`MLAttention`; with ``model.index_topk`` also the DSA indexer's keys
    ``"index_k": [B, S, index_head_dim]``); a Gated DeltaNet layer (``model.layer_types``) holds its
    states instead, of a size independent of S: ``{"conv": [B, W-1, C], "state": [B, Hv, K, V]}``
    (float32 state; :func:`~moefast.model.gated_deltanet.init_state`). Bytes per
    token of an attention layer: :func:`cache_bytes_per_token`."""
    dtype = dtype or model.dtype
    m = model.model_cfg
    return [init_state(m, batch, dtype) if m.layer_type(i) == "linear_attention" else
            {} if m.is_ffn_sublayer(i) else  # a feed-forward sublayer caches nothing
            {k: jnp.zeros((batch, length, *w), dtype) for k, w in model.cache_widths[i]}
            for i in range(m.num_layers)]
