"""Context parallelism: every row's tokens split over the mesh's ``context`` axis (``mesh.context``).

Dimension letters: B batch, T tokens of a row, C tokens of a chunk (T / 2c), c the context axis's size.

Causal attention gives the token at position t work proportional to t, so cutting a row into c
contiguous pieces would leave the last device c times the first one's attention. The row is
instead cut into 2c chunks and device j holds chunks j and 2c - 1 - j (the mirrored pairs that
Megatron-LM's context parallelism and MaxText's load-balanced ring order use): every device then
does the same causal work. :func:`balanced_order` puts a row's tokens in that order (device j's
pair contiguous, so the ``context`` axis splits T evenly); :func:`natural_order` undoes it.

The model permutes its integer inputs (tokens, positions, segment ids) into the balanced order
once, carries the hidden states in it through every layer (token-wise work does not care about
order, and attention masks by each token's index in the row, :func:`row_index`), and restores the
natural order before the output head, so logits, losses and gradients are those of the unsplit
row. Attention gathers the keys and values of the whole row along the axis (for multi-head latent
attention the compressed latent and the shared RoPE key, before their up-projection), each device
keeping its own queries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["CONTEXT_AXIS", "balanced_order", "context_size", "gather_context", "gather_rows", "natural_order",
           "restore_order", "row_index", "split_context"]

CONTEXT_AXIS = "context"


def context_size() -> int:
    """The size of the ``context`` axis of the mesh set with ``jax.set_mesh`` (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[CONTEXT_AXIS])


def _check(t: int, c: int) -> int:
    if t % (2 * c):
        raise ValueError(f"context parallelism over {c} devices cuts each row into 2 x {c} = {2 * c} chunks: "
                         f"the row length {t} must be a multiple of {2 * c}")
    return t // (2 * c)


def balanced_order(a_bt: jax.Array, c: int) -> jax.Array:
    """``a`` [B, T, ...] with its T axis in the load-balanced order of ``c`` context devices: chunks
    (of T / 2c) 0, 2c-1, 1, 2c-2, ..., c-1, c (device j's pair, chunks j and 2c-1-j, contiguous).
    Identity for c = 1.

    Raises:
      ValueError: T not a multiple of 2c.
    """
    if c == 1:
        return a_bt
    b, t = a_bt.shape[:2]
    chunk = _check(t, c)
    halves = a_bt.reshape(b, 2, c, chunk, *a_bt.shape[2:])
    pairs = jnp.stack([halves[:, 0], jnp.flip(halves[:, 1], axis=1)], axis=2)  # [B, c, 2, C, ...]
    return pairs.reshape(a_bt.shape)


def natural_order(a_bt: jax.Array, c: int) -> jax.Array:
    """The inverse of :func:`balanced_order`: [B, T, ...] back in the row's order."""
    if c == 1:
        return a_bt
    b, t = a_bt.shape[:2]
    chunk = _check(t, c)
    pairs = a_bt.reshape(b, c, 2, chunk, *a_bt.shape[2:])
    halves = jnp.stack([pairs[:, :, 0], jnp.flip(pairs[:, :, 1], axis=1)], axis=1)  # [B, 2, c, C, ...]
    return halves.reshape(a_bt.shape)


def row_index(t: int, c: int) -> np.ndarray:
    """int32 [T]: the position in the row of each token of the balanced order (a static table)."""
    if c == 1:
        return np.arange(t, dtype=np.int32)
    halves = np.arange(t, dtype=np.int32).reshape(2, c, _check(t, c))
    return np.stack([halves[0], halves[1, ::-1]], axis=1).reshape(t)


def _batch_axes(mesh) -> tuple[str, ...]:
    from moefast.parallel.mesh import BATCH_AXES

    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def split_context(a_bt: jax.Array) -> jax.Array:
    """``a`` [B, T, ...] constrained to rows over the token axes and T over ``context`` (no-op
    without a context axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if context_size() == 1:
        return a_bt
    return jax.lax.with_sharding_constraint(a_bt, P(_batch_axes(mesh), CONTEXT_AXIS))


def restore_order(x_bt: jax.Array) -> jax.Array:
    """Hidden states [B, T, ...] in the balanced order, T split over ``context``, put back in the
    row's order and split over ``context`` in contiguous pieces (device d: chunks 2d and 2d + 1).
    Each device holds one even and one odd chunk (j and 2c - 1 - j), so two collective permutes
    move them, each a device's half share: no gather, and in the backward pass the same permutes
    reversed (nothing summed). :func:`natural_order` without a context axis.

    Raises:
      ValueError: T not a multiple of 2c.
    """
    c = context_size()
    if c == 1:
        return x_bt
    mesh = jax.sharding.get_abstract_mesh()
    chunk = _check(x_bt.shape[1], c)
    to_even = [(j, (j if j % 2 == 0 else 2 * c - 1 - j) // 2) for j in range(c)]  # where each device's even chunk goes
    to_odd = [(j, (j if j % 2 == 1 else 2 * c - 1 - j) // 2) for j in range(c)]

    def local(x):  # this device's chunks j and 2c - 1 - j
        first = jax.lax.axis_index(CONTEXT_AXIS) % 2 == 0  # chunk j is the even one
        a, b = x[:, :chunk], x[:, chunk:]
        even = jax.lax.ppermute(jnp.where(first, a, b), CONTEXT_AXIS, to_even)
        odd = jax.lax.ppermute(jnp.where(first, b, a), CONTEXT_AXIS, to_odd)
        return jnp.concatenate([even, odd], axis=1)

    from moefast.parallel.mesh import reshard_for_shard_map

    spec = P(_batch_axes(mesh), CONTEXT_AXIS)
    return jax.shard_map(local, in_specs=(spec,), out_specs=spec)(*reshard_for_shard_map((x_bt,), (spec,)))


def gather_context(a_bt: jax.Array) -> jax.Array:
    """``a`` [B, T, ...] constrained to whole rows on every device of the ``context`` axis (an
    all-gather along it; its transpose, in the backward pass, a reduce-scatter). No-op without a
    context axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if context_size() == 1:
        return a_bt
    return jax.lax.with_sharding_constraint(a_bt, P(_batch_axes(mesh)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_rows(x_bt: jax.Array, axis_name: str = CONTEXT_AXIS) -> jax.Array:
    """Inside ``jax.shard_map``: this device's [B, T/c, ...] share of the rows all-gathered along
    ``axis_name`` into [B, T, ...] (in the shards' order), in ``x``'s dtype. Its gradient is the
    reduce-scatter of the cotangent summed in float32 (each device's attention adds to every
    key's gradient: the sum of c partial gradients, not rounded to bfloat16 between them)."""
    return jax.lax.all_gather(x_bt, axis_name, axis=1, tiled=True)


def _gather_rows_fwd(x_bt, axis_name):
    return gather_rows(x_bt, axis_name), jnp.zeros((0,), x_bt.dtype)


def _gather_rows_bwd(axis_name, like, g):
    summed = jax.lax.psum_scatter(g.astype(jnp.float32), axis_name, scatter_dimension=1, tiled=True)
    return (summed.astype(like.dtype),)


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
