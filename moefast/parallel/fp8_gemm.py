"""FP8 GEMMs for training (``model.precision: fp8``): DeepSeek-V3's fine-grained recipe (Liu et al.
2024, arXiv 2412.19437, sec. 3.3: Fprop, Dgrad and Wgrad all take e4m3 inputs; activations and
gradients are scaled per 1 x 128 tile along the contraction, weights per 128 x 128 block; products
accumulate in float32, the scales applied per 128-long piece of the contraction).

Dimension letters: M rows (tokens), K the contraction, N outputs, B batch (experts), G groups.

The three GEMMs of ``y = x @ w`` (:func:`fp8_matmul`, :func:`fp8_grouped_matmul`):

* forward ``y = x @ w``: ``x`` in 1 x 128 tiles along K, ``w`` in 128 x 128 blocks;
* ``dx = dy @ w^T``: ``dy`` in 1 x 128 tiles along N, the same blocks of ``w``;
* ``dw = x^T @ dy`` (a sum over tokens): ``x`` and ``dy`` in 128 x 1 tiles, 128 tokens of one
  channel each (sec. 3.3.2: the transposed tiling for the backward pass); ``dw`` is float32. The
  experts' rows are tiled in order across experts (a tile may hold two experts' tokens: its scale
  covers both, each expert's sum stays its own), as the grouped kernels read them.

Sizes that are not multiples of 128 are zero-padded to the next multiple for the scaling (zeros
change no product; e.g. MLA's 576-wide ``kv_a_proj_with_mqa``); the GPU quantizers pad as they
write, with no padded copy.

Two paths compute the same numbers:

* **GPU kernels** (a step compiled for GPUs, with jax-triton: the ``[gpu]`` extra): the Triton
  FP8 grouped GEMMs of :mod:`moefast.kernels.fp8_matmul` on the e4m3 operands and their scales
  (Hopper's e4m3 tensor-core MMA, each 128-long piece of the contraction scaled and summed in
  float32). Each operand is quantized once, by one-pass kernels: an activation (and in the
  backward the cotangent) is read once for both its 1 x 128 tiles and its 128-token tiles,
  written transposed as the weight-gradient kernel reads them; a weight's 128 x 128 blocks serve
  the forward and, read transposed, the dgrad. The forward keeps the quantized x (its 128-token
  tiles) and w for the backward -- about half the bytes of the bfloat16 operands, and nothing
  quantized again there. A dense layer's GEMM is one group; the capacity experts' ``[E, C, D]``
  buffers are E equal groups. Under a multi-device mesh (GSPMD) a dense layer's kernels run
  inside ``jax.shard_map`` over the tokens' mesh axes (a custom call is not partitioned), its
  weight gradient summed over them in float32.
* **Emulated** (CPU, or a GPU without jax-triton): each GEMM computed from its operands' e4m3
  values times their scales in float32 (:func:`~moefast.parallel.fp8.fake_quantize_tiles`,
  ml_dtypes' e4m3 rounding) with float32 GEMMs: the recipe's numbers, not its speed.

They differ in the order of the float32 sums and in the MMA's own accumulation of each 128
products on Hopper (limited precision, DeepSeek-V3 sec. 3.3.2; exact in the emulation). What
stays as the bf16 precision runs it: the master weights,
optimizer state, norms, router, softmax, attention's score and value products, embeddings, the
LM head and the losses (sec. 3.3: those components keep their precision).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from moefast.kernels.grouped_matmul import grouped_matmul
from moefast.parallel.context import CONTEXT_AXIS
from moefast.parallel.fp8 import fake_quantize_blocks, fake_quantize_tiles
from moefast.parallel.mesh import BATCH_AXES

__all__ = ["PRECISIONS", "check_device", "dense_backward", "dense_forward", "fp8_dense_grads", "fp8_dense_forward",
           "fp8_grouped_matmul", "fp8_matmul", "gspmd_forward", "gspmd_grads"]

PRECISIONS = ("bf16", "fp8")
"""``model.precision``: the GEMMs' input format (module docstring)."""

