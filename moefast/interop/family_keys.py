"""One family's own ``config.json`` keys, read into moefast's fields and written back: the
:class:`~moefast.interop.family_spec.FamilySpec` fields ``family_keys`` (:class:`Gemma4Keys`,
:class:`NemotronHKeys`) and ``config_keys`` (:class:`KimiLinearKeys`, :class:`NemotronHSpelling`). The pieces several families share are in
:mod:`moefast.interop.family_spec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from moefast.config import ExperimentConfig
from moefast.interop.family_spec import LINEAR_KEYS

__all__ = ["Gemma4Keys", "KimiLinearKeys", "NemotronHKeys", "NemotronHSpelling"]


@dataclasses.dataclass(frozen=True)
class Gemma4Keys:
    """Gemma 4's own config.json keys (transformers' ``Gemma4TextConfig``), read into moefast's
    fields and written back:

    * ``rope_parameters`` per layer type: ``sliding_attention``'s ``rope_theta`` (plain RoPE) is
      ``model.rope_base``, ``full_attention``'s ``rope_theta`` ``model.global_rope_base`` and, with
      ``rope_type: proportional``, its ``partial_rotary_factor`` ``model.global_rotary_fraction``;
    * ``global_head_dim`` (transformers' default 512) and ``num_global_key_value_heads`` (default:
      ``num_key_value_heads``): ``model.global_head_dim`` / ``num_global_kv_heads``;
      ``attention_k_eq_v``; ``final_logit_softcapping``;
    * ``top_k_experts`` (moefast ``moe.top_k``), ``hidden_activation`` (``gelu_pytorch_tanh``:
      ``moe.expert_activation=gelu_tanh``);
    * refused: a model without the MoE block (``enable_moe_block`` false), per-layer input
      embeddings (``hidden_size_per_layer_input`` > 0, the E2B/E4B models), layers sharing their
      keys and values (``num_kv_shared_layers`` > 0), bidirectional attention (``all``), attention
      biases, and a last layer that is not full attention (transformers forces it to be).
    """

    hf_keys: Mapping[str, str] = dataclasses.field(default_factory=lambda: {
        "moe.top_k": "top_k_experts", "model.num_global_kv_heads": "num_global_key_value_heads",
        "model.global_rotary_fraction": "rope_parameters", "model.global_rope_base": "rope_parameters",
        "model.rope_base": "rope_parameters"})
    """moefast keys -> the config.json key they come from, for error messages."""
    default_rope: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})
    """``rope_parameters`` where config.json has none (transformers' ``Gemma4TextConfig``)."""
    owns: tuple[str, ...] = ("model.global_head_dim", "model.num_global_kv_heads", "model.global_rope_base",
                             "model.global_rotary_fraction", "model.attention_k_eq_v",
                             "model.final_logit_softcapping")

    def read(self, hf: Mapping[str, Any], reject: Callable[[str, Any, str], None]) -> tuple[dict, dict]:
        """``(model, moe)`` fields from config.json dict ``hf``; ``reject(key, value, why)`` raises."""
        if not hf.get("enable_moe_block"):
            reject("enable_moe_block", hf.get("enable_moe_block"), "a dense Gemma 4; moefast reads the MoE models "
                   "(Gemma 4 26B-A4B)")
        if hf.get("hidden_size_per_layer_input", 256):  # transformers' default when absent
            reject("hidden_size_per_layer_input", hf.get("hidden_size_per_layer_input", 256),
                   "per-layer input embeddings (Gemma 4 E2B/E4B); set it to 0 for a model without them")
        for key in ("num_kv_shared_layers", "attention_bias"):
            if hf.get(key):
                reject(key, hf[key], {"num_kv_shared_layers": "layers reusing earlier layers' keys and values",
                                      "attention_bias": "biases on the attention projections"}[key])
        if hf.get("use_bidirectional_attention") == "all":
            reject("use_bidirectional_attention", "all", "bidirectional attention; moefast's models are causal")
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            reject("hidden_activation", act, "Gemma 4's GeGLU with tanh-approximated GELU (gelu_pytorch_tanh)")
        types = hf.get("layer_types")
        if types and types[-1] != "full_attention":
            reject("layer_types", types, "the last layer must be full_attention (transformers makes it so)")
        rope = hf.get("rope_parameters") or self.default_rope  # absent: transformers' defaults
        sliding, full = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            reject("rope_parameters.sliding_attention.rope_type", sliding.get("rope_type"), "plain RoPE only")
        if full.get("rope_type", "default") not in ("default", "proportional"):
            reject("rope_parameters.full_attention.rope_type", full.get("rope_type"), "plain or proportional RoPE")
        if full.get("factor", 1.0) != 1.0:
            reject("rope_parameters.full_attention.factor", full["factor"], "proportional RoPE without scaling")
        kv = hf.get("num_key_value_heads") or hf["num_attention_heads"]
        head_dim, g_kv = self._full_shape(hf, kv, reject)
        proportional = full.get("rope_type") == "proportional"
        model = dict(rope_base=float(sliding.get("rope_theta", 10000.0)),
                     global_rope_base=float(full.get("rope_theta", 1e6)),
                     global_rotary_fraction=float(full.get("partial_rotary_factor", 1.0)) if proportional else None,
                     global_head_dim=head_dim if head_dim != hf.get("head_dim") else None,
                     num_global_kv_heads=g_kv if g_kv != kv else None,
                     attention_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
                     final_logit_softcapping=hf.get("final_logit_softcapping"))
        if model["global_rotary_fraction"] == 1.0:
            model["global_rotary_fraction"] = None
        top_k = hf.get("top_k_experts")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            reject("top_k_experts", top_k, "the experts each token chooses: an int >= 1 (Gemma 4's key; "
                   "num_experts_per_tok is not read)")
        moe = dict(top_k=top_k, expert_activation="gelu_tanh")
        return model, moe

    @staticmethod
    def _full_shape(hf: Mapping[str, Any], kv: int, reject) -> tuple[int, int]:
        """(head_dim, key/value heads) of the full-attention layers: from ``per_layer_config``
        (what transformers writes: overrides per layer index), else ``global_head_dim`` (default
        512) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
        types = hf.get("layer_types") or []
        per_layer = hf.get("per_layer_config")
        if per_layer is None:
            g_kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
            return int(hf.get("global_head_dim") or 512), int(g_kv or kv)
        if not isinstance(per_layer, Mapping) or not types:
            reject("per_layer_config", per_layer, "overrides per layer index, with layer_types listed")
        shapes = set()
        for i, kind in enumerate(types):
            over = dict(per_layer.get(str(i), per_layer.get(i)) or {})
            extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
            if extra or (kind != "full_attention" and over):
                reject("per_layer_config", per_layer, f"layer {i} ({kind}) overrides {sorted(over)}: moefast reads "
                       "head_dim and num_key_value_heads of the full-attention layers only")
            if kind == "full_attention":
                shapes.add((int(over.get("head_dim", hf.get("head_dim"))), int(over.get("num_key_value_heads", kv))))
        if len(shapes) != 1:
            reject("per_layer_config", per_layer, "full-attention layers of more than one shape")
        return shapes.pop()

    def write(self, cfg: ExperimentConfig) -> dict[str, Any]:
        """Gemma 4's keys of ``cfg``'s model (the full layers' shape as ``per_layer_config``, as
        transformers writes it, and as ``global_head_dim`` / ``num_global_key_value_heads``)."""
        m, e = cfg.model, cfg.moe
        full = {"rope_type": "default", "rope_theta": m.global_rope_base or m.rope_base}
        if m.global_rotary_fraction is not None:
            full.update(rope_type="proportional", partial_rotary_factor=m.global_rotary_fraction)
        g_kv, g_hd = m.attention_shape(m.num_layers)
        over = {"head_dim": g_hd, **({"num_key_value_heads": g_kv} if m.attention_k_eq_v else {})}
        return {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": m.rope_base},
                                    "full_attention": full},
                "per_layer_config": {str(i): over for i in range(m.num_layers) if m.layer_type(i) == "full_attention"},
                "global_head_dim": g_hd, "num_global_key_value_heads": g_kv,
                "attention_k_eq_v": m.attention_k_eq_v, "final_logit_softcapping": m.final_logit_softcapping,
                "top_k_experts": e.top_k, "hidden_activation": "gelu_pytorch_tanh", "enable_moe_block": True,
                "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
                "attention_bias": False}

    def problems(self, cfg: ExperimentConfig, name: str) -> list[str]:
        """What keeps Gemma 4 from holding ``cfg``'s model besides the :class:`FamilySpec` fields."""
        m = cfg.model
        out = []
        if "sliding_attention" not in (m.layer_types or ()):
            out.append(f"model.layer_types without sliding_attention layers ({name} mixes sliding and full layers)")
        elif m.layer_types[-1] != "full_attention":
            out.append(f"model.layer_types ending in {m.layer_types[-1]} ({name}'s last layer is full attention)")
        if m.rope_type != "default" or m.partial_rotary_factor != 1.0:
            out.append(f"model.rope_type={m.rope_type}, partial_rotary_factor={m.partial_rotary_factor} ({name}'s "
                       "sliding layers rotate whole heads with plain RoPE)")
        if m.attention_bias != "none":
            out.append(f"model.attention_bias={m.attention_bias} ({name} has none)")
        if m.attention_k_eq_v is False and m.num_global_kv_heads is not None:
            out.append(f"model.num_global_kv_heads={m.num_global_kv_heads} without attention_k_eq_v ({name}'s "
                       "full layers have their own KV heads only with keys as values)")
        return out


_KDA_KEYS = {"num_heads": ("linear_num_heads", 32, ("linear_num_key_heads", "linear_num_value_heads")),
             "head_dim": ("linear_head_dim", 128, ("linear_key_head_dim", "linear_value_head_dim")),
             "short_conv_kernel_size": ("linear_conv_kernel_dim", 4, ("linear_conv_kernel_dim",))}
"""``linear_attn_config`` key -> (transformers' top-level key, its default, the :data:`LINEAR_KEYS` it
gives): the KDA layers' shape."""


@dataclasses.dataclass(frozen=True)
class KimiLinearKeys:
    """Kimi Linear's ``config.json`` (transformers' ``KimiLinearConfig``, the hub's
    ``configuration_kimi.py``) as the keys the engine reads, and back (:meth:`read`, :meth:`write`):

    * its names for keys other families spell otherwise (transformers' ``attribute_map``):
      ``num_experts_per_token``, ``num_shared_experts``, ``num_expert_group``, ``moe_renormalize``,
      ``model_max_length``, and ``moe_router_activation_func`` for ``scoring_func``;
    * ``linear_attn_config``: the KDA layers' heads (``num_heads``), their width (``head_dim``:
      keys, queries and values) and the short convolutions' width (``short_conv_kernel_size``),
      which win over the top-level ``linear_num_heads`` / ``linear_head_dim`` /
      ``linear_conv_kernel_dim`` (defaults 32, 128, 4); where config.json has no ``layer_types``,
      its 1-indexed ``kda_layers`` and ``full_attn_layers`` (both, every layer once) give the
      layers' kinds, else transformers' default (layer i full attention where i > 0 and i % 4 == 0);
    * ``mlp_layer_types``, else the first ``first_k_dense_replace`` (default 1) layers dense;
    * refused, each by its key: where transformers' ``KimiLinearForCausalLM`` and the
      checkpoint's own code would compute different models (``mla_use_nope: false``, RoPE in the
      MLA layers; ``moe_layer_freq`` other than 1; ``use_grouped_topk: false`` with groups;
      ``layer_types`` or ``mlp_layer_types`` disagreeing with ``linear_attn_config`` /
      ``first_k_dense_replace``; a key of ``linear_attn_config`` it does not have, e.g. Kimi K3's
      ``gate_lower_bound``), and what moefast does not hold (``mla_use_output_gate``, MTP layers
      ``num_nextn_predict_layers``, a tied output head, fewer key/value heads than heads, two
      spellings of one key that differ).
    """

    aliases: Mapping[str, str] = dataclasses.field(default_factory=lambda: {
        "max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group", "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts", "scoring_func": "moe_router_activation_func"})
    """The engine's key -> Kimi Linear's (transformers' ``KimiLinearConfig.attribute_map``)."""

    def read(self, hf: Mapping[str, Any], reject: Callable[[str, Any, str], None]) -> dict[str, Any]:
        """``hf`` with the engine's keys (``layer_types``, ``mlp_layer_types`` and the
        :data:`LINEAR_KEYS` filled in); ``reject(key, value, why)`` raises."""
        out = dict(hf)
        for key, own in self.aliases.items():
            if own in hf and key in hf and hf[own] != hf[key]:
                reject(own, hf[own], f"config.json also has {key}={hf[key]!r}, which transformers reads as the "
                       "same setting; keep one")
            if own in hf:
                out[key] = hf[own]
        n = hf["num_hidden_layers"]
        refused = {"mla_use_nope": (False, "RoPE in the MLA layers: transformers' KimiLinearAttention never rotates "
                                           "(Kimi Linear's MLA is NoPE), so this flag would make transformers and the "
                                           "checkpoint's own code compute different models"),
                   "mla_use_output_gate": (True, "an output gate on the MLA layers (Kimi K3), which Kimi Linear has "
                                                 "not"),
                   "tie_word_embeddings": (True, "transformers' KimiLinearForCausalLM never ties its output head to "
                                                 "the embedding")}
        for key, (bad, why) in refused.items():
            if key in hf and bool(hf[key]) == bad:
                reject(key, hf[key], why)
        if hf.get("moe_layer_freq", 1) != 1:
            reject("moe_layer_freq", hf["moe_layer_freq"], "MoE layers every moe_layer_freq-th: transformers ignores "
                   "the key (every layer after first_k_dense_replace is MoE); the checkpoint's own code does not")
        if hf.get("num_nextn_predict_layers"):
            reject("num_nextn_predict_layers", hf["num_nextn_predict_layers"], "multi-token-prediction layers; "
                   "transformers' Kimi Linear has none")
        if hf.get("use_grouped_topk") is False and (out.get("n_group") or 1) > 1:
            reject("use_grouped_topk", False, "ungrouped routing with num_expert_group > 1: transformers always limits "
                   "the choice to topk_group groups")
        kv = hf.get("num_key_value_heads")
        if kv is not None and kv != hf["num_attention_heads"]:
            reject("num_key_value_heads", kv, f"MLA expands keys and values for every head: it must equal "
                   f"num_attention_heads={hf['num_attention_heads']}")
        linear = hf.get("linear_attn_config") or {}
        if not isinstance(linear, Mapping):
            reject("linear_attn_config", linear, "a dict of the KDA layers' shape and kinds")
        for key in sorted(set(linear) - {*_KDA_KEYS, "kda_layers", "full_attn_layers"}):
            reject(f"linear_attn_config.{key}", linear[key], "not a Kimi Linear key (transformers ignores it; the "
                   "checkpoint's own code would not)")
        for key, (top, default, names) in _KDA_KEYS.items():
            value = linear.get(key, hf.get(top, default))
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                reject(f"linear_attn_config.{key}", value, "an int >= 1")
            out.update({name: value for name in names})
        listed = self._listed_types(linear, n, reject)
        if hf.get("layer_types") is None:
            out["layer_types"] = listed or ["full_attention" if i and i % 4 == 0 else "linear_attention"
                                            for i in range(n)]
        elif listed is not None and list(hf["layer_types"]) != listed:
            reject("layer_types", hf["layer_types"], f"disagrees with linear_attn_config's kda_layers / "
                   f"full_attn_layers ({listed}), which the checkpoint's own code reads")
        k = hf.get("first_k_dense_replace")
        leading = ["dense" if i < (1 if k is None else k) else "sparse" for i in range(n)]
        if hf.get("mlp_layer_types") is None:
            out["mlp_layer_types"] = leading
        elif k is not None and list(hf["mlp_layer_types"]) != leading:
            reject("mlp_layer_types", hf["mlp_layer_types"], f"disagrees with first_k_dense_replace={k}, which the "
                   "checkpoint's own code reads")
        return out

    @staticmethod
    def _listed_types(linear: Mapping[str, Any], n: int, reject) -> list[str] | None:
        """Each layer's kind from ``kda_layers`` / ``full_attn_layers`` (1-indexed); None without them."""
        given = [k for k in ("kda_layers", "full_attn_layers") if k in linear]
        if not given:
            return None
        if len(given) == 1:
            reject(f"linear_attn_config.{given[0]}", linear[given[0]], "without "
                   f"{({'kda_layers', 'full_attn_layers'} - set(given)).pop()}: transformers reads the layers' kinds "
                   "from both lists or neither")
        types: list[str | None] = [None] * n
        for key, kind in (("kda_layers", "linear_attention"), ("full_attn_layers", "full_attention")):
            for layer in linear[key]:
                if not isinstance(layer, int) or not 1 <= layer <= n or types[layer - 1] is not None:
                    reject(f"linear_attn_config.{key}", linear[key], f"layer {layer!r}: the two lists name each "
                           f"layer 1..num_hidden_layers={n} once")
                types[layer - 1] = kind
        if None in types:
            reject("linear_attn_config.kda_layers", linear["kda_layers"], f"layer {types.index(None) + 1} is in "
                   "neither kda_layers nor full_attn_layers: the two lists name every layer, 1-indexed")
        return types

    def write(self, out: dict[str, Any], cfg: ExperimentConfig) -> dict[str, Any]:
        """``out`` (the engine's keys) in Kimi Linear's: the aliases, ``linear_attn_config`` (with
        the 1-indexed layer lists) and transformers' top-level KDA keys, ``first_k_dense_replace``
        where the dense layers are the leading ones, ``mla_use_nope`` (for the checkpoint's own code);
        no ``rope_parameters`` (nothing rotates)."""
        m = cfg.model
        out = {(self.aliases.get(k, k)): v for k, v in out.items()
               if k not in LINEAR_KEYS and k not in ("rope_parameters", "partial_rotary_factor")}
        types = [m.layer_type(i) for i in range(m.num_layers)]
        out["linear_attn_config"] = {
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
            "num_heads": m.linear_num_value_heads, "head_dim": m.linear_value_head_dim,
            "short_conv_kernel_size": m.linear_conv_kernel_dim}
        out.update(linear_num_heads=m.linear_num_value_heads, linear_head_dim=m.linear_value_head_dim,
                   linear_conv_kernel_dim=m.linear_conv_kernel_dim, mla_use_nope=True)
        dense = [not m.is_moe_layer(i) for i in range(m.num_layers)]
        k = dense.index(False)
        if not any(dense[k:]):
            out["first_k_dense_replace"] = k
        return out


_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
"""``hybrid_override_pattern``'s characters (transformers' ``NemotronHConfig._pattern_to_list``)."""
_NEMOTRON_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
"""Older ``layers_block_type`` names transformers remaps (``remap_legacy_layer_types``)."""
_NEMOTRON_LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
                         "mamba_conv_bias": "use_conv_bias"}
