"""Nemotron-H / Nemotron 3 (``nemotron_h``): its tensor tables and :class:`FamilySpec`, registered in
:data:`moefast.interop.families.REGISTRY` (that module's docstring says how a family is written).

Dimension letters: D d_model, H Mamba-2 heads, P their head dim, C = H·P + 2·G·N conv channels (G
groups of N state channels), W the conv width, E experts, F their width, L the latent width, Fs the
shared expert's width. moefast's linear weights are [in, out]; HF's are [out, in].
"""

from __future__ import annotations

from types import MappingProxyType

from moefast.interop.family_keys import NemotronHKeys, NemotronHSpelling
from moefast.interop.family_spec import FamilySpec, LayerTypes, Router, SharedExpert, SublayerPattern
from moefast.interop.transforms import (CONCAT_T, CONV1D, FUSED_EXPERTS, IDENTITY, PER_EXPERT, TRANSPOSED, Transform,
                                        _t, qkv_sizes)

__all__ = ["NEMOTRON_H"]

_NL = "backbone.layers.{i}."
_NX = _NL + "mixer."
_NEMOTRON_NORM = _t(IDENTITY, _NL + "norm.weight")
_NEMOTRON_ATTENTION = MappingProxyType({
    ("attn_norm", "scale"): _NEMOTRON_NORM,
    ("attn", "qkv"): _t(CONCAT_T, *(_NX + f"{x}_proj.weight" for x in "qkv"), split=qkv_sizes),
    ("attn", "out"): _t(TRANSPOSED, _NX + "o_proj.weight"),
})
"""A Nemotron-H attention sublayer: its norm and GQA without biases or RoPE (``mixer.q/k/v/o_proj``)."""
_NEMOTRON_MAMBA = MappingProxyType({
    ("attn_norm", "scale"): _NEMOTRON_NORM,
    ("attn", "in_proj"): _t(TRANSPOSED, _NX + "in_proj.weight"),
    ("attn", "conv"): _t(CONV1D, _NX + "conv1d.weight"),
    ("attn", "conv_bias"): _t(IDENTITY, _NX + "conv1d.bias"),
    **{("attn", x): _t(IDENTITY, _NX + x) for x in ("A_log", "D", "dt_bias")},
    ("attn", "norm"): _t(IDENTITY, _NX + "norm.weight"),
    ("attn", "out"): _t(TRANSPOSED, _NX + "out_proj.weight"),
})
"""A Nemotron-H Mamba-2 sublayer (:class:`moefast.model.Mamba2`, transformers' ``NemotronHMamba2Mixer``):
its norm; in_proj [D, H·P + C + H] (HF [H·P + C + H, D]: z | xBC | dt rows, as moefast's columns),
conv [W, C] (HF [C, 1, W]) and its bias [C], A_log, D and dt_bias [H], the gated norm's weight
[H·P], out [H·P, D]."""
_NEMOTRON_MLP = MappingProxyType({
    ("ffn_norm", "scale"): _NEMOTRON_NORM,
    ("ffn", "w_in"): _t(TRANSPOSED, _NX + "up_proj.weight"),
    ("ffn", "w_out"): _t(TRANSPOSED, _NX + "down_proj.weight"),
})
"""A Nemotron-H MLP sublayer: its norm and the relu² MLP (``model.dense_activation=relu2``): w_in [D, F]
(HF up_proj [F, D]), w_out [F, D]."""


def _nemotron_moe(up: str, down: str, expert: Transform) -> MappingProxyType:
    """A Nemotron-H MoE sublayer with its experts' ``up`` and ``down`` names under ``mixer.experts.``."""
    return MappingProxyType({
        ("ffn_norm", "scale"): _NEMOTRON_NORM,
        ("ffn", "router"): _t(TRANSPOSED, _NX + "gate.weight"),
        ("ffn", "fc1_latent_proj"): _t(TRANSPOSED, _NX + "fc1_latent_proj.weight"),
        ("ffn", "fc2_latent_proj"): _t(TRANSPOSED, _NX + "fc2_latent_proj.weight"),
        ("ffn", "w_in"): _t(expert, _NX + "experts." + up),
        ("ffn", "w_out"): _t(expert, _NX + "experts." + down),
        ("ffn", "shared_w_in"): _t(TRANSPOSED, _NX + "shared_experts.up_proj.weight"),
        ("ffn", "shared_w_out"): _t(TRANSPOSED, _NX + "shared_experts.down_proj.weight"),
    })


