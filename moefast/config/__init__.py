"""Experiment configuration: frozen dataclasses, YAML files and ``section.key=value`` overrides.

One :class:`ExperimentConfig` holds a section per part of the system (``model``, ``moe``, ``data``,
``train``, ``mesh``, ``checkpoint``, ``cache``, ``monitor``, ``lora``). Every section validates its own invariants in
``__post_init__``; :class:`ExperimentConfig` validates the ones that span sections. Errors are
:class:`ConfigError` (a ``ValueError``) with a message that names the key and what to change.

Example::

    cfg = load_config("configs/tiny.yaml", ["train.steps=200", "moe.top_k=1"])
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, steps=10))
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import typing
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CacheConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "MeshConfig",
    "LoRAConfig",
    "MoEConfig",
    "ModelConfig",
    "MonitorConfig",
    "OverlapConfig",
    "TrainConfig",
    "DEFAULT_CONFIG",
    "INVOCATION_KEYS",
    "PARAMETER_KEYS",
    "load_config",
    "parse_overrides",
]

from .fields import ConfigError, _coerce, _require, _suggest
from .lora import LoRAConfig
from .model import ModelConfig
from .moe import MoEConfig
from .run import (CacheConfig, CheckpointConfig, DataConfig, MeshConfig, MonitorConfig, OverlapConfig,  # noqa: F401
                  TrainConfig)

# The model / moe keys that decide the parameters' structure and shapes (everything else in those
# sections chooses how the same parameters are used).
PARAMETER_KEYS = {"model": ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff", "dense_d_ff",
                            "vocab_size", "tie_embeddings", "num_dense_layers", "moe_every", "attention_bias",
                            "qk_norm", "position_encoding", "attention", "q_lora_rank", "kv_lora_rank",
                            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "layer_types",
                            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                            "linear_value_head_dim", "linear_conv_kernel_dim", "linear_attention_kind", "attention_output_gate",
                            "zero_centered_norm", "global_head_dim", "num_global_kv_heads", "attention_k_eq_v",
                            "sandwich_norm", "layer_scalar", "index_topk", "index_n_heads", "index_head_dim",
                            "dense_activation"),
                  "moe": ("num_experts", "shared_expert_d_ff", "shared_expert_gate", "expert_bias", "router_bias",
                          "branch_norms", "per_expert_scale", "expert_activation", "latent_size"),
                  "lora": ("rank", "targets", "expert_rank", "base_dtype", "train")}
# Keys that belong to one invocation of a run, never to the run: the run dir's config.yaml does
# not keep them, and they are ignored in one that an older moefast wrote with them
# (:func:`without_invocation_keys`).
INVOCATION_KEYS = {"train": ("stop_at",)}
CONFIG_DIR = Path(str(importlib.resources.files("moefast.configs")))  # the repo's configs/, installed as moefast.configs
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


_SECTIONS = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "cache": CacheConfig,
    "overlap": OverlapConfig,
    "monitor": MonitorConfig,
    "lora": LoRAConfig,
}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one section per part of the system, plus a name (used for the run dir)."""

    name: str = "tiny"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    overlap: OverlapConfig = dataclasses.field(default_factory=OverlapConfig)
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self):
        _require(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
                 f"{self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                 "lower data.seq_len or raise model.max_seq_len")
        m = self.train.grad_accum_steps
        _require(self.data.batch_size % m == 0, "train.grad_accum_steps",
                 f"must divide data.batch_size={self.data.batch_size} (micro-batches of whole rows), got {m}")
        _require(self.model.mtp_depth < self.data.seq_len, "model.mtp_depth",
                 f"{self.model.mtp_depth} leaves no target inside a row of data.seq_len={self.data.seq_len} "
                 "tokens; lower model.mtp_depth")
        _require(self.data.seq_len % self.model.sequence_slices == 0, "model.sequence_slices",
                 f"{self.model.sequence_slices} must divide data.seq_len={self.data.seq_len} (equal slices of "
                 "each row)")
        c = self.mesh.context
        _require(c == 1 or self.data.seq_len % (2 * c) == 0, "mesh.context",
                 f"{c} cuts each row into 2 x {c} = {2 * c} chunks (a mirrored pair per device): data.seq_len="
                 f"{self.data.seq_len} must be a multiple of {2 * c}")
        w = self.model.linear_conv_kernel_dim
        _require(c == 1 or "linear_attention" not in (self.model.layer_types or ())
                 or self.data.seq_len // (2 * c) >= w - 1, "mesh.context",
                 f"{c} cuts each row into pieces of data.seq_len / {2 * c} = {self.data.seq_len // (2 * c)} tokens, "
                 f"fewer than the linear-attention convolution's {w - 1} earlier taps "
                 f"(model.linear_conv_kernel_dim={w}); raise data.seq_len or lower mesh.context")
        _require(c == 1 or self.model.linear_attention_kind != "mamba2"
                 or "linear_attention" not in (self.model.layer_types or ()), "mesh.context",
                 f"{c} with Mamba-2 layers (model.linear_attention_kind=mamba2): passing their state along the "
                 "context axis is not built yet (Gated DeltaNet and KDA's is); use mesh.context=1")
        _require(c == 1 or self.model.index_topk is None, "mesh.context",
                 f"{c} with sparse MLA (model.index_topk={self.model.index_topk}): the lightning indexer would have "
                 "to score keys held on other devices, which moefast does not do yet; use mesh.context=1")
        stage = self.train.indexer_stage
        _require(stage == "none" or self.model.index_topk is not None, "train.indexer_stage",
                 f"{stage!r} trains DeepSeek Sparse Attention's indexers, and this model has none "
                 "(model.index_topk is null): use \"none\" or set model.index_topk")
        _require(stage == "none" or not self.lora.enabled, "train.indexer_stage",
                 f"{stage!r} with lora: adapters train, the indexers stay as imported; use \"none\" with lora, "
                 "or lora.rank=0 to train the indexers")
        _require(c == 1 or self.model.sequence_slices == 1, "mesh.context",
                 f"{c} with model.sequence_slices={self.model.sequence_slices}: use one or the other")
        if self.lora.enabled and self.lora.targets is not None:  # a named target that adapts nothing would leave what the user meant frozen, silently
            m = self.model
            moe_layers = any(m.is_moe_layer(i) for i in range(m.num_layers))
            has = {"attention": True, "experts": moe_layers, "shared_experts": moe_layers and self.moe.shared_expert_d_ff > 0,
                   "mlp": any(not m.is_moe_layer(i) for i in range(m.num_layers))}
            what = {"experts": "MoE layers", "shared_experts": "shared experts", "mlp": "dense MLP layers"}
            for t in (t for t in self.lora.targets if not has[t]):
                rest = [x for x in self.lora.targets if has[x]]
                _require(False, "lora.targets", f"{t!r} adapts nothing in this model (it has no {what[t]}); leave it "
                         f"out (lora.targets=[{', '.join(rest)}])" if rest else
                         f"{t!r} adapts nothing in this model (it has no {what[t]}); use lora.targets=null (every "
                         "kind the model has)")
        _require(self.moe.dispatch_dtype == "compute" or self.model.d_model % 128 == 0, "moe.dispatch_dtype",
                 f"FP8 dispatch scales each 128 channels of a row; model.d_model={self.model.d_model} is not a "
                 "multiple of 128: use moe.dispatch_dtype=compute")

    def replace(self, **sections: Any) -> "ExperimentConfig":
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, Any]:
        """Nested dicts of plain YAML/JSON values (tuples become lists)."""
        plain = lambda v: [plain(x) for x in v] if isinstance(v, (list, tuple)) else (  # noqa: E731
            {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v)
        return plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "config") -> "ExperimentConfig":
        """Builds a config from nested dicts, rejecting unknown keys and wrong types."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a mapping of sections, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_SECTIONS) - {"name"})
        if unknown:
            raise ConfigError(f"{where}: unknown section '{unknown[0]}'{_suggest(unknown[0], _SECTIONS)}; "
                              f"valid sections: {sorted(_SECTIONS)} and 'name'")
        kwargs: dict[str, Any] = {}
        if "name" in d:
            kwargs["name"] = _coerce("name", d["name"], str)
        for sec, typ in _SECTIONS.items():
            body = d.get(sec) or {}
            if not isinstance(body, dict):
                raise ConfigError(f"{sec}: expected a mapping, got {body!r}")
            kwargs[sec] = _build_section(sec, typ, body)
        return cls(**kwargs)


def _build_section(sec: str, typ: type, body: dict[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(typ)}
    hints = typing.get_type_hints(typ)
    for k in body:
        if k not in fields:
            raise ConfigError(f"{sec}.{k}: unknown key{_suggest(k, fields)}; valid keys of '{sec}': {sorted(fields)}")
    vals = {k: _coerce(f"{sec}.{k}", v, hints[k]) for k, v in body.items()}
    return typ(**vals)


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """Parses ``section.key=value`` strings into nested dicts; values are read as YAML scalars.

    Raises:
      ConfigError: an override is not of the form ``section.key=value``.
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value (e.g. train.steps=200)")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        if parts == ["name"]:
            out["name"] = value
            continue
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override {item!r}: expected section.key=value (e.g. train.steps=200); "
                              f"sections: {sorted(_SECTIONS)}")
        if parts[0] not in _SECTIONS:
            raise ConfigError(f"override {item!r}: unknown section '{parts[0]}'{_suggest(parts[0], _SECTIONS)}; "
                              f"valid sections: {sorted(_SECTIONS)}")
        out.setdefault(parts[0], {})[parts[1]] = value
    return out


