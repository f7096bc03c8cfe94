"""Reliability: non-finite steps, signals, expert-load monitoring and alerts, expert warm-up."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_MODEL
from moefast.config import load_config
from moefast.data import load_corpus
from moefast.config import MoEConfig
from moefast.parallel.expert import moe_ffn
from moefast.train import Trainer, TrainingError
from moefast.train.monitor import ExpertLoadMonitor, load_stats
from moefast.train.step import BATCH_KEYS, ModelDef, aux_loss_coef, eval_step, train_step


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def make_batch(b=8, t=32, seed=0):
    rng = np.random.default_rng(seed)
    batch = {k: jnp.asarray(rng.integers(1, 200, (b, t)), jnp.int32) for k in BATCH_KEYS}
    batch["positions"] = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    batch["segment_ids"] = jnp.ones((b, t), jnp.int32)
    batch["loss_weight"] = jnp.ones((b, t), jnp.float32)
    return batch


# ---------------------------------------------------------------- non-finite steps


def test_nonfinite_step_changes_nothing_but_the_step_counter():
    cfg = load_config(None, SMALL_MODEL)
    md = ModelDef(cfg, 259)
    step = jax.jit(lambda s, b, k: train_step(md, s, b, k))
    key = jax.random.key(0)
    state = md.init_state(0)
    good = make_batch()
    bad = dict(good, loss_weight=good["loss_weight"].at[0, 0].set(jnp.nan))

    after_bad, m = step(state, bad, key)
    assert int(m["nonfinite"]) == 1 and not np.isfinite(float(m["total_loss"]))
    assert int(after_bad["step"]) == 1
    for part in ("params", "opt_state", "routing"):
        for x, y in zip(jax.tree.leaves(state[part]), jax.tree.leaves(after_bad[part])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=part)

    after_good, m2 = step(after_bad, good, key)
    assert int(m2["nonfinite"]) == 0
    # The skipped step did not advance the learning-rate schedule: the first real update uses
    # the learning rate of update 0 (0.0 in the linear warm-up), not that of step 1.
    _, m_fresh = step(md.init_state(0), good, key)
    assert float(m2["learning_rate"]) == float(m_fresh["learning_rate"]) == 0.0
    after_two, _ = step(after_good, good, key)
    changed = [not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(after_two["params"]))]
    assert all(changed)


# The in-process runs' train.steps (part of the learning-rate schedule, so of the compiled step): one
# step program for all of them (test_train.py's too), compiled once and then loaded from the session's
# compilation cache.
STEPS = "train.steps=10"


def poison(monkeypatch, bad_steps):
    """Makes the loss of the given (1-based) steps NaN through a NaN loss weight."""
    original = Trainer.put_batch
    calls = {"n": 0}

    def put_batch(self, batch):
        calls["n"] += 1
        out = original(self, batch)
        if calls["n"] in bad_steps:
            out["loss_weight"] = out["loss_weight"] * jnp.nan
        return out

    monkeypatch.setattr(Trainer, "put_batch", put_batch)


def test_loop_skips_nonfinite_steps_and_logs_them(small_config, tmp_path, monkeypatch):
    poison(monkeypatch, {3, 4})
    cfg = small_config(STEPS, "train.log_every=1", "train.eval_every=0", "train.max_consecutive_nonfinite=3")
    logs = []
    summary = Trainer(cfg, tmp_path, log=logs.append, progress=False).run()
    assert summary.steps == 10 and summary.skipped_steps == 2
    assert [r["step"] for r in records(tmp_path, "nonfinite")] == [3, 4]
    assert any("step 3: non-finite loss" in line and "update skipped (1 in a row)" in line for line in logs)
    assert np.isfinite(summary.final_loss)


def test_loop_stops_after_max_consecutive_nonfinite_naming_the_last_checkpoint(small_config, tmp_path, monkeypatch):
    poison(monkeypatch, set(range(5, 20)))
    cfg = small_config(STEPS, "train.eval_every=0", "train.checkpoint_every=2",
                       "train.max_consecutive_nonfinite=3")
    with pytest.raises(TrainingError, match=r"step 7: 3 consecutive steps with non-finite loss or gradients "
                                            r"since step 5") as e:
        Trainer(cfg, tmp_path, log=None, progress=False).run()
    assert f"Last checkpoint from before step 5: {tmp_path / 'checkpoints' / '4'}." in str(e.value)
    # The good checkpoints are intact and a restart (with the cause fixed) resumes from the last.
    monkeypatch.undo()
    summary = Trainer(cfg, tmp_path, log=None, progress=False).run()
    assert summary.steps == 10 and summary.skipped_steps == 0


# ---------------------------------------------------------------- signals


def _start(run_dir, text_dir, steps):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "moefast", "train", "--run-dir", str(run_dir), "--cpu-devices", "1", "--no-progress",
           *SMALL_MODEL, f"data.source={text_dir}", f"train.steps={steps}", "train.log_every=1",
           "train.eval_every=0", "train.checkpoint_every=0"]
    return cmd, env


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_finishes_the_step_checkpoints_and_exits_0_then_resumes(tmp_path, text_dir, sig):
    run = tmp_path / "run"
    cmd, env = _start(run, text_dir, steps=100_000)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until a few steps are logged
            m = run / "metrics.jsonl"
            if m.exists() and sum(1 for line in m.read_text().splitlines() if '"train"' in line) >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("training did not start")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"stopped by {sig.name} after step" in out
    assert f"resume with the same command: moefast train --run-dir {run} --cpu-devices 1 --no-progress" in out
    stopped = json.loads([line for line in (run / "metrics.jsonl").read_text().splitlines()
                          if '"summary"' in line][-1])
    n = stopped["step"]
    assert stopped["stopped_by"] == sig.name and (run / "checkpoints" / str(n)).is_dir()
    assert [r["step"] for r in records(run, "train")] == list(range(1, n + 1))

    cmd, env = _start(run, text_dir, steps=100_000)  # the same compiled step (from the cache), to step n + 2
    p = subprocess.run([*cmd, f"train.stop_at={n + 2}"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"resuming from step {n}" in p.stdout
    assert [r["step"] for r in records(run, "train")][-2:] == [n + 1, n + 2]


# ---------------------------------------------------------------- monitoring and alerts


def test_load_stats_and_monitor_alert_logic():
    s = load_stats(np.array([[4, 4, 4, 4], [13, 1, 1, 1], [8, 8, 0, 0]]))
    np.testing.assert_allclose(s["max_load_ratio"], [1.0, 3.25, 2.0])
    np.testing.assert_allclose(s["expert_fraction"][1], [13 / 16, 1 / 16, 1 / 16, 1 / 16])
    mon = ExpertLoadMonitor(max_load_ratio=2.5, patience=2)
    balanced, skewed = [4, 4, 4, 4], [13, 1, 1, 1]
    assert mon.update(np.array([skewed])) == []
    assert mon.update(np.array([balanced])) == []  # the run of intervals is broken
    assert mon.update(np.array([skewed])) == []
    (alert,) = mon.update(np.array([skewed]))
    assert alert["layer"] == 0 and "3.25 > monitor.max_load_ratio=2.5 for 2" in alert["reason"]
    assert mon.update(np.array([skewed])) == [] and mon.update(np.array([skewed])) == []  # once per episode
    mon.update(np.array([balanced]))  # cleared
    mon.update(np.array([skewed]))
    assert len(mon.update(np.array([skewed]))) == 1  # a new episode alerts again
    idle = ExpertLoadMonitor(max_load_ratio=10, patience=2)
    idle.update(np.array([[8, 8, 0, 1]]))
    (alert,) = idle.update(np.array([[8, 8, 0, 1]]))
    assert alert["idle_experts"] == [2] and "expert(s) [2] got no tokens for 2" in alert["reason"]
    assert alert["layer_name"] == "MoE layer 0"


def test_alerts_name_the_mtp_block(small_config):
    """The multi-token prediction block's row comes after the main model's MoE layers: its alert
    names it (there is no "MoE layer 2" in a model of two MoE layers)."""
    names = small_config("model.mtp_depth=2").model.moe_layer_names()
    assert names == ["MoE layer 0", "MoE layer 1", "MTP module 1", "MTP module 2"]
    assert small_config().model.moe_layer_names() == ["MoE layer 0", "MoE layer 1"]
    assert small_config("model.mtp_depth=1", "model.num_dense_layers=2").model.moe_layer_names() == []  # dense MTP
    mon = ExpertLoadMonitor(max_load_ratio=10, patience=1, layer_names=names)
    alerts = mon.update(np.array([[4, 4, 4, 4], [4, 4, 4, 4], [8, 8, 0, 0], [4, 4, 4, 4]]))
    assert [(a["layer"], a["layer_name"]) for a in alerts] == [(2, "MTP module 1")]


def _tensorboard_tags(run_dir):
    """The tags of every summary value in the run's TensorBoard event files (TFRecord framing: the
    length, its CRC, the serialized Event, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    tags = []
    for f in sorted((run_dir / "tensorboard").iterdir()):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            tags += [v.tag for v in Event.FromString(data[pos + 12:pos + 12 + n]).summary.value]
            pos += 12 + n + 4
    return tags


