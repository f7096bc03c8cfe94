"""The Hugging Face model families moefast reads and writes, one :class:`FamilySpec` each.

Everything that differs between families lives here: the ``model_type`` and architecture class,
the ``config.json`` keys that vary (and the values transformers assumes when they are absent), which
layers are MoE, and the table of HF tensor names with the transform that turns each into a moefast
parameter. :mod:`moefast.interop.hf` is the generic engine (reading safetensors into shardings,
shape checks, writing) and never names a family.

To add a family:

1. Write one ``FamilySpec(...)`` below and add it to :data:`REGISTRY` under its ``model_type``.
   Start from the closest existing entry: reuse the tensor tables (``_ATTENTION`` or ``_MLA``,
   ``_DENSE_MLP``, ``_moe_tables(...)``, ``_GLOBAL``) and change only the names or keys that differ.
   Routing keys (``scoring_func``, ``topk_method``, ``n_group``, ``routed_scaling_factor``, the
   selection bias) are one :class:`Router`; shared experts one :class:`SharedExpert`; a family that
   is another's architecture under its own ``model_type`` is a ``dataclasses.replace`` of it
   (Kimi K2, GLM-4.7-Flash). Hybrid families (Gated DeltaNet and full attention per
   ``layer_types``: Qwen3-Next, Qwen3.5-MoE) add a :class:`LayerTypes` and a ``linear_tensors`` table
   for their linear-attention layers; a family whose layers are single sublayers (Nemotron-H: a
   mixer or a feed-forward each, per ``layers_block_type``) uses :class:`SublayerPattern` and
   ``LayerTypes(kinds=...)``; a vision-language checkpoint whose language model moefast reads
   names its ``text_config_key``, the prefix of its tensors (``_prefixed``) and the parts it skips.
2. Only if one of its tensors is not a transpose, a concatenation or an expert stack of HF tensors,
   write a new :class:`Transform` subclass in :mod:`moefast.interop.transforms` (``hf_shapes``, ``read``, ``write``, exact inverses; a
   row that needs the model's head layout gives a function of the config that builds it, and
   :class:`RowsTransposed` already reorders or picks rows, writing a tensor that several parameters
   share as :class:`Part` s);
   only if its config.json places MoE layers another way, a layer-pattern class like
   :class:`MlpOnlyLayers` or :class:`FirstKDense` (``moe_layers``, ``to_hf``, ``problem``) in
   :mod:`moefast.interop.family_spec`, where :class:`FamilySpec` documents every field.
3. Add the family to ``tests/interop/test_hf.py``'s tiny transformers models: logits, chosen experts
   and the exact round trip are then checked like the others'.

When several families represent a model, :func:`moefast.interop.hf.hf_family` picks the first in
:data:`REGISTRY` order.

Dimension letters: D d_model, H query heads, G key/value heads, Hd head_dim, F d_ff (of the routed
experts), E experts; MLA: Q q_lora_rank, C kv_lora_rank, N qk_nope_head_dim, R qk_rope_head_dim,
Hv v_head_dim. Gated DeltaNet (as :mod:`moefast.model.gated_deltanet`): Hk key heads, Hv value
heads (r = Hv / Hk per key head), K and V their widths, W the conv width, C = 2·Hk·K + Hv·V conv
channels. moefast's linear weights are [in, out]; HF's are [out, in].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from moefast.config import ModelConfig
# the engine's vocabulary, importable from here as before the split
from moefast.interop.family_keys import Gemma4Keys, KimiLinearKeys
from moefast.interop.family_nemotron import NEMOTRON_H
from moefast.interop.family_spec import (LINEAR_KEYS, AllMoE, BiasKey, FamilySpec, FirstKDense,  # noqa: F401
                                         LayerTypes, MlpLayerTypes, MlpOnlyLayers, Router, SharedExpert,
                                         SublayerPattern)
from moefast.interop.transforms import (CONCAT, CONCAT_T, CONV1D, FUSED_EXPERTS, IDENTITY, PER_EXPERT,  # noqa: F401
                                        TRANSPOSED, Concat, ConcatTransposed, Conv1dTaps, ExpertStack, FusedExperts,
                                        Identity, InterleavedGateUp, Part, PerExpert, RowsTransposed, SubPath, Tensor,
                                        Transform, Transposed, UnitAxes, _t, qkv_sizes)

__all__ = ["LINEAR_KEYS", "REGISTRY", "AllMoE", "BiasKey", "FamilySpec", "FirstKDense", "LayerTypes", "MlpLayerTypes",
           "MlpOnlyLayers", "Part", "Router", "RowsTransposed", "SharedExpert", "SublayerPattern", "Tensor",
           "Transform"]

# ---------------------------------------------------------------------------------- tensor tables
_L = "model.layers.{i}."
_A = _L + "self_attn."
_ATTENTION = MappingProxyType({
    ("attn_norm", "scale"): _t(IDENTITY, _L + "input_layernorm.weight"),
    ("ffn_norm", "scale"): _t(IDENTITY, _L + "post_attention_layernorm.weight"),
    ("attn", "qkv"): _t(CONCAT_T, *(_A + f"{x}_proj.weight" for x in "qkv"), split=qkv_sizes),
    ("attn", "out"): _t(TRANSPOSED, _A + "o_proj.weight"),
    ("attn", "qkv_bias"): _t(CONCAT, *(_A + f"{x}_proj.bias" for x in "qkv"), split=qkv_sizes),
    ("attn", "out_bias"): _t(IDENTITY, _A + "o_proj.bias"),
    ("attn", "q_norm", "scale"): _t(IDENTITY, _A + "q_norm.weight"),
    ("attn", "k_norm", "scale"): _t(IDENTITY, _A + "k_norm.weight"),
})
_MLA = MappingProxyType({
    ("attn_norm", "scale"): _ATTENTION[("attn_norm", "scale")],
    ("ffn_norm", "scale"): _ATTENTION[("ffn_norm", "scale")],
    **{("attn", x): _t(TRANSPOSED, _A + f"{x}.weight")
       for x in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")},
    **{("attn", x, "scale"): _t(IDENTITY, _A + f"{x}.weight") for x in ("q_a_layernorm", "kv_a_layernorm")},
})
"""MLA attention (:class:`moefast.model.transformer.MLAttention`, whose parameters carry HF
DeepSeek-V3's names): q_a_proj [D, Q], q_a_layernorm [Q], q_b_proj [Q, H·(N+R)] or q_proj
[D, H·(N+R)], kv_a_proj_with_mqa [D, C+R], kv_a_layernorm [C], kv_b_proj [C, H·(N+Hv)], o_proj
[H·Hv, D], each HF weight transposed."""


def _rope_columns(heads: int, block: int, offset: int, rope: int) -> np.ndarray:
    """Column permutation of a [..., heads·block] weight whose columns ``offset : offset + rope``
    of each head's block are RoPE features stored as interleaved pairs: moefast's split-half order
    (:func:`moefast.model.positional.rope_deinterleave_permutation`), the other columns in place."""
    from moefast.model.positional import rope_deinterleave_permutation

    perm = np.arange(heads * block)
    for h in range(heads):
        at = h * block + offset
        perm[at:at + rope] = at + rope_deinterleave_permutation(rope)
    return perm


def _mla_query_rope(m: ModelConfig) -> np.ndarray:
    return _rope_columns(m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim)


def _mla_key_rope(m: ModelConfig) -> np.ndarray:
    return _rope_columns(1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank, m.qk_rope_head_dim)


_MTP = MappingProxyType({
    ("enorm", "scale"): _t(IDENTITY, _L + "enorm.weight"),
    ("hnorm", "scale"): _t(IDENTITY, _L + "hnorm.weight"),
    ("eh_proj",): _t(TRANSPOSED, _L + "eh_proj.weight"),
    ("head_norm", "scale"): _t(IDENTITY, _L + "shared_head.norm.weight"),
})
"""A multi-token-prediction layer's own tensors (DeepSeek-V3 and GLM-4.5 checkpoints, vLLM's and
transformers' ``MtpLayer`` names): enorm [D], hnorm [D], eh_proj [2D, D] (HF [D, 2D]: embedding
columns first), shared_head.norm [D] (moefast ``head_norm``)."""
_MTP_COPIES = MappingProxyType({_L + "embed_tokens.weight": ("model.embed_tokens.weight",),
                                _L + "shared_head.head.weight": ("lm_head.weight", "model.embed_tokens.weight")})

_DSA_INDEXER = MappingProxyType({
    **{("attn", "indexer", x): _t(TRANSPOSED, _A + f"indexer.{x}.weight") for x in ("wq_b", "wk", "weights_proj")},
    ("attn", "indexer", "k_norm", "scale"): _t(IDENTITY, _A + "indexer.k_norm.weight"),
    ("attn", "indexer", "k_norm", "bias"): _t(IDENTITY, _A + "indexer.k_norm.bias"),
})
"""DeepSeek Sparse Attention's lightning indexer (:class:`moefast.model.mla.LightningIndexer`,
transformers' ``DeepseekV32Indexer`` names): wq_b [Q, Hi·Di], wk [D, Di], weights_proj [D, Hi], each
HF weight transposed; the key LayerNorm's weight and bias [Di]. Its RoPE features are in
rotate-half order on disk (transformers' indexer does not interleave): no column permutation."""

_MLA_ROPE = MappingProxyType({("attn", "q_b_proj"): _mla_query_rope, ("attn", "q_proj"): _mla_query_rope,
                              ("attn", "kv_a_proj_with_mqa"): _mla_key_rope})


def _indexer_query_rope(m: ModelConfig) -> np.ndarray:
    return _rope_columns(m.index_n_heads, m.index_head_dim, 0, m.qk_rope_head_dim)


def _indexer_key_rope(m: ModelConfig) -> np.ndarray:
    return _rope_columns(1, m.index_head_dim, 0, m.qk_rope_head_dim)


_INDEXER_ROPE = MappingProxyType({("attn", "indexer", "wq_b"): _indexer_query_rope,
                                  **{("attn", "indexer") + x: _indexer_key_rope
                                     for x in (("wk",), ("k_norm", "scale"), ("k_norm", "bias"))}})
"""GLM-MoE-DSA's indexer rotates its first R features as interleaved pairs (transformers'
``GlmMoeDsaIndexer``): those columns of each head of ``wq_b`` and of ``wk`` permuted to moefast's
rotate-half order, and the key LayerNorm's scale and bias with ``wk`` (a LayerNorm commutes with a
permutation of its features), so the rotate-half indexer computes the same scores."""

_DENSE_MLP = MappingProxyType({
    ("ffn", "w_in"): _t(CONCAT_T, _L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    ("ffn", "w_out"): _t(TRANSPOSED, _L + "mlp.down_proj.weight"),
})
_GLOBAL = MappingProxyType({
    ("embed",): _t(IDENTITY, "model.embed_tokens.weight"),
    ("final_norm", "scale"): _t(IDENTITY, "model.norm.weight"),
    ("lm_head",): _t(TRANSPOSED, "lm_head.weight"),
})


def _moe_tables(moe: str = "mlp.", gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
                shared: str | None = None, shared_gate: str | None = None) -> Mapping[str, Mapping[SubPath, Tensor]]:
    """MoE-layer tables: per-expert tensors under ``model.layers.{i}.{moe}`` named ``experts.{e}.
    {gate,up,down}.weight``, or transformers 5's fused ``mlp.experts.gate_up_proj/down_proj``;
    ``shared``: the shared expert's MLP under ``model.layers.{i}.{shared}`` (Qwen2-MoE's
    ``mlp.shared_expert.``, DeepSeek/GLM's ``mlp.shared_experts.``), ``shared_gate`` its gate's
    weight name (Qwen2-MoE's ``mlp.shared_expert_gate.weight``; None: ungated)."""
    x = _L + moe + "experts.{e}."
    per_expert = {("ffn", "router"): _t(TRANSPOSED, _L + moe + "gate.weight"),
                  ("ffn", "w_in"): _t(PER_EXPERT, x + gate + ".weight", x + up + ".weight"),
                  ("ffn", "w_out"): _t(PER_EXPERT, x + down + ".weight")}
    fused = {("ffn", "router"): _t(TRANSPOSED, _L + "mlp.gate.weight"),
             ("ffn", "w_in"): _t(FUSED_EXPERTS, _L + "mlp.experts.gate_up_proj"),
             ("ffn", "w_out"): _t(FUSED_EXPERTS, _L + "mlp.experts.down_proj")}
    if shared:
        s = _L + shared
        extra = {("ffn", "shared_w_in"): _t(CONCAT_T, s + "gate_proj.weight", s + "up_proj.weight"),
                 ("ffn", "shared_w_out"): _t(TRANSPOSED, s + "down_proj.weight")}
        if shared_gate:
            extra[("ffn", "shared_gate")] = _t(TRANSPOSED, _L + shared_gate)
        per_expert, fused = {**per_expert, **extra}, {**fused, **extra}
    return MappingProxyType({"per_expert": MappingProxyType(per_expert), "fused": MappingProxyType(fused)})


def _qwen(model_type: str, architecture: str, name: str, **kw) -> FamilySpec:
    return FamilySpec(
        model_type=model_type, architecture=architecture, name=name, num_experts_keys=("num_experts",
                                                                                       "num_local_experts"),
        expert_ff_key="moe_intermediate_size", dense_ff_key="intermediate_size", moe_layers=MlpOnlyLayers(),
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        export_constants=MappingProxyType({"use_sliding_window": False, "sliding_window": None,
                                           "max_window_layers": lambda cfg: cfg.model.num_layers}), **kw)


# ------------------------------------------------------------------ hybrid layers (Qwen3-Next, Qwen3.5)
def _gated_query_rows(m: ModelConfig) -> np.ndarray:
    """Rows of a gated ``q_proj`` [H·2·Hd, D] that hold the query: head h's block of 2·Hd rows is its
    query (Hd) then its output gate (Hd), as transformers' ``view(..., H, 2·Hd)`` + ``chunk(2)``
    splits it (``Qwen3NextAttention.forward``)."""
    hd = m.head_dim
    return (np.arange(m.num_heads)[:, None] * 2 * hd + np.arange(hd)[None]).ravel()


def _gated_qkv(m: ModelConfig) -> RowsTransposed:
    """moefast ``qkv`` [D, (H + 2G)·Hd] from q_proj's query rows, k_proj and v_proj."""
    q, kv = m.num_heads * m.head_dim, m.kv_heads * m.head_dim
    return RowsTransposed(np.concatenate([_gated_query_rows(m), 2 * q + np.arange(2 * kv)]), (2 * q, kv, kv))


def _gated_gate(m: ModelConfig) -> RowsTransposed:
    """moefast ``gate`` [D, H·Hd] from q_proj's gate rows."""
    return RowsTransposed(_gated_query_rows(m) + m.head_dim, (2 * m.num_heads * m.head_dim,))


def _grouped_in_proj(m: ModelConfig) -> RowsTransposed:
    """moefast Gated DeltaNet ``in_proj`` [D, C + Hv·V + 2·Hv] (columns q | k | v | z | b | a, heads
    in order) from Qwen3-Next's ``in_proj_qkvz`` [Hk·(2K + 2rV), D] and ``in_proj_ba`` [2·Hv, D]
    (r = Hv / Hk), whose rows are grouped per key head h: q (K), k (K), v (r·V: value heads h·r ..
    h·r + r - 1), z (r·V), and b (r), a (r) (``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``)."""
    hk, hv, k, v = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    r = hv // hk
    block = 2 * k + 2 * r * v  # one key head's rows of in_proj_qkvz
    heads = np.arange(hk)[:, None]
    q = (heads * block + np.arange(k)).ravel()
    values = (heads * block + 2 * k + np.arange(r * v)).ravel()  # value head h·r + j, feature d: j·V + d
    b = hk * block + (heads * 2 * r + np.arange(r)).ravel()  # in_proj_ba follows in the stack
    return RowsTransposed(np.concatenate([q, q + k, values, values + r * v, b, b + r]), (hk * block, 2 * hv))


def _in_proj_sizes(m: ModelConfig, width: int) -> tuple[int, ...]:
    """Widths of Qwen3.5's in_proj_qkv | in_proj_z | in_proj_b | in_proj_a in moefast's ``in_proj``."""
    hv, value = m.linear_num_value_heads, m.linear_num_value_heads * m.linear_value_head_dim
    return (width - value - 2 * hv, value, hv, hv)


_LA = _L + "linear_attn."
_GATED_ATTENTION = MappingProxyType({
    ("attn_norm", "scale"): _ATTENTION[("attn_norm", "scale")],
    ("ffn_norm", "scale"): _ATTENTION[("ffn_norm", "scale")],
    ("attn", "qkv"): _t(_gated_qkv, *(_A + f"{x}_proj.weight" for x in "qkv")),
    ("attn", "gate"): _t(_gated_gate, _A + "q_proj.weight"),
    ("attn", "out"): _ATTENTION[("attn", "out")],
    ("attn", "q_norm", "scale"): _ATTENTION[("attn", "q_norm", "scale")],
    ("attn", "k_norm", "scale"): _ATTENTION[("attn", "k_norm", "scale")],
})
"""Gated full attention (Qwen3-Next, Qwen3.5): ``q_proj`` [H·2·Hd, D] holds each head's query and
output gate (moefast ``qkv``'s query columns and ``gate`` [D, H·Hd]); per-head q/k norms; with the
family's zero-centred norms every ``scale`` is HF's ``w`` itself (applied as ``1 + w``)."""
_GATED_DELTANET = MappingProxyType({
    ("attn_norm", "scale"): _ATTENTION[("attn_norm", "scale")],
    ("ffn_norm", "scale"): _ATTENTION[("ffn_norm", "scale")],
    ("attn", "conv"): _t(CONV1D, _LA + "conv1d.weight"),
    ("attn", "A_log"): _t(IDENTITY, _LA + "A_log"),
    ("attn", "dt_bias"): _t(IDENTITY, _LA + "dt_bias"),
    ("attn", "norm"): _t(IDENTITY, _LA + "norm.weight"),
    ("attn", "out"): _t(TRANSPOSED, _LA + "out_proj.weight"),
})
"""A Gated DeltaNet layer's tensors but its input projection (:class:`moefast.model.GatedDeltaNet`):
conv [W, C] (HF [C, 1, W]), A_log and dt_bias [Hv], norm [V] (a plain scale), out [Hv·V, D]."""
_QWEN3_NEXT_LINEAR = MappingProxyType({
    **_GATED_DELTANET,
    ("attn", "in_proj"): _t(_grouped_in_proj, _LA + "in_proj_qkvz.weight", _LA + "in_proj_ba.weight"),
})
_QWEN3_5_LINEAR = MappingProxyType({
    **_GATED_DELTANET,
    ("attn", "in_proj"): _t(CONCAT_T, *(_LA + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                            split=_in_proj_sizes),
})
_HYBRID_DEFAULTS = {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25, "head_dim": 256,
                    "num_key_value_heads": 2, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_QWEN_MTP = MappingProxyType({
    ("enorm", "scale"): _t(IDENTITY, "mtp.pre_fc_norm_embedding.weight"),
    ("hnorm", "scale"): _t(IDENTITY, "mtp.pre_fc_norm_hidden.weight"),
    ("eh_proj",): _t(TRANSPOSED, "mtp.fc.weight"),
    ("head_norm", "scale"): _t(IDENTITY, "mtp.norm.weight"),
})
"""The multi-token-prediction tensors of Qwen3-Next and Qwen3.5 besides the decoder layers
``mtp.layers.{j}.*`` (vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``), shared by those layers:
pre_fc_norm_embedding [D] (moefast ``enorm``), pre_fc_norm_hidden [D] (``hnorm``), fc [2D, D] (HF
[D, 2D] applied to [normed embedding; normed hidden state]: ``eh_proj``), norm [D] (``head_norm``);
zero-centred norms like the model's. The embedding and output head are the main model's (the
hub's ``mtp_use_dedicated_embeddings: false``)."""
_LEFTOVER_MTP = MappingProxyType({"mtp.": "multi-token-prediction tensors (mtp.*) beyond config.json's "
                                          "mtp_num_hidden_layers"})


def _hybrid(model_type: str, architecture: str, name: str, linear_tensors, **kw) -> FamilySpec:
    """Qwen3-Next / Qwen3.5-MoE: Gated DeltaNet and gated full attention per ``layer_types``,
    zero-centred RMSNorms, per-head q/k norms, partial RoPE, softmax top-k routing and a shared
    expert behind a sigmoid gate (Qwen2-MoE's names); at most one multi-token-prediction layer
    (``mtp_num_hidden_layers``: ``mtp.*``, a gated full-attention layer with the family's MLP)."""
    return FamilySpec(
        model_type=model_type, architecture=architecture, name=name, num_experts_keys=("num_experts",),
        expert_ff_key="moe_intermediate_size", qk_norm="per_head", partial_rotary=True,
        shared_expert=SharedExpert("shared_expert_intermediate_size", gated=True), layer_types=LayerTypes(),
        attention_output_gate=True, zero_centered_norm=True, layer_tensors=_GATED_ATTENTION,
        linear_tensors=linear_tensors, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate.weight"),
        unsupported=MappingProxyType({"attention_bias": "biases on the attention projections (moefast's "
                                                        "attention output gate has none)"}),
        mtp_key="mtp_num_hidden_layers", mtp_tensors=_QWEN_MTP, mtp_layer_prefix="mtp.layers.{i}.", mtp_max_depth=1,
        mtp_unsupported=MappingProxyType({"mtp_use_dedicated_embeddings": "an embedding of the MTP layer's own; "
                                                                         "moefast's MTP modules share the model's"}),
        skipped_tensors=_LEFTOVER_MTP, export_constants=MappingProxyType({"attention_bias": False}), **kw)


def _prefixed(table: Mapping, prefix: str) -> MappingProxyType:
    """``table`` with the names under ``model.`` moved under ``prefix`` (``lm_head`` stays)."""
    def move(t: Tensor) -> Tensor:
        return dataclasses.replace(t, names=tuple(prefix + n[len("model."):] if n.startswith("model.") else n
                                                  for n in t.names))
    return MappingProxyType({k: (_prefixed(v, prefix) if isinstance(v, Mapping) else move(v))
                             for k, v in table.items()})


# ------------------------------------------------------------------------------------------ gpt-oss
_GPT_OSS_ATTENTION = MappingProxyType({**{k: v for k, v in _ATTENTION.items() if "q_norm" not in k and "k_norm" not in k},
                                       ("attn", "sinks"): _t(IDENTITY, _A + "sinks")})
"""gpt-oss's attention: GQA with biases on q/k/v/o and a sink logit per head (``self_attn.sinks`` [H])."""
_GPT_OSS_MOE = MappingProxyType({
    ("ffn", "router"): _t(TRANSPOSED, _L + "mlp.router.weight"),
    ("ffn", "router_bias"): _t(IDENTITY, _L + "mlp.router.bias"),
    ("ffn", "w_in"): _t(InterleavedGateUp(), _L + "mlp.experts.gate_up_proj"),
    ("ffn", "b_in"): _t(InterleavedGateUp(), _L + "mlp.experts.gate_up_proj_bias"),
    ("ffn", "w_out"): _t(ExpertStack(), _L + "mlp.experts.down_proj"),
    ("ffn", "b_out"): _t(ExpertStack(), _L + "mlp.experts.down_proj_bias"),
})
"""gpt-oss's MoE block, one on-disk layout: the router [E, D] with its bias [E]; the experts'
``gate_up_proj`` [E, D, 2F] (applied as ``x @ w``; gate and up columns interleaved) and its bias
[E, 2F], ``down_proj`` [E, F, D] and its bias [E, D]."""


# ------------------------------------------------------------------------------------------ Gemma 4
def _qk_sizes(m: ModelConfig, width: int) -> tuple[int, ...]:
    """Widths of q | k in a keys-as-values layer's ``qk`` (its own Hd and G: ``m`` is the layer's
    view, :meth:`~moefast.config.ModelConfig.at_layer`)."""
    return (m.num_heads * m.head_dim, m.kv_heads * m.head_dim)


_GEMMA4_LAYER = MappingProxyType({
    ("attn_norm", "scale"): _t(IDENTITY, _L + "input_layernorm.weight"),
    ("post_attn_norm", "scale"): _t(IDENTITY, _L + "post_attention_layernorm.weight"),
    ("ffn_norm", "scale"): _t(IDENTITY, _L + "pre_feedforward_layernorm.weight"),
    ("post_ffn_norm", "scale"): _t(IDENTITY, _L + "post_feedforward_layernorm.weight"),
    ("layer_scalar",): _t(IDENTITY, _L + "layer_scalar"),
    ("attn", "qkv"): _ATTENTION[("attn", "qkv")],
    ("attn", "qk"): _t(CONCAT_T, _A + "q_proj.weight", _A + "k_proj.weight", split=_qk_sizes),
    ("attn", "out"): _ATTENTION[("attn", "out")],
    ("attn", "q_norm", "scale"): _ATTENTION[("attn", "q_norm", "scale")],
    ("attn", "k_norm", "scale"): _ATTENTION[("attn", "k_norm", "scale")],
})
"""Gemma 4's decoder layer but its feed-forward: the four norms around attention and the
feed-forward (input, post-attention, pre- and post-feed-forward), the layer scalar [1], q/k/v (or,
on a keys-as-values full layer, q/k: ``qk``) and o projections at the layer's own head shape,
per-head q/k norms (the value norm has no weight)."""
_GEMMA4_MOE = MappingProxyType({
    ("ffn", "router"): _t(TRANSPOSED, _L + "router.proj.weight"),
    ("ffn", "router_scale"): _t(IDENTITY, _L + "router.scale"),
    ("ffn", "expert_scale"): _t(IDENTITY, _L + "router.per_expert_scale"),
    ("ffn", "w_in"): _t(FUSED_EXPERTS, _L + "experts.gate_up_proj"),
    ("ffn", "w_out"): _t(FUSED_EXPERTS, _L + "experts.down_proj"),
    ("ffn", "shared_w_in"): _DENSE_MLP[("ffn", "w_in")],
    ("ffn", "shared_w_out"): _DENSE_MLP[("ffn", "w_out")],
    ("ffn", "shared_out_norm"): _t(IDENTITY, _L + "post_feedforward_layernorm_1.weight"),
    ("ffn", "routed_in_norm"): _t(IDENTITY, _L + "pre_feedforward_layernorm_2.weight"),
    ("ffn", "routed_out_norm"): _t(IDENTITY, _L + "post_feedforward_layernorm_2.weight"),
})
"""Gemma 4's feed-forward (moefast ``moe.branch_norms``): the router's ``proj`` [E, D], ``scale``
[D] and ``per_expert_scale`` [E]; the experts' ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E,
D, F] (one on-disk layout); the dense MLP beside them (moefast's shared expert, ``mlp.*``) and the
branches' norms."""


# -------------------------------------------------------------------------------------- Kimi Linear
def _kimi_kda(conv: tuple[str, ...], gate: str) -> MappingProxyType:
    """A Kimi Linear KDA layer (:class:`moefast.model.KimiDeltaAttention`) with its norms, the
    convolution taps as ``conv`` names and the forget gate's tensors under ``self_attn.{gate}``."""
    return MappingProxyType({
        ("attn_norm", "scale"): _ATTENTION[("attn_norm", "scale")],
        ("ffn_norm", "scale"): _ATTENTION[("ffn_norm", "scale")],
        ("attn", "qkv"): _t(CONCAT_T, *(_A + f"{x}_proj.weight" for x in "qkv")),
        ("attn", "conv"): _t(CONV1D, *(_A + c for c in conv)),
        ("attn", "f_a"): _t(TRANSPOSED, _A + gate + "f_a_proj.weight"),
        ("attn", "f_b"): _t(TRANSPOSED, _A + gate + "f_b_proj.weight"),
        ("attn", "dt_bias"): _t(IDENTITY, _A + gate + "dt_bias"),
        ("attn", "A_log"): _t(UnitAxes(lead=2, trail=1), _A + gate + "A_log"),
        ("attn", "b"): _t(TRANSPOSED, _A + "b_proj.weight"),
        ("attn", "g_a"): _t(TRANSPOSED, _A + "g_a_proj.weight"),
        ("attn", "g_b"): _t(TRANSPOSED, _A + "g_b_proj.weight"),
        ("attn", "norm"): _t(IDENTITY, _A + "o_norm.weight"),
        ("attn", "out"): _t(TRANSPOSED, _A + "o_proj.weight"),
    })


_KIMI_KDA = MappingProxyType({
    "per_expert": _kimi_kda(tuple(f"{x}_conv1d.weight" for x in "qkv"), ""),
    "fused": _kimi_kda(("conv1d.weight",), "forget_gate."),
})
"""Kimi Linear's KDA layers per on-disk layout: qkv [D, 3·H·K] from q/k/v_proj; conv [W, 3·H·K]
from the hub's q_conv1d | k_conv1d | v_conv1d [H·K, 1, W] each (per expert: what the hub and
transformers' ``save_pretrained`` write) or transformers' joined conv1d [3·H·K, 1, W] (fused: its
in-memory names, ``save_original_format=False``, with the forget gate's f_a_proj [K, D], f_b_proj
[H·K, K], dt_bias [H·K] and A_log [1, 1, H, 1] under ``forget_gate.``); b_proj [H, D], g_a_proj
[K, D], g_b_proj [H·K, K], o_norm [K], o_proj [D, H·K]."""
_KIMI_MOE = _moe_tables("block_sparse_moe.", "w1", "w3", "w2", shared="block_sparse_moe.shared_experts.")
_KIMI_MOE = MappingProxyType({
    "per_expert": _KIMI_MOE["per_expert"],
    "fused": MappingProxyType({**_KIMI_MOE["fused"],  # transformers' in-memory names: every MoE tensor under mlp.
                               **_moe_tables(shared="mlp.shared_experts.")["fused"]}),
})


# --------------------------------------------------------------------------------------- registry
REGISTRY: dict[str, FamilySpec] = {
    "mixtral": FamilySpec(
        model_type="mixtral", architecture="MixtralForCausalLM", name="Mixtral",
        hf_defaults=MappingProxyType({"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_experts_per_tok": 2}),
        num_experts_keys=("num_local_experts",), expert_ff_key="intermediate_size", norm_topk_prob_key=None,
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables("block_sparse_moe.", "w1", "w3", "w2"),
        unsupported=MappingProxyType({"sliding_window": "sliding-window attention; set it to null for full "
                                                        "attention"}),
        export_constants=MappingProxyType({"sliding_window": None, "router_jitter_noise": 0.0})),
    "qwen2_moe": _qwen(
        "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 4}),
        attention_bias=BiasKey("qkv_bias", "qkv", default=True),
        shared_expert=SharedExpert("shared_expert_intermediate_size", gated=True),
        moe_tensors=_moe_tables(shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate.weight")),
    "qwen3_moe": _qwen(
        "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8}),
        attention_bias=BiasKey("attention_bias", "all"), qk_norm="per_head", moe_tensors=_moe_tables()),
    "olmoe": FamilySpec(
        model_type="olmoe", architecture="OlmoeForCausalLM", name="OLMoE",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8}),
        num_experts_keys=("num_experts", "num_local_experts"), expert_ff_key="intermediate_size",
        attention_bias=BiasKey("attention_bias", "all"), qk_norm="full",
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL, moe_tensors=_moe_tables(),
        unsupported=MappingProxyType({"clip_qkv": "clipping of q/k/v activations"}),
        export_constants=MappingProxyType({"clip_qkv": None}),
        model_checks=((lambda cfg: cfg.model.num_heads * cfg.model.head_dim != cfg.model.d_model,
                       "model.head_dim * num_heads != d_model (OLMoE's q/k norms assume it)"),)),
    # GLM-4.5/4.6/4.7 (zai-org/GLM-4.5 etc.): GQA with q/k/v biases and optional per-head q/k norms,
    # half of each head rotated, DeepSeek-V3's sigmoid router (noaux_tc) with its selection bias,
    # ungated shared experts, the first layers dense. Its MTP layers (num_nextn_predict_layers, named
    # as DeepSeek-V3's) are read into model.mtp_depth modules and written back.
    "glm4_moe": FamilySpec(
        model_type="glm4_moe", architecture="Glm4MoeForCausalLM", name="GLM-4.5",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8,
                                      "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                                      "partial_rotary_factor": 0.5}),
        num_experts_keys=("n_routed_experts", "num_local_experts"), expert_ff_key="moe_intermediate_size",
        dense_ff_key="intermediate_size", moe_layers=FirstKDense(default=1),
        attention_bias=BiasKey("attention_bias", "qkv"), qk_norm="per_head", qk_norm_key="use_qk_norm",
        partial_rotary=True, shared_expert=SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=Router(score_func="sigmoid", topk_methods=MappingProxyType({"noaux_tc": True}), default_method="noaux_tc",
                      scaling_key="routed_scaling_factor", selection_bias=_L + "mlp.gate.e_score_correction_bias"),
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_experts."),
        mtp_key="num_nextn_predict_layers", mtp_tensors=_MTP, mtp_copies=_MTP_COPIES),
    # DeepSeek-V3/R1 (and Moonlight, whose config.json says deepseek_v3): MLA with interleaved RoPE
    # columns and YaRN, the same router as GLM-4.5 (here with real group limits), ungated shared
    # experts, the first layers dense; MTP layers (after num_hidden_layers) read and written.
    "deepseek_v3": FamilySpec(
        model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", name="DeepSeek-V3",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8,
                                      "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                                      "rope_interleave": True, "n_group": 8, "topk_group": 4}),
        num_experts_keys=("n_routed_experts", "num_local_experts"), expert_ff_key="moe_intermediate_size",
        dense_ff_key="intermediate_size", moe_layers=FirstKDense(default=3), mla=True, yarn=True,
        rope_interleave=_MLA_ROPE,
        shared_expert=SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=Router(score_func="sigmoid", topk_methods=MappingProxyType({"noaux_tc": True}), default_method="noaux_tc",
                      # the hub's config.json says so, and vLLM/SGLang create the selection bias only for noaux_tc
                      write_method=True, scaling_key="routed_scaling_factor",
                      selection_bias=_L + "mlp.gate.e_score_correction_bias"),
        layer_tensors=_MLA, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_experts."),
        unsupported=MappingProxyType({"attention_bias": "biases on MLA's q_a/kv_a/o projections"}),
        mtp_key="num_nextn_predict_layers", mtp_tensors=_MTP, mtp_copies=_MTP_COPIES,
        export_constants=MappingProxyType({"attention_bias": False})),
    # DeepSeek-V2 / V2-Lite: MLA (V2-Lite: a direct q_proj) with RoPE features always interleaved
    # (transformers rotates them as complex pairs) and YaRN, softmax routing (greedy or
    # group_limited_greedy by the best probability of each group), gates never renormalised and
    # scaled, ungated shared experts, the first layers dense; no selection bias.
    "deepseek_v2": FamilySpec(
        model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM", name="DeepSeek-V2",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 6,
                                      "n_shared_experts": 2, "routed_scaling_factor": 1.0, "rope_interleave": True}),
        num_experts_keys=("n_routed_experts", "num_experts"), expert_ff_key="moe_intermediate_size",
        dense_ff_key="intermediate_size", moe_layers=FirstKDense(default=0), mla=True, yarn=True,
        rope_interleave=_MLA_ROPE, norm_topk_prob_key=None, fixed_norm_topk_prob=False,
        shared_expert=SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=Router(score_func="softmax", topk_methods=MappingProxyType({"greedy": False, "group_limited_greedy": True}),
                      default_method="greedy", write_method=True, scaling_key="routed_scaling_factor"),
        layer_tensors=_MLA, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_experts."),
        unsupported=MappingProxyType({"attention_bias": "biases on MLA's q_a/kv_a/o projections",
                                      "mlp_bias": "biases in the feed-forward layers"}),
        export_constants=MappingProxyType({"attention_bias": False, "mlp_bias": False, "norm_topk_prob": False})),
    # Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-*): Gated DeltaNet layers (in_proj_qkvz / in_proj_ba grouped
    # per key head) and gated full attention per layer_types, zero-centred norms, a quarter of each
    # head rotated; Qwen2-MoE's experts, router and gated shared expert, dense layers in
    # mlp_only_layers. The checkpoints' MTP layer (mtp_num_hidden_layers: 1, mtp.*: fc, its norms,
    # a gated full-attention layer, a final norm) is read into model.mtp_depth=1 and written back.
    "qwen3_next": _hybrid(
        "qwen3_next", "Qwen3NextForCausalLM", "Qwen3-Next", _QWEN3_NEXT_LINEAR,
        hf_defaults=MappingProxyType({**_HYBRID_DEFAULTS, "num_experts_per_tok": 10, "norm_topk_prob": True}),
        dense_ff_key="intermediate_size", moe_layers=MlpOnlyLayers()),
    # Qwen3.5-MoE's language model (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3-Next's
    # layers with separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (heads in order), every
    # layer MoE, gates always renormalised. Its RoPE is mrope (rope_parameters.mrope_section), which
    # for text (the three position axes equal) is plain partial RoPE: the mrope keys are not used.
    "qwen3_5_moe_text": _hybrid(
        "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3.5-MoE", _QWEN3_5_LINEAR,
        hf_defaults=MappingProxyType({**_HYBRID_DEFAULTS, "num_experts_per_tok": 8}),
        norm_topk_prob_key=None, fixed_norm_topk_prob=True),
    # Kimi Linear (moonshotai/Kimi-Linear-48B-A3B-*): KDA layers (per-channel decay from a low-rank
    # forget gate, separate q/k/v short convolutions, a sigmoid-gated output norm) and MLA layers
    # without any RoPE (transformers' KimiLinearAttention rotates nothing: model.position_encoding=none)
    # per linear_attn_config's 1-indexed lists; DeepSeek-V3's sigmoid router with groups, scaling and a
    # selection bias, ungated shared experts, leading dense layers; its own spelling of the keys
    # (KimiLinearKeys). On disk the MoE layers are block_sparse_moe.* (experts w1/w3/w2) as the hub
    # and transformers' save_pretrained write them, or transformers' fused in-memory names (mlp.*).
    "kimi_linear": FamilySpec(
        model_type="kimi_linear", architecture="KimiLinearForCausalLM", name="Kimi Linear",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8,
                                      "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 2.446,
                                      "n_group": 1, "topk_group": 1, "max_position_embeddings": 1048576,
                                      "tie_word_embeddings": False, "linear_num_key_heads": 32,
                                      "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                                      "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}),
        num_experts_keys=("num_experts", "num_local_experts"), expert_ff_key="moe_intermediate_size",
        dense_ff_key="intermediate_size", moe_layers=MlpLayerTypes(), mla=True,
        shared_expert=SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=Router(score_func="sigmoid", topk_methods=MappingProxyType({"noaux_tc": True}), default_method="noaux_tc",
                      scaling_key="routed_scaling_factor", selection_bias=MappingProxyType({
                          "per_expert": _L + "block_sparse_moe.gate.e_score_correction_bias",
                          "fused": _L + "mlp.gate.e_score_correction_bias"})),
        layer_tensors=_MLA, linear_tensors=_KIMI_KDA, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_KIMI_MOE, layer_types=LayerTypes(),
        unsupported=MappingProxyType({"attention_bias": "biases on MLA's q_a/kv_a/o projections"}),
        fixed=MappingProxyType({"model.position_encoding": "none", "model.linear_attention_kind": "kda"}),
        config_keys=KimiLinearKeys(),
        read_renames=((r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r"\1mlp.\2."),),
        export_constants=MappingProxyType({"attention_bias": False}),
        model_checks=((lambda cfg: cfg.model.tie_embeddings,
                       "model.tie_embeddings=true (transformers' KimiLinearForCausalLM never ties its output head)"),)),
    # Nemotron-H / Nemotron 3: moefast.interop.family_nemotron
    "nemotron_h": NEMOTRON_H,
    # gpt-oss (openai/gpt-oss-20b, -120b): GQA with biases and a sink logit per head, sliding-window
    # layers (128 keys) alternating with full ones, YaRN without truncation; every layer MoE, a
    # router with a bias and softmax over the top-k logits, experts with biases and the clamped
    # SwiGLU, gate/up interleaved on disk.
    "gpt_oss": FamilySpec(
        model_type="gpt_oss", architecture="GptOssForCausalLM", name="gpt-oss",
        hf_defaults=MappingProxyType({"rope_theta": 150000.0, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
                                      "swiglu_limit": 7.0}),
        num_experts_keys=("num_local_experts",), expert_ff_key="intermediate_size", norm_topk_prob_key=None,
        attention_bias=BiasKey("attention_bias", "all", default=True), yarn=True, sliding_window=True,
        attention_sinks=True, expert_activation="clamped_swiglu", expert_bias=True, router_bias=True, mxfp4_experts=True,
        layer_tensors=_GPT_OSS_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=MappingProxyType({"per_expert": _GPT_OSS_MOE, "fused": _GPT_OSS_MOE}),
        export_constants=MappingProxyType({"swiglu_alpha": 1.702})),
    # MiniMax-M2 (MiniMaxAI/MiniMax-M2): GQA with q/k RMSNorms over the whole projections and partial
    # RoPE (the hub's rotary_dim), every layer MoE, sigmoid scores with a selection bias for the
    # choice and the chosen scores renormalised (as DeepSeek-V3's router without groups or scaling),
    # Mixtral's expert names; the bias sits beside the router, block_sparse_moe.* on the hub and
    # mlp.* in transformers' fused layout.
    "minimax_m2": FamilySpec(
        model_type="minimax_m2", architecture="MiniMaxM2ForCausalLM", name="MiniMax-M2",
        hf_defaults=MappingProxyType({"rope_theta": 5e6, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8}),
        num_experts_keys=("num_local_experts",), expert_ff_key="intermediate_size", norm_topk_prob_key=None,
        qk_norm="full", partial_rotary=True,
        router=Router(score_func="sigmoid", selection_bias=MappingProxyType({
            "per_expert": _L + "block_sparse_moe.e_score_correction_bias",
            "fused": _L + "mlp.e_score_correction_bias"})),
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables("block_sparse_moe.", "w1", "w3", "w2"),
        unsupported=MappingProxyType({"sliding_window": "sliding-window attention"}),
        export_constants=MappingProxyType({"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True})),
    # Gemma 4's MoE language model (google/gemma-4-26B-A4B's text model, Gemma4ForCausalLM, model_type
    # gemma4_text): sliding layers (1,024 keys) with five of six, full layers of their own head shape,
    # keys as values and proportional RoPE; sandwich norms, per-head q/k norms and a weightless value
    # norm, logits scaled 1 (not Hd^-0.5); in every layer a dense GeGLU MLP beside 128 GeGLU experts,
    # each branch with its own norms, a router reading its own scaled norm of the residual and
    # per-expert gate scales; a layer scalar; embeddings times sqrt(D), logits soft-capped.
    "gemma4_text": FamilySpec(
        model_type="gemma4_text", architecture="Gemma4ForCausalLM", name="Gemma 4",
        hf_defaults=MappingProxyType({"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8,
                                      "tie_word_embeddings": True, "head_dim": 256, "sliding_window": 512,
                                      "max_position_embeddings": 131072, "intermediate_size": 9216}),
        num_experts_keys=("num_experts",), expert_ff_key="moe_intermediate_size", norm_topk_prob_key=None,
        qk_norm="per_head", sliding_window=True, sliding_pattern=6, expert_activation="gelu_tanh",
        shared_expert=SharedExpert("intermediate_size", gated=False),
        layer_tensors=_GEMMA4_LAYER, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=MappingProxyType({"per_expert": _GEMMA4_MOE, "fused": _GEMMA4_MOE}),
        fixed=MappingProxyType({"model.sandwich_norm": True, "model.value_norm": True, "model.attention_scale": 1.0,
                                "model.embed_scale": True, "model.layer_scalar": True, "moe.branch_norms": True,
                                "moe.per_expert_scale": True}),
        family_keys=Gemma4Keys()),
}
"""HF ``model_type`` -> :class:`FamilySpec`: the families moefast reads and writes, in the order
:func:`moefast.interop.hf.hf_family` tries them."""

# GLM-4.7-Flash: DeepSeek-V3's layers (MLA, interleaved RoPE, the sigmoid router with its selection
# bias, ungated shared experts) with GLM's defaults, dense layers listed in mlp_layer_types. A run
# imported from it is exported as it (moefast export-hf: the family the run was imported from);
# otherwise deepseek_v3, first in the registry, represents the same model.
REGISTRY["glm4_moe_lite"] = dataclasses.replace(
    REGISTRY["deepseek_v3"], model_type="glm4_moe_lite", architecture="Glm4MoeLiteForCausalLM", name="GLM-4.7-Flash",
    hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
                                  "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
                                  "rope_interleave": True, "n_group": 1, "topk_group": 1}),
    moe_layers=MlpLayerTypes(), export_constants=MappingProxyType({"attention_bias": False}))

# DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2-Exp, -V3.2): DeepSeek-V3's layers with DeepSeek Sparse
# Attention: each MLA layer's lightning indexer (self_attn.indexer.*) keeps index_topk keys per query
# (moefast model.index_topk, the dense masked reference). transformers' DeepseekV32Attention always
# rotates MLA's RoPE features as interleaved pairs (no rope_interleave key; false is refused), its
# layer_types are all indexed_attention, its dense layers listed in mlp_layer_types (default: the
# first first_k_dense_replace). FP8 checkpoints read dequantized as V3's.
REGISTRY["deepseek_v32"] = dataclasses.replace(
    REGISTRY["deepseek_v3"], model_type="deepseek_v32", architecture="DeepseekV32ForCausalLM", name="DeepSeek-V3.2",
    hf_defaults=MappingProxyType({**REGISTRY["deepseek_v3"].hf_defaults, "index_topk": 2048, "index_n_heads": 64,
                                  "index_head_dim": 128}),
    moe_layers=MlpLayerTypes(leading=FirstKDense(default=3)), dsa=True,
    layer_tensors=MappingProxyType({**_MLA, **_DSA_INDEXER}))

# GLM-5 / 5.1 (zai-org/GLM-5; transformers' glm_moe_dsa): DeepSeek-V3.2's layers with GLM's defaults,
# the indexer's RoPE interleaved (permuted once at import, as MLA's, by _INDEXER_ROPE). Its
# indexer_types may mark layers "shared" (no indexer: the previous layer's selection reused), which
# moefast does not implement: every layer must be "full" (transformers' default), else one error.
REGISTRY["glm_moe_dsa"] = dataclasses.replace(
    REGISTRY["deepseek_v32"], model_type="glm_moe_dsa", architecture="GlmMoeDsaForCausalLM", name="GLM-MoE-DSA",
    hf_defaults=MappingProxyType({**REGISTRY["deepseek_v32"].hf_defaults, "rms_norm_eps": 1e-5, "n_group": 1,
                                  "topk_group": 1, "index_n_heads": 32}),
    rope_interleave=MappingProxyType({**_MLA_ROPE, **_INDEXER_ROPE}), indexer_types=True)

# Kimi K2 (moonshotai/Kimi-K2-*) is DeepSeek-V3's architecture under its own model_type (remote code):
# read through the V3 spec; a model is always exported as deepseek_v3, which transformers loads.
REGISTRY["kimi_k2"] = dataclasses.replace(REGISTRY["deepseek_v3"], model_type="kimi_k2", name="Kimi K2",
                                          export_as="deepseek_v3")

# Qwen3.5-MoE as published (Qwen/Qwen3.5-*-A*B: Qwen3_5MoeForConditionalGeneration, model_type
# qwen3_5_moe): config.json nests the language model's keys under text_config, its tensors are
# under model.language_model.* (lm_head.weight at the top; the MTP layer's stay at the top, mtp.*,
# as vLLM's Qwen3_5MoeMTP loads them), and a vision tower (model.visual.*) that moefast does not
# read: it is skipped with one note. A model read from it is exported as the
# text model (qwen3_5_moe_text, Qwen3_5MoeForCausalLM), which transformers loads with
# AutoModelForCausalLM; the vision tower is not written.
REGISTRY["qwen3_5_moe"] = dataclasses.replace(
    REGISTRY["qwen3_5_moe_text"], model_type="qwen3_5_moe", architecture="Qwen3_5MoeForConditionalGeneration",
    name="Qwen3.5-MoE (vision-language)", export_as="qwen3_5_moe_text", text_config_key="text_config",
    layer_tensors=_prefixed(_GATED_ATTENTION, "model.language_model."),
    linear_tensors=_prefixed(_QWEN3_5_LINEAR, "model.language_model."),
    dense_tensors=_prefixed(_DENSE_MLP, "model.language_model."),
    moe_tensors=_prefixed(REGISTRY["qwen3_5_moe_text"].moe_tensors, "model.language_model."),
    global_tensors=_prefixed(_GLOBAL, "model.language_model."),
    skipped_tensors=MappingProxyType({"model.visual.": "the vision tower (model.visual.*)", **_LEFTOVER_MTP}))

# Gemma 4 as published (google/gemma-4-26B-A4B[-it]: Gemma4ForConditionalGeneration, model_type gemma4):
# config.json nests the language model's keys under text_config, its tensors are under
# model.language_model.* (the output head tied to the embedding), and the vision and audio towers
# and their embedders (model.vision_tower.*, model.embed_vision.*, model.audio_tower.*,
# model.embed_audio.*) are skipped with one note. A model read from it is written as the text model
# (gemma4_text, Gemma4ForCausalLM).
REGISTRY["gemma4"] = dataclasses.replace(
    REGISTRY["gemma4_text"], model_type="gemma4", architecture="Gemma4ForConditionalGeneration",
    name="Gemma 4 (multimodal)", export_as="gemma4_text", text_config_key="text_config",
    layer_tensors=_prefixed(_GEMMA4_LAYER, "model.language_model."),
    dense_tensors=_prefixed(_DENSE_MLP, "model.language_model."),
    moe_tensors=_prefixed(REGISTRY["gemma4_text"].moe_tensors, "model.language_model."),
    global_tensors=_prefixed(_GLOBAL, "model.language_model."),
    skipped_tensors=MappingProxyType({p: f"the {what} (model.{p.split('.')[1]}.*)" for p, what in (
        ("model.vision_tower.", "vision tower"), ("model.embed_vision.", "vision embedder"),
        ("model.audio_tower.", "audio tower"), ("model.embed_audio.", "audio embedder"))}))
