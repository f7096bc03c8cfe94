"""A run never writes into a directory that holds someone else's files."""

import pytest

from moefast.train import CheckpointError, Trainer
from moefast.train.run_dir import check_writable


def test_run_dir_with_other_files_and_no_run_is_refused_untouched(small_config, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("mine")
    (notes / "config.yaml").write_text("not: a moefast config\n")
    before = sorted(p.name for p in notes.iterdir())
    with pytest.raises(CheckpointError, match=r"holds files that are not a moefast run \(thesis\.tex\)"):
        Trainer(small_config("train.steps=1"), notes, log=None, progress=False).run()
    assert sorted(p.name for p in notes.iterdir()) == before
    assert (notes / "config.yaml").read_text() == "not: a moefast config\n"
    # an empty directory, or one holding only what a run writes (and hidden files), is a run dir;
    # one with a run in it may also hold the user's notes
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".DS_Store").write_text("")
    (fresh / "plots").mkdir()
    (fresh / "config.yaml").write_text("x: 1\n")
    check_writable(fresh)
    (fresh / "my-notes.txt").write_text("kept beside a run")
    with pytest.raises(CheckpointError, match="my-notes.txt"):
        check_writable(fresh)
    (fresh / "metrics.jsonl").write_text("")
    check_writable(fresh)
    assert sorted(p.name for p in fresh.iterdir()) == [".DS_Store", "config.yaml", "metrics.jsonl", "my-notes.txt",
                                                       "plots"]


def test_a_project_directory_with_its_own_checkpoints_is_not_a_run(small_config, tmp_path):
    """A checkpoints/ of other files (another tool's) does not make a run: the Trainer refuses the
    directory when it is created, before its checkpoints are restored or anything is written."""
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "epoch1.pt").write_bytes(b"weights")
    (project / "train.py").write_text("...")
    with pytest.raises(CheckpointError, match=r"not a moefast run \(train\.py, checkpoints/epoch1\.pt\)"):
        Trainer(small_config("train.steps=1"), project, log=None, progress=False)
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == [
        "checkpoints", "checkpoints/epoch1.pt", "train.py"]
    # a run's checkpoints/: numbered steps, orbax's unfinished writes, steps moved aside (and hidden files)
    run = tmp_path / "run"
    for name in ("3", "4.orbax-checkpoint-tmp-1700000000", "2.corrupt-1", ".DS_Store"):
        (run / "checkpoints" / name).mkdir(parents=True)
    (run / "my-notes.txt").write_text("kept beside a run")
    check_writable(run)


def test_the_command_line_refuses_a_directory_that_is_not_a_run_before_reading_it(tmp_path, capsys):
    """`moefast train --run-dir DIR` continues DIR with its own config.yaml: a directory that is not
    a run is refused first, not read as a config ("unknown section 'not'"); import-hf refuses it (and
    another run's dir) before it reads anything of the Hugging Face checkpoint, here one that does not
    exist; eval refuses it before reading its config.yaml."""
    from moefast import cli

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("mine")
    (notes / "config.yaml").write_text("not: a moefast config\n")
    for argv in (["train", "--run-dir", str(notes), "train.steps=1"],
                 ["import-hf", str(tmp_path / "no-such-hf-model"), "--run-dir", str(notes)],
                 ["eval", "--run-dir", str(notes)]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err == (f"error: run dir {notes} holds files that are not a moefast run (thesis.tex): no "
                       "metrics.jsonl, no checkpoints/ of numbered steps; choose a new or empty directory for the "
                       "run\n"), err
    assert sorted(p.name for p in notes.iterdir()) == ["config.yaml", "thesis.tex"]
    assert (notes / "config.yaml").read_text() == "not: a moefast config\n"
    other = tmp_path / "other-run"
    (other / "checkpoints" / "5").mkdir(parents=True)
    assert cli.main(["import-hf", str(tmp_path / "no-such-hf-model"), "--run-dir", str(other)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_trainer_errors_name_the_run_dir_not_the_command_line_flags(small_config, tmp_path):
    """A Python user (Trainer(cfg, run_dir=...)) reads "run dir" and Python arguments, not --run-dir,
    --cpu-devices or --profile; a command suggestion names both ways."""
    from moefast.config import ConfigError
    from moefast.train import Checkpointer, load_run_config

    (tmp_path / "file.txt").write_text("x")
    cases = [(tmp_path / "file.txt", "exists and is not a directory"),
             (tmp_path / "file.txt" / "run", f"cannot be created: {tmp_path / 'file.txt'} is a file")]
    for run_dir, said in cases:
        with pytest.raises((CheckpointError, ConfigError)) as e:
            Trainer(small_config(), run_dir, log=None, progress=False)
        assert str(e.value).startswith(f"run dir {run_dir} {said}") and "--" not in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:
        Trainer(small_config(), tmp_path / "run", log=None, progress=False, profile=(3, 2))
    assert "profile=(3, 2): expected (start, end)" in str(e.value) and "--" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        Trainer(small_config("moe.routing_impl=pallas"), tmp_path / "run", log=None, progress=False)
    assert "devices=jax.devices()[:1]; --cpu-devices 1 on the command line" in str(e.value)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    with pytest.raises(CheckpointError) as e:
        ckpt.restore({}, small_config())
    ckpt.close()
    run = tmp_path / "run"
    assert str(e.value) == f"no checkpoint in {run / 'checkpoints'}; train the run in {run} first"
    with pytest.raises(CheckpointError) as e:
        load_run_config(tmp_path / "nothing")
    assert "start one with moefast train --run-dir DIR, or Trainer(cfg, run_dir=DIR).run() in Python" in str(e.value)
