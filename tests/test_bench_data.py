"""``moefast bench data`` runs end to end on tiny corpora and writes the JSON and markdown it promises."""

import json

from moefast.bench import data as bench


def test_bench_data_writes_json_and_tables(tmp_path):
    out = tmp_path / "data.json"
    assert bench.run_cli(json_out=str(out), sizes_gb=(0.0005,), prepare_mb=0.3, rounds=1, batches=3,
                         work_dir=str(tmp_path), train_step=False) == 0
    rec = json.loads(out.read_text())
    tools = {r["tool"] for r in rec["prepare"]}
    assert tools == {"moefast prepare", "datasets map(num_proc=2)"}
    for r in rec["prepare"]:
        if "skipped" in r:  # only when the datasets package is missing
            assert r["tool"] == "datasets map(num_proc=2)" and "not installed" in r["skipped"]
        else:
            assert r["mb_per_s"] > 0 and r["tokens_per_s"] > 0 and r["tokens"] > 0
    paths = [(r["size_gb"], r["path"]) for r in rec["loader"]]
    assert paths == [(0.0, "baseline (imports only)"), (0.0005, "prepared shards"), (0.0005, "in memory")]
    prepared, in_memory = rec["loader"][1], rec["loader"][2]
    assert prepared["tokens"] == in_memory["tokens"] > 0.0005e9 / 2 * 0.9
    for r in (prepared, in_memory):
        assert r["first_batch_s"] > 0 and r["batches_per_s"] > 0 and r["peak_rss_mb"] > 0
    assert rec["train_step"] is None
    md = (tmp_path / "data.md").read_text()
    assert "| moefast prepare | 1 |" in md and "| 0.0005 | prepared shards |" in md and "| 0.0005 | in memory |" in md
    assert list(tmp_path.iterdir()) == [out, tmp_path / "data.md"]  # the generated corpora are removed


def test_in_memory_path_is_skipped_when_it_would_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "_mem_available_bytes", lambda: 1)
    monkeypatch.setattr(bench, "_datasets_available", lambda: False)
    fake = {"first_batch_s": 0.1, "batches_per_s": 10.0, "tokens": 1, "peak_rss_mb": 100.0}
    monkeypatch.setattr(bench, "_loader_child", lambda source, batches: dict(fake))  # no child processes
    r = bench.bench_data(sizes_gb=(0.0002, 0.0004), prepare_mb=0.2, rounds=1, batches=2, train_step=False,
                         work_dir=str(tmp_path), log=None)
    skipped = [x for x in r.loader if "skipped" in x]
    assert [(x["size_gb"], x["path"]) for x in skipped] == [(0.0004, "in memory")]
    assert "skipped: estimated" in bench.format_tables(r)
