"""A run dir on a full or read-only file system: training stops with one clear error naming the
directory and the last complete checkpoint, which restores, and no metric record is lost silently.

The real test mounts small tmpfs file systems in a private mount namespace (``unshare``, no root
needed where user namespaces are allowed) and skips, saying so, where that is not possible; the
simulated tests run everywhere."""

import errno
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from conftest import SMALL_MODEL, subprocess_env
from moefast.config import ConfigError
from moefast.train import Trainer, load_run_config
from moefast.train import metrics as metrics_mod
from moefast.train.checkpoint import Checkpointer, CheckpointError
from moefast.train.metrics import MetricsWriteError, MetricsWriter


def _train_steps(run_dir, torn_tail: bool = False):
    """Steps of the run's train records; ``torn_tail``: the last line may be a record the full disk
    cut short (the writer repairs it when the run starts again), which is left out."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    if torn_tail and lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines = lines[:-1]
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _namespaces_work() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    p = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt 2>&1 || "
                        "mount -t tmpfs -o size=1m tmpfs /tmp 2>&1"], capture_output=True, text=True)
    return None if p.returncode == 0 else f"cannot mount a tmpfs in a user namespace: {(p.stderr or p.stdout)[:200]}"


SCRIPT = r"""
set -u
OUT=$1; shift
mkdir -p $OUT/full $OUT/ro
mount -t tmpfs -o size=3m tmpfs $OUT/full
"$@" --run-dir $OUT/full/run train.steps=300 checkpoint.keep=10 > $OUT/full.out 2> $OUT/full.err
echo $? > $OUT/full.rc
cp -a $OUT/full/run $OUT/full_copy
mount -t tmpfs -o size=20m tmpfs $OUT/ro
"$@" --run-dir $OUT/ro/run train.steps=300 train.stop_at=10 > /dev/null 2> $OUT/ro_first.err || exit 3
mount -o remount,ro $OUT/ro
"$@" --run-dir $OUT/ro/run train.steps=20 > $OUT/ro.out 2> $OUT/ro.err
echo $? > $OUT/ro.rc
"""


# The full run, the first read-only run and the copy's resume share train.steps=300 (the learning-rate
# schedule is part of the compiled step): one step program, compiled once, then loaded from the
# session's compilation cache.
@pytest.mark.slow
def test_full_and_read_only_file_systems_stop_cleanly_and_the_run_resumes(text_dir, tmp_path):
    why = _namespaces_work()
    if why:
        pytest.skip(why + " (the simulated tests below still run)")
    env = subprocess_env()
    train = [sys.executable, "-m", "moefast", "train", "--cpu-devices", "1", "--no-progress", *SMALL_MODEL,
             f"data.source={text_dir}", "train.checkpoint_every=5", "train.log_every=1", "train.eval_every=0",
             "checkpoint.async_save=true", "train.peak_tflops=1.0"]  # no CPU matmul probe at each start
    script = tmp_path / "faults.sh"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run(["unshare", "-rm", "bash", str(script), str(out), *train], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr + (out / "ro_first.err").read_text()

    # Full disk: exit 2, stderr is one error line (no orbax/tensorstore tracebacks) naming the
    # directory and the last complete checkpoint.
    assert (out / "full.rc").read_text().strip() == "2"
    err = (out / "full.err").read_text().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), "\n".join(err)[-3000:]
    run, copy = out / "full" / "run", out / "full_copy"
    complete = max(int(n) for n in os.listdir(copy / "checkpoints") if n.isdigit())
    assert f"last complete checkpoint, {run / 'checkpoints' / str(complete)}," in err[0]
    assert "No space left on device" in err[0] and str(run) in err[0]
    # Nothing lost: every step up to the checkpoint has its record; the checkpoint restores.
    steps = _train_steps(copy, torn_tail=True)
    assert steps[:complete] == list(range(1, complete + 1)) and steps == sorted(steps)
    cfg = load_run_config(copy)
    restored = Checkpointer(copy / "checkpoints", async_save=False).restore(
        Trainer(cfg, copy, log=None, progress=False).abstract_state(), cfg)
    assert restored.step == complete
    # Once there is space again (here: a copy on a disk with room), the same command resumes; the
    # records of the steps after the checkpoint are replaced by the replay's.
    r = subprocess.run([*train, "--run-dir", str(copy), f"train.stop_at={complete + 3}"], capture_output=True,
                       text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {complete} " in r.stdout
    assert _train_steps(copy) == list(range(1, complete + 4))

    # Read-only: one error line naming the file and the last complete checkpoint (step 10).
    assert (out / "ro.rc").read_text().strip() == "2"
    err = (out / "ro.err").read_text().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    ro_run = out / "ro" / "run"
    assert f"cannot write {ro_run / 'config.yaml'}: Read-only file system" in err[0]
    assert f"last complete checkpoint, {ro_run / 'checkpoints' / '10'}, is intact" in err[0]


def test_failed_metrics_write_stops_with_the_last_checkpoint_and_resume_fills_the_records(
        small_config, tmp_path, monkeypatch):
    """metrics.jsonl cannot be appended to at step 7 (disk full): the run stops with an error naming
    the file and checkpoint 4, which is intact; the rerun resumes from it and metrics.jsonl then
    holds steps 1-8 once each."""
    cfg = small_config("train.steps=8", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=4",
                       "checkpoint.async_save=true")
    devices = jax.devices()[:1]
    real_write, seen = os.write, []

    def write(fd, data):
        if b'"kind": "train", "step": 7,' in bytes(data):
            seen.append(7)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(metrics_mod.os, "write", write)
    with pytest.raises(CheckpointError) as info:
        Trainer(cfg, tmp_path, log=None, progress=False, devices=devices).run()
    monkeypatch.undo()
    msg = str(info.value)
    assert seen and f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device" in msg
    assert f"last complete checkpoint, {tmp_path / 'checkpoints' / '4'}, is intact" in msg
    assert _train_steps(tmp_path) == [1, 2, 3, 4, 5, 6]
    lines = []
    summary = Trainer(cfg, tmp_path, log=lines.append, progress=False, devices=devices).run()
    assert summary.steps == 8 and f"resuming from step 4 ({tmp_path / 'checkpoints' / '4'})" in lines
    assert any("removed 2 record(s) after step 4" in line for line in lines), lines
    assert _train_steps(tmp_path) == list(range(1, 9))


def test_metrics_writer_drops_replayed_records_and_a_cut_line(tmp_path):
    w = MetricsWriter(tmp_path)
    for s in range(1, 6):
        w.write("train", s, {"loss": float(s)})
    w.write("eval", 4, {"eval_loss": 1.0})  # an evaluation after step 4's record
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 6, "lo')  # a process killed while writing
    w = MetricsWriter(tmp_path, resume_step=3)
    assert w.removed == 4  # steps 4, 5, the evaluation at 4, and the cut line
    w.write("train", 4, {"loss": 40.0})
    w.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("train", 3), ("train", 4)]
    assert records[-1]["loss"] == 40.0
    # Records out of step order (an older moefast appended replays): the file is rewritten.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 2, "loss": 2.0}\n')
    assert MetricsWriter(tmp_path, resume_step=3).removed == 1
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 2]
    # resume_step=None keeps everything; each start writes its own TensorBoard file.
    assert MetricsWriter(tmp_path, resume_step=None).removed == 0
    assert len(os.listdir(tmp_path / "tensorboard")) >= 3


def test_metrics_writer_names_the_file_it_cannot_write(tmp_path, monkeypatch):
    w = MetricsWriter(tmp_path)

    def fail(fd, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(metrics_mod.os, "write", fail)
    with pytest.raises(MetricsWriteError, match=f"cannot write {tmp_path / 'metrics.jsonl'}: Read-only file system"):
        w.write("train", 1, {"loss": 1.0})
    monkeypatch.undo()
    w.close()


def _read_only(d):
    """Makes ``d`` read-only; ``False`` when this user can write in it anyway (root)."""
    d.chmod(0o500)
    try:
        (d / "probe").write_text("x")
    except OSError:
        return True
    (d / "probe").unlink()
    return False


@pytest.mark.parametrize("where", ["under-a-file", "in-a-read-only-dir"])
def test_run_dir_that_cannot_be_created_is_refused_by_the_trainer(small_config, tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "file.txt").write_text("x")
        parent, said = tmp_path / "file.txt", "is a file, not a directory"
    else:
        parent, said = tmp_path / "ro", "is not writable"
        parent.mkdir()
        if not _read_only(parent):
            parent.chmod(0o700)
            pytest.skip("this user (root) can write in a read-only directory; the under-a-file case covers it")
    try:
        with pytest.raises(ConfigError) as info:
            Trainer(small_config(), parent / "run", log=None, progress=False)
    finally:
        if parent.is_dir():
            parent.chmod(0o700)
    assert str(info.value).startswith(f"run dir {parent / 'run'} cannot be created: {parent} {said}")
    assert not (parent / "run").exists()


def test_read_only_run_dir_stops_before_anything_is_written(small_config, tmp_path):
    """An existing run dir that cannot be written is refused when the run starts (eval and generate
    may read it), before the corpus is read or the step compiled, naming config.yaml."""
    run = tmp_path / "run"
    run.mkdir()
    if not _read_only(run):
        run.chmod(0o700)
        pytest.skip("this user (root) can write in a read-only directory; the read-only file system test covers it")
    try:
        trainer = Trainer(small_config(), run, log=None, progress=False)  # eval and generate only read it
        with pytest.raises(CheckpointError) as info:
            trainer.run()
        assert trainer.trace_count == 0 and not list(run.iterdir())
    finally:
        run.chmod(0o700)
    assert str(info.value).startswith(f"cannot write {run / 'config.yaml'}: Permission denied; nothing was trained")
