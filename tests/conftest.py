"""Test setup: 8 virtual CPU devices (set before JAX initialises) and strict rank promotion."""

import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))  # shared helpers such as moe_reference.py

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Triton kernels run in the Triton interpreter on CPU tensors; triton reads this when first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The persistent compilation cache (cache.compile_dir=auto) of this test session, shared by the
# in-process runs and the CLI subprocesses, never the user's own ~/.cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="moefast-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
# XLA:CPU's LLVM back end at optimisation level 0: most of this suite's time is compiling small
# programs once, and the level-0 back end compiles them in about 0.4-0.6x the CPU time (test_remat_scan.py:
# 266 -> 151 CPU s, its bitwise checks passing); the XLA (HLO) passes, and so the programs' results up to
# float rounding, are the same. Speed lives in the benchmarks, which never run under this flag
# (command-line subprocesses of the tests start from a clean XLA_FLAGS, or from subprocess_env()'s).
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from moefast import host_memory  # noqa: E402
from moefast.config import load_config  # noqa: E402

# As the moefast command does: freed host memory stays mapped between steps (importing moefast no
# longer does it), made before any test starts JAX's CPU backend.
host_memory.configure()

jax.config.update("jax_numpy_rank_promotion", "raise")

# A model small enough that a training step takes milliseconds on a CPU.
SMALL_MODEL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16",
               "model.d_ff=64", "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2",
               "data.seq_len=32", "data.batch_size=8", "train.warmup_steps=2", "train.eval_batches=2"]


def subprocess_env() -> dict[str, str]:
    """The environment of a test's ``moefast`` command-line subprocess whose speed is not measured:
    this session's without the 8 virtual devices (its ``--cpu-devices`` decides), keeping the
    level-0 LLVM back end above (a cold ``moefast train`` of the small model, whole process, on the
    2-core CPU: 9.6 -> 7.2 s)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    return env


@pytest.fixture(autouse=True)
def _no_ignored_signals(request):
    """No test starts or ends with SIGINT or SIGTERM ignored: SIG_IGN is inherited by every later
    subprocess of this worker, whose own Ctrl-C or SIGTERM then does nothing (twice a test's
    subprocess ran to its timeout that way). Found before or after a test, the default is put back
    with a warning naming the test."""
    import signal
    import warnings

    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}

    def mend(when):
        for sig, default in defaults.items():
            if signal.getsignal(sig) == signal.SIG_IGN:
                warnings.warn(f"{sig.name} was ignored {when} {request.node.nodeid}; the default put back")
                signal.signal(sig, default)

    mend("before")
    yield
    mend("after")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 virtual CPU devices, got {len(devs)}: set XLA_FLAGS before jax starts"
    return devs


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """A small real-text corpus: 24 standard-library modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for p in sorted(root.glob("[a-m]*.py"))[:24]:
        shutil.copy(p, out / p.name)
    return out


@pytest.fixture
def small_config(text_dir):
    def make(*overrides):
        return load_config(None, SMALL_MODEL + [f"data.source={text_dir}", *overrides])
    return make


# The longest test files first: pytest-xdist hands out whole files (--dist loadfile) in collection
# order (--no-loadscope-reorder; by default it orders files by their number of tests, which sent
# the one-test, two-minute chaos soak last), so the two workers finish close together instead of
# one running a long file alone at the end. Order inside each file is kept.
_LONGEST_FIRST = ["train/test_chaos.py", "test_notebooks.py", "parallel/test_multiprocess.py",
                  "train/test_disk_faults.py", "test_bench.py", "train/test_train.py"]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = Path(str(item.fspath)).as_posix()
        return next((i for i, name in enumerate(_LONGEST_FIRST) if path.endswith("tests/" + name)), len(_LONGEST_FIRST))
    items.sort(key=rank)  # stable


def pytest_terminal_summary(terminalreporter):
    """The 15 slowest test files (setup, call and teardown of their tests summed, on whichever
    worker ran them), printed before pytest's own total: what to trim when the suite grows."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown") and hasattr(r, "duration"):
                name = r.nodeid.split("::")[0]
                per_file[name] = per_file.get(name, 0.0) + r.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", "slowest 15 test files")
    for name, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {name}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.1f}s in all test files together "
                                f"({len(per_file)} files; the wall time is pytest's total, below)")
