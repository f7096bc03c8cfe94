"""The gated delta rule of Gated DeltaNet (Qwen3-Next's linear attention) and Kimi Delta Attention (a
decay per key channel), over packed documents.

``gated_delta_rule(q, k, v, g, beta, segment_ids=..., initial_state=..., impl=...)`` returns the
outputs and the final recurrent state. Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", arXiv:2412.06464, eq. 10, exactly as transformers'
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` compute it (the math is in
:mod:`.reference`; packed documents reset the state where the segment id changes). Implementations
(``impl``), one contract, each tested against the recurrence:

* ``"reference"`` — :mod:`.reference`: token by token (``jax.lax.scan``), float32: the oracle.
* ``"chunked"`` — :mod:`.chunked`: the WY/UT chunked form in plain jnp (chunks of ``chunk_size``
  tokens, a unit lower triangular solve per chunk, ``jax.lax.scan`` over chunks), document
  boundaries exact inside a chunk.
* ``"pallas"`` — :mod:`.pallas` (forward kernel), :mod:`.pallas_bwd` (backward kernels) and
  :mod:`.ops` (custom VJP): one Pallas program per (row, head, value block) looping over the
  chunks with the state in registers; the backward recomputes the chunks' states, then loops over
  the chunks in reverse carrying the state's cotangent. Both decays (per head and per key
  channel). Compiled through the Pallas Triton backend on GPU; the Pallas interpreter on CPU
  (tests). Tested in the interpreter and lowered for CUDA; not yet run or timed on a GPU.
* ``"auto"`` — ``"pallas"`` when compiling for GPUs
  (:func:`~moefast.kernels.platform.target_platform`: the mesh's platform, not the host's),
  ``"chunked"`` elsewhere, for either decay.
"""

from __future__ import annotations

from typing import Literal

import jax

from ..platform import resolve_impl
from .chunked import check_chunk_size, gated_delta_rule_chunked
from .ops import gated_delta_rule_pallas
from .reference import gated_delta_rule_reference, validate

__all__ = ["IMPLS", "gated_delta_rule", "gated_delta_rule_chunked", "gated_delta_rule_pallas",
           "gated_delta_rule_reference", "resolve", "validate"]

IMPLS = ("reference", "chunked", "pallas", "auto")
Impl = Literal["reference", "chunked", "pallas", "auto"]


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`): ``"auto"`` is ``"pallas"`` on GPU and
    ``"chunked"`` elsewhere.

    Raises:
      ValueError: an unknown ``impl``.
    """
    return resolve_impl(impl, IMPLS, "chunked", "gated delta rule", platform)


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                     segment_ids: jax.Array | None = None, initial_state: jax.Array | None = None,
                     scale: float | None = None, impl: Impl = "auto", chunk_size: int = 64,
                     interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T tokens per row and head (see :mod:`.reference` for the math).

    Args:
      q: [B, T, H, K] queries, any float dtype, already L2-normalised per head (the caller does it).
      k: [B, T, H, K] keys, any float dtype, already L2-normalised per head; as many heads as v
        (repeat key heads for grouped value heads first).
      v: [B, T, H, V] values, any float dtype.
      g: [B, T, H] log decay per token (<= 0; the state is multiplied by exp(g)), or [B, T, H, K]
        one per key channel (Kimi Delta Attention: row kappa of the state by exp(g[kappa])), any
        float dtype. Every ``impl`` takes both.
      beta: [B, T, H] write strength in (0, 1), any float dtype.
      segment_ids: [B, T] int document ids, or ``None`` (one document per row). The state resets
        to zero at every token whose id differs from the previous token's, so packed documents give
        exactly the outputs each gives alone.
      initial_state: [B, H, K, V] float32 state before token 0, applied to the row's first segment
        only; ``None``: zeros.
      scale: query scale (dimensionless); ``None``: K**-0.5 (transformers scales q by it).
      impl: one of :data:`IMPLS`.
      chunk_size: C, tokens per chunk of ``"chunked"`` and ``"pallas"`` (``"pallas"``: a power of
        two >= 16); T need not be a multiple of it.
      interpret: ``"pallas"`` only: run the kernel in the Pallas interpreter; ``None``: when
        compiling for CPU.

    Returns:
      ``(o, final_state)``: o [B, T, H, V] in v's dtype (computed in float32), final_state
      [B, H, K, V] float32, the state after the row's last token (of its last segment).
      Differentiable with ``jax.grad``/``jax.vjp`` with respect to q, k, v, g, beta and
      initial_state (``"pallas"``: not ``jax.jvp``).

    Raises:
      ValueError: at trace time, naming the argument: bad shapes or dtypes
        (:func:`.reference.validate`), an unknown ``impl``, or a bad ``chunk_size``.
    """
    validate(q, k, v, g, beta, segment_ids, initial_state, scale)
    impl = resolve(impl)
    kw = dict(segment_ids=segment_ids, initial_state=initial_state, scale=scale)
    if impl == "reference":
        return gated_delta_rule_reference(q, k, v, g, beta, **kw)
    if impl == "pallas":
        return gated_delta_rule_pallas(q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, **kw)
    check_chunk_size(chunk_size)
    return gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kw)
