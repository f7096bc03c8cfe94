"""Which Hugging Face tensor holds which moefast parameter, for a model config: the per-layer tables
of a family (main layers and multi-token-prediction layers), both directions walk them (the engine
of :mod:`moefast.interop.hf`, which documents the whole)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moefast.config import ExperimentConfig, ModelConfig
from moefast.interop.families import FamilySpec, Transform
from moefast.interop.hf_files import HFFormatError, _Files


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
    mixer = spec.linear_table(layout) if cfg.model.layer_type(i) == "linear_attention" else spec.layer_tensors
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
    def seen(i):  # the config as layer i sees it: its own attention shape (ModelConfig.at_layer)
        return m if i is None else m.at_layer(i)

    return {p: _Leaf(row.transform_for(seen(i)), tuple(n.format(i=i, e="{e}") for n in row.names),
                     row.sizes(seen(i), shapes[p][-1]), perms[sub](seen(i)) if sub in perms else None)
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


# ------------------------------------------------------------------------ multi-token prediction
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