def without_invocation_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A config (nested dicts, as in a YAML file) without :data:`INVOCATION_KEYS`: what a run dir's
    ``config.yaml`` holds. Returns a copy; other keys and malformed sections are kept as they are."""
    out = dict(raw)
    for sec, keys in INVOCATION_KEYS.items():
        if isinstance(out.get(sec), dict):
            out[sec] = {k: v for k, v in out[sec].items() if k not in keys}
    return out


def _is_run_config(path: Path) -> bool:
    """``path`` is a run dir's own ``config.yaml`` (``moefast train`` writes it next to ``checkpoints/``)."""
    return path.name == "config.yaml" and (path.parent / "checkpoints").is_dir()


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k].update(v)
        else:
            merged[k] = v
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Loads a YAML config and applies ``section.key=value`` overrides.

    Args:
      path: YAML file; ``None`` loads ``configs/tiny.yaml``. A bare file name, or ``configs/NAME``,
        that does not exist here but is a shipped config (``h200_1b.yaml``) loads the shipped one
        (so ``configs/tiny.yaml`` works outside the checkout, e.g. from its notebooks/). The config's
        ``name`` defaults to the file's stem.
      overrides: e.g. ``["train.steps=200", "moe.top_k=1"]``.

    Raises:
      ConfigError: missing/unparsable file, unknown key, wrong type or impossible value, or
        ``overrides`` not a list of strings.
    """
    if isinstance(overrides, (str, bytes)) or not (
            overrides is None or (isinstance(overrides, (list, tuple)) and all(isinstance(o, str) for o in overrides))):
        hint = f" (a single override: [{overrides!r}])" if isinstance(overrides, str) else ""
        raise ConfigError(f"overrides: expected a list of 'section.key=value' strings{hint}, got "
                          f"{type(overrides).__name__} {overrides!r}"[:300])
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file() and path.parent in (Path("."), Path("configs")) and (CONFIG_DIR / path.name).is_file():
        path = CONFIG_DIR / path.name  # a shipped config by name (or as the checkout names it), from any directory
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; shipped configs: "
                          f"{sorted(p.name for p in CONFIG_DIR.glob('*.yaml'))}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    raw.setdefault("name", path.stem)
    if _is_run_config(path):  # an older moefast kept train.stop_at there: it was that invocation's
        raw = without_invocation_keys(raw)
    raw = _merge(raw, parse_overrides(list(overrides or [])))
    return ExperimentConfig.from_dict(raw, where=str(path))
