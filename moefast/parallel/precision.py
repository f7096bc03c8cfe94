"""Mixed precision across the mesh: compute in ``model.dtype``, weight gradients summed in float32.

The train state holds float32 parameters (the optimizer's master copy), split over the mesh like
the optimizer moments (:func:`moefast.parallel.state_spec`: their logical axes plus ``data`` on a
free dimension). Where a weight is used it is cast to the compute dtype *and then* gathered, so the
shards travel in bfloat16 when computing in bfloat16; its gradient is computed with a float32
result, so the partial sums that are reduce-scattered back into the shards are float32.

A plain ``x @ w.astype(bfloat16)`` does neither: XLA's sharding propagation moves the all-gather
before the cast (float32 on the wire), and the weight-gradient GEMM returns bfloat16, so the
reduction over the token shards runs in bfloat16. Hence three custom-VJP ops:

* :func:`dense` — ``x @ w`` for GSPMD-partitioned weights (attention, dense FFN, shared expert,
  LM head);
* :func:`embed_lookup` — rows of the embedding table;
* :func:`expert_weights` — the experts' weights inside the expert-parallel ``jax.shard_map``
  (:mod:`moefast.parallel.expert`): gathered in bfloat16 over the axes their shard is split on,
  gradient reduce-scattered in float32 over those and summed over the other token axes.

Each is exact in float32 (``dtype=float32``: the same values and gradients as the plain ops).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moefast.parallel.context import CONTEXT_AXIS
from moefast.parallel.fp8_gemm import dense_backward, dense_forward, gspmd_forward, gspmd_grads
from moefast.parallel.mesh import BATCH_AXES, state_spec

__all__ = ["costing_twin", "dense", "embed_lookup", "expert_weights", "local_dense"]


_COSTING_TWIN = contextvars.ContextVar("moefast_costing_twin", default=False)


@contextlib.contextmanager
def costing_twin():
    """Inside: :func:`dense` traces its weight-gradient GEMM with a result in the compute dtype
    (then cast to float32) instead of a float32 result, and the experts' weight gradients (bf16
    GEMMs whose float32 cast XLA fuses into them) are kept apart from that cast by an
    optimization barrier. For cost estimates only, never for
    training: XLA's speed-of-light estimator (jaxlib 0.10.2) costs a bf16 x bf16 -> f32 GEMM by a
    fallback interpolator at about 12 TFLOP/s on H100, 60x below the rate its measured table gives
    the same GEMM with a bf16 result, which is near what the GPU runs either kind at
    (:mod:`moefast.bench.gpu_schedule`). Same FLOPs, same collectives; the float32 result's extra
    bytes are not in the twin. :func:`moefast.bench.gpu_compile.gpu_compile` also compiles the twin
    with XLA's split-K rewrite off (``xla_gpu_experimental_force_split_k=1``): split, a GEMM's
    partial products have float32 results too."""
    token = _COSTING_TWIN.set(True)
    try:
        yield
    finally:
        _COSTING_TWIN.reset(token)


def _unfused(x: jax.Array) -> jax.Array:
    """The costing twin's GEMM result kept apart from the float32 cast that follows it (XLA fuses
    the cast into the GEMM, whose float32 result its table mis-costs the same way)."""
    return jax.lax.optimization_barrier(x)


def _multi_device() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def _gather(w: jax.Array, names: tuple, dtype) -> jax.Array:
    """``w`` (float32, as the state holds it) cast to ``dtype`` in its state sharding, then
    replicated: the all-gather moves ``dtype`` bytes."""
    wc = w.astype(dtype)
    if not _multi_device():
        return wc
    mesh = jax.sharding.get_abstract_mesh()
    wc = jax.lax.with_sharding_constraint(wc, state_spec(names, w.shape, mesh))
    return jax.lax.with_sharding_constraint(wc, P())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _dense(x, w, dtype, names, transposed, w_dtype, fp8):
    return _dense_fwd(x, w, dtype, names, transposed, w_dtype, fp8)[0]


def _product(x, wc, transposed, fp8, local=False):
    """``x @ wc`` (``wc.T``) and what :func:`_dense_grads` needs; ``fp8``: by the FP8 recipe, under
    GSPMD or, ``local``, on this device, the residuals the operands quantized once
    (:func:`moefast.parallel.fp8_gemm.dense_forward`)."""
    if fp8:
        w = wc.T if transposed else wc
        y, payload = (dense_forward if local else gspmd_forward)(x, w, x.dtype)
        return y, (payload, jnp.zeros((0,) + w.shape, w.dtype))
    return x @ (wc.T if transposed else wc), (x, wc)


def _dense_fwd(x, w, dtype, names, transposed, w_dtype, fp8):
    return _product(x, _gather(w, names, dtype), transposed, fp8)


def _dense_grads(res, g, transposed, w_dtype, x_dtype, fp8=False, local=False):
    """(dx in the compute dtype, dw from a GEMM with a float32 result, as ``w_dtype``) from
    :func:`_product`'s residuals; with ``fp8``, both from e4m3 GEMMs
    (:func:`moefast.parallel.fp8_gemm.gspmd_grads`)."""
    if fp8:
        payload, w_like = res
        dx, dw = (dense_backward if local else gspmd_grads)(payload, g, w_like.shape[1:], x_dtype)  # dx in x_dtype
        return dx, (dw.T if transposed else dw).astype(w_dtype)
    x, wc = res
    lead = "".join(chr(ord("a") + i) for i in range(x.ndim - 1))  # the token dimensions
    w_spec = "oi" if transposed else "io"
    dx = jnp.einsum(f"{lead}o,{w_spec}->{lead}i", g, wc)
    if _COSTING_TWIN.get():
        dw = _unfused(jnp.einsum(f"{lead}i,{lead}o->{w_spec}", x, g))
    else:
        dw = jnp.einsum(f"{lead}i,{lead}o->{w_spec}", x, g, preferred_element_type=jnp.float32)
    return dx, dw.astype(w_dtype)


def _dense_bwd(dtype, names, transposed, w_dtype, fp8, res, g):
    return _dense_grads(res, g, transposed, w_dtype, dtype, fp8)


_dense.defvjp(_dense_fwd, _dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _local_dense(x, w, dtype, fp8):
    return _product(x, w.astype(dtype), False, fp8, local=True)[0]


def local_dense(x: jax.Array, w: jax.Array, dtype, fp8: bool = False) -> jax.Array:
    """:func:`dense` for a weight already whole on this device (inside ``jax.shard_map``: nothing
    to gather): ``x @ w`` in ``dtype``, ``x`` [..., I] (in ``dtype``), ``w`` [I, O]; the weight
    gradient from a GEMM with a float32 result, in ``w``'s dtype; ``fp8``: :func:`dense`'s."""
    return _local_dense(x, w, jnp.dtype(dtype), bool(fp8))


def _local_dense_fwd(x, w, dtype, fp8):
    y, res = _product(x, w.astype(dtype), False, fp8, local=True)
    return y, (res, jnp.zeros((0,), w.dtype))


def _local_dense_bwd(dtype, fp8, res, g):
    res, w_like = res
    return _dense_grads(res, g, False, w_like.dtype, dtype, fp8, local=True)


_local_dense.defvjp(_local_dense_fwd, _local_dense_bwd)


def dense(x: jax.Array, w: jax.Array, dtype, names: tuple[str | None, str | None], *,
          transposed: bool = False, fp8: bool = False) -> jax.Array:
    """``x @ w`` (``x @ w.T`` with ``transposed``) computed in ``dtype``, with a float32 weight
    gradient.

    Args:
      x: [..., I] activations, any float dtype (cast to ``dtype``).
      w: [I, O] float32 weights ([O, I] with ``transposed``, e.g. a tied embedding table), sharded
        as the state holds them.
      dtype: compute dtype (``jnp.bfloat16`` or ``jnp.float32``).
      names: ``w``'s logical axes as stored, e.g. ``("embed", "heads")`` (its state sharding).
      fp8: the three GEMMs by the FP8 recipe (``model.precision: fp8``,
        :mod:`moefast.parallel.fp8_gemm`): e4m3 inputs with fine-grained scales, float32 sums;
        the weight still travels in ``dtype``.

    Returns:
      [..., O] in ``dtype``. ``x``'s gradient is computed in ``dtype``; ``w``'s by a GEMM with a
      float32 result (``preferred_element_type``), so its sum over the token shards is float32.

    Raises:
      ValueError: ``w`` is not 2-D or does not multiply ``x``.
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[1 if transposed else 0]:
        raise ValueError(f"dense: x [..., {x.shape[-1]}] and w {list(w.shape)} (transposed={transposed}) "
                         "do not multiply")
    return _dense(x.astype(dtype), w, jnp.dtype(dtype), tuple(names), bool(transposed), w.dtype, bool(fp8))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lookup(table, ids, dtype, names):
    return _gather(table, names, dtype)[ids]


