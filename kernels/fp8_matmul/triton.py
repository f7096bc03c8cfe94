"""Launchers of the FP8 grouped GEMM kernels and their quantizers (:mod:`._triton_kernel`, Triton).

Dimension letters: M rows (sorted by group), K the contraction, N outputs, G groups; the GEMMs'
all multiples of :data:`BLOCK` (the quantizers write them padded with zeros).

* :func:`quantize` — one read of x [M, K] (bf16 or float32): its 1 x 128 tiles along K and/or
  its 128 x 1 tiles along M written transposed [K, M] (the weight gradient's operand), e4m3 with
  float32 scales; :func:`quantize_weights` — w [G, K, N] in 128 x 128 blocks. Both compute the
  bits of :mod:`moefast.parallel.fp8`'s XLA quantizers (checked in the tests).
* :func:`scaled_grouped_matmul` — ``y[rows of g] = A[rows] @ B[g]`` with e4m3 A in 1 x 128
  tiles and e4m3 B in 128 x 128 blocks, per (row tile, group) pair as the bf16 grouped kernel
  schedules them (:func:`moefast.kernels.grouped_matmul.pallas.tile_table`); ``transpose_b``
  reads B[g] transposed (the backward ``dy @ w^T`` without a copy of ``w``).
* :func:`scaled_weight_grads` — ``dw[g] = sum over g's rows of x_row^T dy_row`` from x and dy
  transposed ([K, M], [N, M]) in tiles of 128 tokens.

Each 128-long piece of the contraction is one tensor-core product (``tl.dot`` with
``max_num_imprecise_acc=128``: Hopper's FP8 MMA accumulates those 128 products in its own,
limited precision), scaled by the two tiles' scales and added to a float32 accumulator: the
promotion of DeepSeek-V3 sec. 3.3.2 (interval N_C = 128). Pallas' Triton lowering (jax 0.10.2)
cannot express this: it emits ``tt.dot`` without ``max_num_imprecise_acc``, and Triton then
refuses Hopper's MMA for e4m3 with a float32 result and runs it as f16 ``mma.sync`` after an
upcast (the PTX of both is checked by the tests through :func:`compile_for`).

Two launchers per kernel, as for the routing kernel (:mod:`moefast.kernels.routing.triton`): JAX
(``jax_triton.triton_call``, the ``[gpu]`` extra; also in a step compiled for compile-only GPUs,
with the target's compute capability) and torch (CUDA tensors, or CPU tensors under the Triton
interpreter: how the tests check the kernels without a GPU).
"""

from __future__ import annotations

import functools

from ..routing.triton import _assembler_for_jax, compile_kernel, interpreting
from ..vma import vary_together

__all__ = ["BLOCK", "available", "compile_for", "quantize", "quantize_torch", "quantize_weights",
           "quantize_weights_torch", "scaled_grouped_matmul", "scaled_grouped_matmul_torch", "scaled_weight_grads",
           "scaled_weight_grads_torch", "tile_rows"]

BLOCK = 128  # the scaling granularity (DeepSeek-V3: 1 x 128 tiles, 128 x 128 blocks), the K step, N's tile
NUM_WARPS, NUM_STAGES = 4, 3
SCOPE = "moefast_fp8_gemm"  # the launches' named scope: moefast_fp8_gemm_{forward,dgrad,wgrad}


def tile_rows(num_rows: int, num_groups: int) -> int:
    """BM, rows per tile of the forward kernel: 128, or 64 when 128-row tiles would waste more
    than 10 % of the rows at the group boundaries (Hopper's MMA needs multiples of 64)."""
    return 128 if (num_groups - 1) * 128 <= 0.1 * num_rows else 64


@functools.cache
def _kernels():
    import triton

    from ._triton_kernel import quantize_blocks_kernel, quantize_kernel, scaled_dw_kernel, scaled_grouped_kernel

    return (triton.jit(scaled_grouped_kernel), triton.jit(scaled_dw_kernel), triton.jit(quantize_kernel),
            triton.jit(quantize_blocks_kernel))