def test_mtp_rows_are_named_in_metrics_and_tensorboard(small_config, tmp_path):
    """The per-layer rows of the multi-token prediction block come after the main model's MoE layers:
    TensorBoard tagged them as one more main layer (train/dropped_fraction/moe_layer_2 in a model of
    two MoE layers) and metrics.jsonl left them unnamed. Now each train record's layer_names names the
    rows and the tags are named after them (the main layers' tags unchanged)."""
    from moefast.train.metrics import MetricsWriter
    from moefast.train.mfu import Peak
    from moefast.train.timing import StepBook

    cfg = small_config("model.mtp_depth=1", "train.log_every=1")
    writer = MetricsWriter(tmp_path)
    book = StepBook(cfg, t_start=time.perf_counter(), last=1, writer=writer, say=lambda s: None, bar=None, ckpt=None,
                    flops_per_token=1.0, peak=Peak(None, None, 1, "test"))
    rows = np.arange(3, dtype=np.float32)  # two MoE layers, then the MTP module
    book.record(1, {"loss": np.float32(2.0), "total_loss": np.float32(2.5), "aux_loss": np.float32(1.0),
                    "z_loss": np.float32(0.1), "grad_norm": np.float32(1.0), "learning_rate": np.float32(1e-3),
                    "nonfinite": np.int32(0), "mtp_loss": np.float32(2.2), "mtp_loss_depth_1": np.float32(2.2),
                    "tokens_per_expert": np.array([[4, 4, 4, 4], [8, 0, 4, 4], [2, 2, 6, 6]], np.int32),
                    "dropped_fraction": rows, "router_entropy": rows, "aux_loss_per_layer": rows,
                    "z_loss_per_layer": rows})
    book.flush()
    writer.close()
    (rec,) = records(tmp_path, "train")
    assert rec["layer_names"] == ["MoE layer 0", "MoE layer 1", "MTP module 1"] == cfg.model.moe_layer_names()
    assert rec["dropped_fraction"] == [0.0, 1.0, 2.0]
    tags = _tensorboard_tags(tmp_path)
    for key in ("dropped_fraction", "router_entropy", "aux_loss_per_layer", "z_loss_per_layer", "max_load_ratio",
                "expert_load"):
        assert sorted(t for t in tags if t.startswith(f"train/{key}/")) == [
            f"train/{key}/moe_layer_0", f"train/{key}/moe_layer_1", f"train/{key}/mtp_module_1"], key
    assert len(tags) == len(set(tags)) and not [t for t in tags if t.endswith("moe_layer_2")]
    # a record without layer_names (or another count of rows): moe_layer_<row>, as before
    other = tmp_path / "other"
    w = MetricsWriter(other)
    w.write("train", 1, {"dropped_fraction": rows, "layer_names": ["MoE layer 0"]})
    w.close()
    assert _tensorboard_tags(other) == [f"train/dropped_fraction/moe_layer_{i}" for i in range(3)]