_HI = jax.lax.Precision.HIGHEST


def check_device(platform: str, device) -> str:
    """The note a run with ``model.precision: fp8`` logs for the devices its step is compiled for.

    Args:
      platform: ``"cpu"``, ``"gpu"``, ... (:func:`moefast.parallel.platform` of the mesh).
      device: one of the mesh's devices (a GPU's ``compute_capability``, e.g. ``"9.0"``, is read).

    Raises:
      ConfigError: a GPU without FP8 tensor cores (compute capability below 8.9: before Ada and
        Hopper).
    """
    from moefast.config import ConfigError

    cc = getattr(device, "compute_capability", None) if platform == "gpu" else None
    if cc is not None and float(cc) < 8.9:
        raise ConfigError(f"model.precision: fp8 trains for FP8 tensor cores (compute capability 8.9 or later: Ada, "
                          f"Hopper, Blackwell); these {device.device_kind} GPUs are {cc}: use model.precision=bf16")
    if platform == "gpu":
        from moefast.kernels import fp8_matmul

        why = fp8_matmul.available(platform)
        if why is None:
            return "note: model.precision=fp8 runs its GEMMs in the Triton FP8 kernels (moefast/kernels/fp8_matmul)"
        return (f"note: model.precision=fp8 is emulated with float32 GEMMs ({why}): the FP8 numerics, not their "
                "speed")
    return (f"note: model.precision=fp8 computes the recipe's e4m3 numbers with float32 GEMMs on {platform} "
            "(emulated: the FP8 numerics, not their speed; moefast/parallel/fp8_gemm.py)")


def _kernels() -> bool:
    """Whether the GPU kernels run this trace (compiling for GPUs, jax-triton installed)."""
    from moefast.kernels import fp8_matmul

    return fp8_matmul.available() is None


def _live_rows(y: jax.Array, sizes: jax.Array) -> jax.Array:
    """``y`` with the rows after the last group set to 0 (the kernels never write them)."""
    live = jnp.arange(y.shape[0], dtype=jnp.int32) < jnp.sum(sizes)
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype))


def _kernel_forward(x2, w, sizes, dtype, *, live=False):
    """GPU: [M, K] rows grouped by ``sizes`` times ``w`` [G, K, N] -> [M, N] in ``dtype``, and what the
    backward needs, each operand quantized once: x's 128-token tiles, written transposed [Kp, Mp]
    by the same one-pass kernel that writes its 1 x 128 tiles, and w's 128 x 128 blocks (the dgrad
    reads them transposed). ``live``: rows after the last group may exist (zeroed)."""
    from moefast.kernels.fp8_matmul import quantize, quantize_weights, scaled_grouped_matmul

    m, n = x2.shape[0], w.shape[-1]
    xq, sx, xt, sxt = quantize(x2, rows=True, cols=True)
    wq, sw = quantize_weights(w)
    y = scaled_grouped_matmul(xq, sx, wq, sw, sizes, out_dtype=dtype)[:m, :n]
    return (_live_rows(y, sizes) if live else y), (xt, sxt, wq, sw)


def _kernel_grads(payload, g2, sizes, k, dx_dtype, dw_dtype=jnp.float32, *, live=False):
    """GPU: the backward GEMMs of :func:`_kernel_forward` from its ``payload`` and the cotangent
    ``g2`` [M, N] (quantized once, both tilings from one read): (dx [M, K] in ``dx_dtype``,
    dw [G, K, N] in ``dw_dtype``, summed in float32)."""
    from moefast.kernels.fp8_matmul import quantize, scaled_grouped_matmul, scaled_weight_grads

    xt, sxt, wq, sw = payload
    m, n = g2.shape
    gq, sg, gt, sgt = quantize(g2, rows=True, cols=True)
    dx = scaled_grouped_matmul(gq, sg, wq, sw, sizes, transpose_b=True, out_dtype=dx_dtype)[:m, :k]
    dw = scaled_weight_grads(xt, sxt, gt, sgt, sizes, out_dtype=dw_dtype)[:, :k, :n]
    return (_live_rows(dx, sizes) if live else dx), dw


