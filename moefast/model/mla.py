"""Multi-head latent attention (MLA; DeepSeek-V2 and V3): the :class:`MLAttention` module.

Dimension letters: B batch, T tokens, S key length (cache), D d_model, H heads, C kv_lora_rank,
N qk_nope_head_dim, R qk_rope_head_dim, Hv v_head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moefast.kernels.lightning_indexer import lightning_indexer_scores
from moefast.kernels.sparse_attention import sparse_attention
from moefast.model.attention import attend, causal_attention, context_flash_attention
from moefast.model.norm import rms_norm
from moefast.model.positional import apply_rope
from moefast.parallel.context import context_size, gather_context
from moefast.model.lora import effective_weight, project
from moefast.parallel.mesh import on_own_rows
from moefast.parallel.precision import local_dense

__all__ = ["INDEXER_LOSS_BLOCK", "INDEXER_NORM_EPS", "INDEXER_QUERY_BLOCK", "MLA_NORM_EPS", "LightningIndexer", "MLAttention", "segment_mask"]


MLA_NORM_EPS = 1e-6
"""Epsilon of MLA's two RMSNorms (``q_a_layernorm``, ``kv_a_layernorm``): DeepSeek's reference code
and Hugging Face's build them with the default 1e-6 whatever ``rms_norm_eps`` is."""


INDEXER_QUERY_BLOCK = 256
"""Queries the lightning indexer scores at a time (rows whose length it divides; else the whole
row): float32 [B, Tb, S] scores a block (the reference's [B, Tb, Hi, S] logits), never the row's T x S."""

INDEXER_LOSS_BLOCK = 64
"""Queries the indexer's KL loss (:meth:`LightningIndexer.kl_loss`) takes at a time: the sparse
stage gathers each block's selected keys, [B, Tb, k, C + R] (151 MiB a row at DeepSeek-V3.2's
k = 2,048 and 64 queries), so its blocks are smaller than the selection's."""

INDEXER_NORM_EPS = 1e-6
"""Epsilon of the lightning indexer's key LayerNorm (transformers' ``DeepseekV32Indexer.k_norm``)."""


def segment_mask(segment_ids_bt: jax.Array) -> jax.Array:
    """bool [B, 1, T, T]: causal inside each packed document (the fused kernel's mask, from its ids)."""
    t = segment_ids_bt.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return ((segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]) & causal[None])[:, None]


