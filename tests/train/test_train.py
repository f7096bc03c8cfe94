"""Training loop: single trace, exact resume, learning on real text, metrics records."""

import json

import jax
import numpy as np
import pytest

from moefast.data import load_corpus
from moefast.model.layout import to_layout
from moefast.train import CheckpointError, Checkpointer, Trainer


def read_records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_train_step_is_traced_once(small_config, tmp_path):
    cfg = small_config("train.steps=10", "train.log_every=1", "train.eval_every=5", "train.checkpoint_every=5",
                       "train.peak_tflops=0.001")
    lines = []
    trainer = Trainer(cfg, tmp_path, log=lines.append, progress=False, profile=(4, 5))
    summary = trainer.run()
    assert summary.steps == 10
    assert trainer.trace_count == 1, "the train step was retraced; check for weak types or changing shapes"
    recs = read_records(tmp_path, "train")
    assert [r["step"] for r in recs] == list(range(1, 11))
    for r in recs:
        assert {"loss", "tokens_per_s", "aux_loss", "z_loss", "learning_rate", "tokens_per_expert",
                "dropped_fraction"} <= r.keys()
        assert np.asarray(r["tokens_per_expert"]).shape == (2, 4)
        assert r["model_flops_per_token"] == trainer.flops_per_token > 0
    # MFU = tokens/s * FLOPs per token / peak (train.peak_tflops: 1 GFLOP/s for the whole CPU)
    timed = [r for r in recs if r["step"] not in (1, 4, 5)]  # not the compiling one, not the profiled ones
    for r in timed:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["model_flops_per_token"] / 1e9)
    assert all(r["mfu"] is None and r["tokens_per_s"] is None for r in recs if r["step"] in (1, 4, 5))
    step_lines = [ln for ln in lines if ln.startswith("step") and "tokens/s" in ln]
    assert len(step_lines) == 7 and all(f"MFU {100 * r['mfu']:.1f}%" in ln for ln, r in zip(step_lines, timed))
    # profile=(4, 5): a trace of those steps, which are left out of the rates
    assert list((tmp_path / "profile").rglob("*.trace.json.gz"))
    assert [ln.split("|")[0].strip() for ln in lines if ln.endswith("| profiled")] == ["step      4", "step      5"]
    assert lines.index(next(ln for ln in lines if ln.startswith("profile of steps 4 to 5"))) > lines.index(
        next(ln for ln in lines if ln.startswith("step      5")))
    assert summary.mfu == pytest.approx(summary.tokens_per_s * trainer.flops_per_token / 1e9)
    evals = read_records(tmp_path, "eval")
    assert [r["step"] for r in evals] == [5, 10]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_bits_per_byte"] > 0 for r in evals)
    assert (tmp_path / "tensorboard").is_dir()


STATEFUL = ["model.dropout=0.1", "moe.capacity_mode=dynamic", "moe.aux_free_bias_rate=0.01",
            "moe.warmup_steps=6", "moe.aux_loss_coef_start=0.1"]


