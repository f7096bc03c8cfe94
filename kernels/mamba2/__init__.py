"""Mamba-2's SSD scan (state-space duality), the sequence mixer of Nemotron-H / Nemotron 3
(``nemotron_h`` in transformers), over packed documents.

``ssd(x, dt, A, B, C, segment_ids=..., initial_state=..., impl=...)`` returns the outputs and the
final state. Dao and Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", arXiv:2405.21060 (the recurrence, sec. 3; the chunked
block decomposition, sec. 6), exactly as transformers' Nemotron-H Mamba-2 mixer computes it between
its convolution and its gated norm (the math is in :mod:`.reference`; packed documents reset the
state where the segment id changes). Implementations (``impl``), one contract, each tested against
the recurrence:

* ``"reference"`` — :mod:`.reference`: token by token (``jax.lax.scan``), float32: the oracle.
* ``"chunked"`` — :mod:`.chunked`: the SSD block decomposition in plain jnp (intra-chunk quadratic
  form with the segment-sum decay matrix, inter-chunk state passing with ``jax.lax.scan``; chunks
  of ``chunk_size`` tokens, 128 by default as transformers), document boundaries exact inside a
  chunk. Gradients by JAX autodiff.
* ``"pallas"`` — :mod:`.pallas` (forward kernel), :mod:`.pallas_bwd` (backward kernels) and
  :mod:`.ops` (custom VJP): one Pallas program per (row, head, block of the head dim) looping over
  the chunks with the [Pb, N] state in registers; the backward recomputes the chunks' states, then
  loops over the chunks in reverse carrying the state's cotangent. Chunks of at most 64 tokens
  (larger tiles do not fit a program), products in three-pass TF32 on the tensor cores (about
  float32). Compiled through the Pallas Triton backend on GPU; the Pallas interpreter on CPU
  (tests). Tested in the interpreter, lowered for CUDA and compiled to PTX for a compile-only
  H100; not yet run or timed on a GPU.
* ``"auto"`` — ``"pallas"`` when compiling for GPUs
  (:func:`~moefast.kernels.platform.target_platform`: the mesh's platform, not the host's),
  ``"chunked"`` elsewhere.

:func:`ssd_flops` gives the chunked algorithm's forward FLOPs for benchmarks.
"""

from __future__ import annotations

from typing import Literal

import jax

from ..platform import resolve_impl
from .chunked import check_chunk_size, ssd_chunked
from .ops import ssd_pallas
from .pallas import FORWARD_NAME, STATES_NAME
from .pallas_bwd import BACKWARD_NAME
from .reference import ssd_reference, validate

__all__ = ["BACKWARD_NAME", "FORWARD_NAME", "IMPLS", "STATES_NAME", "resolve", "ssd", "ssd_chunked", "ssd_flops",
           "ssd_pallas", "ssd_reference", "validate"]

