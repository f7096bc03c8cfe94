"""Triton kernel for the routing operation: the same one pass over token blocks as :mod:`.pallas`.

Dimension letters: T tokens, E experts, K top_k, B token blocks, Tb tokens per block; Ep >= E and
Kp >= K are the expert and choice axes padded to powers of two (Triton block shapes).

One program per token block computes, in float32 whatever the logits' dtype, exactly what the
Pallas kernel does (softmax or sigmoid scores, the group limit and the gates' scaling factor of
:class:`.reference.Scoring` included, as constexprs) (see :mod:`.pallas` for the conventions; as there, NaN logits are not supported:
a NaN row's choices may differ from the reference's, an expert index may be E, and rows with
infinite logits give a NaN ``z_sum`` where the reference gives inf): the softmax statistics, the top-k of
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

PTX version: Triton writes PTX of the newest version its own bundled ``ptxas-blackwell`` accepts
(Triton 3.9 bundles CUDA 13.4's: PTX 9.4 for compute capability >= 9.0), but under JAX the PTX is
assembled by the CUDA toolkit jaxlib runs with (``jax[cuda12]``: the ``nvidia-cuda-nvcc-cu12``
wheel's ptxas 12.9, which rejects ``.version 9.4``). :func:`routing_blocks` therefore points
Triton's ``ptxas_blackwell`` knob at that toolkit's ptxas (:func:`cuda_ptxas`) when it is older
than Triton's own, so that Triton emits PTX the toolkit assembles (8.8 for 12.9), unless the user
set ``TRITON_PTXAS_BLACKWELL_PATH``. Triton's knobs write through to the environment: after a call,
this process and the processes it starts have ``TRITON_PTXAS_BLACKWELL_PATH`` set to that ptxas. :func:`compile_for` compiles the kernel for a GPU
architecture without a GPU (PTX and cubin), which is how the tests check that it assembles.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import sys

from .pallas import BlockOutputs, check_block_tokens, next_power_of_2
from .reference import Scoring

__all__ = ["available", "compile_for", "cuda_ptxas", "ptxas_version", "routing_blocks", "routing_blocks_torch",
           "scoring_constexprs"]


def available(platform: str | None = None) -> str | None:
    """``None`` when the JAX launcher can run on ``platform`` (default: the platform being compiled
    for, :func:`~moefast.kernels.platform.target_platform`), else why not (a sentence)."""
    from ..platform import target_platform

    platform = platform or target_platform()
    if platform != "gpu":
        return (f"impl='triton' runs on a GPU only (compiling for: {platform}); its kernel is "
                "checked on CPU under the Triton interpreter by the tests")
    try:
        import jax_triton  # noqa: F401
    except ModuleNotFoundError:
        return ("impl='triton' needs jax-triton: pip install 'jax-triton>=0.3' into the environment whose "
                "CUDA jaxlib runs this GPU (the [gpu] extra; not with constraints.txt, which pins the CPU jax)")
    except Exception as e:  # installed but broken (e.g. built for another jaxlib)
        return f"impl='triton': jax-triton is installed but failed to import ({type(e).__name__}: {e})"
    return None


def cuda_ptxas(search: list[str] | None = None) -> str | None:
    """The ptxas of the CUDA toolkit JAX runs with, or ``None``: the ``nvidia-cuda-nvcc-cu1x`` wheel's
    ``nvidia/cuda_nvcc/bin/ptxas`` under ``search`` (default ``sys.path``; what ``jax[cuda12]``
    installs and XLA uses), else ``$CUDA_HOME/bin/ptxas``, else ``ptxas`` on ``PATH``."""
    for root in (sys.path if search is None else search):
        hits = sorted(glob.glob(os.path.join(root or ".", "nvidia", "cuda_nvcc", "bin", "ptxas")))
        if hits:
            return hits[0]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.isfile(os.path.join(home, "bin", "ptxas")):
        return os.path.join(home, "bin", "ptxas")
    return shutil.which("ptxas")


@functools.lru_cache(maxsize=8)
def ptxas_version(path: str) -> tuple[int, int]:
    """``(major, minor)`` CUDA release of the ptxas at ``path`` (``ptxas --version``)."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"{path} --version printed no CUDA release: {out.strip()[:200]}")
    return int(m.group(1)), int(m.group(2))


def _assembler_for_jax(ptxas: str | None = None) -> str | None:
    """The ptxas Triton should take its PTX version from so that JAX's toolkit assembles the PTX.

    ``ptxas`` given: that one (the caller names the assembler, whatever the environment says).
    Else the toolkit's (:func:`cuda_ptxas`) when it is older than Triton's bundled
    ``ptxas-blackwell``, and ``None`` when Triton's own is fine, there is no toolkit ptxas, or the
    user chose one with ``TRITON_PTXAS_BLACKWELL_PATH``."""
    if ptxas is not None:
        return ptxas
    if os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"):
        return None
    ptxas = cuda_ptxas()
    if ptxas is None:
        return None
    import triton

    return ptxas if ptxas_version(ptxas) < ptxas_version(triton.knobs.nvidia.ptxas_blackwell.path) else None


