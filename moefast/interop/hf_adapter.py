"""A LoRA run out and in: its adapters as a PEFT adapter directory for transformers' model of the
same base, that directory read back into a run, and the merged base (:func:`merged_base`, which
:func:`~moefast.interop.hf.save_hf` writes for a run with ``lora``).

A PEFT (0.21) adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``;
``PeftModel.from_pretrained(model, dir)`` puts it on transformers' model of the base (the model
``save_hf`` writes for the run without adapters, or the one it was imported from). Each adapter is
on one *site* of that model:

* a linear module: ``lora_A.weight`` [R, in], ``lora_B.weight`` [out, R], delta ``W [out, in] +=
  s B A``; named in ``target_modules`` (one regular expression naming exactly the adapted modules),
  or by its ``.weight`` in ``target_parameters`` where PEFT 0.21 would take its name for one of
  transformers 4's per-expert modules (:data:`_V4_EXPERT_NAMES`: a dense MLP's or shared expert's
  ``gate_proj``, ``up_proj``, ``down_proj``), which is the same arithmetic and the same keys;
* a routed experts' tensor (``target_parameters``: PEFT's ``ParamWrapper``, transformers 5 keeps
  the experts fused in memory): ``lora_A.weight`` [E·R, in] whose row ``e·R + j`` is expert e's
  row j, ``lora_B.weight`` [out, R·E] whose column ``j·E + e`` is expert e's column j; in and out
  are the tensor's axes 2 and 1 ([E, out, in]), or 1 and 2 where the module applies it as
  ``x @ w`` (``is_transposed``: gpt-oss). Two tensors of one module nest: the first (in the
  module's order, gate_up before down) is keyed ``...experts.base_layer.lora_A.weight``.

``s`` is ``lora_alpha / R`` (``rank_pattern`` / ``alpha_pattern`` where a site differs from
``r`` / ``lora_alpha``). Keys are ``base_model.model.<site>.lora_{A,B}.weight``.

Which moefast adapter feeds which site is not written per family: each adapted parameter's export
transform (the family's tensor table, :func:`~moefast.interop.hf_tables._leaves`, in the fused
expert layout that transformers holds in memory) is run on index probes, arrays whose entries are
their own (expert, input row, output column), which shows where every HF element comes from. The
maps must factorise (each HF row one moefast output column, the input axis and the expert axis
passed through in order: checked on their first 3 rows) and carry no scaling (a probe of ones).
A site whose rows come from several moefast adapters (the parts of a fused projection, or two
parameters: Qwen3-Next/Qwen3.5's ``q_proj`` holds the query of ``qkv`` and the output ``gate``,
Qwen3-Next's ``in_proj_qkvz`` two parts of ``in_proj``) gets its P adapters stacked: rank
``P·r``, ``A`` their ``A`` s one above the other, ``B`` block-diagonal, exactly the same delta. A
site fed by one adapter has rank ``r``.

Reading inverts it: a stacked site is split back (its off-diagonal blocks of ``B`` must be zero),
and a site of rank ``r`` over several moefast parts (PEFT trains one ``A`` per module) gives each
part that ``A``. Sites the adapter does not hold keep the run's fresh adapters (``B = 0``).

Raises :class:`~moefast.interop.hf_files.HFFormatError` (one message naming the family and the
site) where a run's adapters cannot be a PEFT adapter: adapters on multi-token-prediction modules
(transformers' models have none), parameters ``lora.train`` trains in full, or a family transform
that is not a relabelling of rows and columns.

Dimension letters: E experts, R a site's rank, r moefast's (``lora.rank``, ``lora.expert_rank``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from moefast.config import ExperimentConfig, LoRAConfig
from moefast.config.lora import LORA_TARGETS
from moefast.interop import families
from moefast.interop.hf_configs import hf_family
from moefast.interop.hf_files import HFFormatError, _host as host
from moefast.interop.hf_read import _flat_paths
from moefast.interop.hf_tables import _Leaf, _leaves
from moefast.model import lora
from moefast.model.layout import to_layout
from moefast.model.transformer import build_model

__all__ = ["adapter_lora_config", "load_peft_adapter", "merged_base", "save_peft_adapter"]

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's key prefix: the PeftModel's base_model (LoraModel), its model
_V4_EXPERT_NAMES = ("gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
"""Module names that PEFT 0.21.2 takes, in ``target_modules`` of a model whose experts transformers 5
fuses (Qwen2-MoE- and Mixtral-style conversions: DeepSeek, GLM, Qwen3-MoE, Qwen3-Next, OLMoE,
MiniMax, ...), for transformers 4's per-expert modules, rewriting them to the fused experts'
tensors at twice the rank and alpha (``peft/utils/transformers_weight_conversion.py``,
``_convert_peft_config_moe``): a dense MLP's or shared expert's ``gate_proj`` there would lose its
adapter. Such linear weights are named in ``target_parameters`` instead (its ``.weight``; PEFT's
``ParamWrapper`` on a 2-D weight computes the same ``W + s B A``, and keys it the same)."""
_PROBE_ROWS = 3  # input rows (and experts) the probes carry: enough to see an axis reordered or moved


# ------------------------------------------------------------------------------------- the model
def _unrolled(cfg: ExperimentConfig) -> ExperimentConfig:
    return cfg.replace(model=dataclasses.replace(cfg.model, scan_layers=False))


def _abstract(cfg: ExperimentConfig, vocab: int) -> nnx.Module:
    return nnx.eval_shape(lambda: build_model(_unrolled(cfg), vocab))


def _base_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` without adapters, as the base model it exports: a routing state the run kept frozen
    (``lora.routing=frozen``) never moved, so no selection-bias rate is the model's."""
    if cfg.lora.enabled and cfg.lora.routing == "frozen":
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, aux_free_bias_rate=0.0))
    return cfg.replace(lora=LoRAConfig())


