"""Hugging Face ``config.json`` in and out, and the tensor tables both directions walk (the engine
of :mod:`moefast.interop.hf`, which documents the whole; reading weights: :mod:`.hf_read`, writing:
:mod:`.hf_write`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

from moefast.config import PARAMETER_KEYS, ConfigError, ExperimentConfig, _merge, load_config, parse_overrides
from moefast.interop import families
from moefast.interop.families import FamilySpec
from moefast.interop.hf_files import HFFormatError, _fp8_block, hf_config
from moefast.interop.hf_tables import _check_mtp, _mtp_layers_on_disk, _mtp_problems


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


# ----------------------------------------------------------------------------------------- config
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
    ``model_type`` and :data:`_TOP_LEVEL_KEYS`; for a family with ``config_keys`` (Kimi Linear), in
    the engine's keys.

    Raises:
      HFFormatError: unknown ``model_type``, the sub-dict is missing, or a key the family's
        ``config_keys`` refuses.
    """
    spec = family_spec(hf.get("model_type"))
    key = spec.text_config_key
    if key is not None:
        text = hf.get(key)
        if not isinstance(text, dict):
            raise HFFormatError(f"config.json: {key}={text!r} ({spec.model_type}): {spec.name} keeps its language "
                                f"model's config in {key!r}, a dict")
        hf = {**text, **{k: hf[k] for k in _TOP_LEVEL_KEYS if k in hf}, "model_type": hf["model_type"]}
    if spec.config_keys is not None:  # the family's own spelling, in the engine's keys

        def reject(field: str, value: Any, why: str) -> None:
            raise HFFormatError(f"config.json: {field}={value!r} ({spec.model_type}) is not supported: {why}")

        hf = spec.config_keys.read(hf, reject)
    return hf


def _indexer_types(hf: dict) -> list:
    """GLM-MoE-DSA's per-layer indexer kinds as transformers' ``GlmMoeDsaConfig`` derives them:
    ``indexer_types``, else ``index_topk_pattern`` ("F"/"S" per layer), else layer i is full when
    ``max(i - offset + 1, 0) % freq == 0`` (``index_topk_freq``, default 1; ``index_skip_topk_offset``,
    default 2)."""
    if hf.get("indexer_types") is not None:
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(hf["num_hidden_layers"])]


def _dsa_keys(hf: dict, spec: FamilySpec, get, reject) -> dict[str, Any]:
    """DeepSeek Sparse Attention's model keys from ``config.json`` (transformers' names), or one
    ``reject``: MLA's RoPE always interleaved, every layer with its own indexer."""
    if hf.get("rope_interleave") is False:
        reject("rope_interleave", False, f"transformers' {spec.name} always rotates MLA's RoPE features as "
               "interleaved pairs (it does not read the key)")
    if spec.indexer_types and any(t != "full" for t in _indexer_types(hf)):
        reject("indexer_types", _indexer_types(hf), f"moefast runs {spec.name}'s indexer on every layer: "
               "layers that reuse the previous layer's selection (\"shared\", no indexer tensors) are not "
               "implemented")
    return {k: get(k) for k in ("index_topk", "index_n_heads", "index_head_dim")}


def _yarn_keys(hf: dict, rope: dict, reject) -> dict[str, Any]:
    """YaRN's model keys from ``config.json``'s rope dict (empty for a factor of 1), or one ``reject``."""
    if rope.get("attention_factor") is not None:
        reject("rope_parameters", rope, "YaRN with an explicit attention_factor")
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
    if factor == 1:  # YaRN's frequencies and attention factor are RoPE's (read as plain RoPE)
        return {}
    return dict(rope_type="yarn", rope_factor=float(factor), original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=rope.get("mscale") or None, mscale_all_dim=rope.get("mscale_all_dim") or None,
                rope_truncate=bool(rope.get("truncate", True)))


