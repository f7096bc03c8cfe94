"""Hugging Face checkpoints in and out: the generic engine over :mod:`moefast.interop.families`.

Dimension letters: L layers, D d_model, H query heads, G key/value heads, Hd head_dim, F d_ff (of
the routed experts), Fd dense d_ff, Fs shared-expert d_ff, E experts, V vocab.

A Hugging Face (HF) model directory holds ``config.json`` and its weights in ``*.safetensors``
files (one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``). Each family
moefast supports is one :class:`~moefast.interop.families.FamilySpec` in
:data:`~moefast.interop.families.REGISTRY` (its config keys and tensor table); this module reads
and writes any of them and names none.

* :func:`config_from_hf` reads ``config.json`` into an :class:`~moefast.config.ExperimentConfig`
  (``model`` and ``moe`` sections from the checkpoint, everything else from a base config and
  overrides). Hybrid families (Qwen3-Next, Qwen3.5-MoE) give ``model.layer_types`` (transformers'
  default from ``full_attention_interval`` when absent), the ``linear_*`` keys, the attention output
  gate and zero-centred norms; a vision-language config (Qwen3.5-MoE's ``qwen3_5_moe``) is read
  from its ``text_config``. Options moefast does not implement (sliding windows, RoPE scaling other than the
  YaRN of families with ``yarn``, partial rotary outside families with ``partial_rotary``, a
  ``scoring_func`` / ``topk_method`` the family's router does not compute, a family's own
  ``unsupported`` keys, a ``quantization_config`` other than FP8 blocks, unknown
  ``model_type``) raise :class:`HFFormatError` naming the field.
* :func:`load_hf_params` streams the weights tensor by tensor into moefast's parameters (either
  layer layout, ``model.scan_layers``), each straight into its target sharding: a device's shard
  of an expert tensor reads only that device's experts from disk, so no host holds the whole model.
  Both on-disk expert layouts are read: one tensor per expert (what ``save_pretrained`` writes by
  default) and fused ``experts.gate_up_proj`` [E, 2F, D] / ``experts.down_proj`` [E, D, F]
  (transformers 5's in-memory layout, ``save_pretrained(save_original_format=False)``).
  Multi-token-prediction layers (DeepSeek-V3, GLM-4.5: ``num_nextn_predict_layers`` layers after
  ``num_hidden_layers``, their copies of the embedding and output head equal to the main ones,
  which moefast shares; Qwen3-Next, Qwen3.5: ``mtp_num_hidden_layers`` layers ``mtp.layers.{j}``
  with one ``mtp.fc``, its norms and ``mtp.norm``, at most one of them) are read into the model's
  ``model.mtp_depth`` MTP modules (by default as many as the files hold, see
  :func:`config_from_hf`); layers beyond ``model.mtp_depth`` are skipped with a note.
  transformers' forward pass never runs them (vLLM's speculative decoding does). FP8 block-quantized
  checkpoints (DeepSeek-V3/R1, Kimi K2 on the hub: F8_E4M3 weights [O, I] with float32
  ``weight_scale_inv`` [ceil(O/BO), ceil(I/BI)], config.json's ``quantization_config``) are
  dequantized on read, tensor by tensor, to float32 (with a note); every other quantization is
  refused naming ``quantization_config.quant_method``. Parts of a checkpoint that a family marks
  as not read (``FamilySpec.skipped_tensors``: a vision tower, ``mtp.*`` tensors beyond
  ``mtp_num_hidden_layers``) are left out with one note.
* :func:`load_hf_routing` reads a router's selection bias (``e_score_correction_bias`` [E] per MoE
  layer) into moefast's routing state ``{"bias": [L_moe, E], "load_ema": [L_moe, E]}`` float32,
  where moefast keeps it (out of the parameters and the optimizer).
* :func:`save_hf` writes the reverse: safetensors (sharded above ``max_shard_bytes``, with the
  index; the routing state's bias as each MoE layer's ``e_score_correction_bias``; the MTP
  modules as layers ``num_hidden_layers + k - 1`` with ``num_nextn_predict_layers``, or as
  Qwen3-Next's ``mtp.*`` with ``mtp_num_hidden_layers``), a
  ``config.json`` that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, and the
  tokenizer files of a run that has them. A model read from a vision-language checkpoint is
  written as its text model (``FamilySpec.export_as``: Qwen3.5-MoE as ``qwen3_5_moe_text``). A
  tensor that several parameters share (Qwen3-Next's gated ``q_proj``: query and gate rows per
  head) is assembled from the :class:`~moefast.interop.families.Part` s their transforms write.

Conventions (checked against transformers 5.24 by ``tests/interop/test_hf.py``): HF linear weights
are [out, in] (moefast's are [in, out]); moefast fuses q|k|v into one [D, (H + 2G)·Hd] matrix and
each SwiGLU's gate|up into [D, 2F] (gate first, as HF's ``gate_up_proj``); both use split-half
RoPE (``rotate_half``) with ``inv_freq = base^(-2i/Hd)``, so q/k weights need no permutation,
except the RoPE columns of checkpoints stored interleaved (DeepSeek's ``rope_interleave``), permuted
once per parameter by the family's ``rope_interleave`` table at import and back at export.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes  # registers bfloat16 with numpy, so safetensors' numpy API reads BF16; float8 for FP8
import numpy as np
from flax import nnx

from moefast.config import (PARAMETER_KEYS, ConfigError, ExperimentConfig, ModelConfig, _merge, load_config,
                            parse_overrides)
from moefast.interop import families
from moefast.interop.families import FamilySpec, Transform
from moefast.model.layout import layer_layout, to_layout
from moefast.model.transformer import build_model

__all__ = ["FAMILIES", "HFFormatError", "config_from_hf", "family_spec", "hf_config", "hf_family", "load_hf",
           "load_hf_params", "load_hf_routing", "save_hf"]


class _Architectures(Mapping[str, str]):
    """A live view of :data:`~moefast.interop.families.REGISTRY`: ``model_type`` -> architecture."""

    def __getitem__(self, model_type: str) -> str:
        return families.REGISTRY[model_type].architecture

    def __iter__(self) -> Iterator[str]:
        return iter(families.REGISTRY)

    def __len__(self) -> int:
        return len(families.REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


FAMILIES: Mapping[str, str] = _Architectures()
"""HF ``model_type`` -> architecture class, the families moefast reads and writes (a view of
:data:`moefast.interop.families.REGISTRY`)."""

_IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class HFFormatError(ConfigError):
    """A Hugging Face checkpoint (or a config to export as one) uses something moefast cannot
    represent, or its files do not match its ``config.json``."""


# ----------------------------------------------------------------------------------------- config
def hf_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an HF model directory, as a dict.

    Raises:
      HFFormatError: no such directory or file, or not valid JSON.
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        raise HFFormatError(f"{f} not found: pass a Hugging Face model directory (config.json and *.safetensors)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{f} is not valid JSON ({e})") from None


def family_spec(model_type: str | None) -> FamilySpec:
    """The :class:`~moefast.interop.families.FamilySpec` of an HF ``model_type``.

    Raises:
      HFFormatError: ``model_type`` is missing or not in the registry (the message lists the
        supported families).
    """
    supported = sorted(families.REGISTRY)
    if model_type is None:
        raise HFFormatError(f"config.json has no model_type; moefast reads {supported}")
    spec = families.REGISTRY.get(model_type)
    if spec is None:
        raise HFFormatError(f"config.json: model_type {model_type!r} is not supported; moefast reads {supported} "
                            "(a new family is one FamilySpec in moefast/interop/families.py)")
    return spec


_TOP_LEVEL_KEYS = ("tie_word_embeddings", "quantization_config")
"""Keys a composite (vision-language) config.json keeps at its top level for the whole model, which
transformers' composite model reads there rather than in ``text_config``."""


def _language_config(hf: dict) -> dict[str, Any]:
    """The language model's keys of a ``config.json`` dict: itself, or for a family with a
    ``text_config_key`` (a vision-language checkpoint) that sub-dict with the top level's
    ``model_type`` and :data:`_TOP_LEVEL_KEYS`.

    Raises:
      HFFormatError: unknown ``model_type``, or the sub-dict is missing.
    """
    spec = family_spec(hf.get("model_type"))
    key = spec.text_config_key
    if key is None:
        return hf
    text = hf.get(key)
    if not isinstance(text, dict):
        raise HFFormatError(f"config.json: {key}={text!r} ({spec.model_type}): {spec.name} keeps its language "
                            f"model's config in {key!r}, a dict")
    return {**text, **{k: hf[k] for k in _TOP_LEVEL_KEYS if k in hf}, "model_type": hf["model_type"]}


