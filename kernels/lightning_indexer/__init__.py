"""Lightning-indexer scores (DeepSeek Sparse Attention's indexer, DeepSeek-V3.2-Exp sec. 2.1, eq. 1).

``lightning_indexer_scores(q, w, k, *, scale, impl="auto", interpret=None)``: how much each query
wants each key of its row, ``scores[b, t, s] = sum_h w[b, t, h] · relu(scale · q[b, t, h] · k[b, s])``;
the caller keeps each query's top-k keys (:mod:`~moefast.kernels.sparse_attention` attends to them). DeepGEMM's
``fp8_mqa_logits`` kernel computes the same in FP8.

Dimension letters: B batch, T queries, S keys (tokens of the row), Hi indexer heads, Di indexer
head width.

* q [B, T, Hi, Di]: the indexer's queries (float32, bfloat16 or float16).
* w [B, T, Hi] float32: each head's weight per query, any sign (DeepSeek-V3.2: the weights
  projection of the token times Hi^-0.5).
* k [B, S, Di] of q's dtype: one indexer key per token, shared by the heads.
* scale: the logit scale (a static float; DeepSeek-V3.2: Di^-0.5), either sign.
* scores [B, T, S] float32. DeepSeek-V3.2: Hi = 64, Di = 128, T a block of 256 queries (or the
  row), S up to 131072. Any T, S, Di >= 1 (nothing needs to be a multiple of a block).

**No gradient.** The result carries none, whatever ``impl``: gradients are stopped at q, w and k
(``jax.lax.stop_gradient``) and at the result, so ``jax.grad`` through it gives zeros (the
indexer learns from its own loss on the reference's scores; a top-k selection has no gradient
anyway). A caller that needs a gradient calls :func:`lightning_indexer_scores_reference`.

Memory: the plain XLA form (the reference) materialises the float32 [B, T, Hi, S] logits (2 GiB
for one row's block of 256 queries at S = 32768); the kernel keeps the Hi axis in registers and
writes only the [B, T, S] scores. FLOPs: 2·B·T·S·Hi·Di either way.

Implementations (``impl``), one contract:

* ``"reference"`` — :mod:`.reference`: two jnp einsums at ``Precision.HIGHEST`` in float32, the
  [B, T, Hi, S] logits in memory: the oracle.
* ``"pallas"`` — :mod:`.pallas`: a Pallas Triton kernel, one program per block of queries and
  keys looping over the heads (Hopper ``wgmma`` products, a float32 accumulator in registers).
  Tested in the Pallas interpreter on CPU, lowered for CUDA and compiled to PTX for a compile-only
  H100 from a CPU machine; **never run on a GPU** (none was available): its speed and block sizes
  are unmeasured.
* ``"auto"`` — ``"pallas"`` when compiling for GPUs (:func:`~moefast.kernels.platform.target_platform`:
  the mesh's platform, not the host's), ``"reference"`` elsewhere.
"""

from __future__ import annotations

from typing import Literal

import jax

from ..platform import resolve_impl
from .pallas import SCORES_NAME, lightning_indexer_scores_pallas
from .reference import lightning_indexer_scores_reference, validate

__all__ = ["IMPLS", "SCORES_NAME", "lightning_indexer_scores", "lightning_indexer_scores_pallas",
           "lightning_indexer_scores_reference", "resolve", "validate"]

IMPLS = ("reference", "pallas", "auto")
Impl = Literal["reference", "pallas", "auto"]


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`): ``"auto"`` is ``"pallas"`` on GPU and
    ``"reference"`` elsewhere.

    Raises:
      ValueError: an unknown ``impl``.
    """
    return resolve_impl(impl, IMPLS, "reference", "lightning indexer", platform)


def lightning_indexer_scores(q: jax.Array, w: jax.Array, k: jax.Array, *, scale: float, impl: Impl = "auto",
                             interpret: bool | None = None) -> jax.Array:
    """Each query's score of each key of its row (contract: the module docstring).

    Args:
      q: [B, T, Hi, Di] indexer queries; k: [B, S, Di] indexer keys (one per token, shared by the
        heads); one dtype (float32, bfloat16 or float16).
      w: float32 [B, T, Hi] each head's weight per query.
      scale: logit scale (dimensionless), a static float.
      impl: one of :data:`IMPLS`.
      interpret: ``"pallas"`` only: the Pallas interpreter; ``None``: when compiling for CPU.

    Returns:
      float32 [B, T, S] ``sum_h w · relu(scale · q_h · k)``, without gradient (zero under
      ``jax.grad``; :func:`lightning_indexer_scores_reference` for one).

    Raises:
      ValueError: at trace time: bad shapes or dtypes, a traced ``scale`` (:func:`.reference.validate`),
        an unknown ``impl``.
    """
    validate(q, w, k, scale)
    # stopped at the inputs, not only the result: JAX would otherwise trace the Pallas kernel's JVP
    # (which fails) before reaching a stop on its output
    q, w, k = (jax.lax.stop_gradient(x) for x in (q, w, k))
    if resolve(impl) == "pallas":
        scores = lightning_indexer_scores_pallas(q, w, k, scale=scale, interpret=interpret)
    else:
        scores = lightning_indexer_scores_reference(q, w, k, scale=scale)
    return jax.lax.stop_gradient(scores)