def test_monitoring_records_in_metrics_and_collapsed_router_alert(small_config, tmp_path, monkeypatch):
    """A router forced to collapse (a +100 selection bias on experts 0 and 1 of every layer)
    raises the load alert and the idle-expert alert after `patience` log intervals."""
    original = Trainer.init_state

    def collapsed(self):
        state = original(self)
        state["routing"]["bias"] = state["routing"]["bias"].at[:, :2].set(100.0)
        return state

    monkeypatch.setattr(Trainer, "init_state", collapsed)
    cfg = small_config(STEPS, "train.log_every=1", "train.eval_every=0",
                       "monitor.max_load_ratio=1.5", "monitor.patience=2")
    logs = []
    Trainer(cfg, tmp_path, log=logs.append, progress=False).run()
    train = records(tmp_path, "train")
    for r in train:
        assert {"expert_fraction", "max_load_ratio", "router_entropy", "dropped_fraction",
                "aux_loss_per_layer", "z_loss_per_layer", "tokens_per_expert"} <= r.keys()
        assert np.asarray(r["expert_fraction"]).shape == (2, 4)
        np.testing.assert_allclose(r["max_load_ratio"], [2.0, 2.0])  # all tokens on 2 of 4 experts
    alerts = records(tmp_path, "alert")
    assert [(a["step"], a["layer"]) for a in alerts] == [(2, 0), (2, 1)]  # once per episode, per layer
    assert alerts[0]["idle_experts"] == [2, 3]
    assert any("warning: step 2: MoE layer 0: max/mean expert load 2.00" in line for line in logs)


