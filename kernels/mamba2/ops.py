"""The Pallas SSD scan with a custom VJP: the differentiable wrapper of :mod:`.pallas` (forward
kernel) and :mod:`.pallas_bwd` (backward kernels).

Dimension letters: B batch, T tokens, H heads, P head dim, G groups, N state size.

Pallas kernels have no reverse-mode rule, so the kernel call is wrapped in :func:`jax.custom_vjp`.
The wrapper first forms the log decay a = dt·A [B, T, H] in float32 with plain jnp, outside the
custom VJP, so JAX's autodiff of that product turns the kernels' d(a) into dA (summed over rows and
tokens) and adds A·d(a) to d(dt). The forward saves only its inputs (x, dt, a, B, C, the run ids and
the initial state); the backward pass is two Pallas kernels (:func:`.pallas_bwd.ssd_bwd_blocks`):
a forward recompute that stores the state entering every chunk, then a reverse loop over the chunks
carrying the state's cotangent. No XLA form of the chunked scan runs. Tested in the Pallas
interpreter (equal to the chunked form's VJP and the recurrence's gradients), lowered for CUDA and
compiled to PTX for a compile-only H100; never run on a GPU (none was available). Forward-mode AD
(``jax.jvp``) is not supported through the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .pallas import MAX_KERNEL_CHUNK, check_pallas_chunk_size, default_interpret, ssd_blocks
from .pallas_bwd import ssd_bwd_blocks
from .reference import run_ids, validate

__all__ = ["ssd_pallas"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _ssd_core(x, dt, a, B, C, run, s0, chunk_size, interpret):
    return ssd_blocks(x, dt, a, B, C, run, s0, chunk_size=chunk_size, interpret=interpret)


def _core_fwd(x, dt, a, B, C, run, s0, chunk_size, interpret):
    out = _ssd_core(x, dt, a, B, C, run, s0, chunk_size, interpret)
    return out, (x, dt, a, B, C, run, s0)


def _core_bwd(chunk_size, interpret, residuals, cotangents):
    x, dt, a, B, C, run, s0 = residuals
    dy, ds = cotangents
    grads = ssd_bwd_blocks(x, dt, a, B, C, run, s0, dy, ds, chunk_size=chunk_size, interpret=interpret)
    dx, ddt, da, dB, dC, ds0 = (d.astype(v.dtype) for d, v in zip(grads, (x, dt, a, B, C, s0)))
    return dx, ddt, da, dB, dC, np.zeros(run.shape, jax.dtypes.float0), ds0  # run ids: integers


_ssd_core.defvjp(_core_fwd, _core_bwd)


def ssd_pallas(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, *,
               segment_ids: jax.Array | None = None, initial_state: jax.Array | None = None,
               chunk_size: int = 128, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The SSD scan computed by the Pallas kernels (:mod:`.pallas`, :mod:`.pallas_bwd`).

    Same contract as :func:`.reference.ssd_reference`; equals :func:`.chunked.ssd_chunked` to
    float32 rounding (in the interpreter; compiled, its products are three-pass TF32: about float32).

    Args:
      x: [B, T, H, P] inputs, any float dtype.
      dt: [B, T, H] step sizes (softplus'd, biased and clamped by the caller: > 0), any float dtype.
      A: [H] decay rates (negative), any float dtype (float32 inside).
      B: [B, T, G, N] input projections, any float dtype; G divides H.
      C: [B, T, G, N] output projections, any float dtype.
      segment_ids: [B, T] int document ids (the state resets where the id changes) or ``None``.
      initial_state: [B, H, P, N] float32 state before the row's first segment, or ``None``: zeros.
      chunk_size: Q, tokens per chunk, a power of two >= 16; T need not be a multiple of it. The
        kernels take chunks of ``min(chunk_size, MAX_KERNEL_CHUNK)`` (64) tokens: the same
        recurrence, summed in another order; larger tiles do not fit a program (:mod:`.pallas`).
      interpret: run the kernels in the Pallas interpreter; ``None``: when compiling for CPU
        (:func:`~moefast.kernels.platform.target_platform`).

    Returns:
      ``(y [B, T, H, P] in x's dtype, final_state [B, H, P, N] float32)``. Differentiable with
      ``jax.grad``/``jax.vjp`` with respect to x, dt, A, B, C and initial_state (the backward pass
      is Pallas kernels, module docstring); not ``jax.jvp``.

    Raises:
      ValueError: see :func:`.reference.validate`, or ``chunk_size`` not a power of two >= 16.
      NotImplementedError: interpret mode inside ``jax.shard_map(check_vma=True)`` on varying
        inputs (see :func:`.pallas.ssd_blocks`).
    """
    validate(x, dt, A, B, C, segment_ids, initial_state)
    check_pallas_chunk_size(chunk_size)
    b, t, h, p = x.shape
    if interpret is None:
        interpret = default_interpret()
    s0 = (jnp.zeros((b, h, p, B.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    a = dt.astype(jnp.float32) * A.astype(jnp.float32)[None, None, :]  # log decay, differentiated by JAX
    return _ssd_core(x, dt, a, B, C, run_ids(segment_ids, b, t), s0, min(chunk_size, MAX_KERNEL_CHUNK),
                     bool(interpret))
