"""Hugging Face checkpoints in and out: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Dimension letters: L layers, D d_model, H query heads, G key/value heads, Hd head_dim, F d_ff (of
the routed experts), Fd dense d_ff, Fs shared-expert d_ff, E experts, V vocab.

A Hugging Face (HF) model directory holds ``config.json`` and its weights in ``*.safetensors``
files (one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

* :func:`config_from_hf` reads ``config.json`` into an :class:`~moefast.config.ExperimentConfig`
  (``model`` and ``moe`` sections from the checkpoint, everything else from a base config and
  overrides). Options moefast does not implement (sliding windows, RoPE scaling such as YaRN,
  partial rotary, OLMoE's ``clip_qkv``, other architectures such as DeepSeek's MLA) raise
  :class:`HFFormatError` naming the field.
* :func:`load_hf_params` streams the weights tensor by tensor into moefast's parameters (either
  layer layout, ``model.scan_layers``), each straight into its target sharding: a device's shard
  of an expert tensor reads only that device's experts from disk, so no host holds the whole model.
  Both on-disk expert layouts are read: one tensor per expert (``experts.{e}.gate_proj/up_proj/
  down_proj``, Mixtral's ``experts.{e}.w1/w3/w2``, what ``save_pretrained`` writes by default) and
  fused ``experts.gate_up_proj`` [E, 2F, D] / ``experts.down_proj`` [E, D, F] (transformers 5's
  in-memory layout, ``save_pretrained(save_original_format=False)``).
* :func:`save_hf` writes the reverse: safetensors (sharded above ``max_shard_bytes``, with the
  index), a ``config.json`` that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, and
  the tokenizer files of a run that has them.

Conventions (checked against transformers 5.24 by ``tests/interop/test_hf.py``): HF linear weights
are [out, in] (moefast's are [in, out]); moefast fuses q|k|v into one [D, (H + 2G)·Hd] matrix and
each SwiGLU's gate|up into [D, 2F] (gate first, as HF's ``gate_up_proj``); both use split-half
RoPE (``rotate_half``) with ``inv_freq = base^(-2i/Hd)``, so q/k weights need no permutation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so safetensors' numpy API reads BF16
import numpy as np
from flax import nnx

from moefast.config import PARAMETER_KEYS, ConfigError, ExperimentConfig, _merge, load_config, parse_overrides
from moefast.model.layout import layer_layout, to_layout
from moefast.model.transformer import build_model

__all__ = ["FAMILIES", "HFFormatError", "config_from_hf", "hf_config", "hf_family", "load_hf", "load_hf_params",
           "save_hf"]

FAMILIES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
"""HF ``model_type`` -> architecture class, the families moefast reads and writes."""

# Values transformers assumes when config.json omits a field (the config classes' defaults).
_FAMILY_DEFAULTS = {
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_experts_per_tok": 2},
    "qwen2_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 4},
    "qwen3_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8},
    "olmoe": {"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8},
}
_IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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


def _get(hf: dict, family: str, key: str, default: Any = None) -> Any:
    v = hf.get(key)
    return _FAMILY_DEFAULTS[family].get(key, default) if v is None else v


def _moe_layers(hf: dict, family: str, num_layers: int) -> list[bool]:
    if family in ("mixtral", "olmoe"):
        return [True] * num_layers
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step") or 1
    return [i not in only and (i + 1) % step == 0 for i in range(num_layers)]


def _hf_sections(hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model, moe)`` config sections of an HF ``config.json`` dict."""
    family = hf.get("model_type")
    if family is None:
        raise HFFormatError(f"config.json has no model_type; moefast reads {sorted(FAMILIES)}")
    if family not in FAMILIES:
        raise HFFormatError(f"config.json: model_type {family!r} is not supported; moefast reads "
                            f"{sorted(FAMILIES)}")

    def reject(field: str, value: Any, why: str) -> None:
        raise HFFormatError(f"config.json: {field}={value!r} ({family}) is not supported: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        reject("hidden_act", hf["hidden_act"], "moefast's experts are SwiGLU (silu)")
    for field in ("rope_parameters", "rope_scaling"):  # 5.x writes the first; older files (and guides) the second
        rope = hf.get(field) or {}
        if "full_attention" in rope or "sliding_attention" in rope:
            reject(field, rope, "RoPE parameters per layer type (sliding-window layers)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            reject(f"{field}.rope_type", rope_type,
                   "moefast implements plain RoPE only (no linear/dynamic/YaRN/LongRoPE/Llama-3 scaling)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        reject("partial_rotary_factor", partial, "RoPE rotates every feature of a head in moefast")
    theta = rope.get("rope_theta", hf.get("rope_theta")) or _FAMILY_DEFAULTS[family]["rope_theta"]
    if family == "mixtral" and hf.get("sliding_window") is not None:
        reject("sliding_window", hf["sliding_window"], "sliding-window attention; set it to null for full attention")
    if hf.get("use_sliding_window"):
        reject("use_sliding_window", True, "sliding-window attention")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        reject("layer_types", hf["layer_types"], "only full_attention layers")
    if family == "olmoe" and hf.get("clip_qkv") is not None:
        reject("clip_qkv", hf["clip_qkv"], "clipping of q/k/v activations")

    d, n_layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or d // heads
    e = hf.get("num_local_experts") if family == "mixtral" else hf.get("num_experts", hf.get("num_local_experts"))
    if not e:
        reject("num_experts", e, "a model without experts; moefast needs at least one MoE layer")
    moe_at = _moe_layers(hf, family, n_layers)
    if not any(moe_at):
        reject("mlp_only_layers", hf.get("mlp_only_layers"), "every layer is dense")
    ids = [i for i, m in enumerate(moe_at) if m]
    nd = ids[0]
    every = ids[1] - ids[0] if len(ids) > 1 else n_layers - nd  # one MoE layer: the rest are dense
    if moe_at != [i >= nd and (i - nd) % every == 0 for i in range(n_layers)]:
        reject("mlp_only_layers/decoder_sparse_step", (hf.get("mlp_only_layers"), hf.get("decoder_sparse_step")),
               f"MoE layers {ids}: moefast's layers are num_dense_layers leading dense ones, then every "
               "moe_every-th one MoE")
    qwen = family in ("qwen2_moe", "qwen3_moe")
    f = hf["moe_intermediate_size"] if qwen else hf["intermediate_size"]
    dense_ff = hf["intermediate_size"] if qwen and hf["intermediate_size"] != f else None
    if family == "qwen2_moe":
        bias = "qkv" if hf.get("qkv_bias", True) else "none"
    elif family == "mixtral":
        bias = "none"
    else:
        bias = "all" if hf.get("attention_bias") else "none"
    model = dict(d_model=d, num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, d_ff=f,
                 dense_d_ff=dense_ff, vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 4096),
                 position_encoding="rope", rope_base=float(theta), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                 num_dense_layers=nd, moe_every=every, norm_eps=float(_get(hf, family, "rms_norm_eps")),
                 attention_bias=bias, qk_norm={"qwen3_moe": "per_head", "olmoe": "full"}.get(family, "none"),
                 init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0)
    moe = dict(num_experts=e, top_k=_get(hf, family, "num_experts_per_tok"),
               norm_topk_prob=True if family == "mixtral" else bool(hf.get("norm_topk_prob", False)),
               shared_expert_d_ff=(hf.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0,
               shared_expert_gate=True)
    if hf.get("router_aux_loss_coef") is not None:
        moe["aux_loss_coef"] = float(hf["router_aux_loss_coef"])
    return model, moe


def config_from_hf(path: str | Path, overrides: list[str] | None = None, *,
                   base: ExperimentConfig | None = None) -> ExperimentConfig:
    """The experiment config of an HF model directory.

    The ``model`` section and the MoE layer's shape and routing (``num_experts``, ``top_k``,
    ``norm_topk_prob``, the shared expert, ``aux_loss_coef`` from ``router_aux_loss_coef``) come
    from ``config.json``; every other key from ``base`` (default: the shipped ``configs/tiny.yaml``);
    ``data.tokenizer`` is the directory when it holds a ``tokenizer.json``. ``overrides``
    (``section.key=value``) apply last, except to the keys that decide parameter shapes.

    Args:
      path: HF model directory.
      overrides: e.g. ``["train.steps=100", "data.source=my.jsonl", "moe.capacity_factor=0"]``.
      base: config the non-HF sections come from.

    Returns:
      The :class:`~moefast.config.ExperimentConfig`, named after the directory.

    Raises:
      HFFormatError: missing or unsupported ``config.json`` (the message names the field), or an
        override of a key fixed by the checkpoint.
      ConfigError: a bad override.
    """
    path = Path(path)
    hf_model, hf_moe = _hf_sections(hf_config(path))
    raw = (base or load_config(None)).to_dict()
    raw["name"] = path.resolve().name
    raw["model"] = hf_model
    raw["moe"] = {**raw["moe"], **hf_moe}
    if (path / "tokenizer.json").is_file():
        raw["data"] = {**raw["data"], "tokenizer": str(path.resolve())}
    extra = parse_overrides(list(overrides or []))
    for sec, keys in PARAMETER_KEYS.items():
        for k in keys:
            if k in extra.get(sec, {}):
                raise HFFormatError(f"{sec}.{k} is fixed by {path / 'config.json'} (the weights' shapes depend on "
                                    "it); drop the override")
    return ExperimentConfig.from_dict(_merge(raw, extra), where=f"{path / 'config.json'} + overrides")


def hf_family(cfg: ExperimentConfig) -> str:
    """The HF ``model_type`` that represents ``cfg``'s model exactly.

    Qwen2-MoE: a shared expert; Qwen3-MoE: per-head q/k norms; OLMoE: q/k norms over the whole
    projections; Mixtral: none of these, every layer MoE, no attention bias, renormalised gates.

    Raises:
      HFFormatError: no family represents the model; the message names the fields.
    """
    m, e = cfg.model, cfg.moe
    if m.position_encoding != "rope":
        raise HFFormatError("model.position_encoding: HF MoE families use RoPE; 'sinusoidal' cannot be exported")
    if e.aux_free_bias_rate > 0:
        raise HFFormatError("moe.aux_free_bias_rate > 0: the learned selection bias changes which experts are chosen "
                            "and HF MoE routers have no bias; such a model cannot be exported exactly")
    all_moe = all(m.is_moe_layer(i) for i in range(m.num_layers))
    problems = []
    if e.shared_expert_d_ff:
        family = "qwen2_moe"
        if not e.shared_expert_gate:
            problems.append("moe.shared_expert_gate=false (Qwen2-MoE gates its shared expert)")
        if m.qk_norm != "none":
            problems.append(f"model.qk_norm={m.qk_norm} (Qwen2-MoE has none)")
        if m.attention_bias == "all":
            problems.append("model.attention_bias=all (Qwen2-MoE has no output-projection bias)")
    elif m.qk_norm == "per_head":
        family = "qwen3_moe"
        if m.attention_bias == "qkv":
            problems.append("model.attention_bias=qkv (Qwen3-MoE's attention_bias covers the output too: all)")
    elif m.qk_norm == "full":
        family = "olmoe"
        if not all_moe:
            problems.append("dense layers (OLMoE is MoE in every layer)")
        if m.attention_bias == "qkv":
            problems.append("model.attention_bias=qkv (OLMoE's attention_bias covers the output too: all)")
        if m.num_heads * m.head_dim != m.d_model:
            problems.append("model.head_dim * num_heads != d_model (OLMoE's q/k norms assume it)")
    else:
        family = "mixtral"
        if not all_moe:
            problems.append("dense layers (Mixtral is MoE in every layer; Qwen-MoE has dense layers but needs "
                            "per-head q/k norms or a shared expert)")
        if m.attention_bias != "none":
            problems.append(f"model.attention_bias={m.attention_bias} (Mixtral has none)")
        if not e.norm_topk_prob:
            problems.append("moe.norm_topk_prob=false (Mixtral always renormalises)")
    if problems:
        raise HFFormatError(f"no Hugging Face family represents this model: as {family} it has "
                            + "; ".join(problems))
    return family


def _export_config(cfg: ExperimentConfig, family: str, vocab_size: int, dtype: str,
                   special: dict[str, int | None]) -> dict[str, Any]:
    m, e = cfg.model, cfg.moe
    dense = [i for i in range(m.num_layers) if not m.is_moe_layer(i)]
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family]], "model_type": family, "vocab_size": vocab_size,
        "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_base},
        "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu", "num_experts_per_tok": e.top_k,
        "initializer_range": m.init_std, "attention_dropout": 0.0, "use_cache": True,
        "router_aux_loss_coef": e.aux_loss_coef, "output_router_logits": False, "dtype": dtype,
        **special,
    }
    if family == "mixtral":
        out.update(intermediate_size=m.d_ff, num_local_experts=e.num_experts, sliding_window=None,
                   router_jitter_noise=0.0)
    elif family in ("qwen2_moe", "qwen3_moe"):
        out.update(intermediate_size=m.dense_ff, moe_intermediate_size=m.d_ff, num_experts=e.num_experts,
                   norm_topk_prob=e.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense,
                   use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
        if family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=e.shared_expert_d_ff, qkv_bias=m.attention_bias == "qkv")
        else:
            out.update(attention_bias=m.attention_bias == "all")
    else:
        out.update(intermediate_size=m.d_ff, num_experts=e.num_experts, norm_topk_prob=e.norm_topk_prob,
                   attention_bias=m.attention_bias == "all", clip_qkv=None)
    return out


