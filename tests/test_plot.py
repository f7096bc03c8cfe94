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


@pytest.mark.parametrize("with_config", [False, True], ids=["records-only", "config-yaml"])
def test_multi_token_prediction_curves_and_layers(tmp_path, with_config):
    """With model.mtp_depth=1 the MTP loss (train and eval) is its own curve on loss.png, and the
    MTP block's row (after the two main MoE layers) is named as such in the per-layer figures."""
    tpe = [[5, 3, 0, 0], [2, 2, 2, 2], [8, 0, 0, 0]]  # [L_moe + D, E]: the last row is the MTP block's
    recs = [{"kind": "train", "step": s, "loss": 3.0 - s / 10, "mtp_loss": 3.5 - s / 10,
             "mtp_loss_depth_1": 3.5 - s / 10, "tokens_per_expert": tpe, "dropped_fraction": [0.1, 0.0, 0.3],
             "router_entropy": [1.0, 1.3, 0.2]}
            for s in (2, 4, 6)]
    recs += [{"kind": "eval", "step": 6, "eval_loss": 2.5, "eval_mtp_loss": 2.9, "eval_bits_per_byte": 3.0},
             {"kind": "alert", "step": 6, "layer": 2, "layer_name": "MTP module 1", "reason": "idle"}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    if with_config:
        import yaml

        from moefast.config import load_config

        from conftest import SMALL_MODEL

        cfg = load_config(None, SMALL_MODEL + ["model.mtp_depth=1"])
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    figs = plot.run_figures(tmp_path)
    lines = {ln.get_label(): ln for ln in figs["loss"].axes[0].get_lines()}
    np.testing.assert_array_equal(lines["training MTP loss"].get_xdata(), [2, 4, 6])
    np.testing.assert_allclose(lines["training MTP loss"].get_ydata(), [3.3, 3.1, 2.9])
    val = lines["validation MTP loss"]
    assert list(val.get_xdata()) == [6] and list(val.get_ydata()) == [2.9]
    legend = [t.get_text() for t in figs["loss"].axes[0].get_legend().get_texts()]
    assert {"training loss", "validation loss", "training MTP loss", "validation MTP loss"} <= set(legend)
    heat = [ax.get_title() for ax in figs["expert_load"].axes if ax.get_title()]
    blocks = [" (block 0)", " (block 1)"] if with_config else ["", ""]
    assert heat == [f"MoE layer 0{blocks[0]}", f"MoE layer 1{blocks[1]}", "MTP module 1"]
    marked = [ax.get_title() for ax in figs["expert_load"].axes if any(ln.get_marker() == "v" for ln in ax.get_lines())]
    assert marked == ["MTP module 1"]  # the alert of row 2 on the MTP block's heatmap
    for ax in figs["routing"].axes:
        labels = [ln.get_label() for ln in ax.get_lines() if ln.get_marker() == "."]
        assert labels == ["MoE layer 0", "MoE layer 1", "MTP module 1"]
    plain = [r for r in recs if r["kind"] != "alert"]
    for r in plain:
        for k in ("mtp_loss", "mtp_loss_depth_1", "eval_mtp_loss"):
            r.pop(k, None)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in plain) + "\n")
    (tmp_path / "config.yaml").unlink(missing_ok=True)
    figs = plot.run_figures(tmp_path)  # without MTP: no MTP curve, every row a main MoE layer
    assert not [ln for ln in figs["loss"].axes[0].get_lines() if "MTP" in ln.get_label()]
    assert [ax.get_title() for ax in figs["expert_load"].axes if ax.get_title()] == [f"MoE layer {i}" for i in range(3)]


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
