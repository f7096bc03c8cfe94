"""Checkpoint faults: a process killed mid-save, truncated or corrupted step directories, a
failing background write, and what the messages say. Most tests drive ``Checkpointer`` with a small
synthetic state; one runs the ``Trainer`` through the faults (real processes killed at random
moments: test_chaos.py)."""

import errno
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from orbax.checkpoint._src.path import atomicity

from moefast.train import Trainer
from moefast.train.checkpoint import Checkpointer, CheckpointError, CheckpointWarning

# A restore that fails part-way leaves tensorstore reads whose callbacks find orbax's event loop
# closed ("Event loop is closed", reported at garbage collection, in whichever test runs then).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

TMP = ".orbax-checkpoint-tmp"  # orbax 0.12: <step>.orbax-checkpoint-tmp until the write completes


def make_state(i: int) -> dict:
    return {"params": {"w": jnp.arange(64 * 48.0).reshape(64, 48) + i, "b": jnp.arange(8.0) * i},
            "step": jnp.asarray(i, jnp.int32)}


ABSTRACT = {"params": {"w": jax.ShapeDtypeStruct((64, 48), jnp.float32), "b": jax.ShapeDtypeStruct((8,), jnp.float32)},
            "step": jax.ShapeDtypeStruct((), jnp.int32)}


def assert_state(restored, i: int) -> None:
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(make_state(i))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert restored.data_state == {"pos": i}


def write_steps(directory, cfg, steps, *, async_save=False, keep=10):
    ckpt = Checkpointer(directory, keep=keep, async_save=async_save)
    for i in steps:
        ckpt.save(i, make_state(i), {"pos": i}, cfg, force=True)
    ckpt.close()


def train_records(run_dir):
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["kind"] == "train"]


def names(directory):
    return sorted(os.listdir(directory))


def truncate(path, size=None):
    size = os.path.getsize(path) // 2 if size is None else size
    with open(path, "r+b") as f:
        f.truncate(size)


# ---------------------------------------------------------------------------- 1. killed mid-save
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_unfinished_write_is_ignored_then_cleaned_and_that_step_saved_again(small_config, tmp_path, async_save):
    cfg = small_config()
    write_steps(tmp_path, cfg, [1, 2])
    # What a kill during the write of step 3 leaves: orbax's temporary directory, here with all of
    # step 2's files (a write that got far) but without the final rename to "3".
    shutil.copytree(tmp_path / "2", tmp_path / f"3{TMP}")
    os.remove(tmp_path / f"3{TMP}" / "commit_success.txt")
    (tmp_path / f"9{TMP}" / "state").mkdir(parents=True)  # a write that had just begun, of a step never saved again
    lines = []
    ckpt = Checkpointer(tmp_path, async_save=async_save, log=lines.append)
    assert ckpt.latest_step() == 2  # the leftover is not a step
    assert_state(ckpt.restore(ABSTRACT, cfg), 2)
    assert not lines  # an unfinished write is not a corrupt checkpoint: nothing to warn about
    assert ckpt.save(3, make_state(3), {"pos": 3}, cfg, force=True)
    ckpt.wait()
    assert any(f"3{TMP}, 9{TMP}" in line and "removed unfinished" in line for line in lines), lines
    assert names(tmp_path) == ["1", "2", "3"]
    ckpt.close()
    assert_state(Checkpointer(tmp_path).restore(ABSTRACT, cfg), 3)  # the new step 3, not the leftover


# A real `moefast train` SIGKILLed during asynchronous saves (and at other moments), 20 times:
# tests/train/test_chaos.py.


# ---------------------------------------------------------------------------- 2. corrupted steps
def _truncate_manifest(step_dir):
    truncate(step_dir / "state" / "manifest.ocdbt")


def _delete_tree_metadata(step_dir):
    os.remove(step_dir / "state" / "_METADATA")  # orbax then reports a pytree structure mismatch


