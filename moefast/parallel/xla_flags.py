"""XLA flags for overlapping collectives with compute on GPU (``overlap.xla_flags``).

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend, and aborts the process on a flag
name it does not know. :func:`configure` therefore runs before JAX starts (``moefast train`` calls
it right after reading the config; the :class:`~moefast.train.Trainer` calls it too, for scripts
and notebooks) and adds :data:`GPU_FLAGS` only when JAX may start a GPU backend, never replacing a
flag that ``XLA_FLAGS`` already names. The names are those of jaxlib 0.10.2 and 0.11.2; a test
starts XLA with all of them to check that the installed jaxlib accepts them.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys

__all__ = ["GPU_FLAGS", "compile_options", "configure", "gpu_possible", "merge_flags"]

_COMBINE_BYTES = str(128 * 2**20)  # combine small collectives up to 128 MiB (not tuned by measurement)

GPU_FLAGS: dict[str, str] = {
    # Schedule collectives asynchronously and move them so that compute hides them.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Pipeline FSDP's all-gathers / reduce-scatters and the gradient all-reduce across loop
    # iterations (scan over layers, gradient accumulation), and double-buffer while loops.
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # Collectives on their own high-priority stream, so compute kernels do not delay them.
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": _COMBINE_BYTES,
    "xla_gpu_all_gather_combine_threshold_bytes": _COMBINE_BYTES,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": _COMBINE_BYTES,
}

_applied: list[str] | None = None


def gpu_possible() -> bool:
    """Whether JAX may start a GPU backend in this process: a CUDA or ROCm PJRT plugin is
    installed and ``JAX_PLATFORMS`` (if set) allows it."""
    platforms = {p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if platforms and not platforms & {"cuda", "gpu", "rocm"}:
        return False
    names = {ep.name.lower() for ep in importlib.metadata.entry_points(group="jax_plugins")}
    return any(n.startswith(("xla_cuda", "xla_rocm", "cuda", "rocm")) for n in names)


def merge_flags(existing: str, flags: dict[str, str]) -> tuple[str, list[str]]:
    """``existing`` (an ``XLA_FLAGS`` value) plus each of ``flags`` it does not set already.

    Returns:
      ``(new XLA_FLAGS value, the flags added as "--name=value")``.
    """
    present = set(re.findall(r"--([A-Za-z0-9_]+)", existing))
    added = [f"--{k}={v}" for k, v in flags.items() if k not in present]
    return " ".join([existing.strip(), *added]).strip(), added


PARALLEL_COLLECTIVES = "xla_gpu_experimental_parallel_collective_overlap_limit"
COLLECTIVE_CSE = "xla_gpu_experimental_collective_cse_distance_threshold"
# Identical collectives merged by XLA's ScheduleAwareCollectiveOpsCSE when their users are at most
# this many instructions apart: far enough for a layer's sequence slices, which gather the same
# weights once each (a layer body holds a few thousand instructions)
COLLECTIVE_CSE_DISTANCE = 1_000_000


def compile_options(enabled: bool, platform: str, collectives_in_flight: int = 1,
                    dedupe_collectives: bool = False) -> dict[str, bool | int | str]:
    """:data:`GPU_FLAGS` as per-compilation options (``Lowered.compile(options)``) for a step compiled
    for ``platform`` (the mesh's, :func:`moefast.parallel.platform`): the flags then apply to a
    GPU step also when ``XLA_FLAGS`` could not carry them (JAX already started, or compiling for
    GPUs from a CPU host). Flags that ``XLA_FLAGS`` names keep the user's value.

    Args:
      enabled: ``overlap.xla_flags``.
      platform: ``"gpu"`` gets the flags; any other platform none.
      collectives_in_flight: ``overlap.collectives_in_flight``: above 1, XLA's scheduler may keep
        that many asynchronous collectives in flight at once
        (``xla_gpu_experimental_parallel_collective_overlap_limit``; XLA's default 1 runs them one
        after another), also with ``enabled`` False.
      dedupe_collectives: merge identical collectives (XLA's ``ScheduleAwareCollectiveOpsCSE``,
        ``xla_gpu_experimental_collective_cse_distance_threshold``; off by default in XLA): with
        ``model.sequence_slices`` > 1 every slice gathers a layer's weights, the same all-gather
        each time, which XLA's ordinary CSE never merges (collectives have side effects); also
        with ``enabled`` False.
    """
    if platform != "gpu":
        return {}
    present = set(re.findall(r"--([A-Za-z0-9_]+)", os.environ.get("XLA_FLAGS", "")))
    typed = lambda v: v == "true" if v in ("true", "false") else int(v) if v.isdigit() else v
    out = {k: typed(v) for k, v in GPU_FLAGS.items() if k not in present} if enabled else {}
    if collectives_in_flight > 1 and PARALLEL_COLLECTIVES not in present:
        out[PARALLEL_COLLECTIVES] = collectives_in_flight
    if dedupe_collectives and COLLECTIVE_CSE not in present:
        out[COLLECTIVE_CSE] = COLLECTIVE_CSE_DISTANCE
    return out


def _jax_started() -> bool:
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and xb.backends_are_initialized())


def configure(enabled: bool = True, *, log=print) -> list[str]:
    """Adds :data:`GPU_FLAGS` to ``XLA_FLAGS`` once per process, where JAX may use a GPU.

    Args:
      enabled: ``overlap.xla_flags``; False adds nothing.
      log: where the one line saying which flags were added goes.

    Returns:
      The flags added (``"--name=value"``); empty on CPU/TPU-only hosts, when disabled, when every
      flag was set by the user, or when JAX's backend had already started (then ``log`` gets a note).
    """
    global _applied
    if _applied is not None:
        return _applied
    if not enabled or not gpu_possible():
        _applied = []
        return _applied
    new, added = merge_flags(os.environ.get("XLA_FLAGS", ""), GPU_FLAGS)
    if added and _jax_started():
        log("note: JAX started before moefast could add its GPU collective-overlap flags (overlap.xla_flags); "
            "set them in XLA_FLAGS before starting Python, or construct the Trainer before running JAX code")
        _applied = []
        return _applied
    if added:
        os.environ["XLA_FLAGS"] = new
        log(f"XLA flags added for overlap on GPU (overlap.xla_flags=false turns them off): {' '.join(added)}")
    _applied = added
    return _applied
