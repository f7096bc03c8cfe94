"""Writing moefast parameters as a Hugging Face checkpoint (the engine of :mod:`moefast.interop.hf`,
which documents the whole)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes  # registers bfloat16 with numpy, so safetensors' numpy API reads BF16; float8 for FP8
import numpy as np

from moefast.config import ExperimentConfig
from moefast.interop import families
from moefast.interop.families import FamilySpec
from moefast.model.layout import to_layout
from moefast.interop.hf_files import HFFormatError, _host
from moefast.interop.hf_tables import _Leaf, _leaves, _mtp_copies
from moefast.interop.hf_configs import _TOKENIZER_FILES, _export_config, hf_family
from moefast.interop.hf_read import _bias_names, _flat_paths


def _bias_rows(spec: FamilySpec, cfg: ExperimentConfig, routing_state: dict | None,
               layout: str = "per_expert") -> list[tuple[str, np.ndarray]]:
    """``(HF name, float32 [E])`` of each MoE layer's selection bias for ``spec`` (empty for a
    family without one).

    Raises:
      HFFormatError: no routing state for a family with a selection bias; a non-zero bias for a family
        without one.
    """
    names = _bias_names(spec, cfg, layout)
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


FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""config.json's ``quantization_config`` of an ``fp8`` export: DeepSeek-V3's block-quantized layout."""
# tensors an fp8 export keeps in bfloat16 (DeepSeek-V3 quantizes every Linear weight but its router's, the
# embeddings' and the output head's): routers, embeddings, heads, norms, biases, convolutions, decay rates
_NOT_FP8 = re.compile(r"embed_tokens|lm_head|shared_head|\.gate\.weight$|router|norm|bias|conv1d|A_log|sinks|scale")


def _fp8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [..., O, I] as float8_e4m3fn and its float32 ``scale_inv`` [..., ceil(O/128), ceil(I/128)],
    so that the reader's ``q[..., r, c] * scale_inv[..., r // 128, c // 128]`` gives ``x`` to e4m3's
    precision (DeepSeek-V3 repo, ``inference/fp8_cast_bf16.py``). A block's scale is the training
    quantizer's (:mod:`moefast.parallel.fp8`): its max-abs / 448, at least the smallest normal float32
    (a block whose max-abs is subnormal would otherwise get scale 0 and NaN codes), 1 for an all-zero
    block."""
    x = np.asarray(x, np.float32)
    *lead, o, i = x.shape
    po, pi = -o % 128, -i % 128
    xp = np.pad(x, [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    b = xp.reshape(*lead, (o + po) // 128, 128, (i + pi) // 128, 128)
    amax = np.abs(b).max(axis=(-3, -1))
    s = np.where(amax > 0, np.maximum(amax * np.float32(1 / 448), np.finfo(np.float32).tiny), 1).astype(np.float32)
    q = np.clip(b * (np.float32(1) / s)[..., :, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(xp.shape)[..., :o, :i], s


def _fp8_rows(tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Every matrix but the routers', the embeddings', the output heads' and convolutions'
    (:data:`_NOT_FP8`: the attention and MLP projections, routed and shared experts in either layout)
    as FP8 blocks with their ``_scale_inv``; the rest in bfloat16.

    Raises:
      ValueError: a tensor with a non-finite value (FP8 cannot encode one, and a block's scale would
        spread it over the block; the bfloat16 ones are refused alike), or (a bug) a non-finite code
        or scale; the export writes nothing then (it writes into a temporary directory it removes on
        failure).
    """
    for name, x in tensors:
        if not np.isfinite(np.asarray(x, np.float32)).all():
            raise ValueError(f"export-hf --dtype fp8: {name} holds non-finite values (NaN or inf): export a "
                             "checkpoint with finite weights (nothing was written)")
        if np.ndim(x) >= 2 and not _NOT_FP8.search(name):
            q, s = _fp8_blocks(x)
            codes = q.view(np.uint8) & 0x7F  # e4m3fn's only non-finite code is S.1111.111
            if (codes == 0x7F).any() or not (np.isfinite(s) & (s > 0)).all():
                raise ValueError(f"export-hf --dtype fp8: {name} quantized to non-finite codes or scales "
                                 "(a bug in moefast; nothing was written)")
            yield name, q
            yield name + "_scale_inv", s
        else:
            yield name, np.asarray(x).astype(ml_dtypes.bfloat16)


def _special_ids(cfg: ExperimentConfig, vocab_size: int) -> dict[str, int | None]:
    """BOS/EOS/PAD ids of the run's tokenizer for config.json (``None`` where it has none, or where
    an id is outside the model's vocabulary, e.g. the byte tokenizer's with a smaller model)."""
    from moefast.data import get_tokenizer

    tok = get_tokenizer(cfg.data.tokenizer)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    return {k: (v if v is not None and v < vocab_size else None) for k, v in ids.items()}


