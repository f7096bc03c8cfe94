"""Grouped matmul: rows sorted by group, each group multiplied by its own matrix (MoE experts).

``grouped_matmul(x [N, I], w [G, I, O], group_sizes [G], impl=...)`` has the contract of
:func:`jax.lax.ragged_dot`: rows ``[offset_g, offset_g + group_sizes[g])`` times ``w[g]``, 0 for rows
after the last group. Implementations (``impl``):

* ``"ragged_dot"`` — :func:`jax.lax.ragged_dot`: grouped kernels on GPU/TPU; XLA:CPU lowers it to
  dense work (G times the FLOPs).
* ``"tiled"`` — :mod:`.tiled`: full tiles in a loop with a run-time trip count plus one partial
  piece per group, so the work is the real rows plus less than ``granule_rows`` rows per group;
  a custom VJP with the same schedule.
* ``"auto"`` — ``"tiled"`` on CPU, ``"ragged_dot"`` elsewhere.

:func:`.reference.grouped_matmul_reference` is the dense truth both are tested against.
"""

from __future__ import annotations

from typing import Literal

import jax

from ..platform import target_platform
from .reference import grouped_matmul_reference, validate
from .tiled import check_tiles, grouped_matmul_tiled

__all__ = ["IMPLS", "grouped_matmul", "grouped_matmul_reference", "resolve"]

IMPLS = ("auto", "ragged_dot", "tiled")
Impl = Literal["auto", "ragged_dot", "tiled"]


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`).

    Raises:
      ValueError: an unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"grouped matmul impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "tiled" if (platform or target_platform()) == "cpu" else "ragged_dot"
    return impl


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: Impl = "auto",
                   tile_rows: int = 512, granule_rows: int = 128) -> jax.Array:
    """Rows of each group times that group's matrix.

    Args:
      x: [N, I] rows sorted by group, any float dtype.
      w: [G, I, O], the dtype of ``x``.
      group_sizes: [G] int32, rows per group, ``sum(group_sizes) <= N`` (may be traced).
      impl: one of :data:`IMPLS`.
      tile_rows, granule_rows: ``"tiled"`` only — rows of a full tile and the granularity of the
        partial piece (``granule_rows`` divides ``tile_rows``).

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
    return jax.lax.ragged_dot(x, w, group_sizes.astype("int32"))