def available(platform: str | None = None) -> str | None:
    """``None`` when the JAX launchers can run on ``platform`` (default: the platform being
    compiled for), else why not (a sentence)."""
    from ..platform import target_platform

    platform = platform or target_platform()
    if platform != "gpu":
        return f"the FP8 GEMM kernels run on GPUs (compiling for: {platform})"
    if interpreting():
        return "TRITON_INTERPRET=1 is set, which makes Triton interpret kernels instead of compiling them: unset it"
    try:
        import jax_triton  # noqa: F401
    except ModuleNotFoundError:
        return "the FP8 GEMM kernels need jax-triton (the [gpu] extra: pip install 'jax-triton>=0.3')"
    except Exception as e:
        return f"jax-triton is installed but failed to import ({type(e).__name__}: {e})"
    return None


def _check(m, k, n, g, bm):
    for name, v in (("M", m), ("K", k), ("N", n)):
        if v % BLOCK:
            raise ValueError(f"the FP8 grouped GEMM needs {name} a multiple of {BLOCK} (the caller pads), got {v}")
    if m % bm:
        raise ValueError(f"M={m} is not a multiple of the row tile {bm}")


def _grouped_args(m, k_b, n_b, transpose_b):
    """(K, N, strides of B, strides of its block scales along K and N) of the product for B stored
    [G, k_b, n_b] with scales [G, k_b / 128, n_b / 128]."""
    if transpose_b:
        return n_b, k_b, (k_b * n_b, 1, n_b), (1, n_b // BLOCK)
    return k_b, n_b, (k_b * n_b, n_b, 1), (n_b // BLOCK, 1)


def _call(kernel, args, out_shape, grid, scope, **constexprs):
    import inspect

    import jax
    import jax_triton as jt
    import triton

    from ..platform import target_compute_capability

    chosen = _assembler_for_jax()
    if chosen:  # the PTX version JAX's ptxas assembles (moefast.kernels.routing.triton)
        triton.knobs.nvidia.ptxas_blackwell = chosen
    name = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
    cc = target_compute_capability()
    # inside jax.shard_map: the inputs vary over the union of their axes, and so does the result
    # (jax-triton's call declares none)
    args, axes = vary_together(*args)
    with jax.named_scope(scope):  # the launch's op_name in the HLO (what moefast bench gpu-compile counts)
        out = jt.triton_call(*args, kernel=kernel, **{name: out_shape}, grid=grid, num_warps=NUM_WARPS,
                             num_stages=NUM_STAGES, **({"compute_capability": cc} if cc else {}), **constexprs)
    if not axes:
        return out
    if isinstance(out, (list, tuple)):
        return list(vary_together(*out, *args)[0][:len(out)])
    return vary_together(out, *args)[0][0]


def scaled_grouped_matmul(a, sa, b, sb, group_sizes, *, transpose_b: bool = False, out_dtype=None,
                          block_rows: int | None = None):
    """``[M, N]``: each group's rows of ``a`` times its ``b`` (JAX, GPU; module docstring).

    Args:
      a: [M, K] float8_e4m3fn rows sorted by group; sa: [M, K / 128] float32 scales.
      b: [G, K, N] float8_e4m3fn (``transpose_b``: [G, N, K], read transposed).
      sb: float32 scales of ``b``'s 128 x 128 blocks as stored: [G, K / 128, N / 128]
        (``transpose_b``: [G, N / 128, K / 128]; :func:`moefast.parallel.fp8.quantize_blocks`).
      group_sizes: [G] int32 rows per group (sum <= M).
      out_dtype: the result's dtype (default bfloat16).
      block_rows: BM (default :func:`tile_rows`).

    Returns:
      [M, N] in ``out_dtype``; rows after the last group are not written (mask them).

    Raises:
      ValueError: sizes not multiples of 128; RuntimeError: no GPU or no jax-triton.
    """
    import jax
    import jax.numpy as jnp

    from ..grouped_matmul.pallas import tile_table

    why = available()
    if why:
        raise RuntimeError(why)
    m, _ = a.shape
    g, k_b, n_b = b.shape
    k, n, (sg, sk, sn), (ssk, ssn) = _grouped_args(m, k_b, n_b, transpose_b)
    bm = block_rows or tile_rows(m, g)
    _check(m, k, n, g, bm)
    table = tile_table(group_sizes, m, bm)
    out = jax.ShapeDtypeStruct((m, n), out_dtype or jnp.bfloat16)
    scope = f"{SCOPE}_{'dgrad' if transpose_b else 'forward'}"
    return _call(_kernels()[0], (table, a, sa, b, sb), out, (table.shape[1], n // BLOCK), scope, PAIRS=table.shape[1],
                 K=k, N=n, STRIDE_BG=sg, STRIDE_BK=sk, STRIDE_BN=sn, STRIDE_SK=ssk, STRIDE_SN=ssn, BM=bm, BN=BLOCK,
                 BK=BLOCK)


def scaled_weight_grads(xt, sxt, dyt, sdyt, group_sizes, *, out_dtype=None):
    """``[G, K, N]`` in ``out_dtype`` (default float32; summed in float32 either way): per group the
    sum over its rows of ``x_row^T dy_row`` (JAX, GPU).

    Args:
      xt: [K, M] float8_e4m3fn, x transposed; sxt: [K, M / 128] float32, one scale per 128 tokens
        of a channel.
      dyt: [N, M] float8_e4m3fn; sdyt: [N, M / 128] float32.
      group_sizes: [G] int32 rows per group.
    """
    import jax
    import jax.numpy as jnp

    why = available()
    if why:
        raise RuntimeError(why)
    k, m = xt.shape
    n = dyt.shape[0]
    g = group_sizes.shape[0]
    _check(m, k, n, g, BLOCK)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    bounds = jnp.concatenate([ends - group_sizes.astype(jnp.int32), ends])
    out = jax.ShapeDtypeStruct((g, k, n), out_dtype or jnp.float32)
    return _call(_kernels()[1], (bounds, xt, sxt, dyt, sdyt), out, (g, k // BLOCK, n // BLOCK), f"{SCOPE}_wgrad",
                 G=g, M=m, K=k, N=n,
                 BT=BLOCK, BI=BLOCK, BO=BLOCK)


def _padded_to_block(v: int) -> int:
    return -(-v // BLOCK) * BLOCK


def quantize(x, *, rows: bool = True, cols: bool = False):
    """One pass over ``x`` [M, K] (any float; JAX, GPU): its e4m3 values and float32 scales in 1 x 128
    tiles along K (``rows``) and/or in 128 x 1 tiles along M, written transposed (``cols``: 128
    tokens of one channel, the weight gradient's operand), the same numbers as
    :func:`moefast.parallel.fp8.quantize_tiles` of ``x`` and of ``x.T``. Sizes are padded with zeros
    to multiples of 128 in the kernel (no padded copy).

    Returns:
      ``(q [Mp, Kp], s [Mp, Kp / 128])`` with ``rows``, then ``(qt [Kp, Mp], st [Kp, Mp / 128])``
      with ``cols`` (Mp, Kp: M, K rounded up to 128), as one flat tuple.

    Raises:
      ValueError: neither ``rows`` nor ``cols``; RuntimeError: no GPU or no jax-triton.
    """
    import jax
    import jax.numpy as jnp

    why = available()
    if why:
        raise RuntimeError(why)
    if not (rows or cols):
        raise ValueError("quantize: ask for rows, cols or both")
    m, k = x.shape
    mp, kp = _padded_to_block(m), _padded_to_block(k)
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    unused = lambda dtype: jax.ShapeDtypeStruct((1,), dtype)  # noqa: E731  (a constexpr branch skips it)
    outs = [jax.ShapeDtypeStruct((mp, kp), f8), jax.ShapeDtypeStruct((mp, kp // BLOCK), f32)] if rows else \
        [unused(f8), unused(f32)]
    outs += [jax.ShapeDtypeStruct((kp, mp), f8), jax.ShapeDtypeStruct((kp, mp // BLOCK), f32)] if cols else \
        [unused(f8), unused(f32)]
    got = _call(_kernels()[2], (x,), outs, (mp // BLOCK, kp // BLOCK), f"{SCOPE}_quantize", M=m, K=k, MP=mp, KP=kp,
                ROWS=bool(rows), COLS=bool(cols), B=BLOCK)
    return tuple(got[:2] if rows else ()) + tuple(got[2:] if cols else ())


def quantize_weights(w):
    """One pass over the weights ``w`` [G, K, N] (any float; JAX, GPU): their e4m3 values and one
    float32 scale per 128 x 128 block, the same bits as :func:`moefast.parallel.fp8.quantize_blocks`;
    K and N padded with zeros to multiples of 128 in the kernel.

    Returns:
      ``(q [G, Kp, Np] float8_e4m3fn, s [G, Kp / 128, Np / 128] float32)``.

    Raises:
      RuntimeError: no GPU or no jax-triton.
    """
    import jax
    import jax.numpy as jnp

    why = available()
    if why:
        raise RuntimeError(why)
    g, k, n = w.shape
    kp, np_ = _padded_to_block(k), _padded_to_block(n)
    outs = [jax.ShapeDtypeStruct((g, kp, np_), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((g, kp // BLOCK, np_ // BLOCK), jnp.float32)]
    return tuple(_call(_kernels()[3], (w,), outs, (g, kp // BLOCK, np_ // BLOCK), f"{SCOPE}_quantize_weights",
                       K=k, N=n, KP=kp, NP=np_, B=BLOCK))


def _interpretable(t):
    if t.device.type == "cpu" and not interpreting():
        raise RuntimeError("Triton kernels run on CPU tensors only in the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")


def scaled_grouped_matmul_torch(a, sa, b, sb, table, *, transpose_b: bool = False, out_dtype=None,
                                block_rows: int = 128):
    """:func:`scaled_grouped_matmul` on torch tensors (CUDA, or CPU under the Triton interpreter),
    with the pair table given ([4, P] int32, :func:`moefast.kernels.grouped_matmul.pallas.tile_table`)."""
    import torch

    _interpretable(a)
    m, _ = a.shape
    g, k_b, n_b = b.shape
    k, n, (sg, sk, sn), (ssk, ssn) = _grouped_args(m, k_b, n_b, transpose_b)
    _check(m, k, n, g, block_rows)
    out = torch.zeros((m, n), dtype=out_dtype or torch.bfloat16, device=a.device)
    pairs = table.shape[1]
    _kernels()[0][(pairs, n // BLOCK)](table.contiguous(), a.contiguous(), sa.contiguous(), b.contiguous(),
                                        sb.contiguous(), out, PAIRS=pairs, K=k, N=n, STRIDE_BG=sg, STRIDE_BK=sk,
                                        STRIDE_BN=sn, STRIDE_SK=ssk, STRIDE_SN=ssn, BM=block_rows, BN=BLOCK, BK=BLOCK,
                                        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def scaled_weight_grads_torch(xt, sxt, dyt, sdyt, bounds):
    """:func:`scaled_weight_grads` on torch tensors, with ``bounds`` [2 G] int32 (the groups'
    first rows, then their ends)."""
    import torch

    _interpretable(xt)
    k, m = xt.shape
    n = dyt.shape[0]
    g = bounds.shape[0] // 2
    _check(m, k, n, g, BLOCK)
    out = torch.empty((g, k, n), dtype=torch.float32, device=xt.device)
    _kernels()[1][(g, k // BLOCK, n // BLOCK)](bounds.contiguous(), xt.contiguous(), sxt.contiguous(),
                                               dyt.contiguous(), sdyt.contiguous(), out, G=g, M=m, K=k, N=n,
                                               BT=BLOCK, BI=BLOCK, BO=BLOCK, num_warps=NUM_WARPS,
                                               num_stages=NUM_STAGES)
    return out


def quantize_torch(x, *, rows: bool = True, cols: bool = False):
    """:func:`quantize` on a torch tensor (CUDA, or CPU under the Triton interpreter)."""
    import torch

    _interpretable(x)
    m, k = x.shape
    mp, kp = _padded_to_block(m), _padded_to_block(k)
    f8 = torch.float8_e4m3fn
    q, s = torch.zeros((mp, kp), dtype=f8, device=x.device), torch.zeros((mp, kp // BLOCK), device=x.device)
    qt, st = torch.zeros((kp, mp), dtype=f8, device=x.device), torch.zeros((kp, mp // BLOCK), device=x.device)
    _kernels()[2][(mp // BLOCK, kp // BLOCK)](x.contiguous(), q, s, qt, st, M=m, K=k, MP=mp, KP=kp, ROWS=rows,
                                               COLS=cols, B=BLOCK, num_warps=NUM_WARPS)
    return tuple((q, s) if rows else ()) + tuple((qt, st) if cols else ())


def quantize_weights_torch(w):
    """:func:`quantize_weights` on a torch tensor (CUDA, or CPU under the Triton interpreter)."""
    import torch

    _interpretable(w)
    g, k, n = w.shape
    kp, np_ = _padded_to_block(k), _padded_to_block(n)
    q = torch.zeros((g, kp, np_), dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.zeros((g, kp // BLOCK, np_ // BLOCK), device=w.device)
    _kernels()[3][(g, kp // BLOCK, np_ // BLOCK)](w.contiguous(), q, s, K=k, N=n, KP=kp, NP=np_, B=BLOCK,
                                                   num_warps=NUM_WARPS)
    return q, s


def compile_for(kind: str = "forward", arch: int = 90, *, ptxas: str | None = None) -> str:
    """PTX of a kernel compiled by Triton for compute capability ``arch`` (no GPU needed), with the
    PTX version JAX's toolkit assembles.

    Args:
      kind: ``"forward"`` (A @ B[g]), ``"dgrad"`` (A @ B[g]^T), ``"wgrad"``, ``"quantize"`` or
        ``"quantize_weights"``.
      arch: compute capability x 10.
      ptxas: the assembler whose CUDA release sets the PTX version (``None``: JAX's toolkit's).

    Raises:
      ValueError: an unknown ``kind``; triton.runtime.errors.PTXASError: ptxas rejected the PTX.
    """
    from ._triton_kernel import quantize_blocks_kernel, quantize_kernel, scaled_dw_kernel, scaled_grouped_kernel

    if kind in ("forward", "dgrad"):
        k, n = 512, 384
        _, _, (sg, sk, sn), (ssk, ssn) = _grouped_args(1024, *((n, k) if kind == "dgrad" else (k, n)), kind == "dgrad")
        fn, names = scaled_grouped_kernel, ["table_ptr", "a_ptr", "sa_ptr", "b_ptr", "sb_ptr", "o_ptr"]
        types = ["*i32", "*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*bf16"]
        consts = dict(PAIRS=16, K=k, N=n, STRIDE_BG=sg, STRIDE_BK=sk, STRIDE_BN=sn, STRIDE_SK=ssk, STRIDE_SN=ssn,
                      BM=128, BN=BLOCK, BK=BLOCK)
    elif kind == "wgrad":
        fn, names = scaled_dw_kernel, ["bounds_ptr", "xt_ptr", "sxt_ptr", "dyt_ptr", "sdyt_ptr", "dw_ptr"]
        types = ["*i32", "*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*fp32"]
        consts = dict(G=4, M=1024, K=512, N=384, BT=BLOCK, BI=BLOCK, BO=BLOCK)
    elif kind == "quantize":
        fn, names = quantize_kernel, ["x_ptr", "q_ptr", "s_ptr", "qt_ptr", "st_ptr"]
        types = ["*bf16", "*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32"]
        consts = dict(M=1000, K=576, MP=1024, KP=640, ROWS=True, COLS=True, B=BLOCK)
    elif kind == "quantize_weights":
        fn, names = quantize_blocks_kernel, ["w_ptr", "q_ptr", "s_ptr"]
        types = ["*fp32", "*fp8e4nv", "*fp32"]
        consts = dict(K=576, N=1408, KP=640, NP=1408, B=BLOCK)
    else:
        raise ValueError(f"kind={kind!r}: one of 'forward', 'dgrad', 'wgrad', 'quantize', 'quantize_weights'")
    kernel = compile_kernel(fn, dict(zip(names, types)), consts, arch=arch, ptxas=ptxas,
                            options={"num_warps": NUM_WARPS, "num_stages": NUM_STAGES})
    return kernel.asm["ptx"]
