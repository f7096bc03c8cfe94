"""The routing benchmark compares equal computations and writes what it promises."""

import dataclasses
import json

from moefast.bench import routing as bench


def test_implementations_agree():
    assert bench.check_fused_matches_onehot(tokens=64, experts=4) < 1e-4


def test_records_and_table(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_GRID", [(64, 4), (128, 8)])
    out = tmp_path / "routing.json"
    assert bench.run_cli(quick=True, json_out=str(out), repeats=1) == 0
    records = json.loads(out.read_text())
    assert {(r["impl"], r["tokens"], r["experts"]) for r in records} == {
        (i, t, e) for i in bench.IMPLS for t, e in [(64, 4), (128, 8)]}
    for r in records:
        assert {"impl", "tokens", "experts", "top_k", "time_ms", "temp_bytes"} <= r.keys()
        assert r["time_ms"] > 0 and r["temp_bytes"] >= 0 and r["top_k"] == 2
    table = (tmp_path / "routing.md").read_text()
    assert "| 128 | 8 |" in table and "onehot / fused" in table


def test_onehot_is_skipped_when_too_big():
    recs = bench.bench_routing([(256, 4)], impls=("onehot",), repeats=1, onehot_max_bytes=1.0, log=None)
    assert recs[0].skipped and recs[0].time_ms is None
    assert "skipped" in bench.format_table(recs)
    assert dataclasses.asdict(recs[0])["skipped"]
