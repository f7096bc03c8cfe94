"""A Hugging Face checkpoint's files on disk: safetensors headers, the shards of an index, a
tensor's bytes read lazily (and FP8 block-quantized ones dequantized), shape checks; and
:class:`HFFormatError`, the error of everything in :mod:`moefast.interop.hf` (the engine's lowest
layer: it knows files, not families)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes  # registers bfloat16 with numpy, so safetensors' numpy API reads BF16; float8 for FP8
import numpy as np

from moefast.config import ConfigError


def _host(x: Any) -> np.ndarray:
    """``x`` as a NumPy array on this host (a multi-host array gathered from every process)."""
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


class HFFormatError(ConfigError):
    """A Hugging Face checkpoint (or a config to export as one) uses something moefast cannot
    represent, or its files do not match its ``config.json``."""


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
    if method == "mxfp4":  # gpt-oss's experts: their _blocks / _scales tensors say it (_Files)
        return None
    if method != "fp8":
        reject("quant_method", method, "moefast reads unquantized checkpoints, FP8 block-quantized ones "
                                       "(quant_method 'fp8' with weight_block_size, as DeepSeek-V3 and Kimi K2) and "
                                       "gpt-oss's MXFP4 experts (quant_method 'mxfp4')")
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


_MXFP4_BLOCKS, _MXFP4_SCALES = "_blocks", "_scales"
# the 16 values of an FP4 (e2m1) code, sign in the high bit (OCP Microscaling Formats (MX) v1.0, sec. 5.3.3)
_FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     np.float32)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP Microscaling v1.0: 32 FP4 e2m1 values sharing one e8m0 power-of-two scale) as
    gpt-oss's checkpoints store an expert weight ``X`` [E, O, I] (applied transposed: ``x @ X[e].T``
    is HF's unquantized ``x @ X'[e]`` with ``X'`` [E, I, O]): ``X_blocks`` uint8 [E, O, I/32, 16],
    two codes a byte, the low nibble first, and ``X_scales`` uint8 [E, O, I/32], the exponent plus
    127. Returns the unquantized HF layout ``X'`` [E, I, O], float32 (exact: every value is a
    power-of-two multiple of a code).

    Raises:
      HFFormatError: the scales' shape is not the blocks' without their last axis, or blocks not
        16 bytes (32 values) each.
    """
    if blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1] or blocks.ndim != 4:
        raise HFFormatError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
                            "blocks are [experts, out, in/32, 16] bytes and scales [experts, out, in/32]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(_FP4_E2M1[codes], scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


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

    gpt-oss's MXFP4 experts (``quant_method: mxfp4``): ``X_blocks`` and ``X_scales`` read as the
    unquantized ``X`` they stand for (:func:`mxfp4_dequantize`; a row slice: those experts only).
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
        self._disk: dict[str, str] = {}  # a renamed tensor's name (rename) -> its name in the file
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
        self.mxfp4: dict[str, tuple[int, ...]] = {}  # X (its _blocks and _scales on disk) -> X's shape
        self._mx_where: dict[str, tuple[str, str]] = {}  # X -> the files of its blocks and scales
        q = hf_config(path).get("quantization_config") if (path / "config.json").is_file() else None
        mx = isinstance(q, Mapping) and q.get("quant_method") == "mxfp4"
        for k in [k for k in self.where if mx and k.endswith(_MXFP4_BLOCKS)]:
            base = k[:-len(_MXFP4_BLOCKS)]
            if base + _MXFP4_SCALES not in self.where:
                raise HFFormatError(f"{path}: MXFP4 tensor {k} has no {base + _MXFP4_SCALES} (its scales); the "
                                    "checkpoint is incomplete")
            blocks = tuple(self.handles[self.where[k]].get_slice(k).get_shape())
            scales = tuple(self.handles[self.where[base + _MXFP4_SCALES]].get_slice(base + _MXFP4_SCALES).get_shape())
            if len(blocks) != 4 or blocks[-1] != 16 or scales != blocks[:-1]:
                raise HFFormatError(f"{path}: MXFP4 {k} {list(blocks)} and {base + _MXFP4_SCALES} {list(scales)} do "
                                    "not match: blocks are [experts, out, in/32, 16] bytes, scales [experts, out, in/32]")
            self.mxfp4[base] = (blocks[0], blocks[2] * 32, blocks[1])
            self.where[base] = self.where[k]
            self._mx_where[base] = (self.where.pop(k), self.where.pop(base + _MXFP4_SCALES))
        if mx and not self.mxfp4:
            raise HFFormatError(f"{path}: config.json says quant_method 'mxfp4' but no tensor is stored as MXFP4 "
                                "(X_blocks with X_scales): the checkpoint and its config disagree")
        for scale in self._scale_where:
            weight = scale[:-len(_SCALE_INV)]
            if weight not in self.fp8:
                dtype = headers[self.where[weight]][0][weight]["dtype"] if weight in self.where else None
                raise HFFormatError(f"{path}: {scale} holds block scales of {weight}, which is "
                                    f"{dtype or 'missing'}, not an F8_E4M3 weight")
            del self.where[scale]

    def rename(self, renames: tuple[tuple[str, str], ...]) -> None:
        """Tensors known by other names: each ``(regex, replacement)`` (``re.sub``) applied to the
        names on disk (a family's ``read_renames``); ``get`` and ``shape`` take the new names.

        Raises:
          HFFormatError: a renamed tensor's new name is a tensor of the files too.
        """
        for old in list(self.where) if renames else []:
            new = old
            for pattern, replacement in renames:
                new = re.sub(pattern, replacement, new)
            if new == old or old in self.fp8 or old in self.mxfp4:  # quantized weights keep their names
                continue
            if new in self.where:
                raise HFFormatError(f"{self.path}: {old} and {new} are the same tensor under two names; keep one")
            self.where[new] = self.where.pop(old)
            self._disk[new] = old

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4:
            return self.mxfp4[name]
        return tuple(self.handles[self.where[name]].get_slice(self._disk.get(name, name)).get_shape())

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """float32 array of tensor ``name`` (only ``rows``, a contiguous slice, of its first axis
        when given); an FP8 weight dequantized (for a row slice: the scale rows of the blocks
        that cover it, cropped)."""
        if name in self.fp8:
            return self._dequantized(name, rows)
        if name in self.mxfp4:
            blocks, scales = (np.asarray(self.handles[f].get_slice(n)[rows if rows is not None else slice(None)])
                              for f, n in zip(self._mx_where[name], (name + _MXFP4_BLOCKS, name + _MXFP4_SCALES)))
            return mxfp4_dequantize(blocks, scales)
        s = self.handles[self.where[name]].get_slice(self._disk.get(name, name))
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
