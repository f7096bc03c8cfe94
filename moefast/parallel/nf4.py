"""NF4 (4-bit NormalFloat) storage for frozen base weights (QLoRA, Dettmers et al. 2023,
arXiv:2305.14314, sec. 3 and Appendix E): each block of 64 consecutive values along a weight's last
axis is scaled by its max-abs onto [-1, 1] and every value stored as the 4-bit index of the nearest
of 16 fixed levels, two indices a byte; ``w ≈ NF4_CODE[index] * absmax``.

Layout of a weight ``w`` [..., O] (leading axes kept, so both arrays shard like the weight on them):
the last axis zero-padded to ``Op = ceil(O / 64) * 64``; ``codes`` [..., Op / 2] uint8, column
``2j`` in the low nibble of byte ``j`` and column ``2j + 1`` in its high nibble; ``absmax``
[..., Op / 64] float32, one a block. (bitsandbytes packs the first value of a pair in the HIGH
nibble and blocks the flattened tensor, so its bytes are not these.)

Rounding, as bitsandbytes' ``dQuantizeNF4`` (csrc/kernels.cu) and its torch reference
(``bucketize`` on the midpoints): ``x = w / absmax`` takes index ``i`` = the number of midpoints
``(NF4_CODE[k] + NF4_CODE[k+1]) / 2`` (float32) strictly below ``x``, so a value exactly on a
midpoint takes the lower level (bitsandbytes multiplies by ``1 / absmax`` instead of dividing,
which can pick the other level for values within an ulp of a midpoint). An all-zero block
stores absmax 0 (it is divided by 1) and dequantizes to exact zeros. Inputs must be finite."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["NF4", "NF4_BLOCK", "NF4_CODE", "nf4_bytes", "nf4_dequantize", "nf4_quantize"]

NF4_BLOCK = 64  # values along the last axis sharing one absmax (QLoRA sec. 3, blocksize 64)

# The 16 NF4 levels, ascending: QLoRA Appendix E; the same float32 values as bitsandbytes'
# `nf4_dequantization_lut` (csrc/kernels.cu) and `get_4bit_type("nf4")` (bitsandbytes/functional.py).
# A NumPy constant, so importing this module starts no JAX backend.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)
NF4_CODE.flags.writeable = False
_MIDPOINTS = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)  # [15] float32: bitsandbytes' thresholds


@dataclasses.dataclass(frozen=True)
class NF4:
    """A weight [..., O] in NF4 form (module docstring), a pytree: ``codes`` and ``absmax`` are its
    leaves and ``width`` (O) static aux data, so it passes through ``jax.jit``, ``jax.tree.map``
    and ``jax.shard_map`` (a single ``P(...)`` spec applies to both leaves), and lives in NNX state
    as ``nnx.data(q)`` or as the value of a non-``Param`` ``nnx.Variable`` (the width rides in the
    treedef / graphdef; an optimizer over ``nnx.Param`` never sees it).

    Attributes:
      codes: [..., Op / 2] uint8, two 4-bit indices into :data:`NF4_CODE` a byte.
      absmax: [..., Op / 64] float32, each block's max |w| (0 for an all-zero block).
      width: O, the weight's true last-axis size (a Python int).
    """
    codes: jax.Array
    absmax: jax.Array
    width: int


jax.tree_util.register_dataclass(NF4, data_fields=["codes", "absmax"], meta_fields=["width"])


def _blocks(o: int) -> int:
    return -(-o // NF4_BLOCK)


def nf4_quantize(w: jax.Array) -> NF4:
    """A weight to NF4 (module docstring). Jittable, pure jnp; runs on a local shard inside
    ``jax.shard_map`` when the last axis is not split.

    Args:
      w: [..., O] float (any float dtype, read as float32), finite.

    Returns:
      :class:`NF4` with codes [..., ceil(O/64)*32] uint8, absmax [..., ceil(O/64)] float32, width O.

    Raises:
      ValueError: ``w`` is 0-d (no last axis to block).
    """
    if w.ndim == 0:
        raise ValueError("nf4_quantize needs a weight with at least one axis, got a scalar")
    *lead, o = w.shape
    nb = _blocks(o)
    x = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, nb * NF4_BLOCK - o)])
    x = x.reshape(*lead, nb, NF4_BLOCK)
    absmax = jnp.max(jnp.abs(x), axis=-1)  # [..., nb]
    scaled = x / jnp.where(absmax > 0, absmax, 1.0)[..., None]
    # side="left": the count of midpoints strictly below each value (a tie takes the lower level).
    idx = jnp.searchsorted(jnp.asarray(_MIDPOINTS), scaled, side="left", method="scan_unrolled")
    pairs = idx.astype(jnp.uint8).reshape(*lead, nb * NF4_BLOCK // 2, 2)
    return NF4(pairs[..., 0] | (pairs[..., 1] << 4), absmax, o)


def nf4_dequantize(q: NF4, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`nf4_quantize`. Jittable; elementwise plus reshapes of the last axis, so it
    runs on a local shard inside ``jax.shard_map`` (the last axis whole on each device).

    Args:
      q: :class:`NF4` of a weight [..., O].
      dtype: the result's dtype (float32 by default).

    Returns:
      [..., O] in ``dtype``: ``NF4_CODE[index] * absmax`` computed in float32, then cast.

    Raises:
      ValueError: ``codes``, ``absmax`` and ``width`` do not describe the same blocks.
    """
    *lead, half = q.codes.shape
    nb = q.absmax.shape[-1]
    if half * 2 != nb * NF4_BLOCK or tuple(q.absmax.shape[:-1]) != tuple(lead) or _blocks(q.width) != nb:
        raise ValueError(f"NF4 codes {q.codes.shape}, absmax {q.absmax.shape} and width {q.width} disagree: "
                         f"expected codes [..., {_blocks(q.width) * NF4_BLOCK // 2}], absmax [..., {_blocks(q.width)}]")
    idx = jnp.stack([q.codes & 0xF, q.codes >> 4], axis=-1).reshape(*lead, nb, NF4_BLOCK)
    x = jnp.asarray(NF4_CODE)[idx] * q.absmax.astype(jnp.float32)[..., None]
    return x.reshape(*lead, nb * NF4_BLOCK)[..., :q.width].astype(dtype)


def nf4_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of the NF4 form of a weight of ``shape`` [..., O]: ``codes`` (Op / 2 a row) plus
    ``absmax`` (4 a block of 64), Op = O rounded up to a multiple of 64; 0.5625 B a value when
    64 divides O."""
    *lead, o = shape
    return math.prod(lead) * _blocks(o) * (NF4_BLOCK // 2 + 4)