def _lookup_fwd(table, ids, dtype, names):
    # the table's shape and dtype ride along in an empty array (no bytes kept for the backward)
    return _gather(table, names, dtype)[ids], (ids, jnp.zeros((0,) + table.shape, table.dtype))


def _lookup_bwd(dtype, names, res, g):
    ids, shape_of = res
    table_shape = shape_of.shape[1:]
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get(CONTEXT_AXIS, 1) > 1 and g.ndim == 3:
        # rows over the token axes, their tokens over context; the table's gradient is split along
        # its features over every axis: first the tokens whole and the features over context (one
        # all-to-all), which the partitioner then turns into the table's split (another), instead
        # of replicating the cotangent to reach it
        rows = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1) or None
        g = jax.lax.with_sharding_constraint(g, P(rows, None, CONTEXT_AXIS))
    d_table = jnp.zeros(table_shape, jnp.float32).at[ids].add(g.astype(jnp.float32))
    return d_table.astype(shape_of.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def embed_lookup(table: jax.Array, ids: jax.Array, dtype, names: tuple[str | None, str | None]) -> jax.Array:
    """Rows ``table[ids]`` in ``dtype``; the table's gradient is a float32 scatter-add.

    Args:
      table: [V, D] float32 embedding table, sharded as the state holds it.
      ids: [...] int token ids in [0, V).
      dtype: compute dtype.
      names: ``table``'s logical axes (its state sharding).

    Returns:
      [..., D] in ``dtype``.
    """
    return _lookup(table, ids, jnp.dtype(dtype), tuple(names))


def _gather_plan(spec: P, token_axes: tuple[str, ...], keep: str | None):
    """``(dim, axis)`` pairs to all-gather a shard of ``spec`` over (every mesh axis in it but
    ``keep``), and the token axes the shard does not vary over (its gradient is summed over them).
    A dimension split over several axes holds block ``(i, j)`` of its (major, minor) axes at
    ``i * minor + j``, so its axes are gathered minor first: each gather then joins whole
    contiguous blocks."""
    gathers, split = [], set()
    for dim, entry in enumerate(spec):
        for axis in reversed(entry if isinstance(entry, tuple) else (entry,)):
            if axis is None:
                continue
            split.add(axis)
            if axis != keep:
                gathers.append((dim, axis))
    return tuple(gathers), tuple(a for a in token_axes if a not in split)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _expert_weights(w, dtype, gathers, sum_axes, token_axes, w_dtype):
    return _expert_weights_fwd(w, dtype, gathers, sum_axes, token_axes, w_dtype)[0]


def _expert_weights_fwd(w, dtype, gathers, sum_axes, token_axes, w_dtype):
    wc = w.astype(dtype)
    for dim, axis in gathers:
        wc = jax.lax.all_gather(wc, axis, axis=dim, tiled=True)
    if sum_axes:  # used with every device's own tokens: varying over all token axes
        wc = jax.lax.pcast(wc, sum_axes, to="varying")
    return wc, None


def _expert_weights_bwd(dtype, gathers, sum_axes, token_axes, w_dtype, _, g):
    g = (_unfused(g) if _COSTING_TWIN.get() else g).astype(jnp.float32)
    if sum_axes:
        g = jax.lax.psum(g, sum_axes)
    for dim, axis in reversed(gathers):
        g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    return (g.astype(w_dtype),)


_expert_weights.defvjp(_expert_weights_fwd, _expert_weights_bwd)


def expert_weights(w: jax.Array, dtype, spec: P, token_axes: tuple[str, ...], keep: str | None) -> jax.Array:
    """Inside ``jax.shard_map``: this device's experts' full weights in ``dtype``, from its shard.

    Args:
      w: this device's float32 shard of an expert weight whose ``in_specs`` entry is ``spec``.
      dtype: compute dtype.
      spec: the weight's ``PartitionSpec`` (its state sharding, :func:`moefast.parallel.state_spec`).
      token_axes: the mesh axes the tokens are split over (the shard_map's batch axes).
      keep: the axis the shard stays split on (``"expert"``: each device keeps its experts), or
        ``None``.

    Returns:
      The shard all-gathered (in ``dtype``) over every axis of ``spec`` except ``keep``. Its
      gradient is reduce-scattered back to the shard in float32 over those axes, after a float32
      ``psum`` over the token axes the shard is not split on.
    """
    gathers, sum_axes = _gather_plan(spec, token_axes, keep)
    return _expert_weights(w, jnp.dtype(dtype), gathers, sum_axes, tuple(token_axes), w.dtype)