def test_default_monitoring_has_no_alert_on_a_healthy_run(small_config, tmp_path):
    Trainer(small_config(STEPS, "train.log_every=1", "train.eval_every=0"),
            tmp_path, log=None, progress=False).run()
    assert records(tmp_path, "alert") == []
    assert all(0 < np.min(r["router_entropy"]) <= np.log(4) + 1e-6 for r in records(tmp_path, "train"))


# ---------------------------------------------------------------- expert warm-up


def _skewed_inputs(t=256, d=8, e=4):
    x = jnp.asarray(np.abs(np.random.default_rng(0).normal(size=(1, t, d))) + 0.5, jnp.float32)
    router = np.zeros((d, e), np.float32)
    router[:, 0] = 0.3  # every token prefers expert 0, then the rest tie
    w_in = jnp.asarray(np.random.default_rng(1).normal(size=(e, d, 8)) * 0.1, jnp.float32)
    w_out = jnp.asarray(np.random.default_rng(2).normal(size=(e, 4, d)) * 0.1, jnp.float32)
    return x, jnp.ones((1, t), bool), jnp.asarray(router), w_in, w_out


@pytest.mark.parametrize("mode", ["uniform", "noise"])
def test_warmup_routing_spreads_tokens_and_is_off_outside_warmup(mode):
    x, mask, router, w_in, w_out = _skewed_inputs()
    spec = MoEConfig(num_experts=4, top_k=1, capacity_factor=4.0, min_capacity=1, warmup_routing=mode,
                     warmup_noise=2.0)
    key = jax.random.key(3)
    plain = moe_ffn(x, mask, router, w_in, w_out, spec)[1].tokens_per_expert
    assert np.asarray(plain).tolist() == [256, 0, 0, 0]
    warm = moe_ffn(x, mask, router, w_in, w_out, spec, warmup_key=key, warmup_active=jnp.asarray(True))
    counts = np.asarray(warm[1].tokens_per_expert)
    assert counts.min() >= 20, counts  # every expert sees data
    again = moe_ffn(x, mask, router, w_in, w_out, spec, warmup_key=key, warmup_active=jnp.asarray(True))
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(warm[0]))  # same key, same routing
    off = moe_ffn(x, mask, router, w_in, w_out, spec, warmup_key=key, warmup_active=jnp.asarray(False))
    np.testing.assert_array_equal(np.asarray(off[1].tokens_per_expert), np.asarray(plain))