class LightningIndexer(nnx.Module):
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2-Exp tech report, sec. 2.1, eq. 1;
    transformers' ``DeepseekV32Indexer``, whose parameter names these are, each ``nn.Linear``
    weight transposed): it scores every key for every query and keeps the ``topk`` best.

    Dimension letters: Hi = ``num_heads`` (``index_n_heads``), Di = ``head_dim``
    (``index_head_dim``), Q the MLA query latent (``q_lora_rank``), R = ``rope_dim``.

    * ``wq_b`` [Q, Hi·Di] (lora, heads): the indexer's queries from MLA's normalised query latent
      c^Q (``q_a_layernorm(q_a_proj(x))``, shared with the attention);
    * ``wk`` [D, Di] (embed, lora) and the LayerNorm ``k_norm`` (``scale``, ``bias`` [Di], eps 1e-6):
      one key per token shared by every indexer head;
    * ``weights_proj`` [D, Hi] (embed, heads): each head's weight per query, computed in float32
      (transformers keeps this module in float32).

    The first R features of queries and keys are rotated by the model's RoPE tables in the
    rotate-half (split) layout, as transformers' indexer does (its MLA's own RoPE is interleaved);
    the other Di - R pass. The score of key s for query t is
    ``sum_h w[t, h] · Hi^-0.5 · relu(q[t, h] · k[s] · Di^-0.5)`` in float32 (transformers computes the
    same product without the reference code's Hadamard rotation and FP8, which preserve it up to
    rounding). Keys the query may not see are excluded before the top-k; with k = min(topk, S),
    a query that sees fewer than k keys keeps all of them, as transformers' ``topk`` over its
    additively masked scores does.

    No gradient of the model's output reaches the indexer: its scores pass through
    ``jax.lax.stop_gradient`` (transformers computes them under ``torch.no_grad``) and a top-k
    selection has none anyway. It learns from its own loss, :meth:`kl_loss` (``train.indexer_stage``);
    without one (``"none"``) moefast's optimizer exempts it from weight decay, so training leaves it
    as imported.
    """

    def __init__(self, d_model: int, q_lora_rank: int, *, num_heads: int, head_dim: int, rope_dim: int, topk: int,
                 dtype, init_std: float, rngs: nnx.Rngs):
        self.num_heads, self.head_dim, self.rope_dim, self.topk, self.dtype = num_heads, head_dim, rope_dim, topk, dtype
        init = jax.nn.initializers.normal(init_std)
        self.wq_b = nnx.Param(init(rngs.params(), (q_lora_rank, num_heads * head_dim)), logical_axes=("lora", "heads"))
        self.wk = nnx.Param(init(rngs.params(), (d_model, head_dim)), logical_axes=("embed", "lora"))
        self.k_norm = nnx.LayerNorm(head_dim, epsilon=INDEXER_NORM_EPS, dtype=jnp.float32, param_dtype=jnp.float32,
                                    scale_metadata={"logical_axes": ("norm",)},
                                    bias_metadata={"logical_axes": ("norm",)}, rngs=rngs)
        self.weights_proj = nnx.Param(init(rngs.params(), (d_model, num_heads)), logical_axes=("embed", "heads"))

    def _rotate(self, x_bthd, rope):
        return x_bthd if rope is None else apply_rope(x_bthd, *rope)  # the first R features (rope's 2F = R)

    def keys(self, x_btd: jax.Array, rope) -> jax.Array:
        """The indexer's keys, float32 [B, T, Di] (normalised, the first R features rotated)."""
        k = self.k_norm(project(self, "wk", x_btd, self.dtype, ("embed", "lora")).astype(jnp.float32))
        return self._rotate(k[:, :, None], rope)[:, :, 0]

    def _queries(self, x_btd: jax.Array, q_lat_btq: jax.Array, rope) -> tuple[jax.Array, jax.Array]:
        """The indexer's queries [B, T, Hi, Di] (compute dtype, the first R features rotated) and
        each head's weight times Hi^-0.5, float32 [B, T, Hi]."""
        b, t, _ = x_btd.shape
        h, d = self.num_heads, self.head_dim
        q = self._rotate(project(self, "wq_b", q_lat_btq, self.dtype, ("lora", "heads")).reshape(b, t, h, d), rope)
        w = jnp.einsum("btd,dh->bth", x_btd.astype(jnp.float32), self.weights_proj[...].astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST) * h ** -0.5
        return q, w

    def _scores(self, q_bthd, w_bth, k, keys: str) -> jax.Array:
        """float32 index scores ``sum_h w · relu(q_h · k · Di^-0.5)`` (the reference's, differentiable;
        products in q's dtype, float32 sums) of the keys ``k``: shared ones
        [B, S, Di] (``keys="bsd"``, scores [B, T, S]) or each query's own [B, T, K, Di]
        (``keys="btsd"``, scores [B, T, K])."""
        logits = jnp.einsum(f"bthd,{keys}->bths", q_bthd, k.astype(q_bthd.dtype), precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * self.head_dim ** -0.5  # the keys in q's dtype
        return jnp.einsum("bth,bths->bts", w_bth, jax.nn.relu(logits), precision=jax.lax.Precision.HIGHEST)

    def top_keys(self, x_btd: jax.Array, q_lat_btq: jax.Array, rope, k_bsd: jax.Array, visible: jax.Array) -> jax.Array:
        """int32 [B, T, k], k = min(topk, S): the keys each query keeps, the indices of its
        min(topk, visible keys) best-scored keys among those it may see, -1 in the slots past its
        visible keys.

        Scored :data:`INDEXER_QUERY_BLOCK` queries at a time by
        :func:`moefast.kernels.lightning_indexer.lightning_indexer_scores` (the Pallas kernel when
        compiling for GPUs, each device on its own rows: float32 [B, Tb, S] scores a block, never the
        [B, Tb, Hi, S] logits; the reference elsewhere), the keys in the queries' dtype.

        Args:
          x_btd: [B, T, D] the layer's input. q_lat_btq: [B, T, Q] MLA's normalised query latent.
          rope: the queries' (cos, sin) float32 [B, T, 1, R/2], or None (nothing rotated).
          k_bsd: float32 [B, S, Di] the keys (:meth:`keys`; with a cache, the cached ones).
          visible: bool [B or 1, T, S], True where the query may see the key; or, for a training
            row (S = T), its int [B, T] segment ids: causal inside each document, the mask built a
            block at a time (no [T, S] mask in memory).
        """
        b, t, _ = x_btd.shape
        s = k_bsd.shape[1]
        q, w = self._queries(x_btd, q_lat_btq, rope)
        k = min(self.topk, s)
        scale = self.head_dim ** -0.5
        by_ids = visible.ndim == 2

        def choose(q, w, keys, visible):  # on one device's rows
            rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), q.shape[:2])

            def block(args):
                q, w, row, seen = args  # seen: [B, Tb] segment ids, or the block's bool mask rows
                scores = lightning_indexer_scores(q, w, keys, scale=scale)  # float32 [B, Tb, S]
                if by_ids:
                    seen = (seen[:, :, None] == visible[:, None, :]) & (row[:, :, None] >= jnp.arange(s)[None, None])
                top, idx = jax.lax.top_k(jnp.where(seen, scores, -jnp.inf), k)  # [B, Tb, k]
                return jnp.where(top > -jnp.inf, idx, -1)

            mask = visible if by_ids else jnp.broadcast_to(visible, q.shape[:2] + (s,))
            return _by_query_blocks(block, (q, w, rows, mask))

        keys = k_bsd.astype(q.dtype)
        if by_ids:  # training rows: each device on its own (the kernel is a Pallas call)
            return on_own_rows(choose, q, w, keys, visible, where="lightning indexer")
        return choose(q, w, keys, visible)

    def select(self, idx_btk: jax.Array, mask_bts: jax.Array) -> jax.Array:
        """bool [B, T, S]: :meth:`top_keys`'s ``idx_btk`` as a mask, a subset of ``mask_bts`` (the
        dense masked reference's form)."""
        s = mask_bts.shape[-1]
        chosen = jnp.put_along_axis(jnp.zeros(idx_btk.shape[:-1] + (s,), bool), jnp.maximum(idx_btk, 0),
                                    True, axis=-1, inplace=False)
        return chosen & mask_bts

    def kl_loss(self, x_btd: jax.Array, q_lat_btq: jax.Array, rope, attn_q_bthf: jax.Array, attn_k_bsf: jax.Array,
                scale: float, query_mask_bt: jax.Array, *, mask_bts: jax.Array | None = None,
                idx_btk: jax.Array | None = None) -> jax.Array:
        """The indexer's training loss (DeepSeek-V3.2-Exp tech report, sec. 2.1.1): summed over the
        queries ``query_mask_bt`` (bool [B, T]) keeps, ``KL(p_t || softmax(I_t))`` over a set of keys:
        every key the query may see (``mask_bts``, bool [B or 1, T, S]: the dense warm-up, eq. 3) or
        the keys it selected (``idx_btk`` int32 [B, T, k], -1 unused: the sparse stage, eq. 4).

        ``p_t`` is the layer's attention distribution over that set summed over its H heads and
        L1-normalised (so the heads' mean), from MLA's absorbed queries ``attn_q_bthf`` [B, T, H, F]
        and shared keys ``attn_k_bsf`` [B, S, F] (F = C + R) at ``scale``; it is a target: no
        gradient. ``I_t`` are the indexer's scores of the same keys from a detached ``x_btd`` and
        ``q_lat_btq`` (:meth:`top_keys`' arguments), so the gradient reaches the indexer's
        parameters only. Computed in blocks of :data:`INDEXER_LOSS_BLOCK` queries, each under
        ``jax.checkpoint``: float32 temporaries [B, Tb, H, S] (dense) or [B, Tb, k, F] (sparse) a
        block, recomputed in the backward pass (the reference; no kernel). Returns float32 [], nats.
        """
        sg = jax.lax.stop_gradient
        x_btd, q_lat_btq, attn_q_bthf, attn_k_bsf = (sg(a) for a in (x_btd, q_lat_btq, attn_q_bthf, attn_k_bsf))
        b, t, _ = x_btd.shape
        # [B, S, Di]: the same keys as the selection's, now differentiated, in the queries' dtype before any gather
        k_i = self.keys(x_btd, rope).astype(self.dtype)
        q_i, w = self._queries(x_btd, q_lat_btq, rope)
        gather = jax.vmap(lambda a, i: a[i])  # [B, S, F], [B, Tb, k] -> [B, Tb, k, F]

        def kl(logits_bths, scores_bts, valid_bts, qm_bt):  # sum over queries of KL(mean_h softmax || softmax)
            p = jnp.mean(jax.nn.softmax(jnp.where(valid_bts[:, :, None], logits_bths, -1e30), axis=-1), axis=2)
            log_q = jax.nn.log_softmax(jnp.where(valid_bts, scores_bts, -1e30), axis=-1)
            per = jnp.where(valid_bts, jax.scipy.special.xlogy(p, p) - p * log_q, 0.0)
            return jnp.sum(jnp.where(qm_bt[..., None], per, 0.0))

        hp = jax.lax.Precision.HIGHEST
        if idx_btk is None:
            mask_bts = jnp.broadcast_to(mask_bts, (b, t, attn_k_bsf.shape[1]))

            def block(args):
                q_i, w, q_a, mask, qm = args
                logits = jnp.einsum("bthf,bsf->bths", q_a, attn_k_bsf, precision=hp,
                                    preferred_element_type=jnp.float32) * scale
                return kl(logits, self._scores(q_i, w, k_i, "bsd"), mask, qm)

            parts = (q_i, w, attn_q_bthf, mask_bts, query_mask_bt)
        else:
            def block(args):
                q_i, w, q_a, idx, qm = args
                safe = jnp.maximum(idx, 0)
                logits = jnp.einsum("bthf,btkf->bthk", q_a, gather(attn_k_bsf, safe), precision=hp,
                                    preferred_element_type=jnp.float32) * scale  # keys in the compute dtype
                return kl(logits, self._scores(q_i, w, gather(k_i, safe), "btsd"), idx >= 0, qm)

            parts = (q_i, w, attn_q_bthf, idx_btk, query_mask_bt)
        return jnp.sum(_by_query_blocks(jax.checkpoint(block), parts, per_row=False, size=INDEXER_LOSS_BLOCK))


