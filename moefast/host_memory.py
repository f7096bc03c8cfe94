"""Host memory that stays mapped from one step to the next (glibc ``malloc`` settings).

XLA:CPU allocates a compiled step's temporaries (≈490 MiB for the tiny config) with ``malloc`` and
frees them when the step ends. With glibc's defaults those buffers live in per-thread arenas and
large ``mmap`` chunks that are handed back to the kernel on ``free``, so every step re-faults
≈165,000 fresh zero-filled pages and spends ≈25 % of its CPU time in the kernel. Three ``mallopt``
settings keep freed memory in the process for the next step:

* ``M_ARENA_MAX = 1``: one arena (the ``brk`` heap) for every thread, so XLA's worker threads do not
  allocate from per-thread ``mmap`` heaps that glibc shrinks on ``free``;
* ``M_MMAP_THRESHOLD = 1 GiB``: buffers below 1 GiB come from that heap instead of their own
  ``mmap``, which ``free`` would ``munmap``;
* ``M_TRIM_THRESHOLD = 2 GiB - 1``: the heap is not trimmed back to the kernel until more than that
  is free at its top.

Measured on the 2-core CPU machine (bare compiled tiny-config step, one process each, see
``docs/perf.md``): 0 page faults per step instead of ≈165,000 and the step ≈1.3× faster — as fast
as preloading tcmalloc, without a system package or re-executing the process. Each setting alone,
or any two of them, left most of the faults.

The settings change the whole process, so nothing applies them on import: the ``moefast`` command
(``moefast train``, ``eval``, ``bench ...``) calls :func:`configure` before JAX starts, and a script
or notebook that uses the Python API opts in the same way, before it runs any JAX computation::

    import moefast
    moefast.host_memory.configure()  # first: XLA's CPU threads pick their arena on their first malloc
    summary = moefast.Trainer(moefast.load_config(), run_dir="runs/demo").run()

Called after JAX's CPU client has started its threads, it changes nothing and returns
``"too-late"``. Set ``MOEFAST_HOST_MALLOC=system`` in the environment to keep glibc's defaults (to
measure against them; ``moefast bench malloc`` runs ``moefast train`` both ways). They are applied
only on glibc (Linux) when JAX will run on the CPU (no accelerator plugin installed, or
``JAX_PLATFORMS=cpu``); on a GPU or TPU host the step's temporaries live in device memory and the
host allocator is left alone.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys

__all__ = ["ENV_VAR", "MALLOPT_SETTINGS", "configure", "status"]

ENV_VAR = "MOEFAST_HOST_MALLOC"
MODES = ("keep", "system")

# glibc's mallopt parameter numbers (malloc.h) and the values moefast sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MALLOPT_SETTINGS = {"M_ARENA_MAX": (_M_ARENA_MAX, 1),
                    "M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, 1 << 30),
                    "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, (1 << 31) - 1)}

_status: str | None = None


def _jax_started() -> bool:
    """Whether a JAX backend (and so XLA's thread pool) exists already in this process."""
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and xb.backends_are_initialized())


def _accelerator_possible() -> bool:
    """Whether JAX may pick a non-CPU backend here (an installed PJRT plugin or libtpu), unless
    ``JAX_PLATFORMS`` restricts it to the CPU."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and set(platforms.lower().split(",")) <= {"cpu"}:
        return False
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    return any(importlib.util.find_spec(m) is not None for m in ("jax_plugins", "libtpu"))


def configure(mode: str | None = None) -> str:
    """Applies the host ``malloc`` settings of this module once per process.

    Args:
      mode: ``"keep"`` (keep freed memory mapped) or ``"system"`` (glibc's defaults); ``None``
        reads ``$MOEFAST_HOST_MALLOC`` (default ``"keep"``).

    Returns:
      What happened: ``"keep"`` (settings applied), ``"system"`` (asked for the defaults),
      ``"not-glibc"``, ``"accelerator"`` (JAX may run on a GPU/TPU: left alone) or ``"too-late"``
      (JAX's CPU backend had already started: settings not applied, see the module docstring).
      Later calls return the first call's result (after validating ``mode``).

    Raises:
      ValueError: an unknown mode (the message lists the valid ones).
    """
    global _status
    mode = (os.environ.get(ENV_VAR) or "keep") if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r} is not one of {MODES}: 'keep' keeps freed host memory mapped "
                         "between steps (faster on CPU), 'system' leaves glibc's malloc defaults")
    if _status is not None:
        return _status
    if mode == "system":
        _status = "system"
    elif not sys.platform.startswith("linux"):
        _status = "not-glibc"
    elif _accelerator_possible():
        _status = "accelerator"
    elif _jax_started():
        _status = "too-late"
    else:
        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # raises AttributeError on musl and other C libraries
            ok = all(libc.mallopt(param, ctypes.c_int(value)) == 1 for param, value in MALLOPT_SETTINGS.values())
        except (OSError, AttributeError):
            ok = False
        _status = "keep" if ok else "not-glibc"
    return _status


def status() -> str | None:
    """The result of :func:`configure` in this process, or ``None`` before it ran."""
    return _status