def merged_base(cfg: ExperimentConfig, params: dict) -> tuple[ExperimentConfig, dict]:
    """The model without adapters whose weights are the run's with its adapters merged:
    ``W + (alpha / r) A B`` per projection (per expert for the routed experts), float32, from the
    base as stored (NF4 dequantized) (:func:`moefast.model.lora.merged_params`).

    Args:
      cfg: a run with ``lora``; params: its parameters (either layer layout).

    Returns:
      ``(config, params)``: ``cfg`` without ``lora`` and unrolled (``model.scan_layers`` false),
      and float32 numpy parameters of that model (held on this host).
    """
    # on this host as stored (every process gathers its share's missing shards: multi-host runs too)
    unrolled = jax.tree.map(host, to_layout(params, cfg.model, scanned=False))
    graphdef, state = nnx.split(_abstract(cfg, int(unrolled["embed"].shape[0])))
    nnx.replace_by_pure_dict(state, unrolled)
    merged = lora.merged_params(nnx.merge(graphdef, state), unrolled)
    return _base_config(_unrolled(cfg)), merged


# -------------------------------------------------------------------------------------- the map
@dataclasses.dataclass(frozen=True)
class _Block:
    """One moefast adapter on a site: part ``part`` of the parameter at ``path`` (unrolled), of
    ``target``'s rank and scale, filling the site's output ``rows`` from its output ``cols``."""

    path: tuple
    part: int
    target: str
    rows: np.ndarray  # int [n]: the site's output indices it fills
    cols: np.ndarray  # int [n]: the parameter's output columns they are


@dataclasses.dataclass
class _Site:
    """A PEFT adapter: the linear module or the experts' tensor HF tensor ``name`` is."""

    name: str  # "model.layers.0.self_attn.q_proj.weight" or "model.layers.1.mlp.experts.gate_up_proj"
    expert: bool
    out: int  # the site's output features
    blocks: list[_Block]
    experts: int = 1  # E of an experts' tensor
    key: str = ""  # the site's lora_A/lora_B key stem (set by _sites)

    @property
    def as_parameter(self) -> bool:
        """Named in ``target_parameters`` (PEFT's ``ParamWrapper``): the experts' tensors, and the
        linear weights whose module names PEFT 0.21 would take for transformers 4's per-expert
        modules (:data:`_V4_EXPERT_NAMES`)."""
        return self.expert or self.name.rsplit(".", 2)[-2] in _V4_EXPERT_NAMES

    @property
    def peft_name(self) -> str:  # what PEFT matches: the parameter (target_parameters) or the module
        return self.name if self.as_parameter else self.name[:-len(".weight")]


