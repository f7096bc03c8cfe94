"""Grouped-query softmax attention: the XLA path over causal key blocks, the fused kernel path, and
the :class:`Attention` module.

Dimension letters: B batch, T tokens (query length), S key length (cache), D d_model, H query heads,
G key/value heads, Hd head_dim.

Attention is causal and never crosses packed documents (segment ids). It is computed by
:func:`causal_attention` (XLA einsums over the causal key blocks, a [B, 1, T, T] mask) or by the
fused kernel :func:`fused_attention` (segment ids, memory linear in T), chosen by
``model.attention_impl`` (:func:`attention_impl`; ``"auto"``: fused when compiling for GPUs).
Multi-head latent attention (DeepSeek) is :mod:`moefast.model.mla`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moefast.kernels.attention import flash_attention
from moefast.kernels.platform import target_platform
from moefast.model.norm import rms, rms_norm
from moefast.model.positional import apply_rope
from moefast.parallel.context import (CONTEXT_AXIS, context_size, gather_context, gather_rows, natural_order,
                                      row_index)
from moefast.parallel.mesh import on_own_rows, reshard_for_shard_map, token_shards
from moefast.model.lora import project

__all__ = ["ATTENTION_BLOCK", "Attention", "attend", "attention_impl", "causal_attention", "context_flash_attention",
           "fused_attention"]


ATTENTION_BLOCK = 128  # query rows per block of :func:`causal_attention` (chosen by measurement: docs/perf.md)


def _attend(q_btghd, k_bsgd, v_bsgd, mask_b11ts, sinks_gr=None, return_max: bool = False):
    """Softmax attention of one query block: [B, T, G, R, Hd] queries (already scaled), [B, S, G, Hd]
    keys and values, bool mask broadcastable to [B, G, R, T, S], optional [G, R] sink logits (a
    column of the softmax, dropped after it); logits and softmax in float32. Returns [B, T, G, R,
    Hv] in the queries' dtype, and with ``return_max`` also the float32 [G, R] largest logit per
    head (over batch, queries and unmasked keys; the sink excluded; ``finfo.min`` for a head that
    sees nothing), not differentiated."""
    s = jnp.einsum("btgrd,bsgd->bgrts", q_btghd, k_bsgd, preferred_element_type=jnp.float32)
    s = jnp.where(mask_b11ts, s, jnp.finfo(jnp.float32).min)  # finite: a fully masked row stays finite
    if sinks_gr is not None:
        sink = jnp.broadcast_to(sinks_gr.astype(jnp.float32)[None, :, :, None, None], (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1].astype(v_bsgd.dtype)
    else:
        p = jax.nn.softmax(s, axis=-1).astype(v_bsgd.dtype)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, v_bsgd, preferred_element_type=jnp.float32).astype(q_btghd.dtype)
    if not return_max:
        return o
    # the row maxima as jax.nn.softmax takes them (same reduction: XLA's CSE computes it once without sinks)
    row_max = jnp.max(jax.lax.stop_gradient(s), axis=-1, initial=-jnp.inf, keepdims=True)  # [B, G, R, T, 1]
    return o, jnp.max(row_max, axis=(0, 3, 4))


def causal_attention(q_bthd: jax.Array, k_bsgd: jax.Array, v_bsgd: jax.Array, mask_b1ts: jax.Array, *,
                     causal: bool, block: int = ATTENTION_BLOCK, scale: float | None = None,
                     sinks_h: jax.Array | None = None, return_max: bool = False
                     ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1) with grouped-query heads, computing
    only the key blocks a causal mask can reach.

    With ``causal=True`` (training and evaluation: T == S, ``mask_b1ts`` already causal) the queries
    are split into blocks of ``block`` rows and block i attends to keys ``[0, end_i)`` only, so the
    work above the diagonal blocks is never done: at T = 256 and 128-row blocks 3/4 of the full
    score matrix, at T = 1024 9/16. Its speed against the full-matrix einsums and
    ``jax.nn.dot_product_attention(implementation="xla")`` on CPU, and the block size, are measured in
    docs/perf.md ("moefast against Hugging Face transformers"). The result equals full masked
    attention (the skipped logits are all masked).

    Args:
      q_bthd: [B, T, H, Hd] queries; k_bsgd: [B, S, G, Hd] keys, v_bsgd: [B, S, G, Hv] values (H
        divisible by G; Hv = Hd but in MLA), same dtype as the queries.
      mask_b1ts: bool [B or 1, 1, T, S], True where a query may attend to a key. Keys and values
        that no query may see never reach the result, whatever they hold (NaN or inf included).
      causal: the mask is causal over T == S (query t never sees key s > t).
      block: query rows per block (static).
      scale: logit scale, a dimensionless multiplier; ``None``: ``Hd ** -0.5``.
      sinks_h: [H] sink logits joining each softmax's denominator, unscaled (gpt-oss), or ``None``.
      return_max: also return each head's largest pre-softmax logit (QK-clip, Kimi K2, arXiv
        2507.20534, sec. 2.1): the scaled logit ``q·k·scale`` entering the softmax, over the batch,
        the queries and the keys the mask lets them see (the sink excluded), taken from the
        softmax's own row maxima (no extra pass over the logits without sinks).

    Returns:
      [B, T, H, Hv] in the queries' dtype; logits and softmax are computed in float32. With
      ``return_max`` the pair (that, float32 [H] maxima: query head h = g·R + r of key/value head
      g, −inf for a head that sees no key), the maxima not differentiated.

    Raises:
      ValueError: ``causal`` with T != S, or H not divisible by G.
    """
    b, t, h, hd = q_bthd.shape
    s_len, g = k_bsgd.shape[1], k_bsgd.shape[2]
    if h % g:
        raise ValueError(f"num_heads={h} must be a multiple of num_kv_heads={g}")
    if causal and t != s_len:
        raise ValueError(f"causal block attention needs as many queries as keys (got {t} and {s_len})")
    q = (q_bthd * jnp.asarray(hd ** -0.5 if scale is None else scale, q_bthd.dtype)).reshape(b, t, g, h // g, hd)
    if not causal:  # a KV cache: slots no query may see hold anything (a reused buffer: NaN, inf). Their
        # logits are selected away below; their values are selected away here, since a zero weight
        # times NaN or inf is NaN.
        seen_bs = jnp.any(mask_b1ts[:, 0], axis=1)  # [B or 1, S]
        v_bsgd = jnp.where(seen_bs[:, :, None, None], v_bsgd, jnp.zeros((), v_bsgd.dtype))
    mask = mask_b1ts[:, :, None]  # [B, 1, 1, T, S]
    sinks = None if sinks_h is None else sinks_h.reshape(g, h // g)
    if not causal or t <= block:
        parts = [_attend(q, k_bsgd, v_bsgd, mask, sinks, return_max)]
    else:
        parts = [_attend(q[:, i: i + block], k_bsgd[:, : i + block], v_bsgd[:, : i + block],
                         mask[..., i: i + block, : i + block], sinks, return_max)
                 for i in range(0, t, block)]
    outs = [p[0] if return_max else p for p in parts]
    o = (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)).reshape(b, t, h, v_bsgd.shape[-1])
    if not return_max:
        return o
    max_h = functools.reduce(jnp.maximum, [p[1] for p in parts]).reshape(h)
    return o, jnp.where(max_h > jnp.finfo(jnp.float32).min, max_h, -jnp.inf)  # a masked logit is finfo.min


def attention_impl(impl: str, batch: int) -> str:
    """``"blocked"`` or ``"flash"``: what ``model.attention_impl=impl`` means for a batch of
    ``batch`` rows in the program being traced. ``"auto"`` is ``"flash"`` when compiling for GPUs
    (:func:`~moefast.kernels.platform.target_platform`) and the batch divides over the token
    shards, else ``"blocked"``.

    Raises:
      ValueError: ``impl="flash"`` with a batch the token shards do not divide.
    """
    shards = token_shards("attention")[1]
    if impl == "auto":
        return "flash" if target_platform() == "gpu" and batch % shards == 0 else "blocked"
    if impl == "flash" and batch % shards:
        raise ValueError(f"model.attention_impl=flash: batch {batch} is not divisible by the {shards} token shards "
                         "of the mesh; use a batch that is, or model.attention_impl=blocked")
    return impl


def fused_attention(q_bthd: jax.Array, k_bsgd: jax.Array, v_bsgd: jax.Array, segment_ids_bt: jax.Array, *,
                    kv_segment_ids_bs: jax.Array | None = None, scale: float | None = None,
                    window: int | None = None, sinks_h: jax.Array | None = None,
                    return_max: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal grouped-query attention inside packed documents with the fused kernel
    (:func:`moefast.kernels.attention.flash_attention`), each device on its own rows.

    Under a mesh the kernel runs inside ``jax.shard_map`` over the token axes (a Pallas call has no
    partitioning rule: left to the partitioner, every device would gather the whole batch).

    Args:
      q_bthd: [B, T, H, Hd] queries (unscaled); k_bsgd: [B, S, G, Hd] keys, v_bsgd: [B, S, G, Hv]
        values (Hv = Hd but in MLA), in their dtype. S = T, or, with ``kv_segment_ids_bs``, S >= T
        and the queries are the last T of the S positions (a later sequence slice:
        ``model.sequence_slices``).
      segment_ids_bt: [B, T] int document ids of the queries (query t sees keys s <= S - T + t of
        its own id); kv_segment_ids_bs: [B, S] those of the keys (``None``: the queries').
      scale: logit scale; ``None``: ``Hd ** -0.5``.
      window: a sliding window of that many keys (:func:`~moefast.kernels.attention.flash_attention`).
      sinks_h: [H] sink logits, or ``None``.
      return_max: also return each head's largest pre-softmax logit (the kernel's ``return_max``,
        reduced over rows and queries with a max), as :func:`causal_attention`.

    Returns:
      [B, T, H, Hv] in the queries' dtype; with ``return_max`` the pair (that, float32 [H]), the
      maxima not differentiated.
    """
    interpret = target_platform() == "cpu"
    kw = dict(q_offset=k_bsgd.shape[1] - q_bthd.shape[1], window=window, sm_scale=scale, interpret=interpret,
              return_max=return_max)
    kv_ids = segment_ids_bt if kv_segment_ids_bs is None else kv_segment_ids_bs
    arrays = [q_bthd, k_bsgd, v_bsgd, segment_ids_bt, kv_ids]
    if sinks_h is not None:  # as rows, so that every operand is split over the token axes: device i's
        # gradient lands in its first row, and the broadcast's transpose sums the rows
        arrays.append(jnp.broadcast_to(sinks_h, (q_bthd.shape[0], *sinks_h.shape)))

    def run(q, k, v, seg, kv_seg, *sinks_bh):
        out = flash_attention(q, k, v, seg, kv_segment_ids_bs=kv_seg, sinks_h=sinks_bh[0][0] if sinks_bh else None,
                              **kw)
        return (out[0], jnp.max(out[1], axis=2)) if return_max else out  # maxima [B, H, T] -> [B, H]

    if context_size() > 1:  # the keys and values arrive split along the axis: gathered inside
        if kv_segment_ids_bs is not None:
            raise ValueError("context parallelism: sequence slices (keys before the queries) are not supported on a "
                             "context axis")
        return context_flash_attention(q_bthd, (k_bsgd, v_bsgd), segment_ids_bt, scale=scale, window=window,
                                       sinks_h=sinks_h, return_max=return_max)
    out = on_own_rows(run, *arrays, where="attention")
    return (out[0], jnp.max(out[1], axis=0)) if return_max else out


def context_flash_attention(q_bthd: jax.Array, kv_parts: tuple[jax.Array, ...], segment_ids_bt: jax.Array, *,
                            make_kv=None, weights: tuple[jax.Array, ...] = (), scale: float | None = None,
                            window: int | None = None, sinks_h: jax.Array | None = None,
                            return_max: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention of rows split over the mesh's ``context`` axis with the fused kernel
    (:mod:`moefast.parallel.context`), inside ``jax.shard_map``.

    Each device holds its mirrored pair of chunks of every row (the balanced order). It
    all-gathers the row's ``kv_parts`` and segment ids along the axis (in the backward pass the
    parts' gradients are reduce-scattered back), puts them in the row's order, builds the keys and
    values from them (``make_kv``: multi-head latent attention up-projects its gathered latent
    here, so only the latent and the RoPE key travel), and runs the kernel once per chunk with the
    chunk's own traced query offset: each chunk's causal loop bounds stop at its own position, so
    every device does the same work. A sliding window skips the key blocks outside it (the whole
    row is still gathered).

    Args:
      q_bthd: [B, T, H, Hd] queries in the balanced order, T split over ``context``.
      kv_parts: [B, T, ...] arrays in the balanced order, split like the queries: ``(keys [B, T, G,
        Hd], values [B, T, G, Hv])`` without ``make_kv``.
      segment_ids_bt: [B, T] int document ids in the balanced order.
      make_kv: ``(*whole_parts, *weights) -> (keys, values)`` on one device's whole rows, or
        ``None`` (the parts are the keys and values).
      weights: arrays ``make_kv`` reads, whole on every device (their gradients summed over the mesh).
      scale, window, sinks_h, return_max: as :func:`fused_attention`.

    Returns:
      [B, T, H, Hv] in the balanced order, split like the queries; with ``return_max`` the pair
      (that, float32 [H] largest logits: each device's chunks reduced, then the devices').

    Raises:
      ValueError: T not a multiple of 2 x the context axis's size.
    """
    c = context_size()
    b, t = q_bthd.shape[:2]
    if t % (2 * c):
        raise ValueError(f"context parallelism over {c} devices: the row length {t} must be a multiple of {2 * c}")
    chunk = t // (2 * c)
    rows = token_shards("attention")[0] or None
    kw = dict(window=window, sm_scale=scale, interpret=target_platform() == "cpu", return_max=return_max)
    n_parts, n_weights = len(kv_parts), len(weights)

    def local(q, seg, *rest):
        parts, ws, sinks = rest[:n_parts], rest[n_parts:n_parts + n_weights], rest[n_parts + n_weights:]
        whole = [natural_order(gather_rows(p), c) for p in parts]
        kv_seg = natural_order(jax.lax.all_gather(seg, CONTEXT_AXIS, axis=1, tiled=True), c)
        k, v = make_kv(*whole, *ws) if make_kv is not None else whole
        j = jax.lax.axis_index(CONTEXT_AXIS)
        outs = []
        for half, offset in ((0, j * chunk), (1, (2 * c - 1 - j) * chunk)):
            mine = slice(half * chunk, (half + 1) * chunk)
            # the kernels' names carry the offset's mean over the devices (what cost models count)
            mean = (c - 1) * chunk // 2 if half == 0 else (3 * c - 1) * chunk // 2
            outs.append(flash_attention(q[:, mine], k, v, seg[:, mine], kv_segment_ids_bs=kv_seg,
                                        sinks_h=sinks[0] if sinks else None, q_offset=mean,
                                        dynamic_q_offset=offset, **kw))
        if not return_max:
            return jnp.concatenate(outs, axis=1)
        # this device's largest logits [B, 1, H] (its two chunks): a row per device along the axis
        return jnp.concatenate([o for o, _ in outs], axis=1), jnp.maximum(*(m.max(axis=2) for _, m in outs))[:, None]

    split = P(rows, CONTEXT_AXIS)
    args = (q_bthd, segment_ids_bt, *kv_parts, *weights, *(() if sinks_h is None else (sinks_h,)))
    specs = (split, split, *(split,) * n_parts, *(P(),) * (len(args) - 2 - n_parts))
    out = jax.shard_map(local, in_specs=specs, out_specs=(split, split) if return_max else split,
                        check_vma=False)(*reshard_for_shard_map(args, specs))
    return (out[0], jnp.max(out[1], axis=(0, 1))) if return_max else out


def attend(q_bthd: jax.Array, k_bsgd: jax.Array, v_bsgd: jax.Array, mask, *, scale: float | None = None,
           causal: bool = True, window: int | None = None, sinks_h: jax.Array | None = None,
           q_start: jax.Array | int | None = None, return_max: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The attention of a block over the mask the model passes: the fused kernel for segment ids
    (an int [B, T] array, or the pair ([B, T] queries' ids, [B, S] keys' ids) of a later sequence
    slice), else :func:`causal_attention` over a bool [B or 1, 1, T, S] mask (its causal key
    blocks skipped when ``causal`` and S = T), narrowed to a sliding ``window`` of keys, query t
    at key position ``q_start + t`` (``None``: S - T; a KV cache: the cache index). Other
    arguments and the result (with ``return_max``: and each head's largest pre-softmax logit,
    float32 [H]) as :func:`fused_attention`."""
    c = context_size() if causal else 1
    if c > 1 and not (isinstance(mask, tuple) or mask.ndim == 2):  # the blocked einsums on a context axis:
        # the row's keys and values on every device (the fused path gathers them itself)
        k_bsgd, v_bsgd = gather_context(k_bsgd), gather_context(v_bsgd)
    if isinstance(mask, tuple):
        return fused_attention(q_bthd, k_bsgd, v_bsgd, mask[0], kv_segment_ids_bs=mask[1], scale=scale,
                               window=window, sinks_h=sinks_h, return_max=return_max)
    if mask.ndim == 2:
        return fused_attention(q_bthd, k_bsgd, v_bsgd, mask, scale=scale, window=window, sinks_h=sinks_h,
                               return_max=return_max)
    t, s_len = q_bthd.shape[1], k_bsgd.shape[1]
    if window:
        if c > 1:  # the balanced order: each token's place in the row
            q_pos = k_pos = jnp.asarray(row_index(t, c))
        else:
            q_pos, k_pos = (s_len - t if q_start is None else q_start) + jnp.arange(t), jnp.arange(s_len)
        mask = mask & ((q_pos[:, None] - k_pos[None, :]) < window)[None, None]
    # the causal key blocks are those of the row's order: in the balanced order the mask says all
    return causal_attention(q_bthd, k_bsgd, v_bsgd, mask, causal=causal and t == s_len and c == 1, scale=scale,
                            sinks_h=sinks_h, return_max=return_max)


class Attention(nnx.Module):
    """Causal grouped-query attention with RoPE (:func:`causal_attention`, or :func:`fused_attention`
    when the model passes segment ids: ``model.attention_impl``).

    Parameters: ``qkv`` [D, (H + 2G)·Hd] (embed, heads), fused q|k|v projections; ``out`` [H·Hd, D]
    (heads, embed). Options (``model.attention_bias``): ``qkv_bias`` [(H + 2G)·Hd] and ``out_bias``
    [D]. ``model.qk_norm``: ``q_norm``/``k_norm`` RMSNorm scales of [Hd] (``"per_head"``: each
    head's query and key normalised, Qwen3) or of [H·Hd] and [G·Hd] (``"full"``: the whole query
    and key projections, OLMoE), applied before RoPE (``zero_centered``: scales applied as ``1 + w``).
    ``output_gate`` (``model.attention_output_gate``; Qwen3-Next, Qwen3.5): ``gate`` [D, H·Hd]
    (embed, heads), the output multiplied by ``sigmoid(x gate)`` before ``out``. ``window``
    (``"sliding_attention"`` layers, ``model.sliding_window``): each query sees its ``window``
    latest keys. ``sinks`` (``model.attention_sinks``; gpt-oss): ``sinks`` [H] (heads), a learned
    logit per head joining each softmax's denominator. ``k_eq_v`` (``model.attention_k_eq_v``, Gemma 4's
    full layers): ``qk`` [D, (H + G)·Hd] replaces ``qkv``, the values being the keys' projection before
    their norm and RoPE. ``value_norm``: each head's values RMS-normalised without a scale (Gemma 4).
    ``scale``: the logits' multiplier (``None``: Hd ** -0.5).
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 dtype, init_std: float, out_std: float, bias: str = "none", qk_norm: str = "none",
                 norm_eps: float = 1e-6, output_gate: bool = False, zero_centered: bool = False,
                 window: int | None = None, sinks: bool = False, k_eq_v: bool = False, value_norm: bool = False,
                 scale: float | None = None, fp8: bool = False, rngs: nnx.Rngs):
        if k_eq_v and bias != "none":
            raise ValueError("Attention: keys as values (k_eq_v) has no value projection to bias; use bias='none'")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.has_sinks = window, sinks
        self.dtype, self.bias, self.qk_norm, self.output_gate = dtype, bias, qk_norm, output_gate
        self.k_eq_v, self.value_norm, self.norm_eps, self.scale = k_eq_v, value_norm, norm_eps, scale
        self.fp8 = fp8  # model.precision == "fp8": the projections' GEMMs by the FP8 recipe
        init = jax.nn.initializers.normal(init_std)
        width = (num_heads + (1 if k_eq_v else 2) * num_kv_heads) * head_dim
        if k_eq_v:
            self.qk = nnx.Param(init(rngs.params(), (d_model, width)), logical_axes=("embed", "heads"))
        else:
            self.qkv = nnx.Param(init(rngs.params(), (d_model, width)), logical_axes=("embed", "heads"))
        if output_gate:
            self.gate = nnx.Param(init(rngs.params(), (d_model, num_heads * head_dim)), logical_axes=("embed", "heads"))
        self.out = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (num_heads * head_dim, d_model)),
                             logical_axes=("heads", "embed"))
        if sinks:
            self.sinks = nnx.Param(init(rngs.params(), (num_heads,)), logical_axes=("heads",))
        if bias != "none":
            self.qkv_bias = nnx.Param(jnp.zeros((width,), jnp.float32), logical_axes=("heads",))
        if bias == "all":
            self.out_bias = nnx.Param(jnp.zeros((d_model,), jnp.float32), logical_axes=("norm",))
        if qk_norm != "none":
            q_dim, k_dim = (head_dim, head_dim) if qk_norm == "per_head" else (num_heads * head_dim,
                                                                                num_kv_heads * head_dim)
            self.q_norm = rms_norm(q_dim, norm_eps, dtype, rngs, zero_centered=zero_centered)
            self.k_norm = rms_norm(k_dim, norm_eps, dtype, rngs, zero_centered=zero_centered)

    def __call__(self, x_btd, rope, mask_b1ts, cache: dict | None, cache_index, kv_prefix: tuple | None = None, *,
                 record_max: bool = False):
        """``rope``: ``(cos, sin)`` float32 [B, T, 1, Hd/2] from :func:`rope_cos_sin`, or ``None``
        (no rotation: sinusoidal encodings were added to the embeddings); ``mask_b1ts``: bool
        [B or 1, 1, T, S], True where a query may attend to a key (:func:`causal_attention`), or
        the int [B, T] segment ids of the packed documents (no cache: :func:`fused_attention`), or
        a sequence slice's pair of ids (:func:`attend`).

        ``kv_prefix`` (a sequence slice, ``model.sequence_slices``; no cache): ``()`` for the first
        slice, else the earlier slices' ``(keys [B, S0, G, Hd], values)``, which these queries
        attend to before their own. Returns ``(out [B, T, D], new cache or None)``, or with a
        ``kv_prefix`` ``(out, (keys, values) of the prefix and this slice)`` for the next slice.
        With ``record_max`` a third result: each head's largest pre-softmax logit of these queries,
        float32 [H] (:func:`causal_attention`'s ``return_max``; QK-clip), not differentiated, or
        ``None`` with a cache (generation records nothing)."""
        b, t, _ = x_btd.shape
        h, g, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = project(self, "qk" if self.k_eq_v else "qkv", x_btd, self.dtype, ("embed", "heads"), fp8=self.fp8)
        if self.bias != "none":  # added in float32: the bias gradient sums tokens in float32
            qkv = (qkv.astype(jnp.float32) + self.qkv_bias[...][None, None]).astype(self.dtype)
        q, k = qkv[..., : h * hd], qkv[..., h * hd: (h + g) * hd]
        v = k if self.k_eq_v else qkv[..., (h + g) * hd:]  # keys as values: before the key norm and RoPE
        if self.qk_norm == "full":
            q, k = self.q_norm(q).astype(self.dtype), self.k_norm(k).astype(self.dtype)
        q, k, v = q.reshape(b, t, h, hd), k.reshape(b, t, g, hd), v.reshape(b, t, g, hd)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q).astype(self.dtype), self.k_norm(k).astype(self.dtype)
        if self.value_norm:  # RMSNorm without a scale, in float32
            v = rms(v, self.norm_eps).astype(self.dtype)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        new_cache = None
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), cache_index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), cache_index, axis=1)
            new_cache = {"k": k, "v": v}
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        if kv_prefix:
            k, v = (jnp.concatenate([p, a], axis=1) for p, a in zip(kv_prefix, (k, v)))
        sinks = self.sinks[...] if self.has_sinks else None
        record = record_max and cache is None
        o = attend(q, k, v, mask_b1ts, causal=cache is None, window=self.window, sinks_h=sinks, scale=self.scale,
                   q_start=None if cache is None else cache_index, return_max=record)
        o, max_h = o if record else (o, None)
        o = o.reshape(b, t, h * hd)
        if self.output_gate:
            g = project(self, "gate", x_btd, self.dtype, ("embed", "heads"), fp8=self.fp8)
            o = (o * jax.nn.sigmoid(g.astype(jnp.float32)).astype(o.dtype)).astype(self.dtype)
        o = project(self, "out", o, self.dtype, ("heads", "embed"), fp8=self.fp8)
        if self.bias == "all":
            o = (o.astype(jnp.float32) + self.out_bias[...][None, None]).astype(self.dtype)
        out = (o, (k, v) if kv_prefix is not None else new_cache)
        return (*out, max_h) if record_max else out
