"""Host malloc settings: importing moefast changes nothing process-wide; the CLI applies them.

How much they save (page faults and tokens/s of ``moefast train`` both ways) is measured by
``moefast bench malloc``, not here: a speed assertion fails on a loaded machine.
"""

import json
import os
import subprocess
import sys

import pytest

from moefast import host_memory

# What a fresh interpreter holds before and after `import moefast` (standard library only).
_PROBE = """
import json, sys, threading, warnings
before = (sys.excepthook, sys.unraisablehook, threading.excepthook, list(warnings.filters))
import moefast
after = (sys.excepthook, sys.unraisablehook, threading.excepthook, list(warnings.filters))
print(json.dumps({"status": moefast.host_memory.status(),
                  "hooks_untouched": all(a is b for a, b in zip(before[:3], after[:3])),
                  "filters_untouched": before[3] == after[3],
                  "jax_imported": "jax" in sys.modules}))
"""


def _fresh(code, **env):
    e = {k: v for k, v in os.environ.items() if k != host_memory.ENV_VAR} | env
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=e)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]


def test_a_bare_import_changes_nothing_process_wide():
    got = json.loads(_fresh(_PROBE))
    assert got == {"status": None, "hooks_untouched": True, "filters_untouched": True, "jax_imported": False}


@pytest.mark.parametrize("env,want", [({}, "keep"), ({host_memory.ENV_VAR: "system"}, "system")])
def test_configure_follows_the_environment_variable(env, want):
    code = "from moefast import host_memory; print(host_memory.configure(), host_memory.status())"
    assert _fresh(code, JAX_PLATFORMS="cpu", **env) == f"{want} {want}"


def test_configure_after_jax_started_changes_nothing():
    code = ("import jax; jax.devices(); from moefast import host_memory; "
            "print(host_memory.configure(), host_memory.status())")
    assert _fresh(code, JAX_PLATFORMS="cpu") == "too-late too-late"


def test_the_train_command_applies_the_settings(tmp_path, text_dir):
    from conftest import SMALL_MODEL

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", host_memory.ENV_VAR)}
    p = subprocess.run([sys.executable, "-m", "moefast", "train", "--run-dir", str(tmp_path / "r"), "--no-progress",
                        f"data.source={text_dir}", *SMALL_MODEL, "train.steps=1", "train.eval_every=0",
                        "train.checkpoint_every=0"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert "host malloc keep" in p.stdout, p.stdout  # the run's log line: configured before JAX started


def test_a_bad_mode_is_one_clear_error(tmp_path):
    env = dict(os.environ, **{host_memory.ENV_VAR: "tcmalloc"})
    p = subprocess.run([sys.executable, "-m", "moefast", "train", "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: MOEFAST_HOST_MALLOC='tcmalloc' is not one of")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="'keep'"):
        host_memory.configure("lots")  # validated even after the first call


def test_this_test_process_keeps_memory():
    # conftest calls configure() after importing jax, but before any backend has started.
    assert host_memory.status() == "keep"


def test_bench_malloc_table_and_records():
    from moefast.bench import malloc

    recs = [malloc.MallocRecord(round=r, mode=m, steps=12, tokens_per_s=t, faults_per_step_last_window=f,
                                faults_per_step_run=f + 1, final_loss=2.5, wall_s=9.0)
            for r, (m, t, f) in enumerate([("keep", 300.0, 0.0), ("system", 200.0, 40_000.0),
                                           ("keep", 320.0, 2.0), ("system", 220.0, 42_000.0)], 1)]
    table = malloc.format_table(recs)
    keep, system = table.splitlines()[2:]
    assert "`keep`" in keep and "| 2 | 310 | 1 | 2 |" in keep
    assert "`system`" in system and "| 2 | 210 | 41,000 | 41,001 |" in system
    with pytest.raises(ValueError, match="--steps must be >= 3"):
        malloc.bench_malloc(steps=2)


def test_a_trainer_reports_the_policy_and_never_sets_it(monkeypatch, small_config):
    """A script that did not opt in is told how (on CPU); the Trainer itself leaves malloc alone."""
    from moefast.train import Trainer

    monkeypatch.setattr(host_memory, "_status", None)
    said = []
    t = Trainer(small_config(), None, log=said.append, progress=False)
    assert host_memory.status() is None and t.host_malloc == "system (not configured)"
    assert any("call moefast.host_memory.configure() before any JAX computation" in s for s in said), said