def test_warmup_follows_the_step_and_evaluation_never_uses_it():
    warm_cfg = load_config(None, SMALL_MODEL + ["moe.warmup_steps=5", "moe.warmup_routing=uniform",
                                                "moe.aux_loss_coef_start=0.1"])
    plain_cfg = load_config(None, SMALL_MODEL)
    warm, plain = ModelDef(warm_cfg, 259), ModelDef(plain_cfg, 259)
    batch, key = make_batch(), jax.random.key(0)
    state = warm.init_state(0)

    # one compiled step per model (steps 0 and 5 of the warm-up model are the same program)
    steps = {md: jax.jit(lambda s, md=md: train_step(md, s, batch, key)[1]) for md in (warm, plain)}

    def metrics(md, step):
        return steps[md](dict(state, step=jnp.asarray(step, jnp.int32)))

    during, after, base = metrics(warm, 0), metrics(warm, 5), metrics(plain, 5)
    assert not np.array_equal(np.asarray(during["tokens_per_expert"]), np.asarray(base["tokens_per_expert"]))
    np.testing.assert_array_equal(np.asarray(after["tokens_per_expert"]), np.asarray(base["tokens_per_expert"]))
    assert float(after["loss"]) == float(base["loss"])
    # The aux-loss coefficient decays linearly from the start value to the base over the warm-up.
    coefs = [float(aux_loss_coef(warm_cfg, jnp.asarray(s))) for s in (0, 2, 5, 9)]
    np.testing.assert_allclose(coefs, [0.1, 0.1 - 0.09 * 2 / 5, 0.01, 0.01], rtol=1e-6)
    assert float(during["aux_loss_coef"]) == pytest.approx(0.1)
    # Evaluation: no warm-up randomness, whatever the config says.
    bpt = np.ones(259, np.int32)
    a = eval_step(warm, state["params"], state["routing"], batch, bpt)
    b = eval_step(plain, state["params"], state["routing"], batch, bpt)
    assert float(a["ce_sum"]) == float(b["ce_sum"])


def test_evaluation_loss_of_a_sequence_does_not_depend_on_its_batch_mates():
    """Training would drop tokens here (capacity factor 0.5, all tokens preferring one expert is
    likely); evaluation routes every token without noise, so row 0's loss is the same whatever
    rows share its batch."""
    cfg = load_config(None, SMALL_MODEL + ["moe.capacity_factor=0.5", "moe.warmup_steps=100"])
    md = ModelDef(cfg, 259)
    state = md.init_state(0)
    bpt = np.ones(259, np.int32)
    row0 = make_batch(seed=1)
    results = []
    for seed in (2, 3):
        batch = dict(make_batch(seed=seed))
        batch = {k: v.at[0].set(row0[k][0]) for k, v in batch.items()}
        batch["loss_weight"] = jnp.zeros_like(batch["loss_weight"]).at[0].set(1.0)  # score row 0 only
        results.append(float(eval_step(md, state["params"], state["routing"], batch, bpt)["ce_sum"]))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
    # The same rows in a training step do interact (capacity is shared): the test can tell.
    train_batches = []
    for seed in (2, 3):
        batch = {k: v.at[0].set(row0[k][0]) for k, v in make_batch(seed=seed).items()}
        train_batches.append(batch)
    step = jax.jit(lambda b: train_step(md, state, b, jax.random.key(0))[1])  # one compile for both batches
    m = [step(b) for b in train_batches]
    assert float(m[0]["dropped_fraction"][0]) > 0


def test_sigterm_in_process_stops_after_that_step_and_restores_handlers(small_config, tmp_path, monkeypatch):
    original = Trainer.put_batch
    calls = {"n": 0}

    def put_batch(self, batch):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 2 is being prepared
        return original(self, batch)

    monkeypatch.setattr(Trainer, "put_batch", put_batch)
    before = signal.getsignal(signal.SIGTERM)
    # No prefetch: put_batch runs in the loop, just before step 2 (with prefetch it runs earlier, on
    # the prefetch thread, and the signal would arrive during step 1).
    cfg = small_config(STEPS, "train.eval_every=0", "train.checkpoint_every=0", "data.prefetch=0")
    summary = Trainer(cfg, tmp_path, log=None, progress=False).run()
    assert summary.stopped_by == "SIGTERM" and summary.steps == 2 and summary.checkpoint.endswith("/2")
    assert signal.getsignal(signal.SIGTERM) is before


def test_signal_before_the_first_step_runs_no_step(small_config, tmp_path, monkeypatch):
    from moefast.train import signals

    original = signals.StopRequest.install

    def install_then_signal(self):
        original(self)
        os.kill(os.getpid(), signal.SIGINT)  # e.g. Ctrl-C while the step compiles

    monkeypatch.setattr(signals.StopRequest, "install", install_then_signal)
    cfg = small_config(STEPS, "train.eval_every=0")
    summary = Trainer(cfg, tmp_path, log=None, progress=False).run()
    assert summary.stopped_by == "SIGINT" and summary.steps_this_run == 0 and summary.checkpoint is None
    assert not any((tmp_path / "checkpoints").iterdir())
