"""Parameter counts and model FLOPs per token of a config (the numerator of MFU).

Dimension letters: D d_model, H query heads, G key/value heads, Hd head_dim, F d_ff, E experts,
K top_k, V vocab, L layers (L_moe of them MoE), T sequence length.

The convention is PaLM's (Chowdhery et al. 2022, appendix B): training FLOPs per token are

    6 * N_active + 12 * L * H * Hd * T

* ``6 * N_active``: every weight a token's computation multiplies by costs 2 FLOPs (multiply and
  add) in the forward pass and 4 in the backward (gradients of its input and of the weight).
  ``N_active`` counts the weights of the matmuls one token goes through: the attention projections
  (q, k, v and out: ``D * (H + 2G) * Hd + H * Hd * D`` per layer), the router (``D * E``) and
  ``top_k`` SwiGLU experts (``K * 3 * D * F``) of each MoE layer (with ``model.attention=mla`` the
  attention projections are MLA's: ``q_a_proj``/``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``,
  ``kv_b_proj`` and ``o_proj``), the dense SwiGLU (``3 * D * F``)
  of each dense layer, and the LM head (``D * V``, the tied embedding matrix when
  ``model.tie_embeddings``). The input embedding lookup is a gather (no FLOPs), so an untied input
  embedding matrix is not counted; nor are the RMSNorm scales (no matmul).
* ``12 * L * H * Hd * T``: the attention scores ``Q K^T`` and the weighted values ``P V``, 2 * 2 * T
  * H * Hd FLOPs per token and layer forward, times 3 for training. Like PaLM this counts the full
  T x T score matrix, although a causal model needs only its lower triangle (moefast's block-causal
  attention skips most of the rest), so it slightly over-credits short blocks and under-credits
  nothing. With MLA the term is ``6 * L * H * (Hd_qk + Hv) * T``, Hd_qk = ``qk_nope_head_dim +
  qk_rope_head_dim`` and Hv = ``v_head_dim`` (the training path's expanded heads).

DeepSeek Sparse Attention (``model.index_topk`` = k; DeepSeek-V3.2-Exp tech report, sec. 2.1):
each query attends to min(T, k) keys, so T -> min(T, k) in MLA's attention term, plus the
lightning indexer's scores of every key, ``2 * index_n_heads * index_head_dim * T`` per token and
layer, forward only (no gradient reaches it from the model's loss). Its KL loss
(``train.indexer_stage``) adds, per token, layer and key of the set it covers, the attention's
logits again (``2 * H * Hd_qk``, its target) and the indexer's scores forward and backward
(``3 * 2 * index_n_heads * index_head_dim``); in the dense warm-up over all T keys, on top of the
dense model's forward pass only (``2 * N_active`` and a third of the attention term: nothing but
the indexers is differentiated), in the sparse stage over min(T, k).

Full-attention layers of a shape of their own (``model.global_head_dim``, ``num_global_kv_heads``;
``attention_k_eq_v``: no value projection) count at their own Hd and G in both terms (Gemma 4).

Gated DeltaNet layers (``model.layer_types``; :mod:`moefast.model.gated_deltanet`) replace the
attention projections by their own (``in_proj`` ``D * (C + 2 * Hv * V + 2 * Hv)``, the depthwise
convolution's ``W * C`` taps, ``out`` ``Hv * V * D``; C = ``2 * Hk * K + Hv * V``) and the attention
term by the chunked gated delta rule's work per token and value head, forward
``6 * K * V + c * (5 * K + 3 * V)`` at chunk c = 64 (reading and writing the K x V state: 3 products;
the chunk's key-key and query-key products, the unit-triangular solve for the keys and values,
and the intra-chunk weighted values: Yang et al. 2024, arXiv:2412.06464, sec. 3.3, the WY/UT form),
times 3 for training; it does not grow with T.

Multi-token prediction (``model.mtp_depth`` = D; DeepSeek-V3, arXiv 2412.19437, sec. 2.2): each
module adds its projection ``M_k`` (``2 * D * D``), one block (attention, and the router and
``top_k`` experts of an MoE block or the dense SwiGLU) and one more pass through the shared LM head
to ``N_active``, and one more layer to the attention term (every module runs over all T positions).
Its embedding lookups are gathers; its three RMSNorm scales count in ``total`` only.

This is *model* FLOPs: the work of exact top-k routing, whatever the implementation does. Capacity
padding (``capacity_factor`` > 1 computes empty slots), rematerialisation and the optimizer are not
counted, so MFU is lower when they cost time, as it should be.
"""