# --------------------------------------------------------------------------------- tensor mapping
@dataclasses.dataclass(frozen=True)
class _Leaf:
    """How one moefast parameter of one layer (unrolled layout) is made of HF tensors.

    ``kind``:
      ``"t"``: ``names[0]`` transposed ([out, in] -> [in, out]); ``"id"``: as it is;
      ``"cat"``: ``names`` transposed and concatenated along the last axis (sizes ``sizes``);
      ``"cat1"``: 1-D ``names`` (biases) concatenated as they are;
      ``"experts_in"`` / ``"experts_out"``: [E, D, 2F] gate|up or [E, F, D] down projections of the
      routed experts, from per-expert tensors (``names`` = (gate, up) or (down,) patterns with
      ``{e}``) or from the fused tensor ``fused``.
    """

    kind: str
    names: tuple[str, ...]
    sizes: tuple[int, ...] = ()
    fused: str | None = None

    @property
    def expert_axis(self) -> bool:
        return self.kind.startswith("experts")


def _layer_leaves(cfg: ExperimentConfig, family: str, i: int, fused: bool) -> dict[tuple, _Leaf]:
    """Sub-path in ``params["blocks"][i]`` -> :class:`_Leaf`, for layer ``i``."""
    m, e = cfg.model, cfg.moe
    p = f"model.layers.{i}."
    a = p + "self_attn."
    hd = m.head_dim
    qkv_sizes = (m.num_heads * hd, m.kv_heads * hd, m.kv_heads * hd)
    out = {("attn_norm", "scale"): _Leaf("id", (p + "input_layernorm.weight",)),
           ("ffn_norm", "scale"): _Leaf("id", (p + "post_attention_layernorm.weight",)),
           ("attn", "qkv"): _Leaf("cat", tuple(a + f"{x}_proj.weight" for x in "qkv"), qkv_sizes),
           ("attn", "out"): _Leaf("t", (a + "o_proj.weight",))}
    if m.attention_bias != "none":
        out[("attn", "qkv_bias")] = _Leaf("cat1", tuple(a + f"{x}_proj.bias" for x in "qkv"), qkv_sizes)
    if m.attention_bias == "all":
        out[("attn", "out_bias")] = _Leaf("id", (a + "o_proj.bias",))
    if m.qk_norm != "none":
        out[("attn", "q_norm", "scale")] = _Leaf("id", (a + "q_norm.weight",))
        out[("attn", "k_norm", "scale")] = _Leaf("id", (a + "k_norm.weight",))
    mlp = p + "mlp."
    if not m.is_moe_layer(i):
        out[("ffn", "w_in")] = _Leaf("cat", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), (m.dense_ff,) * 2)
        out[("ffn", "w_out")] = _Leaf("t", (mlp + "down_proj.weight",))
        return out
    moe = p + ("block_sparse_moe." if family == "mixtral" and not fused else "mlp.")
    x = moe + "experts."
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out[("ffn", "router")] = _Leaf("t", (moe + "gate.weight",))
    out[("ffn", "w_in")] = _Leaf("experts_in", (x + "{e}." + gate + ".weight", x + "{e}." + up + ".weight"),
                                 (m.d_ff,) * 2, fused=x + "gate_up_proj" if fused else None)
    out[("ffn", "w_out")] = _Leaf("experts_out", (x + "{e}." + down + ".weight",),
                                  fused=x + "down_proj" if fused else None)
    if e.shared_expert_d_ff:
        s = mlp + "shared_expert."
        out[("ffn", "shared_w_in")] = _Leaf("cat", (s + "gate_proj.weight", s + "up_proj.weight"),
                                            (e.shared_expert_d_ff,) * 2)
        out[("ffn", "shared_w_out")] = _Leaf("t", (s + "down_proj.weight",))
        if e.shared_expert_gate:
            out[("ffn", "shared_gate")] = _Leaf("t", (mlp + "shared_expert_gate.weight",))
    return out


