"""Process-wide state: creating a Checkpointer changes none of it; Trainer.run changes it only while
it runs (the filters of orbax's repeated failure reports, the SIGTERM / SIGINT handlers) and puts
back exactly what it found, however it ends."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest

from moefast.train import Trainer, TrainingError
from moefast.train.checkpoint import quiet_orbax_aftermath


def _snapshot():
    return {"excepthook": sys.excepthook, "unraisablehook": sys.unraisablehook,
            "warnings": list(warnings.filters),
            "asyncio": list(logging.getLogger("asyncio").filters), "absl": list(logging.getLogger("absl").filters),
            "sigint": signal.getsignal(signal.SIGINT), "sigterm": signal.getsignal(signal.SIGTERM)}


CHILD = textwrap.dedent("""
    import logging, sys, warnings
    import moefast
    from moefast.config import load_config
    from moefast.train import Checkpointer, ModelDef

    def snapshot():
        return (sys.excepthook, sys.unraisablehook, list(warnings.filters),
                list(logging.getLogger("asyncio").filters), list(logging.getLogger("absl").filters))

    cfg = load_config(None, sys.argv[2:])
    model = ModelDef(cfg, 256)
    state = model.init_state(0)  # a tiny model's train state
    before = snapshot()
    ckpt = Checkpointer(sys.argv[1], async_save=True)
    ckpt.save(1, state, None, cfg)
    ckpt.wait()
    ckpt.close()
    after = snapshot()
    assert sys.excepthook is sys.__excepthook__, sys.excepthook
    assert sys.unraisablehook is sys.__unraisablehook__, sys.unraisablehook
    for name, b, a in zip(("excepthook", "unraisablehook", "warnings.filters", "asyncio filters", "absl filters"),
                          before, after):
        assert a == b, (name, b, a)
    print("unchanged")
""")


def test_creating_a_checkpointer_changes_nothing_process_wide(tmp_path):
    from conftest import SMALL_MODEL

    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "checkpoints"), *SMALL_MODEL],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XLA_FLAGS": ""})  # one CPU device: nothing here is sharded
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("unchanged")
    assert (tmp_path / "checkpoints" / "1").is_dir()  # the save really ran


@pytest.mark.parametrize("exc", [None, RuntimeError, KeyboardInterrupt])
def test_quiet_orbax_aftermath_puts_back_exactly_what_it_changed(exc):
    before = _snapshot()
    try:
        with quiet_orbax_aftermath():
            inside = _snapshot()
            assert inside["excepthook"] is not before["excepthook"]
            assert inside["unraisablehook"] is not before["unraisablehook"]
            assert len(inside["warnings"]) == len(before["warnings"]) + 2
            assert len(inside["asyncio"]) == len(before["asyncio"]) + 1
            assert len(inside["absl"]) == len(before["absl"]) + 1
            warnings.filterwarnings("ignore", message="someone else's filter, added meanwhile")
            if exc is not None:
                raise exc("stop")
    except (RuntimeError, KeyboardInterrupt):
        pass
    after = _snapshot()
    ours = warnings.filters[0]
    assert ours[1].pattern == "someone else's filter, added meanwhile"  # kept: not ours to remove
    warnings.filters.remove(ours)
    assert after["warnings"][1:] == before["warnings"]
    assert {k: v for k, v in after.items() if k != "warnings"} == {k: v for k, v in before.items() if k != "warnings"}


def test_nested_quiet_blocks_leave_the_outer_one_in_place():
    before = _snapshot()
    with quiet_orbax_aftermath():
        outer = _snapshot()
        with quiet_orbax_aftermath():
            pass
        assert _snapshot() == outer
    assert _snapshot() == before


def _assert_restored(before, after):
    """``after`` is ``before`` except for warning filters that imports during the run added
    (e.g. tensorboard's): none of the run's own filters is left, and none was removed."""
    assert {k: v for k, v in after.items() if k != "warnings"} == {k: v for k, v in before.items() if k != "warnings"}
    assert [f for f in after["warnings"] if f in before["warnings"]] == before["warnings"]
    assert not [f for f in after["warnings"] if f[1] is not None and "never awaited" in f[1].pattern]


def test_run_restores_process_state_on_return_and_on_failure(small_config, tmp_path, monkeypatch):
    before, during = _snapshot(), []
    summary = Trainer(small_config("train.steps=2", "train.eval_every=0"), tmp_path / "ok",
                      log=lambda line: during.append(_snapshot()), progress=False).run()
    assert summary.steps == 2
    assert during[0]["excepthook"] is not before["excepthook"]  # installed while it ran
    assert during[0]["sigterm"] is not before["sigterm"]
    _assert_restored(before, _snapshot())

    def fail(self, step, m):
        raise TrainingError("a step failed")

    from moefast.train import timing

    monkeypatch.setattr(timing.StepBook, "record", fail)
    with pytest.raises(TrainingError, match="a step failed"):
        Trainer(small_config("train.steps=2", "train.eval_every=0"), tmp_path / "failed", log=None,
                progress=False).run()
    _assert_restored(before, _snapshot())