def _truncate_array_data(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        if os.path.basename(root) == "d":  # OCDBT data files
            for f in files:
                truncate(os.path.join(root, f))


def _corrupt_meta_json(step_dir):
    (step_dir / "meta" / "metadata").write_text('{"step": 3, "config": {"mod')


CORRUPTIONS = {"truncated-manifest": _truncate_manifest, "deleted-tree-metadata": _delete_tree_metadata,
               "truncated-array-data": _truncate_array_data, "corrupt-meta-json": _corrupt_meta_json}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_latest_step_falls_back_to_previous_and_is_set_aside(small_config, tmp_path, corrupt):
    cfg = small_config()
    write_steps(tmp_path, cfg, [1, 2, 3])
    corrupt(tmp_path / "3")
    lines = []
    ckpt = Checkpointer(tmp_path, keep=2, async_save=True, log=lines.append)
    restored = ckpt.restore(ABSTRACT, cfg)
    assert restored.step == 2 and restored.meta["step"] == 2
    assert_state(restored, 2)  # exactly what step 2 saved
    assert len(lines) == 1 and lines[0].startswith("warning: ")
    assert f"{tmp_path / '3'} could not be restored (" in lines[0] and "restored step 2" in lines[0]
    assert f"moved it to {tmp_path / '3.corrupt-1'}" in lines[0]
    assert names(tmp_path) == ["1", "2", "3.corrupt-1"] and ckpt.latest_step() == 2
    # Training goes on from step 2 and saves step 3 again (keep=2 then deletes step 1 only).
    ckpt.save(3, make_state(3), {"pos": 3}, cfg, force=True)
    ckpt.close()
    assert names(tmp_path) == ["2", "3", "3.corrupt-1"]
    assert_state(Checkpointer(tmp_path).restore(ABSTRACT, cfg), 3)


def test_fallback_warns_through_warnings_without_log_and_numbers_repeated_corruption(small_config, tmp_path):
    cfg = small_config()
    write_steps(tmp_path, cfg, [1, 2])
    (tmp_path / "2.corrupt-1").mkdir()  # an earlier incident
    _truncate_manifest(tmp_path / "2")
    expected = r"checkpoint .*/2 could not be restored \(.+\); moved it to .*/2\.corrupt-2; restored step 1"
    with pytest.warns(CheckpointWarning, match=expected):
        restored = Checkpointer(tmp_path).restore(ABSTRACT, cfg)
    assert restored.step == 1
    assert names(tmp_path) == ["1", "2.corrupt-1", "2.corrupt-2"]


def test_all_steps_corrupt_is_a_clear_error_and_moves_nothing(small_config, tmp_path):
    cfg = small_config()
    write_steps(tmp_path, cfg, [1, 2])
    _truncate_array_data(tmp_path / "2")
    _corrupt_meta_json(tmp_path / "1")
    ckpt = Checkpointer(tmp_path, log=lambda s: pytest.fail(f"unexpected message: {s}"))
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(ABSTRACT, cfg)
    msg = str(e.value)
    assert f"no checkpoint in {tmp_path} could be restored" in msg
    assert f"{tmp_path / '2'}: " in msg and f"{tmp_path / '1'}: metadata unreadable" in msg
    assert names(tmp_path) == ["1", "2"]  # no step restored: the cause may be the code, nothing is moved
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / '2'} could not be restored"):
        ckpt.restore(ABSTRACT, cfg, step=2)  # an explicit step never falls back
    ckpt.close()


def test_implementation_choices_may_change_on_resume(small_config, tmp_path):
    """How the same model is computed (grouped matmul, routing kernel, exchange chunks, attention and
    Gated DeltaNet kernels, remat, the GEMMs' precision: the state is float32 master weights either
    way) is not part of the checkpoint's identity, like the mesh."""
    write_steps(tmp_path, small_config(), [1])
    ckpt = Checkpointer(tmp_path, log=lambda s: pytest.fail(f"unexpected message: {s}"))
    other = small_config("moe.grouped_matmul=ragged_dot", "moe.routing_impl=reference", "moe.overlap_chunks=2",
                         "moe.overlap_chain=true", "model.attention_impl=blocked",
                         "model.linear_attention_impl=reference", "model.remat=full", "model.precision=fp8")
    assert ckpt.restore(ABSTRACT, other).step == 1
    ckpt.close()


def test_config_mismatch_raises_at_once_without_fallback(small_config, tmp_path):
    write_steps(tmp_path, small_config(), [1, 2])
    ckpt = Checkpointer(tmp_path, log=lambda s: pytest.fail(f"unexpected message: {s}"))
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / '2'} was written with a different 'moe'"):
        ckpt.restore(ABSTRACT, small_config("moe.num_experts=8"))
    assert names(tmp_path) == ["1", "2"]
    ckpt.close()


