"""Pallas (Triton backend) kernel of the lightning indexer's scores.

Dimension letters: B batch, T queries (Tq a block of them), S keys (Sk a block of them), Hi
indexer heads, Di indexer head width (Wd: its next power of two, >= 16).

``scores[b, t, s] = sum_h w[b, t, h] · relu(scale · q[b, t, h] · k[b, s])`` (DeepSeek-V3.2-Exp,
sec. 2.1, eq. 1; DeepGEMM's ``fp8_mqa_logits`` computes the same in FP8).

Grid ``(S / Sk, T / Tq, B)`` (rounded up): one program per block of Sk keys, block of Tq queries
and row. A program loads its [Sk, Wd] key tile once and loops over the Hi heads
(``lax.fori_loop``): head h's [Tq, Wd] query tile times the key tile (``[Tq, Wd] x [Wd, Sk]``,
every side >= 16: tensor-core shaped), clipped at 0, times the queries' weights ``scale · w[:, h]``
and added to a float32 [Tq, Sk] accumulator kept in registers; the tile is stored once. Nothing of
size Hi × S is written: the kernel writes only the float32 [B, T, S] scores, where the plain XLA
form materialises float32 [B, T, Hi, S] logits. The scale is folded into the weights (for
``scale >= 0``, ``relu(scale · x) = scale · max(x, 0)``; for ``scale < 0`` it is
``scale · min(x, 0)``): one max and one multiply-add per logit.

Nothing is padded in memory: rows past T and S and columns past Di are masked on load (zeros) and
on store, so T, S and Di may be any size >= 1 (a partial block at each end). Block sizes
(:func:`blocks`): Tq = ``min(64, pow2(T))``, Sk = ``min(128, pow2(S))``, 4 warps for 16-bit
inputs; Sk <= 64 and 8 warps for float32 (three TF32 products a head, their operands split in
registers: at 4 warps ptxas spilled 124 bytes). 2 pipeline stages: the next head's query tile
loads (``cp.async``) during this head's product. At DeepSeek-V3.2's sizes (Hi = 64, Di = 128,
bfloat16) a program's accumulator and product are 2 × 64 × 128 float32 over 128 threads (128
registers a thread), the key tile 32 KiB and each query tile 16 KiB of shared memory. These are
untuned guesses: no GPU was available.

Precision: bfloat16/float16 products accumulate in float32 on the tensor cores; float32 inputs use
three-pass TF32 (``DotAlgorithmPreset.TF32_TF32_F32_X3``, about float32 accuracy on tensor cores)
when compiled and an exact float32 product in the interpreter (XLA:CPU has no TF32).

Cost per row: 2·T·S·Hi·Di FLOPs of products and T·S·Hi clips and multiply-adds; reads the
query block once per key block (⌈S / Sk⌉·T·Hi·Di elements, from L2 at these sizes), k once per
query block, w once per key block, and writes T·S float32.

Status: tested in the Pallas interpreter (CPU), lowered for CUDA and compiled for a compile-only
H100 (sm_90a PTX through the CUDA PJRT plugin, ``.venv/gpu-compile``) from a CPU machine; never run
or timed on a GPU (none was available). Compiled for sm_90a at Hi = 64, Di = 128, T = 256, S =
1000 with the default blocks, offline ptxas 12.9 (``-v``) reported: bfloat16, 156 registers a
thread, no spills, each head's product 8 Hopper ``wgmma.mma_async ... m64n128k16.f32.bf16.bf16``;
float32, 211 registers, no spills, its products ``wgmma ... m64n32k8.f32.tf32.tf32``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..platform import target_platform
from .reference import validate

__all__ = ["BLOCK_S", "BLOCK_T", "SCORES_NAME", "blocks", "default_interpret", "lightning_indexer_scores_pallas",
           "num_warps_for", "pow2"]

SCORES_NAME = "moefast_lightning_indexer_scores"
"""The kernel's name in HLO (the ``__gpu$xla.gpu.triton`` custom call's ``name``) and PTX (``.entry``)."""

BLOCK_T = 64  # queries per program (fewer, a power of two >= 16, for fewer queries)
BLOCK_S = 128  # keys per program (64 for float32 inputs; fewer, a power of two >= 16, for fewer keys)


def pow2(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (Triton dots need every side >= 16)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def default_interpret() -> bool:
    """The Pallas interpreter when compiling for CPU (:func:`~moefast.kernels.platform.target_platform`)."""
    return target_platform() == "cpu"


def blocks(num_queries: int, num_keys: int, dtype, block_t: int | None = None,
           block_s: int | None = None) -> tuple[int, int]:
    """``(Tq, Sk)``: queries and keys per program. Defaults: :data:`BLOCK_T` queries and
    :data:`BLOCK_S` keys (half for float32 inputs: twice the bytes a tile, three products a head),
    each at most the next power of two (>= 16) of T and S (untuned).

    Raises:
      ValueError: a block size that is no power of two >= 16.
    """
    bt = block_t or min(BLOCK_T, pow2(num_queries))
    bs = block_s or min(BLOCK_S // (2 if jnp.dtype(dtype) == jnp.float32 else 1), pow2(num_keys))
    for name, x in (("block_t", bt), ("block_s", bs)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a Triton block side), got {x}")
    return bt, bs


def num_warps_for(dtype) -> int:
    """Warps a program: 8 for float32 inputs (three-pass TF32 holds more in registers), else 4."""
    return 8 if jnp.dtype(dtype) == jnp.float32 else 4


def _scores_kernel(q_ref, w_ref, k_ref, o_ref, *, scale: float, width: int, num_queries: int, num_keys: int,
                   precision):
    tq, num_heads, wd = q_ref.shape
    sk = k_ref.shape[0]
    rows = pl.program_id(1) * tq + jnp.arange(tq) < num_queries  # [Tq] queries of the row
    keys = pl.program_id(0) * sk + jnp.arange(sk) < num_keys  # [Sk] keys of the row
    cols = jnp.arange(wd) < width  # [Wd] features of a head
    k = plt.load(k_ref, mask=keys[:, None] & cols[None, :], other=0.0)  # [Sk, Wd], once for every head
    q_mask = rows[:, None] & cols[None, :]
    clip = jnp.maximum if scale >= 0 else jnp.minimum  # relu(scale·x) = scale·clip(x, 0)

    def head(h, acc):
        q = plt.load(q_ref.at[:, h, :], mask=q_mask, other=0.0)  # [Tq, Wd]
        w = plt.load(w_ref.at[:, h], mask=rows, other=0.0) * scale  # [Tq]
        x = plt.dot(q, k, trans_b=True, precision=precision)  # [Tq, Sk] float32
        return acc + w[:, None] * clip(x, 0.0)

    acc = lax.fori_loop(0, num_heads, head, jnp.zeros((tq, sk), jnp.float32))
    plt.store(o_ref, acc, mask=rows[:, None] & keys[None, :])


def lightning_indexer_scores_pallas(q_bthd: jax.Array, w_bth: jax.Array, k_bsd: jax.Array, *, scale: float,
                                    block_t: int | None = None, block_s: int | None = None,
                                    interpret: bool | None = None, num_warps: int | None = None,
                                    num_stages: int = 2) -> jax.Array:
    """Lightning-indexer scores by the Pallas kernel (same contract as
    :func:`.reference.lightning_indexer_scores_reference`, equal to it to float rounding).

    Args:
      q_bthd: [B, T, Hi, Di] queries; k_bsd: [B, S, Di] keys; one dtype (float32, bfloat16,
        float16).
      w_bth: float32 [B, T, Hi] each head's weight per query.
      scale: logit scale (dimensionless), static.
      block_t: queries per program (Tq), a power of two >= 16; ``None``: :func:`blocks`.
      block_s: keys per program (Sk), a power of two >= 16; ``None``: :func:`blocks`.
      interpret: run in the Pallas interpreter; ``None``: when compiling for CPU.
      num_warps: warps a program; ``None``: :func:`num_warps_for`. num_stages: Triton's software
        pipelining depth of the head loop. Both ignored by the interpreter.

    Returns:
      float32 [B, T, S]. Not differentiable: Pallas' automatic JVP of this kernel fails (an
      ``AssertionError`` inside JAX, even with the result under ``jax.lax.stop_gradient``, since
      the JVP is traced before the output's stop). The public
      :func:`~moefast.kernels.lightning_indexer.lightning_indexer_scores` stops gradients at its
      inputs so that it is never asked for.

    Raises:
      ValueError: see :func:`.reference.validate`; a block size that is no power of two >= 16.
    """
    validate(q_bthd, w_bth, k_bsd, scale)
    b, t, h, d = q_bthd.shape
    s = k_bsd.shape[1]
    bt, bs = blocks(t, s, q_bthd.dtype, block_t, block_s)
    if b * t == 0:
        return jnp.zeros((b, t, s), jnp.float32)
    if interpret is None:
        interpret = default_interpret()
    wd = pow2(d)
    if q_bthd.dtype != jnp.float32:
        precision = None  # bfloat16 / float16 products, float32 accumulation
    elif interpret:
        precision = lax.Precision.HIGHEST  # XLA:CPU has no TF32: the exact float32 product
    else:
        precision = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    kernel = functools.partial(_scores_kernel, scale=float(scale), width=d, num_queries=t, num_keys=s,
                               precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(s, bs), pl.cdiv(t, bt), b),
        in_specs=[pl.BlockSpec((None, bt, h, wd), lambda si, ti, bi: (bi, ti, 0, 0)),
                  pl.BlockSpec((None, bt, h), lambda si, ti, bi: (bi, ti, 0)),
                  pl.BlockSpec((None, bs, wd), lambda si, ti, bi: (bi, si, 0))],
        out_specs=pl.BlockSpec((None, bt, bs), lambda si, ti, bi: (bi, ti, si)),
        out_shape=jax.ShapeDtypeStruct((b, t, s), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps or num_warps_for(q_bthd.dtype),
                                           num_stages=num_stages),
        interpret=bool(interpret), name=SCORES_NAME,
    )(q_bthd, w_bth, k_bsd)