"""Older config.json names of Nemotron-H's keys that ``NemotronHConfig`` reads (and prefers) -> the
current name (the others it renames, ``mamba_expand``, ``mamba_dt_max``, ..., shape nothing moefast
computes)."""
_MAMBA_KEYS = {"linear_num_value_heads": ("mamba_num_heads", 128), "linear_value_head_dim": ("mamba_head_dim", 64),
               "linear_num_key_heads": ("n_groups", 8), "linear_key_head_dim": ("ssm_state_size", 128),
               "linear_conv_kernel_dim": ("conv_kernel", 4)}
"""The :data:`LINEAR_KEYS` (Mamba-2's shape, :mod:`moefast.model.mamba2`) -> (Nemotron-H's key,
transformers' default)."""
_NEMOTRON_SIZES = {"intermediate_size": 21504, "moe_intermediate_size": 7688, "n_routed_experts": 8}
"""Widths and the expert count where config.json omits them: transformers' defaults."""


@dataclasses.dataclass(frozen=True)
class NemotronHSpelling:
    """Nemotron-H's ``config.json`` (transformers' ``NemotronHConfig``) as the keys the engine
    reads, and back (:meth:`read`, :meth:`write`):

    * ``layers_block_type``, one entry per layer, each ``linear_attention`` (Mamba-2; the legacy
      ``mamba``), ``full_attention`` (``attention``), ``moe`` or ``mlp``; or, where it is absent, the
      legacy ``hybrid_override_pattern`` string, one character per layer: ``M``, ``*``, ``E``, ``-``;
      neither: transformers' default ``M E * -``. It is the engine's ``layer_types`` (moefast's
      sublayer pattern) and sets ``num_hidden_layers`` (transformers derives it, ignoring the key);
    * ``layer_norm_epsilon`` (``rms_norm_eps``; default 1e-5); Mamba-2's shape ``mamba_num_heads``,
      ``mamba_head_dim``, ``n_groups``, ``ssm_state_size``, ``conv_kernel`` (the :data:`LINEAR_KEYS`;
      the older ``mamba_n_groups``, ``mamba_d_conv``, ``mamba_dt_min``, ``mamba_conv_bias`` win where
      present, as in transformers); ``num_key_value_heads`` null is ``num_attention_heads``;
      ``moe_shared_expert_intermediate_size`` 0 or null is ``intermediate_size`` (transformers'
      ``NemotronHMLP`` falls back to it); absent widths and expert counts are transformers' defaults;
    * ignored, as transformers ignores them: ``attention_bias`` (``NemotronHAttention`` has no
      biases), ``n_shared_experts``, ``sliding_window``, ``time_step_limit``, ``num_hidden_layers``;
      ``num_nextn_predict_layers``: the checkpoint's ``mtp.*`` tensors are skipped with one note;
    * refused, each by its key: activations other than ``relu2`` (``mlp_hidden_act``: MLPs, experts)
      and ``silu`` (``mamba_hidden_act``), biases (``use_bias``: Mamba-2's projections; ``mlp_bias``),
      a convolution without a bias (``use_conv_bias: false``), a tied output head, an unknown
      pattern character or layer kind, ``n_groups`` not dividing ``mamba_num_heads``.
    """

    def read(self, hf: Mapping[str, Any], reject: Callable[[str, Any, str], None]) -> dict[str, Any]:
        """``hf`` with the engine's keys (``layer_types``, ``num_hidden_layers``, ``rms_norm_eps``,
        the :data:`LINEAR_KEYS`) filled in; ``reject(key, value, why)`` raises."""
        out = dict(hf)
        out.update({new: hf[old] for old, new in _NEMOTRON_LEGACY_KEYS.items() if old in hf})
        for key, want, why in (("mlp_hidden_act", "relu2", "the MLPs and experts are relu² (Nemotron-H's relu2)"),
                               ("mamba_hidden_act", "silu", "Mamba-2's convolution is followed by SiLU (silu)")):
            if out.get(key, want) != want:
                reject(key, out[key], why)
        for key, bad, why in (("use_bias", True, "biases on Mamba-2's in/out projections"),
                              ("mlp_bias", True, "biases in the MLPs, experts and latent projections"),
                              ("use_conv_bias", False, "a Mamba-2 convolution without a bias (moefast's has one)"),
                              ("tie_word_embeddings", True, "transformers' NemotronHForCausalLM never ties its "
                                                            "output head to the embedding")):
            if key in out and bool(out[key]) == bad:
                reject(key, out[key], why)
        out["layer_types"] = self._types(hf, reject)
        out["num_hidden_layers"] = len(out["layer_types"])
        out["rms_norm_eps"] = out.get("layer_norm_epsilon") or 1e-5
        for key, (own, default) in _MAMBA_KEYS.items():
            value = out.get(own, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                reject(own, value, "an int >= 1")
            out[key] = value
        if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
            reject("n_groups", out["linear_num_key_heads"], f"Mamba-2's groups must divide its "
                   f"mamba_num_heads={out['linear_num_value_heads']} heads")
        if "num_key_value_heads" in out and out["num_key_value_heads"] is None:
            out["num_key_value_heads"] = out["num_attention_heads"]
        if out.get("n_routed_experts") is None and out.get("num_local_experts") is not None:
            out["n_routed_experts"] = out["num_local_experts"]  # transformers' attribute_map
        for key, default in _NEMOTRON_SIZES.items():  # the engine reads these without defaults
            if out.get(key) is None:
                out[key] = default
        shared = "moe_shared_expert_intermediate_size"
        if shared in out and not out[shared]:
            out[shared] = out["intermediate_size"]
        return out

    @staticmethod
    def _types(hf: Mapping[str, Any], reject) -> list[str]:
        """Each layer's kind from ``layers_block_type`` or ``hybrid_override_pattern``."""
        given, pattern = hf.get("layers_block_type"), hf.get("hybrid_override_pattern")
        if given is None and pattern is not None:
            bad = [f"{c!r} (layer {i})" for i, c in enumerate(str(pattern)) if c not in _NEMOTRON_PATTERN]
            if not isinstance(pattern, str) or not pattern or bad:
                reject("hybrid_override_pattern", pattern, f"{', '.join(bad) or 'no layers'}: one character per "
                       "layer, each M (Mamba-2), * (attention), E (MoE) or - (MLP)")
            return [_NEMOTRON_PATTERN[c] for c in pattern]
        if given is None:
            return ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
        kinds = set(_NEMOTRON_PATTERN.values())
        types = [_NEMOTRON_LEGACY_TYPES.get(t, t) for t in given] if isinstance(given, (list, tuple)) else None
        bad = [f"{t!r} (layer {i})" for i, t in enumerate(types or []) if t not in kinds]
        if not types or bad:
            reject("layers_block_type", given, f"{', '.join(bad) or 'no layers'}: one entry per layer, each "
                   "linear_attention (Mamba-2), full_attention, moe or mlp")
        return types

    def write(self, out: dict[str, Any], cfg: ExperimentConfig) -> dict[str, Any]:
        """``out`` (the engine's keys) in Nemotron-H's: ``layers_block_type``, ``layer_norm_epsilon``,
        Mamba-2's shape under its names, the activations and biases it implies; no RoPE keys (nothing
        rotates) and no MTP layers."""
        m = cfg.model
        dropped = {*LINEAR_KEYS, "layer_types", "rms_norm_eps", "rope_theta", "rope_parameters", "hidden_act",
                   "partial_rotary_factor"}
        out = {k: v for k, v in out.items() if k not in dropped}
        out.update({own: getattr(m, key) for key, (own, _) in _MAMBA_KEYS.items()})
        out.update(layers_block_type=list(m.layer_types), layer_norm_epsilon=m.norm_eps, mlp_hidden_act="relu2",
                   mamba_hidden_act="silu", use_bias=False, mlp_bias=False, use_conv_bias=True, attention_bias=False,
                   num_nextn_predict_layers=0)
        return out


@dataclasses.dataclass(frozen=True)
class NemotronHKeys:
    """Nemotron-H's own config.json keys, read into moefast's fields and written back:
    ``time_step_min`` (transformers' default 0.001; Mamba-2's floor on its time steps, which
    transformers' mixer clamps at: ``model.time_step_min``) and ``moe_latent_size`` (null: the experts
    work in ``hidden_size``; ``moe.latent_size``)."""

    hf_keys: Mapping[str, str] = dataclasses.field(default_factory=lambda: {
        "model.time_step_min": "time_step_min", "moe.latent_size": "moe_latent_size"})
    """moefast keys -> the config.json key they come from, for error messages."""
    owns: tuple[str, ...] = ("model.time_step_min", "moe.latent_size")

    def read(self, hf: Mapping[str, Any], reject: Callable[[str, Any, str], None]) -> tuple[dict, dict]:
        """``(model, moe)`` fields from config.json dict ``hf``; ``reject(key, value, why)`` raises."""
        floor = hf.get("time_step_min", 0.001)
        if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not floor >= 0:
            reject("time_step_min", floor, "Mamba-2's floor on its time steps: a number >= 0")
        latent = hf.get("moe_latent_size")
        if latent is not None and (not isinstance(latent, int) or isinstance(latent, bool) or latent < 1):
            reject("moe_latent_size", latent, "the experts' latent width: an int >= 1, or null (hidden_size)")
        return {"time_step_min": float(floor)}, {"latent_size": latent}

    def write(self, cfg: ExperimentConfig) -> dict[str, Any]:
        return {"time_step_min": cfg.model.time_step_min, "moe_latent_size": cfg.moe.latent_size}

    def problems(self, cfg: ExperimentConfig, name: str) -> list[str]:
        """Nothing beyond the :class:`FamilySpec` fields."""
        return []
