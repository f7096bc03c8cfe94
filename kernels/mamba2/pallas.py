"""Pallas kernel of Mamba-2's chunked SSD scan (forward): one program per (row, head, block of the
head dim), a loop over the chunks inside it with the state in registers. The backward kernel is in
:mod:`.pallas_bwd`; the custom VJP joining them in :mod:`.ops`.

Dimension letters: B batch, T tokens, H heads, P head dim, G groups, N state size, Q tokens per
chunk (``chunk_size``), Z = Tp / Q chunks, Tp the padded length, Pp and Np the widths padded to
powers of two (>= 16, Triton's smallest dot), Pb head-dim columns per program (``block_p``),
Nv = Pp / Pb head-dim blocks.

The math is :mod:`.chunked`'s, chunk by chunk, for one head and Pb of its P columns (the gated
delta rule's forward kernel, :mod:`moefast.kernels.gated_delta_rule.pallas`, without the delta
rule's triangular solve: within a chunk the SSD is masked, decayed linear attention with C as the
queries, B as the keys and dt·x as the values). The program keeps the state transposed, S^T
[Np, Pb], so that every product has a side of Q or Np rows (Hopper's warpgroup MMA, ``wgmma``,
works on 64-row tiles). Per chunk, in float32 whatever the inputs' dtype (:func:`chunk_decays`),
with a = dt·A the log decay (computed by the wrapper) and xd = dt·x:

1. ``L`` [Q, Q], the decay from token s to token l: ``exp(sum_{s < k <= l} a_k)`` for s <= l in
   one run (one document), 0 elsewhere. The sums come from a cumulative sum over the tile's rows
   (``jnp.cumsum``, Triton's scan), not as differences of cumulative sums, exactly as the chunked
   form (transformers' ``segment_sum``); the exponent is masked to 0 outside before the exp;
2. ``y = ((C B^T) * L) xd + (c e^G) (C S^T)`` stored for the chunk's tokens (G the cumulative
   decay of the run continuing the incoming state, c marks that run's tokens);
3. ``S^T <- c_last e^{G_last} S^T + B^T (k_fac xd)``, ``k_fac = e^{G_last - G}`` on the chunk's
   last run and 0 elsewhere (L's last row; from a cumulative sum over that run only).

The program reads its head's group of B and C straight from the [B, T, G, N] arrays (a block
index ``h // (H / G)``): nothing is repeated per head in memory; ``C B^T`` is recomputed by every
program of a group (H / G heads x Nv blocks).

Precision: every product takes float32 operands and accumulates in float32: three-pass TF32 on
the tensor cores when compiled (``DotAlgorithmPreset.TF32_TF32_F32_X3``, about float32 accuracy:
:data:`COMPILED_PRECISION`), the exact float32 product (``Precision.HIGHEST``) in the interpreter
(XLA:CPU has no TF32). IEEE float32 dots would compile to unrolled FMAs (megabytes of PTX and
about ten minutes of ptxas at Q = N = 128, checked); bfloat16 operands (what mamba_ssm's Triton
kernels use for bfloat16 inputs) would be faster and less exact: not done.

Chunks: the public entry (:func:`.ops.ssd_pallas`) runs the kernels on chunks of
``min(chunk_size, MAX_KERNEL_CHUNK)`` = at most 64 tokens. The chunk only orders the float32
sums (every chunk size computes the same recurrence), and at Q = 128 a program's [Q, Q] and
[Q, N] float32 tiles do not fit: the backward kernel asks for 256 KiB of shared memory (an H100
has 227) and fails to compile, the forward spills more.

Compiled through the Pallas Triton backend (``plt.CompilerParams``; deprecated since jax 0.11 in
favour of Mosaic GPU, still shipped); ``interpret=True`` runs it in the Pallas interpreter on CPU.
Status: tested in the interpreter, lowered for CUDA and compiled to sm_90a PTX for a compile-only
H100 from a CPU machine; never run or timed on a GPU (none was available). At Nemotron-H's
widths (P = 64, N = 128, bfloat16 inputs, Q = 64, Pb = 32) the products are ``wgmma.mma_async ...
m64n{32,64}k8.f32.tf32.tf32`` and offline ptxas 12.9 (``-v``, sm_90a) reported: this forward
kernel (4 warps) 255 registers a thread and 1,144 bytes of spill stores (a 1,176-byte stack
frame); the states recompute (4 warps) 255 registers, no spills; the backward
(:mod:`.pallas_bwd`, 8 warps) 255 registers and 5,552 bytes of spill stores (4,736-byte frame).
Block sizes and warps are untuned guesses (the module constants below): the least spilling of the
configurations put to ptxas (Q in {64, 128}, Pb in {16, 32, 64}, 4 or 8 warps, one and three TF32
passes: all spill except the states recompute).

``states=True`` (:func:`ssd_blocks`) runs the same loop without the outputs and stores the state
entering each chunk instead: the backward pass's forward recompute.
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

__all__ = ["BLOCK_P", "COMPILED_PRECISION", "FORWARD_NAME", "MAX_KERNEL_CHUNK", "NUM_WARPS", "STATES_NAME",
           "check_pallas_chunk_size", "check_vary", "chunk_decays", "compiler_params", "default_interpret",
           "dot_precision", "input_specs", "padded_width", "prepare", "ssd_blocks"]

FORWARD_NAME = "moefast_ssd_fwd"
STATES_NAME = "moefast_ssd_states"
BLOCK_P = 32  # default head-dim columns per program (Pb); capped at Pp, at least 16
MAX_KERNEL_CHUNK = 64  # the largest chunk the public entry runs the kernels on (module docstring)
NUM_WARPS = 4  # the forward and states kernels; the backward's: pallas_bwd.NUM_WARPS
NUM_STAGES = 1
COMPILED_PRECISION = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3  # three-pass TF32 (module docstring)


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


def dot_precision(interpret: bool):
    """The kernels' product precision: ``Precision.HIGHEST`` in the interpreter (XLA:CPU's exact
    float32 product); three-pass TF32 (:data:`COMPILED_PRECISION`) when compiled."""
    return HIGHEST if interpret else COMPILED_PRECISION


def _dot(a, b, precision, *, trans_a: bool = False, trans_b: bool = False):
    """``a @ b`` (``a^T``, ``b^T`` as asked) of float32 tiles, float32 result, at ``precision``."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def chunk_decays(a, run, prev_run, *, with_decay: bool = True):
    """The chunk's decays (one head, float32): everything that depends on a and the runs only.

    Args:
      a: [Q] log decays dt·A (<= 0); run: [Q] int32 run ids; prev_run: the run id of the token
        before the chunk (int32 scalar; 0 before the row); ``with_decay``: form the [Q, Q] tiles
        (``False``: ``incl`` and ``decay`` are None; the states pass reads no outputs).

    Returns:
      A dict: ``incl`` [Q, Q] bool (s <= l, same run); ``decay`` L [Q, Q] (module docstring, 0 off
      ``incl``); ``q_in`` [Q] (``c e^G``: how token l reads the incoming state); ``k_fac`` [Q]
      (``e^{G_last - G}`` on the last run, 0 elsewhere: L's last row, how token s reaches the
      outgoing state); ``carry`` (``c_last e^{G_last}``, a scalar: the incoming state's share of
      the outgoing one); ``run_last``; ``is_last`` [Q] and ``rows``, ``cols`` [Q, Q] iotas (None
      without ``with_decay``). The vectors come from cumulative sums over one run only (the
      continuing run for ``q_in`` and ``carry``, the last run for ``k_fac``: a large decay in an
      earlier document of the chunk never enters them).
    """
    q = run.shape[0]
    pos = jax.lax.broadcasted_iota(jnp.int32, (q,), 0)
    is_last = pos == q - 1
    cont = run == prev_run  # continues the incoming state (the chunk's first run, if any)
    run_last = jnp.sum(jnp.where(is_last, run, 0))
    in_last = run == run_last
    cum_first = jnp.cumsum(jnp.where(cont, a, 0.0))  # G on the continuing run
    cum_last = jnp.cumsum(jnp.where(in_last, a, 0.0))  # G on the last run
    g_end = jnp.sum(jnp.where(is_last, cum_last, 0.0))  # G_last
    q_in = jnp.where(cont, jnp.exp(cum_first), 0.0)
    carry = jnp.sum(jnp.where(is_last, q_in, 0.0))  # c_last e^{G_last}
    k_fac = jnp.where(in_last, jnp.exp(jnp.where(in_last, g_end - cum_last, 0.0)), 0.0)
    out = dict(q_in=q_in, k_fac=k_fac, carry=carry, run_last=run_last, is_last=is_last, incl=None, decay=None,
               rows=None, cols=None)
    if with_decay:
        rows = jax.lax.broadcasted_iota(jnp.int32, (q, q), 0)  # l (or k)
        cols = jax.lax.broadcasted_iota(jnp.int32, (q, q), 1)  # s
        incl = (run[:, None] == run[None, :]) & (rows >= cols)
        seg = jnp.cumsum(jnp.where(rows > cols, a[:, None], 0.0), axis=0)  # sum_{s < k <= l} a_k
        out.update(incl=incl, decay=jnp.where(incl, jnp.exp(jnp.where(incl, seg, 0.0)), 0.0), rows=rows, cols=cols)
    return out