def _ids(shape: tuple[int, ...]) -> np.ndarray:
    """float64 [shape]: every entry its own flat index + 1 (exact, 0 never written by a probe)."""
    return np.arange(1, math.prod(shape) + 1, dtype=np.float64).reshape(shape)


def _where_from(leaf: _Leaf, shape: tuple[int, ...], what: str) -> list[tuple[str, np.ndarray, np.ndarray, int]]:
    """``(HF name, HF output rows, moefast output column of each, HF rows in all)`` for each HF tensor
    the parameter of ``shape`` ([in, out], or [E, in, out] for experts) writes, from an index probe.

    Raises:
      HFFormatError: the transform is not a relabelling PEFT can follow (``what`` names it).
    """
    expert = len(shape) == 3
    small = (min(shape[0], _PROBE_ROWS),) * expert + (min(shape[-2], _PROBE_ROWS), shape[-1])
    out = []
    for (name, x), (_, ones) in zip(leaf.write(_ids(small)), leaf.write(np.ones(small))):
        rows = total = None  # a whole tensor's; a Part: the rows of a tensor that parameters share
        if isinstance(x, families.Part):
            rows, total, x, ones = x.index, x.rows, x.value, ones.value
        x, ones = np.asarray(x), np.asarray(ones)
        if x.ndim != len(small) or "{e}" in name:
            raise HFFormatError(f"{what} is written as {name} of shape {list(x.shape)}: not "
                                + ("one [E, ., .] tensor of every expert" if expert else "a linear weight [out, in]"))
        if not np.all(ones == 1):
            raise HFFormatError(f"{what}: {name} scales the values it holds")
        flat = x.astype(np.int64) - 1
        col, rest = flat % shape[-1], flat // shape[-1]
        row, e = rest % small[-2], rest // small[-2]
        n_in = small[-2]
        if expert:  # [E, out, in] (in on axis 2, transformers' default) or [E, in, out] (x @ w: gpt-oss)
            in_axis = next((k for k in (2, 1) if x.shape[k] == n_in and np.array_equal(
                row, np.broadcast_to(np.expand_dims(np.arange(n_in), tuple({0, 1, 2} - {k})), row.shape))), None)
            if in_axis is None or x.shape[0] != small[0] or not np.array_equal(
                    e, np.broadcast_to(np.arange(small[0])[:, None, None], e.shape)):
                raise HFFormatError(f"{what}: {name} reorders the experts or their input rows")
            cols = col[0, :, 0] if in_axis == 2 else col[0, 0, :]
            total = len(cols)
            rows = np.arange(total)
            same = np.all(col == np.expand_dims(cols, (0, in_axis)))
        else:
            if x.shape[1] != n_in or not np.array_equal(row, np.broadcast_to(np.arange(n_in), row.shape)):
                raise HFFormatError(f"{what}: {name} is not a linear weight [out, in] with the input rows in order")
            cols, same = col[:, 0], np.all(col == col[:, :1])
            rows, total = (np.arange(x.shape[0]), x.shape[0]) if rows is None else (rows, total)
        if not same:
            raise HFFormatError(f"{what}: {name} mixes the parameter's output columns within a row")
        out.append((name, rows, cols, total))
    return out


