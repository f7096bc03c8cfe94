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
    qkv = (m.num_heads + 2 * m.kv_heads) * m.head_dim
    attn = d * qkv + m.num_heads * m.head_dim * d
    attn += {"none": 0, "qkv": qkv, "all": qkv + d}[m.attention_bias]
    attn += {"none": 0, "per_head": 2 * m.head_dim, "full": (m.num_heads + m.kv_heads) * m.head_dim}[m.qk_norm]
    norms = 2 * d
    if m.attention == "mla":
        attn, mla_norms = _mla_params(m)
        norms += mla_norms
    n_moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    n_dense = m.num_layers - n_moe
    expert = 3 * d * f
    dense = 3 * d * m.dense_ff
    shared = 3 * d * e.shared_expert_d_ff + (d if e.shared_expert_d_ff and e.shared_expert_gate else 0)
    experts = n_moe * e.num_experts * expert
    layers_total = m.num_layers * (attn + norms) + n_moe * (d * e.num_experts + shared) + experts + n_dense * dense
    embed = v * d
    total = layers_total + embed + d + (0 if m.tie_embeddings else embed)  # + final norm
    active = (m.num_layers * attn + n_moe * (d * e.num_experts + e.top_k * expert + shared) + n_dense * dense
              + embed)
    return ParamCounts(total=total, active=active,
                       active_with_embedding=active + (0 if m.tie_embeddings else embed), experts=experts)


def _mla_params(m) -> tuple[int, int]:
    """(matmul weights, norm scales) of one MLA block (:class:`~moefast.model.transformer.MLAttention`)."""
    h, d, c, r = m.num_heads, m.d_model, m.kv_lora_rank, m.qk_rope_head_dim
    qk = h * (m.qk_nope_head_dim + r)
    q = d * m.q_lora_rank + m.q_lora_rank * qk if m.q_lora_rank else d * qk
    weights = q + d * (c + r) + c * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d
    return weights, c + (m.q_lora_rank or 0)


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
    if m.attention == "mla":  # scores over Hd_qk features, weighted values over Hv: 6 * L * H * (Hd_qk + Hv) * T
        return float(6 * n_active + 6 * m.num_layers * m.num_heads * sum(attention_widths(m)) * t)
    return float(6 * n_active + 12 * m.num_layers * m.num_heads * m.head_dim * t)
