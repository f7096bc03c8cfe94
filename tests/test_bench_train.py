"""``moefast bench train``: the lever table on an expert-parallel mesh, its JSON and markdown, and
the profile's split by kind of work."""

import json

import pytest

from conftest import SMALL_MODEL
from moefast.bench import train as bench
from moefast.config import ConfigError


def test_ablation_variants():
    """The variants of ``--ablate`` and what each changes (the ablated run itself and its
    table: tests/test_notebooks.py::test_scaling)."""
    variants = bench.variant_overrides(True, 4, "gpu")
    by = {name: settings for name, _, settings in variants}
    assert list(by) == ["baseline", "+caching", "+overlap", "+slot dispatch", "+fused routing kernel", "all levers"]
    assert by["baseline"] == bench.BASELINE
    assert by["+overlap"] == ["data.prefetch=1", "moe.overlap_chunks=2"]  # expert axis 4: chunks
    assert by["+slot dispatch"] == ["moe.dispatch=slot"] and by["+fused routing kernel"] == ["moe.routing_impl=auto"]
    assert by["all levers"] == ["cache.tables=true", "data.prefetch=1", "moe.overlap_chunks=2",
                                "moe.dispatch=slot", "moe.routing_impl=auto"]
    # on CPU routing_impl=auto is the reference: no row that would measure nothing
    assert "+fused routing kernel" not in [name for name, _, _ in bench.variant_overrides(True, 4, "cpu")]
    assert [name for name, _, _ in bench.variant_overrides(False, 4)] == ["config"]


def test_record_and_profile_on_an_expert_mesh(tmp_path, text_dir):
    out = tmp_path / "train.json"
    overrides = SMALL_MODEL + [f"data.source={text_dir}", "mesh.data=2", "mesh.expert=4", "model.num_layers=1"]
    assert bench.run_cli(json_out=str(out), steps=2, rounds=1, ablate=False, overrides=overrides,
                         profile_dir=str(tmp_path / "prof")) == 0
    r = json.loads(out.read_text())
    assert r["mesh"] == {"data": 2, "fsdp": 1, "expert": 4}
    (v,) = r["records"]
    assert len(v["tokens_per_s_rounds"]) == 1 and v["tokens_per_s"] > 0
    assert v["step_ms_p10"] <= v["step_ms"] <= v["step_ms_p90"]
    assert 0 < v["mfu"] < 1 and v["compile_s"] > 0 and v["memory_bytes"] > 0
    kinds = v["profile"]["kinds_ms"]
    assert set(kinds) == {"matmul", "routing", "dispatch/combine", "collectives", "optimizer", "other"}
    assert kinds["matmul"] > 0 and kinds["collectives"] > 0 and kinds["optimizer"] > 0
    assert (tmp_path / "prof").is_dir()
    md = out.with_suffix(".md").read_text()
    assert "| config |" in md and "dispatch/combine" in md


def test_ablation_needs_a_capacity(text_dir):
    with pytest.raises(ConfigError, match="one-hot dispatch, which needs a capacity"):
        bench.bench_train(None, SMALL_MODEL + [f"data.source={text_dir}", "moe.capacity_factor=0"], steps=1,
                          rounds=1, ablate=True)


def test_onehot_einsums_are_dispatch_work_not_matmul(small_config, tmp_path):
    """classify_work puts GShard's one-hot einsums (dots traced from moefast.routing.dispatch) under
    dispatch/combine and keeps the experts' dots as matmul; by slot, dispatch has no dot at all."""
    import jax

    from moefast.bench.xla_profile import classify_work, parse_hlo
    from moefast.train import Trainer

    def dots_by_kind(dispatch):
        t = Trainer(small_config(f"moe.dispatch={dispatch}", "model.num_layers=1"), tmp_path / dispatch, log=None,
                    progress=False, devices=jax.devices()[:1])
        text = t.compiled_train_step().as_text()
        instrs, comps, _ = parse_hlo(text)
        has_dot = {n for n, i in instrs.items() if i.opcode == "dot" or any(
            instrs[m].opcode == "dot" for c in i.calls for m in comps.get(c, []))}
        kinds = classify_work(text)
        return {k: sum(1 for n in has_dot if kinds[n] == k) for k in set(kinds.values())}

    onehot, slot = dots_by_kind("onehot"), dots_by_kind("slot")
    assert onehot.get("dispatch/combine", 0) >= 4  # dispatch and combine, forward and backward
    assert slot.get("dispatch/combine", 0) == 0
    assert onehot["matmul"] > 0 and slot["matmul"] > 0
