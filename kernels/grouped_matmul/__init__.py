"""Grouped matmul: rows sorted by group, each group multiplied by its own matrix (MoE experts).

``grouped_matmul(x [N, I], w [G, I, O], group_sizes [G], impl=...)`` has the contract of
:func:`jax.lax.ragged_dot`: rows ``[offset_g, offset_g + group_sizes[g])`` times ``w[g]``, 0 for rows
after the last group. Implementations (``impl``):

* ``"pallas"`` — :mod:`.pallas`: a Pallas (Triton) grouped GEMM over (row tile, group) pairs, so
  the work is the real rows plus less than a tile per group boundary, forward and both backward
  products; compiled on GPU, interpreted on CPU (tests only).
* ``"ragged_dot"`` — :func:`jax.lax.ragged_dot`: TPU's grouped kernel; XLA:GPU (jax 0.10.2) and
  XLA:CPU expand it into dense one-hot work (G times the FLOPs).
* ``"tiled"`` — :mod:`.tiled`: full tiles in a loop with a run-time trip count plus one partial
  piece per group, so the work is the real rows plus less than ``granule_rows`` rows per group;
  a custom VJP with the same schedule.
* ``"auto"`` — ``"pallas"`` when compiling for GPUs, ``"tiled"`` on CPU, ``"ragged_dot"`` on TPU.

:func:`.reference.grouped_matmul_reference` is the dense truth both are tested against.
"""

from __future__ import annotations

from typing import Literal

import jax

from ..platform import target_platform
from .pallas import grouped_matmul_pallas
from .reference import grouped_matmul_reference, validate
from .tiled import check_tiles, grouped_matmul_tiled

__all__ = ["IMPLS", "grouped_matmul", "grouped_matmul_pallas", "grouped_matmul_reference", "resolve"]

IMPLS = ("auto", "pallas", "ragged_dot", "tiled")
Impl = Literal["auto", "pallas", "ragged_dot", "tiled"]


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`).

    Raises:
      ValueError: an unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"grouped matmul impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return {"cpu": "tiled", "gpu": "pallas"}.get(platform or target_platform(), "ragged_dot")
    return impl


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: Impl = "auto",
                   tile_rows: int = 512, granule_rows: int = 128) -> jax.Array:
    """Rows of each group times that group's matrix.

    Args:
      x: [N, I] rows sorted by group, any float dtype.
      w: [G, I, O], the dtype of ``x``.
      group_sizes: [G] int32, rows per group, ``sum(group_sizes) <= N`` (may be traced).
      impl: one of :data:`IMPLS`.
      tile_rows: ``"tiled"`` only — rows of a full tile; ``"pallas"`` picks its own tile
        (:func:`.pallas.tile_rows_for`).
      granule_rows: ``"tiled"`` only — the granularity of the partial piece, in rows (divides
        ``tile_rows``).

    Returns:
      [N, O] in ``x.dtype``; 0 for rows after the last group. Differentiable with ``jax.grad`` /
      ``jax.vjp`` with respect to ``x`` and ``w`` (``"tiled"``: not ``jax.jvp``).

    Raises:
      ValueError: bad shapes (see :func:`.reference.validate`), an unknown ``impl``, or tile sizes
        that do not divide.
    """
    validate(x, w, group_sizes)
    impl = resolve(impl)
    if impl == "tiled":
        check_tiles(tile_rows, granule_rows)
        return grouped_matmul_tiled(x, w, group_sizes.astype("int32"), tile_rows, granule_rows)
    if impl == "pallas":
        return grouped_matmul_pallas(x, w, group_sizes)
    return jax.lax.ragged_dot(x, w, group_sizes.astype("int32"))
