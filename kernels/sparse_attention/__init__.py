"""Top-k sparse attention (DeepSeek Sparse Attention; MLA in its absorbed, multi-query form).

``sparse_attention(q, k, v, indices, *, scale, impl="auto", interpret=None)``: every query attends,
in all its heads, only to the K keys its row's ``indices`` select (DeepSeek-V3.2-Exp's lightning
indexer picks them; this package takes them as given and never differentiates them).

Dimension letters: B batch, T queries, S keys (tokens of the row's cache), H query heads, D
query/key width, Dv value width, K selected keys per query (``top_k``).

* q [B, T, H, D]: queries. MLA absorbed: D = kv_lora_rank + qk_rope_head_dim (512 + 64 in
  DeepSeek-V3.2), the no-RoPE part already multiplied by the key up-projection.
* k [B, S, D]: one key per token shared by all heads (the compressed latent and the RoPE key).
* v [B, S, Dv]: one value per token shared by all heads (the latent, Dv = kv_lora_rank; the caller
  applies the value up-projection to the output).
* indices [B, T, K] int32: the keys each query attends to, -1 for unused slots (a row of fewer
  than K valid keys; any index outside [0, S) counts as unused); the valid ones distinct per query.
* scale: the logit scale (a static float).
* out [B, T, H, Dv] in q's dtype, the softmax in float32; 0 for a query with no valid slot. With
  ``return_lse=True`` also the [B, T, H] float32 natural log-sum-exp (-inf there). Differentiable
  with respect to q, k and v; gradients reach only the selected keys and values.

Cost per query and all its heads: K·(D + Dv) elements of k and v gathered (once per block of heads),
2·H·K·(D + Dv) FLOPs forward and 2·H·K·(3·D + 2·Dv) backward: O(K·D), not the O(S·D) of dense
attention, and no T × S (or T × K) matrix in memory in the kernels (the reference does hold the
gathered [B, T, K, D] keys).

Implementations (``impl``), one contract:

* ``"reference"`` — :mod:`.reference`: pure jnp, gathers the selected keys and values ([B, T, K, D]
  in memory) and takes a masked softmax over the K slots: the oracle.
* ``"pallas"`` — :mod:`.pallas` (forward), :mod:`.pallas_bwd` (backward), :mod:`.ops` (custom VJP):
  Pallas Triton kernels, one program per (query, block of heads), looping over the query's slots
  in blocks, gathering the selected rows of k and v, online softmax; the backward stores dq and
  atomically adds dk and dv into the selected keys' rows. Tested in the Pallas interpreter on CPU,
  lowered for CUDA and compiled to PTX for a compile-only H100 from a CPU machine; **never run on
  a GPU** (none was available): its speed and block sizes are unmeasured.
* ``"auto"`` — ``"pallas"`` when compiling for GPUs (:func:`~moefast.kernels.platform.target_platform`:
  the mesh's platform, not the host's), ``"reference"`` elsewhere.

A dense boolean mask built from the indices (``mask[b, t, s] = s in indices[b, t]``) and an
ordinary masked softmax give the same outputs (tested): the gather form is that attention without
the [T, S] matrix.
"""

from __future__ import annotations

from typing import Literal

import jax

from ..platform import resolve_impl
from .ops import sparse_attention_pallas
from .pallas import FORWARD_NAME
from .pallas_bwd import BACKWARD_NAME
from .reference import sparse_attention_reference, validate

__all__ = ["BACKWARD_NAME", "FORWARD_NAME", "IMPLS", "resolve", "sparse_attention", "sparse_attention_pallas",
           "sparse_attention_reference", "validate"]

IMPLS = ("reference", "pallas", "auto")
Impl = Literal["reference", "pallas", "auto"]


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`): ``"auto"`` is ``"pallas"`` on GPU and
    ``"reference"`` elsewhere.

    Raises:
      ValueError: an unknown ``impl``.
    """
    return resolve_impl(impl, IMPLS, "reference", "sparse attention", platform)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, indices: jax.Array, *, scale: float,
                     impl: Impl = "auto", return_lse: bool = False, return_max: bool = False,
                     interpret: bool | None = None):
    """Attention of each query to its K selected keys (contract: the module docstring).

    Args:
      q: [B, T, H, D] queries; k: [B, S, D] keys, v: [B, S, Dv] values (one per token, shared by
        the heads); q, k, v of one float dtype.
      indices: [B, T, K] int keys of each query's row, -1 unused; valid ones distinct per query.
      scale: logit scale (dimensionless), a static float.
      impl: one of :data:`IMPLS`.
      return_lse: also return the [B, T, H] float32 natural log-sum-exp (differentiable).
      return_max: also return the [B, T, H] float32 largest logit ``q·k·scale`` of each query's
        selected keys (-inf where none), not differentiated (QK-clip, the logit metrics).
      interpret: ``"pallas"`` only: the Pallas interpreter; ``None``: when compiling for CPU.

    Returns:
      out [B, T, H, Dv] in q's dtype, then the log-sum-exp when ``return_lse``, then the largest
      logits when ``return_max`` (a tuple when either is asked for).

    Raises:
      ValueError: at trace time: bad shapes or dtypes, a traced ``scale`` (:func:`.reference.validate`),
        an unknown ``impl``.
    """
    validate(q, k, v, indices, scale)
    if resolve(impl) == "pallas":
        return sparse_attention_pallas(q, k, v, indices, scale=scale, return_lse=return_lse, return_max=return_max,
                                       interpret=interpret)
    return sparse_attention_reference(q, k, v, indices, scale=scale, return_lse=return_lse, return_max=return_max)