def _top_leaves(cfg: ExperimentConfig) -> dict[tuple, _Leaf]:
    out = {("embed",): _Leaf("id", ("model.embed_tokens.weight",)),
           ("final_norm", "scale"): _Leaf("id", ("model.norm.weight",))}
    if not cfg.model.tie_embeddings:
        out[("lm_head",)] = _Leaf("t", ("lm_head.weight",))
    return out


# ---------------------------------------------------------------------------------------- reading
class _Files:
    """The safetensors files of an HF directory: tensor name -> file, read lazily (numpy)."""

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
        for name in files:
            if not (path / name).is_file():
                raise HFFormatError(f"{index} lists {name}, which is missing from {path}")
            try:
                h = safe_open(str(path / name), framework="numpy")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise HFFormatError(f"{path / name} is not a readable safetensors file ({e})") from None
            self.handles[name] = h
            for k in h.keys():
                self.where[k] = name
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise HFFormatError(f"{index} lists {missing[:3]} but those files do not hold them")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """float32 array of tensor ``name`` (only ``rows`` of its first axis when given)."""
        s = self.handles[self.where[name]].get_slice(name)
        x = s[rows] if rows is not None else s[:]
        return np.asarray(x, np.float32)


def _check_shape(files: _Files, name: str, want: tuple[int, ...]) -> None:
    got = files.shape(name)
    if got != tuple(want):
        raise HFFormatError(f"{files.path}: tensor {name} has shape {list(got)}, but config.json implies {list(want)}")


