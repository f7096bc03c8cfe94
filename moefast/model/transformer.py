"""Decoder-only MoE transformer in Flax NNX.

Dimension letters: B batch, T tokens (query length), S key length (cache), D d_model, H query heads,
G key/value heads, Hd head_dim, F d_ff, V vocab, L layers, E experts.

Block (pre-norm, :mod:`moefast.model.block`): ``x + Attn(RMSNorm(x))`` then ``x + FFN(RMSNorm(x))`` where FFN is a
:class:`~moefast.model.moe.MoELayer` or a dense SwiGLU; with ``model.sandwich_norm`` (Gemma) each
output is RMS-normalised again before the addition, with ``model.layer_scalar`` (Gemma 4) the
block's output is multiplied by a learned scalar, and with ``moe.branch_norms`` the MoE layer also
reads the un-normalised ``x``. The attention kinds live in modules of their
own: grouped-query attention with RoPE or sinusoidal encodings (:mod:`moefast.model.attention`:
:func:`causal_attention`, the fused kernel :func:`fused_attention`, ``model.attention_impl``) and,
with ``model.attention=mla``, DeepSeek's multi-head latent attention (:mod:`moefast.model.mla`),
whose generation cache holds its compressed vectors (:func:`cache_bytes_per_token`). Attention
never crosses packed documents (segment ids).

Caching (``cache.tables``): the positional rows (gathered from constant tables, see
:mod:`moefast.model.positional`) and the attention mask are computed once per forward pass and
shared by every layer; with ``cache.tables=False`` every layer recomputes both.

Memory (``model.remat``, ``model.scan_layers``): each block may run under ``jax.checkpoint`` with a
policy of :data:`REMAT_POLICIES`, and identical blocks may be stacked and run by ``jax.lax.scan``
(parameter layout: :mod:`moefast.model.layout`). With a KV cache (generation) the stacked blocks are
sliced and run one by one.

Multi-token prediction (``model.mtp_depth`` = D > 0; DeepSeek-V3, arXiv 2412.19437, sec. 2.2):
after the main stack, D :class:`MTPModule` s run in sequence (unrolled, also with ``scan_layers``)
and their logits come back in :attr:`ModelOutput.mtp_logits`; never with a KV cache (generation).

Randomness: every random draw uses ``fold_in(step_key, site)`` with site ``3 * layer`` (dropout of
the attention output), ``3 * layer + 1`` (dropout of the feed-forward output) and ``3 * layer + 2``
(expert warm-up routing noise); no key is split or carried between calls. Multi-token prediction
module k (1-based) uses layer id ``L + k - 1``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moefast.config import ExperimentConfig
from moefast.model.attention import ATTENTION_BLOCK, attention_impl, causal_attention, fused_attention
from moefast.model.block import DEFAULT_ROPE, FULL_ROPE, Block, _sliced_tables, _slices
from moefast.model.kv_cache import (_DTYPES, KVCache, _cache_widths, cache_bytes_per_token,  # noqa: F401
                                    init_cache)
from moefast.model.layout import layer_layout
from moefast.model.mla import MLA_NORM_EPS, MLAttention
from moefast.model.moe import MoEStats
from moefast.model.norm import rms_norm
from moefast.model.positional import Yarn, check_positions, document_positions, rope_cos_sin, sinusoidal_encoding
from moefast.parallel.context import balanced_order, context_size, restore_order, row_index, split_context
from moefast.parallel.expert import EXPERT_IN, EXPERT_OUT, ROUTING, RoutingSums
from moefast.parallel.precision import dense, embed_lookup

__all__ = ["ATTENTION_BLOCK", "KVCache", "MINIMAL_SAVED", "MLA_NORM_EPS", "MLAttention", "MTPModule", "ModelOutput",
           "REMAT_POLICIES", "Transformer", "attention_impl", "build_model", "cache_bytes_per_token", "causal_attention",
           "fused_attention", "init_cache", "init_routing_state", "shift_left"]



class ModelOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] float32
    moe: MoEStats | None  # fields stacked over MoE layers: [L_moe, E] / [L_moe]; None without MoE layers
    cache: KVCache | None  # updated cache when one was passed
    # multi-token prediction (model.mtp_depth = D > 0, no cache): D arrays [B, T, V] float32, entry
    # k - 1 holding module k's logits for token t_{i+k+1} at row i; None otherwise
    mtp_logits: tuple[jax.Array, ...] | None = None
    # float32 [L_attn, H], not differentiated: each softmax-attention layer's largest pre-softmax
    # logit per head (the scaled q·k over batch, queries and the keys each may see; QK-clip, Kimi K2,
    # arXiv 2507.20534, sec. 2.1), one row per such layer of the main stack in layer order, then the
    # MTP modules' blocks (moefast.model.layout.softmax_attention_layers); None with a cache or
    # without softmax attention layers (Gated DeltaNet layers have no row)
    max_logits: jax.Array | None = None
    # float32 [L_attn], differentiated: while DSA's indexers train (train.indexer_stage), each
    # layer's indexer KL summed over the batch's real queries (the rows of max_logits); else None
    indexer_loss: jax.Array | None = None


def shift_left(a_bt: jax.Array, k: int, fill=0) -> jax.Array:
    """``a`` moved k places left along axis 1, the last k columns ``fill``: row i holds ``a[:, i + k]``.

    Args:
      a_bt: [B, T, ...] array; k: static shift in tokens, 0 <= k.
      fill: value of the k columns past the end (same dtype as ``a_bt``).

    Returns:
      [B, T, ...] like ``a_bt``.
    """
    if k == 0:
        return a_bt
    pad = jnp.full((a_bt.shape[0], min(k, a_bt.shape[1]), *a_bt.shape[2:]), fill, a_bt.dtype)
    return jnp.concatenate([a_bt[:, k:], pad], axis=1)


class MTPModule(nnx.Module):
    """Multi-token prediction module k (DeepSeek-V3, arXiv 2412.19437, sec. 2.2, eqs. 21-22):

        h'_i^k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]      (eq. 21)
        h^k = RMSNorm_head(TRM_k(h'^k))                               (eq. 22, and the head's norm)

    then ``P^k_{i+k+1} = softmax(OutHead(h_i^k))`` (eq. 23) through the model's shared output head.
    ``h^0`` is the main model's output after its final RMSNorm, and each module passes its output
    after its own head norm to the next, as the released checkpoints are used by Hugging Face
    transformers (5.24, ``MtpModel``) and vLLM; the concatenation puts the embedding first, the
    checkpoints' order (the paper writes the hidden state first; only ``M_k``'s rows move).

    Parameters (Hugging Face DeepSeek-V3 names of MTP layer ``L + k - 1`` in brackets):
    ``enorm`` [D] (``enorm``), ``hnorm`` [D] (``hnorm``), ``eh_proj`` [2D, D] (``eh_proj``, stored
    transposed [D, 2D] there), ``block`` (:class:`Block`, the decoder layer: ``input_layernorm``,
    ``self_attn``, ``post_attention_layernorm``, ``mlp``), ``head_norm`` [D]
    (``shared_head.norm``). ``shared_head.head`` and ``embed_tokens`` are the main model's head and
    embedding (shared, not stored here). Qwen3-Next / Qwen3.5 (vLLM's ``qwen3_next_mtp.py``) name
    them ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.fc``, ``mtp.layers.{k-1}``
    and ``mtp.norm``; with ``model.layer_types`` the block is a full-attention block (gated like
    the model's), as every block past ``num_layers`` is.

    The block is an MoE block when the model has MoE layers (its statistics, aux and z losses join
    the main model's, and it has a routing-state row), else dense.
    """

    def __init__(self, cfg: ExperimentConfig, k: int, *, rngs: nnx.Rngs):
        m = cfg.model
        self.dtype = _DTYPES[m.dtype]
        self.fp8 = m.precision == "fp8"  # eh_proj by the FP8 recipe, as the blocks' projections
        self.enorm = rms_norm(m.d_model, m.norm_eps, self.dtype, rngs, zero_centered=m.zero_centered_norm)
        self.hnorm = rms_norm(m.d_model, m.norm_eps, self.dtype, rngs, zero_centered=m.zero_centered_norm)
        self.eh_proj = nnx.Param(jax.nn.initializers.normal(m.init_std)(rngs.params(), (2 * m.d_model, m.d_model)),
                                 logical_axes=(None, "embed"))
        has_moe = any(m.is_moe_layer(i) for i in range(m.num_layers))
        self.block = Block(cfg, m.num_layers + k - 1, rngs=rngs, is_moe=has_moe)
        self.head_norm = rms_norm(m.d_model, m.norm_eps, self.dtype, rngs, zero_centered=m.zero_centered_norm)

    @property
    def is_moe(self) -> bool:
        return self.block.is_moe

    def __call__(self, h_btd, emb_btd, layer, rope, attn_mask, token_mask, cache=None, cache_index=0,
                 step_key=None, routing_state=None, routing_warmup=None, *, drop_tokens=True, record_max=False):
        """One module: ``h_btd`` [B, T, D] = h^{k-1} (compute dtype), ``emb_btd`` [B, T, D] =
        Emb(t_{i+k}) at row i; the rest as :meth:`Block.__call__` (``layer`` = L + k - 1).
        Returns ``(h^k [B, T, D] in the compute dtype, stats or None, None)``, with ``record_max``
        and the block's largest logits per head, float32 [H]."""
        x = jnp.concatenate([self.enorm(emb_btd), self.hnorm(h_btd)], axis=-1).astype(self.dtype)
        x = dense(x, self.eh_proj[...], self.dtype, (None, "embed"), fp8=self.fp8)
        x, stats, _, *max_h = self.block(x, layer, rope, attn_mask, token_mask, None, cache_index, step_key,
                                         routing_state, routing_warmup, drop_tokens=drop_tokens, record_max=record_max)
        return self.head_norm(x).astype(self.dtype), stats, None, *max_h


MINIMAL_SAVED = (ROUTING, EXPERT_IN, EXPERT_OUT)
"""What ``model.remat=minimal`` keeps (``checkpoint_name`` in :mod:`moefast.parallel.expert`)."""
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*MINIMAL_SAVED),
}
"""``model.remat`` -> ``jax.checkpoint`` policy of each block (``None``: no rematerialisation)."""


def _block_fn(graphdef, remat: str, drop_tokens: bool, record_max: bool = False):
    """``f(state, x, layer, rope, attn_mask, token_mask, cache, cache_index, step_key, routing_state,
    routing_warmup) -> (x, stats, cache)``, with ``record_max`` also the block's largest logits
    per head (float32 [H] or ``None``, :meth:`Block.__call__`): the block of ``graphdef`` as a pure
    function, under ``jax.checkpoint`` with the policy of ``remat``."""

    def f(state, *args):
        return nnx.merge(graphdef, state)(*args, drop_tokens=drop_tokens, record_max=record_max)

    if REMAT_POLICIES[remat] is None:
        return f
    return jax.checkpoint(f, policy=REMAT_POLICIES[remat])


def _rows_in_layer_order(parts: list[tuple[tuple[int, ...], jax.Array | None]]) -> jax.Array | None:
    """One [n, H] array from ``(layer indices, [len(indices), H] rows or None)`` parts given in any
    layer order (the scanned layout's prefix, groups and tail): the rows sorted by layer, the
    ``None`` parts (Gated DeltaNet blocks) left out; ``None`` when nothing is left."""
    parts = [(ids, rows) for ids, rows in parts if rows is not None]
    if not parts:
        return None
    ids = np.concatenate([np.asarray(i, np.int64) for i, _ in parts])
    rows = _concat([r for _, r in parts]) if len(parts) > 1 else parts[0][1]
    order = np.argsort(ids, kind="stable")
    return rows if np.array_equal(order, np.arange(ids.size)) else jax.tree.map(lambda r: r[order], rows)


def _stack(records: list):
    """Per-layer records (arrays, or dicts of them: :meth:`Block.__call__`) stacked on a new leading axis."""
    return jax.tree.map(lambda *a: jnp.stack(a), *records)


def _concat(records: list):
    """Stacked records joined along their leading (layers) axis."""
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *records)