def compile_for(arch: int = 90, *, ptxas: str | None = None, top_k: int = 2, num_experts: int = 8,
                block_tokens: int = 128, logits_dtype: str = "bf16", num_warps: int = 4,
                scoring: Scoring = Scoring()) -> tuple[str, bytes]:
    """Compiles the kernel with Triton for compute capability ``arch`` (no GPU needed) with the PTX
    version JAX's toolkit accepts (module docstring).

    Args:
      arch: compute capability x 10 (90: H100/H200).
      ptxas: the ptxas to assemble with, whose CUDA release sets the PTX version (``None``: the
        toolkit's, :func:`cuda_ptxas`, when older than Triton's own and ``TRITON_PTXAS_BLACKWELL_PATH``
        is unset; else Triton's choice).
      top_k, num_experts, block_tokens, logits_dtype, num_warps, scoring: the kernel's
        specialisation (:class:`.reference.Scoring`).

    Returns:
      ``(ptx, cubin)``: the PTX text and the cubin that ptxas assembled from it.

    Raises:
      triton.runtime.errors.PTXASError: ptxas rejected the PTX.
    """
    from ._triton_kernel import routing_kernel

    check_block_tokens(block_tokens)
    scoring.check(num_experts, top_k)
    ep, kp = next_power_of_2(num_experts), next_power_of_2(top_k)
    types = [f"*{logits_dtype}", "*i32", "*fp32", "i32", "i32", "*i32", "*fp32", "*i32", "*i32", "*fp32", "*fp32"]
    names = ["logits_ptr", "mask_ptr", "bias_ptr", "num_tokens", "num_experts", "index_ptr", "gates_ptr", "rank_ptr",
             "counts_ptr", "prob_sum_ptr", "z_ptr"]
    consts = {"TOP_K": top_k, "TB": block_tokens, "EP": ep, "KP": kp, **scoring_constexprs(scoring, num_experts)}
    kernel = compile_kernel(routing_kernel, dict(zip(names, types)), consts, arch=arch, ptxas=ptxas,
                            options={"num_warps": num_warps})
    return kernel.asm["ptx"], kernel.asm["cubin"]


def compile_kernel(fn, arg_types: dict, consts: dict, *, arch: int = 90, ptxas: str | None = None,
                   options: dict | None = None):
    """Triton's compiled kernel of the undecorated ``fn`` for compute capability ``arch`` (no GPU
    needed): ``arg_types`` its arguments' Triton types (``"*fp32"``, ``"i32"``, ...), ``consts`` its
    constexprs, with the PTX version of ``ptxas`` (:func:`compile_for`'s)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**arg_types, **{k: "constexpr" for k in consts}}
    src = ASTSource(triton.jit(fn), signature, constexprs=consts)
    with triton.knobs.nvidia.scope():
        chosen = _assembler_for_jax(ptxas)
        if chosen:
            triton.knobs.nvidia.ptxas_blackwell = chosen
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options or {})


# Outputs of the kernel, in its parameter order: name, shape from (T, K, B, E), dtype.
_OUTPUTS = (("index", "tk", "int32"), ("gates", "tk", "float32"), ("rank", "tk", "int32"),
            ("counts", "bke", "int32"), ("prob_sum", "be", "float32"), ("z", "b", "float32"))


def _output_shapes(t: int, e: int, top_k: int, nb: int) -> list[tuple[str, tuple[int, ...], str]]:
    dims = {"tk": (t, top_k), "bke": (nb, top_k, e), "be": (nb, e), "b": (nb,)}
    return [(name, dims[kind], dtype) for name, kind, dtype in _OUTPUTS]


def _check(t: int, e: int, top_k: int, mask_shape, bias_shape) -> None:
    """The launchers' argument checks (the kernel reads out of bounds on bad sizes)."""
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    if tuple(mask_shape) != (t,) or tuple(bias_shape) != (e,):
        raise ValueError(f"mask must be [{t}] and bias [{e}] for logits [{t}, {e}]; got {tuple(mask_shape)} and "
                         f"{tuple(bias_shape)}")
    if t * e >= 2**31:
        raise ValueError(f"tokens x experts = {t * e} needs 64-bit offsets; the kernel indexes with int32 "
                         "(route fewer tokens per call)")


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


