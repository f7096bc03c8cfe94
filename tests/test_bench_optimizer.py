"""``moefast bench optimizer``: AdamW against Muon over a learning-rate grid, then more seeds at each
one's best rate; the figures and the verdict follow from the runs' own records."""

import json

import pytest

from conftest import SMALL_MODEL, subprocess_env
from moefast.bench import optimizer as bench
from moefast.cli import main


def _run(opt, lr, seed, curve, diverged=False):
    final = None if diverged else curve[-1][1]
    return bench.OptimizerRun(opt, lr, seed, curve, final, 0.01, 1.0, 1.0, diverged=diverged)


def test_pick_means_steps_to_target_and_ratio():
    """The picked rate ignores a diverged run; the means are over the seeds at the picked rate; the
    steps to AdamW's final mean loss are read off each mean curve."""
    runs = [_run("adamw", 1e-3, 0, [(10, 3.0), (20, 2.6)]),
            _run("adamw", 1e-2, 0, [(10, 2.8), (20, 2.4)]),  # AdamW's best
            _run("muon", 1e-3, 0, [(10, 2.5), (20, 2.2)]),  # Muon's best
            _run("muon", 1e-2, 0, [(10, 2.0)], diverged=True),  # lowest loss seen, but diverged
            _run("adamw", 1e-2, 1, [(10, 2.6), (20, 2.2)]),
            _run("muon", 1e-3, 1, [(10, 2.1), (20, 2.0)])]
    r = bench._verdict(None, [], 20, 10, 2, [1e-3, 1e-2], 2, runs, "x")
    adamw, muon = r.summaries["adamw"], r.summaries["muon"]
    assert (adamw.learning_rate, muon.learning_rate) == (1e-2, 1e-3)
    assert adamw.curve == [(10, pytest.approx(2.7)), (20, pytest.approx(2.3))] and adamw.seeds == [0, 1]
    assert r.target_loss == adamw.final_eval_loss == pytest.approx(2.3)
    assert (adamw.steps_to_target, muon.steps_to_target) == (20, 10)  # Muon's mean at step 10: 2.3 <= 2.3
    assert r.ratio == 0.5 and r.met
    assert "Muon reaches AdamW's final validation loss in 0.50 x AdamW's steps (target <= 0.8)" in bench.format_table(r)
    slow = [*runs[:4], runs[4], _run("muon", 1e-3, 1, [(10, 2.9), (20, 2.8)])]  # Muon's mean never <= 2.3
    never = bench._verdict(None, [], 20, 10, 2, [1e-3, 1e-2], 2, slow, "x")
    assert never.summaries["muon"].steps_to_target is None and never.ratio is None and not never.met
    assert "Muon does not reach AdamW's final validation loss" in bench.format_table(never)
    with pytest.raises(RuntimeError, match="every learning rate of the grid diverged"):
        bench._verdict(None, [], 20, 10, 2, [1e-2], 1, [runs[1], runs[3]], "x")


def test_bench_optimizer_end_to_end(tmp_path, text_dir, monkeypatch):
    """Four real `moefast train` processes of the small model (a grid of one rate with the first seed
    for each optimizer, then the second seed at it; the pick over a grid is the test above's), the
    JSON and markdown they write."""
    monkeypatch.setenv("XLA_FLAGS", subprocess_env()["XLA_FLAGS"])  # one CPU device per process
    out = tmp_path / "optimizer.json"
    overrides = SMALL_MODEL + [f"data.source={text_dir}", "train.seed=5", "model.num_layers=1", "train.eval_batches=1"]
    grid = (1e-2,)
    code = bench.run_cli(json_out=str(out), config=None, overrides=overrides, steps=20, seeds=2, lr_grid=grid,
                         eval_every=10)
    rec = json.loads(out.read_text())
    runs = rec["runs"]
    assert len(runs) == 2 * len(grid) + 2 * 1
    assert [(r["optimizer"], r["learning_rate"], r["seed"]) for r in runs] == [
        ("adamw", 1e-2, 5), ("muon", 1e-2, 5), ("adamw", 1e-2, 6), ("muon", 1e-2, 6)]
    assert set(rec["summaries"]) == {"adamw", "muon"}
    for opt, s in rec["summaries"].items():
        mine = [r for r in runs if r["optimizer"] == opt and r["learning_rate"] == s["learning_rate"]]
        assert [r["seed"] for r in mine] == s["seeds"] == [5, 6]
        for r in mine:
            assert [step for step, _ in r["eval_curve"]] == [10, 20] and r["final_eval_loss"] == r["eval_curve"][-1][1]
        assert s["curve"] == [[step, pytest.approx(sum(dict(r["eval_curve"])[step] for r in mine) / 2)]
                              for step in (10, 20)]
        reached = [step for step, loss in s["curve"] if loss <= rec["target_loss"]]
        assert s["steps_to_target"] == (reached[0] if reached else None)
        assert s["step_s"] > 0 and s["optimizer_mib"] > 0
    adamw, muon = rec["summaries"]["adamw"], rec["summaries"]["muon"]
    assert rec["target_loss"] == adamw["final_eval_loss"] and adamw["steps_to_target"] in (10, 20)
    muon_steps = muon["steps_to_target"]
    assert rec["ratio"] == (None if muon_steps is None else muon_steps / adamw["steps_to_target"])
    assert muon["optimizer_mib"] < adamw["optimizer_mib"]  # one momentum buffer per Muon matrix, AdamW's two
    assert code == (0 if rec["met"] else 1)
    md = (tmp_path / "optimizer.md").read_text()
    assert md.rstrip().splitlines()[-1].startswith(("Muon reaches AdamW's final validation loss in ",
                                                    "Muon does not reach AdamW's final validation loss"))


@pytest.mark.parametrize("argv, message", [
    (["--lr-grid", "1e-3,x"], "--lr-grid '1e-3,x': expected distinct learning rates > 0"),
    (["--lr-grid", "1e-3,0"], "--lr-grid '1e-3,0': expected distinct learning rates > 0"),
    (["--steps", "20", "--eval-every", "25"], "--steps (20) must be >= --eval-every (25)"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["train.optimizer=muon"], "train.optimizer=muon: moefast bench optimizer sets train.optimizer itself"),
    (["train.learning_rate=0.1"], "moefast bench optimizer sets train.learning_rate itself"),
    (["--vary", "lora.base_dtype=bfloat16,nf4"], "--vary applies to bench precision only, not to bench optimizer"),
])
def test_bench_optimizer_option_errors(argv, message, capsys):
    """A bad option: one error line and exit 2, before any run."""
    assert main(["bench", "optimizer", *argv]) == 2
    assert message in capsys.readouterr().err


def test_precision_refuses_the_optimizer_options(capsys):
    assert main(["bench", "precision", "--eval-every", "10"]) == 2
    assert "--eval-every applies to bench optimizer only, not to bench precision" in capsys.readouterr().err