def _stack_modules(blocks: list[Block]) -> Block:
    """One :class:`Block` whose parameters are those of ``blocks`` stacked on a leading ``layers``
    axis (the blocks must be of one kind: all MoE or all dense)."""
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.state(b) for b in blocks]
    stacked = jax.tree.map(lambda *vs: jnp.stack(vs), *states)
    for _, v in nnx.to_flat_state(stacked):
        v.set_metadata(logical_axes=("layers", *v.get_metadata()["logical_axes"]))
    return nnx.merge(graphdef, stacked)


class Transformer(nnx.Module):
    """Decoder-only MoE language model.

    Build with :func:`build_model`. Call with token ids, positions and segment ids; see
    :meth:`__call__`.
    """

    def __init__(self, cfg: ExperimentConfig, vocab_size: int, *, rngs: nnx.Rngs):
        m = cfg.model
        self.vocab_size, self.max_seq_len = vocab_size, m.max_seq_len
        self.position_encoding, self.rope_base, self.head_dim = m.position_encoding, m.rope_base, m.head_dim
        self.rope_dim, self.yarn, self.attention = m.rotary_dim, Yarn.from_config(m), m.attention
        self.full_rope = None  # (width, base, rotated pairs) of the full-attention layers' own table
        if m.full_layer_rope:
            hd = m.full_head_dim
            rotated = None if m.global_rotary_fraction is None else int(m.global_rotary_fraction * hd // 2)
            self.full_rope = (hd, m.rope_base if m.global_rope_base is None else m.global_rope_base, rotated)
        self.embed_multiplier = math.sqrt(m.d_model) if m.embed_scale else 1.0
        self.softcap = m.final_logit_softcapping
        self.cache_widths = tuple(tuple(_cache_widths(m, i).items()) for i in range(m.num_layers))
        self.model_cfg = m  # frozen, hashable: static metadata (init_cache's Gated DeltaNet states)
        self.cache_tables = cfg.cache.tables
        self.attention_impl = m.attention_impl
        self.dtype = _DTYPES[m.dtype]
        self.tie_embeddings = m.tie_embeddings
        self.embed = nnx.Param(jax.nn.initializers.normal(m.init_std)(rngs.params(), (vocab_size, m.d_model)),
                               logical_axes=("vocab", "embed"))
        self.num_layers, self.num_kv_heads = m.num_layers, m.kv_heads
        self.remat, self.scan_layers = m.remat, m.scan_layers
        self.sequence_slices = m.sequence_slices
        blocks = [Block(cfg, i, rngs=rngs) for i in range(m.num_layers)]  # one init order for both layouts
        if not m.scan_layers:
            self.blocks = nnx.List(blocks)
        else:  # see moefast.model.layout
            self.layout = layer_layout(m)
            if self.layout.prefix:
                self.prefix = _stack_modules([blocks[i] for i in self.layout.prefix])
            if self.layout.groups:
                self.groups = nnx.List([_stack_modules([blocks[i] for i in ids]) for ids in self.layout.groups])
            if self.layout.tail:
                self.tail = nnx.List([blocks[i] for i in self.layout.tail])
        self.final_norm = rms_norm(m.d_model, m.norm_eps, self.dtype, rngs, zero_centered=m.zero_centered_norm)
        if not m.tie_embeddings:
            self.lm_head = nnx.Param(jax.nn.initializers.normal(m.init_std)(rngs.params(), (m.d_model, vocab_size)),
                                     logical_axes=("embed", "vocab"))
        self.top_k = cfg.moe.top_k  # reduces the routing sums into MoEStats (_moe_stats)
        self.mtp_depth = m.mtp_depth
        if m.mtp_depth:  # after every other parameter: the main model's initial values do not depend on D
            self.mtp_routing_row = sum(m.is_moe_layer(i) for i in range(m.num_layers))  # MTP rows follow the main's
            self.mtp = nnx.List([MTPModule(cfg, k, rngs=rngs) for k in range(1, m.mtp_depth + 1)])

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                 segment_ids_bt: jax.Array | None = None, *, cache: KVCache | None = None,
                 cache_index: jax.Array | int = 0, step_key: jax.Array | None = None,
                 drop_tokens: bool = True, routing_state: dict[str, jax.Array] | None = None,
                 routing_warmup: jax.Array | None = None) -> ModelOutput:
        """Forward pass.

        Args:
          tokens_bt: [B, T] int token ids in [0, V).
          positions_bt: [B, T] int positions in [0, max_seq_len); ``None``: each token's position
            in its document of ``segment_ids_bt`` (:func:`~moefast.model.positional.document_positions`:
            a packed row's second document starts at 0, as it would alone), else ``arange(T)`` (plus
            ``cache_index`` when decoding).
          segment_ids_bt: [B, T] int document ids of packed rows (0 = padding: never routed; padding
            attends only to padding). ``None`` = one document. Ignored with a cache.
          cache: per-layer KV cache from :func:`init_cache` (generation). Keys/values of these
            tokens are written at ``cache_index`` and attention covers cache entries ``<=`` each
            query's own index.
          cache_index: [] int, where the first of these tokens goes in the cache.
          step_key: PRNG key of this step (``fold_in(base_key, step)``); each layer and site
            folds in its own id. ``None`` disables dropout (evaluation).
          drop_tokens: MoE capacity dropping (training); False routes every token (evaluation,
            generation), see :class:`MoELayer`.
          routing_state: non-trainable routing state from the train state (see
            :func:`init_routing_state`): ``{"bias": [L_moe, E], "load_ema": [L_moe, E]}`` float32;
            row j belongs to the j-th MoE layer. ``None``: no bias, uniform load.
          routing_warmup: [] bool, True during expert warm-up (``moe.warmup_steps``): routing is
            randomised with keys folded from ``step_key``. Ignored without a ``step_key``.

        Returns:
          :class:`ModelOutput` with float32 logits [B, T, V] and, without a cache, each
          softmax-attention layer's largest pre-softmax logit per head, float32 [L_attn, H]
          (``max_logits``; recorded in the layers' own attention, not differentiated).

        Raises:
          ValueError: T (or cache length) exceeds ``max_seq_len``, or concrete positions are out of
            ``[0, max_seq_len)``.
        """
        b, t = tokens_bt.shape
        # context parallelism (a mesh's context axis, moefast.parallel.context): training's rows only
        context = context_size() if cache is None else 1
        tokens_in = tokens_bt
        if t > self.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len={self.max_seq_len}; "
                             "shorten the input or raise model.max_seq_len")
        if positions_bt is None and cache is None and segment_ids_bt is not None:
            positions_bt = document_positions(segment_ids_bt)
        elif positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None] + cache_index, (b, t))
        check_positions(positions_bt, self.max_seq_len)
        if cache is not None:
            # key length S: the attention layers' caches (Gated DeltaNet layers carry states instead)
            s = next((next(iter(c.values())).shape[1] for c in cache if c and "state" not in c), 0)
            if s > self.max_seq_len:
                raise ValueError(f"cache length {s} exceeds model.max_seq_len={self.max_seq_len}")

            def make_mask():  # [1, 1, T, S]: each query sees the cache up to its own index; no segments
                q_idx = cache_index + jnp.arange(t)
                return (jnp.arange(s)[None, :] <= q_idx[:, None])[None, None], None

            token_mask = jnp.ones((b, t), bool)
        else:
            if segment_ids_bt is None:
                segment_ids_bt = jnp.ones((b, t), jnp.int32)
            fused = attention_impl(self.attention_impl, b) == "flash"
            if context > 1:  # the layers carry each row in the context axis's balanced order
                tokens_in, positions_bt, segment_ids_bt = (balanced_order(a, context) for a in
                                                          (tokens_bt, positions_bt, segment_ids_bt))
            index_t = jnp.asarray(row_index(t, context))  # each token's place in the row

            def make_mask():  # ([B, 1, T, T] causal inside each packed document, or the segment ids; the ids)
                if fused:  # the kernel masks from the segment ids themselves
                    return segment_ids_bt, segment_ids_bt
                causal = index_t[:, None] >= index_t[None, :]
                same_doc = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
                return (same_doc & causal[None])[:, None], segment_ids_bt

            token_mask = segment_ids_bt != 0

        def make_rope():  # (cos, sin) [B, T, 1, Hd/2] (or the named tables), None with sinusoidal encodings
            if self.position_encoding != "rope":
                return None
            tables = rope_cos_sin(positions_bt, self.max_seq_len, self.rope_dim, self.rope_base,
                                  cached=self.cache_tables, yarn=self.yarn)
            if self.full_rope is None:
                return tables
            width, base, rotated = self.full_rope
            return {DEFAULT_ROPE: tables, FULL_ROPE: rope_cos_sin(positions_bt, self.max_seq_len, width, base,
                                                                  cached=self.cache_tables, rotated=rotated)}

        if self.cache_tables:  # once per forward pass, shared by every layer
            attn_mask, rope = make_mask(), make_rope()

        x = split_context(self._embed(tokens_in))
        if self.position_encoding == "sinusoidal":
            x = x + sinusoidal_encoding(positions_bt, self.max_seq_len, x.shape[-1], self.dtype,
                                        cached=self.cache_tables)
        layer_args = dict(token_mask=token_mask, cache_index=cache_index, step_key=step_key,
                          routing_warmup=routing_warmup, drop_tokens=drop_tokens)
        if not self.cache_tables:  # the baseline: every layer rebuilds them
            make = lambda: (make_mask(), make_rope())
        else:
            make = lambda: (attn_mask, rope)
        n = self.sequence_slices if cache is None else 1
        if n > 1:  # the layers carry the rows as n sequence slices (Block.__call__)
            x, layer_make = _slices(x, n), lambda: _sliced_tables(*make(), n)
            layer_args = {**layer_args, "token_mask": _slices(token_mask, n)}
        else:
            layer_make = make
        if self.scan_layers and cache is None:
            x, moe, max_logits = self._scanned(x, layer_make, routing_state, **layer_args)
            new_cache = None
        else:
            x, moe, new_cache, max_logits = self._unrolled(x, layer_make, routing_state, cache, **layer_args)
        if n > 1:
            x = jnp.concatenate(x, axis=1)
            layer_args["token_mask"] = token_mask  # the MTP modules run on whole rows
        x = self.final_norm(x).astype(x.dtype)
        logits = self._head(restore_order(x))  # the row's order again
        mtp_logits = None
        if self.mtp_depth and cache is None:
            mtp_logits, mtp_moe, mtp_max = self._mtp(x, tokens_bt, make, routing_state, context=context, **layer_args)
            if mtp_moe is not None:
                moe = mtp_moe if moe is None else RoutingSums.concatenate([moe, mtp_moe])
            max_logits = mtp_max if max_logits is None else _concat([max_logits, mtp_max])
        rec = max_logits or {}  # {"max_logits": [L_attn, H], "indexer_loss": [L_attn] while the indexers train}
        return ModelOutput(logits=logits, moe=self._moe_stats(moe), cache=new_cache,
                           mtp_logits=mtp_logits,
                           max_logits=None if not rec else jax.lax.stop_gradient(rec["max_logits"]),
                           indexer_loss=rec.get("indexer_loss"))

    def _moe_stats(self, sums: RoutingSums | None) -> MoEStats | None:
        """Every MoE layer's routing sums [L_moe, S, ...], reduced over the token shards once here
        (one all-reduce after the layers instead of one in each layer's forward and recomputed
        forward pass)."""
        return None if sums is None else sums.stats(self.top_k)

    def _embed(self, tokens_bt):
        """[B, T, D] token embeddings in the compute dtype (times sqrt(D) with ``model.embed_scale``)."""
        x = embed_lookup(self.embed[...], tokens_bt, self.dtype, ("vocab", "embed"))
        return x * jnp.asarray(self.embed_multiplier, x.dtype) if self.embed_multiplier != 1.0 else x

    def _head(self, x_btd):
        """The output head (shared by the multi-token prediction modules): float32 [B, T, V], capped
        at ``C * tanh(logits / C)`` with ``model.final_logit_softcapping`` = C."""
        if self.tie_embeddings:
            logits = dense(x_btd, self.embed[...], self.dtype, ("vocab", "embed"), transposed=True)
        else:
            logits = dense(x_btd, self.lm_head[...], self.dtype, ("embed", "vocab"))
        logits = logits.astype(jnp.float32)
        if self.softcap is not None:
            logits = self.softcap * jnp.tanh(logits / self.softcap)
        return logits

    def _mtp(self, h_btd, tokens_bt, make, routing_state, *, drop_tokens, context: int = 1, **kw):
        """The D multi-token prediction modules in order (DeepSeek-V3 sec. 2.2, eqs. 21-23), each
        under ``jax.checkpoint`` like a block. Module k reads the embedding of ``t_{i+k}`` (tokens
        shifted k places left; the k rows past the end read id 0 and are never targets) and the
        attention tables of the main blocks: the same packed-document mask, and the same positions
        (module k's inputs sit at the positions of ``t_{i+k}``, k further on inside a document, but
        rotary attention depends only on position differences, which are the same). On a context
        axis ``h_btd`` and the tables are in its balanced order and ``tokens_bt`` in the row's: the
        shifted tokens are reordered, the logits put back in the row's order. Returns
        ``(D logits [B, T, V] float32, MoE statistics [D, ...] or None, largest logits [D, H])``."""
        logits, stats, maxes = [], [], []
        for k, module in enumerate(self.mtp, start=1):
            emb = self._embed(balanced_order(shift_left(tokens_bt, k), context))
            rs = None
            if routing_state is not None and module.is_moe:
                rs = {n: v[self.mtp_routing_row + k - 1] for n, v in routing_state.items()}
            attn_mask, rope = make()
            graphdef, state = nnx.split(module)
            h_btd, s_k, _, max_k = _block_fn(graphdef, self.remat, drop_tokens, record_max=True)(
                state, h_btd, emb, self.num_layers + k - 1, rope, attn_mask, kw["token_mask"], None,
                kw["cache_index"], kw["step_key"], rs, kw["routing_warmup"])
            logits.append(self._head(restore_order(h_btd)))
            maxes.append(max_k)
            if s_k is not None:
                stats.append(s_k)
        moe = jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None
        return tuple(logits), moe, _stack(maxes)

    def layer_modules(self) -> list[Block]:
        """The L blocks in order, as modules (scanned stacks sliced, so each holds one layer's
        parameters)."""
        if not self.scan_layers:
            return list(self.blocks)
        out: dict[int, Block] = {}

        def sliced(stack, k):
            graphdef, state = nnx.split(stack)
            return nnx.merge(graphdef, jax.tree.map(lambda a: a[k], state))

        for k, i in enumerate(self.layout.prefix):
            out[i] = sliced(self.prefix, k)
        for j, ids in enumerate(self.layout.groups):
            for k, i in enumerate(ids):
                out[i] = sliced(self.groups[j], k)
        for j, i in enumerate(self.layout.tail):
            out[i] = self.tail[j]
        return [out[i] for i in range(self.num_layers)]

    def _unrolled(self, x, make, routing_state, cache, *, drop_tokens, **kw):
        """Every block in a Python loop (the unrolled layout, and any layout with a KV cache).
        Returns ``(x, routing sums or None, new cache or None, largest logits [L_attn, H] or None)``
        (no logits recorded with a cache)."""
        stats, new_cache, maxes = [], [] if cache is not None else None, []
        for i, block in enumerate(self.layer_modules()):
            rs = None
            if routing_state is not None and block.is_moe:
                rs = {k: v[len(stats)] for k, v in routing_state.items()}
            attn_mask, rope = make()
            graphdef, state = nnx.split(block)
            x, s_i, c_i, *max_i = _block_fn(graphdef, self.remat, drop_tokens, record_max=cache is None)(
                state, x, i, rope, attn_mask, kw["token_mask"], None if cache is None else cache[i],
                kw["cache_index"], kw["step_key"], rs, kw["routing_warmup"])
            if s_i is not None:
                stats.append(s_i)
            if cache is not None:
                new_cache.append(c_i)
            if max_i and max_i[0] is not None:  # a softmax-attention block (without a cache)
                maxes.append(max_i[0])
        moe = jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None
        return x, moe, new_cache, _stack(maxes) if maxes else None

    def _scanned(self, x, make, routing_state, *, drop_tokens, **kw):
        """The scanned layout: ``jax.lax.scan`` over the prefix stack and over the whole groups
        (each iteration runs one group's blocks in order), then the tail unrolled. MoE layer j's
        routing-state row and statistics stay row j of [L_moe, ...] (layer order: the groups' MoE
        blocks, group by group, then the tail's). Returns ``(x, routing sums or None, largest
        logits [L_attn, H] in layer order or None)``."""
        layout = self.layout
        maxes = []  # (layer indices, their largest logits [n, H] or None)
        rest = (kw["token_mask"], None, kw["cache_index"], kw["step_key"])

        def run(fn, state, x, layer, rs):  # make(): the cached tables, or (baseline) built in this layer
            attn_mask, rope = make()
            return fn(state, x, layer, rope, attn_mask, *rest, rs, kw["routing_warmup"])

        if layout.prefix:
            graphdef, state = nnx.split(self.prefix)
            fn = _block_fn(graphdef, self.remat, drop_tokens, record_max=True)

            def prefix_body(x, xs):
                st, layer = xs
                out = run(fn, st, x, layer, None)
                return out[0], out[3]

            x, prefix_max = jax.lax.scan(prefix_body, x, (state, jnp.asarray(layout.prefix, jnp.int32)))
            maxes.append((layout.prefix, prefix_max))
        stats = []
        moe_rows = 0  # routing-state rows used so far (MoE layers in layer order)
        if layout.groups:
            g = layout.num_groups
            parts = [nnx.split(stack) for stack in self.groups]
            fns = [_block_fn(gd, self.remat, drop_tokens, record_max=True) for gd, _ in parts]
            moe_pos = [j for j, stack in enumerate(self.groups) if stack.is_moe]  # MoE positions of the pattern
            m = len(moe_pos)
            rs_groups = None
            if routing_state is not None and m:  # group k's MoE layers are rows k * m .. k * m + m - 1
                rs_groups = {k: v[: g * m].reshape(g, m, *v.shape[1:]) for k, v in routing_state.items()}

            def group_body(x, xs):  # the pattern's blocks in order; statistics of its MoE blocks, each one's logits
                states, layers, rs = xs
                group_stats, group_max = [], []
                for j in range(len(fns)):
                    rs_j = None if rs is None or j not in moe_pos else {k: v[moe_pos.index(j)] for k, v in rs.items()}
                    x, s_j, _, m_j = run(fns[j], states[j], x, layers[j], rs_j)
                    group_max.append(m_j)
                    if s_j is not None:
                        group_stats.append(s_j)
                return x, (jax.tree.map(lambda *a: jnp.stack(a), *group_stats) if group_stats else None, group_max)

            layers = jnp.asarray(layout.groups, jnp.int32)  # [P, G]
            x, (group_stats, group_max) = jax.lax.scan(group_body, x, ([st for _, st in parts], list(layers),
                                                                       rs_groups))
            maxes.extend(zip(layout.groups, group_max))  # position j's [G, H] (None: Gated DeltaNet)
            if group_stats is not None:  # [G, m, ...] -> [G * m, ...]: layer order
                stats.append(jax.tree.map(lambda a: a.reshape(g * m, *a.shape[2:]), group_stats))
            moe_rows = g * m
        if layout.tail:
            for j, i in enumerate(layout.tail):
                rs = None
                if routing_state is not None and self.tail[j].is_moe:
                    rs = {k: v[moe_rows] for k, v in routing_state.items()}
                    moe_rows += 1
                graphdef, state = nnx.split(self.tail[j])
                x, s_i, _, m_i = run(_block_fn(graphdef, self.remat, drop_tokens, record_max=True), state, x, i, rs)
                maxes.append(((i,), None if m_i is None else jax.tree.map(lambda a: a[None], m_i)))
                if s_i is not None:
                    stats.append(jax.tree.map(lambda a: a[None], s_i))
        moe = RoutingSums.concatenate(stats) if stats else None
        return x, moe, _rows_in_layer_order(maxes)