# Settings whose compiled step is test_train_step_is_traced_once's (same model and train.steps, which
# the learning-rate schedule holds): later Trainers of the session load it from the compilation cache.
PLAIN = ["train.steps=10", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0"]
PREFETCH = (["data.prefetch=0"], ["data.prefetch=3"], ["data.prefetch=1"])  # full run; first and second half


FIT = ["data.batch_size=16", "train.grad_accum_steps=2", "model.scan_layers=true", "model.remat=minimal", "model.dropout=0.1",
       "model.mtp_depth=1",  # with a multi-token prediction module (unrolled after the scanned stack)
       "train.optimizer=muon"]  # and Muon (its momentum and its matrices split over data 8: ZeRO)


@pytest.mark.parametrize("extra,prefetch", [([], PREFETCH), (["model.dropout=0.1"], ([], [], [])),
                                            (STATEFUL, ([], [], [])), (FIT, ([], [], []))],
                         ids=["plain-prefetch-0-3-1", "dropout", "stateful-routing", "accumulate-scan-remat-mtp-muon"])
def test_resume_is_exact(small_config, tmp_path, extra, prefetch):
    """A run of 2N steps equals a run stopped at N and restarted to 2N, bit for bit. With dropout
    and expert warm-up the step's keys derive from the seed and the restored step, so they repeat;
    the dynamic-capacity load average and the aux-free bias are part of the checkpointed state;
    the learning-rate schedule and the aux coefficient continue from the restored step; Muon's
    momentum is restored like AdamW's moments. Device
    prefetch reads batches ahead of the step, but the checkpoint keeps the position of the last
    batch trained on: the same with no prefetch, 3 batches ahead and 1 ahead after the resume."""
    common = [*PLAIN, *extra]
    corpus = load_corpus(small_config(*common).data)
    full, split = tmp_path / "full", tmp_path / "split"
    lines = []
    Trainer(small_config(*common, *prefetch[0]), full, log=lines.append, progress=False, corpus=corpus).run()
    first = Trainer(small_config(*common, *prefetch[1], "train.stop_at=5"), split, log=None, progress=False,
                    corpus=corpus)
    assert first.run().steps == 5
    second = Trainer(small_config(*common, *prefetch[2]), split, log=None, progress=False, corpus=corpus)
    summary = second.run()
    assert summary.steps == 10 and summary.steps_this_run == 5
    assert second.trace_count == 1  # the restored state fits the compiled step: no retrace

    losses_full = [r["loss"] for r in read_records(full, "train")]
    losses_split = [r["loss"] for r in read_records(split, "train")]
    assert len(losses_full) == 10 and losses_split == losses_full  # exact float equality
    if "model.mtp_depth=1" in extra:  # its loss logged apart (and in the total), replayed exactly too
        mtp = [(r["mtp_loss"], r["mtp_loss_depth_1"]) for r in read_records(split, "train")]
        assert mtp == [(r["mtp_loss"], r["mtp_loss_depth_1"]) for r in read_records(full, "train")]
        assert all(a == b and np.isfinite(a) and a > 0 for a, b in mtp)
        assert all(r["total_loss"] > r["loss"] for r in read_records(full, "train"))
        assert [np.isfinite(r["eval_mtp_loss"]) for r in read_records(full, "eval")] == [True]
        step_lines = [ln for ln in lines if ln.startswith("step") and "| aux " in ln]  # the console shows it
        assert [ln.split(" | ")[1:3] for ln in step_lines] == [
            [f"loss {r['loss']:.4f}", f"mtp {r['mtp_loss']:.3f}"] for r in read_records(full, "train")]
        (ev,) = read_records(full, "eval")
        assert [ln for ln in lines if f"| eval loss {ev['eval_loss']:.4f} | eval mtp {ev['eval_mtp_loss']:.3f} | "
                "eval bits/byte" in ln]
        assert a_moe_rows(second) == 2 + 1  # the MTP block's routing row after the two main MoE layers
        assert all(r["layer_names"] == ["MoE layer 0", "MoE layer 1", "MTP module 1"]  # what those rows are
                   for r in read_records(full, "train"))
    else:
        assert not [ln for ln in lines if "| mtp " in ln or "eval mtp" in ln]

    cfg = small_config(*common)
    abstract = second.abstract_state()
    a = Checkpointer(full / "checkpoints").restore(abstract, cfg)
    b = Checkpointer(split / "checkpoints").restore(abstract, cfg)
    assert a.step == b.step == 10
    assert a.data_state == b.data_state
    assert jax.tree.structure(b.state) == jax.tree.structure(second.init_state())  # no list/tuple drift
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def a_moe_rows(trainer):
    return trainer.abstract_state()["routing"]["bias"].shape[0]


@pytest.mark.parametrize("first,then", [(False, True), (True, False)], ids=["unrolled-to-scanned", "scanned-to-unrolled"])
def test_checkpoint_converts_between_scanned_and_unrolled_layers(small_config, tmp_path, first, then):
    """A run checkpointed with one layer layout resumes with the other: the restored state is the
    checkpoint's, converted exactly (both directions), and (unrolled to scanned) training continues
    as the uninterrupted run to fp32 rounding; the next checkpoint is written in the new layout."""
    common = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=2",
              "model.num_layers=3", "model.moe_every=2"]
    corpus = load_corpus(small_config(*common).data)
    layers = lambda scanned: f"model.scan_layers={str(scanned).lower()}"
    full, split = tmp_path / "full", tmp_path / "split"
    if then:  # the uninterrupted run to compare with (one direction is enough for training on)
        Trainer(small_config(*common, layers(first)), full, log=None, progress=False, corpus=corpus).run()
    Trainer(small_config(*common, layers(first), "train.stop_at=2"), split, log=None, progress=False,
            corpus=corpus).run()
    lines = []
    second = Trainer(small_config(*common, layers(then)), split, log=lines.append, progress=False, corpus=corpus)
    # the converted step-2 state equals the checkpoint's, read in its own layout and converted here
    before = Trainer(small_config(*common, layers(first)), split, log=None, progress=False, corpus=corpus)
    a = Checkpointer(split / "checkpoints").restore(before.abstract_state(), before.cfg, step=2)
    b = Checkpointer(split / "checkpoints", log=lines.append).restore(second.abstract_state(), second.cfg, step=2)
    assert any("converted to scan_layers" in ln for ln in lines)
    converted = to_layout(jax.device_get(a.state), second.cfg.model, then)
    assert jax.tree.structure(converted) == jax.tree.structure(b.state)
    for x, y in zip(jax.tree.leaves(converted), jax.tree.leaves(b.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    if not then:
        return
    summary = second.run()
    assert summary.steps == 4 and summary.steps_this_run == 2
    np.testing.assert_allclose([r["loss"] for r in read_records(split, "train")],
                               [r["loss"] for r in read_records(full, "train")], rtol=2e-5)
    final = Checkpointer(split / "checkpoints").restore(second.abstract_state(), second.cfg)
    assert final.step == 4 and ("blocks" in final.state["params"]) == (not then)


def test_resume_with_incompatible_config_fails_clearly(small_config, tmp_path):
    """A refused resume compiles nothing first: not the train step, nor the CPU peak probe of the
    MFU line (measured again here; it once ran before the checkpoint was checked)."""
    from jax import monitoring

    from moefast.train import mfu

    # a plain run (its step comes from the session's compilation cache)
    Trainer(small_config(*PLAIN), tmp_path, log=None, progress=False).run()
    other = Trainer(small_config("train.steps=4", "moe.num_experts=8"), tmp_path, log=None, progress=False)
    mfu.cpu_matmul_peak.cache_clear()
    compiled = []  # every backend compile, a compilation-cache hit included

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(kw.get("fun_name", "?"))

    monitoring.register_event_duration_secs_listener(listen)
    try:
        with pytest.raises(CheckpointError, match="different 'moe' config"):
            other.run()
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert compiled == [], f"compiled before the resume was refused: {compiled}"


def test_loss_falls_on_default_corpus(small_config, tmp_path):
    """A short real run on the standard-library corpus: the loss falls clearly."""
    cfg = small_config("data.source=stdlib", "train.steps=40", "train.log_every=1", "train.eval_every=0",
                       "train.checkpoint_every=0", "train.learning_rate=0.01")
    summary = Trainer(cfg, tmp_path, log=None, progress=False).run()
    losses = [r["loss"] for r in read_records(tmp_path, "train")]
    assert np.mean(losses[:3]) > 5.0  # ~ln(259) at initialisation
    assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 2.0, losses
    assert summary.eval_bits_per_byte < 6.0


def test_persistent_compilation_cache_is_written_and_hit(small_config, tmp_path):
    from jax import monitoring

    from moefast.train.compile_cache import configure_compilation_cache

    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    cache_dir = tmp_path / "xla"
    # one layer: the runs compile for real (a fresh cache directory, then the cache turned off); the
    # cache's behaviour does not depend on the model's size
    common = ["model.num_layers=1", "train.steps=2", "train.eval_every=0", f"cache.compile_dir={cache_dir}"]
    corpus = load_corpus(small_config().data)
    try:
        Trainer(small_config(*common), tmp_path / "a", log=None, progress=False, corpus=corpus).run()
        assert any(p.name.startswith("jit_counted_step-") for p in cache_dir.iterdir()), \
            "the train step was not written to the compilation cache"
        events.clear()
        Trainer(small_config(*common), tmp_path / "b", log=None, progress=False, corpus=corpus).run()
        assert "/jax/compilation_cache/cache_hits" in events  # the new Trainer's step was loaded from disk
        events.clear()
        off = Trainer(small_config("model.num_layers=1", "train.steps=1", "train.eval_every=0",
                                   "cache.compile_dir=null"), tmp_path / "c", log=None, progress=False, corpus=corpus)
        assert off.compile_cache_dir is None
        off.run()
        assert "/jax/compilation_cache/cache_hits" not in events
    finally:
        configure_compilation_cache("auto")  # back to the suite's cache (conftest)


def test_steady_state_steps_read_nothing_back_from_the_devices(small_config, tmp_path, monkeypatch):
    """Between log, save and evaluation points nothing is read back from the devices. The loop
    runs those steps under ``jax.transfer_guard_device_to_host("disallow")``, but on CPU device
    arrays are host memory and the guard never fires, so this test records every read of an
    array's host value (``ArrayImpl._value``, behind ``float()``, ``np.asarray`` and
    ``jax.device_get``) with the last step the loop had dispatched: 10 steps, a log line every 4
    (read one step late: step 4's after step 5 is queued, step 8's after step 9), no evaluation or
    checkpoint before the end (step 10)."""
    from jax._src import array

    from moefast.train import timing

    dispatched, reads = [0], []
    value = array.ArrayImpl._value
    monkeypatch.setattr(array.ArrayImpl, "_value", property(lambda self: (reads.append(dispatched[-1]),
                                                                          value.fget(self))[1]))
    record = timing.StepBook.record
    monkeypatch.setattr(timing.StepBook, "record", lambda self, step, m: (dispatched.append(step),
                                                                          record(self, step, m))[1])
    cfg = small_config(*PLAIN, "train.log_every=4")  # the step compiled by test_train_step_is_traced_once
    assert Trainer(cfg, tmp_path, log=None, progress=False).run().steps == 10
    assert {1, 5, 9, 10} <= set(reads) <= {0, 1, 5, 9, 10}, sorted(set(reads))
