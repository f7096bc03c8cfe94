"""What the user sees when something goes wrong: one clear line when every checkpoint is corrupt,
a quiet exit on a second Ctrl-C, warnings for settings that are valid but almost certainly not
meant, and alerts that survive a resume. (Checkpoint corruption reasons, the required restore
target and a machine too small for a checkpoint: test_checkpoint_faults.py.)"""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import SMALL_MODEL
from moefast.data import load_corpus
from moefast.train import Trainer, config_warnings, learning_rate_schedule
from moefast.train.monitor import ExpertLoadMonitor

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _truncate_array_data(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for f in files if os.path.basename(root) == "d" else ():
            os.truncate(os.path.join(root, f), 10)


# The command-line runs' train.steps (part of the learning-rate schedule, so of the compiled step): one
# step program for both (and test_faults.py's signal runs), compiled once, then loaded from the
# session's compilation cache; train.stop_at ends a run earlier.
STEPS = "train.steps=100000"


@pytest.mark.slow
def test_every_checkpoint_corrupt_is_one_error_line(text_dir, tmp_path):
    """``moefast eval`` of a run whose checkpoints are all corrupt prints exactly one line: orbax's
    and tensorstore's leftover reports (dozens of tracebacks) are silenced."""
    cfg = ["--cpu-devices", "1", *SMALL_MODEL, f"data.source={text_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "moefast", "train", "--run-dir", str(tmp_path), "--no-progress", *cfg,
                        STEPS, "train.stop_at=4", "train.checkpoint_every=2", "train.eval_every=0"],
                       capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    for step in ("2", "4"):
        _truncate_array_data(tmp_path / "checkpoints" / step)
    p = subprocess.run([sys.executable, "-m", "moefast", "eval", "--run-dir", str(tmp_path), "--cpu-devices", "1"],
                       capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no checkpoint in "), p.stderr[-3000:]
    assert err[0].count(" cannot be read: a ") == 2, err[0]  # what is wrong, for both steps


CHILD = textwrap.dedent("""
    import os, signal, sys, threading
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, whatever was inherited
    from orbax.checkpoint._src.checkpointers import async_checkpointer
    from moefast import cli
    from moefast.train import checkpoint, timing

    # The write's commit (orbax renames the step's temporary directory) is held for ever: the second
    # Ctrl-C always comes while the checkpoint is being written, however busy the machine.
    async_checkpointer._on_commit_callback = lambda *a, **k: threading.Event().wait()

    real_record = timing.StepBook.record
    def record(self, step, metrics):
        real_record(self, step, metrics)
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: stop after this step with a checkpoint
    timing.StepBook.record = record

    real_wait = checkpoint.Checkpointer.wait
    def wait(self):  # Ctrl-C again, 0.5 s into waiting for that checkpoint's write
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        return real_wait(self)
    checkpoint.Checkpointer.wait = wait
    sys.exit(cli.main())  # as the moefast command: its own process, which leaves at once
""")


def test_second_ctrl_c_while_the_checkpoint_is_written_exits_quietly(text_dir, tmp_path):
    """The second Ctrl-C lands while the stop checkpoint is still being written (its write is held
    until the process ends, so this does not depend on the machine's speed): one line, exit 130, the
    run resumes from the start, and the unfinished write is no checkpoint."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-c", CHILD, "train", "--run-dir", str(tmp_path), "--cpu-devices", "1",
                        "--no-progress", *SMALL_MODEL, f"data.source={text_dir}", STEPS,
                        "train.checkpoint_every=0", "train.eval_every=0"],
                       capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 130, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stderr.strip() == "interrupted", p.stderr[-3000:]  # no absl traceback, no C++ abort
    said = "interrupted: not waiting for the checkpoint being written; the run resumes from "
    (line,) = [line for line in p.stdout.splitlines() if line.startswith(said)]
    assert line == said + "the start (no complete checkpoint) (same command)"
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()]


def test_config_warnings_and_a_one_document_corpus(small_config, tmp_path):
    cfg = small_config("train.steps=3", "moe.warmup_steps=10", "train.warmup_steps=5")
    said = config_warnings(cfg)
    assert len(said) == 2
    assert said[0].startswith("moe.warmup_steps=10 > train.steps=3: routing is randomised")
    # what the schedule does with it: a linear climb over the whole run, never the peak, never a decay
    assert said[1].startswith("train.warmup_steps=5 > train.steps=3: the warm-up is cut to the run's 3 steps, so the "
                              "learning rate climbs linearly from 0 for the whole run (step k at (k-1)/3 of "
                              f"train.learning_rate={cfg.train.learning_rate}, the last step at 0.667 of it) and "
                              "never decays"), said[1]
    applied = [float(learning_rate_schedule(cfg)(k - 1)) / cfg.train.learning_rate for k in (1, 2, 3)]  # step k's
    np.testing.assert_allclose(applied, [0, 1 / 3, 2 / 3], rtol=1e-6)
    assert config_warnings(small_config("train.steps=30", "moe.warmup_steps=10")) == []
    assert config_warnings(small_config("train.steps=30", "model.linear_attention_kind=kda")) == [
        "model.linear_attention_kind=kda has no effect: no layer is linear_attention (model.layer_types); list the "
        "linear layers there"]

    one = tmp_path / "one"
    one.mkdir()
    (one / "only.txt").write_text("the only document of this corpus. " * 400)
    corpus = load_corpus(small_config(f"data.source={one}").data)
    assert not corpus.held_out_documents
    (warning,) = corpus.warnings(small_config().data)
    assert "has 1 document, too few to hold whole documents out" in warning
    lines = []
    Trainer(small_config(f"data.source={one}", "train.steps=1", "moe.warmup_steps=5", "train.warmup_steps=0"),
            tmp_path / "run", log=lines.append, progress=False, devices=jax.devices()[:1]).run()
    assert any(line.startswith("warning: moe.warmup_steps=5 > train.steps=1") for line in lines), lines
    assert any(line.startswith("warning: data.source=") and "1 document" in line for line in lines), lines


def test_monitor_counters_survive_a_resume():
    loads = [[[10, 0, 5, 5]]] * 2 + [[[10, 0, 5, 5]]] * 3
    whole = ExpertLoadMonitor(3.0, 3)
    alerts_whole = [whole.update(x) for x in loads]
    first = ExpertLoadMonitor(3.0, 3)
    alerts = [first.update(x) for x in loads[:2]]
    second = ExpertLoadMonitor(3.0, 3)
    second.load_state_dict(first.state_dict())  # what the checkpoint's meta carries
    alerts += [second.update(x) for x in loads[2:]]
    assert alerts == alerts_whole and any(alerts_whole)
    assert ExpertLoadMonitor(3.0, 3).state_dict() == {}