def _written_as(family: str | None, spec: FamilySpec) -> str:
    """Why ``spec``'s ``model_type`` is written when ``family`` was asked for (one that moefast
    reads but writes as another: :attr:`FamilySpec.export_as`); ``""`` when it is the same."""
    if family is None or family == spec.model_type:
        return ""
    asked = families.REGISTRY[family]
    if asked.text_config_key:  # a vision-language (multimodal) checkpoint: moefast holds its language model
        why = (f"moefast holds the language model of {asked.name} only, written as its text model "
               f"({spec.architecture}, which transformers' AutoModelForCausalLM loads)")
    else:
        why = (f"transformers does not know {family}; {spec.model_type} ({spec.architecture}) is the same "
               "architecture")
    return f"; model_type {spec.model_type}, not {family}: {why}"


def save_hf(cfg: ExperimentConfig, params: dict, out_dir: str | Path, *, routing_state: dict | None = None,
            layout: str = "per_expert", dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
            family: str | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Writes moefast parameters as an HF model directory.

    The directory is assembled next to ``out_dir`` and renamed into place when complete, so an
    interrupted export never leaves a half-written model under ``out_dir``.

    Args:
      cfg: the experiment the parameters belong to. A run with ``lora`` is written as its model
        with the adapters merged (:func:`moefast.interop.hf_adapter.merged_base`: ``W + (alpha /
        r) A B`` per projection and expert, float32, from the base as stored), a model of the base
        architecture; its adapters alone are :func:`~moefast.interop.hf_adapter.save_peft_adapter`'s.
      params: the parameters (either layer layout; jax arrays, sharded or not, or numpy).
      routing_state: the run's routing state (``{"bias": [L_moe, E], ...}``, the train state's
        ``routing``): its ``bias`` rows are written as the MoE layers' selection biases
        (``e_score_correction_bias``, always float32) of a family that has them, where it is
        required; for other families it must be zero or ``None``.
      out_dir: new directory (must not exist, or be empty).
      layout: ``"per_expert"`` (``experts.{e}.*`` tensors: what ``save_pretrained`` writes by
        default and older readers expect) or ``"fused"`` (``experts.gate_up_proj`` /
        ``experts.down_proj``).
      dtype: ``"float32"`` or ``"bfloat16"`` for the saved tensors, or ``"fp8"``: DeepSeek-V3's
        block-quantized layout (every matrix but the routers', embeddings' and output heads' --
        attention and MLP projections, experts in either layout -- as float8_e4m3fn with a float32
        ``weight_scale_inv`` per 128 x 128 block, the rest bfloat16, config.json's
        ``quantization_config``: :data:`FP8_BLOCK_CONFIG`), which :func:`load_hf` reads back.
      max_shard_bytes: bytes per safetensors file; more makes shards and an index.
      family: HF ``model_type`` to write (e.g. ``"glm4_moe_lite"`` for a GLM-4.7-Flash fine-tune,
        which ``deepseek_v3`` represents too); ``None``: the first that fits (:func:`hf_family`).
        A family written as another (``FamilySpec.export_as``: ``qwen3_5_moe`` as
        ``qwen3_5_moe_text``, ``kimi_k2`` as ``deepseek_v3``) is written as that one.
      log: printer for a one-line summary (with, for a ``family`` written as another, which
        ``model_type`` was written and why).

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
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "fp8": np.float32}.get(dtype)
    if np_dtype is None:
        raise ValueError(f"dtype={dtype!r}: expected 'float32', 'bfloat16' or 'fp8'")
    if dtype == "fp8" and layout == "fused" and any(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers)):
        warnings.warn("export-hf --dtype fp8 --layout fused: transformers reads the fused experts' "
                      "gate_up_proj_scale_inv / down_proj_scale_inv only in its GPU FP8 experts; on CPU it leaves "
                      "them unused and multiplies the raw e4m3 codes (wrong logits, no error): export "
                      "--layout per_expert for a checkpoint every reader dequantizes", stacklevel=2)
    merged = ""
    if cfg.lora.enabled:
        from moefast.interop.hf_adapter import merged_base

        cfg, params = merged_base(cfg, params)
        merged = ", LoRA adapters merged into the weights"
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
    bias_rows = _bias_rows(spec, cfg, routing_state, layout)

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
        rows = itertools.chain(tensors, _copy_rows(spec, cfg, leaves, values, np_dtype))
        if dtype == "fp8":
            rows = _fp8_rows(rows)
        for name, x in itertools.chain(rows, bias_rows):
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
            hf = _export_config(cfg, spec, vocab, "bfloat16" if dtype == "fp8" else dtype, special)
            if dtype == "fp8":
                hf["quantization_config"] = dict(FP8_BLOCK_CONFIG)
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
                log(f"wrote {spec.model_type} ({layout} experts, {dtype}{merged}) to {out_dir}: {n} safetensors file(s), "
                    f"{total / 2**20:,.1f} MiB" + _written_as(family, spec))
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
