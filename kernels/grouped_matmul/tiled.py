"""Grouped matmul whose work is the real rows, for backends where ``ragged_dot`` is dense (XLA:CPU).

Dimension letters: N rows, G groups, I input features, O output features, R rows of a tile.

XLA:CPU lowers :func:`jax.lax.ragged_dot` to dense work, every row times every group's matrix (G
times the FLOPs). Here each group's rows ``[offset_g, offset_g + n_g)`` are multiplied by ``w[g]``
in static-shape pieces whose number depends on ``n_g`` at run time:

* ``n_g // tile_rows`` full tiles of ``tile_rows`` rows, in a loop whose trip count is that number
  (a dynamic bound: no empty tile is computed), each written into the output in place with
  ``dynamic_update_slice``;
* the remaining ``n_g % tile_rows`` rows as one matmul of ``ceil(rem / granule_rows) * granule_rows``
  rows, chosen by ``lax.switch`` among ``tile_rows / granule_rows`` static sizes (none when the
  remainder is 0). The piece is read and written at ``min(start, N - rows)`` so that it never
  leaves the array (no padded copies), and rows of it outside the group are masked, so the output
  is exact and rows outside every group are 0.

So the work is the real rows plus less than ``granule_rows`` rows per group, and the matmuls are
large enough to run near the machine's matmul speed (moefast's docs/perf.md, "Dropless on CPU",
has the measurements). The groups
are visited in a static Python loop, so each loop body multiplies by one fixed ``w[g]`` (no weight
gather per tile).

The VJP (``jax.custom_vjp``) is the same schedule: ``dx = grouped(dy, w^T)`` and, per group, ``dw_g =
sum over its pieces of x_piece^T dy_piece`` accumulated in float32 (rows past the group's end
masked). Forward-mode AD is not supported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_tiles", "grouped_matmul_tiled"]


def check_tiles(tile_rows: int, granule_rows: int) -> None:
    """Raises ValueError unless ``granule_rows`` >= 1 divides ``tile_rows``."""
    if granule_rows < 1 or tile_rows < granule_rows or tile_rows % granule_rows:
        raise ValueError(f"tile_rows={tile_rows} must be a positive multiple of granule_rows={granule_rows} >= 1")


def _dot(a, b, out_dtype):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _zeros(shape, dtype, *like):
    """Zeros that vary over the manual mesh axes of every array in ``like`` (inside
    ``jax.shard_map``), so the loop carries keep one type; plain zeros elsewhere. XLA folds the
    adds of zeros away."""
    z = jnp.zeros_like(like[0], shape=shape, dtype=dtype)
    for a in like[1:]:
        z = z + jnp.zeros_like(a, shape=(), dtype=dtype)
    return z


def _schedule(group_sizes, tile_rows: int):
    """Per group: first row, full tiles, and the remainder (rows in the last, partial piece)."""
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    full = sizes // tile_rows
    return starts, full, sizes - full * tile_rows


def _piece_sizes(n: int, tile_rows: int, granule_rows: int) -> list[int]:
    """Row counts of the partial-piece branches: k * granule_rows (k >= 1) up to a tile, at most N."""
    return [min(k * granule_rows, n) for k in range(1, tile_rows // granule_rows + 1)]


def _piece_rows(s, r, rows: int, n: int):
    """Where a partial piece of ``rows`` rows for rows ``[s, s + r)`` is read: it starts at
    ``min(s, N - rows)`` (so it stays inside the array without padding), and the [rows] mask
    marks its rows that belong to the group."""
    s_read = jnp.minimum(s, n - rows)
    row = s_read + jnp.arange(rows)
    return s_read, ((row >= s) & (row < s + r))[:, None]


def _forward(x, w, group_sizes, tile_rows: int, granule_rows: int):
    """[N, O]: rows of group g times ``w[g]``; 0 outside every group."""
    n, _ = x.shape
    num_groups, _, o = w.shape
    out = _zeros((n, o), x.dtype, x, w, group_sizes)
    starts, full, rem = _schedule(group_sizes, tile_rows)
    for g in range(num_groups):
        w_g = w[g]
        if n >= tile_rows:  # else no group has a full tile
            def tile(i, out, start=starts[g], w_g=w_g):
                s = start + i * tile_rows
                y = _dot(jax.lax.dynamic_slice_in_dim(x, s, tile_rows), w_g, out.dtype)
                return jax.lax.dynamic_update_slice_in_dim(out, y, s, 0)

            out = jax.lax.fori_loop(0, full[g], tile, out)

        def piece(out, s, r, w_g, rows):
            s_read, keep = _piece_rows(s, r, rows, n)
            y = _dot(jax.lax.dynamic_slice_in_dim(x, s_read, rows), w_g, out.dtype)
            y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, s_read, rows))
            return jax.lax.dynamic_update_slice_in_dim(out, y, s_read, 0)

        branches = [lambda out, s, r, w_g: out] + [
            functools.partial(piece, rows=rows) for rows in _piece_sizes(n, tile_rows, granule_rows)]
        which = (rem[g] + granule_rows - 1) // granule_rows
        out = jax.lax.switch(which, branches, out, starts[g] + full[g] * tile_rows, rem[g], w_g)
    return out


def _weight_grads(x, dy, group_sizes, num_groups: int, tile_rows: int, granule_rows: int, w_dtype):
    """[G, I, O]: per group, the sum over its rows of x_row^T dy_row (float32 accumulation)."""
    n, i_dim = x.shape
    o = dy.shape[1]
    starts, full, rem = _schedule(group_sizes, tile_rows)
    contract_rows = (((0,), (0,)), ((), ()))
    grads = []
    for g in range(num_groups):
        acc = _zeros((i_dim, o), jnp.float32, x, dy, group_sizes)
        if n >= tile_rows:
            def tile(i, acc, start=starts[g]):
                s = start + i * tile_rows
                xs = jax.lax.dynamic_slice_in_dim(x, s, tile_rows)
                ds = jax.lax.dynamic_slice_in_dim(dy, s, tile_rows)
                return acc + jax.lax.dot_general(xs, ds, contract_rows, preferred_element_type=jnp.float32)

            acc = jax.lax.fori_loop(0, full[g], tile, acc)

        def piece(acc, s, r, rows):
            s_read, keep = _piece_rows(s, r, rows, n)
            xs = jnp.where(keep, jax.lax.dynamic_slice_in_dim(x, s_read, rows), 0)
            ds = jax.lax.dynamic_slice_in_dim(dy, s_read, rows)
            return acc + jax.lax.dot_general(xs, ds, contract_rows, preferred_element_type=jnp.float32)

        branches = [lambda acc, s, r: acc] + [
            functools.partial(piece, rows=rows) for rows in _piece_sizes(n, tile_rows, granule_rows)]
        which = (rem[g] + granule_rows - 1) // granule_rows
        grads.append(jax.lax.switch(which, branches, acc, starts[g] + full[g] * tile_rows, rem[g]))
    return jnp.stack(grads).astype(w_dtype)


def grouped_matmul_tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile_rows: int = 512,
                         granule_rows: int = 128) -> jax.Array:
    """Grouped matmul computing only the real rows (see the module docstring).

    Args:
      x: [N, I] rows sorted by group, any float dtype.
      w: [G, I, O], same dtype as ``x``.
      group_sizes: [G] int32, rows per group (``sum <= N``; traced values are fine).
      tile_rows: R, rows of a full tile (static).
      granule_rows: the partial piece's row count is a multiple of this (static, divides R).

    Returns:
      [N, O] in ``x.dtype`` (float32 accumulation); 0 for rows after the last group.
    """
    # Inside shard_map, x and w may vary over different mesh axes (tokens split over data, weights
    # replicated): give both the union (adding a zero that varies like the other), so the custom
    # VJP's cotangents have their primals' types and JAX's AD sums dw over the token axes.
    x, w = x + jnp.zeros_like(w, shape=(), dtype=x.dtype), w + jnp.zeros_like(x, shape=(), dtype=w.dtype)
    return _tiled(x, w, group_sizes, tile_rows, granule_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled(x, w, group_sizes, tile_rows, granule_rows):
    return _forward(x, w, group_sizes, tile_rows, granule_rows)


def _fwd(x, w, group_sizes, tile_rows, granule_rows):
    return _forward(x, w, group_sizes, tile_rows, granule_rows), (x, w, group_sizes)


def _bwd(tile_rows, granule_rows, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = _forward(dy, jnp.swapaxes(w, 1, 2), group_sizes, tile_rows, granule_rows)
    dw = _weight_grads(x, dy, group_sizes, w.shape[0], tile_rows, granule_rows, w.dtype)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_tiled.defvjp(_fwd, _bwd)
