"""The Pallas gated delta rule with a custom VJP: the differentiable wrapper of :mod:`.pallas`
(forward kernel) and :mod:`.pallas_bwd` (backward kernels).

Dimension letters: B batch, T tokens, H heads, K key width, V value width.

Pallas kernels have no reverse-mode rule, so the kernel call is wrapped in :func:`jax.custom_vjp`.
The forward saves only its inputs (q, k, v, g, beta, the run ids and the initial state); the
backward pass is two Pallas kernels (:func:`.pallas_bwd.gated_delta_rule_bwd_blocks`): a forward
recompute that stores the state entering every chunk, then a reverse loop over the chunks carrying
the state's cotangent. Both decays (g [B, T, H], Gated DeltaNet; g [B, T, H, K], KDA) take this
path; no XLA form of the chunked rule runs. Tested in the Pallas interpreter (equal to the chunked
form's VJP and the recurrence's gradients) and lowered for CUDA; never run on a GPU (none was
available). Forward-mode AD (``jax.jvp``) is not supported through the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .pallas import check_pallas_chunk_size, default_interpret, gated_delta_rule_blocks
from .pallas_bwd import gated_delta_rule_bwd_blocks
from .reference import run_ids, validate

__all__ = ["gated_delta_rule_pallas"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _gated_delta_rule_core(q, k, v, g, beta, run, s0, scale, chunk_size, interpret):
    return gated_delta_rule_blocks(q, k, v, g, beta, run, s0, scale=scale, chunk_size=chunk_size,
                                   interpret=interpret)


def _core_fwd(q, k, v, g, beta, run, s0, scale, chunk_size, interpret):
    out = _gated_delta_rule_core(q, k, v, g, beta, run, s0, scale, chunk_size, interpret)
    return out, (q, k, v, g, beta, run, s0)


def _core_bwd(scale, chunk_size, interpret, residuals, cotangents):
    q, k, v, g, beta, run, s0 = residuals
    do, ds = cotangents
    grads = gated_delta_rule_bwd_blocks(q, k, v, g, beta, run, s0, do, ds, scale=scale, chunk_size=chunk_size,
                                        interpret=interpret)
    dq, dk, dv, dg, dbeta, ds0 = (d.astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta, s0)))
    return dq, dk, dv, dg, dbeta, np.zeros(run.shape, jax.dtypes.float0), ds0  # run ids: integers


_gated_delta_rule_core.defvjp(_core_fwd, _core_bwd)


def gated_delta_rule_pallas(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                            segment_ids: jax.Array | None = None, initial_state: jax.Array | None = None,
                            scale: float | None = None, chunk_size: int = 64,
                            interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule computed by the Pallas kernel (:mod:`.pallas`).

    Same contract as :func:`.reference.gated_delta_rule_reference`; equals
    :func:`.chunked.gated_delta_rule_chunked` (same ``chunk_size``) to float32 rounding.

    Args:
      q: [B, T, H, K] queries, any float dtype, L2-normalised per head.
      k: [B, T, H, K] keys, any float dtype, L2-normalised per head.
      v: [B, T, H, V] values, any float dtype.
      g: [B, T, H] log decay (<= 0), or [B, T, H, K] one per key channel (KDA), any float dtype.
      beta: [B, T, H] write strength in (0, 1), any float dtype.
      segment_ids: [B, T] int document ids (the state resets where the id changes) or ``None``.
      initial_state: [B, H, K, V] float32 state before the row's first segment, or ``None``: zeros.
      scale: query scale (dimensionless); ``None``: K**-0.5.
      chunk_size: C, tokens per chunk, a power of two >= 16; T need not be a multiple of it.
      interpret: run the kernel in the Pallas interpreter; ``None``: when compiling for CPU
        (:func:`~moefast.kernels.platform.target_platform`).

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``. Differentiable with
      ``jax.grad``/``jax.vjp`` with respect to q, k, v, g, beta and initial_state (the backward
      pass is Pallas kernels, module docstring); not ``jax.jvp``.

    Raises:
      ValueError: see :func:`.reference.validate`, or ``chunk_size`` not a power of two >= 16.
      NotImplementedError: interpret mode inside ``jax.shard_map(check_vma=True)`` on varying
        inputs (see :func:`.pallas.gated_delta_rule_blocks`).
    """
    validate(q, k, v, g, beta, segment_ids, initial_state, scale)
    check_pallas_chunk_size(chunk_size)
    b, t, h, kd = q.shape
    if interpret is None:
        interpret = default_interpret()
    s0 = (jnp.zeros((b, h, kd, v.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    return _gated_delta_rule_core(q, k, v, g, beta, run_ids(segment_ids, b, t), s0,
                                  kd ** -0.5 if scale is None else float(scale), chunk_size, bool(interpret))