def test_checkpoint_of_an_older_version_without_newer_config_keys_restores(small_config, tmp_path, monkeypatch):
    """Config keys added since a checkpoint was written default to the old behaviour, so its
    missing keys are read as the defaults; a real difference is still refused."""
    cfg = small_config()
    old = cfg.to_dict()
    del old["model"]["position_encoding"], old["moe"]["warmup_steps"], old["cache"], old["monitor"]
    monkeypatch.setattr(type(cfg), "to_dict", lambda self: json.loads(json.dumps(old)))
    write_steps(tmp_path, cfg, [1])
    monkeypatch.undo()
    ckpt = Checkpointer(tmp_path)
    assert ckpt.restore(ABSTRACT, small_config()).step == 1
    with pytest.raises(CheckpointError, match=r"different 'model' config \(keys \['position_encoding'\]\)"):
        ckpt.restore(ABSTRACT, small_config("model.position_encoding=sinusoidal"))
    ckpt.close()


# ---------------------------------------------------------------------------- 3. failed background writes
def _fail_data_write(monkeypatch, step):
    """Disk full while a JSON item of ``step`` is written (in orbax's commit threads when async)."""
    original = json_checkpoint_handler.JsonCheckpointHandler._save_fn

    async def save_fn(self, x, directory):
        if f"{step}{TMP}" in str(directory):
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))
        return await original(self, x, directory)

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", save_fn)


def _fail_commit(monkeypatch, step):
    """The directory turns read-only just before ``step``'s write is committed (renamed)."""
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if f"{step}{TMP}" in str(self.get()):
            raise OSError(errno.EROFS, "Read-only file system", str(self.get()))
        return await original(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)


@pytest.mark.parametrize("fault,surface,async_save", [
    (_fail_data_write, "save", True), (_fail_commit, "wait", True), (_fail_data_write, "close", True),
    (_fail_commit, "save", False)], ids=["disk-full-at-next-save", "read-only-at-wait", "disk-full-at-close",
                                        "read-only-sync"])
def test_failed_write_surfaces_as_error_and_keeps_last_good_checkpoint(small_config, tmp_path, monkeypatch,
                                                                     fault, surface, async_save):
    cfg = small_config()
    ckpt = Checkpointer(tmp_path, keep=1, async_save=async_save)  # keep=1: GC would delete step 1
    ckpt.save(1, make_state(1), {"pos": 1}, cfg, force=True)
    ckpt.wait()
    fault(monkeypatch, 2)
    expected = (rf"checkpoint step 2 could not be written to {tmp_path / '2'} \((No space left on device|Read-only "
                rf"file system) \[errno \d+\]; OSError: .*\); the last complete "
                rf"checkpoint, {tmp_path / '1'}, was kept\. Check free disk space and write permissions of {tmp_path}")
    if not async_save:
        with pytest.raises(CheckpointError, match=expected):
            ckpt.save(2, make_state(2), {"pos": 2}, cfg, force=True)
    else:
        assert ckpt.save(2, make_state(2), {"pos": 2}, cfg, force=True)  # returns; the write fails behind
        with pytest.raises(CheckpointError, match=expected):
            if surface == "save":
                ckpt.save(3, make_state(3), {"pos": 3}, cfg, force=True)
            elif surface == "wait":
                ckpt.wait()
            else:
                ckpt.close()
    assert [n for n in names(tmp_path) if TMP not in n] == ["1"]  # the good step is intact, no step 2
    assert ckpt.latest_step() == 1
    assert_state(Checkpointer(tmp_path).restore(ABSTRACT, cfg), 1)
    monkeypatch.undo()
    if surface == "close":
        ckpt = Checkpointer(tmp_path, keep=1, async_save=async_save)
    ckpt.wait()  # the error was raised once
    ckpt.save(2, make_state(2), {"pos": 2}, cfg, force=True)  # the failed step can be written again
    ckpt.close()
    assert names(tmp_path) == ["2"]
    assert_state(Checkpointer(tmp_path).restore(ABSTRACT, cfg), 2)


