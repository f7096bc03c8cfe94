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
