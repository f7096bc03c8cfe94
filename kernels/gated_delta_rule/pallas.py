"""Pallas kernel of the chunked gated delta rule: one program per (row, head, value block), a loop
over the chunks inside it with the state in registers.

Dimension letters: B batch, T tokens, H heads, K key width, V value width, C tokens per chunk
(``chunk_size``), Tp = N·C the padded length, Kp and Vp the widths padded to powers of two (>= 16,
Triton's smallest dot), Vb value columns per program (``block_v``).

The math is :mod:`.chunked`'s, chunk by chunk (same segmented decay, same-run masks, the incoming
state read only by the run that continues it, the carried state built from the last run), for one
head and Vb of the V value columns. Per chunk, in float32 whatever the inputs' dtype:

1. ``G`` (segmented cumulative decay) as a masked row sum over the chunk, ``D = exp(G_i - G_j)`` on
   same-run pairs j <= i (masked before the exp);
2. ``A = beta_i (k k^T)_ij D_ij`` strictly below the diagonal, and ``T = (I + A)^-1`` by forward
   substitution: C - 1 row updates of a [C, C] tile held in registers (the row of A picked by a
   masked sum), as fla's first Triton WY kernels did (T is recomputed by every value block of a
   head: it depends on k, g and beta only);
3. ``U = T (beta v)``, ``W = T (beta c e^G k)``, ``delta = U - W S``,
   ``o = scale (c e^G q) S + (q k^T * D) delta`` stored for the chunk's tokens, and
   ``S <- c_last e^{G_last} S + (k * m e^{G_last - G})^T delta``.

Every product is a float32 ``dot`` at ``Precision.HIGHEST`` (IEEE on the Triton backend, not TF32),
so the kernel equals the chunked jnp form to float32 rounding; Triton then emits them as float32
FMAs, not tensor-core MMAs (a TF32 or bfloat16 product mode would be faster and less exact).
Compiled through the Pallas Triton backend (``plt.CompilerParams``; deprecated since jax 0.11 in
favour of Mosaic GPU, still shipped); ``interpret=True`` runs it in the Pallas interpreter on CPU.
Status: lowered for CUDA from a CPU machine (tested), and its Triton IR compiled by hand to an
sm_90a cubin with triton 3.9 and ptxas 12.9 without a GPU; never run or timed on a GPU. The offline
ptxas reports heavy register spills at K = V = 128 (as it does for the routing kernel, so the
offline figures are not trusted); block sizes and warps are untuned guesses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..platform import target_platform
from ..vma import out_struct as _out_struct, vary_together
from .chunked import chunk_prep
from .reference import HIGHEST

__all__ = ["check_pallas_chunk_size", "default_interpret", "gated_delta_rule_blocks", "padded_width"]


def padded_width(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (Triton dots need every side >= 16)."""
    return max(16, 1 << (n - 1).bit_length())


def check_pallas_chunk_size(chunk_size) -> None:
    """Raises ValueError unless ``chunk_size`` is a power of two >= 16 (a Triton block side)."""
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16
            or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a power of two >= 16 for impl='pallas' (Triton block sides), "
                         f"got {chunk_size!r}")


