"""Grouped matmul as a Pallas (Triton) kernel: the work is the real rows, on GPU.

Dimension letters: N rows, G groups, I input features, O output features, M rows of a tile, Nb/Kb
the output and contraction tile widths.

XLA:GPU expands :func:`jax.lax.ragged_dot` into dense one-hot work (G times the FLOPs; jax 0.10.2).
Here the rows, sorted by group, are cut into row tiles of M rows, scheduled as the group metadata
of JAX's TPU grouped matmul (``jax.experimental.pallas.ops.tpu.megablox``) does: tile ``b`` of the
rows belongs to every group whose rows intersect it, so there are at most ``N / M + G - 1`` (tile,
group) pairs (grouped GEMMs for MoE: MegaBlocks, Gale et al. 2023). A small table built in JAX before the
launch lists them (group, first row of the tile, the group's rows inside it); the kernel has one
program per (pair, output tile) and multiplies the tile's rows by ``w[group]``, masking the rows of
other groups on load and on store. Pairs beyond the real number (it depends on the group sizes at
run time) exit at once. The work is the real rows plus less than M rows per group boundary.

The backward pass (``jax.custom_vjp``) uses the same kernels: ``dx = grouped(dy, w^T)`` (the
weight tile read transposed, no copy of ``w``) and a weight-gradient kernel with one program per
(group, I tile, O tile) that sums ``x_tile^T dy_tile`` over the group's row tiles (a loop whose
trip count is read at run time) in float32; a group without rows gets a zero gradient.

The tile M is the largest of 16..128 rows whose worst case wastes at most 10 % of the rows
(:func:`tile_rows_for`). The kernels' names carry their tile sizes (and the weight-gradient kernel
its number of pairs), from which ``moefast bench gpu-compile`` counts their FLOPs.

Feature sizes that are not multiples of 16 (Triton's dot) are zero-padded and N is padded to a
multiple of M (copies: keep them multiples). On CPU the kernels run in the Pallas interpreter
(tests only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..platform import target_platform
from .reference import validate
from ..vma import out_struct, vary_together

__all__ = ["MAX_WASTE", "TILE_ROWS", "grouped_matmul_pallas", "tile_rows_for", "tile_table"]

TILE_ROWS = (16, 32, 64, 128)  # M: rows per tile (a boundary between groups wastes less than M rows)
MAX_WASTE = 0.1  # the largest tile whose worst case wastes at most this fraction of the rows


def tile_rows_for(num_rows: int, num_groups: int) -> int:
    """M: the largest of :data:`TILE_ROWS` whose worst-case waste, ``(G - 1) x M`` rows at the group
    boundaries, is at most :data:`MAX_WASTE` of the N rows (16 when none is: few rows per group)."""
    fits = [m for m in TILE_ROWS if (num_groups - 1) * m <= MAX_WASTE * num_rows]
    return max(fits) if fits else TILE_ROWS[0]


def _width(n: int, cap: int = 64) -> int:
    """The largest power of two <= ``cap`` dividing ``n`` (at least 16: Triton's dot)."""
    w = cap
    while w >= 16:
        if n % w == 0:
            return w
        w //= 2
    raise ValueError(f"the grouped matmul kernel needs feature sizes that are multiples of 16, got {n}")


def table_pairs(num_rows: int, num_groups: int, tile_rows: int) -> int:
    """P, the static number of (row tile, group) pairs: ``N / M + G - 1``."""
    return -(-num_rows // tile_rows) + num_groups - 1


def tile_table(group_sizes: jax.Array, num_rows: int, tile_rows: int) -> jax.Array:
    """[4, P] int32 (P = N / M + G - 1 pairs): per (row tile, group) pair the group (-1: unused),
    the tile's first row, and the group's first and end rows clipped to the tile.

    Args:
      group_sizes: [G] int32 rows per group (sum <= N).
      num_rows: N, a multiple of ``tile_rows``.
      tile_rows: M.
    """
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile_rows
    # tiles a non-empty group touches: [first, last]; an empty group none
    count = jnp.where(sizes > 0, (ends - 1) // tile_rows - first + 1, 0)
    pair_end = jnp.cumsum(count)
    pairs = table_pairs(num_rows, g, tile_rows)
    p = jnp.arange(pairs, dtype=jnp.int32)
    group = jnp.searchsorted(pair_end, p, side="right").astype(jnp.int32)  # G where p is past the last pair
    used = group < g
    gi = jnp.minimum(group, g - 1)
    tile = first[gi] + p - (pair_end[gi] - count[gi])
    row0 = tile * tile_rows
    lo = jnp.maximum(starts[gi], row0)
    hi = jnp.minimum(ends[gi], row0 + tile_rows)
    return jnp.stack([jnp.where(used, gi, -1), jnp.where(used, row0, 0), lo, jnp.where(used, hi, lo)]).astype(jnp.int32)


def _gmm_kernel(table_ref, x_ref, w_ref, o_ref, *, tile_rows: int, bn: int, bk: int, transpose_w: bool):
    p, j = pl.program_id(0), pl.program_id(1)
    g, row0, lo, hi = table_ref[0, p], table_ref[1, p], table_ref[2, p], table_ref[3, p]

    @pl.when(g >= 0)
    def _():
        rows = row0 + jnp.arange(tile_rows)
        keep = ((rows >= lo) & (rows < hi))[:, None]
        k_dim = x_ref.shape[1]

        def body(kk, acc):
            xb = plgpu.load(x_ref.at[pl.ds(row0, tile_rows), pl.ds(kk * bk, bk)], mask=keep, other=0.0)
            if transpose_w:  # w is [G, O, I]: read its [Nb, Kb] tile and contract its second dim
                wb = w_ref[g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)]
                return acc + plgpu.dot(xb, wb, trans_b=True)
            wb = w_ref[g, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)]
            return acc + plgpu.dot(xb, wb)

        acc = jax.lax.fori_loop(0, k_dim // bk, body, jnp.zeros((tile_rows, bn), jnp.float32))
        plgpu.store(o_ref.at[pl.ds(row0, tile_rows), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype), mask=keep)


def _gmm(x, w, table, *, transpose_w: bool, tile_rows: int, interpret: bool):
    """[N, O] = rows of each pair's group times ``w[g]`` (``w[g]^T`` if ``transpose_w``); rows in no
    pair are left unwritten (the caller masks them)."""
    n, k_dim = x.shape
    o = w.shape[1] if transpose_w else w.shape[2]
    bn, bk = _width(o), _width(k_dim)
    kernel = functools.partial(_gmm_kernel, tile_rows=tile_rows, bn=bn, bk=bk, transpose_w=transpose_w)
    (table, x, w), _ = vary_together(table, x, w)
    return pl.pallas_call(
        kernel, grid=(table.shape[1], o // bn), out_shape=out_struct(x, (n, o), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3), interpret=interpret,
        name=f"grouped_matmul_m{tile_rows}_n{bn}_k{k_dim}")(table, x, w)  # the name gives the FLOPs


def _dw_kernel(bounds_ref, x_ref, dy_ref, dw_ref, *, tile_rows: int):
    g = pl.program_id(0)
    start, end = bounds_ref[0, g], bounds_ref[1, g]
    bi, bo = dw_ref.shape
    a, b = pl.program_id(1), pl.program_id(2)
    first = start // tile_rows
    trips = jnp.where(end > start, (end - 1) // tile_rows - first + 1, 0)

    def body(c, acc):
        row0 = (first + c) * tile_rows
        rows = row0 + jnp.arange(tile_rows)
        keep = ((rows >= start) & (rows < end))[:, None]
        xb = plgpu.load(x_ref.at[pl.ds(row0, tile_rows), pl.ds(a * bi, bi)], mask=keep, other=0.0)
        db = plgpu.load(dy_ref.at[pl.ds(row0, tile_rows), pl.ds(b * bo, bo)], mask=keep, other=0.0)
        return acc + plgpu.dot(xb, db, trans_a=True)

    acc = jax.lax.fori_loop(0, trips, body, jnp.zeros((bi, bo), jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _weight_grads(x, dy, group_sizes, *, tile_rows: int, interpret: bool, out_dtype):
    """[G, I, O]: per group the sum over its rows of ``x_row^T dy_row`` (float32 accumulation)."""
    i_dim, o = x.shape[1], dy.shape[1]
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    bounds = jnp.stack([ends - sizes, ends])
    bi, bo = _width(i_dim), _width(o)
    (bounds, x, dy), _ = vary_together(bounds, x, dy)
    return pl.pallas_call(
        functools.partial(_dw_kernel, tile_rows=tile_rows), grid=(g, i_dim // bi, o // bo),
        out_specs=pl.BlockSpec((None, bi, bo), lambda e, a, b: (e, a, b)),
        out_shape=out_struct(x, (g, i_dim, o), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3), interpret=interpret,
        name=f"grouped_matmul_dw_m{tile_rows}_p{table_pairs(x.shape[0], g, tile_rows)}_r{x.shape[0]}_i{bi}_o{bo}"
    )(bounds, x, dy)


def _rows_in_groups(y, group_sizes):
    """``y`` with the rows after the last group set to 0 (the kernel never writes them)."""
    live = jnp.arange(y.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes.astype(jnp.int32))
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, group_sizes, tile_rows, interpret):
    table = tile_table(group_sizes, x.shape[0], tile_rows)
    return _rows_in_groups(_gmm(x, w, table, transpose_w=False, tile_rows=tile_rows, interpret=interpret), group_sizes)


def _fwd(x, w, group_sizes, tile_rows, interpret):
    return _grouped(x, w, group_sizes, tile_rows, interpret), (x, w, group_sizes)


def _bwd(tile_rows, interpret, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    table = tile_table(group_sizes, x.shape[0], tile_rows)
    dx = _rows_in_groups(_gmm(dy, w, table, transpose_w=True, tile_rows=tile_rows, interpret=interpret),
                         group_sizes)
    dw = _weight_grads(x, dy, group_sizes, tile_rows=tile_rows, interpret=interpret, out_dtype=w.dtype)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_grouped.defvjp(_fwd, _bwd)


def grouped_matmul_pallas(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile_rows: int | None = None,
                          interpret: bool | None = None) -> jax.Array:
    """Grouped matmul whose work is the real rows (module docstring).

    Args:
      x: [N, I] rows sorted by group (float16/bfloat16/float32).
      w: [G, I, O] in the dtype of ``x`` (I and O not multiples of 16 are zero-padded: a copy).
      group_sizes: [G] int32 rows per group (``sum <= N``; traced values are fine).
      tile_rows: M, rows per tile (a power of two >= 16); ``None``: :func:`tile_rows_for`.
      interpret: run in the Pallas interpreter; ``None``: when compiling for CPU.

    Returns:
      [N, O] in ``x.dtype`` (float32 accumulation); 0 for rows after the last group. Differentiable
      with ``jax.grad``/``jax.vjp`` (not ``jax.jvp``); empty groups get zero weight gradients.

    Raises:
      ValueError: bad shapes or dtypes (:func:`.reference.validate`), or ``tile_rows`` not a power of two
        >= 16.
    """
    validate(x, w, group_sizes)
    if tile_rows is None:
        tile_rows = tile_rows_for(x.shape[0], w.shape[0])
    if tile_rows < 16 or tile_rows & (tile_rows - 1):
        raise ValueError(f"tile_rows={tile_rows} must be a power of two >= 16")
    if interpret is None:
        interpret = target_platform() == "cpu"
    n, i_dim = x.shape
    o = w.shape[2]
    pad_i, pad_o = -i_dim % 16, -o % 16  # Triton's dot: feature sizes in multiples of 16 (zeros add nothing)
    if pad_i or pad_o:
        x = jnp.pad(x, ((0, 0), (0, pad_i)))
        w = jnp.pad(w, ((0, 0), (0, pad_i), (0, pad_o)))
    pad = -n % tile_rows
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    # inside shard_map x and w may vary over different mesh axes: give both the union (AD then sums
    # dw over the token axes), as the tiled path does
    x, w = x + jnp.zeros_like(w, shape=(), dtype=x.dtype), w + jnp.zeros_like(x, shape=(), dtype=w.dtype)
    y = _grouped(x, w, group_sizes.astype(jnp.int32), tile_rows, interpret)
    return y[:n, :o] if pad or pad_o else y