def _by_query_blocks(fn, args: tuple, per_row: bool = True, size: int | None = None) -> jax.Array:
    """``fn`` over blocks of ``size`` (default :data:`INDEXER_QUERY_BLOCK`) queries
    (``jax.lax.map``; the whole row when that does not divide T) of ``args``, arrays [B, T, ...]:
    with ``per_row`` its [B, Tb, ...] results joined back to [B, T, ...], else its per-block
    results stacked [T / Tb, ...]."""
    b, t = args[0].shape[:2]
    size = INDEXER_QUERY_BLOCK if size is None else size
    tb = size if t % size == 0 else t
    split = lambda a: jnp.moveaxis(a.reshape(b, t // tb, tb, *a.shape[2:]), 1, 0)  # noqa: E731
    out = jax.lax.map(fn, tuple(split(a) for a in args))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, *out.shape[3:]) if per_row else out


class MLAttention(nnx.Module):
    """Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, sec. 2.1, eqs. 9-19;
    DeepSeek-V3 uses it unchanged), causal, with the shared RoPE key of the decoupled rotary
    strategy (sec. 2.1.3).

    Dimension letters (besides the module's): C = ``kv_lora_rank`` (d_c), Q = ``q_lora_rank``
    (d_c'), N = ``qk_nope_head_dim``, R = ``qk_rope_head_dim`` (d_h^R), Hv = ``v_head_dim``.

    Parameters (Hugging Face DeepSeek-V3's names; each is the HF ``nn.Linear`` weight transposed,
    [in, out], the heads' columns head-major as HF's ``view(..., H, -1)``):

    * ``q_a_proj`` [D, Q] (embed, lora), ``q_a_layernorm`` scale [Q], ``q_b_proj`` [Q, H·(N+R)]
      (lora, heads): the low-rank query, eq. 12 with RMSNorm on c^Q; or, with ``q_lora_rank`` 0 /
      ``None``, ``q_proj`` [D, H·(N+R)] (embed, heads) (DeepSeek-V2-Lite).
    * ``kv_a_proj_with_mqa`` [D, C+R] (embed, lora): the compressed KV c^KV (eq. 9) and the shared
      RoPE key k^R before rotation (eq. 15); ``kv_a_layernorm`` scale [C] normalises c^KV.
    * ``kv_b_proj`` [C, H·(N+Hv)] (lora, heads): per head the no-RoPE key k^C (eq. 10) and the value
      (eq. 11).
    * ``o_proj`` [H·Hv, D] (heads, embed) (eq. 19).

    Each head's query is ``[q^C, RoPE(q^R)]`` and key ``[k^C, RoPE(k^R)]`` (eqs. 16-17; without
    RoPE, ``model.position_encoding=none``, ``[q^C, q^R]`` and ``[k^C, k^R]``: Kimi Linear); the logit
    scale is ``(N + R) ** -0.5 * softmax_multiplier`` (YaRN, :attr:`Yarn.softmax_multiplier`).
    Without a cache (training) keys and values are expanded per head and attended as H heads
    (:func:`causal_attention` / :func:`fused_attention`). With a cache (generation) only c^KV
    (normalised) and the rotated k^R are cached, [B, S, C] and [B, S, R], and ``kv_b_proj`` is
    absorbed into the query and the output (sec. 2.1.2): one shared key [c^KV, k^R] of C + R
    features and one shared value c^KV for all heads, the same function of the inputs.

    With ``index_topk`` (``model.index_topk``; DeepSeek-V3.2's sparse attention) an ``indexer``
    (:class:`LightningIndexer`) picks each query's keys, and the attention above runs over the mask
    narrowed to them: a dense masked attention (the reference path, on the blocked einsums; the
    fused flash kernel is never used, segment ids are turned into the bool mask). The cache then
    also holds the indexer's keys, ``"index_k"`` [B, S, Di]. Sequence slices and context
    parallelism are refused. ``indexer_stage`` (``train.indexer_stage``) says how the indexer
    learns: ``"dense_warmup"`` keeps the attention dense (no selection) and records the indexer's
    KL to it over every visible key, ``"sparse"`` its KL over the selected keys.
    """

    def __init__(self, d_model: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, softmax_multiplier: float = 1.0,
                 dtype, init_std: float, out_std: float, fp8: bool = False, index_topk: int | None = None,
                 index_n_heads: int = 64, index_head_dim: int = 128, indexer_stage: str = "none", rngs: nnx.Rngs):
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank or 0, kv_lora_rank
        if index_topk is not None and not self.q_lora_rank:
            raise ValueError("MLAttention: the DSA indexer (index_topk) reads the query latent: needs q_lora_rank >= 1")
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.dtype, self.fp8 = dtype, fp8  # fp8: model.precision == "fp8" (the projections)
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * softmax_multiplier
        init = jax.nn.initializers.normal(init_std)
        qk = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if self.q_lora_rank:
            self.q_a_proj = nnx.Param(init(rngs.params(), (d_model, self.q_lora_rank)), logical_axes=("embed", "lora"), fp8=self.fp8)
            self.q_a_layernorm = rms_norm(self.q_lora_rank, MLA_NORM_EPS, dtype, rngs)
            self.q_b_proj = nnx.Param(init(rngs.params(), (self.q_lora_rank, qk)), logical_axes=("lora", "heads"), fp8=self.fp8)
        else:
            self.q_proj = nnx.Param(init(rngs.params(), (d_model, qk)), logical_axes=("embed", "heads"), fp8=self.fp8)
        self.kv_a_proj_with_mqa = nnx.Param(init(rngs.params(), (d_model, kv_lora_rank + qk_rope_head_dim)),
                                            logical_axes=("embed", "lora"), fp8=self.fp8)
        self.kv_a_layernorm = rms_norm(kv_lora_rank, MLA_NORM_EPS, dtype, rngs)
        self.kv_b_proj = nnx.Param(init(rngs.params(), (kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))),
                                   logical_axes=("lora", "heads"), fp8=self.fp8)
        self.o_proj = nnx.Param(jax.nn.initializers.normal(out_std)(rngs.params(), (num_heads * v_head_dim, d_model)),
                                logical_axes=("heads", "embed"), fp8=self.fp8)
        self.sparse = index_topk is not None
        self.indexer_stage = indexer_stage if self.sparse else "none"  # train.indexer_stage
        if self.sparse:
            self.indexer = LightningIndexer(d_model, self.q_lora_rank, num_heads=index_n_heads,
                                            head_dim=index_head_dim, rope_dim=qk_rope_head_dim, topk=index_topk,
                                            dtype=dtype, init_std=init_std, rngs=rngs)

    def _absorbed(self, q_nope, q_rope, c_kv, k_rope):
        """MLA's absorbed form (DeepSeek-V2 sec. 2.1.2): each head's query [q^C W_UK, q^R]
        [B, T, H, C + R] and the one shared key [c^KV, k^R] [B, S, C + R] a token, in the compute
        dtype, and ``kv_b_proj`` as [C, H, N + Hv] (its last Hv columns W_UV up-project the latent
        output)."""
        c, h, n = self.kv_lora_rank, self.num_heads, self.nope
        w = effective_weight(self, "kv_b_proj").astype(self.dtype).reshape(c, h, n + self.v_head_dim)
        q_lat = jnp.einsum("bthn,chn->bthc", q_nope, w[..., :n], preferred_element_type=jnp.float32)
        q = jnp.concatenate([q_lat.astype(self.dtype), q_rope.astype(self.dtype)], axis=-1)
        k = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1).astype(self.dtype)
        return q, k, w

    def _sparse_attention(self, absorbed, c_kv, idx_btk):
        """DSA's attention over the selected keys in MLA's absorbed form
        (:func:`moefast.kernels.sparse_attention.sparse_attention`: the Pallas kernels when
        compiling for GPUs, the gather reference elsewhere): each head's query [q^C W_UK, q^R]
        [B, T, H, C + R] against one key [c^KV, k^R] and one value c^KV a token, the latent output
        up-projected by W_UV (DeepSeek-V2 sec. 2.1.2's absorption, as the decode path does). The
        same function as the masked reference up to rounding. Returns ``o_proj``'s output [B, T, D]
        and each head's largest logit over the selected keys, float32 [H] (not differentiated).
        ``absorbed``: :meth:`_absorbed`'s queries, keys and ``kv_b_proj``."""
        q, k, w = absorbed
        b, t, h, _ = q.shape
        n, hv = self.nope, self.v_head_dim
        # each device on its own rows: a Pallas call has no partitioning rule, and left to the
        # partitioner every device would gather the whole batch around it
        o_lat, max_bth = on_own_rows(lambda *a: sparse_attention(*a, scale=self.scale, return_max=True), q, k,
                                     c_kv.astype(self.dtype), idx_btk.astype(jnp.int32), where="sparse attention")
        o = jnp.einsum("bthc,chv->bthv", o_lat, w[..., n:], preferred_element_type=jnp.float32).astype(self.dtype)
        return (project(self, "o_proj", o.reshape(b, t, h * hv), self.dtype, ("heads", "embed"), fp8=self.fp8),
                jnp.max(max_bth, axis=(0, 1)))

    def _sparse(self, x_btd, q_lat, rope, q_nope, q_rope, c_kv, k_rope, mask_b1ts, cache, cache_index, kv_prefix,
                record_max, token_mask):
        """DSA's part of :meth:`__call__` (its arguments, the query latent and MLA's query and key
        parts): ``(the mask narrowed to the selected keys, the indexer keys [B, S, Di] (the cache's
        with one), the indexer's KL or None, None)``; in training with the fused kernels the last
        entry is :meth:`_sparse_attention`'s ``(output, largest logits)`` instead (the mask unused).
        The dense warm-up (``indexer_stage``) keeps the mask.

        Raises:
          ValueError: sequence slices or a context axis.
        """
        if kv_prefix is not None or isinstance(mask_b1ts, tuple) or context_size() > 1:
            raise ValueError("MLAttention with index_topk (sparse MLA) runs on whole rows only: no sequence "
                             "slices (model.sequence_slices) and no context parallelism (mesh.context)")
        fused = mask_b1ts.ndim == 2  # segment ids: attention_impl=flash
        visible = mask_b1ts if fused else mask_b1ts[:, 0]  # [B, T] ids, or bool [B or 1, T, S]
        index_k = self.indexer.keys(x_btd, rope)  # [B, T, Di]
        if cache is not None:
            index_k = jax.lax.dynamic_update_slice_in_dim(cache["index_k"], index_k.astype(cache["index_k"].dtype),
                                                          cache_index, axis=1)
        learn = record_max and cache is None and self.indexer_stage != "none"
        # one absorbed query and key for the kernel and the loss: the 671B step at 4k rows fits with
        # 0.23 GiB less than with two; at 32k rows it holds 20 GiB more (docs/perf.md, "DeepSeek Sparse Attention")
        absorbed = self._absorbed(q_nope, q_rope, c_kv, k_rope) if cache is None and (fused or learn) else None
        if learn:
            q_abs, k_abs, _ = absorbed
            query_mask = jnp.ones(x_btd.shape[:2], bool) if token_mask is None else token_mask
            kl = functools.partial(self.indexer.kl_loss, x_btd, q_lat, rope, q_abs, k_abs, self.scale, query_mask)
        if self.indexer_stage == "dense_warmup":  # dense attention; the indexer learns it over every visible key
            indexer_kl = kl(mask_bts=segment_mask(visible)[:, 0] if fused else visible) if learn else None
        else:
            idx = self.indexer.top_keys(x_btd, q_lat, rope, index_k, visible)
            indexer_kl = kl(idx_btk=idx) if learn else None
            if cache is None and fused:
                return mask_b1ts, index_k, indexer_kl, self._sparse_attention(absorbed, c_kv, idx)
            mask_b1ts = self.indexer.select(idx, visible)[:, None]
        return mask_b1ts, index_k, indexer_kl, None

    def __call__(self, x_btd, rope, mask_b1ts, cache: dict | None, cache_index, kv_prefix: tuple | None = None, *,
                 record_max: bool = False, token_mask=None):
        """Arguments as :meth:`Attention.__call__` (``rope``: float32 [B, T, 1, R/2] cos and sin, or
        ``None`` with ``model.position_encoding=none``: the R features stay unrotated, Kimi Linear's NoPE);
        ``cache``: ``{"kv": [B, S, C], "k_rope": [B, S, R]}`` (:func:`init_cache`) or ``None``.
        Returns ``([B, T, D] in the compute dtype, the updated cache or None)``; with a
        ``kv_prefix`` (a sequence slice), the per-head keys [B, S, H, N + R] and values [B, S, H,
        Hv] of the prefix and this slice in place of the cache. With ``record_max`` a third
        result: each head's largest pre-softmax logit ``[q^C, q^R]·[k^C, k^R] · scale`` of these
        queries, float32 [H], not differentiated (QK-clip), or ``None`` with a cache; while the
        indexer trains (``indexer_stage`` not ``"none"``, no cache) a fourth: its KL loss summed
        over the queries ``token_mask`` (bool [B, T], the real tokens) keeps, float32 []
        (:meth:`LightningIndexer.kl_loss`)."""
        b, t, _ = x_btd.shape
        h, n, r, c, hv = self.num_heads, self.nope, self.rope, self.kv_lora_rank, self.v_head_dim
        if self.q_lora_rank:
            q_lat = self.q_a_layernorm(project(self, "q_a_proj", x_btd, self.dtype, ("embed", "lora"),
                                               fp8=self.fp8)).astype(self.dtype)
            q = project(self, "q_b_proj", q_lat, self.dtype, ("lora", "heads"), fp8=self.fp8)
        else:
            q = project(self, "q_proj", x_btd, self.dtype, ("embed", "heads"), fp8=self.fp8)
        q = q.reshape(b, t, h, n + r)
        q_nope, q_rope = q[..., :n], (q[..., n:] if rope is None else apply_rope(q[..., n:], *rope))
        kv_a = project(self, "kv_a_proj_with_mqa", x_btd, self.dtype, ("embed", "lora"), fp8=self.fp8)
        c_kv = self.kv_a_layernorm(kv_a[..., :c]).astype(self.dtype)  # [B, T, C]
        k_rope = kv_a[..., c:] if rope is None else apply_rope(kv_a[..., None, c:], *rope)[:, :, 0]  # [B, T, R], shared
        index_k = indexer_kl = None
        if self.sparse:  # DSA: the indexer's keys (the dense masked reference), or the fused sparse kernel
            mask_b1ts, index_k, indexer_kl, fused = self._sparse(x_btd, q_lat, rope, q_nope, q_rope, c_kv, k_rope,
                                                                 mask_b1ts, cache, cache_index, kv_prefix, record_max,
                                                                 token_mask)
            if fused is not None:  # training with the fused kernels: MLA's absorbed form over the selection
                out, max_h = fused
                return _with_records((out, None), max_h, indexer_kl) if record_max else (out, None)
        if cache is None and kv_prefix is None and context_size() > 1 and not isinstance(mask_b1ts, tuple) \
                and mask_b1ts.ndim == 2:  # the fused kernel on a context axis: each device gathers the row's
            # latent and RoPE key (C + R features a token, not H (N + R + Hv)) and up-projects them itself
            def make_kv(c_kv, k_rope, w):
                kv = local_dense(c_kv, w, self.dtype, self.fp8).reshape(*c_kv.shape[:2], h, n + hv)
                k = jnp.concatenate([kv[..., :n], jnp.broadcast_to(k_rope[:, :, None], (*kv.shape[:3], r))], axis=-1)
                return k, kv[..., n:]

            o = context_flash_attention(jnp.concatenate([q_nope, q_rope], axis=-1), (c_kv, k_rope), mask_b1ts,
                                        make_kv=make_kv, weights=(effective_weight(self, "kv_b_proj"),),
                                        scale=self.scale, return_max=record_max)
            new_cache = None
        elif cache is None:
            if not kv_prefix:  # the blocked einsums on a context axis: the row's latent and RoPE key gathered
                c_kv, k_rope = gather_context(c_kv), gather_context(k_rope)
            kv = project(self, "kv_b_proj", c_kv, self.dtype, ("lora", "heads"), fp8=self.fp8).reshape(b, t, h, n + hv)
            k = jnp.concatenate([kv[..., :n], jnp.broadcast_to(k_rope[:, :, None], (b, t, h, r))], axis=-1)
            q, v = jnp.concatenate([q_nope, q_rope], axis=-1), kv[..., n:]
            if kv_prefix:
                k, v = (jnp.concatenate([p, a], axis=1) for p, a in zip(kv_prefix, (k, v)))
            o = attend(q, k, v, mask_b1ts, scale=self.scale, return_max=record_max)
            new_cache = (k, v) if kv_prefix is not None else None
        else:
            c_kv = jax.lax.dynamic_update_slice_in_dim(cache["kv"], c_kv.astype(cache["kv"].dtype), cache_index, axis=1)
            k_rope = jax.lax.dynamic_update_slice_in_dim(cache["k_rope"], k_rope.astype(cache["k_rope"].dtype),
                                                         cache_index, axis=1)
            new_cache = {"kv": c_kv, "k_rope": k_rope, **({"index_k": index_k} if self.sparse else {})}
            w = effective_weight(self, "kv_b_proj").astype(self.dtype).reshape(c, h, n + hv)
            q_lat = jnp.einsum("bthn,chn->bthc", q_nope, w[..., :n], preferred_element_type=jnp.float32)
            q = jnp.concatenate([q_lat.astype(self.dtype), q_rope], axis=-1)  # [B, T, H, C + R]
            k = jnp.concatenate([c_kv, k_rope], axis=-1).astype(self.dtype)[:, :, None]  # [B, S, 1, C + R]
            o_lat = causal_attention(q, k, c_kv.astype(self.dtype)[:, :, None], mask_b1ts, causal=False,
                                     scale=self.scale)  # [B, T, H, C]
            o = jnp.einsum("bthc,chv->bthv", o_lat, w[..., n:], preferred_element_type=jnp.float32).astype(self.dtype)
        o, max_h = o if record_max and cache is None else (o, None)
        out = (project(self, "o_proj", o.reshape(b, t, h * hv), self.dtype, ("heads", "embed"), fp8=self.fp8),
               new_cache)
        return _with_records(out, max_h, indexer_kl) if record_max else out


def _with_records(out: tuple, max_h, indexer_kl) -> tuple:
    """``(output, cache)`` and what :meth:`MLAttention.__call__` records: the largest logits, then
    the indexer's loss when it has one."""
    return (*out, max_h) if indexer_kl is None else (*out, max_h, indexer_kl)