IMPLS = ("reference", "chunked", "pallas", "auto")
Impl = Literal["reference", "chunked", "pallas", "auto"]


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`): ``"auto"`` is ``"pallas"`` on GPU and
    ``"chunked"`` elsewhere.

    Raises:
      ValueError: an unknown ``impl``.
    """
    return resolve_impl(impl, IMPLS, "chunked", "mamba2 ssd", platform)


def ssd(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, *,
        segment_ids: jax.Array | None = None, initial_state: jax.Array | None = None, impl: Impl = "auto",
        chunk_size: int = 128, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Mamba-2's SSD scan over T tokens per row and head (see :mod:`.reference` for the math).

    Per head h (group g = h // (H / G)), float32::

        S_t = exp(dt_t A_h) S_{t-1} + dt_t outer(x_t, B_t[g])    # [P, N]
        y_t = S_t C_t[g]                                          # [P]

    Args:
      x: [B, T, H, P] inputs (after Mamba-2's convolution), any float dtype.
      dt: [B, T, H] step sizes, already softplus'd, biased and clamped by the caller (> 0), any
        float dtype.
      A: [H] decay rates, negative (``-exp(A_log)``), float32 (any float dtype is upcast).
      B: [B, T, G, N] input projections, any float dtype; G divides H, head h reads group
        h // (H / G).
      C: [B, T, G, N] output projections, any float dtype.
      segment_ids: [B, T] int document ids, or ``None`` (one document per row). The state resets
        to zero at every token whose id differs from the previous token's, so packed documents give
        exactly the outputs each gives alone.
      initial_state: [B, H, P, N] float32 state before token 0, applied to the row's first segment
        only; ``None``: zeros.
      impl: one of :data:`IMPLS`.
      chunk_size: Q, tokens per chunk of ``"chunked"`` and ``"pallas"`` (``"pallas"``: a power of
        two >= 16, run in chunks of at most 64); T need not be a multiple of it. Every chunk size
        computes the same recurrence (float32 sums in another order).
      interpret: ``"pallas"`` only: run the kernels in the Pallas interpreter; ``None``: when
        compiling for CPU.

    Returns:
      ``(y, final_state)``: y [B, T, H, P] in x's dtype (computed in float32), final_state
      [B, H, P, N] float32, the state after the row's last token (of its last segment). The D skip
      connection, the gate and the norm are the caller's. Differentiable with ``jax.grad``/
      ``jax.vjp`` with respect to x, dt, A, B, C and initial_state (``"pallas"``: not ``jax.jvp``).

    Raises:
      ValueError: at trace time, naming the argument: bad shapes or dtypes
        (:func:`.reference.validate`), an unknown ``impl``, or a bad ``chunk_size``.
    """
    validate(x, dt, A, B, C, segment_ids, initial_state)
    impl = resolve(impl)
    kw = dict(segment_ids=segment_ids, initial_state=initial_state)
    if impl == "reference":
        return ssd_reference(x, dt, A, B, C, **kw)
    if impl == "pallas":
        return ssd_pallas(x, dt, A, B, C, chunk_size=chunk_size, interpret=interpret, **kw)
    check_chunk_size(chunk_size)
    return ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, **kw)


def ssd_flops(b: int, t: int, h: int, p: int, g: int, n: int, chunk_size: int = 128) -> int:
    """Forward FLOPs of the chunked SSD algorithm (:mod:`.chunked`), 2 per multiply-add.

    With Q = ``chunk_size``, Z = ceil(T / Q) chunks and Tp = Z·Q padded tokens (Dao and Gu 2024,
    sec. 6, the four steps of the block decomposition)::

        2·B·Tp·G·Q·N      C B^T per chunk and group, [Q, N] x [N, Q]       (step 1, scores)
      + 2·B·Tp·H·Q·P      (C B^T * L) xd per chunk and head, [Q, Q] x [Q, P] (step 1, outputs)
      + 2·B·Tp·H·P·N      each chunk's state, xd^T B, [P, Q] x [Q, N]      (step 2)
      + 2·B·Z·H·P·N       state passing, S <- c S + S_chunk                (step 3)
      + 2·B·Tp·H·P·N      the incoming state's read, C S^T, [Q, N] x [N, P] (step 4)

    The full [Q, Q] blocks are counted (the chunked form and the kernel compute them whole, the
    causal half included); elementwise work (the decay matrix's exps and masks, dt·x) is not. The
    Pallas kernel recomputes C B^T per (head, head-dim block) rather than once per group: its
    executed FLOPs exceed this by 2·B·Tp·(H·Pp/Pb - G)·Q·N.

    Args:
      b: batch (a positive int, as every size here).
      t: tokens.
      h: heads.
      p: head dim.
      g: groups (dividing h).
      n: state size.
      chunk_size: Q, tokens per chunk.

    Returns:
      The FLOPs (an int).

    Raises:
      ValueError: a size that is not a positive int, or g not dividing h.
    """
    sizes = dict(b=b, t=t, h=h, p=p, g=g, n=n, chunk_size=chunk_size)
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if h % g:
        raise ValueError(f"g={g} groups must divide h={h} heads")
    z = -(-t // chunk_size)
    tp = z * chunk_size
    return 2 * b * tp * (g * chunk_size * n + h * chunk_size * p + 2 * h * p * n) + 2 * b * z * h * p * n