def _hf_sections(hf: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model, moe)`` config sections of an HF ``config.json`` dict."""
    spec = family_spec(hf.get("model_type"))
    hf = _language_config(hf)

    def reject(field: str, value: Any, why: str) -> None:
        raise HFFormatError(f"config.json: {field}={value!r} ({spec.model_type}) is not supported: {why}")

    def get(key: str) -> Any:  # transformers' default where config.json omits the key
        v = hf.get(key)
        return spec.hf_defaults[key] if v is None else v

    _fp8_block(hf)  # the quantizations moefast reads (dequantized), or an error naming the field
    q = hf.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4" and not spec.mxfp4_experts:
        reject("quantization_config.quant_method", "mxfp4", f"MXFP4 is read for gpt-oss's experts only, not {spec.name}")
    if hf.get("hidden_act", "silu") != "silu" and spec.expert_activation == "silu":
        reject("hidden_act", hf["hidden_act"], "moefast's experts are SwiGLU (silu)")
    for field in ("rope_parameters", "rope_scaling") if spec.family_keys is None else ():  # 5.x writes the first;
        rope = hf.get(field) or {}  # older files (and guides) the second; a family with keys of its own reads them
        if "full_attention" in rope or "sliding_attention" in rope:
            reject(field, rope, "RoPE parameters per layer type (sliding-window layers)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default") and not (rope_type == "yarn" and spec.yarn):
            reject(f"{field}.rope_type", rope_type,
                   f"moefast implements plain RoPE and YaRN for {spec.name}" if spec.yarn else
                   "moefast implements plain RoPE only (no linear/dynamic/YaRN/LongRoPE/Llama-3 scaling)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is None and hf.get("rotary_dim") and hf.get("head_dim"):  # MiniMax-M2's legacy key, as transformers reads it
        partial = hf["rotary_dim"] / hf["head_dim"]
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
    tied = hf.get("tie_word_embeddings", spec.hf_defaults.get("tie_word_embeddings", False))  # absent: the family's
    sliding = None
    if spec.sliding_window:
        kinds = ("sliding_attention", "full_attention")
        layer_types = hf.get("layer_types") or [kinds[(i + 1) % spec.sliding_pattern == 0] for i in range(n_layers)]
        if len(layer_types) != n_layers or any(t not in kinds for t in layer_types):
            reject("layer_types", hf.get("layer_types"), f"one entry per layer ({n_layers}), each {kinds[0]!r} or "
                   f"{kinds[1]!r}")
        layer_types = tuple(layer_types) if "sliding_attention" in layer_types else None
        sliding = hf.get("sliding_window", spec.hf_defaults.get("sliding_window"))
        if layer_types is not None and (not isinstance(sliding, int) or sliding < 1):
            reject("sliding_window", sliding, "sliding_attention layers need a window of at least one key")
    elif spec.layer_types is None:
        kind = "indexed_attention" if spec.dsa else "full_attention"  # DeepSeek-V3.2: every layer sparse MLA
        if any(t != kind for t in hf.get("layer_types") or []):
            reject("layer_types", hf["layer_types"], f"only {kind} layers")
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
    if spec.moe_layers.sublayers:  # Nemotron-H: layer_types says where the MoE (and dense) sublayers are
        nd, every = 0, 1
    elif moe_at != [i >= nd and (i - nd) % every == 0 for i in range(n_layers)]:
        reject(layer_field, layer_value,
               f"MoE layers {ids}: moefast's layers are num_dense_layers leading dense ones, then every "
               "moe_every-th one MoE")
    f = hf.get(spec.expert_ff_key)
    if not isinstance(f, int) or isinstance(f, bool) or f < 1:
        reject(spec.expert_ff_key, f, "each routed expert's width: an int >= 1")
    dense_ff = hf.get(spec.dense_ff_key) if spec.dense_ff_key else None
    b = spec.attention_bias
    qk_norm = spec.qk_norm if spec.qk_norm_key is None or hf.get(spec.qk_norm_key) else "none"
    model = dict(d_model=d, num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, d_ff=f,
                 dense_d_ff=dense_ff if dense_ff != f else None, vocab_size=hf["vocab_size"],
                 max_seq_len=hf.get("max_position_embeddings", spec.hf_defaults.get("max_position_embeddings", 4096)), position_encoding="rope",
                 rope_base=float(theta), tie_embeddings=bool(tied),
                 num_dense_layers=nd, moe_every=every, norm_eps=float(get("rms_norm_eps")),
                 attention_bias=b.covers if b is not None and hf.get(b.key, b.default) else "none",
                 qk_norm=qk_norm, init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0)
    if spec.partial_rotary:
        model["partial_rotary_factor"] = float(partial)
    if layer_types is not None and spec.sliding_window:
        model.update(layer_types=layer_types, sliding_window=int(sliding))
    elif layer_types is not None:
        model.update(layer_types=layer_types, **{k: int(get(k)) for k in families.LINEAR_KEYS})
    if spec.attention_sinks:
        model["attention_sinks"] = True
    if spec.attention_output_gate:
        model["attention_output_gate"] = True
    if spec.zero_centered_norm:
        model["zero_centered_norm"] = True
    if spec.mla:
        r = hf["qk_rope_head_dim"]
        model.update(attention="mla", q_lora_rank=hf.get("q_lora_rank") or None, kv_lora_rank=hf["kv_lora_rank"],
                     qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=r, v_head_dim=hf["v_head_dim"],
                     num_kv_heads=None, head_dim=r)  # transformers sets head_dim to qk_rope_head_dim
    if spec.dsa:  # DeepSeek Sparse Attention's indexer, under transformers' names
        model.update(_dsa_keys(hf, spec, get, reject))
    if rope.get("rope_type", rope.get("type")) == "yarn":
        model.update(_yarn_keys(hf, rope, reject))
    shared = spec.shared_expert
    shared_ff = 0
    if shared is not None:
        shared_ff = hf.get(shared.ff_key, spec.hf_defaults.get(shared.ff_key)) or 0
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
    if spec.expert_activation == "clamped_swiglu":
        from moefast.parallel.expert import GPT_OSS_ALPHA
        if hf.get("swiglu_alpha", GPT_OSS_ALPHA) != GPT_OSS_ALPHA:
            reject("swiglu_alpha", hf["swiglu_alpha"], f"the clamped SwiGLU's gain is {GPT_OSS_ALPHA} in moefast")
        moe.update(expert_activation=spec.expert_activation, swiglu_limit=float(get("swiglu_limit")))
    moe.update(expert_bias=spec.expert_bias, router_bias=spec.router_bias, expert_activation=spec.expert_activation)
    for key, value in spec.fixed.items():
        sec, _, field = key.partition(".")
        (model if sec == "model" else moe)[field] = value
    if spec.family_keys is not None:
        own_model, own_moe = spec.family_keys.read(hf, reject)
        model.update(own_model)
        moe.update(own_moe)
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
    for sec in ("model", "moe"):  # config.json fixes these; the lora section is the run's choice
        for k in PARAMETER_KEYS[sec]:
            if k in extra.get(sec, {}):
                raise HFFormatError(f"{sec}.{k} is fixed by {path / 'config.json'} (the weights' shapes or "
                                    "their meaning depend on it); drop the override")
    try:
        cfg = ExperimentConfig.from_dict(_merge(raw, extra), where=f"{path / 'config.json'} + overrides")
    except ConfigError as err:  # a value from config.json: name its key there too
        key = str(err).split(":", 1)[0]
        sec, _, field = key.partition(".")
        own = family_spec(hf["model_type"]).family_keys
        hf_key = ((own.hf_keys.get(key) if own is not None else None) or _HF_KEYS.get(key)
                  or (field if sec == "model" and field in hf else None))
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
    if (m.index_topk is not None) != spec.dsa:
        out.append(f"model.index_topk={'null' if m.index_topk is None else m.index_topk} ({name}'s attention is "
                   f"{'sparse (DeepSeek Sparse Attention): set it' if spec.dsa else 'dense: leave it null'})")
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
    frozen = cfg.lora.enabled and cfg.lora.routing == "frozen"  # the bias never moves: as imported
    if e.aux_free_bias_rate > 0 and r.selection_bias is None and not frozen:
        out.append(f"moe.aux_free_bias_rate={e.aux_free_bias_rate} ({name}'s router has no selection bias, which "
                   "changes the chosen experts)")
    out += _mtp_problems(spec, m)
    if "linear_attention" in (m.layer_types or ()) and spec.layer_types is None:
        out.append(f"model.layer_types with linear_attention layers ({name}'s layers are full attention)")
    if m.sublayers and not spec.moe_layers.sublayers:
        out.append(f"model.layer_types with moe / mlp sublayers ({name}'s layers each hold a token mixer and a "
                   "feed-forward)")
    if m.attention_output_gate != spec.attention_output_gate:
        out.append(f"model.attention_output_gate={str(m.attention_output_gate).lower()} ({name} "
                   f"{'gates' if spec.attention_output_gate else 'does not gate'} its attention output)")
    if m.zero_centered_norm != spec.zero_centered_norm:
        out.append(f"model.zero_centered_norm={str(m.zero_centered_norm).lower()} ({name}'s RMSNorms apply "
                   f"{'1 + w' if spec.zero_centered_norm else 'w'})")
    if "sliding_attention" in (m.layer_types or ()) and not spec.sliding_window:
        out.append(f"model.layer_types with sliding_attention layers ({name} has no sliding-window attention)")
    if m.attention_sinks != spec.attention_sinks:
        out.append(f"model.attention_sinks={str(m.attention_sinks).lower()} ({name} "
                   f"{'has' if spec.attention_sinks else 'has no'} attention sinks)")
    if e.expert_activation != spec.expert_activation:
        out.append(f"moe.expert_activation={e.expert_activation} ({name}'s experts: {spec.expert_activation})")
    for field in ("expert_bias", "router_bias"):
        if getattr(e, field) != getattr(spec, field):
            out.append(f"moe.{field}={str(getattr(e, field)).lower()} ({name} "
                       f"{'has' if getattr(spec, field) else 'has no'} {field.replace('_', ' ')}es)")
    if m.rope_type == "yarn" and not m.rope_truncate and not spec.yarn:
        out.append(f"model.rope_truncate=false ({name} has no YaRN scaling here)")
    out += _fixed_problems(spec, cfg)
    if spec.family_keys is not None:
        out += spec.family_keys.problems(cfg, name)
    out += [message for fails, message in spec.model_checks if fails(cfg)]
    return out


def _fixed_problems(spec: FamilySpec, cfg: ExperimentConfig) -> list[str]:
    """The keys some family fixes (``FamilySpec.fixed``) or reads itself (``family_keys.owns``)
    where ``cfg`` differs from what ``spec`` holds: its fixed value, the key's default where it
    neither fixes nor owns it."""
    out = []
    owned = set(spec.family_keys.owns) if spec.family_keys is not None else set()
    keys = {k for other in families.REGISTRY.values() for k in (*other.fixed, *(other.family_keys.owns if
                                                                                 other.family_keys else ()))}
    for key in sorted(keys - owned):
        sec, _, field = key.partition(".")
        want = spec.fixed[key] if key in spec.fixed else _default(sec, field)
        have = getattr(getattr(cfg, sec), field)
        if have != want:
            shown = lambda v: str(v).lower() if isinstance(v, bool) or v is None else v  # noqa: E731
            out.append(f"{key}={shown(have)} ({spec.name} has {shown(want)})")
    return out


def _default(section: str, field: str) -> Any:
    """The default of config key ``section.field``."""
    import dataclasses

    from moefast.config import ModelConfig, MoEConfig
    cls = ModelConfig if section == "model" else MoEConfig
    return next(f.default for f in dataclasses.fields(cls) if f.name == field)


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
    if m.position_encoding == "sinusoidal":
        raise HFFormatError("model.position_encoding: HF MoE families use RoPE (or none: Kimi Linear); 'sinusoidal' "
                            "cannot be exported")
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
        "tie_word_embeddings": m.tie_embeddings, "num_experts_per_tok": e.top_k,
        "initializer_range": m.init_std, "attention_dropout": 0.0, "use_cache": True,
        "router_aux_loss_coef": e.aux_loss_coef, "output_router_logits": False, "dtype": dtype,
        **special,
    }
    if spec.expert_activation != "gelu_tanh":  # Gemma 4 names its activation hidden_activation (family_keys)
        out["hidden_act"] = "silu"
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
        if not m.rope_truncate:  # transformers' default is true: written only when it is not
            out["rope_parameters"]["truncate"] = False
    if spec.mla:
        out.update(q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                   qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_rope_head_dim,
                   num_key_value_heads=m.num_heads)
    if spec.dsa:
        out.update(index_topk=m.index_topk, index_n_heads=m.index_n_heads, index_head_dim=m.index_head_dim,
                   layer_types=["indexed_attention"] * m.num_layers)
        if spec.indexer_types:
            out["indexer_types"] = ["full"] * m.num_layers
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
    if spec.sliding_window:
        out.update(layer_types=[m.layer_type(i) for i in range(m.num_layers)], sliding_window=m.sliding_window)
    if spec.expert_activation == "clamped_swiglu":
        out["swiglu_limit"] = e.swiglu_limit
    if spec.family_keys is not None:
        out.update(spec.family_keys.write(cfg))
    out.update({k: v(cfg) if callable(v) else v for k, v in spec.export_constants.items()})
    if spec.config_keys is not None:
        out = spec.config_keys.write(out, cfg)
    return out