def default_interpret() -> bool:
    """Interpret mode by default when compiling for CPU (:func:`~moefast.kernels.platform.target_platform`),
    where Pallas Triton kernels cannot be compiled."""
    return target_platform() == "cpu"


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """``a @ b`` (``a^T``, ``b^T`` as asked) in float32 at full precision."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


def _gated_delta_rule_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, s0_ref, o_ref, s_ref, *,
                             scale: float, chunk_size: int, num_chunks: int):
    """One (row, head, value block): refs q, k [Tp, Kp]; v, o [Tp, Vb]; g, beta [Tp] float32;
    run [Tp] int32; s0, s (the final state) [Kp, Vb] float32."""
    c = chunk_size
    f32 = jnp.float32
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)  # i
    cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)  # j
    pos = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)
    is_last = pos == c - 1
    eye = (rows == cols).astype(f32)

    def chunk(n, carry):
        s, prev_run = carry  # [Kp, Vb] float32; run id of the token before the chunk
        at = pl.ds(pl.multiple_of(n * c, c), c)
        q = q_ref[at, :].astype(f32) * scale  # [C, Kp]
        k = k_ref[at, :].astype(f32)  # [C, Kp]
        v = v_ref[at, :].astype(f32)  # [C, Vb]
        g = g_ref[at]  # [C]
        beta = beta_ref[at]  # [C]
        run = run_ref[at]  # [C]

        same = run[:, None] == run[None, :]
        incl = same & (rows >= cols)
        strict = same & (rows > cols)
        seg_decay = jnp.sum(jnp.where(incl, g[None, :], 0.0), axis=1)  # G [C]
        diff = seg_decay[:, None] - seg_decay[None, :]
        decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)  # D [C, C]
        a = jnp.where(strict, beta[:, None] * _dot(k, k, trans_b=True) * decay, 0.0)

        def substitute(i, t):  # row i of T = (I + A)^-1: e_i - sum_{j < i} A_ij T_j
            a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # [C], A[i, :]
            t_i = jnp.where(pos == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * t, axis=0)
            return jnp.where(rows == i, t_i[None, :], t)

        t = jax.lax.fori_loop(1, c, substitute, eye)
        cont = (run == prev_run).astype(f32)  # continues the incoming state
        e_g = jnp.exp(seg_decay)
        u = _dot(t, beta[:, None] * v)  # [C, Vb]
        w = _dot(t, (beta * cont * e_g)[:, None] * k)  # [C, Kp]
        delta = u - _dot(w, s)
        o = _dot((cont * e_g)[:, None] * q, s) + _dot(_dot(q, k, trans_b=True) * decay, delta)
        o_ref[at, :] = o.astype(o_ref.dtype)

        run_last = jnp.sum(jnp.where(is_last, run, 0))
        g_last = jnp.sum(jnp.where(is_last, seg_decay, 0.0))
        in_last = run == run_last
        k_out = jnp.where(in_last, jnp.exp(jnp.where(in_last, g_last - seg_decay, 0.0)), 0.0)[:, None] * k
        carry_decay = jnp.sum(jnp.where(is_last, cont, 0.0)) * jnp.exp(g_last)
        return carry_decay * s + _dot(k_out, delta, trans_a=True), run_last

    s, _ = jax.lax.fori_loop(0, num_chunks, chunk, (s0_ref[...].astype(f32), jnp.int32(0)))
    s_ref[...] = s


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret", "block_v", "num_warps",
                                             "num_stages"))
def gated_delta_rule_blocks(q, k, v, g, beta, run, s0, *, scale: float, chunk_size: int = 64,
                            interpret: bool = True, block_v: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None):
    """Runs the kernel over a (B, H, Vp / Vb) grid (no custom VJP: see :mod:`.ops`).

    Args:
      q: [B, T, H, K] and k: [B, T, H, K], any float dtype (upcast in the kernel).
      v: [B, T, H, V], any float dtype; the output takes its dtype.
      g: [B, T, H] log decay and beta: [B, T, H], any float dtype (float32 in the kernel).
      run: [B, T] int32 run ids (:func:`.reference.run_ids`).
      s0: [B, H, K, V] float32 initial state.
      scale: query scale (dimensionless).
      chunk_size: C, a power of two >= 16 (checked by the caller); T need not be a multiple of it.
      interpret: run in the Pallas interpreter (CPU) instead of compiling.
      block_v: Vb, value columns per program, a power of two; ``None``: 32 for Kp >= 128, else 64
        (capped at Vp).
      num_warps, num_stages: Triton compiler parameters (compiled mode only); ``None``: 4 and 1.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``.

    Raises:
      ValueError: ``block_v`` not a power of two.
      NotImplementedError: ``interpret=True`` inside ``jax.shard_map(check_vma=True)`` on varying
        inputs (the Pallas interpreter cannot run there; the compiled kernel can).
    """
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    tp, run = chunk_prep(run.astype(jnp.int32), b, t, chunk_size)
    kp, vp = padded_width(kd), padded_width(vd)
    if block_v is None:
        block_v = 32 if kp >= 128 else 64
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    vb = min(block_v, vp)

    def pad(x, width=None):  # tokens to Tp (zeros: g = beta = 0 leave the state alone), features to width
        widths = [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2)
        if width is not None:
            widths[-1] = (0, width - x.shape[-1])
        return jnp.pad(x, widths) if any(w for _, w in widths) else x

    q, k, v = pad(q, kp), pad(k, kp), pad(v, vp)
    g, beta = pad(g.astype(jnp.float32)), pad(beta.astype(jnp.float32))
    s0 = s0.astype(jnp.float32)
    if (kp, vp) != (kd, vd):
        s0 = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - kd), (0, vp - vd)))
    (q, k, v, g, beta, run, s0), axes = vary_together(q, k, v, g, beta, run, s0)
    if axes and interpret:
        raise NotImplementedError(
            f"the Pallas interpreter cannot run inside jax.shard_map(check_vma=True) on arrays varying over "
            f"{sorted(axes, key=str)}: use impl='chunked' on CPU, or shard_map(..., check_vma=False)")
    out_struct = functools.partial(_out_struct, q)

    kernel = functools.partial(_gated_delta_rule_kernel, scale=scale, chunk_size=chunk_size,
                               num_chunks=tp // chunk_size)
    qk_spec = pl.BlockSpec((None, tp, None, kp), lambda bi, hi, vi: (bi, 0, hi, 0))
    v_spec = pl.BlockSpec((None, tp, None, vb), lambda bi, hi, vi: (bi, 0, hi, vi))
    gb_spec = pl.BlockSpec((None, tp, None), lambda bi, hi, vi: (bi, 0, hi))
    s_spec = pl.BlockSpec((None, None, kp, vb), lambda bi, hi, vi: (bi, hi, 0, vi))
    o, s = pl.pallas_call(
        kernel,
        grid=(b, h, vp // vb),
        in_specs=[qk_spec, qk_spec, v_spec, gb_spec, gb_spec,
                  pl.BlockSpec((None, tp), lambda bi, hi, vi: (bi, 0)), s_spec],
        out_specs=[v_spec, s_spec],
        out_shape=[out_struct((b, tp, h, vp), v.dtype), out_struct((b, h, kp, vp), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(
            num_warps=4 if num_warps is None else num_warps, num_stages=1 if num_stages is None else num_stages),
        name="gated_delta_rule",
    )(q, k, v, g, beta, run, s0)
    return o[:, :t, :, :vd], s[:, :, :kd, :vd]
