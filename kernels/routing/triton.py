"""Triton kernel for the routing operation: the same one pass over token blocks as :mod:`.pallas`.

Dimension letters: T tokens, E experts, K top_k, B token blocks, Tb tokens per block; Ep >= E and
Kp >= K are the expert and choice axes padded to powers of two (Triton block shapes).

One program per token block computes, in float32 whatever the logits' dtype, exactly what the
Pallas kernel does (see :mod:`.pallas` for the conventions): the softmax statistics, the top-k of
``logits + bias`` by K rounds of "max over the experts not yet taken, then the lowest expert index
reaching it" (ties to the lower index, as :func:`jax.lax.top_k`), the renormalised gates, per
(choice rank, expert) the block's counts and each assignment's rank within the block (an inclusive
``tl.cumsum`` over tokens of the one-hot assignments), and the block's partial ``prob_sum`` and
``z_sum``. :mod:`.ops` turns these into global GShard ranks and applies capacity, with the same
``jax.custom_vjp`` as the Pallas path.

Two launchers share the kernel:

* :func:`routing_blocks` (JAX, GPU): ``jax_triton.triton_call``; needs ``jax-triton`` (the
  ``[gpu]`` extra). Importing this module never needs it, nor ``triton``.
* :func:`routing_blocks_torch` (torch tensors): with ``TRITON_INTERPRET=1`` (set before triton is
  imported) the Triton interpreter runs it on CPU tensors, which is how the tests check the kernel
  itself without a GPU.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from .pallas import BlockOutputs, check_block_tokens, next_power_of_2

__all__ = ["available", "routing_blocks", "routing_blocks_torch"]


def available() -> str | None:
    """``None`` when the JAX launcher can run here, else why not (a sentence)."""
    try:
        import jax
        import jax_triton  # noqa: F401
    except ImportError:
        return "impl='triton' needs jax-triton (pip install -c constraints.txt -e '.[gpu]')"
    if jax.default_backend() != "gpu":
        return (f"impl='triton' runs on a GPU only (default backend: {jax.default_backend()}); its kernel is "
                "checked on CPU under the Triton interpreter by the tests")
    return None


@functools.lru_cache(maxsize=1)
def _kernel():
    """The ``triton.jit``-wrapped kernel (for the interpreter when ``TRITON_INTERPRET=1``)."""
    import triton

    from ._triton_kernel import routing_kernel

    return triton.jit(routing_kernel)


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter: ``TRITON_INTERPRET=1`` in the environment
    before triton was first imported (triton wraps its own library functions, e.g. ``tl.max``, for
    the interpreter at import: setting the variable later is not enough)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    import triton.language as tl

    return type(tl.max).__name__ == "InterpretedFunction"


def _sizes(t: int, e: int, top_k: int, block_tokens: int) -> tuple[int, int, int]:
    check_block_tokens(block_tokens)
    return -(-t // block_tokens), next_power_of_2(e), next_power_of_2(top_k)


def routing_blocks_torch(logits, mask, bias, *, top_k: int, block_tokens: int = 128) -> BlockOutputs:
    """Runs the Triton kernel on torch tensors: CUDA tensors compiled, or CPU tensors in the Triton
    interpreter (``TRITON_INTERPRET=1`` set before triton is imported, as the tests' conftest does).

    Args:
      logits: torch [T, E] float32 or bfloat16, contiguous.
      mask: torch [T] bool or int, False/0 for padding.
      bias: torch [E] float32 selection-only bias.
      top_k: K in [1, E].
      block_tokens: Tb, a positive power of two.

    Returns:
      :class:`.pallas.BlockOutputs` of numpy arrays (B = ceil(T / Tb) blocks).

    Raises:
      ValueError: ``block_tokens`` is not a positive power of two.
      RuntimeError: CPU tensors without the interpreter.
    """
    import torch

    if logits.device.type == "cpu" and not interpreting():
        raise RuntimeError("Triton kernels run on CPU tensors only in the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")

    t, e = logits.shape
    nb, ep, kp = _sizes(t, e, top_k, block_tokens)
    dev = logits.device
    out = dict(index=torch.empty((t, top_k), dtype=torch.int32, device=dev),
               gates=torch.empty((t, top_k), dtype=torch.float32, device=dev),
               rank=torch.empty((t, top_k), dtype=torch.int32, device=dev),
               counts=torch.empty((nb, top_k, e), dtype=torch.int32, device=dev),
               prob_sum=torch.empty((nb, e), dtype=torch.float32, device=dev),
               z=torch.empty((nb,), dtype=torch.float32, device=dev))
    _kernel()[(nb,)](logits.contiguous(), mask.to(torch.int32).contiguous(),
                              bias.to(torch.float32).contiguous(), out["index"], out["gates"], out["rank"],
                              out["counts"], out["prob_sum"], out["z"], t, e, TOP_K=top_k, TB=block_tokens, EP=ep,
                              KP=kp)
    n = {k: (v.float() if v.dtype == torch.bfloat16 else v).cpu().numpy() for k, v in out.items()}
    return BlockOutputs(expert_index=n["index"], gates=n["gates"], block_rank=n["rank"], counts=n["counts"],
                        prob_sum=n["prob_sum"], z_sum=n["z"])


def routing_blocks(logits, mask, bias, *, top_k: int, block_tokens: int = 128, num_warps: int | None = None
                   ) -> BlockOutputs:
    """Runs the Triton kernel from JAX on a GPU (``jax_triton.triton_call``).

    Args:
      logits: [T, E] router logits, float32 or bfloat16 (read once, math in float32).
      mask: [T] bool, False for padding.
      bias: [E] float32 selection-only bias.
      top_k: K in [1, E]; block_tokens: Tb, a positive power of two; num_warps: Triton warps
        (``None``: 4 for small blocks, else 8).

    Returns:
      :class:`.pallas.BlockOutputs` of jax arrays.

    Raises:
      RuntimeError: jax-triton is not installed or the backend is not a GPU (:func:`available`).
    """
    import jax
    import jax.numpy as jnp

    why = available()
    if why:
        raise RuntimeError(why)
    import jax_triton as jt

    t, e = logits.shape
    nb, ep, kp = _sizes(t, e, top_k, block_tokens)
    if num_warps is None:
        num_warps = 4 if block_tokens * ep <= 8192 else 8
    shapes = [jax.ShapeDtypeStruct((t, top_k), jnp.int32), jax.ShapeDtypeStruct((t, top_k), jnp.float32),
              jax.ShapeDtypeStruct((t, top_k), jnp.int32), jax.ShapeDtypeStruct((nb, top_k, e), jnp.int32),
              jax.ShapeDtypeStruct((nb, e), jnp.float32), jax.ShapeDtypeStruct((nb,), jnp.float32)]
    kw = dict(kernel=_kernel(), grid=(nb,), num_warps=num_warps, TOP_K=top_k, TB=block_tokens, EP=ep, KP=kp)
    args = (logits, mask.astype(jnp.int32), bias.astype(jnp.float32), np.int32(t), np.int32(e))
    import inspect

    # jax-triton >= 0.4 names the output types out_type; older releases out_shape
    name = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
    outs = jt.triton_call(*args, **{name: shapes}, **kw)
    return BlockOutputs(*outs)
