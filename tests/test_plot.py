"""moefast plot: the PNGs of a short real run, and metrics read the way a resumed run wrote them."""

import json

import numpy as np
import pytest

from moefast import plot


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, text_dir):
    from moefast.config import load_config
    from moefast.train import Trainer

    from conftest import SMALL_MODEL

    run = tmp_path_factory.mktemp("plotrun") / "run"
    cfg = load_config(None, SMALL_MODEL + [f"data.source={text_dir}", "mesh.data=1", "train.steps=12",
                                           "train.log_every=2", "train.eval_every=6", "train.checkpoint_every=0",
                                           "monitor.patience=1", "monitor.max_load_ratio=1.01"])
    import jax

    Trainer(cfg, run, log=None, progress=False, devices=jax.devices()[:1]).run()
    return run


def test_pngs_of_a_real_run(run_dir, tmp_path):
    from PIL import Image

    from moefast import cli

    out = tmp_path / "plots"
    assert cli.main(["plot", "--run-dir", str(run_dir), "--out", str(out)]) == 0
    for name in plot.FIGURES:
        path = out / f"{name}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            w, h = im.size
            pixels = np.asarray(im.convert("L"))
        assert 600 <= w <= 2000 and 300 <= h <= 1500, (name, im.size)
        assert path.stat().st_size > 15_000 and pixels.std() > 10  # drawn on, not blank
    assert not (run_dir / "plots").exists()  # --out given: nothing written into the run dir


def test_figures_show_what_the_metrics_say(run_dir):
    records = plot.read_metrics(run_dir)
    assert records["alert"]  # monitor.max_load_ratio=1.01 alerts at once
    figs = plot.run_figures(run_dir)
    loss_ax = figs["loss"].axes[0]
    steps = [r["step"] for r in records["train"]]
    train_line = [ln for ln in loss_ax.get_lines() if ln.get_label() == "training loss"][0]
    np.testing.assert_array_equal(train_line.get_xdata(), steps)
    np.testing.assert_allclose(train_line.get_ydata(), [r["loss"] for r in records["train"]])
    assert any(ln.get_label() == "expert-load alert" for ln in loss_ax.get_lines())
    heat = [ax for ax in figs["expert_load"].axes if ax.get_title().startswith("MoE layer")]
    assert len(heat) == len(records["train"][0]["tokens_per_expert"])  # one per MoE layer
    share = np.asarray(heat[0].collections[0].get_array()).reshape(4, len(steps))  # [E, S]
    tpe = np.array([r["tokens_per_expert"][0] for r in records["train"]], float)
    np.testing.assert_allclose(share, (4 * tpe / tpe.sum(axis=1, keepdims=True)).T)  # relative to uniform (E=4)
    alerted = {a["layer"] for a in records["alert"]}
    marked = {i for i, ax in enumerate(heat) if any(ln.get_marker() == "v" for ln in ax.get_lines())}
    assert marked == alerted


def test_replayed_steps_and_a_cut_last_line(tmp_path):
    lines = [{"kind": "train", "step": 2, "loss": 3.0}, {"kind": "train", "step": 4, "loss": 2.0},
             {"kind": "train", "step": 4, "loss": 2.5}, {"kind": "eval", "step": 4, "eval_loss": 2.4}]
    text = "\n".join(json.dumps(r) for r in lines) + '\n{"kind": "train", "st'
    (tmp_path / "metrics.jsonl").write_text(text)
    rec = plot.read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in rec["train"]] == [(2, 3.0), (4, 2.5)]  # the replayed step's last record
    assert rec["eval"][0]["eval_loss"] == 2.4
    paths = plot.plot_run(tmp_path)  # no expert counts, no MFU: still every figure
    assert sorted(paths) == sorted(plot.FIGURES) and all(p.is_file() for p in paths.values())
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train"\n' + text)
    with pytest.raises(ValueError, match="line 1"):
        plot.read_metrics(tmp_path)


def test_a_diverged_run_stays_readable(tmp_path):
    """Losses spanning 1e8 get a log axis; a NaN breaks the line; skipped steps are marked."""
    recs = [{"kind": "train", "step": s, "loss": v} for s, v in [(5, 5.0), (10, 1.9e8), (15, float("nan")),
                                                                   (20, 5.5)]]
    recs.append({"kind": "nonfinite", "step": 15, "loss": float("nan"), "grad_norm": 1.0, "in_a_row": 1})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    ax = plot.run_figures(tmp_path)["loss"].axes[0]
    assert ax.get_yscale() == "log"
    line = [ln for ln in ax.get_lines() if ln.get_label() == "training loss"][0]
    assert np.isnan(line.get_ydata()[2])  # a gap, not a bridge
    marks = [ln for ln in ax.get_lines() if ln.get_label() == "non-finite step (skipped)"][0]
    assert list(marks.get_xdata()) == [15]


def test_not_a_run_dir_and_bad_outputs(tmp_path, capsys, run_dir):
    from moefast import cli

    assert cli.main(["plot", "--run-dir", str(tmp_path / "nope")]) == 2
    assert "not a moefast run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert cli.main(["plot", "--run-dir", str(tmp_path / "empty")]) == 2
    assert "no training or evaluation records yet" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert cli.main(["plot", "--run-dir", str(run_dir), "--out", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the plots to") and "choose another directory (moefast plot --out)" in err
