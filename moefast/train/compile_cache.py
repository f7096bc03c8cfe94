"""XLA's persistent compilation cache (``cache.compile_dir``).

A restarted run whose programs are unchanged loads their executables from disk instead of running
XLA's optimisation passes again; tracing and lowering still run. JAX only caches programs that took
at least ``jax_persistent_cache_min_compile_time_secs`` (default 1 s) to compile, which leaves most
CPU programs out, so moefast lowers that threshold to 0.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as _cc

__all__ = ["configure_compilation_cache", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/moefast/xla``, or ``~/.cache/moefast/xla`` (per user)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "moefast" / "xla"


def configure_compilation_cache(compile_dir: str | os.PathLike | None) -> Path | None:
    """Points JAX's persistent compilation cache at ``compile_dir`` (or turns it off).

    Safe to call more than once per process (tests, notebooks): a change of directory or of the
    on/off state resets JAX's cache object so the next compilation uses the new setting.

    Args:
      compile_dir: ``"auto"`` (:func:`default_cache_dir`), a directory (created if missing; ``~``
        is expanded), or ``None`` (off).

    Returns:
      The directory in use, or ``None`` when off.

    Raises:
      OSError: the directory cannot be created (the message names it; pass ``cache.compile_dir=null``
        to run without a cache).
    """
    if compile_dir is None:
        if jax.config.jax_enable_compilation_cache:
            jax.config.update("jax_enable_compilation_cache", False)
            _cc.reset_cache()
        return None
    path = default_cache_dir() if str(compile_dir) == "auto" else Path(compile_dir).expanduser()
    path = path.absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cache.compile_dir: cannot create {path} ({e.strerror}); choose another directory "
                      "or turn the compilation cache off with cache.compile_dir=null") from None
    changed = (jax.config.jax_compilation_cache_dir != str(path)
               or not jax.config.jax_enable_compilation_cache)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if changed:
        _cc.reset_cache()
    return path