def _ssd_kernel(x_ref, dt_ref, a_ref, b_ref, c_ref, run_ref, s0_ref, *out_refs, chunk_size: int, num_chunks: int,
                states: bool, precision):
    """One (row, head, head-dim block), the state transposed (S^T [Np, Pb], so that every product
    has a side of Q or Np rows: Hopper's warpgroup MMA wants 64): refs x [Tp, Pb]; dt, a [Tp]
    float32; b, c [Tp, Np] (the head's group); run [Tp] int32; s0 [Np, Pb] float32. Outputs:
    ``states=False``: y [Tp, Pb] and the final state [Np, Pb] float32; ``states=True``: the state
    entering every chunk, [Z·Np, Pb] float32 (chunk z at rows z·Np .. z·Np + Np - 1), for the
    backward pass."""
    q = chunk_size
    f32 = jnp.float32
    np_ = b_ref.shape[-1]

    def chunk(z, carry):
        s, prev_run = carry  # S^T [Np, Pb] float32; run id of the token before the chunk
        at = pl.ds(pl.multiple_of(z * q, q), q)
        if states:
            out_refs[0][pl.ds(pl.multiple_of(z * np_, np_), np_), :] = s
        xd = x_ref[at, :].astype(f32) * dt_ref[at][:, None]  # [Q, Pb]
        d = chunk_decays(a_ref[at], run_ref[at], prev_run, with_decay=not states)
        if not states:
            bm = b_ref[at, :].astype(f32)  # [Q, Np]
            cm = c_ref[at, :].astype(f32)  # [Q, Np]
            scores = _dot(cm, bm, precision, trans_b=True) * d["decay"]  # [Q, Q]
            y = _dot(scores, xd, precision) + d["q_in"][:, None] * _dot(cm, s, precision)
            y_ref = out_refs[0]
            y_ref[at, :] = y.astype(y_ref.dtype)
        bm = b_ref[at, :].astype(f32)  # reloaded (L1/L2): not kept live across the outputs' products
        s = d["carry"] * s + _dot(bm, d["k_fac"][:, None] * xd, precision, trans_a=True)  # S^T += B^T (k_fac xd)
        return s, d["run_last"]

    s, _ = jax.lax.fori_loop(0, num_chunks, chunk, (s0_ref[...].astype(f32), jnp.int32(0)))
    if not states:
        out_refs[1][...] = s