def _hf_sections(hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model, moe)`` config sections of an HF ``config.json`` dict."""
    spec = family_spec(hf.get("model_type"))
    hf = _language_config(hf)

    def reject(field: str, value: Any, why: str) -> None:
        raise HFFormatError(f"config.json: {field}={value!r} ({spec.model_type}) is not supported: {why}")

    def get(key: str) -> Any:  # transformers' default where config.json omits the key
        v = hf.get(key)
        return spec.hf_defaults[key] if v is None else v

    _fp8_block(hf)  # the one quantization moefast reads (dequantized), or an error naming the field
    if hf.get("hidden_act", "silu") != "silu":
        reject("hidden_act", hf["hidden_act"], "moefast's experts are SwiGLU (silu)")
    for field in ("rope_parameters", "rope_scaling"):  # 5.x writes the first; older files (and guides) the second
        rope = hf.get(field) or {}
        if "full_attention" in rope or "sliding_attention" in rope:
            reject(field, rope, "RoPE parameters per layer type (sliding-window layers)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default") and not (rope_type == "yarn" and spec.yarn):
            reject(f"{field}.rope_type", rope_type,
                   f"moefast implements plain RoPE and YaRN for {spec.name}" if spec.yarn else
                   "moefast implements plain RoPE only (no linear/dynamic/YaRN/LongRoPE/Llama-3 scaling)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    partial = spec.hf_defaults.get("partial_rotary_factor", 1.0) if partial is None else partial
    if partial != 1 and not spec.partial_rotary:
        reject("partial_rotary_factor", partial, f"{spec.name}'s attention rotates every feature of a head")
    theta = rope.get("rope_theta", hf.get("rope_theta")) or spec.hf_defaults["rope_theta"]
    for key, why in spec.unsupported.items():
        if hf.get(key) not in (None, False):
            reject(key, hf[key], why)
    if hf.get("use_sliding_window"):
        reject("use_sliding_window", True, "sliding-window attention")
    d, n_layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    if spec.layer_types is None:
        if any(t != "full_attention" for t in hf.get("layer_types") or []):
            reject("layer_types", hf["layer_types"], "only full_attention layers")
        layer_types = None
    else:
        try:
            layer_types = spec.layer_types.types(hf, n_layers)
        except ValueError as err:
            reject(spec.layer_types.key, hf.get(spec.layer_types.key), str(err))
    kv = hf.get("num_key_value_heads") or spec.hf_defaults.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or spec.hf_defaults.get("head_dim") or d // heads
    e = next((hf[k] for k in spec.num_experts_keys if hf.get(k) is not None), None)
    if not e:
        reject(spec.num_experts_keys[0], e, "a model without experts; moefast needs at least one MoE layer")
    layer_keys = spec.moe_layers.keys
    layer_values = tuple(hf.get(k) for k in layer_keys)
    layer_field, layer_value = "/".join(layer_keys), layer_values[0] if len(layer_values) == 1 else layer_values
    try:
        moe_at = spec.moe_layers.moe_layers(hf, n_layers)
    except ValueError as err:
        reject(layer_field, layer_value, str(err))
    if not any(moe_at):
        reject(layer_field, layer_value, "every layer is dense")
    ids = [i for i, m in enumerate(moe_at) if m]
    nd = ids[0]
    every = ids[1] - ids[0] if len(ids) > 1 else n_layers - nd  # one MoE layer: the rest are dense
    if moe_at != [i >= nd and (i - nd) % every == 0 for i in range(n_layers)]:
        reject(layer_field, layer_value,
               f"MoE layers {ids}: moefast's layers are num_dense_layers leading dense ones, then every "
               "moe_every-th one MoE")
    f = hf[spec.expert_ff_key]
    dense_ff = hf.get(spec.dense_ff_key) if spec.dense_ff_key else None
    b = spec.attention_bias
    qk_norm = spec.qk_norm if spec.qk_norm_key is None or hf.get(spec.qk_norm_key) else "none"
    model = dict(d_model=d, num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, d_ff=f,
                 dense_d_ff=dense_ff if dense_ff != f else None, vocab_size=hf["vocab_size"],
                 max_seq_len=hf.get("max_position_embeddings", 4096), position_encoding="rope",
                 rope_base=float(theta), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                 num_dense_layers=nd, moe_every=every, norm_eps=float(get("rms_norm_eps")),
                 attention_bias=b.covers if b is not None and hf.get(b.key, b.default) else "none",
                 qk_norm=qk_norm, init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0)
    if spec.partial_rotary:
        model["partial_rotary_factor"] = float(partial)
    if layer_types is not None:
        model.update(layer_types=layer_types, **{k: int(get(k)) for k in families.LINEAR_KEYS})
    if spec.attention_output_gate:
        model["attention_output_gate"] = True
    if spec.zero_centered_norm:
        model["zero_centered_norm"] = True
    if spec.mla:
        r = hf["qk_rope_head_dim"]
        model.update(attention="mla", q_lora_rank=hf.get("q_lora_rank") or None, kv_lora_rank=hf["kv_lora_rank"],
                     qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=r, v_head_dim=hf["v_head_dim"],
                     num_kv_heads=None, head_dim=r)  # transformers sets head_dim to qk_rope_head_dim
    if rope.get("rope_type", rope.get("type")) == "yarn":
        if rope.get("truncate", True) is not True or rope.get("attention_factor") is not None:
            reject("rope_parameters", rope, "YaRN with truncate=false or an explicit attention_factor")
        # as transformers: a top-level original_max_position_embeddings wins, else the rope dict's, else
        # max_position_embeddings; a null factor is max_position_embeddings / that
        original = (hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                    or hf.get("max_position_embeddings"))
        if "factor" not in rope:
            reject("rope_parameters", rope, "YaRN needs its context-extension factor; the 'factor' key is missing")
        factor = rope["factor"]
        if factor is None and original and hf.get("max_position_embeddings"):
            factor = hf["max_position_embeddings"] / original
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1:
            reject("rope_parameters.factor", factor, "YaRN's context-extension factor is a number >= 1")
        if not isinstance(original, int) or original < 1:
            reject("original_max_position_embeddings", original, "YaRN needs the pretraining context length")
        if factor > 1:  # factor 1: YaRN's frequencies and attention factor are RoPE's (read as plain RoPE)
            model.update(rope_type="yarn", rope_factor=float(factor), original_max_position_embeddings=original,
                         beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                         mscale=rope.get("mscale") or None, mscale_all_dim=rope.get("mscale_all_dim") or None)
    shared = spec.shared_expert
    shared_ff = 0
    if shared is not None:
        shared_ff = hf.get(shared.ff_key) or 0
        if shared.count_key is not None:
            shared_ff *= get(shared.count_key) or 0
    norm_key = spec.norm_topk_prob_key
    moe = dict(num_experts=e, top_k=get("num_experts_per_tok"),
               norm_topk_prob=(spec.fixed_norm_topk_prob if norm_key is None
                               else bool(get(norm_key) if norm_key in spec.hf_defaults else hf.get(norm_key, False))),
               shared_expert_d_ff=shared_ff, shared_expert_gate=shared.gated if shared is not None else True,
               **_router_sections(spec, hf, get, reject))
    if hf.get("router_aux_loss_coef") is not None:
        moe["aux_loss_coef"] = float(hf["router_aux_loss_coef"])
    return model, moe


def _router_sections(spec: FamilySpec, hf: dict, get: Callable[[str], Any],
                     reject: Callable[[str, Any, str], None]) -> dict[str, Any]:
    """moefast's ``moe.score_func``, ``num_groups``, ``topk_groups`` and ``routed_scaling_factor`` from
    config.json's ``scoring_func``, ``topk_method``, ``n_group``, ``topk_group`` and
    ``routed_scaling_factor`` (the family's :class:`~moefast.interop.families.Router`); the family's
    HF code decides what a key it lacks means."""
    r = spec.router
    score = hf.get("scoring_func") or r.score_func
    if score != r.score_func:
        reject("scoring_func", score, f"{spec.name}'s router computes {r.score_func} scores")
    out: dict[str, Any] = {"score_func": r.score_func}
    if r.topk_methods:
        method = hf.get("topk_method") or r.default_method
        if method not in r.topk_methods:
            reject("topk_method", method, f"{spec.name} routes by {' or '.join(r.topk_methods)}")
        groups = (hf.get("n_group") or spec.hf_defaults.get("n_group") or 1) if r.topk_methods[method] else 1
        kept = hf.get("topk_group") or spec.hf_defaults.get("topk_group") or groups  # greedy ignores the groups
        out.update(num_groups=groups, topk_groups=kept if groups > 1 else 1)
    if r.scaling_key is not None:
        out["routed_scaling_factor"] = float(get(r.scaling_key))
    return out


def config_from_hf(path: str | Path, overrides: list[str] | None = None, *,
                   base: ExperimentConfig | None = None) -> ExperimentConfig:
    """The experiment config of an HF model directory.

    The ``model`` section and the MoE layer's shape and routing (``num_experts``, ``top_k``,
    ``norm_topk_prob``, the shared expert, ``aux_loss_coef`` from ``router_aux_loss_coef``) come
    from ``config.json``; every other key from ``base`` (default: the shipped ``configs/tiny.yaml``);
    ``data.tokenizer`` is the directory when it holds a ``tokenizer.json``. ``overrides``
    (``section.key=value``) apply last, except to the keys that decide parameter shapes.

    ``model.mtp_depth`` is the number of multi-token-prediction layers the checkpoint holds: its
    ``num_nextn_predict_layers`` / ``mtp_num_hidden_layers`` (the family's ``mtp_key``) where the
    files hold those layers' tensors, else 0 (transformers' ``save_pretrained`` writes the key but
    never the layers). Override it to load fewer (``model.mtp_depth=0``: none, the next-token model
    only).

    Args:
      path: HF model directory.
      overrides: e.g. ``["train.steps=100", "data.source=my.jsonl", "moe.capacity_factor=0"]``.
      base: config the non-HF sections come from.

    Returns:
      The :class:`~moefast.config.ExperimentConfig`, named after the directory.

    Raises:
      HFFormatError: missing or unsupported ``config.json`` (the message names the field), an
        override of a key fixed by the checkpoint, or MTP layers that ``model.mtp_depth`` modules
        cannot hold exactly (more than the family's ``mtp_max_depth``, e.g. Qwen3-Next's
        ``mtp_num_hidden_layers: 2``; a Qwen3-Next MTP layer whose MLP would be dense; an
        ``mtp_unsupported`` key set): the message names the key and the depth that can be read.
      ConfigError: a bad override.
    """
    path = Path(path)
    hf = hf_config(path)
    hf_model, hf_moe = _hf_sections(hf)
    hf = _language_config(hf)
    raw = (base or load_config(None)).to_dict()
    raw["name"] = path.resolve().name
    raw["model"] = {**hf_model, "mtp_depth": _mtp_layers_on_disk(path, family_spec(hf["model_type"]), hf)}
    raw["moe"] = {**raw["moe"], **hf_moe}
    if (path / "tokenizer.json").is_file():
        raw["data"] = {**raw["data"], "tokenizer": str(path.resolve())}
    extra = parse_overrides(list(overrides or []))
    for sec, keys in PARAMETER_KEYS.items():
        for k in keys:
            if k in extra.get(sec, {}):
                raise HFFormatError(f"{sec}.{k} is fixed by {path / 'config.json'} (the weights' shapes or "
                                    "their meaning depend on it); drop the override")
    try:
        cfg = ExperimentConfig.from_dict(_merge(raw, extra), where=f"{path / 'config.json'} + overrides")
    except ConfigError as err:  # a value from config.json: name its key there too
        key = str(err).split(":", 1)[0]
        sec, _, field = key.partition(".")
        hf_key = _HF_KEYS.get(key) or (field if sec == "model" and field in hf else None)
        if hf_key is None or field in extra.get(sec, {}):
            raise
        raise HFFormatError(f"{path / 'config.json'}: {hf_key}={hf.get(hf_key)!r} gives {err}") from None
    _check_mtp(family_spec(hf["model_type"]), hf, cfg.model, path)
    return cfg


_HF_KEYS = {"model.d_model": "hidden_size", "model.num_layers": "num_hidden_layers",
            "model.num_heads": "num_attention_heads", "model.num_kv_heads": "num_key_value_heads",
            "moe.top_k": "num_experts_per_tok", "moe.num_groups": "n_group", "moe.topk_groups": "topk_group",
            "moe.routed_scaling_factor": "routed_scaling_factor", "model.vocab_size": "vocab_size",
            "model.max_seq_len": "max_position_embeddings", "model.norm_eps": "rms_norm_eps"}
"""moefast config keys whose value :func:`config_from_hf` takes from a config.json key of another name
(for error messages; a ``model.*`` key of the same name is found as it is)."""



def _problems(spec: FamilySpec, cfg: ExperimentConfig) -> list[str]:
    """What keeps ``spec``'s family from representing ``cfg``'s model exactly (empty: nothing)."""
    m, e, name = cfg.model, cfg.moe, spec.name
    out = []
    qk_norms = (spec.qk_norm,) if spec.qk_norm_key is None else ("none", spec.qk_norm)
    if m.qk_norm not in qk_norms:
        out.append(f"model.qk_norm={m.qk_norm} ({name}'s q/k norms: {' or '.join(qk_norms)})")
    shared = spec.shared_expert
    if shared is None and e.shared_expert_d_ff:
        out.append(f"moe.shared_expert_d_ff={e.shared_expert_d_ff} ({name} has no shared expert)")
    elif shared is not None and not e.shared_expert_d_ff:
        out.append(f"moe.shared_expert_d_ff=0 ({name} has a shared expert)")
    elif shared is not None and e.shared_expert_gate != shared.gated:
        out.append(f"moe.shared_expert_gate={str(e.shared_expert_gate).lower()} ({name} "
                   f"{'gates' if shared.gated else 'does not gate'} its shared expert)")
    elif shared is not None and shared.count_key is not None and e.shared_expert_d_ff % m.d_ff:
        out.append(f"moe.shared_expert_d_ff={e.shared_expert_d_ff} not a multiple of model.d_ff={m.d_ff} ({name}'s "
                   f"shared experts are {shared.count_key} x {shared.ff_key} wide)")
    layers = spec.moe_layers.problem(m, name)
    if layers:
        out.append(layers)
    bias = ("none",) if spec.attention_bias is None else ("none", spec.attention_bias.covers)
    if m.attention_bias not in bias:
        out.append(f"model.attention_bias={m.attention_bias} ({name} has {' or '.join(bias)})")
    if (m.attention == "mla") != spec.mla:
        out.append(f"model.attention={m.attention} ({name}'s attention is {'mla' if spec.mla else 'gqa'})")
    if m.rope_type == "yarn" and not spec.yarn:
        out.append(f"model.rope_type=yarn ({name} has no YaRN scaling here)")
    if m.partial_rotary_factor != 1 and not spec.partial_rotary:
        out.append(f"model.partial_rotary_factor={m.partial_rotary_factor} ({name} rotates every feature of a head)")
    if spec.norm_topk_prob_key is None and e.norm_topk_prob != spec.fixed_norm_topk_prob:
        out.append(f"moe.norm_topk_prob={str(e.norm_topk_prob).lower()} ({name} "
                   f"{'always' if spec.fixed_norm_topk_prob else 'never'} renormalises)")
    r = spec.router
    if e.score_func != r.score_func:
        out.append(f"moe.score_func={e.score_func} ({name} scores experts by {r.score_func})")
    if e.num_groups > 1 and e.topk_groups < e.num_groups and not any(r.topk_methods.values()):
        out.append(f"moe.num_groups={e.num_groups} with topk_groups={e.topk_groups} ({name} has no group-limited "
                   "routing)")
    if e.routed_scaling_factor != 1 and r.scaling_key is None:
        out.append(f"moe.routed_scaling_factor={e.routed_scaling_factor} ({name} never scales its gates)")
    if e.aux_free_bias_rate > 0 and r.selection_bias is None:
        out.append(f"moe.aux_free_bias_rate={e.aux_free_bias_rate} ({name}'s router has no selection bias, which "
                   "changes the chosen experts)")
    out += _mtp_problems(spec, m)
    if "linear_attention" in (m.layer_types or ()) and spec.layer_types is None:
        out.append(f"model.layer_types with linear_attention layers ({name}'s layers are full attention)")
    if m.attention_output_gate != spec.attention_output_gate:
        out.append(f"model.attention_output_gate={str(m.attention_output_gate).lower()} ({name} "
                   f"{'gates' if spec.attention_output_gate else 'does not gate'} its attention output)")
    if m.zero_centered_norm != spec.zero_centered_norm:
        out.append(f"model.zero_centered_norm={str(m.zero_centered_norm).lower()} ({name}'s RMSNorms apply "
                   f"{'1 + w' if spec.zero_centered_norm else 'w'})")
    out += [message for fails, message in spec.model_checks if fails(cfg)]
    return out


def hf_family(cfg: ExperimentConfig, family: str | None = None) -> str:
    """The HF ``model_type`` that represents ``cfg``'s model exactly: ``family`` when given, else
    the first family of :data:`~moefast.interop.families.REGISTRY` whose spec fits (q/k norms,
    shared expert, dense layers, attention biases, partial rotary, gate renormalisation, scores,
    token mixers (``model.layer_types``), attention output gate, zero-centred norms,
    group limits, gate scaling, a learned selection bias, multi-token prediction, the spec's own
    ``model_checks``). A family that transformers does not know (``FamilySpec.export_as``, e.g.
    ``kimi_k2``) stands for the one it is written as (``deepseek_v3``).

    Raises:
      HFFormatError: no family represents the model, or ``family`` is unknown or does not; the
        message names the objections.
    """
    m, e = cfg.model, cfg.moe
    if m.position_encoding != "rope":
        raise HFFormatError("model.position_encoding: HF MoE families use RoPE; 'sinusoidal' cannot be exported")
    if family is not None:
        if family not in families.REGISTRY:
            raise HFFormatError(f"family {family!r} is not one moefast writes; known: {', '.join(families.REGISTRY)}")
        family = families.REGISTRY[family].export_as or family
        problems = _problems(families.REGISTRY[family], cfg)
        if problems:
            raise HFFormatError(f"{family} cannot represent this model: it has " + "; ".join(problems))
        return family
    problems = {}
    for model_type, spec in families.REGISTRY.items():
        if spec.export_as:
            continue
        problems[model_type] = _problems(spec, cfg)
        if not problems[model_type]:
            return model_type
    closest = sorted(problems.items(), key=lambda kv: len(kv[1]))  # stable: registry order among equals
    raise HFFormatError("no Hugging Face family represents this model (closest first):"
                        + "".join(f"\n  as {t} it has " + "; ".join(p) for t, p in closest))


def _export_config(cfg: ExperimentConfig, spec: FamilySpec, vocab_size: int, dtype: str,
                   special: dict[str, int | None]) -> dict[str, Any]:
    m, e = cfg.model, cfg.moe
    dense = [i for i in range(m.num_layers) if not m.is_moe_layer(i)]
    out: dict[str, Any] = {
        "architectures": [spec.architecture], "model_type": spec.model_type, "vocab_size": vocab_size,
        "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_base},
        "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu", "num_experts_per_tok": e.top_k,
        "initializer_range": m.init_std, "attention_dropout": 0.0, "use_cache": True,
        "router_aux_loss_coef": e.aux_loss_coef, "output_router_logits": False, "dtype": dtype,
        **special,
    }
    if spec.dense_ff_key:
        out[spec.dense_ff_key] = m.dense_ff
    out[spec.expert_ff_key] = m.d_ff
    out[spec.num_experts_keys[0]] = e.num_experts
    if spec.norm_topk_prob_key:
        out[spec.norm_topk_prob_key] = e.norm_topk_prob
    out.update(spec.moe_layers.to_hf(dense, m.num_layers))
    if spec.attention_bias is not None:
        out[spec.attention_bias.key] = m.attention_bias == spec.attention_bias.covers
    if spec.qk_norm_key is not None:
        out[spec.qk_norm_key] = m.qk_norm != "none"
    if spec.partial_rotary:
        out["partial_rotary_factor"] = out["rope_parameters"]["partial_rotary_factor"] = m.partial_rotary_factor
    if m.rope_type == "yarn":
        out["rope_parameters"].update(rope_type="yarn", factor=m.rope_factor,
                                      original_max_position_embeddings=m.original_max_position_embeddings,
                                      beta_fast=m.beta_fast, beta_slow=m.beta_slow, mscale=m.mscale,
                                      mscale_all_dim=m.mscale_all_dim)
    if spec.mla:
        out.update(q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                   qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_rope_head_dim,
                   num_key_value_heads=m.num_heads)
    if spec.rope_interleave:
        out["rope_interleave"] = True
    shared = spec.shared_expert
    if shared is not None and shared.count_key is not None:
        out[shared.count_key] = e.shared_expert_d_ff // m.d_ff
    elif shared is not None:
        out[shared.ff_key] = e.shared_expert_d_ff
    r = spec.router
    if r.topk_methods:
        out.update(n_group=e.num_groups, topk_group=e.topk_groups)
        if r.write_method:
            out.update(scoring_func=r.score_func, topk_method=r.method(e.num_groups > 1 and e.topk_groups < e.num_groups))
    if r.scaling_key is not None:
        out[r.scaling_key] = e.routed_scaling_factor
    if spec.mtp_key is not None:
        out[spec.mtp_key] = m.mtp_depth
        out.update({k: False for k in spec.mtp_unsupported})
    if spec.layer_types is not None:
        out.update(spec.layer_types.to_hf(tuple(m.layer_type(i) for i in range(m.num_layers))))
        out.update({k: getattr(m, k) for k in families.LINEAR_KEYS})
    out.update({k: v(cfg) if callable(v) else v for k, v in spec.export_constants.items()})
    return out


# --------------------------------------------------------------------------------- tensor mapping
@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One unrolled moefast parameter bound to its HF tensors: a table row of the family's spec with
    the layer filled into ``names`` (expert names still hold ``{e}``) and ``sizes`` the widths of
    the parameter's last axis per name."""

    transform: Transform
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    perm: np.ndarray | None = None  # moefast's columns = HF's[..., perm] (interleaved RoPE features)

    @property
    def expert_axis(self) -> bool:
        return self.transform.expert_axis

    def read(self, get: Callable[..., np.ndarray]) -> np.ndarray:
        """The whole (non-expert) parameter."""
        x = self.transform.read(get, self.names, None)
        return x if self.perm is None else x[..., self.perm]

    def write(self, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
        if self.perm is not None:
            value = value[..., np.argsort(self.perm)]
        return self.transform.write(value, self.names, self.sizes)


def _table(spec: FamilySpec, cfg: ExperimentConfig, i: int, layout: str) -> Mapping[tuple, Any]:
    """The tensor table of layer ``i`` (token mixer and norms, then its MLP's) in expert ``layout``."""
    mlp = spec.moe_tensors[layout] if cfg.model.is_moe_layer(i) else spec.dense_tensors
    mixer = spec.linear_tensors if cfg.model.layer_type(i) == "linear_attention" else spec.layer_tensors
    return {**mixer, **mlp}


def _leaves(spec: FamilySpec, cfg: ExperimentConfig, layout: str,
            shapes: Mapping[tuple, tuple[int, ...]], interleaved: bool = True) -> dict[tuple, _Leaf]:
    """Path in the unrolled parameter tree -> :class:`_Leaf`, for the parameters ``shapes`` (path
    -> shape), in the order of the family's tables (global rows first and last around the layers);
    ``interleaved``: the files' RoPE columns are interleaved pairs (the family's ``rope_interleave``).

    Raises:
      HFFormatError: a parameter the family's tables have no row for.
    """
    if layout not in spec.moe_tensors:
        raise HFFormatError(f"{spec.model_type} has no {layout!r} expert layout; it has {sorted(spec.moe_tensors)}")
    m = cfg.model
    rows: dict[tuple, tuple[Any, int | None, tuple]] = {}  # path -> (row, HF layer, sub-path in its block)
    top = list(spec.global_tensors.items())
    rows.update({p: (row, None, ()) for p, row in top[:1]})
    for i in range(m.num_layers):
        rows.update({("blocks", i) + sub: (row, i, sub) for sub, row in _table(spec, cfg, i, layout).items()})
    rows.update({p: (row, None, ()) for p, row in top[1:]})
    if m.mtp_depth and spec.mtp_key is not None:  # MTP module k: HF layer L + k - 1, or MTP layer k - 1
        has_moe = any(m.is_moe_layer(i) for i in range(m.num_layers))
        block = spec.mtp_block_tensors(layout, has_moe)
        for k in range(m.mtp_depth):
            i = spec.mtp_layer(m.num_layers, k)
            rows.update({("mtp", k) + sub: (row, i, ()) for sub, row in spec.mtp_tensors.items()})
            rows.update({("mtp", k, "block") + sub: (row, i, sub) for sub, row in block.items()})
    unknown = sorted(set(shapes) - set(rows), key=str)
    if unknown:
        raise HFFormatError(f"parameters {unknown[:3]} have no Hugging Face name in {spec.model_type}")
    perms = spec.rope_interleave if interleaved else {}
    return {p: _Leaf(row.transform_for(m), tuple(n.format(i=i, e="{e}") for n in row.names),
                     row.sizes(m, shapes[p][-1]), perms[sub](m) if sub in perms else None)
            for p, (row, i, sub) in rows.items() if p in shapes}


def _disk_layout(spec: FamilySpec, cfg: ExperimentConfig, present: Mapping[str, Any]) -> str:
    """The expert layout whose first MoE layer's expert tensors are all in ``present``."""
    i = next(i for i in range(cfg.model.num_layers) if cfg.model.is_moe_layer(i))
    for layout, table in spec.moe_tensors.items():
        names = [n.format(i=i, e=0) for row in table.values() if row.transform_for(cfg.model).expert_axis
                 for n in row.names]
        if names and all(n in present for n in names):
            return layout
    return "per_expert"  # the missing tensors are reported by name


# ---------------------------------------------------------------------------------------- reading
_SCALE_INV = "_scale_inv"  # FP8 block scales: ``X.weight_scale_inv`` next to ``X.weight``
_QUANT_ADVICE = ("dequantize the checkpoint first (e.g. with the model's own conversion script) or use a "
                 "bf16/fp32 copy of it")


def _fp8_block(hf: Mapping[str, Any]) -> tuple[int, int] | None:
    """The weight block ``(BO, BI)`` of a config.json's FP8 block quantization, ``None`` without a
    ``quantization_config``.

    The format of DeepSeek-V3/R1 and Kimi K2 on the hub (DeepSeek-V3 repo ``README_WEIGHTS.md``):
    ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
    [128, 128]}``, the 128x128 weight blocks of DeepSeek-V3's FP8 training (arXiv 2412.19437,
    sec. 3.3, fine-grained quantization).

    Raises:
      HFFormatError: any other quantization (compressed-tensors, gptq, awq, bitsandbytes, FP8
        without ``weight_block_size`` or in e5m2, static activation scales), naming the field.
    """
    q = hf.get("quantization_config")
    if not q:
        return None

    def reject(field: str, value: Any, why: str) -> None:
        raise HFFormatError(f"config.json: quantization_config.{field}={value!r} is not supported: {why}; "
                            f"{_QUANT_ADVICE}")

    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if method != "fp8":
        reject("quant_method", method, "moefast reads unquantized checkpoints and FP8 block-quantized ones "
                                       "(quant_method 'fp8' with weight_block_size, as DeepSeek-V3 and Kimi K2)")
    if q.get("fmt", "e4m3") != "e4m3":
        reject("fmt", q["fmt"], "FP8 weights are read in e4m3 only")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        reject("activation_scheme", q["activation_scheme"], "static activation scales have no place in moefast")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        reject("weight_block_size", block, "FP8 is read with a [BO, BI] weight block size only (no per-tensor or "
                                           "per-channel scales)")
    return int(block[0]), int(block[1])


def _safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """``(tensor name -> {"dtype", "shape", "data_offsets"}, byte offset of the data)`` of a
    safetensors file: an 8-byte little-endian header length, then that many bytes of JSON; each
    tensor's ``data_offsets`` are relative to the end of the header."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class _Files:
    """The safetensors files of an HF directory: tensor name -> file, read lazily (numpy).

    FP8 block-quantized weights (DeepSeek-V3/R1, Kimi K2: config.json's ``quantization_config``, see
    :func:`_fp8_block`) are dequantized on read, a tensor (or a row block of it) at a time: ``X``
    float8_e4m3fn [..., O, I] with its float32 ``X_scale_inv`` [..., ceil(O/BO), ceil(I/BI)] reads
    as ``X[..., r, c] * X_scale_inv[..., r // BO, c // BI]`` in float32 (DeepSeek-V3 repo
    ``inference/fp8_cast_bf16.py``, ``weight_dequant``). The scales are consumed: they are not in
    ``where``. FP8 bytes are memory-mapped from the file (safetensors' numpy API has no float8).
    """

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFFormatError(f"{index}: not a safetensors index with a weight_map ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f.name for f in path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise HFFormatError(f"{path}: no *.safetensors files (moefast reads safetensors, not pytorch_model.bin)")
        self.handles, self.where = {}, {}
        headers = {}
        for name in files:
            if not (path / name).is_file():
                raise HFFormatError(f"{index} lists {name}, which is missing from {path}")
            try:
                h = safe_open(str(path / name), framework="numpy")
                headers[name] = _safetensors_header(path / name)
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise HFFormatError(f"{path / name} is not a readable safetensors file ({e})") from None
            self.handles[name] = h
            for k in h.keys():
                self.where[k] = name
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise HFFormatError(f"{index} lists {missing[:3]} but those files do not hold them")
        self.block = _fp8_block(hf_config(path)) if (path / "config.json").is_file() else None
        self.fp8: dict[str, tuple[str, int, tuple[int, ...]]] = {}  # FP8 weight -> (file, byte offset, shape)
        self._maps: dict[str, np.memmap] = {}
        self._scale_where = {k: f for k, f in self.where.items() if k.endswith(_SCALE_INV)}
        for k, f in self.where.items():
            header, start = headers[f]
            dtype = header[k]["dtype"]
            if not dtype.startswith("F8"):
                continue
            if dtype != "F8_E4M3":
                raise HFFormatError(f"{path}: tensor {k} is {dtype}; moefast reads FP8 weights in E4M3 only "
                                    f"({_QUANT_ADVICE})")
            if self.block is None:
                raise HFFormatError(f"{path}: tensor {k} is F8_E4M3, but config.json has no quantization_config "
                                    "(quant_method 'fp8' with weight_block_size) saying how it is scaled")
            shape = tuple(header[k]["shape"])
            if len(shape) < 2:
                raise HFFormatError(f"{path}: FP8 tensor {k} has shape {list(shape)}; FP8 blocks need [..., out, in]")
            if k + _SCALE_INV not in self._scale_where:
                raise HFFormatError(f"{path}: FP8 tensor {k} has no {k + _SCALE_INV} (its block scales); "
                                    "the checkpoint is incomplete")
            (bo, bi), scale = self.block, k + _SCALE_INV
            want = shape[:-2] + (-(-shape[-2] // bo), -(-shape[-1] // bi))
            got = tuple(self.handles[self._scale_where[scale]].get_slice(scale).get_shape())
            if got != want:
                raise HFFormatError(f"{path}: {scale} has shape {list(got)}, but {k} {list(shape)} in {bo}x{bi} "
                                    f"blocks (quantization_config.weight_block_size) needs {list(want)}")
            self.fp8[k] = (f, start + header[k]["data_offsets"][0], shape)
        for scale in self._scale_where:
            weight = scale[:-len(_SCALE_INV)]
            if weight not in self.fp8:
                dtype = headers[self.where[weight]][0][weight]["dtype"] if weight in self.where else None
                raise HFFormatError(f"{path}: {scale} holds block scales of {weight}, which is "
                                    f"{dtype or 'missing'}, not an F8_E4M3 weight")
            del self.where[scale]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """float32 array of tensor ``name`` (only ``rows``, a contiguous slice, of its first axis
        when given); an FP8 weight dequantized (for a row slice: the scale rows of the blocks
        that cover it, cropped)."""
        if name in self.fp8:
            return self._dequantized(name, rows)
        s = self.handles[self.where[name]].get_slice(name)
        x = s[rows] if rows is not None else s[:]
        return np.asarray(x, np.float32)

    def _dequantized(self, name: str, rows: slice | None) -> np.ndarray:
        file, offset, shape = self.fp8[name]
        if file not in self._maps:
            self._maps[file] = np.memmap(self.path / file, np.uint8, mode="r")
        size = int(np.prod(shape))
        w = self._maps[file][offset:offset + size].view(ml_dtypes.float8_e4m3fn).reshape(shape)
        lo, hi, _ = (rows or slice(None)).indices(shape[0])
        hi = max(lo, hi)
        bo, bi = self.block
        scale = self.handles[self._scale_where[name + _SCALE_INV]].get_slice(name + _SCALE_INV)
        if len(shape) == 2:  # rows cut the blocked axis: the blocks covering [lo, hi), then crop
            s = np.asarray(scale[lo // bo:-(-hi // bo)], np.float32)
            s = np.repeat(s, bo, axis=0)[lo % bo:lo % bo + hi - lo]
        else:  # rows cut a leading (expert) axis
            s = np.asarray(scale[lo:hi], np.float32)
            s = np.repeat(s, bo, axis=-2)[..., :shape[-2], :]
        s = np.repeat(s, bi, axis=-1)[..., :shape[-1]]
        return w[lo:hi].astype(np.float32) * s

    def close(self) -> None:
        for h in self.handles.values():
            h.__exit__(None, None, None)
        self._maps.clear()


def _check_shape(files: _Files, name: str, want: tuple[int, ...]) -> None:
    got = files.shape(name)
    if got != tuple(want):
        raise HFFormatError(f"{files.path}: tensor {name} has shape {list(got)}, but config.json implies {list(want)}")



def _flat_paths(tree: Any) -> list[tuple[tuple, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), v) for path, v in flat]


def _abstract_params(cfg: ExperimentConfig, vocab_size: int) -> dict:
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, vocab_size))))


def load_hf_params(path: str | Path, cfg: ExperimentConfig, *, shardings: Any = None,
                   log: Callable[[str], None] | None = None) -> dict:
    """Reads the weights of an HF model directory into moefast parameters (float32).

    Tensors are read one by one; each parameter is assembled with
    ``jax.make_array_from_callback`` straight into its sharding, and for expert tensors a device's
    shard reads only its experts (a row slice of a fused tensor, or the per-expert tensors).

    Args:
      path: HF model directory (``config.json``, ``model.safetensors`` or shards with
        ``model.safetensors.index.json``), per-expert or fused expert layout.
      cfg: the experiment, normally from :func:`config_from_hf` on the same directory; its
        ``model.scan_layers`` chooses the layout of the returned tree.
      shardings: pytree of ``jax.sharding.Sharding`` with the parameters' structure (e.g. a
        trainer's ``state_sharding["params"]``); ``None``: the first device.
      log: printer of notes (the multi-token-prediction layers a checkpoint carries beyond
        ``num_hidden_layers`` + ``model.mtp_depth``, which are not read; FP8 block-quantized
        weights dequantized; the tensors of the family's ``skipped_tensors``, e.g. a vision
        tower, one line); ``None``: :func:`warnings.warn`.

    Returns:
      The parameters, a pure dict like ``nnx.to_pure_dict`` of the model's state, float32.

    Raises:
      HFFormatError: an unsupported ``config.json`` (see :func:`config_from_hf`), missing or
        unexpected tensors, a tensor whose shape does not match the config (names the tensor
        and both shapes), ``model.mtp_depth`` above the MTP layers the files hold or above what
        the family holds exactly (see :func:`config_from_hf`), or an MTP
        layer's copy of the embedding or output head that differs from the main one; an FP8
        weight without its ``*_scale_inv``, or one whose shape does not match the weight's blocks
        (names the tensor).
    """
    path = Path(path)
    spec = _family_of(path)
    files = _Files(path)
    m = cfg.model
    vocab = m.vocab_size
    if vocab is None:
        raise HFFormatError("model.vocab_size is null; build the config with config_from_hf")
    hf = _language_config(hf_config(path))
    _check_mtp(spec, hf, m, path)
    on_disk = _mtp_layers_held(files.where, spec, hf)
    if m.mtp_depth > on_disk:
        raise HFFormatError(f"model.mtp_depth={m.mtp_depth}, but {path} holds {on_disk} multi-token-prediction layers "
                            f"({spec.mtp_key}={hf.get(spec.mtp_key) if spec.mtp_key else None} in config.json); "
                            f"import with model.mtp_depth<={on_disk}")
    target = _abstract_params(cfg, vocab)
    unrolled = dict(_flat_paths(to_layout(target, m, scanned=False)))
    interleaved = bool(hf.get("rope_interleave", spec.hf_defaults.get("rope_interleave", False)))
    leaves = _leaves(spec, cfg, _disk_layout(spec, cfg, files.where), {p: a.shape for p, a in unrolled.items()},
                     interleaved)
    expected: dict[str, tuple[int, ...]] = {}
    for p, leaf in leaves.items():
        expected.update(leaf.transform.hf_shapes(leaf.names, unrolled[p].shape, leaf.sizes))
    expected.update({n: (cfg.moe.num_experts,) for n in _bias_names(spec, cfg)})  # read by load_hf_routing
    copies = {n: next((c for c in main if c in files.where), main[0]) for n, main in _mtp_copies(spec, cfg)
              if n in files.where}
    missing = [n for n in expected if n not in files.where]
    if missing:
        raise HFFormatError(f"{path}: {len(missing)} tensors that config.json implies are missing, e.g. "
                            f"{missing[:3]}")
    unexpected = [n for n in files.where if n not in expected and n not in copies
                  and not n.endswith(_IGNORED_TENSORS)]
    mtp = _mtp_tensors(spec, hf, unexpected, m.mtp_depth)
    if mtp:
        unexpected = [n for n in unexpected if n not in mtp]
        note = (f"{path}: {len(mtp)} tensors of the checkpoint's multi-token-prediction layers "
                f"({spec.mtp_key}={hf[spec.mtp_key]} in config.json) are not read (model.mtp_depth="
                f"{m.mtp_depth} reads the first {m.mtp_depth} whole layers)" +
                ("; the imported model predicts the next token only, as transformers' does" if not m.mtp_depth else ""))
        (log or warnings.warn)(note)
    skipped = {p: [n for n in unexpected if n.startswith(p)] for p in spec.skipped_tensors}
    skipped = {p: names for p, names in skipped.items() if names}
    if skipped:
        unexpected = [n for n in unexpected if not n.startswith(tuple(skipped))]
        (log or warnings.warn)(f"{path}: {sum(map(len, skipped.values()))} tensors not read (moefast reads "
                               f"{spec.name}'s language model only): " +
                               "; ".join(f"{spec.skipped_tensors[p]}: {len(names)}" for p, names in skipped.items()))
    if unexpected:
        raise HFFormatError(f"{path}: {len(unexpected)} tensors moefast has no place for, e.g. {unexpected[:3]} "
                            "(an architecture option moefast does not implement?)")
    if files.fp8:
        bo, bi = files.block
        (log or warnings.warn)(f"{path}: FP8 block-quantized weights (block {bo}×{bi}) dequantized to float32 "
                               f"({len(files.fp8)} tensors, config.json's quantization_config)")
    for n, want in expected.items():
        _check_shape(files, n, want)
    for n, main in copies.items():  # moefast shares these with the main model: they must be exact copies
        if main not in files.where or files.shape(n) != files.shape(main):
            raise HFFormatError(f"{path}: {n} should copy {main}, which is missing or of another shape")
        rows = files.shape(n)[0]
        for lo in range(0, rows, 4096):  # a block of rows at a time: no second whole embedding on the host
            block = slice(lo, min(lo + 4096, rows))
            if not np.array_equal(files.get(n, block), files.get(main, block)):
                raise HFFormatError(f"{path}: {n} differs from {main}; moefast's multi-token-prediction modules "
                                    "share the main model's embedding and output head (DeepSeek-V3 sec. 2.2), so "
                                    "this checkpoint cannot be read exactly; import with model.mtp_depth=0")

    layout = layer_layout(m)
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, target)
    sharding_of = dict(_flat_paths(shardings))

    def sources(p: tuple) -> tuple[list[_Leaf], bool]:
        """The unrolled leaves of target path ``p`` and whether it is stacked."""
        if p[0] == "prefix":
            return [leaves[("blocks", i) + p[1:]] for i in layout.prefix], True
        if p[0] == "groups":
            return [leaves[("blocks", i) + p[2:]] for i in layout.groups[p[1]]], True
        if p[0] == "tail":
            return [leaves[("blocks", layout.tail[p[1]]) + p[2:]]], False
        return [leaves[p]], False

    out = {}
    for p, aval in _flat_paths(target):
        sources_p, stacked = sources(p)
        cache: dict[Any, np.ndarray] = {}

        def one(leaf: _Leaf, index: tuple) -> np.ndarray:
            if leaf.expert_axis:
                lo, hi, _ = index[0].indices(cfg.moe.num_experts)
                return leaf.transform.read(files.get, leaf.names, slice(lo, hi))[(slice(None),) + tuple(index[1:])]
            if id(leaf) not in cache:  # whole tensor, once per parameter (every device's shard cuts it)
                cache[id(leaf)] = leaf.read(files.get)
            return cache[id(leaf)][tuple(index)]

        def callback(index: tuple, leaves=sources_p, stacked=stacked, shape=aval.shape) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            if not stacked:
                return one(leaves[0], index)
            lo, hi, _ = index[0].indices(shape[0])
            return np.stack([one(leaves[k], index[1:]) for k in range(lo, hi)])

        out[p] = jax.make_array_from_callback(aval.shape, sharding_of[p], callback)
        cache.clear()
    files.close()
    return _unflatten(target, out)


def _mtp_tensors(spec: FamilySpec, hf: Mapping[str, Any], names: list[str], depth: int) -> set[str]:
    """The ``names`` of multi-token-prediction tensors that ``depth`` (``model.mtp_depth``) MTP
    modules do not read: those of the config.json's ``spec.mtp_key`` layers from layer ``depth``
    on (DeepSeek-V3 sec. 2.2: layers after ``num_hidden_layers``, GLM-4.5's layer 46 or 92;
    Qwen3-Next's ``mtp.layers.{j}``), and with ``depth`` 0 the tensors they share (Qwen3-Next's
    ``mtp.fc``, its norms). Only names not read otherwise may be passed."""
    n = int(hf.get(spec.mtp_key) or 0) if spec.mtp_key is not None else 0
    if not n:
        return set()
    first = spec.mtp_layer(hf["num_hidden_layers"], 0)
    own = {t.format(i=spec.mtp_layer(hf["num_hidden_layers"], k)) for k in range(depth, n)
           for row in spec.mtp_tensors.values() for t in row.names}
    prefix = spec.mtp_name(next(iter(spec.layer_tensors.values())).names[0]).split("{i}")[0]  # "model.layers."
    out = set()
    for name in names:
        index = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
        if name in own or (index.isdigit() and first + depth <= int(index) < first + n):
            out.add(name)
    return out


def _mtp_problems(spec: FamilySpec, m: ModelConfig) -> list[str]:
    """What keeps ``spec``'s family from holding ``m``'s ``model.mtp_depth`` MTP modules exactly
    (empty: nothing), each as ``"model.mtp_depth=D (why)"``."""
    d, name = m.mtp_depth, spec.name
    if not d:
        return []
    if spec.mtp_key is None:
        return [f"model.mtp_depth={d} ({name} has no multi-token prediction layers)"]
    out = []
    if spec.mtp_max_depth is not None and d > spec.mtp_max_depth:
        out.append(f"model.mtp_depth={d} ({name}'s multi-token-prediction layers share one fc, its norms and the "
                   f"final norm, which every moefast MTP module keeps for itself: at most {spec.mtp_max_depth})")
    if spec.mtp_layer_prefix is not None and any(m.is_moe_layer(i) for i in range(m.num_layers)):
        dense = [j for j in range(min(d, m.num_layers)) if not m.is_moe_layer(j)]  # MTP layer j is built as layer j
        if dense:
            out.append(f"model.mtp_depth={d} with layer {dense[0]} dense ({name}'s MTP layer j has layer j's kind of "
                       "MLP; moefast's MTP blocks are MoE in a model with MoE layers)")
    return out


def _check_mtp(spec: FamilySpec, hf: Mapping[str, Any], m: ModelConfig, path: Path) -> None:
    """Raises HFFormatError when ``m``'s ``model.mtp_depth`` MTP modules cannot be read exactly from
    the checkpoint of language-model config ``hf`` (:func:`_mtp_problems`, or a key of the family's
    ``mtp_unsupported`` set), naming the config.json key and the depth that can be read."""
    if not m.mtp_depth or spec.mtp_key is None:
        return  # a family without MTP layers: model.mtp_depth > 0 is caught by the layers on disk
    unsupported = [f"{k}={hf[k]!r} ({why})" for k, why in spec.mtp_unsupported.items() if hf.get(k)]
    problems = _mtp_problems(spec, m) + unsupported
    if not problems:
        return
    most = 0 if unsupported else max(k for k in range(m.mtp_depth)
                                     if not _mtp_problems(spec, dataclasses.replace(m, mtp_depth=k)))
    raise HFFormatError(f"{path / 'config.json'}: {spec.mtp_key}={hf.get(spec.mtp_key)!r} ({spec.model_type}): "
                        f"moefast cannot read these multi-token-prediction layers exactly: {'; '.join(problems)}; "
                        f"import with model.mtp_depth={most}" + (" (the next-token model only)" if not most else
                                                                 f" (reads the first {most} exactly)"))


def _mtp_copies(spec: FamilySpec, cfg: ExperimentConfig) -> list[tuple[str, tuple[str, ...]]]:
    """``(HF name, the main tensors it may copy)`` of the copies each of ``model.mtp_depth`` MTP
    layers keeps of the shared embedding and output head (the family's ``mtp_copies``)."""
    m = cfg.model
    return [(n.format(i=spec.mtp_layer(m.num_layers, k)), main) for k in range(m.mtp_depth)
            for n, main in spec.mtp_copies.items()]


def _mtp_layers_held(names: Mapping[str, Any], spec: FamilySpec, hf: Mapping[str, Any]) -> int:
    """How many of the ``hf[spec.mtp_key]`` multi-token-prediction layers the tensor ``names`` hold
    (each with all of the family's ``mtp_tensors``), counted from the first; 0 for a family
    without them."""
    n = int(hf.get(spec.mtp_key) or 0) if spec.mtp_key is not None else 0
    for k in range(n if spec.mtp_tensors else 0):
        layer = [t.format(i=spec.mtp_layer(hf["num_hidden_layers"], k)) for row in spec.mtp_tensors.values()
                 for t in row.names]
        if not all(t in names for t in layer):
            return k
    return n if spec.mtp_tensors else 0


def _mtp_layers_on_disk(path: Path, spec: FamilySpec, hf: Mapping[str, Any]) -> int:
    """:func:`_mtp_layers_held` by the safetensors files of ``path``; 0 without readable weights
    (reading reports that)."""
    if spec.mtp_key is None or not hf.get(spec.mtp_key) or not spec.mtp_tensors:
        return 0  # no files opened
    try:
        files = _Files(path)
    except HFFormatError:
        return 0
    try:
        return _mtp_layers_held(files.where, spec, hf)
    finally:
        files.close()


def _bias_names(spec: FamilySpec, cfg: ExperimentConfig) -> list[str]:
    """HF names of the MoE layers' selection biases [E], in layer order, then the MTP layers' (row
    j of the routing state's ``bias`` is the j-th, as :func:`~moefast.model.init_routing_state`
    orders them); empty when the family has none."""
    name = spec.router.selection_bias
    m = cfg.model
    layers = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
    if name is None:
        return []
    names = [name.format(i=i) for i in layers]
    if layers and spec.mtp_key is not None:  # the MoE blocks of the MTP layers: the rows after the main model's
        names += [spec.mtp_name(name).format(i=spec.mtp_layer(m.num_layers, k)) for k in range(m.mtp_depth)]
    return names


def load_hf_routing(path: str | Path, cfg: ExperimentConfig, *, shardings: Any = None) -> dict[str, jax.Array]:
    """The routing state of an HF model directory: :func:`~moefast.model.init_routing_state` with,
    for a family whose router has a selection bias (``e_score_correction_bias``, DeepSeek-V3 sec.
    2.1.2: GLM-4.5, DeepSeek-V3), ``bias`` row j = the j-th MoE layer's tensor.

    moefast keeps that bias in the train state's ``routing`` entry (float32, never seen by the
    optimizer), not in the parameters: pass this to the model (``routing_state=``) or to
    :meth:`moefast.train.Trainer.initialize`, or the experts are chosen without it.

    Args:
      path: HF model directory.
      cfg: its experiment config (:func:`config_from_hf`).
      shardings: pytree of ``jax.sharding.Sharding`` like the state (a trainer's
        ``state_sharding["routing"]``); ``None``: the first device.

    Returns:
      ``{"bias": [L_moe, E], "load_ema": [L_moe, E]}`` float32 (``{}`` without MoE layers); the bias
      is zero for a family without one.

    Raises:
      HFFormatError: an unsupported ``config.json``, or a bias tensor missing or of another shape.
    """
    from moefast.model import init_routing_state

    path = Path(path)
    spec = _family_of(path)
    state = {k: np.array(v) for k, v in init_routing_state(cfg).items()}
    names = _bias_names(spec, cfg) if state else []
    if names:
        files = _Files(path)
        try:
            for j, n in enumerate(names):
                if n not in files.where:
                    raise HFFormatError(f"{path}: the selection bias {n} of a {spec.name} MoE layer is missing")
                _check_shape(files, n, (cfg.moe.num_experts,))
                state["bias"][j] = files.get(n)
        finally:
            files.close()
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, state)
    return jax.tree.map(lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i, x=x: x[i]), state, shardings)


def _unflatten(like: Any, values: dict[tuple, Any]) -> Any:
    def build(node, prefix):
        if isinstance(node, dict):
            return {k: build(v, prefix + (k,)) for k, v in node.items()}
        return values[prefix]

    return build(like, ())


def _family_of(path: Path) -> FamilySpec:
    hf = hf_config(path)
    _hf_sections(hf)  # rejects what moefast cannot represent
    return families.REGISTRY[hf["model_type"]]


def load_hf(path: str | Path, overrides: list[str] | None = None, *, base: ExperimentConfig | None = None,
            shardings: Any = None) -> tuple[ExperimentConfig, dict]:
    """``(config, params)`` of an HF model directory: :func:`config_from_hf` then
    :func:`load_hf_params` (see both for the arguments and errors).

    Example::

        cfg, params = moefast.load_hf("path/to/hf-moe-model", ["model.dtype=bfloat16"])
        model = moefast.ModelDef(cfg, cfg.model.vocab_size).module(params)
        logits = model(tokens_bt, drop_tokens=False).logits  # [B, T, V] float32; no capacity: as HF computes

    A family with a selection bias (GLM-4.5, DeepSeek-V3) keeps it in the routing state, not in
    the parameters: add ``routing_state=load_hf_routing(path, cfg)`` to the model call.
    """
    cfg = config_from_hf(path, overrides, base=base)
    return cfg, load_hf_params(path, cfg, shardings=shardings)


# ---------------------------------------------------------------------------------------- writing
def _host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _bias_rows(spec: FamilySpec, cfg: ExperimentConfig, routing_state: dict | None) -> list[tuple[str, np.ndarray]]:
    """``(HF name, float32 [E])`` of each MoE layer's selection bias for ``spec`` (empty for a
    family without one).

    Raises:
      HFFormatError: no routing state for a family with a selection bias; a non-zero bias for a family
        without one.
    """
    names = _bias_names(spec, cfg)
    bias = None if not routing_state else _host(routing_state["bias"]).astype(np.float32)
    if not names:
        if bias is not None and np.any(bias):
            raise HFFormatError(f"the routing state has a non-zero selection bias, which changes the chosen experts; "
                                f"{spec.name}'s router has none, so this model cannot be exported exactly")
        return []
    if bias is None:
        raise HFFormatError(f"{spec.name} has a selection bias per MoE layer (e_score_correction_bias): pass "
                            "routing_state (the run's routing state; moefast.model.init_routing_state(cfg) for none)")
    if bias.shape != (len(names), cfg.moe.num_experts):
        raise HFFormatError(f"routing_state['bias'] has shape {list(bias.shape)}, expected "
                            f"{[len(names), cfg.moe.num_experts]} (MoE layers, experts)")
    return [(n, bias[j]) for j, n in enumerate(names)]


def _copy_rows(spec: FamilySpec, cfg: ExperimentConfig, leaves: Mapping[tuple, _Leaf], values: Mapping[tuple, Any],
               np_dtype: Any) -> Iterator[tuple[str, np.ndarray]]:
    """``(HF name, tensor)`` of the MTP layers' copies of the shared embedding and output head
    (the family's ``mtp_copies``), equal to the main tensors as written."""
    source = {name: p for p, leaf in leaves.items() for name in leaf.names}
    for name, main in _mtp_copies(spec, cfg):
        src = next((c for c in main if c in source), None)
        if src is not None:
            yield name, dict(leaves[source[src]].write(_host(values[source[src]])))[src].astype(np_dtype)


def _joined(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, np.ndarray]]:
    """``(HF name, tensor)`` as the parameters' transforms write them, with the
    :class:`~moefast.interop.families.Part` s of a tensor that several parameters share joined: that
    tensor comes once, when its last rows are written.

    Raises:
      HFFormatError: a family's tables write some rows of a tensor twice or never (a bug in its spec).
    """
    open_parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> (tensor so far, rows written)
    for name, x in tensors:
        if not isinstance(x, families.Part):
            yield name, x
            continue
        if name not in open_parts:
            open_parts[name] = (np.zeros((x.rows,) + x.value.shape[1:], x.value.dtype), np.zeros(x.rows, bool))
        full, written = open_parts[name]
        if written[x.index].any():
            raise HFFormatError(f"rows of {name} are written by two parameters (a bug in the family's tensor tables)")
        full[x.index], written[x.index] = x.value, True
        if written.all():
            del open_parts[name]
            yield name, full
    if open_parts:
        raise HFFormatError(f"some rows of {sorted(open_parts)[:3]} are written by no parameter (a bug in the family's "
                            "tensor tables)")