def scoring_constexprs(scoring: Scoring, num_experts: int) -> dict:
    """The kernel's constexprs for ``scoring`` (NUM_GROUPS 1 when the group limit removes nothing)."""
    g = scoring.num_groups if scoring.grouped else 1
    return dict(SIGMOID=scoring.score_func == "sigmoid", NUM_GROUPS=g, TOPK_GROUPS=scoring.topk_groups if g > 1 else 1,
                GROUP_SIZE=num_experts // g, SCALE=float(scoring.scale))


def _sizes(t: int, e: int, top_k: int, block_tokens: int) -> tuple[int, int, int]:
    check_block_tokens(block_tokens)
    return -(-t // block_tokens), next_power_of_2(e), next_power_of_2(top_k)


def routing_blocks_torch(logits, mask, bias, *, top_k: int, block_tokens: int = 128,
                         scoring: Scoring = Scoring()) -> BlockOutputs:
    """Runs the Triton kernel on torch tensors: CUDA tensors compiled, or CPU tensors in the Triton
    interpreter (``TRITON_INTERPRET=1`` set before triton is imported, as the tests' conftest does).

    Args:
      logits: torch [T, E] float32 or bfloat16, contiguous.
      mask: torch [T] bool or int, False/0 for padding.
      bias: torch [E] float32 selection-only bias.
      top_k: K in [1, E].
      block_tokens: Tb, a positive power of two.
      scoring: score function, group limit and gate scaling (:class:`.reference.Scoring`).

    Returns:
      :class:`.pallas.BlockOutputs` of numpy arrays (B = ceil(T / Tb) blocks).

    Raises:
      ValueError: ``block_tokens`` is not a positive power of two, or ``scoring`` does not fit E
        and K (:meth:`.reference.Scoring.check`).
      RuntimeError: CPU tensors without the interpreter.
    """
    import torch

    if logits.device.type == "cpu" and not interpreting():
        raise RuntimeError("Triton kernels run on CPU tensors only in the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")

    t, e = logits.shape
    _check(t, e, top_k, mask.shape, bias.shape)
    scoring.check(e, top_k)
    nb, ep, kp = _sizes(t, e, top_k, block_tokens)
    dev = logits.device
    out = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
           for name, shape, dtype in _output_shapes(t, e, top_k, nb)}
    # the order of jax-triton's triton_call (see routing_blocks): inputs, then the outputs
    _kernel()[(nb,)](logits.contiguous(), mask.to(torch.int32).contiguous(), bias.to(torch.float32).contiguous(),
                     t, e, *out.values(), TOP_K=top_k, TB=block_tokens, EP=ep, KP=kp,
                     **scoring_constexprs(scoring, e))
    n = {k: (v.float() if v.dtype == torch.bfloat16 else v).cpu().numpy() for k, v in out.items()}
    return BlockOutputs(expert_index=n["index"], gates=n["gates"], block_rank=n["rank"], counts=n["counts"],
                        prob_sum=n["prob_sum"], z_sum=n["z"])


def routing_blocks(logits, mask, bias, *, top_k: int, block_tokens: int = 128, num_warps: int | None = None,
                   scoring: Scoring = Scoring()) -> BlockOutputs:
    """Runs the Triton kernel from JAX on a GPU (``jax_triton.triton_call``).

    Args:
      logits: [T, E] router logits, float32 or bfloat16 (read once, math in float32).
      mask: [T] bool, False for padding.
      bias: [E] float32 selection-only bias.
      top_k: K in [1, E]; block_tokens: Tb, a positive power of two; num_warps: Triton warps
        (``None``: 4 for small blocks, else 8); scoring: :class:`.reference.Scoring`.

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
    import triton

    chosen = _assembler_for_jax()
    if chosen:  # jax-triton compiles at lowering time, so the knob stays set; Triton writes it through to
        # os.environ (TRITON_PTXAS_BLACKWELL_PATH), so processes started later inherit it
        triton.knobs.nvidia.ptxas_blackwell = chosen
    t, e = logits.shape
    _check(t, e, top_k, mask.shape, bias.shape)
    nb, ep, kp = _sizes(t, e, top_k, block_tokens)
    if num_warps is None:
        num_warps = 4 if block_tokens * ep <= 8192 else 8
    shapes = [jax.ShapeDtypeStruct(shape, getattr(jnp, dtype)) for _, shape, dtype in _output_shapes(t, e, top_k, nb)]
    kw = dict(kernel=_kernel(), grid=(nb,), num_warps=num_warps, TOP_K=top_k, TB=block_tokens, EP=ep, KP=kp,
              **scoring_constexprs(scoring, e))
    # jax-triton passes the array inputs, then the scalars (static: Python ints), in this order, then
    # one pointer per output: the kernel's parameter order (kernels/routing/_triton_kernel.py)
    args = (logits, mask.astype(jnp.int32), bias.astype(jnp.float32), int(t), int(e))
    import inspect

    # jax-triton >= 0.4 names the output types out_type; older releases out_shape
    name = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
    outs = jt.triton_call(*args, **{name: shapes}, **kw)
    return BlockOutputs(*outs)