# ---------------------------------------------------------------------------- the Trainer through both
def test_trainer_stops_on_failed_write_then_resumes_past_a_corrupt_step(small_config, tmp_path, monkeypatch):
    """Run 1 fails writing step 4 (surfacing at step 5's save, training stops); step 3 is then
    corrupted; run 2 warns, resumes from step 2, saves steps 3.. again, and its losses equal run 1's
    (the state it restored is exactly step 2's)."""
    common = ["train.steps=6", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=1",
              "checkpoint.keep=2", "checkpoint.async_save=true"]
    cfg = small_config(*common)
    devices = jax.devices()[:1]
    fault = _fail_data_write
    fault(monkeypatch, 4)
    with pytest.raises(CheckpointError, match="checkpoint step 4 could not be written"):
        Trainer(cfg, tmp_path, log=None, progress=False, devices=devices).run()
    monkeypatch.undo()
    ckpts = tmp_path / "checkpoints"
    assert [n for n in names(ckpts) if TMP not in n] == ["2", "3"]  # keep=2 deleted nothing it needed
    first = train_records(tmp_path)
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]

    _truncate_array_data(ckpts / "3")
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = Trainer(cfg, tmp_path, log=lines.append, progress=False, devices=devices).run()
    said = lines + [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any(f"{ckpts / '3'} could not be restored" in s and "restored step 2" in s for s in said), said
    assert f"resuming from step 2 ({ckpts / '2'})" in lines
    assert summary.steps == 6 and summary.steps_this_run == 4
    assert names(ckpts) == ["3.corrupt-1", "5", "6"]  # step 4's unfinished write was removed too
    # the records of steps 3-5 of run 1 were removed on resume (replayed): each step once, in order
    assert any("removed 3 record(s) after step 2" in line for line in lines), lines
    second = train_records(tmp_path)
    assert [r["step"] for r in second] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in second[:5]] == [r["loss"] for r in first]  # exact resume from step 2


# ---------------------------------------------------------------------------- 5. what the messages say
def _zero_array_data(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        if os.path.basename(root) == "d":
            for f in files:
                path = os.path.join(root, f)
                size = os.path.getsize(path)
                with open(path, "wb") as fh:
                    fh.write(bytes(size))


# (corruption, what the reason must say about the files)
REASONS = {
    "empty-tree-metadata": (lambda d: truncate(d / "state" / "_METADATA", 0), "state/_METADATA is empty (0 bytes)"),
    "missing-tree-metadata": (lambda d: os.remove(d / "state" / "_METADATA"), "state/_METADATA is missing"),
    "cut-tree-metadata": (lambda d: truncate(d / "state" / "_METADATA", 50), "state/_METADATA is not valid JSON"),
    "missing-index": (lambda d: os.remove(d / "state" / "manifest.ocdbt"), "state/manifest.ocdbt (the array index) is missing"),
    "cut-array-data": (lambda d: _truncate_array_data(d), "cannot be read: a data file is shorter than its index says (truncated)"),
    "zeroed-array-data": (_zero_array_data, "cannot be read: a file is corrupt (its bytes do not decode)"),
    "missing-data-item": (lambda d: os.remove(d / "data" / "metadata"), "data/metadata is missing"),
}


@pytest.mark.parametrize("corrupt,said", REASONS.values(), ids=REASONS.keys())
def test_corruption_reasons_say_what_is_wrong_with_the_files(small_config, tmp_path, corrupt, said):
    cfg = small_config()
    write_steps(tmp_path, cfg, [1, 2])
    corrupt(tmp_path / "2")
    lines = []
    restored = Checkpointer(tmp_path, log=lines.append).restore(ABSTRACT, cfg)
    assert_state(restored, 1)
    assert len(lines) == 1 and said in lines[0], lines
    assert "StopIteration" not in lines[0] and "Dict key mismatch" not in lines[0]


def test_restore_needs_a_target(small_config, tmp_path):
    cfg = small_config()
    write_steps(tmp_path, cfg, [1])
    with pytest.raises(TypeError, match=r"needs the target structure.*abstract_state\(\)"):
        Checkpointer(tmp_path).restore(None, cfg)


def test_a_machine_that_cannot_hold_the_checkpoint_is_not_told_the_files_are_damaged(small_config, tmp_path,
                                                                                     monkeypatch):
    cfg = small_config()
    write_steps(tmp_path, cfg, [1, 2])
    ckpt = Checkpointer(tmp_path)
    calls = []
    real = ckpt.manager.restore

    def restore(step, args=None):
        if "state" in args.keys():
            calls.append(step)
            raise ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9663676416 bytes.")
        return real(step, args=args)

    monkeypatch.setattr(ckpt.manager, "restore", restore)
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(ABSTRACT, cfg)
    msg = str(e.value)
    assert "could not be restored on this machine" in msg and "Out of memory" in msg
    assert "damaged" not in msg and "files look complete" in msg
    assert calls == [2] and names(tmp_path) == ["1", "2"]  # no fallback, nothing moved aside
    ckpt.close()
