"""Reading a Hugging Face checkpoint's weights and routing state into moefast's parameters (the
engine of :mod:`moefast.interop.hf`, which documents the whole)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from moefast.config import ExperimentConfig, LoRAConfig
from moefast.interop import families
from moefast.interop.families import FamilySpec
from moefast.model.layout import layer_layout, to_layout
from moefast.model.transformer import build_model
from moefast.interop.hf_files import HFFormatError, _Files, _check_shape, hf_config
from moefast.interop.hf_tables import (_Leaf, _check_mtp, _disk_layout, _leaves, _mtp_copies, _mtp_layers_held,
                                      _mtp_tensors)
from moefast.interop.hf_configs import _IGNORED_TENSORS, _hf_sections, _language_config, config_from_hf


def _flat_paths(tree: Any) -> list[tuple[tuple, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), v) for path, v in flat]


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun`` in its number: ``1 tensor``, ``3 tensors``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _examples(names: list[str], shown: int = 3) -> str:
    """The tail of a message listing ``names``: all of them, or the first ``shown`` as examples."""
    return f", e.g. {names[:shown]}" if len(names) > shown else f": {names}"


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
    files.rename(spec.read_renames)
    cfg = cfg.replace(lora=LoRAConfig())  # the base model's parameters (adapters: moefast.model.lora.from_base)
    m = cfg.model
    vocab = m.vocab_size
    if vocab is None:
        raise HFFormatError("model.vocab_size is null; build the config with config_from_hf")
    hf = _language_config(hf_config(path))
    _check_mtp(spec, hf, m, path)
    on_disk = _mtp_layers_held(files.where, spec, hf)
    if m.mtp_depth > on_disk:
        held = _count(on_disk, "multi-token-prediction layer")
        raise HFFormatError(f"model.mtp_depth={m.mtp_depth}, but {path} holds {held} "
                            f"({spec.mtp_key}={hf.get(spec.mtp_key) if spec.mtp_key else None} in config.json); "
                            f"import with model.mtp_depth<={on_disk}")
    target = _abstract_params(cfg, vocab)
    unrolled = dict(_flat_paths(to_layout(target, m, scanned=False)))
    interleaved = bool(hf.get("rope_interleave", spec.hf_defaults.get("rope_interleave", False)))
    layout = _disk_layout(spec, cfg, files.where)
    leaves = _leaves(spec, cfg, layout, {p: a.shape for p, a in unrolled.items()}, interleaved)
    expected: dict[str, tuple[int, ...]] = {}
    for p, leaf in leaves.items():
        expected.update(leaf.transform.hf_shapes(leaf.names, unrolled[p].shape, leaf.sizes))
    expected.update({n: (cfg.moe.num_experts,) for n in _bias_names(spec, cfg, layout)})  # read by load_hf_routing
    copies = {n: next((c for c in main if c in files.where), main[0]) for n, main in _mtp_copies(spec, cfg)
              if n in files.where}
    missing = [n for n in expected if n not in files.where]
    if missing:
        raise HFFormatError(f"{path}: {_count(len(missing), 'tensor')} that config.json implies "
                            f"{'is' if len(missing) == 1 else 'are'} missing{_examples(missing)}")
    unexpected = [n for n in files.where if n not in expected and n not in copies
                  and not n.endswith(_IGNORED_TENSORS)]
    mtp = _mtp_tensors(spec, hf, unexpected, m.mtp_depth)
    if mtp:
        unexpected = [n for n in unexpected if n not in mtp]
        note = (f"{path}: {_count(len(mtp), 'tensor')} of the checkpoint's multi-token-prediction layers "
                f"({spec.mtp_key}={hf[spec.mtp_key]} in config.json) {'is' if len(mtp) == 1 else 'are'} not read "
                f"(model.mtp_depth={m.mtp_depth} reads the first {m.mtp_depth} whole layers)" +
                ("; the imported model predicts the next token only, as transformers' does" if not m.mtp_depth else ""))
        (log or warnings.warn)(note)
    skipped = {p: [n for n in unexpected if n.startswith(p)] for p in spec.skipped_tensors}
    skipped = {p: names for p, names in skipped.items() if names}
    if skipped:
        unexpected = [n for n in unexpected if not n.startswith(tuple(skipped))]
        (log or warnings.warn)(f"{path}: {_count(sum(map(len, skipped.values())), 'tensor')} not read (moefast reads "
                               f"{spec.name}'s language model only): " +
                               "; ".join(f"{spec.skipped_tensors[p]}: {len(names)}" for p, names in skipped.items()))
    if unexpected:
        raise HFFormatError(f"{path}: {_count(len(unexpected), 'tensor')} moefast has no place for"
                            f"{_examples(unexpected)} (an architecture option moefast does not implement?)")
    if files.fp8:
        bo, bi = files.block
        (log or warnings.warn)(f"{path}: FP8 block-quantized weights (block {bo}×{bi}) dequantized to float32 "
                               f"({_count(len(files.fp8), 'tensor')}, config.json's quantization_config)")
    if files.mxfp4:
        (log or warnings.warn)(f"{path}: MXFP4 expert weights dequantized to float32 "
                               f"({_count(len(files.mxfp4), 'tensor')}, config.json's quantization_config)")
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


def _bias_names(spec: FamilySpec, cfg: ExperimentConfig, layout: str = "per_expert") -> list[str]:
    """HF names of the MoE layers' selection biases [E] in the on-disk expert ``layout``, in layer
    order, then the MTP layers' (row j of the routing state's ``bias`` is the j-th, as
    :func:`~moefast.model.init_routing_state` orders them); empty when the family has none."""
    name = spec.router.bias_name(layout)
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
        files.rename(spec.read_renames)
        try:
            names = _bias_names(spec, cfg, _disk_layout(spec, cfg, files.where))
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