def _expected_hf_shapes(leaf: _Leaf, target: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes ``leaf`` needs to build an unrolled moefast parameter of shape ``target``."""
    if leaf.kind == "t":
        return {leaf.names[0]: target[::-1]}
    if leaf.kind == "id":
        return {leaf.names[0]: target}
    if leaf.kind == "cat":
        return {n: (s, target[0]) for n, s in zip(leaf.names, leaf.sizes)}
    if leaf.kind == "cat1":
        return {n: (s,) for n, s in zip(leaf.names, leaf.sizes)}
    e = target[0]
    if leaf.kind == "experts_in":  # target [E, D, 2F]
        if leaf.fused:
            return {leaf.fused: (e, target[2], target[1])}
        return {n.format(e=k): (target[2] // 2, target[1]) for k in range(e) for n in leaf.names}
    if leaf.fused:  # experts_out, target [E, F, D]
        return {leaf.fused: (e, target[2], target[1])}
    return {leaf.names[0].format(e=k): (target[2], target[1]) for k in range(e)}


def _read_leaf(files: _Files, leaf: _Leaf, experts: slice | None) -> np.ndarray:
    """The unrolled moefast parameter (float32), restricted to ``experts`` for expert leaves."""
    if leaf.kind == "t":
        return files.get(leaf.names[0]).T
    if leaf.kind == "id":
        return files.get(leaf.names[0])
    if leaf.kind in ("cat", "cat1"):
        parts = [files.get(n) for n in leaf.names]
        return np.concatenate([x.T for x in parts] if leaf.kind == "cat" else parts, axis=-1)
    if leaf.fused:  # [E, 2F, D] or [E, D, F] -> [E, D, 2F] or [E, F, D]
        return files.get(leaf.fused, experts).transpose(0, 2, 1)
    ids = range(experts.start, experts.stop)
    if leaf.kind == "experts_in":
        return np.stack([np.concatenate([files.get(n.format(e=k)).T for n in leaf.names], axis=-1) for k in ids])
    return np.stack([files.get(leaf.names[0].format(e=k)).T for k in ids])


def _flat_paths(tree: Any) -> list[tuple[tuple, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), v) for path, v in flat]


def _abstract_params(cfg: ExperimentConfig, vocab_size: int) -> dict:
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, vocab_size))))


def load_hf_params(path: str | Path, cfg: ExperimentConfig, *, shardings: Any = None) -> dict:
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

    Returns:
      The parameters, a pure dict like ``nnx.to_pure_dict`` of the model's state, float32.

    Raises:
      HFFormatError: missing or unexpected tensors, or a tensor whose shape does not match the
        config (names the tensor and both shapes).
    """
    path = Path(path)
    family = _family_of(path)
    files = _Files(path)
    m = cfg.model
    vocab = m.vocab_size
    if vocab is None:
        raise HFFormatError("model.vocab_size is null; build the config with config_from_hf")
    target = _abstract_params(cfg, vocab)
    sample = [n for n in files.where if ".experts." in n]
    fused = any(n.endswith("experts.gate_up_proj") for n in sample)
    per_layer = {i: _layer_leaves(cfg, family, i, fused) for i in range(m.num_layers)}
    top = _top_leaves(cfg)
    unrolled = to_layout(target, m, scanned=False)
    expected: dict[str, tuple[int, ...]] = {}
    for sub, aval in _flat_paths(unrolled):
        leaf = top[sub] if sub[0] != "blocks" else per_layer[sub[1]][sub[2:]]
        expected.update(_expected_hf_shapes(leaf, aval.shape))
    missing = [n for n in expected if n not in files.where]
    if missing:
        raise HFFormatError(f"{path}: {len(missing)} tensors that config.json implies are missing, e.g. "
                            f"{missing[:3]}")
    unexpected = [n for n in files.where if n not in expected and not n.endswith(_IGNORED_TENSORS)]
    if unexpected:
        raise HFFormatError(f"{path}: {len(unexpected)} tensors moefast has no place for, e.g. {unexpected[:3]} "
                            "(an architecture option moefast does not implement?)")
    for n, want in expected.items():
        _check_shape(files, n, want)

    layout = layer_layout(m)
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, target)
    sharding_of = dict(_flat_paths(shardings))

    def sources(p: tuple) -> tuple[list[_Leaf], bool]:
        """The per-layer leaves of target path ``p`` and whether it is stacked."""
        if p[0] == "blocks":
            return [per_layer[p[1]][p[2:]]], False
        if p[0] == "prefix":
            return [per_layer[i][p[1:]] for i in layout.prefix], True
        if p[0] == "groups":
            return [per_layer[i][p[2:]] for i in layout.groups[p[1]]], True
        if p[0] == "tail":
            return [per_layer[layout.tail[p[1]]][p[2:]]], False
        return [top[p]], False

    out = {}
    for p, aval in _flat_paths(target):
        leaves, stacked = sources(p)
        cache: dict[Any, np.ndarray] = {}

        def one(leaf: _Leaf, index: tuple) -> np.ndarray:
            if leaf.expert_axis:
                lo, hi, _ = index[0].indices(cfg.moe.num_experts)
                return _read_leaf(files, leaf, slice(lo, hi))[(slice(None),) + tuple(index[1:])]
            if id(leaf) not in cache:  # whole tensor, once per parameter (every device's shard cuts it)
                cache[id(leaf)] = _read_leaf(files, leaf, None)
            return cache[id(leaf)][tuple(index)]

        def callback(index: tuple, leaves=leaves, stacked=stacked, shape=aval.shape) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            if not stacked:
                return one(leaves[0], index)
            lo, hi, _ = index[0].indices(shape[0])
            return np.stack([one(leaves[k], index[1:]) for k in range(lo, hi)])

        out[p] = jax.make_array_from_callback(aval.shape, sharding_of[p], callback)
        cache.clear()
    for h in files.handles.values():
        h.__exit__(None, None, None)
    return _unflatten(target, out)