def build_model(cfg: ExperimentConfig, vocab_size: int, *, seed: int | None = None) -> Transformer:
    """Creates a :class:`Transformer` with freshly initialised parameters (float32).

    Args:
      cfg: experiment config (``model`` and ``moe`` sections are used).
      vocab_size: V; must be >= the tokenizer's vocabulary.
      seed: initialisation seed; ``None`` = ``cfg.train.seed``.
    """
    vocab = cfg.model.vocab_size or vocab_size
    if vocab < vocab_size:
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer's {vocab_size} ids: the model cannot "
                         "embed its tokens; use the tokenizer the model was made for (data.tokenizer; in a run dir, its "
                         "files may have changed since), or a model.vocab_size of at least that")
    return Transformer(cfg, vocab, rngs=nnx.Rngs(cfg.train.seed if seed is None else seed))


def init_routing_state(cfg: ExperimentConfig) -> dict[str, jax.Array]:
    """Non-trainable routing state, one row per MoE layer: the aux-loss-free selection ``bias``
    (zeros) and the ``load_ema`` of each expert's share of assignments (uniform), float32 [L_moe, E].
    Empty when the model has no MoE layer. With multi-token prediction (``model.mtp_depth`` = D)
    the D MTP blocks are MoE layers too: rows L_moe .. L_moe + D - 1, after the main model's."""
    n = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    if n == 0:
        return {}
    n += cfg.model.mtp_depth
    e = cfg.moe.num_experts
    return {"bias": jnp.zeros((n, e), jnp.float32), "load_ema": jnp.full((n, e), 1.0 / e, jnp.float32)}