def _sites(cfg: ExperimentConfig, vocab: int, family: str | None) -> tuple[families.FamilySpec, list[_Site]]:
    """The family's spec and the PEFT sites of ``cfg``'s adapted model (``cfg.lora`` enabled), in
    the family's table order, each with its key stem.

    Raises:
      HFFormatError: no family represents the model, or an adapter PEFT cannot hold (module docstring).
    """
    base = _base_config(cfg)
    checked = hf_family(base, family)
    spec = families.REGISTRY[family or checked]  # an asked family's own names (Qwen3.5's vision-language model)
    shapes = {p: tuple(v.shape) for p, v in _flat_paths(nnx.to_pure_dict(nnx.state(_abstract(base, vocab))))}
    leaves = _leaves(spec, _unrolled(base), "fused", shapes)
    sites: dict[str, _Site] = {}
    for path, module, name in lora.adapted(_abstract(cfg, vocab)):
        p = tuple(path) + (name,)
        target = lora.TARGETS[type(module).__name__][name]
        what = f"{spec.name}'s {'/'.join(map(str, p))} (lora.targets: {target})"
        if p[0] == "mtp":
            raise HFFormatError(f"{what} cannot be expressed as a PEFT adapter: transformers' "
                                f"{spec.architecture} has no multi-token-prediction layers (model.mtp_depth="
                                f"{cfg.model.mtp_depth}); export the merged model instead")
        bounds = np.cumsum(lora.parts_of(module, name))
        for hf_name, rows, cols, total in _where_from(leaves[p], shapes[p], what):
            expert = len(shapes[p]) == 3
            site = sites.setdefault(hf_name, _Site(hf_name, expert, total, [], shapes[p][0] if expert else 1))
            part = np.searchsorted(bounds, cols, side="right")
            for k in np.unique(part):
                site.blocks.append(_Block(p, int(k), target, rows[part == k], cols[part == k]))
    for site in sites.values():
        site.blocks.sort(key=lambda b: b.rows.min())  # stacked in the site's row order
        filled = np.concatenate([b.rows for b in site.blocks])
        if len(np.unique(filled)) != len(filled):
            raise HFFormatError(f"{spec.name}'s {site.name}: rows written by two adapters (a bug in its tables)")
        if site.expert and len(site.blocks) > 1:
            raise HFFormatError(f"{spec.name}'s {site.name} cannot be expressed as a PEFT adapter: it joins "
                                f"{len(site.blocks)} moefast adapters, and PEFT's experts' tensor has one")
    by_module: dict[str, list[_Site]] = {}  # experts' tensors of one module nest, the first innermost
    for site in sites.values():
        stem = site.name.rsplit(".", 1)[0]  # the module
        by_module.setdefault(stem, []).append(site)
    for stem, group in by_module.items():
        for k, site in enumerate(group):
            site.key = PREFIX + stem + ".base_layer" * (len(group) - 1 - k)
    return spec, list(sites.values())


def _rank(cfg: LoRAConfig, site: _Site) -> int:
    return sum(cfg.rank_of(b.target) for b in site.blocks)


def _module_regex(sites: list[_Site]) -> str | None:
    """One regular expression that ``re.fullmatch`` es exactly the adapted modules of every layer:
    each site's name with its layer index as ``\\d+``; ``None`` when no module is adapted."""
    names = sorted({re.sub(r"\\\.(\d+)\\\.", r"\\.\\d+\\.", re.escape(s.peft_name)) for s in sites
                    if not s.as_parameter})
    return "|".join(names) or None


def _shortest_keys(names: list[str], value: dict[str, Any], among: list[str]) -> dict[str, Any]:
    """``{key: value}`` with, for each of ``names``, its shortest dotted suffix (two names at least)
    whose matches among ``among`` (names ending in ``.key``) all have its value (PEFT's
    ``rank_pattern`` matching)."""
    out = {}
    for n in names:
        parts = n.split(".")
        for k in range(len(parts) - 2, -1, -1):  # at least the module and the parameter: "experts.down_proj"
            key = ".".join(parts[k:])
            if all(value[m] == value[n] for m in among if m == key or m.endswith("." + key)):
                out[key] = value[n]
                break
    return out


# --------------------------------------------------------------------------------------- writing
def _host(x: Any) -> np.ndarray:
    return np.asarray(host(x), np.float32)


