"""Host memory stays mapped between steps: the CLI's train process re-faults no pages per step."""

import json
import os
import subprocess
import sys

import pytest

from moefast import host_memory

# Large enough that each step's XLA temporaries (≈70 MiB) are well above glibc's mmap threshold.
MODEL = ["model.d_model=64", "model.d_ff=128", "model.num_layers=2", "model.num_heads=2", "model.head_dim=32",
         "moe.num_experts=4", "data.batch_size=16", "data.seq_len=256", "train.warmup_steps=1",
         "train.eval_batches=1", "train.steps=12", "train.log_every=4"]


def _train(run_dir, text_dir, mode):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[host_memory.ENV_VAR] = mode
    p = subprocess.run([sys.executable, "-m", "moefast", "train", "--run-dir", str(run_dir), "--no-progress",
                        f"data.source={text_dir}", *MODEL], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert f"host malloc {mode}" in p.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    summary = [r for r in records if r["kind"] == "summary"][0]
    return train, summary


def test_train_process_takes_far_fewer_page_faults_per_step(tmp_path, text_dir):
    keep, keep_summary = _train(tmp_path / "keep", text_dir, "keep")
    system, system_summary = _train(tmp_path / "system", text_dir, "system")
    # glibc's defaults hand the step's temporaries back to the kernel: tens of thousands of faults
    # per step in every log window. Kept mapped, the heap grows once, then no step faults.
    faults = {"keep": [r["page_faults_per_step"] for r in keep] + [keep_summary["page_faults_per_step"]],
              "system": [r["page_faults_per_step"] for r in system] + [system_summary["page_faults_per_step"]]}
    assert min(faults["system"]) > 10_000, faults
    assert faults["keep"][-2] < 0.01 * faults["system"][-2], faults  # the last log window
    # The whole run's mean includes the heap's one-off growth to its working size in the first
    # window (~40k faults per step there), so it is only compared, not bounded tightly.
    assert faults["keep"][-1] < faults["system"][-1], faults
    # Same computation either way.
    assert [r["loss"] for r in keep] == [r["loss"] for r in system]


def test_a_bad_mode_is_one_clear_error(tmp_path):
    env = dict(os.environ, **{host_memory.ENV_VAR: "tcmalloc"})
    p = subprocess.run([sys.executable, "-m", "moefast", "train", "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: MOEFAST_HOST_MALLOC='tcmalloc' is not one of")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="'keep'"):
        host_memory.configure("lots")  # validated even after the first call


def test_this_test_process_keeps_memory():
    # conftest imports jax before moefast, but no backend has started by then.
    assert host_memory.status() == "keep"