from __future__ import annotations

import dataclasses

from moefast.config import ExperimentConfig

__all__ = ["ParamCounts", "attention_widths", "model_flops_per_token", "param_counts"]


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameters of a config, by where they are (counts of scalars, not bytes).

    Attributes:
      total: every parameter of the model (embeddings, head, norms, all experts).
      active: the weights one token multiplies by (the ``N_active`` of :mod:`moefast.model.flops`):
        attention projections, routers, ``top_k`` experts per MoE layer, dense feed-forwards, LM head.
      active_with_embedding: ``active`` plus the input embedding matrix when it is untied (the way
        model cards count "active parameters", e.g. Mixtral 8x7B's 12.9B).
      experts: parameters of all experts of all MoE layers.
    """

    total: int
    active: int
    active_with_embedding: int
    experts: int


def param_counts(cfg: ExperimentConfig, vocab_size: int | None = None) -> ParamCounts:
    """Counts the parameters of ``cfg``'s model analytically (no arrays are built).

    Args:
      cfg: the experiment (``model`` and ``moe`` sections).
      vocab_size: V when ``model.vocab_size`` is null (the tokenizer's size).

    Raises:
      ValueError: neither ``model.vocab_size`` nor ``vocab_size`` is given.
    """
    m, e = cfg.model, cfg.moe
    v = m.vocab_size or vocab_size
    if not v:
        raise ValueError("model.vocab_size is null: pass vocab_size (the tokenizer's vocabulary size)")
    d, f = m.d_model, m.d_ff
    # a logit per head (sinks), not multiplied by a token: in the total only
    attn_other = m.num_heads if m.attention_sinks else 0
    # each sublayer's pre-norm (and sandwich norm), a block's layer scalar
    norm_ffn = d + (d if m.sandwich_norm else 0)
    norm_mixer, scalar = norm_ffn, (1 if m.layer_scalar else 0)
    if m.attention == "mla":
        attn, mla_norms = _mla_params(m)
        norm_mixer += mla_norms
        attn_at = lambda i: attn  # noqa: E731
    else:
        attn_at = lambda i: _gqa_params(m, i)  # noqa: E731
        attn = attn_at(m.num_layers)  # a full-attention layer's (the MTP blocks')
    norms = norm_mixer + norm_ffn + scalar  # a whole block's
    mixers = [i for i in range(m.num_layers) if not m.is_ffn_sublayer(i)]  # all but Nemotron-H's FFNs
    n_linear = sum(m.layer_type(i) == "linear_attention" for i in mixers)
    attn_layers = sum(attn_at(i) for i in mixers if m.layer_type(i) != "linear_attention")
    linear_weights, linear_other = _linear_params(m)
    n_moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    n_dense = sum(k == "mlp" for k in m.layer_types) if m.sublayers else m.num_layers - n_moe
    n_ffn = n_moe + n_dense
    layer_norms = len(mixers) * norm_mixer + n_ffn * norm_ffn + m.num_layers * scalar
    up = 2 if e.gated else 1  # a fused gate | up, or (relu2) the up projection alone
    de = e.latent_size or d  # the experts' width (moe.latent_size)
    expert = (up + 1) * de * f + ((up * f + de) if e.expert_bias else 0)
    latent = 2 * d * de if e.latent_size else 0  # fc1_latent_proj, fc2_latent_proj: every token, once a layer
    router = d * e.num_experts + (e.num_experts if e.router_bias else 0) + (e.num_experts if e.per_expert_scale else 0)
    dense = (2 if m.dense_activation == "relu2" else 3) * d * m.dense_ff
    # every token's weights in an MoE layer besides the router and its experts: the shared expert, the latent projections
    shared = (up + 1) * d * e.shared_expert_d_ff + (d if e.shared_expert_d_ff and e.shared_expert_gate else 0) + latent
    norms_moe = 4 * d if e.branch_norms else 0  # not multiplied by a token's features: in the total only
    experts = n_moe * e.num_experts * expert
    n_full = len(mixers) - n_linear
    mixers_total = attn_layers + n_full * attn_other + n_linear * (linear_weights + linear_other)
    layers_total = (mixers_total + layer_norms + n_moe * (router + shared + norms_moe) + experts + n_dense * dense)
    embed = v * d
    total = layers_total + embed + d + (0 if m.tie_embeddings else embed)  # + final norm
    active = (attn_layers + n_linear * linear_weights + n_moe * (router + e.top_k * expert + shared)
              + n_dense * dense + embed)
    if m.mtp_depth:  # DeepSeek-V3 sec. 2.2: M_k, one block, three norms; the head is shared (active once more)
        if n_moe:
            block_total = attn + attn_other + norms + router + shared + norms_moe + e.num_experts * expert
            block_active = attn + router + e.top_k * expert + shared
            experts += m.mtp_depth * e.num_experts * expert
        else:
            block_total, block_active = attn + attn_other + norms + dense, attn + dense
        total += m.mtp_depth * (2 * d * d + 3 * d + block_total)
        active += m.mtp_depth * (2 * d * d + block_active + embed)
    return ParamCounts(total=total, active=active,
                       active_with_embedding=active + (0 if m.tie_embeddings else embed), experts=experts)


def _gqa_params(m, layer: int) -> int:
    """Weights of block ``layer``'s GQA attention multiplied by each token's features (its own
    head shape, :meth:`~moefast.config.ModelConfig.attention_shape`; no value projection with
    ``attention_k_eq_v`` on a full layer), with their biases and q/k norm scales."""
    d, h = m.d_model, m.num_heads
    g, hd = m.attention_shape(layer)
    kv = 1 if m.attention_k_eq_v and m.layer_type(layer) == "full_attention" else 2
    qkv = (h + kv * g) * hd
    attn = d * qkv + h * hd * d
    attn += {"none": 0, "qkv": qkv, "all": qkv + d}[m.attention_bias]
    attn += {"none": 0, "per_head": 2 * hd, "full": (h + g) * hd}[m.qk_norm]
    if m.attention_output_gate:
        attn += d * h * hd
    return attn


def _linear_params(m) -> tuple[int, int]:
    """(weights a token multiplies by: projections and conv taps; other parameters: A_log, dt_bias,
    the output norm) of one Gated DeltaNet block, or of one KDA or Mamba-2 block
    (``linear_attention_kind``)."""
    c = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
    hv, vd = m.linear_num_value_heads, m.linear_value_head_dim
    if m.linear_attention_kind == "mamba2":  # in_proj (z | xBC | dt), conv taps, out; conv bias, dt_bias, A_log, D, norm
        weights = m.d_model * (hv * vd + c + hv) + m.linear_conv_kernel_dim * c + hv * vd * m.d_model
        return weights, c + 3 * hv + hv * vd
    if m.linear_attention_kind == "kda":  # qkv, conv, b, the forget and output gates' factors, out
        hk = hv * vd
        weights = m.d_model * (c + hv + 2 * vd + hk) + 2 * vd * hk + m.linear_conv_kernel_dim * c
        return weights, hk + hv + vd
    weights = m.d_model * (c + hv * vd + 2 * hv) + m.linear_conv_kernel_dim * c + hv * vd * m.d_model
    return weights, 2 * hv + vd


DELTA_RULE_CHUNK = 64  # the chunk of the gated delta rule's chunked form, for its FLOP count


def _delta_rule_flops(m) -> int:
    """Forward FLOPs per token of one Gated DeltaNet layer's recurrence (module docstring); of a
    Mamba-2 layer's SSD scan in 128-token chunks Q: ``2 (G Q N + H Q P + 2 H P N)`` (the chunk's
    C B^T, its weighted inputs, the states in and out: :func:`moefast.kernels.mamba2.ssd_flops`)."""
    if m.linear_attention_kind == "mamba2":
        g, n, h, p, q = m.linear_num_key_heads, m.linear_key_head_dim, m.linear_num_value_heads, \
            m.linear_value_head_dim, 128
        return 2 * (g * q * n + h * q * p + 2 * h * p * n)
    k, v, c = m.linear_key_head_dim, m.linear_value_head_dim, DELTA_RULE_CHUNK
    return m.linear_num_value_heads * (6 * k * v + c * (5 * k + 3 * v))


def _mla_params(m) -> tuple[int, int]:
    """(matmul weights, norm scales) of one MLA block (:class:`~moefast.model.transformer.MLAttention`)."""
    h, d, c, r = m.num_heads, m.d_model, m.kv_lora_rank, m.qk_rope_head_dim
    qk = h * (m.qk_nope_head_dim + r)
    q = d * m.q_lora_rank + m.q_lora_rank * qk if m.q_lora_rank else d * qk
    weights = q + d * (c + r) + c * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d
    norms = c + (m.q_lora_rank or 0)
    if m.index_topk is not None:  # DSA's lightning indexer: wq_b, wk, weights_proj; k_norm's scale and bias
        hi, di = m.index_n_heads, m.index_head_dim
        weights += m.q_lora_rank * hi * di + d * di + d * hi
        norms += 2 * di
    return weights, norms


def attention_widths(model_cfg) -> tuple[int, int]:
    """Per-head widths ``(query/key, value)`` of the attention scores and weighted values: ``(Hd, Hd)``
    for GQA, ``(qk_nope_head_dim + qk_rope_head_dim, v_head_dim)`` for MLA (its training path
    attends with expanded per-head keys and values)."""
    m = model_cfg
    if m.attention == "mla":
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return m.head_dim, m.head_dim


def model_flops_per_token(cfg: ExperimentConfig, vocab_size: int | None = None, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): ``6 * N_active + 12 * L * H * Hd * T``
    (PaLM, Chowdhery et al. 2022, appendix B; see the module docstring for what is counted).

    Args:
      cfg: the experiment.
      vocab_size: V when ``model.vocab_size`` is null.
      seq_len: T; ``None`` = ``data.seq_len``.

    Returns:
      FLOPs per trained token (a float; multiply by tokens/s for model FLOP/s).
    """
    m = cfg.model
    t = cfg.data.seq_len if seq_len is None else seq_len
    n_active = param_counts(cfg, vocab_size).active
    n_linear = sum(m.layer_type(i) == "linear_attention" for i in range(m.num_layers))
    linear = 3 * n_linear * _delta_rule_flops(m)
    n_ffn = sum(m.is_ffn_sublayer(i) for i in range(m.num_layers))  # Nemotron-H's feed-forward sublayers
    layers = m.num_layers - n_linear - n_ffn + m.mtp_depth  # attention layers; each MTP module has one more
    if m.attention == "mla":  # scores over Hd_qk features, weighted values over Hv: 6 * L * H * (Hd_qk + Hv) * T
        heads, widths = m.num_heads, sum(attention_widths(m))
        if m.index_topk is None:
            return float(6 * n_active + 6 * layers * heads * widths * t + linear)
        index, stage = 2 * m.index_n_heads * m.index_head_dim, cfg.train.indexer_stage
        qk = 2 * heads * attention_widths(m)[0]  # the KL's target: the attention's logits again
        if stage == "dense_warmup":  # the dense model forward; the indexers' KL over all T keys, forward and backward
            return float(2 * n_active + layers * (2 * heads * widths * t + (qk + 3 * index) * t) + linear / 3)
        # DSA: each query attends to min(T, k) keys; its indexer scores all T, forward only
        keys = min(t, m.index_topk)
        kl = (qk + 3 * index) * keys if stage == "sparse" else 0  # the KL over the selected keys
        return float(6 * n_active + layers * (6 * heads * widths * keys + index * t + kl) + linear)
    # a sliding-window layer's query sees at most W keys: T -> min(T, W) in its term; each layer at its own Hd
    n_sliding = sum(m.layer_type(i) == "sliding_attention" for i in range(m.num_layers))
    width_keys = ((layers - n_sliding) * m.full_head_dim * t
                  + n_sliding * m.head_dim * min(t, m.sliding_window or t))
    return float(6 * n_active + 12 * m.num_heads * width_keys + linear)
