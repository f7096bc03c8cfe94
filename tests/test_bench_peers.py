"""``benchmarks/peers.py``: the three sides run and are recorded; the profile's op grouping is right."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

from moefast.bench import xla_profile

PEERS_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


def _load_peers():
    """benchmarks/peers.py as a module (it is a script outside the package)."""
    spec = importlib.util.spec_from_file_location("benchmarks_peers", PEERS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


peers = _load_peers()


def test_peers_bench_end_to_end(tmp_path, text_dir, monkeypatch):
    pytest.importorskip("torch", reason="the peers extra is not installed (pip install -e '.[peers]')")
    pytest.importorskip("transformers", reason="the peers extra is not installed (pip install -e '.[peers]')")
    from conftest import SMALL_MODEL

    # The child processes run as `moefast train` does by default: one CPU device, not the test
    # session's 8 virtual ones.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))

    out = tmp_path / "peers.json"
    assert peers.run_cli(json_out=str(out), rounds=1, steps=2,
                         overrides=SMALL_MODEL + [f"data.source={text_dir}"]) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["moefast_bare"]["tokens_per_s"] > 0
    assert rec["moefast_train_tokens_per_s"] > 0
    assert rec["hf"]["tokens_per_s"] > 0
    assert rec["moefast_bare"]["steps"] == rec["hf"]["steps"] == 2
    assert rec["train_over_hf"] > 0 and rec["bare_over_hf"] > 0
    # The HF model follows the overrides: same shapes, so the same parameter count.
    assert rec["shapes"]["hidden_size"] == 32 and rec["shapes"]["num_local_experts"] == 4
    assert rec["moefast_params"] == rec["hf_params"]
    assert (rec["hf_experts_implementation"], rec["hf_attn_implementation"]) == ("grouped_mm", "sdpa")
    assert rec["torch_threads"] >= 1 and rec["torch_version"] and rec["jax_version"] == jax.__version__
    assert rec["platform"] == "cpu (1 device(s))"
    assert "train / HF" in (tmp_path / "peers.md").read_text()


def test_missing_peer_packages_is_one_clear_error(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "torch" else real(name, *a, **k))
    assert peers.main(["--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert err.endswith("pip install -c constraints.txt -e '.[peers]'")


def test_the_script_runs_by_path_and_the_cli_points_at_it(capsys):
    p = subprocess.run([sys.executable, str(PEERS_SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert all(o in p.stdout for o in ("--config", "--json", "--steps", "--rounds", "--profile", "--cpu-devices"))
    from moefast.cli import main

    assert main(["bench", "peers", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: moefast bench peers moved") and "python benchmarks/peers.py" in err


def test_hlo_kinds_and_trace_times(tmp_path):
    tx = optax.adamw(1e-3)

    def f(x, w, idx, opt_state):
        g = jnp.tanh(x @ w)[idx]  # a dot, then a gather (the tanh fuses into one of them)
        grads = x.T @ g
        updates, opt_state = tx.update(grads, opt_state, w)  # optimizer code (optax)
        return optax.apply_updates(w, updates), opt_state, jnp.sum(g, axis=0), jnp.exp(x) * 3.0  # elementwise

    x, w = jnp.ones((256, 64)), jnp.ones((64, 64)) * 0.01
    idx = jnp.arange(256) % 7
    args = (x, w, idx, tx.init(w))
    compiled = jax.jit(f).lower(*args).compile()
    text = compiled.as_text()
    kinds = xla_profile.classify_hlo(text)
    instrs, comps, _ = xla_profile.parse_hlo(text)
    entry = re.search(r"^ENTRY %?([^\s(]+)", text, re.MULTILINE).group(1)
    entry_kinds = {n: kinds[n] for n in comps[entry]}
    assert {"matmul", "elementwise/fusion", "gather/scatter", "optimizer"} <= set(entry_kinds.values()), entry_kinds

    def fused_opcodes(name):
        ins = instrs[name]
        return {instrs[m].opcode for c in ins.calls for m in comps.get(c, [])} | {ins.opcode}

    for name, kind in entry_kinds.items():
        if "dot" in fused_opcodes(name):
            assert kind == "matmul", name
        elif "gather" in fused_opcodes(name):
            assert kind == "gather/scatter", name

    # The trace names its op events like the compiled program's instructions.
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(2):
            jax.block_until_ready(compiled(*args))
    (trace,) = glob.glob(str(tmp_path / "**" / "*.trace.json.gz"), recursive=True)
    times = xla_profile.xla_trace_times(trace, kinds, steps=2)
    assert times["op_events"] > 0 and times["kinds"]["matmul"] > 0
    assert set(times["kinds"]) == set(peers.KINDS)

    assert [peers.torch_kind(n) for n in ("aten::mm", "aten::_grouped_mm", "aten::index", "aten::sum", "aten::cat",
                                          "aten::silu_backward", "MmBackward0")] == [
        "matmul", "matmul", "gather/scatter", "reduction", "copy/transpose/concatenate", "elementwise/fusion", "other"]
