"""The routing benchmark compares equal computations and writes what it promises."""

import dataclasses
import json
import re

import pytest

from moefast.bench import routing as bench


def test_implementations_agree():
    assert bench.check_fused_matches_onehot(tokens=64, experts=4) < 1e-4


def test_records_and_table(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_GRID", [(64, 4), (128, 8)])
    (tmp_path / "a.dir").mkdir()
    out = tmp_path / "a.dir" / "routing.json"
    assert bench.run_cli(quick=True, json_out=str(out), repeats=1) == 0
    records = json.loads(out.read_text())
    assert {(r["impl"], r["tokens"], r["experts"]) for r in records} == {
        (i, t, e) for i in bench.IMPLS for t, e in [(64, 4), (128, 8)]}
    for r in records:
        assert {"impl", "tokens", "experts", "top_k", "time_ms", "temp_bytes"} <= r.keys()
        assert r["time_ms"] > 0 and r["temp_bytes"] >= 0 and r["top_k"] == 2
    table = (tmp_path / "a.dir" / "routing.md").read_text()  # next to the JSON, whatever dots the path has
    assert "| 128 | 8 |" in table and "onehot / fused" in table


def test_onehot_is_skipped_when_too_big():
    recs = bench.bench_routing([(256, 4)], impls=("onehot",), repeats=1, onehot_max_bytes=1.0, log=None)
    assert recs[0].skipped and recs[0].time_ms is None
    assert "skipped" in bench.format_table(recs)
    assert dataclasses.asdict(recs[0])["skipped"]


def test_cache_bench_writes_the_promised_json(tmp_path, text_dir, devices, monkeypatch):
    from conftest import SMALL_MODEL, subprocess_env
    from moefast.bench import cache

    # Its `moefast train` launches run on one CPU device, as the command does by default, instead of
    # this session's 8 virtual ones (which take longer to compile for); the timed steps stay in here.
    monkeypatch.setenv("XLA_FLAGS", subprocess_env()["XLA_FLAGS"])
    out = tmp_path / "cache.json"
    overrides = SMALL_MODEL + [f"data.source={text_dir}"]
    assert cache.run_cli(json_out=str(out), steps=2, pairs=1, overrides=overrides) == 0
    rec = json.loads(out.read_text())
    for k in ("step_time_on_s", "step_time_off_s", "first_step_cold_s", "first_step_warm_s"):
        assert rec[k] > 0, k
    assert rec["step_runs"] == 2 and rec["launch_pairs"] == 1
    assert "time to first step" in (tmp_path / "cache.md").read_text()


def test_overlap_bench_writes_the_promised_json(tmp_path, text_dir, devices):
    from conftest import SMALL_MODEL
    from moefast.bench import overlap

    out = tmp_path / "overlap.json"
    overrides = SMALL_MODEL + [f"data.source={text_dir}", "train.eval_batches=1", "model.num_layers=1"]
    # rounds=0: no moefast train processes (tested with the cache bench); the steps are the point here
    assert overlap.run_cli(json_out=str(out), steps=1, rounds=0, overrides=overrides, cpu_devices=8) == 0
    rec = json.loads(out.read_text())
    assert rec["mesh"] == {"data": 2, "fsdp": 1, "expert": 4}
    for n in ("1", "2", "4"):
        c = rec["collectives"][n]
        assert rec["step_s"][n] > 0 and c["all_to_alls"] == c["expected"] == 4 * int(n)  # 1 MoE layer
        assert c["independent_first_dispatches"] == int(n)
    assert rec["prefetch_tokens_per_s"] == {"1": [], "0": []}
    assert "| 4 |" in (tmp_path / "overlap.md").read_text()


def test_call_times_respects_the_budget():
    import time

    import numpy as np

    from moefast.bench.process import call_times

    def slow():
        time.sleep(0.05)
        return np.zeros(1)

    assert len(call_times(slow, repeats=3)) == 3
    times = call_times(slow, repeats=50, budget_s=0.1)  # the warm-up took >= 0.05 s: at most 2 timed calls
    assert 1 <= len(times) <= 2 and min(times) >= 0.05


def test_gpu_check_runs_on_cpu(tmp_path):
    """The GPU script itself, tiny and interpreted, so it does not first break on a lent GPU."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "gpu_check.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--cpu-smoke", "--only", "lowering,bandwidth,kernel",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = json.loads(out.read_text())["checks"]
    assert set(checks) == {"lowering", "bandwidth", "kernel"}
    assert checks["lowering"]["rows"][0]["triton_custom_call"] is True
    assert checks["bandwidth"]["rows"][0]["bandwidth_GBs"] > 0
    kernel = checks["kernel"]["rows"]
    assert len(kernel) == 8 and all(r["status"] == "ok" and r["median_ms"] > 0 for r in kernel)


def test_gpu_check_rejects_an_unknown_check_name(capsys, monkeypatch):
    """A misspelt --only would otherwise run nothing and exit 0, wasting a lent GPU's time."""
    import importlib.util
    import sys
    from pathlib import Path

    import pytest

    spec = importlib.util.spec_from_file_location(
        "gpu_check", Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as e:
        module.main(["--cpu-smoke", "--only", "kernel,atention"])
    assert e.value.code == 2
    assert "no check named atention; the checks: lowering," in capsys.readouterr().err


def test_precision_bench_verdict_is_on_the_means_over_seeds(capsys):
    """moefast bench precision's figures from the runs' metrics records (final training loss: the
    mean of the last logged records; eval loss at the end), averaged over the seeds, fp8 against
    bf16 within 2 %; and its CLI help (a '%' in argparse help once crashed every bench --help)."""
    from moefast.bench import precision
    from moefast.cli import main

    def records(*losses, eval_loss):
        return [*({"kind": "train", "step": 10 * i, "loss": v} for i, v in enumerate(losses, 1)),
                {"kind": "eval", "step": 10 * len(losses), "eval_loss": eval_loss}]

    runs = [precision._summary("bf16", 0, records(9.0, 2.0, 2.0, eval_loss=1.70), 1.0, window=2),
            precision._summary("fp8", 0, records(9.0, 2.1, 2.1, eval_loss=1.75), 1.0, window=2),
            precision._summary("bf16", 1, records(9.0, 2.0, 2.0, eval_loss=1.80), 1.0, window=2),
            precision._summary("fp8", 1, records(9.0, 1.9, 1.9, eval_loss=1.72), 1.0, window=2)]
    r = precision._verdict(None, [], 30, 2, 0.02, runs, 2, "x")
    assert r.mean_train == {"bf16": 2.0, "fp8": 2.0} and abs(r.relative_eval - (1.735 / 1.75 - 1)) < 1e-12
    assert r.within and "mean of 2" in precision.format_table(r)
    one = precision._verdict(None, [], 30, 2, 0.02, runs[:2], 1, "x")  # seed 0 alone: +5 % train loss
    assert not one.within and "NOT within 2%" in precision.format_table(one)
    lower = precision._verdict(None, [], 30, 2, 0.02, runs[2:], 1, "x")  # seed 1: fp8 5 % lower is within
    assert lower.relative_train < -0.02 and lower.within
    with pytest.raises(SystemExit) as e:
        main(["bench", "precision", "--help"])
    assert e.value.code == 0 and "--seeds" in capsys.readouterr().out


@pytest.mark.parametrize("target", [None, "train", "memory", "routing", "cache", "malloc", "overlap", "gpu-compile",
                                    "linear-attention", "sparse-attention", "data", "precision",
                                    "optimizer"])
def test_each_bench_target_has_its_own_help(target, capsys, monkeypatch):
    """moefast bench TARGET --help: that benchmark's description and its options only (it once printed
    the whole bench help); bench --help: every option."""
    from moefast.cli import BENCH_OPTIONS, _parser, main
    from moefast.cli.bench import BENCH_TARGETS

    monkeypatch.setenv("COLUMNS", "1000")  # one line a help: the texts compare whole
    assert list(BENCH_TARGETS) == list(BENCH_OPTIONS)
    with pytest.raises(SystemExit) as e:
        main(["bench", *([target] if target else []), "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    bench_actions = [a for a in _parser().bench_parser._actions if a.option_strings and a.dest != "help"]
    listed = set(re.findall(r"^  (-[-\w]+)", out.split("\noptions:\n")[1], re.M)) - {"-h"}
    if target is None:
        assert out.startswith("usage: moefast bench [-h]") and listed == {a.option_strings[0] for a in bench_actions}
        return
    assert out.startswith(f"usage: moefast bench {target} [-h]") and f"\n\n{BENCH_TARGETS[target]}\n\n" in out
    assert listed == {a.option_strings[0] for a in bench_actions if a.dest in BENCH_OPTIONS[target]}
    assert ("section.key=value" in out) == ("overrides" in BENCH_OPTIONS[target])
    steps = re.search(r"^  --steps STEPS +(.*)$", out, re.M)  # its help says what it is to this target alone
    assert steps is None or not re.search(r"\b(train|memory|cache|malloc|overlap|data|precision|optimizer): ", steps[1])