def _unflatten(like: Any, values: dict[tuple, Any]) -> Any:
    def build(node, prefix):
        if isinstance(node, dict):
            return {k: build(v, prefix + (k,)) for k, v in node.items()}
        return values[prefix]

    return build(like, ())


def _family_of(path: Path) -> str:
    hf = hf_config(path)
    _hf_sections(hf)  # rejects what moefast cannot represent
    return hf["model_type"]


def load_hf(path: str | Path, overrides: list[str] | None = None, *, base: ExperimentConfig | None = None,
            shardings: Any = None) -> tuple[ExperimentConfig, dict]:
    """``(config, params)`` of an HF model directory: :func:`config_from_hf` then
    :func:`load_hf_params` (see both for the arguments and errors).

    Example::

        cfg, params = moefast.load_hf("path/to/Qwen3-30B-A3B", ["model.dtype=bfloat16"])
        model = moefast.ModelDef(cfg, cfg.model.vocab_size).module(params)
        logits = model(tokens_bt, drop_tokens=False).logits  # [B, T, V] float32; no capacity: as HF computes
    """
    cfg = config_from_hf(path, overrides, base=base)
    return cfg, load_hf_params(path, cfg, shardings=shardings)


# ---------------------------------------------------------------------------------------- writing
def _host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _write_leaf(leaf: _Leaf, value: np.ndarray, num_experts: int) -> list[tuple[str, np.ndarray]]:
    """Inverse of :func:`_read_leaf`: the HF tensors of one unrolled moefast parameter."""
    if leaf.kind == "t":
        return [(leaf.names[0], value.T)]
    if leaf.kind == "id":
        return [(leaf.names[0], value)]
    if leaf.kind in ("cat", "cat1"):
        parts = np.split(value, np.cumsum(leaf.sizes)[:-1], axis=-1)
        return [(n, x.T if leaf.kind == "cat" else x) for n, x in zip(leaf.names, parts)]
    if leaf.fused:
        return [(leaf.fused, value.transpose(0, 2, 1))]
    out = []
    for k in range(num_experts):
        if leaf.kind == "experts_in":
            parts = np.split(value[k], len(leaf.names), axis=-1)
            out += [(n.format(e=k), x.T) for n, x in zip(leaf.names, parts)]
        else:
            out.append((leaf.names[0].format(e=k), value[k].T))
    return out