def prepare(x, dt, a, B, C, run, s0, *, chunk_size: int, block_p: int | None):
    """The kernels' padded inputs (shared by the forward and backward calls).

    Returns:
      ``(arrays, dims)``: arrays x [B, Tp, H, Pp] (x's dtype); dt, a [B, Tp, H] float32; B, C
      [B, Tp, G, Np] (their dtypes); run [B, Tp] int32; s0 transposed, [B, H, Np, Pp] float32 — tokens padded
      with zeros (dt = a = 0: the state is left alone) in the last token's run, widths with zeros;
      dims ``dict(t, p, n, tp, pp, np, pb, r)`` (r = H / G heads per group).

    Raises:
      ValueError: ``block_p`` not a power of two.
    """
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    tp, run = chunk_prep(run.astype(jnp.int32), b, t, chunk_size)
    pp, np_ = padded_width(p), padded_width(n)
    block_p = BLOCK_P if block_p is None else block_p
    if isinstance(block_p, bool) or not isinstance(block_p, int) or block_p < 1 or block_p & (block_p - 1):
        raise ValueError(f"block_p must be a power of two, got {block_p!r}")
    pb = min(max(block_p, 16), pp)

    def pad(arr, width=None):  # tokens to Tp, the last axis to width
        widths = [(0, 0), (0, tp - t)] + [(0, 0)] * (arr.ndim - 2)
        if width is not None:
            widths[-1] = (0, width - arr.shape[-1])
        return jnp.pad(arr, widths) if any(w for _, w in widths) else arr

    x, B, C = pad(x, pp), pad(B, np_), pad(C, np_)
    dt, a = pad(dt.astype(jnp.float32)), pad(a.astype(jnp.float32))
    s0 = jnp.pad(jnp.swapaxes(s0.astype(jnp.float32), 2, 3), ((0, 0), (0, 0), (0, np_ - n), (0, pp - p)))
    return (x, dt, a, B, C, run, s0), dict(t=t, p=p, n=n, tp=tp, pp=pp, np=np_, pb=pb, r=h // g)


def check_vary(arrays, interpret: bool):
    """``arrays`` made to vary together (:func:`..vma.vary_together`).

    Raises:
      NotImplementedError: interpret mode on arrays varying over mesh axes (inside
        ``jax.shard_map(check_vma=True)``).
    """
    arrays, axes = vary_together(*arrays)
    if axes and interpret:
        raise NotImplementedError(
            f"the Pallas interpreter cannot run inside jax.shard_map(check_vma=True) on arrays varying over "
            f"{sorted(axes, key=str)}: use impl='chunked' on CPU, or shard_map(..., check_vma=False)")
    return arrays


def input_specs(tp: int, np_: int, pb: int, r: int, num_chunks: int):
    """BlockSpecs over the (B, H, Pp / Pb) grid: x (and y, dy) [Tp, Pb]; dt, a [Tp]; B, C [Tp, Np]
    of the head's group; run [Tp]; a transposed state block [Np, Pb] of [B, H, Np, Pp]; the chunks'
    transposed states [Z·Np, Pb] of [B, H, Z·Np, Pp]."""
    return dict(
        x=pl.BlockSpec((None, tp, None, pb), lambda bi, hi, pi: (bi, 0, hi, pi)),
        th=pl.BlockSpec((None, tp, None), lambda bi, hi, pi: (bi, 0, hi)),
        bc=pl.BlockSpec((None, tp, None, np_), lambda bi, hi, pi: (bi, 0, hi // r, 0)),
        run=pl.BlockSpec((None, tp), lambda bi, hi, pi: (bi, 0)),
        s=pl.BlockSpec((None, None, np_, pb), lambda bi, hi, pi: (bi, hi, 0, pi)),
        states=pl.BlockSpec((None, None, num_chunks * np_, pb), lambda bi, hi, pi: (bi, hi, 0, pi)),
    )


def compiler_params(interpret: bool, num_warps: int | None, num_stages: int | None,
                    default_warps: int = NUM_WARPS):
    """Triton compiler parameters (``None`` in interpret mode); ``default_warps`` and
    :data:`NUM_STAGES` by default."""
    return None if interpret else plt.CompilerParams(
        num_warps=default_warps if num_warps is None else num_warps,
        num_stages=NUM_STAGES if num_stages is None else num_stages)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "block_p", "num_warps", "num_stages",
                                             "states"))
def ssd_blocks(x, dt, a, B, C, run, s0, *, chunk_size: int = 128, interpret: bool = True,
               block_p: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
               states: bool = False):
    """Runs the forward kernel over a (B, H, Pp / Pb) grid (no custom VJP: see :mod:`.ops`).

    Args:
      x: [B, T, H, P], any float dtype; the output takes its dtype.
      dt: [B, T, H] step sizes (> 0), any float dtype (float32 in the kernel).
      a: [B, T, H] log decays dt·A (<= 0), float32.
      B, C: [B, T, G, N], any float dtypes (upcast in the kernel); G divides H.
      run: [B, T] int32 run ids (:func:`.reference.run_ids`).
      s0: [B, H, P, N] float32 initial state.
      chunk_size: Q, a power of two >= 16 (checked by the caller); T need not be a multiple of it.
      interpret: run in the Pallas interpreter (CPU) instead of compiling.
      block_p: Pb, head-dim columns per program, a power of two; ``None``: :data:`BLOCK_P` (capped
        at Pp, at least 16).
      num_warps, num_stages: Triton compiler parameters (compiled mode only); ``None``:
        :data:`NUM_WARPS` and :data:`NUM_STAGES`.
      states: return the state entering every chunk instead (the backward pass's forward recompute).

    Returns:
      ``(y [B, T, H, P] in x's dtype, final_state [B, H, P, N] float32)``; ``states=True``: the
      padded, transposed states entering each chunk, [B, H, Z·Np, Pp] float32 (chunk z's S^T at
      rows z·Np .. z·Np + Np - 1).

    Raises:
      ValueError: ``block_p`` not a power of two.
      NotImplementedError: ``interpret=True`` inside ``jax.shard_map(check_vma=True)`` on varying
        inputs (the Pallas interpreter cannot run there; the compiled kernel can).
    """
    b, _, h, _ = x.shape
    arrays, d = prepare(x, dt, a, B, C, run, s0, chunk_size=chunk_size, block_p=block_p)
    x, dt, a, B, C, run, s0 = check_vary(arrays, interpret)
    tp, pp, np_, pb = d["tp"], d["pp"], d["np"], d["pb"]
    z = tp // chunk_size
    out_struct = functools.partial(_out_struct, x)
    kernel = functools.partial(_ssd_kernel, chunk_size=chunk_size, num_chunks=z, states=states,
                               precision=dot_precision(interpret))
    sp = input_specs(tp, np_, pb, d["r"], z)
    if states:
        out_specs = [sp["states"]]
        out_shape = [out_struct((b, h, z * np_, pp), jnp.float32)]
    else:
        out_specs = [sp["x"], sp["s"]]
        out_shape = [out_struct((b, tp, h, pp), x.dtype), out_struct((b, h, np_, pp), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, pp // pb),
        in_specs=[sp["x"], sp["th"], sp["th"], sp["bc"], sp["bc"], sp["run"], sp["s"]],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params(interpret, num_warps, num_stages),
        name=STATES_NAME if states else FORWARD_NAME,
    )(x, dt, a, B, C, run, s0)
    if states:
        return outs[0]
    y, s = outs
    return y[:, :d["t"], :, :d["p"]], jnp.swapaxes(s[:, :, :d["n"], :d["p"]], 2, 3)