def _special_ids(cfg: ExperimentConfig, vocab_size: int) -> dict[str, int | None]:
    """BOS/EOS/PAD ids of the run's tokenizer for config.json (``None`` where it has none, or where
    an id is outside the model's vocabulary, e.g. the byte tokenizer's with a smaller model)."""
    from moefast.data import get_tokenizer

    tok = get_tokenizer(cfg.data.tokenizer)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    return {k: (v if v is not None and v < vocab_size else None) for k, v in ids.items()}


def save_hf(cfg: ExperimentConfig, params: dict, out_dir: str | Path, *, routing_state: dict | None = None,
            layout: str = "per_expert", dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
            family: str | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Writes moefast parameters as an HF model directory.

    The directory is assembled next to ``out_dir`` and renamed into place when complete, so an
    interrupted export never leaves a half-written model under ``out_dir``.

    Args:
      cfg: the experiment the parameters belong to.
      params: the parameters (either layer layout; jax arrays, sharded or not, or numpy).
      routing_state: the run's routing state (``{"bias": [L_moe, E], ...}``, the train state's
        ``routing``): its ``bias`` rows are written as the MoE layers' selection biases
        (``e_score_correction_bias``, always float32) of a family that has them, where it is
        required; for other families it must be zero or ``None``.
      out_dir: new directory (must not exist, or be empty).
      layout: ``"per_expert"`` (``experts.{e}.*`` tensors: what ``save_pretrained`` writes by
        default and older readers expect) or ``"fused"`` (``experts.gate_up_proj`` /
        ``experts.down_proj``).
      dtype: ``"float32"`` or ``"bfloat16"`` for the saved tensors.
      max_shard_bytes: bytes per safetensors file; more makes shards and an index.
      family: HF ``model_type`` to write (e.g. ``"glm4_moe_lite"`` for a GLM-4.7-Flash fine-tune,
        which ``deepseek_v3`` represents too); ``None``: the first that fits (:func:`hf_family`).
      log: printer for a one-line summary.

    Returns:
      ``out_dir`` as a ``Path``.

    Raises:
      HFFormatError: no HF family (or not ``family``) represents the model, a non-zero selection
        bias for a family without one, no ``routing_state`` for a family with one, or ``out_dir`` is
        not empty.
      ValueError: a bad ``layout`` or ``dtype``.
    """
    from safetensors.numpy import save_file

    if layout not in ("per_expert", "fused"):
        raise ValueError(f"layout={layout!r}: expected 'per_expert' or 'fused'")
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}.get(dtype)
    if np_dtype is None:
        raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16'")
    spec = families.REGISTRY[hf_family(cfg, family)]
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFFormatError(f"{out_dir} exists and is not an empty directory; choose a new one (nothing is "
                            "overwritten)")
    m = cfg.model
    unrolled = to_layout(params, m, scanned=False)
    vocab = int(unrolled["embed"].shape[0])
    values = dict(_flat_paths(unrolled))
    leaves = _leaves(spec, cfg, layout, {p: np.shape(v) for p, v in values.items()})
    bias_rows = _bias_rows(spec, cfg, routing_state)

    # With several processes every one gathers the tensors (collectives) and process 0 alone writes.
    is_main = jax.process_index() == 0
    tmp = None
    if is_main:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed export to the same place
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export is for other tools and users
    try:
        shards: list[list[str]] = []
        pending: dict[str, np.ndarray] = {}
        size = total = 0

        def flush():
            nonlocal pending, size
            if pending:
                if is_main:
                    save_file(pending, str(tmp / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
                shards.append(list(pending))
                pending, size = {}, 0

        tensors = ((name, x.astype(np_dtype)) for name, x in
                   _joined(name_x for p, leaf in leaves.items() for name_x in leaf.write(_host(values[p]))))
        for name, x in itertools.chain(tensors, _copy_rows(spec, cfg, leaves, values, np_dtype), bias_rows):
            x = np.ascontiguousarray(x)
            if pending and size + x.nbytes > max_shard_bytes:
                flush()
            pending[name] = x
            size += x.nbytes
            total += x.nbytes
        flush()
        if is_main:
            n = len(shards)
            names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
            for k, name in enumerate(names):
                os.replace(tmp / f"shard-{k:05d}.safetensors", tmp / name)
                os.chmod(tmp / name, 0o666 & ~umask)  # safetensors creates its files private (0600)
            if n > 1:
                index = {"metadata": {"total_size": total},
                         "weight_map": {t: names[k] for k, ts in enumerate(shards) for t in ts}}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            special = _special_ids(cfg, vocab)
            hf = _export_config(cfg, spec, vocab, dtype, special)
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            gen = {k: v for k, v in special.items() if k != "pad_token_id" and v is not None}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            tok = Path(cfg.data.tokenizer)
            tok_dir = tok.parent if tok.is_file() else tok
            if cfg.data.tokenizer != "byte" and tok_dir.is_dir():
                for f in _TOKENIZER_FILES:
                    if (tok_dir / f).is_file():
                        shutil.copy2(tok_dir / f, tmp / f)
            if out_dir.exists():
                out_dir.rmdir()  # empty (checked above)
            os.replace(tmp, out_dir)
            if log is not None:
                log(f"wrote {spec.model_type} ({layout} experts, {dtype}) to {out_dir}: {n} safetensors file(s), "
                    f"{total / 2**20:,.1f} MiB")
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
