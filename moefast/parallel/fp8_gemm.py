"""FP8 GEMMs for training (``model.precision: fp8``): DeepSeek-V3's fine-grained recipe (Liu et al.
2024, arXiv 2412.19437, sec. 3.3: Fprop, Dgrad and Wgrad all take e4m3 inputs; activations and
gradients are scaled per 1 x 128 tile along the contraction, weights per 128 x 128 block; products
accumulate in float32, the scales applied per 128-long piece of the contraction).

Dimension letters: M rows (tokens), K the contraction, N outputs, B batch (experts), G groups.

The three GEMMs of ``y = x @ w`` (:func:`fp8_matmul`, :func:`fp8_grouped_matmul`):

* forward ``y = x @ w``: ``x`` in 1 x 128 tiles along K, ``w`` in 128 x 128 blocks;
* ``dx = dy @ w^T``: ``dy`` in 1 x 128 tiles along N, the same blocks of ``w``;
* ``dw = x^T @ dy`` (a sum over tokens): ``x`` and ``dy`` in 128 x 1 tiles, 128 tokens of one
  channel each (sec. 3.3.2: the transposed tiling for the backward pass); ``dw`` is float32.

Sizes that are not multiples of 128 are zero-padded to the next multiple for the scaling (zeros
change no product; e.g. MLA's 576-wide ``kv_a_proj_with_mqa``).

Here each GEMM is computed from its operands' e4m3 values times their scales, in float32
(:func:`~moefast.parallel.fp8.fake_quantize_tiles`): the recipe's numbers (ml_dtypes' e4m3
rounding), the same on every platform, with float32 GEMMs. Only the order of the float32 sums
differs from a kernel that applies the scales per 128-long piece (both exact products of e4m3
values, summed in float32). What stays as the bf16 precision runs it: the master weights,
optimizer state, norms, router, softmax, attention's score and value products, embeddings, the
LM head and the losses (sec. 3.3: those components keep their precision).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moefast.kernels.grouped_matmul import grouped_matmul
from moefast.parallel.fp8 import fake_quantize_blocks, fake_quantize_tiles

__all__ = ["PRECISIONS", "check_device", "fp8_dense_grads", "fp8_dense_forward", "fp8_grouped_matmul", "fp8_matmul"]

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
    return (f"note: model.precision=fp8 computes the recipe's e4m3 numbers with float32 GEMMs on {platform} "
            "(emulated: the FP8 numerics, not their speed; moefast/parallel/fp8_gemm.py)")


def _tokens_tiles(a: jax.Array) -> jax.Array:
    """[*B, M, C] fake-quantized in 128 x 1 tiles (128 tokens of one channel), float32."""
    return jnp.swapaxes(fake_quantize_tiles(jnp.swapaxes(a, -1, -2)), -1, -2)


def _flat(x: jax.Array, batch: int) -> jax.Array:
    """[*B, *T, K] -> [*B, M, K]: the token dims between the batch dims and K as one."""
    return x.reshape(*x.shape[:batch], -1, x.shape[-1])


def fp8_dense_forward(x: jax.Array, w: jax.Array) -> jax.Array:
    """Forward GEMM: ``x`` [*B, *T, K] (1 x 128 tiles) times ``w`` [*B, K, N] (128 x 128 blocks);
    float32 [*B, *T, N]."""
    batch = w.ndim - 2
    y = jnp.matmul(_flat(fake_quantize_tiles(x), batch), fake_quantize_blocks(w), precision=_HI)
    return y.reshape(*x.shape[:-1], w.shape[-1])


def fp8_dense_grads(x: jax.Array, w: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The backward GEMMs of :func:`fp8_dense_forward` for the cotangent ``g`` [*B, *T, N]:
    ``(dx [*B, *T, K], dw [*B, K, N])``, both float32."""
    batch = w.ndim - 2
    dx = jnp.matmul(_flat(fake_quantize_tiles(g), batch), jnp.swapaxes(fake_quantize_blocks(w), -1, -2), precision=_HI)
    xt, gt = _tokens_tiles(_flat(x, batch)), _tokens_tiles(_flat(g, batch))
    dw = jnp.matmul(jnp.swapaxes(xt, -1, -2), gt, precision=_HI)
    return dx.reshape(x.shape), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, dtype):
    return fp8_dense_forward(x, w).astype(dtype)


def _matmul_fwd(x, w, dtype):
    return _matmul(x, w, dtype), (x, w)


def _matmul_bwd(dtype, res, g):
    x, w = res
    dx, dw = fp8_dense_grads(x, w, g)
    return dx.astype(x.dtype), dw.astype(w.dtype)


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
    return grouped_matmul(fake_quantize_tiles(x), fake_quantize_blocks(w), group_sizes, impl=impl).astype(dtype)


def _grouped_fwd(x, w, group_sizes, impl, dtype):
    return _grouped(x, w, group_sizes, impl, dtype), (x, w, group_sizes)


def _grouped_bwd(impl, dtype, res, g):
    x, w, group_sizes = res
    wq = fake_quantize_blocks(w)
    _, dx_of = jax.vjp(lambda a: grouped_matmul(a, wq, group_sizes, impl=impl), jnp.zeros(x.shape, jnp.float32))
    (dx,) = dx_of(fake_quantize_tiles(g))
    xt = _tokens_tiles(x)
    _, dw_of = jax.vjp(lambda b: grouped_matmul(xt, b, group_sizes, impl=impl), wq)
    (dw,) = dw_of(_tokens_tiles(g))
    return dx.astype(x.dtype), dw.astype(w.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)


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
