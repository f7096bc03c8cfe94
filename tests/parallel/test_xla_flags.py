"""GPU collective-overlap XLA flags: accepted by the installed jaxlib, never override the user's."""

import os
import subprocess
import sys

import pytest

from moefast.parallel import xla_flags


def _start_xla(flags: str) -> subprocess.CompletedProcess:
    """A fresh CPU process that starts XLA with ``XLA_FLAGS=flags`` and compiles one program."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(2)).sum())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_every_gpu_flag_is_known_to_the_installed_jaxlib():
    """XLA aborts the process on an unknown flag name, so an unknown name here would kill every GPU
    run at start. The CPU jaxlib parses the same flag table (GPU flags included)."""
    _, added = xla_flags.merge_flags("", xla_flags.GPU_FLAGS)
    r = _start_xla(" ".join(added))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "4.0"
    bogus = _start_xla("--xla_gpu_this_flag_does_not_exist=true")  # the check can fail
    assert bogus.returncode != 0 and "xla_gpu_this_flag_does_not_exist" in bogus.stderr


def test_user_flags_are_never_overridden():
    new, added = xla_flags.merge_flags("--xla_gpu_enable_latency_hiding_scheduler=false --foo_bar=1",
                                       xla_flags.GPU_FLAGS)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in new
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in new
    assert len(added) == len(xla_flags.GPU_FLAGS) - 1 and new.startswith("--xla_gpu_enable_latency_hiding_scheduler=false")


@pytest.mark.parametrize("platforms,expected", [("cpu", False), ("", None)])
def test_no_flags_without_a_gpu(monkeypatch, platforms, expected):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    if expected is not None:
        assert xla_flags.gpu_possible() is expected
    else:  # this CI machine has no CUDA/ROCm plugin installed
        assert xla_flags.gpu_possible() is False
    monkeypatch.setattr(xla_flags, "_applied", None)
    before = os.environ.get("XLA_FLAGS")
    assert xla_flags.configure(True, log=lambda s: pytest.fail(s)) == []
    assert os.environ.get("XLA_FLAGS") == before


def test_flags_are_added_where_a_gpu_may_start(monkeypatch):
    monkeypatch.setattr(xla_flags, "gpu_possible", lambda: True)
    monkeypatch.setattr(xla_flags, "_jax_started", lambda: False)
    monkeypatch.setattr(xla_flags, "_applied", None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pipelined_all_gather=false")
    lines = []
    added = xla_flags.configure(True, log=lines.append)
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in added and len(added) == len(xla_flags.GPU_FLAGS) - 1
    assert os.environ["XLA_FLAGS"].startswith("--xla_gpu_enable_pipelined_all_gather=false ")
    assert len(lines) == 1 and "overlap.xla_flags=false" in lines[0]
    monkeypatch.setattr(xla_flags, "_applied", None)
    assert xla_flags.configure(False) == []  # switched off
    monkeypatch.setattr(xla_flags, "_applied", None)
    monkeypatch.setattr(xla_flags, "_jax_started", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "")
    lines.clear()
    assert xla_flags.configure(True, log=lines.append) == [] and "note:" in lines[0]
