"""Causal attention over packed documents (segment ids) with grouped-query heads.

Query t of a row sees key s <= t of the same document (q [B, T, H, Hd], k and v [B, T, G, Hd],
segment_ids [B, T]). Two functions of one contract:

* :func:`.flash.flash_attention` — :mod:`.flash`: moefast's Pallas Triton flash-attention kernels (forward and backward),
  memory linear in T; queries may be a later slice of the keys' row (``q_offset``) and the
  log-sum-exp is a differentiable output. Compiled on GPU; the Pallas interpreter on CPU (tests only).
* :func:`.reference.attention_reference` — :mod:`.reference`: the full [T, T] matrix in float32 (the truth).

Callers that run on CPU keep their own XLA path (moefast's block-causal einsums); this package is
the GPU kernel and its reference.
"""

from __future__ import annotations

from .flash import KERNEL_NAME, flash_attention, kernel_name, padded_length, visited_pairs
from .reference import attention_reference, validate

__all__ = ["KERNEL_NAME", "attention_reference", "flash_attention", "kernel_name", "padded_length", "validate",
           "visited_pairs"]