def _equal_groups(rows: int, w_shape: tuple[int, ...]) -> jax.Array:
    """Group sizes of ``rows`` grouped rows against weights of ``w_shape``: one group ([K, N]), or
    one equal group per batch index ([B, K, N])."""
    if len(w_shape) > 3:
        raise ValueError(f"fp8 GEMMs take at most one batch dimension, got w {list(w_shape)}")
    g = w_shape[0] if len(w_shape) == 3 else 1
    return jnp.full((g,), rows // g, jnp.int32)


def _groups(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [*B, *T, K] as grouped rows [M, K] and their group sizes (one group per batch index)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2, _equal_groups(x2.shape[0], w.shape)


def _tokens_tiles(a: jax.Array) -> jax.Array:
    """[*B, M, C] fake-quantized in 128 x 1 tiles (128 tokens of one channel), float32."""
    return jnp.swapaxes(fake_quantize_tiles(jnp.swapaxes(a, -1, -2)), -1, -2)


def _flat(x: jax.Array, batch: int) -> jax.Array:
    """[*B, *T, K] -> [*B, M, K]: the token dims between the batch dims and K as one."""
    return x.reshape(*x.shape[:batch], -1, x.shape[-1])


def fp8_dense_forward(x: jax.Array, w: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The emulated forward GEMM (float32 GEMM of the e4m3 values times their scales): ``x``
    [*B, *T, K] (1 x 128 tiles) times ``w`` [*B, K, N] (128 x 128 blocks), at most one batch dim B;
    [*B, *T, N] in ``dtype``."""
    batch = w.ndim - 2
    y = jnp.matmul(_flat(fake_quantize_tiles(x), batch), fake_quantize_blocks(w), precision=_HI)
    return y.reshape(*x.shape[:-1], w.shape[-1]).astype(dtype)


def fp8_dense_grads(x: jax.Array, w: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The emulated backward GEMMs of :func:`fp8_dense_forward` for the cotangent ``g`` [*B, *T, N]:
    ``(dx [*B, *T, K], dw [*B, K, N])``, both float32."""
    batch = w.ndim - 2
    dx = jnp.matmul(_flat(fake_quantize_tiles(g), batch), jnp.swapaxes(fake_quantize_blocks(w), -1, -2), precision=_HI)
    # 128-token tiles of all rows in order (with a batch dim: across its entries, as the kernels
    # tile the grouped rows), then each batch entry's own sum
    xt = _tokens_tiles(x.reshape(-1, x.shape[-1])).reshape(_flat(x, batch).shape)
    gt = _tokens_tiles(g.reshape(-1, g.shape[-1])).reshape(_flat(g, batch).shape)
    dw = jnp.matmul(jnp.swapaxes(xt, -1, -2), gt, precision=_HI)
    return dx.reshape(x.shape), dw


def dense_forward(x: jax.Array, w: jax.Array, dtype) -> tuple[jax.Array, tuple]:
    """The forward GEMM on this device and what :func:`dense_backward` needs.

    Args:
      x: [*B, *T, K] activations; w: [*B, K, N] weights (at most one batch dim B, e.g. experts).
      dtype: the result's dtype.

    Returns:
      ``(y, payload)``: y [*B, *T, N] in ``dtype``. On GPUs (the kernels) the payload holds ``x``
      and ``w`` already quantized for the backward -- x's 128-token tiles (e4m3 [Kp, Mp] and
      float32 scales [Kp, Mp / 128]) from the same pass as its forward tiles, w's e4m3 blocks and
      their scales -- so nothing is quantized twice and it holds about half the bytes of the
      bfloat16 operands; emulated, ``(x, w)``.
    """
    if not _kernels():
        return fp8_dense_forward(x, w, dtype), (x, w)
    x2, sizes = _groups(x, w)
    y, payload = _kernel_forward(x2, w if w.ndim == 3 else w[None], sizes, jnp.dtype(dtype))
    return y.reshape(*x.shape[:-1], w.shape[-1]), payload


def dense_backward(payload: tuple, g: jax.Array, w_shape: tuple[int, ...], x_dtype,
                   dw_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """The backward GEMMs of :func:`dense_forward` for the cotangent ``g`` [*B, *T, N]: ``(dx
    [*B, *T, K] in ``x_dtype``, dw [*B, K, N] in ``dw_dtype``, summed in float32)``; ``w_shape`` is
    ``w``'s."""
    if not _kernels():
        x, w = payload
        dx, dw = fp8_dense_grads(x, w, g)
        return dx.astype(x_dtype), dw.astype(dw_dtype)
    k = w_shape[-2]
    g2 = g.reshape(-1, g.shape[-1])
    sizes = _equal_groups(g2.shape[0], w_shape)
    dx, dw = _kernel_grads(payload, g2, sizes, k, jnp.dtype(x_dtype), jnp.dtype(dw_dtype))
    return dx.reshape(*g.shape[:-1], k), dw.reshape(w_shape)


def _token_spec(x: jax.Array):
    """``x``'s token sharding on the mesh in context ([B, T, ...]: B over the batch axes, T over
    ``context``), or ``None`` when there is no multi-device mesh or B does not split over it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    rows = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    ctx = CONTEXT_AXIS if mesh.shape.get(CONTEXT_AXIS, 1) > 1 and x.ndim >= 3 else None
    size = 1
    for a in rows:
        size *= mesh.shape[a]
    if x.shape[0] % size or (ctx and x.shape[1] % mesh.shape[CONTEXT_AXIS]):
        return None
    return P(rows or None, *([ctx] if x.ndim >= 3 else []), *([None] * (x.ndim - (2 if x.ndim >= 3 else 1))))


def _spec_axes(spec: P) -> tuple[str, ...]:
    return tuple(a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,)))


def _payload_specs(spec: P) -> tuple:
    """shard_map specs of a GPU payload (:func:`dense_forward`): x's transposed tiles split along
    their tokens (the last dim) over the token axes, the weight's blocks whole."""
    tokens = P(None, _spec_axes(spec))
    return tokens, tokens, P(), P()


def gspmd_forward(x: jax.Array, w: jax.Array, dtype) -> tuple[jax.Array, tuple]:
    """:func:`dense_forward` for a dense layer under GSPMD: ``x`` [B, T, K] split over the token
    axes, ``w`` [K, N] whole on every device. The GPU kernels run in ``jax.shard_map`` over the
    token axes (a custom call is not partitioned); the emulation is plain XLA (partitioned as any
    GEMM). Returns ``(y, payload)`` for :func:`gspmd_grads`."""
    spec = _token_spec(x) if _kernels() else None
    if spec is None:
        return dense_forward(x, w, dtype)
    return jax.shard_map(lambda a, b: dense_forward(a, b, dtype), in_specs=(spec, P()),
                         out_specs=(spec, _payload_specs(spec)), check_vma=False)(x, w)


def gspmd_grads(payload: tuple, g: jax.Array, w_shape: tuple[int, ...], x_dtype) -> tuple[jax.Array, jax.Array]:
    """:func:`dense_backward` under GSPMD (:func:`gspmd_forward`): ``w``'s gradient summed over the
    token axes in float32."""
    spec = _token_spec(g) if _kernels() else None
    if spec is None:
        return dense_backward(payload, g, w_shape, x_dtype)
    axes = _spec_axes(spec)

    def local(p, c):
        dx, dw = dense_backward(p, c, w_shape, x_dtype)
        return dx, jax.lax.psum(dw, axes)

    return jax.shard_map(local, in_specs=(_payload_specs(spec), spec), out_specs=(spec, P()),
                         check_vma=False)(payload, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, dtype):
    return dense_forward(x, w, dtype)[0]


def _matmul_fwd(x, w, dtype):
    y, payload = dense_forward(x, w, dtype)
    return y, (payload, jnp.zeros((0,) + w.shape, w.dtype), jnp.zeros((0,), x.dtype))


def _matmul_bwd(dtype, res, g):
    payload, w_like, x_like = res
    return dense_backward(payload, g, w_like.shape[1:], x_like.dtype, w_like.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def fp8_matmul(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """``x @ w`` by the FP8 recipe (module docstring), for weights already whole on this device.

    Args:
      x: [*B, *T, K] activations (B: the leading dims ``w`` shares, e.g. experts; T: tokens).
      w: [*B, K, N] weights, any float dtype.
      dtype: the result's dtype.

    Returns:
      [*B, *T, N] in ``dtype``. Gradients: ``x``'s in its dtype, ``w``'s in its dtype, both from
      e4m3 GEMMs (module docstring).

    Raises:
      ValueError: ``x`` and ``w`` do not multiply.
    """
    batch = w.ndim - 2
    if w.ndim < 2 or x.ndim < batch + 1 or x.shape[:batch] != w.shape[:batch] or x.shape[-1] != w.shape[-2]:
        raise ValueError(f"fp8_matmul: x {list(x.shape)} and w {list(w.shape)} do not multiply")
    return _matmul(x, w, jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, group_sizes, impl, dtype):
    return _grouped_fwd(x, w, group_sizes, impl, dtype)[0]


def _grouped_fwd(x, w, group_sizes, impl, dtype):
    if _kernels():
        y, payload = _kernel_forward(x, w, group_sizes, dtype, live=True)
    else:
        y = grouped_matmul(fake_quantize_tiles(x), fake_quantize_blocks(w), group_sizes, impl=impl).astype(dtype)
        payload = (x, w)
    return y, (payload, group_sizes, jnp.zeros((0,) + w.shape, w.dtype), jnp.zeros((0,), x.dtype))


def _grouped_bwd(impl, dtype, res, g):
    payload, group_sizes, w_like, x_like = res
    zero = np.zeros(group_sizes.shape, jax.dtypes.float0)
    if _kernels():
        dx, dw = _kernel_grads(payload, g, group_sizes, w_like.shape[-2], x_like.dtype, w_like.dtype, live=True)
        return dx, dw, zero
    x, w = payload
    wq = fake_quantize_blocks(w)
    _, dx_of = jax.vjp(lambda a: grouped_matmul(a, wq, group_sizes, impl=impl), jnp.zeros(x.shape, jnp.float32))
    (dx,) = dx_of(fake_quantize_tiles(g))
    xt = _tokens_tiles(x)
    _, dw_of = jax.vjp(lambda b: grouped_matmul(xt, b, group_sizes, impl=impl), wq)
    (dw,) = dw_of(_tokens_tiles(g))
    return dx.astype(x.dtype), dw.astype(w.dtype), zero


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def fp8_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "auto",
                       dtype=None) -> jax.Array:
    """:func:`moefast.kernels.grouped_matmul` by the FP8 recipe: each row's 1 x 128 tiles, each
    group's 128 x 128 weight blocks; the weight gradient from 128-token tiles (a tile may span two
    groups: its scale covers both, each group's sum stays its own).

    Args:
      x: [M, K] rows sorted by group.
      w: [G, K, N] weights.
      group_sizes: [G] int32 rows per group (``sum <= M``).
      impl: the grouped matmul's (:data:`moefast.kernels.grouped_matmul.IMPLS`), run in float32.
      dtype: the result's dtype (default ``x``'s).

    Returns:
      [M, N] in ``dtype``; 0 for rows after the last group.
    """
    return _grouped(x, w, group_sizes.astype(jnp.int32), impl, jnp.dtype(dtype or x.dtype))