_NEMOTRON_MOE = MappingProxyType({"per_expert": _nemotron_moe("{e}.up_proj.weight", "{e}.down_proj.weight", PER_EXPERT),
                                  "fused": _nemotron_moe("up_proj", "down_proj", FUSED_EXPERTS)})
"""A Nemotron-H MoE sublayer per on-disk layout: its norm, the router [E, D] (``mixer.gate``; its
``e_score_correction_bias`` in the routing state), the latent projections fc1 [L, D] and fc2 [D, L]
(with ``moe_latent_size``), the relu² experts (not gated) in the latent width L (else D): per expert
(the hub's and ``save_pretrained``'s ``experts.{e}.up_proj.weight`` [F, L], ``down_proj.weight``
[L, F]) or fused (transformers' in-memory ``experts.up_proj`` [E, F, L], ``down_proj`` [E, L, F]);
the shared expert's up_proj [Fs, D] and down_proj [D, Fs]."""
_NEMOTRON_GLOBAL = MappingProxyType({
    ("embed",): _t(IDENTITY, "backbone.embeddings.weight"),
    ("final_norm", "scale"): _t(IDENTITY, "backbone.norm_f.weight"),
    ("lm_head",): _t(TRANSPOSED, "lm_head.weight"),
})


# Nemotron-H / Nemotron 3 (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B and kin): every layer one pre-norm
# residual sublayer per layers_block_type (or the legacy hybrid_override_pattern): Mamba-2, GQA
# without RoPE or biases, a relu² MLP, or an MoE of relu² experts (not gated) with an ungated
# relu² shared expert, optionally in a latent width (moe_latent_size), routed as DeepSeek-V3
# (sigmoid scores, selection bias, groups, scaling). Tensors under backbone.* as the hub and
# save_pretrained write them (experts per expert), or transformers' in-memory model.* (fused
# experts, read through the rename). The checkpoints' MTP layers (num_nextn_predict_layers,
# mtp.*) are skipped with one note, as transformers ignores them.
NEMOTRON_H = FamilySpec(
    model_type="nemotron_h", architecture="NemotronHForCausalLM", name="Nemotron-H",
    hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 2,
                                  "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
                                  "topk_group": 1, "num_key_value_heads": 8, "head_dim": 128,
                                  "max_position_embeddings": 4096, "tie_word_embeddings": False,
                                  "moe_shared_expert_intermediate_size": 7688, "linear_num_key_heads": 8,
                                  "linear_num_value_heads": 128, "linear_key_head_dim": 128,
                                  "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4}),
    num_experts_keys=("n_routed_experts", "num_local_experts"), expert_ff_key="moe_intermediate_size",
    dense_ff_key="intermediate_size", moe_layers=SublayerPattern(), expert_activation="relu2",
    shared_expert=SharedExpert("moe_shared_expert_intermediate_size", gated=False),
    router=Router(score_func="sigmoid", topk_methods=MappingProxyType({"noaux_tc": True}), default_method="noaux_tc",
                  scaling_key="routed_scaling_factor", selection_bias=_NX + "gate.e_score_correction_bias"),
    layer_tensors=_NEMOTRON_ATTENTION, linear_tensors=_NEMOTRON_MAMBA, dense_tensors=_NEMOTRON_MLP,
    moe_tensors=_NEMOTRON_MOE, global_tensors=_NEMOTRON_GLOBAL,
    layer_types=LayerTypes(kinds=("full_attention", "linear_attention", "moe", "mlp")),
    fixed=MappingProxyType({"model.position_encoding": "none", "model.linear_attention_kind": "mamba2",
                            "model.dense_activation": "relu2"}),
    family_keys=NemotronHKeys(), config_keys=NemotronHSpelling(), read_renames=((r"^model\.", "backbone."),),
    skipped_tensors=MappingProxyType({p: "multi-token-prediction layers (mtp.*), which transformers does not read "
                                         "either" for p in ("mtp.", "backbone.mtp.")}),
    model_checks=((lambda cfg: cfg.model.tie_embeddings,
                   "model.tie_embeddings=true (transformers' NemotronHForCausalLM never ties its output head)"),))
