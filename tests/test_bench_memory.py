"""``moefast bench memory``: the variants it compiles, the table and JSON, fixed keys, timing."""

import json

import pytest

from conftest import SMALL_MODEL
from moefast.bench import memory as bench
from moefast.cli import main
from moefast.config import load_config


def test_variants_cover_remat_scan_and_accumulation_unless_fixed():
    cfg = load_config(None, ["data.batch_size=32"])  # micro-batches of 16 and 8 rows over the tests' 8 devices
    names = [tuple(v) for v in bench.memory_variants([], cfg)]
    assert len(names) == 2 * len(bench.REMAT_ORDER) + 2  # 5 policies x scan off/on, then accumulation 2 and 4
    assert names[0] == ("model.remat=none", "model.scan_layers=false", "train.grad_accum_steps=1")
    assert names[-1] == ("model.remat=none", "model.scan_layers=false", "train.grad_accum_steps=4")
    fixed = bench.memory_variants(["model.scan_layers=true", "train.grad_accum_steps=2"],
                                  load_config(None, ["model.scan_layers=true", "train.grad_accum_steps=2"]))
    assert [v[1:] for v in fixed] == [["model.scan_layers=true", "train.grad_accum_steps=2"]] * len(bench.REMAT_ORDER)


def test_table_json_and_interleaved_steps(tmp_path, text_dir, capsys):
    out = tmp_path / "memory.json"
    overrides = SMALL_MODEL + [f"data.source={text_dir}", "model.num_layers=1", "model.remat=none",
                               "train.grad_accum_steps=1"]
    assert bench.run_cli(json_out=str(out), config=None, overrides=overrides, device_gib=0.01, steps=1) == 0
    r = json.loads(out.read_text())
    assert [(x["remat"], x["scan_layers"], x["grad_accum_steps"]) for x in r["records"]] == [
        ("none", False, 1), ("none", True, 1)]
    for x in r["records"]:
        # per device of the tests' 8: parameters and Adam's two moments split alike over data=8 (ZeRO)
        assert x["param_bytes"] > 0 and x["optimizer_bytes"] == pytest.approx(2 * x["param_bytes"], rel=0.01)
        assert x["total_bytes"] == x["argument_bytes"] + x["temp_bytes"] and x["temp_bytes"] > 0
        assert x["fits"] == (x["total_bytes"] <= 0.01 * 2**30) and x["compile_s"] > 0
        assert x["step_ms"] > 0 and x["tokens_per_s"] > 0
    assert r["records"][0]["param_bytes"] == r["records"][1]["param_bytes"]  # the same model either way
    md = out.with_suffix(".md").read_text()
    assert "| none | on | 1 |" in md and "fits 0.0 GiB" in md and "step time vs first" in md
    assert r["overrides"] == overrides and "with model.d_model=32" in md


def test_cli_rejects_options_bench_memory_does_not_use(capsys):
    assert main(["bench", "memory", "--ablate"]) == 2
    assert "--ablate applies to bench gpu-compile, train only, not to bench memory" in capsys.readouterr().err
    assert main(["bench", "memory", "--device-gib", "0"]) == 2
    assert "--device-gib must be > 0" in capsys.readouterr().err


def test_variants_that_do_not_fit_the_mesh_are_named():
    skipped = []
    variants = bench.memory_variants([], load_config(None, ["data.batch_size=8"]), skipped)  # 8 devices here
    assert len(variants) == 2 * len(bench.REMAT_ORDER)
    assert skipped == ["train.grad_accum_steps=2 (data.batch_size=8 over 8 batch shards)",
                       "train.grad_accum_steps=4 (data.batch_size=8 over 8 batch shards)"]
