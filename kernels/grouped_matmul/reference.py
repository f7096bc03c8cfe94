"""Dense reference of the grouped matmul: the truth the fast paths are compared with.

Dimension letters: N rows, G groups, I input features, O output features.

Rows ``[offset_g, offset_g + group_sizes[g])`` (offsets: the exclusive prefix sum of
``group_sizes``) are multiplied by ``w[g]``; rows after the last group give 0. This is the
contract of :func:`jax.lax.ragged_dot`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["grouped_matmul_reference", "validate"]


def validate(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    """Checks shapes and dtypes at trace time.

    Raises:
      ValueError: ``x`` not [N, I] with N >= 1, ``w`` not [G, I, O] with G >= 1, x and w not of one
        float dtype, ``group_sizes`` not an integer [G].
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [rows, in] and w [groups, in, out] with the same 'in'; got x {x.shape}, "
                         f"w {w.shape}")
    if x.shape[0] < 1 or w.shape[0] < 1:
        raise ValueError(f"the grouped matmul needs at least one row and one group; got x {list(x.shape)}, "
                         f"w {list(w.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or w.dtype != x.dtype:
        raise ValueError(f"x and w must be of one float dtype (cast w to x's compute dtype); got x {x.dtype}, "
                         f"w {w.dtype}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer array of shape [groups]={(w.shape[0],)}, got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Every row times every group's matrix, the right one kept (G times the FLOPs; tests only).

    Args:
      x: [N, I] rows sorted by group.
      w: [G, I, O].
      group_sizes: [G] int, rows per group, summing to at most N.

    Returns:
      [N, O] in ``x.dtype`` (accumulated in float32); 0 for rows after the last group.
    """
    validate(x, w, group_sizes)
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(x.shape[0])
    group_of_row = jnp.searchsorted(ends, row, side="right")  # G for rows after the last group
    y = jnp.einsum("ni,gio->gno", x, w, preferred_element_type=jnp.float32)
    pick = jax.nn.one_hot(group_of_row, w.shape[0], dtype=jnp.float32)  # [N, G]; all-zero rows past the end
    return jnp.einsum("gno,ng->no", y, pick).astype(x.dtype)