def _special_ids(cfg: ExperimentConfig, vocab_size: int) -> dict[str, int | None]:
    """BOS/EOS/PAD ids of the run's tokenizer for config.json (``None`` where it has none, or where
    an id is outside the model's vocabulary, e.g. the byte tokenizer's with a smaller model)."""
    from moefast.data import get_tokenizer

    tok = get_tokenizer(cfg.data.tokenizer)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    return {k: (v if v is not None and v < vocab_size else None) for k, v in ids.items()}


def save_hf(cfg: ExperimentConfig, params: dict, out_dir: str | Path, *, layout: str = "per_expert",
            dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
            log: Callable[[str], None] | None = None) -> Path:
    """Writes moefast parameters as an HF model directory.

    The directory is assembled next to ``out_dir`` and renamed into place when complete, so an
    interrupted export never leaves a half-written model under ``out_dir``.

    Args:
      cfg: the experiment the parameters belong to (its family: :func:`hf_family`).
      params: the parameters (either layer layout; jax arrays, sharded or not, or numpy).
      out_dir: new directory (must not exist, or be empty).
      layout: ``"per_expert"`` (``experts.{e}.*`` tensors: what ``save_pretrained`` writes by
        default and older readers expect) or ``"fused"`` (``experts.gate_up_proj`` /
        ``experts.down_proj``).
      dtype: ``"float32"`` or ``"bfloat16"`` for the saved tensors.
      max_shard_bytes: bytes per safetensors file; more makes shards and an index.
      log: printer for a one-line summary.

    Returns:
      ``out_dir`` as a ``Path``.

    Raises:
      HFFormatError: no HF family represents the model, or ``out_dir`` is not empty.
      ValueError: a bad ``layout`` or ``dtype``.
    """
    from safetensors.numpy import save_file

    if layout not in ("per_expert", "fused"):
        raise ValueError(f"layout={layout!r}: expected 'per_expert' or 'fused'")
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}.get(dtype)
    if np_dtype is None:
        raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16'")
    family = hf_family(cfg)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFFormatError(f"{out_dir} exists and is not an empty directory; choose a new one (nothing is "
                            "overwritten)")
    m = cfg.model
    unrolled = to_layout(params, m, scanned=False)
    vocab = int(unrolled["embed"].shape[0])
    per_layer = {i: _layer_leaves(cfg, family, i, layout == "fused") for i in range(m.num_layers)}
    top = _top_leaves(cfg)
    order = [(("embed",), top[("embed",)])]
    for i in range(m.num_layers):
        order += [(("blocks", i) + sub, leaf) for sub, leaf in per_layer[i].items()]
    order += [(p, top[p]) for p in top if p != ("embed",)]
    values = dict(_flat_paths(unrolled))
    unknown = sorted(set(values) - {p for p, _ in order})
    if unknown:
        raise HFFormatError(f"parameters {unknown[:3]} have no Hugging Face name in {family}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed export to the same place
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export is for other tools and users
    is_main = jax.process_index() == 0
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

        for p, leaf in order:
            value = _host(values[p])
            for name, x in _write_leaf(leaf, value, cfg.moe.num_experts):
                x = np.ascontiguousarray(x.astype(np_dtype))
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
            hf = _export_config(cfg, family, vocab, dtype, special)
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
                log(f"wrote {family} ({layout} experts, {dtype}) to {out_dir}: {n} safetensors file(s), "
                    f"{total / 2**20:,.1f} MiB")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