def save_peft_adapter(cfg: ExperimentConfig, params: dict, out_dir: str | Path, *, family: str | None = None,
                      base_model: str | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Writes a LoRA run's adapters as a PEFT adapter directory (module docstring): float32,
    exactly the run's ``(alpha / r) A B`` on every adapted projection.

    The routing state is not part of an adapter: a run that changed a family's selection bias
    (``lora.routing=update`` with ``moe.aux_free_bias_rate`` > 0) chooses other experts than the
    base with this adapter; its merged export (:func:`~moefast.interop.hf.save_hf`) keeps them.

    Args:
      cfg: the run's config (``lora`` enabled).
      params: its parameters (either layer layout; arrays, sharded or not, or numpy).
      out_dir: new directory (must not exist, or be empty).
      family: HF ``model_type`` whose module names to use (the one the run was imported from, e.g.
        ``qwen3_5_moe`` for Qwen3.5's vision-language model); ``None``: the first that fits.
      base_model: written as ``base_model_name_or_path`` (the base model's directory or hub id).
      log: printer for a one-line summary.

    Returns:
      ``out_dir`` as a ``Path``.

    Raises:
      ValueError: ``cfg`` has no adapters (``lora.rank`` 0).
      HFFormatError: an adapter PEFT cannot hold (module docstring), no family represents the
        model, or ``out_dir`` is not empty.
    """
    from safetensors.numpy import save_file

    if not cfg.lora.enabled:
        raise ValueError("the run has no adapters (lora.rank=0): export its model with save_hf")
    if cfg.lora.train:
        raise HFFormatError(f"this run cannot be exported as a PEFT adapter: lora.train={list(cfg.lora.train)} trains "
                            "those parameters in full, and a PEFT LoRA adapter holds only the low-rank adapters; "
                            "export the merged model instead")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise HFFormatError(f"{out_dir} exists and is not an empty directory; choose a new one (nothing is "
                            "overwritten)")
    unrolled = to_layout(params, cfg.model, scanned=False)
    spec, sites = _sites(cfg, int(unrolled["embed"].shape[0]), family)
    values = dict(_flat_paths(unrolled))
    lc, tensors, ranks, alphas = cfg.lora, {}, {}, {}
    for site in sites:
        a, b = _site_weights(lc, site, values)
        tensors[site.key + ".lora_A.weight"] = np.ascontiguousarray(a)  # safetensors writes the buffer as it is
        tensors[site.key + ".lora_B.weight"] = np.ascontiguousarray(b)
        ranks[site.peft_name] = _rank(lc, site)
        alphas[site.peft_name] = lc.scale(site.blocks[0].target) * ranks[site.peft_name]
    r, alpha = lc.rank, float(lc.rank if lc.alpha is None else lc.alpha)
    names = list(ranks)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": r,
        "lora_alpha": alpha, "target_modules": _module_regex(sites),
        "target_parameters": [s.peft_name for s in sites if s.as_parameter] or None,
        "rank_pattern": _shortest_keys([n for n in names if ranks[n] != r], ranks, names),
        "alpha_pattern": _shortest_keys([n for n in names if alphas[n] != alpha], alphas, names),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    if jax.process_index() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
            (out_dir / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise
        if log is not None:
            n = sum(x.size for x in tensors.values())
            stacked = sum(len(s.blocks) > 1 for s in sites)
            er = cfg.lora.rank_of("experts")
            experts = f" (the experts' {er}: rank_pattern)" if er != r and any(s.expert for s in sites) else ""
            log(f"wrote a PEFT LoRA adapter for {spec.model_type} ({spec.architecture}) to {out_dir}: {len(sites)} "
                f"sites, rank {r}{experts}, alpha {alpha:g}, {n / 1e6:,.3f}M parameters" +
                (f"; {stacked} of them hold several moefast adapters stacked (rank_pattern)" if stacked else ""))
    return out_dir


def _site_weights(lc: LoRAConfig, site: _Site, values: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(lora_A [E·R or R, in], lora_B [out, R·E or R])`` float32 of ``site`` (module docstring)."""
    if site.expert:
        (blk,) = site.blocks
        a, b = (_host(values[blk.path[:-1] + (blk.path[-1] + s,)]) for s in (lora.LORA_A, lora.LORA_B))
        e, d_in, r = a.shape
        out = np.zeros((site.out, r, e), np.float32)
        out[blk.rows] = b[:, :, blk.cols].transpose(2, 1, 0)  # [out, r, E]: column j·E + e
        return a.transpose(0, 2, 1).reshape(e * r, d_in), out.reshape(site.out, r * e)
    scale = lc.scale(site.blocks[0].target)
    a_rows, b = [], np.zeros((site.out, _rank(lc, site)), np.float32)
    at = 0
    for blk in site.blocks:
        r = lc.rank_of(blk.target)
        a_all, b_all = (_host(values[blk.path[:-1] + (blk.path[-1] + s,)]) for s in (lora.LORA_A, lora.LORA_B))
        a_rows.append(a_all[:, blk.part * r:(blk.part + 1) * r].T)
        b[blk.rows, at:at + r] = b_all[:, blk.cols].T * np.float32(lc.scale(blk.target) / scale)
        at += r
    return np.concatenate(a_rows, axis=0), b


# --------------------------------------------------------------------------------------- reading
def _read(adapter_dir: str | Path) -> tuple[dict, dict[str, tuple[int, ...]], Path]:
    """``(adapter_config.json, tensor name -> shape, the safetensors file)`` of a PEFT LoRA adapter
    directory.

    Raises:
      HFFormatError: the files are missing, or the adapter uses what moefast's LoRA does not have.
    """
    from safetensors import safe_open

    d = Path(adapter_dir)
    if not (d / CONFIG).is_file() or not (d / WEIGHTS).is_file():
        raise HFFormatError(f"{d}: a PEFT adapter directory holds {CONFIG} and {WEIGHTS}")
    conf = json.loads((d / CONFIG).read_text())
    unsupported = {"peft_type": ("LORA",), "bias": ("none", None), "use_dora": (False, None),
                   "lora_bias": (False, None), "fan_in_fan_out": (False, None), "modules_to_save": (None, []),
                   "layers_to_transform": (None, [])}
    for k, ok in unsupported.items():
        if conf.get(k) not in ok:
            raise HFFormatError(f"{d / CONFIG}: {k}={conf.get(k)!r}: moefast's LoRA has only low-rank adapters "
                                f"(LoRA, without biases, DoRA or fully trained modules); expected {ok[0]!r}")
    with safe_open(str(d / WEIGHTS), framework="numpy") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return conf, shapes, d / WEIGHTS


def _file_scale(conf: dict, site: _Site, rank: int) -> float:
    """PEFT's scaling of ``site`` of rank ``rank`` (an experts' tensor: per expert): ``alpha / rank``
    (rsLoRA: ``/ sqrt(rank)``), ``alpha`` from ``alpha_pattern`` as PEFT matches it (``(.*\\.)?key$``)."""
    alpha = next((v for k, v in (conf.get("alpha_pattern") or {}).items()
                  if re.match(rf"(.*\.)?({k})$", site.peft_name)), conf["lora_alpha"])
    return alpha / (math.sqrt(rank) if conf.get("use_rslora") else rank)


def _check_keys(keys: set[str], sites: list[_Site], adapter_dir: Any, spec: families.FamilySpec) -> list[_Site]:
    """The ``sites`` the adapter holds.

    Raises:
      HFFormatError: tensors of the adapter that are no site's ``lora_A``/``lora_B``, or a site with one.
    """
    known = {s.key + f".lora_{x}.weight" for s in sites for x in "AB"}
    strangers = sorted(keys - known)
    if strangers:
        raise HFFormatError(f"{adapter_dir}: {len(strangers)} tensors adapt what this {spec.name} run has no adapter "
                            f"for (lora.targets), or another model's modules, e.g. {strangers[:3]}")
    held = [s for s in sites if s.key + ".lora_A.weight" in keys]
    half = [s.key for s in sites if (s.key + ".lora_A.weight" in keys) != (s.key + ".lora_B.weight" in keys)]
    if half:
        raise HFFormatError(f"{adapter_dir}: {half[:3]} have lora_A or lora_B, not both")
    return held


def adapter_lora_config(cfg: ExperimentConfig, adapter_dir: str | Path, *, family: str | None = None) -> LoRAConfig:
    """The ``lora`` section that holds the PEFT adapter in ``adapter_dir`` on ``cfg``'s model:
    where ``cfg.lora`` has no adapters (``lora.rank`` 0), ``cfg.lora`` with ``rank`` and ``alpha``
    (PEFT's ``r``, ``lora_alpha``), ``expert_rank`` (the experts' sites') and ``targets`` (those
    with a site in the adapter) taken from the adapter; else ``cfg.lora``, checked to hold it.
    ``family``: as :func:`save_peft_adapter`'s (whose module names the adapter uses).

    Raises:
      HFFormatError: the adapter does not fit the model (tensors of no site; a site whose rank is
        neither ``r`` nor its moefast adapters' ranks together; experts' sites of different ranks),
        or ``cfg.lora`` differs from it (rank, scale, expert rank, or a target it lacks), naming
        the setting.
    """
    conf, shapes, _ = _read(adapter_dir)
    every = cfg.replace(lora=dataclasses.replace(cfg.lora, rank=1, expert_rank=None, alpha=None, targets=None,
                                                 train=()),  # every kind the model has
                        moe=dataclasses.replace(cfg.moe, aux_free_bias_rate=0.0))  # the sites: not the routing
    spec, sites = _sites(every, cfg.model.vocab_size or 256, family)
    held = _check_keys(set(shapes), sites, adapter_dir, spec)
    if not held:
        raise HFFormatError(f"{adapter_dir}: its tensors adapt none of {spec.name}'s projections")
    r = int(conf["r"])
    expert_ranks = set()
    for s in held:
        rows = shapes[s.key + ".lora_A.weight"][0]
        if s.expert:
            expert_ranks.add(rows // s.experts)
        elif rows not in (r, r * len(s.blocks)):
            raise HFFormatError(f"{adapter_dir}: {s.peft_name} has rank {rows}; moefast's adapters of it are "
                                f"{len(s.blocks)} of rank r={r} (rank {r} or {r * len(s.blocks)} in PEFT)")
    if len(expert_ranks) > 1:
        raise HFFormatError(f"{adapter_dir}: the experts' sites have ranks {sorted(expert_ranks)}; moefast has one "
                            "(lora.expert_rank)")
    alpha = float(conf["lora_alpha"]) * (math.sqrt(r) if conf.get("use_rslora") else 1.0)
    expert_rank = expert_ranks.pop() if expert_ranks else None
    targets = tuple(t for t in LORA_TARGETS if any(b.target == t for s in held for b in s.blocks))
    lc = cfg.lora
    if not lc.enabled:
        return dataclasses.replace(lc, rank=r, alpha=None if alpha == r else alpha, targets=targets,
                                   expert_rank=None if expert_rank in (None, r) else expert_rank)
    wrong = [f"lora.rank={lc.rank} (the adapter's r: {r})"] * (lc.rank != r)
    if lc.rank == r and lc.scale("attention") != alpha / r:
        wrong.append(f"lora.alpha={lc.alpha} (the adapter's: {alpha:g})")
    if expert_rank is not None and lc.rank_of("experts") != expert_rank:
        same = f"= lora.rank {lc.rank}; " if lc.expert_rank is None else ""
        wrong.append(f"lora.expert_rank={lc.expert_rank} ({same}the adapter's: {expert_rank})")
    wrong += [f"lora.targets={list(lc.target_kinds)} lacks {t!r}" for t in targets if t not in lc.target_kinds]
    if wrong:
        raise HFFormatError(f"{adapter_dir} does not fit the run's lora section: {'; '.join(wrong)}; leave lora.rank "
                            "unset to take rank, alpha, expert rank and targets from the adapter")
    return lc


def load_peft_adapter(cfg: ExperimentConfig, adapter_dir: str | Path, params: dict, *, family: str | None = None,
                      log: Callable[[str], None] | None = None) -> dict:
    """``params`` with the adapters of the PEFT adapter in ``adapter_dir`` (the inverse of
    :func:`save_peft_adapter`; module docstring): each site's ``lora_A``/``lora_B`` (float32) into
    its moefast adapters, ``B`` times the ratio of PEFT's scale to the run's; the adapters of sites
    the adapter does not hold are kept (a run's fresh ones: ``B = 0``).

    Args:
      cfg: the run's config (``lora`` enabled; :func:`adapter_lora_config` derives one).
      adapter_dir: a PEFT LoRA adapter directory for ``family``'s module names.
      params: the run's parameters with adapters (either layer layout, kept).
      log: printer for a one-line summary.

    Returns:
      The parameters, the adapters read as numpy float32 arrays, the rest as they were.

    Raises:
      ValueError: ``cfg`` has no adapters.
      HFFormatError: the adapter does not fit ``cfg`` (:func:`adapter_lora_config`), or a stacked
        site's ``B`` mixes its moefast adapters (non-zero off its diagonal blocks).
    """
    if not cfg.lora.enabled:
        raise ValueError("the run has no adapters (lora.rank=0): adapter_lora_config(cfg, adapter_dir) gives the "
                         "lora section that holds this adapter")
    from safetensors import safe_open

    lc = adapter_lora_config(cfg, adapter_dir, family=family)
    conf, shapes, weights = _read(adapter_dir)
    unrolled = to_layout(params, cfg.model, scanned=False)
    spec, sites = _sites(cfg, int(unrolled["embed"].shape[0]), family)
    held = _check_keys(set(shapes), sites, adapter_dir, spec)
    values = dict(_flat_paths(unrolled))
    new: dict[tuple, np.ndarray] = {}

    def leaf(blk: _Block, suffix: str) -> np.ndarray:  # the adapter matrix being filled (host, float32)
        path = blk.path[:-1] + (blk.path[-1] + suffix,)
        if path not in new:
            new[path] = _host(values[path]).copy()
        return new[path]

    with safe_open(str(weights), framework="numpy") as f:
        for site in held:
            a, b = (np.asarray(f.get_tensor(site.key + f".lora_{x}.weight"), np.float32) for x in "AB")
            _read_site(site, a, b, conf, lc, leaf, adapter_dir)
    if log is not None:
        log(f"read {len(held)} of the {len(sites)} adapted sites of {spec.name} from {adapter_dir}"
            + (f"; the other {len(sites) - len(held)} keep fresh adapters (B = 0)" if len(held) < len(sites) else ""))
    return to_layout(_replaced(unrolled, new), cfg.model, scanned=cfg.model.scan_layers)


def _read_site(site: _Site, a: np.ndarray, b: np.ndarray, conf: dict, lc: LoRAConfig,
               leaf: Callable[[_Block, str], np.ndarray], adapter_dir: Any) -> None:
    """``site``'s PEFT ``lora_A`` ``a`` and ``lora_B`` ``b`` (float32, module docstring) into its
    moefast adapters (``leaf(block, LORA_A or LORA_B)``: the matrices to fill), ``B`` rescaled from
    PEFT's scale to the run's."""
    if site.expert:
        (blk,) = site.blocks
        r = a.shape[0] // site.experts
        ratio = _file_scale(conf, site, r) / lc.scale(blk.target)
        leaf(blk, lora.LORA_A)[...] = a.reshape(site.experts, r, -1).transpose(0, 2, 1)
        b_ore = _times(b.reshape(site.out, r, site.experts)[blk.rows], ratio)  # [out, r, E]
        leaf(blk, lora.LORA_B)[:, :, blk.cols] = b_ore.transpose(2, 1, 0)
        return
    ranks = [lc.rank_of(blk.target) for blk in site.blocks]
    stacked = len(ranks) > 1 and a.shape[0] == sum(ranks)  # else one A for every part (PEFT's own)
    starts = np.cumsum([0] + ranks) if stacked else [0] * len(ranks)
    for blk, r, at in zip(site.blocks, ranks, starts):
        rows_b = b[blk.rows]
        if stacked and (np.any(rows_b[:, :at]) or np.any(rows_b[:, at + r:])):
            raise HFFormatError(f"{adapter_dir}: {site.peft_name}'s lora_B mixes the {len(ranks)} moefast adapters its "
                                f"rank {a.shape[0]} stacks (non-zero off its diagonal blocks)")
        ratio = _file_scale(conf, site, a.shape[0]) / lc.scale(blk.target)
        leaf(blk, lora.LORA_A)[:, blk.part * r:(blk.part + 1) * r] = a[at:at + r].T
        leaf(blk, lora.LORA_B)[:, blk.cols] = _times(rows_b[:, at:at + r], ratio).T


def _times(x: np.ndarray, ratio: float) -> np.ndarray:
    """``x * ratio``; ``x`` itself where the ratio is 1 up to rounding (exact round trips)."""
    return x if abs(ratio - 1.0) < 1e-12 else x * np.float32(ratio)


def _replaced(tree: dict, leaves: dict[tuple, np.ndarray]) -> dict:
    """``tree`` (nested dicts) with the leaves at ``leaves``' paths replaced (in their old dtype)."""
    out = dict(tree)
    for path, v in leaves.items():
        d = out
        for k in path[:-1]:
            d[k] = dict(d[k])
            d = d[k]
        d[path[-1]] = v.astype(np.asarray(d[path[-1]]).dtype if not hasattr(d[path[-1]], "dtype")
                               else d[path[-1]].dtype)
    return out
