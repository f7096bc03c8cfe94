"""The training loop: mesh, sharded step, evaluation, logging, checkpoints and exact resume.

Typical use from a script or notebook::

    from moefast import load_config, Trainer
    cfg = load_config(overrides=["train.steps=100"])
    summary = Trainer(cfg, run_dir="runs/demo").run()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import resource
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax.sharding import NamedSharding, PartitionSpec as P

from moefast import host_memory, parallel
from moefast.parallel import xla_flags
from moefast.config import ConfigError, ExperimentConfig
from moefast.data import Corpus, eval_batches, get_tokenizer, load_corpus, train_dataset
from moefast.parallel.distributed import assert_same_config
from moefast.train.checkpoint import Checkpointer, CheckpointError
from moefast.train.compile_cache import configure_compilation_cache
from moefast.model import init_routing_state
from moefast.model.flops import model_flops_per_token
from moefast.train import mfu as mfu_lib
from moefast.train.metrics import MetricsWriteError, MetricsWriter
from moefast.train.monitor import ExpertLoadMonitor, load_stats
from moefast.train.prefetch import DevicePrefetcher
from moefast.train.step import BATCH_KEYS, LN2, ModelDef, eval_step, make_optimizer, train_step

__all__ = ["Trainer", "TrainSummary", "TrainingError", "config_warnings", "load_run_config"]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many consecutive non-finite steps); the message names the
    step and the last good checkpoint."""


class _StopRequest:
    """SIGTERM / SIGINT: finish the current step, checkpoint, return normally.

    Single process: Python handlers for both signals set a flag; a second signal acts as usual
    (Ctrl-C twice interrupts at once: the run does not wait for the checkpoint being written and
    resumes from the last complete one). Python runs a handler only between bytecodes, so two
    signals that both arrive during one native call (a compilation, a long device step) count as
    one: the loop says when it has taken the first (``stopping after step N``). Several processes: SIGTERM is taken by JAX's preemption
    service (installed by ``jax.distributed.initialize``) and every process stops at the same step
    through ``reached_preemption_sync_point``; SIGINT keeps its default behaviour.
    """

    def __init__(self):
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}
        self._multi = jax.process_count() > 1

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._multi:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def requested(self, step: int) -> str | None:
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                return "SIGTERM (preemption notice)"
        return self.signal

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _write_atomically(path: Path, text: str) -> None:
    """Replaces ``path`` by ``text`` so that a crash leaves the old or the new file, never a cut one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None


def config_warnings(cfg: ExperimentConfig) -> list[str]:
    """Settings that are valid but almost certainly not meant (the run logs each as a warning)."""
    out = []
    tc, moe = cfg.train, cfg.moe
    if moe.warmup_steps > tc.steps:
        out.append(f"moe.warmup_steps={moe.warmup_steps} > train.steps={tc.steps}: routing is randomised "
                   f"({moe.warmup_routing} warm-up) for the whole run, so the router never trains on its own "
                   "choices; lower moe.warmup_steps")
    if tc.warmup_steps > tc.steps:
        out.append(f"train.warmup_steps={tc.warmup_steps} > train.steps={tc.steps}: the learning rate never "
                   f"reaches train.learning_rate={tc.learning_rate}; lower train.warmup_steps")
    return out


def load_run_config(run_dir: str | Path) -> ExperimentConfig:
    """The config a run was started with (``<run-dir>/config.yaml``).

    Raises:
      CheckpointError: the run directory or its config is missing or unreadable.
      ConfigError: the config has unknown keys or impossible values.
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: {run_dir} is not a moefast run directory "
                              "(start one with: moefast train --run-dir DIR)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); moefast train writes it at "
                              "every start: restore it from the run's first command, or rerun that command") from None
    if not isinstance(raw, dict) or not raw:
        raise CheckpointError(f"{path} holds no config; moefast train writes it at every start: rerun the "
                              "run's training command to rewrite it")
    return ExperimentConfig.from_dict(raw, where=str(path))


@dataclasses.dataclass
class TrainSummary:
    steps: int  # optimizer steps completed in total
    steps_this_run: int
    final_loss: float | None  # training cross-entropy of the last step (nats/token)
    eval_loss: float | None  # validation cross-entropy (nats/token)
    eval_bits_per_byte: float | None
    eval_step: int | None  # the step the validation figures belong to
    tokens_per_s: float | None  # mean training throughput after the first (compiling) step, evaluation excluded
    first_step_s: float | None  # time to first step: from the start of run() to the first completed
    # step (state init or restore, tracing, compilation or a compilation-cache hit, the step itself)
    wall_s: float
    checkpoint: str | None
    memory: dict[str, int] | None = None  # bytes per device, see Trainer.memory_per_device
    skipped_steps: int = 0  # updates skipped for non-finite loss or gradients
    page_faults_per_step: float | None = None  # minor page faults of the process per timed step (as
    # tokens_per_s: after the first step, evaluation excluded); ~0 when host memory stays mapped
    stopped_by: str | None = None  # the signal that ended the run early (after a checkpoint)
    mfu: float | None = None  # model FLOPs utilisation at tokens_per_s (moefast.train.mfu), a fraction
    model_flops_per_token: float | None = None  # training FLOPs per token (moefast.model.flops)

    def format(self) -> str:
        f = lambda v, spec: "n/a" if v is None else format(v, spec)
        return (f"steps {self.steps} ({self.steps_this_run} this run) | train loss {f(self.final_loss, '.4f')} | "
                f"val loss {f(self.eval_loss, '.4f')} | val bits/byte {f(self.eval_bits_per_byte, '.4f')}"
                + (f" (at step {self.eval_step})" if self.eval_step not in (None, self.steps) else "") + " | "
                f"{f(self.tokens_per_s, ',.0f')} tokens/s"
                + (f" (MFU {100 * self.mfu:.1f}%)" if self.mfu is not None else "")
                + f" | time to first step {f(self.first_step_s, '.2f')} s | "
                f"wall {self.wall_s:.1f} s | checkpoint {self.checkpoint or 'none'}"
                + (f" | {self.skipped_steps} non-finite steps skipped" if self.skipped_steps else "")
                + (f" | stopped by {self.stopped_by}" if self.stopped_by else "")
                + ("" if not self.memory else f" | per device: params {self.memory['param_bytes'] / 2**20:.1f} MiB, "
                   f"optimizer {self.memory['optimizer_bytes'] / 2**20:.1f} MiB"))


_FETCH_EVERY_STEP = ("loss", "grad_norm", "nonfinite")  # what a flush reads of a step that is not logged


class _StepBook:
    """Per-step bookkeeping of a run: the metrics of the steps since the last flush (kept on the
    devices), the non-finite-step counters, the log window's time and page faults, and the totals
    of the summary.

    :meth:`record` only keeps a step's metrics; :meth:`flush` reads them back in one transfer
    (everything of a log step, loss / gradient norm / non-finite flag of the others), reports
    non-finite steps, writes the log line and record of each log step, and raises
    :class:`TrainingError` after ``train.max_consecutive_nonfinite`` non-finite steps in a row. So a
    run of non-finite steps is reported at the next flush (a log, save or evaluation point), and the
    updates of those steps were skipped by the step itself.
    """

    def __init__(self, cfg: ExperimentConfig, *, t_start: float, last: int, writer: MetricsWriter,
                 say: Callable[[str], None], bar, ckpt: Checkpointer, flops_per_token: float, peak: mfu_lib.Peak):
        self.tc, self.last, self.writer, self.say, self.bar, self.ckpt = cfg.train, last, writer, say, bar, ckpt
        self.t_start = t_start
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        self.flops_per_token, self.peak = flops_per_token, peak
        self.monitor = ExpertLoadMonitor(cfg.monitor.max_load_ratio, cfg.monitor.patience)
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []
        self.first_step_s: float | None = None
        self.final_loss: float | None = None
        self.nonfinite_in_a_row = self.skipped_steps = 0
        self.window_t: float | None = None  # start of the log window (None until the first step is done)
        self.window_steps = self.window_faults = 0
        self.timed_steps, self.timed_s, self.timed_faults = 0, 0.0, 0  # steps after the first one
        self.untimed: str | None = None  # between start_untimed() and end_untimed(): why these steps have no rate

    @staticmethod
    def _faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def _is_log(self, step: int) -> bool:
        return step % self.tc.log_every == 0 or step == self.last

    def record(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Keeps a dispatched step's metrics (no transfer)."""
        self.pending.append((step, metrics))
        if self.bar is not None:
            self.bar.update(1)

    def flush(self, before: int | None = None) -> None:
        """Reads back and reports the recorded steps (only those ``< before``, and only if one of
        them is a log step, when ``before`` is given)."""
        take = self.pending if before is None else [p for p in self.pending if p[0] < before]
        if not take or (before is not None and not any(self._is_log(s) for s, _ in take)):
            return
        self.pending = self.pending[len(take):]
        while take:  # one transfer per log step (its time ends that log window) and one for the rest
            n = next((i + 1 for i, (s, _) in enumerate(take) if self._is_log(s)), len(take))
            part, take = take[:n], take[n:]
            fetched = jax.device_get([m if self._is_log(s) else {k: m[k] for k in _FETCH_EVERY_STEP}
                                      for s, m in part])  # blocks until the last of these steps is done
            now = time.perf_counter()
            for (step, _), m in zip(part, fetched):
                self._step(step, m, now)

    def _step(self, step: int, m: dict[str, Any], now: float) -> None:
        self.final_loss = float(m["loss"])
        if self.window_t is None:  # the run's first step (compiled or loaded from the cache)
            self.window_t, self.window_faults, self.first_step_s = now, self._faults(), now - self.t_start
        elif self.untimed is None:
            self.window_steps += 1
        if int(m["nonfinite"]):
            self._nonfinite(step, m)
        else:
            self.nonfinite_in_a_row = 0
        if self._is_log(step):
            self._log_line(step, m, now)

    def _nonfinite(self, step: int, m: dict[str, Any]) -> None:
        tc = self.tc
        self.nonfinite_in_a_row, self.skipped_steps = self.nonfinite_in_a_row + 1, self.skipped_steps + 1
        self.writer.write("nonfinite", step, {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                                              "in_a_row": self.nonfinite_in_a_row})
        self.say(f"warning: step {step}: non-finite loss ({float(m['loss'])}) or gradient norm "
                 f"({float(m['grad_norm'])}); update skipped ({self.nonfinite_in_a_row} in a row)")
        if self.nonfinite_in_a_row >= tc.max_consecutive_nonfinite:
            first_bad = step - self.nonfinite_in_a_row + 1
            before = [s for s in self.ckpt.all_steps() if s < first_bad]
            good = max(before) if before else None
            raise TrainingError(
                f"step {step}: {self.nonfinite_in_a_row} consecutive steps with non-finite loss or gradients "
                f"since step {first_bad} (train.max_consecutive_nonfinite={tc.max_consecutive_nonfinite}); "
                "the updates were skipped. Last checkpoint from before step "
                f"{first_bad}: " + (f"{self.ckpt.directory / str(good)}" if good is not None else "none")
                + ". The model may have diverged a few finite steps earlier: lower train.learning_rate (or "
                "check the data) and restart from an earlier checkpoint or a new --run-dir.")

    def _log_line(self, step: int, m: dict[str, Any], now: float) -> None:
        steps = self.window_steps if self.untimed is None else 0
        rate = self.tokens_per_step * steps / (now - self.window_t) if steps else None
        faults = self._faults() - self.window_faults
        if self.untimed is None:
            self.timed_steps, self.timed_s = self.timed_steps + steps, self.timed_s + (now - self.window_t)
            self.timed_faults += faults
        rec = {k: (float(v) if np.ndim(v) == 0 else np.asarray(v)) for k, v in m.items()}
        rec["tokens_per_s"] = rate
        rec["mfu"] = mfu_lib.mfu(rate, self.flops_per_token, self.peak)
        rec["model_flops_per_token"] = self.flops_per_token
        rec["page_faults_per_step"] = faults / steps if steps else None
        alerts = []
        if "tokens_per_expert" in m:
            rec.update(load_stats(m["tokens_per_expert"]))
            alerts = self.monitor.update(m["tokens_per_expert"])
        self.writer.write("train", step, rec)
        drop = float(np.mean(m["dropped_fraction"])) if "dropped_fraction" in m else 0.0
        load = f" | max/mean load {float(np.max(rec['max_load_ratio'])):.2f}" if "max_load_ratio" in rec else ""
        self.say(f"step {step:>6} | loss {rec['loss']:.4f} | aux {rec['aux_loss']:.4f} | "
                 f"z {rec['z_loss']:.3f} | dropped {drop:.3f}{load} | lr {rec['learning_rate']:.2e} | "
                 + (f"{rate:,.0f} tokens/s" if rate is not None else self.untimed or "compiled")
                 + (f" | MFU {100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else ""))
        for alert in alerts:
            self.writer.write("alert", step, alert)
            self.say(f"warning: step {step}: MoE layer {alert['layer']}: {alert['reason']}")
        self.window_t, self.window_steps, self.window_faults = now, 0, self._faults()

    def start_untimed(self, label: str) -> None:
        """The steps recorded from now until :meth:`end_untimed` have no rate (their log lines say
        ``label``) and count in neither tokens/s nor page faults per step (e.g. profiled steps).
        The steps before are read back first."""
        self.flush()
        self.untimed = label

    def end_untimed(self) -> None:
        """Reads the untimed steps back and starts a new log window."""
        try:
            self.flush()
        finally:
            self.untimed = None
            if self.window_t is not None:
                self.window_t, self.window_steps, self.window_faults = time.perf_counter(), 0, self._faults()

    @contextlib.contextmanager
    def paused(self):
        """Time and page faults inside are not counted in the log window (evaluation)."""
        t, f = time.perf_counter(), self._faults()
        try:
            yield
        finally:
            if self.window_t is not None:
                self.window_t += time.perf_counter() - t
                self.window_faults += self._faults() - f

    def totals(self) -> tuple[float | None, float | None]:
        """Mean tokens/s and page faults per step over the steps after the first (evaluation
        excluded), including the steps since the last log line."""
        if self.window_steps:
            self.timed_steps += self.window_steps
            self.timed_s += time.perf_counter() - self.window_t
            self.timed_faults += self._faults() - self.window_faults
            self.window_steps = 0
        if not self.timed_steps:
            return None, None
        return self.tokens_per_step * self.timed_steps / self.timed_s, self.timed_faults / self.timed_steps


class Trainer:
    """Owns a run: corpus, model definition, mesh, compiled steps, checkpoints and metrics.

    Args:
      cfg: the experiment.
      run_dir: where checkpoints, ``metrics.jsonl``, TensorBoard events and ``config.yaml`` go;
        ``None`` = ``runs/<cfg.name>``. An existing run dir with checkpoints is resumed.
      log: console printer (``print``-like); ``None`` prints nothing.
      progress: show a tqdm progress bar (only when the output is a terminal).
      corpus: reuse an already loaded corpus (tests, notebooks).
      devices: devices of the mesh (default: all devices of all processes).
      profile: ``(start, end)``: write a ``jax.profiler`` trace of optimizer steps ``start`` to
        ``end`` (1-based, inclusive) into ``<run_dir>/profile`` (TensorBoard's profile plugin and
        ui.perfetto.dev read it). The devices finish the steps before ``start`` first, and the
        trace stops once step ``end`` is done (or the run ends).

    Raises:
      ValueError: ``profile`` is not ``1 <= start <= end``.
    """

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path | None = None, *,
                 log: Callable[[str], None] | None = print, progress: bool = True,
                 corpus: Corpus | None = None, devices: list | None = None,
                 profile: tuple[int, int] | None = None):
        if profile is not None and not (isinstance(profile, tuple) and len(profile) == 2 and 1 <= profile[0] <= profile[1]):
            raise ValueError(f"profile={profile!r}: expected (start, end) optimizer steps with 1 <= start <= end, "
                             "e.g. (10, 12) or --profile 10:12")
        self.profile = profile
        self.cfg = cfg
        self.run_dir = Path(run_dir or Path("runs") / cfg.name)
        xla_flags.configure(cfg.overlap.xla_flags, log=log or (lambda s: None))  # before JAX starts, if it has not
        self.is_main = jax.process_index() == 0
        self._log = log if (log is not None and self.is_main) else (lambda s: None)
        # Checkpoint warnings (e.g. a corrupt step skipped) go to the console log; without one, to
        # Python warnings.
        self._ckpt_log = self._log if log is not None else None
        self.progress = progress and self.is_main
        assert_same_config(cfg.to_dict())
        self.compile_cache_dir = configure_compilation_cache(cfg.cache.compile_dir)
        self.host_malloc = host_memory.configure()
        if self.host_malloc == "too-late":
            self._log("note: JAX's CPU backend started before moefast was imported, so freed host memory goes back "
                      "to the OS after every step (about 1.3x slower on CPU): import moefast before running any "
                      "JAX computation (in a notebook: restart the kernel and import moefast first)")
        self.mesh = parallel.make_mesh(cfg, devices)
        self.platform = parallel.platform(self.mesh)  # what the steps are compiled for
        if cfg.moe.routing_impl == "pallas" and self.platform == "cpu" and self.mesh.size > 1:
            raise ConfigError("moe.routing_impl: 'pallas' runs in the Pallas interpreter on CPU, which cannot run "
                              f"inside the expert-parallel shard_map over {self.mesh.size} devices; use "
                              "'reference' or 'auto' here, or one CPU device (--cpu-devices 1)")
        if cfg.moe.routing_impl == "triton":
            from moefast.kernels.routing import triton as triton_kernel

            why = triton_kernel.available(self.platform)
            if why:
                others = "'auto' or 'reference'" if self.platform == "cpu" and self.mesh.size > 1 else \
                    "'auto', 'reference' or 'pallas'"
                raise ConfigError(f"moe.routing_impl: {why}; use {others} here")
        if corpus is not None:
            self.corpus = corpus  # else read on first use (cached_property): compiling needs only the tokenizer
        self.data_cfg = cfg.data  # with a run-dir-relative tokenizer path resolved
        tok = cfg.data.tokenizer
        if tok != "byte" and not Path(tok).is_absolute() and (self.run_dir / tok).exists():
            self.data_cfg = dataclasses.replace(cfg.data, tokenizer=str((self.run_dir / tok).resolve()))
        self.tokenizer = corpus.tokenizer if corpus is not None else get_tokenizer(self.data_cfg.tokenizer)
        self.model_def = ModelDef(cfg, self.tokenizer.vocab_size)
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, parallel.batch_spec(self.mesh))
        self.state_sharding = self._state_sharding()
        self.trace_count = 0
        self.flops_per_token = model_flops_per_token(cfg, self.tokenizer.vocab_size)

        def counted_step(state, batch, key):
            self.trace_count += 1  # runs only while tracing: counts (re)compilations
            return train_step(self.model_def, state, batch, key)

        self._train_step = jax.jit(counted_step, donate_argnums=0,
                                   in_shardings=(self.state_sharding, self.batch_sharding, self.replicated),
                                   out_shardings=(self.state_sharding, self.replicated))
        self._eval_step = jax.jit(
            functools.partial(eval_step, self.model_def, bytes_per_token=self.tokenizer.bytes_per_token),
            in_shardings=(self.state_sharding["params"], self.state_sharding["routing"], self.batch_sharding),
            out_shardings=self.replicated)
        self.base_key = jax.random.key(cfg.train.seed)
        self._compiled_step = None
        self._eval_data: list[dict[str, np.ndarray]] | None = None

    @functools.cached_property
    def corpus(self) -> Corpus:
        """The run's corpus (``data.*``), read on first use."""
        return load_corpus(self.data_cfg)

    @functools.cached_property
    def peak(self) -> mfu_lib.Peak:
        """Peak FLOP/s of the mesh's devices, the denominator of MFU (on CPU measured on first use)."""
        return mfu_lib.peak_flops(self.mesh.devices.flat, self.cfg.train.peak_tflops)

    # ------------------------------------------------------------------ state
    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of a global batch (arrays [B_local, T] keyed by ``BATCH_KEYS``) as
        global arrays in the batch sharding."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(batch[k]))
                for k in BATCH_KEYS}

    def _state_sharding(self) -> dict[str, Any]:
        """Shardings of the train state: parameters by their logical axes (``fsdp`` splits
        ``embed``, ``expert`` splits experts) plus the ZeRO split over ``data`` and ``expert``
        (:meth:`~moefast.train.step.ModelDef.param_state_specs`); optimizer moments like their
        parameter; scalars replicated."""
        mesh = self.mesh
        param_spec = self.model_def.param_state_specs(mesh)
        abstract = self.model_def.abstract_state()
        opt_spec = optax.tree_utils.tree_map_params(
            make_optimizer(self.cfg), lambda p, spec: spec, abstract["opt_state"], param_spec,
            transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
        specs = {"params": param_spec, "opt_state": opt_spec, "step": P(),
                 "routing": jax.tree.map(lambda _: P(), abstract["routing"])}
        return parallel.shardings(mesh, specs)

    def init_state(self) -> dict[str, Any]:
        """Fresh train state, created directly in its shardings (no device holds a full copy of
        a split parameter)."""
        seed = self.cfg.train.seed
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda: self.model_def.init_state(seed), out_shardings=self.state_sharding)()

    def abstract_state(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of the train state (the restore target)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.model_def.abstract_state(), self.state_sharding)

    def lower_train_step(self) -> jax.stages.Lowered:
        """The train step lowered for this run's exact shapes and shardings (nothing runs; works for
        compile-only devices too)."""
        batch = {k: jax.ShapeDtypeStruct((self.cfg.data.batch_size, self.cfg.data.seq_len),
                                         np.float32 if k == "loss_weight" else np.int32,
                                         sharding=self.batch_sharding)
                 for k in BATCH_KEYS}
        key = jax.ShapeDtypeStruct(self.base_key.shape, self.base_key.dtype, sharding=self.replicated)
        with jax.set_mesh(self.mesh):
            return self._train_step.lower(self.abstract_state(), batch, key)

    def compiler_options(self) -> dict[str, bool | int | str]:
        """XLA options the train step is compiled with: the collective-overlap flags
        (:data:`~moefast.parallel.xla_flags.GPU_FLAGS`) when the mesh is on GPUs and
        ``overlap.xla_flags`` is on, except those ``XLA_FLAGS`` sets itself."""
        return xla_flags.compile_options(self.cfg.overlap.xla_flags, self.platform)

    def compiled_train_step(self):
        """The train step compiled ahead of time for this run's exact shapes and shardings (traced
        once; a batch of another shape or dtype is an error, never a silent recompilation)."""
        if self._compiled_step is None:
            self._compiled_step = self.lower_train_step().compile(self.compiler_options())
        return self._compiled_step

    def memory_per_device(self) -> dict[str, int]:
        """Bytes per device: parameters and optimizer state (from their shardings) and the compiled
        train step's arguments and temporaries (``compiled.memory_analysis()``)."""
        abstract = self.abstract_state()

        def shard_bytes(tree):
            return int(sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                           for a in jax.tree.leaves(tree)))

        out = {"param_bytes": shard_bytes(abstract["params"]), "optimizer_bytes": shard_bytes(abstract["opt_state"])}
        mem = self.compiled_train_step().memory_analysis()
        if mem is not None:
            out["compiled_argument_bytes"] = int(mem.argument_size_in_bytes)
            out["compiled_temp_bytes"] = int(mem.temp_size_in_bytes)
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, params: dict, routing_state: dict) -> dict[str, float]:
        """Validation loss (nats/token) and bits per byte over ``train.eval_batches`` batches."""
        if self._eval_data is None:
            self._eval_data = eval_batches(self.corpus, self.cfg.data, self.cfg.train.eval_batches,
                                           process_index=jax.process_index(),
                                           process_count=jax.process_count())
        totals = None
        with jax.set_mesh(self.mesh):
            for batch in self._eval_data:
                out = self._eval_step(params, routing_state, self.put_batch(batch))
                totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
        totals = jax.device_get(totals)
        ce = float(totals["ce_sum"]) / max(float(totals["weight_sum"]), 1.0)
        bpb = float(totals["ce_sum"]) / LN2 / max(float(totals["bytes"]), 1.0)
        return {"eval_loss": ce, "eval_bits_per_byte": bpb}

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainSummary:
        """Trains from the latest checkpoint in the run dir (or from scratch) to ``train.stop_at``
        (or ``train.steps``), evaluating, logging and checkpointing on the configured intervals.

        SIGTERM or SIGINT (once) during the run ends it after the current step with a checkpoint
        (:attr:`TrainSummary.stopped_by` says which); one that arrives before the first step (while
        compiling) ends it before any step, leaving the run dir as it was. A second SIGINT raises
        ``KeyboardInterrupt`` without waiting for the checkpoint being written (the line logged
        names the last complete one).

        A start that resumes from step N first removes from ``metrics.jsonl`` the records of the
        steps after N (left by a start that was killed before its next checkpoint; they are
        replayed), see :mod:`moefast.train.metrics`.

        Raises:
          TrainingError: ``train.max_consecutive_nonfinite`` non-finite steps in a row.
          CheckpointError: an incompatible or unreadable checkpoint, a failed checkpoint write, or a
            failed write of ``metrics.jsonl``, TensorBoard events or ``config.yaml`` (disk full,
            read-only): the message names the file or step and the last complete checkpoint.
        """
        stop = _StopRequest()
        stop.install()
        try:  # (orbax's log of a second Ctrl-C during a checkpoint wait: moefast.train.checkpoint's filter)
            return self._run(stop)
        finally:
            stop.uninstall()

    def _run(self, stop: _StopRequest) -> TrainSummary:
        t_start = time.perf_counter()
        cfg, tc = self.cfg, self.cfg.train
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise CheckpointError(f"--run-dir {self.run_dir} exists and is not a directory; choose another path")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = Checkpointer(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                            async_save=cfg.checkpoint.async_save, log=self._ckpt_log)
        data_iter = iter(train_dataset(self.corpus, cfg.data, seed=tc.seed,
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count()))
        self._log(f"corpus: {self.corpus.summary()}")
        n_params = sum(x.size for x in jax.tree.leaves(self.model_def.abstract_params))
        self._log(f"model: {n_params / 1e6:.2f}M parameters | mesh {dict(self.mesh.shape)} on "
                  f"{jax.device_count()} {jax.devices()[0].platform} device(s) | compilation cache "
                  f"{self.compile_cache_dir or 'off'} | host malloc {self.host_malloc}")
        peak = self.peak
        self._log(f"MFU: {self.flops_per_token / 1e6:,.1f} MFLOP per token (6 x active parameters + attention); peak "
                  + (f"{peak.flops_per_s / 1e12:,.3g} TFLOP/s" + (f" ({peak.devices} x {peak.per_device_tflops:,.4g})"
                                                                   if peak.devices > 1 else "")
                     if peak.flops_per_s else "unknown") + f" [{peak.source}]")

        for warning in config_warnings(cfg) + self.corpus.warnings(cfg.data):
            self._log(f"warning: {warning}")
        loop_state: dict[str, Any] = {}
        if ckpt.latest_step() is not None:
            restored = ckpt.restore(self.abstract_state(), cfg)  # fails before anything is written
            state, start = restored.state, restored.step
            loop_state = restored.meta.get("loop") or {}
            if restored.data_state is not None:  # None: an imported step 0 (Trainer.initialize), data not yet read
                data_iter.set_state(restored.data_state)
            self._log(f"resuming from step {start} ({ckpt.directory / str(start)})")
            saved_mesh = restored.meta.get("config", {}).get("mesh")
            if saved_mesh is not None and saved_mesh != cfg.to_dict()["mesh"]:
                self._log(f"note: mesh changed from {saved_mesh} to {cfg.to_dict()['mesh']}: the state was restored "
                          "into the new shardings; routing groups (tokens per device) differ, so losses will not "
                          "match the old mesh bit for bit")
            saved_train = restored.meta.get("config", {}).get("train", {})
            saved_steps = saved_train.get("steps")
            if start == 0:  # nothing trained yet (an imported run): no schedule to keep
                saved_steps, saved_train = None, {}
            if saved_steps is not None and saved_steps != tc.steps:
                self._log(f"note: train.steps changed from {saved_steps} to {tc.steps}: the learning-rate "
                          f"schedule now spans {tc.steps} steps, so this run is not a resume of the original "
                          "schedule")
            changed = [f"{k} {saved_train[k]!r} -> {v!r}" for k, v in cfg.to_dict()["train"].items()
                       if k not in ("steps", "stop_at") and k in saved_train and saved_train[k] != v]
            if changed:
                self._log(f"note: train settings changed since the checkpoint: {', '.join(changed)}")
        else:
            state, start = self.init_state(), 0
        try:
            if self.is_main:  # only once the config is known to fit the run dir's checkpoints
                _write_atomically(self.run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            writer = MetricsWriter(self.run_dir, enabled=self.is_main, resume_step=start)
        except OSError as e:
            raise self._write_error(e, ckpt, start) from None
        if writer.removed:
            self._log(f"metrics: removed {writer.removed} record(s) after step {start} from {writer.path}, left by a "
                      "start that ended before its next checkpoint (those steps are trained and logged again now)")
        last = tc.last_step
        if start >= last:
            self._log(f"run is already at step {start} (train.stop_at/train.steps = {last}); nothing to train")

        bar = None
        if self.progress and last > start:
            from tqdm.auto import tqdm

            bar = tqdm(total=last, initial=start, desc="train", unit="step", dynamic_ncols=True, leave=False,
                       disable=None)  # None: no bar when the output is not a terminal
        say = bar.write if bar is not None and not bar.disable else self._log
        if bar is not None and self._log is not print:
            say = self._log

        book = _StepBook(cfg, t_start=t_start, last=last, writer=writer, say=say, bar=bar, ckpt=ckpt,
                         flops_per_token=self.flops_per_token, peak=self.peak)
        book.monitor.load_state_dict(loop_state.get("monitor") or {})

        def save(step: int) -> None:
            # Every record of the steps up to this one is written (and durable) before the
            # checkpoint exists, so a resume from it replays exactly the steps whose records it drops.
            writer.sync()
            ckpt.save(step, state, data_state, cfg, force=True, loop_state={"monitor": book.monitor.state_dict()})
        eval_metrics: dict[str, float] = {}
        eval_at = None  # the step eval_metrics belong to
        stopped_by = None
        step_fn = self.compiled_train_step() if last > start else None
        memory = self.memory_per_device() if last > start else None
        if memory:
            self._log("per device: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.1f} MiB"
                                                 for k, v in memory.items()))
        done, data_state = start, data_iter.get_state()
        prefetch = cfg.data.prefetch_batches(self.platform) if last > start else 0
        batches = DevicePrefetcher(data_iter, self.put_batch, prefetch)
        trace_from = trace_to = None
        if self.profile is not None:
            trace_from, trace_to = max(self.profile[0], start + 1), min(self.profile[1], last)
            if trace_from > trace_to and last > start:
                self._log(f"note: --profile {self.profile[0]}:{self.profile[1]} is outside the steps of this run "
                          f"({start + 1} to {last}); no trace is written")
            if trace_from > trace_to:
                trace_from = trace_to = None
        tracing = False
        try:
            with jax.set_mesh(self.mesh):
                for step in range(start, last):
                    if stop.signal and step == start:  # before the first step: nothing new to save
                        stopped_by = stop.signal
                        say(f"{stopped_by}: stopped before the first step of this run; no step was run")
                        break
                    if step + 1 == trace_from:  # the trace holds these steps only: earlier ones finish first
                        book.start_untimed("profiled")
                        jax.block_until_ready(state)
                        jax.profiler.start_trace(str(self.run_dir / "profile"))
                        tracing = True
                    # Steady state: nothing comes back from the devices (metrics stay there until a
                    # log, save or evaluation point), so the host runs ahead and the devices never wait.
                    with jax.transfer_guard_device_to_host("disallow"):
                        batch, data_state = next(batches)
                        state, metrics = step_fn(state, batch, self.base_key)
                        book.record(step + 1, metrics)
                    done = step + 1
                    if tracing and done == trace_to:
                        jax.block_until_ready(state)
                        jax.profiler.stop_trace()
                        tracing = False
                        book.end_untimed()  # reads the traced steps back (their log lines)
                        say(f"profile of steps {trace_from} to {trace_to} written to {self.run_dir / 'profile'} "
                            f"(ui.perfetto.dev opens its *.trace.json.gz; TensorBoard needs the "
                            f"tensorboard-plugin-profile package); these steps are not in tokens/s")
                    is_last = done == last
                    save_now = bool(tc.checkpoint_every and done % tc.checkpoint_every == 0) or is_last
                    eval_now = bool(tc.eval_every and done % tc.eval_every == 0) or is_last
                    if step == start or save_now or eval_now:
                        book.flush()  # the first step (time to first step), and before saving or evaluating
                    else:
                        book.flush(before=done)  # a log point one step late: this step is already queued
                    if eval_now:  # before the checkpoint of this step: its record belongs to it
                        with book.paused():  # evaluation is not in tokens/s or faults per step
                            eval_metrics, eval_at = self.evaluate(state["params"], state["routing"]), done
                            writer.write("eval", done, eval_metrics)
                            say(f"step {done:>6} | eval loss {eval_metrics['eval_loss']:.4f} | "
                                f"eval bits/byte {eval_metrics['eval_bits_per_byte']:.4f}")
                    if save_now:
                        save(done)
                    stopped_by = stop.requested(done)  # after evaluation: a signal then stops here too
                    if stopped_by:
                        book.flush()
                        say(f"{stopped_by}: stopping after step {done}; writing its checkpoint"
                            + (" (Ctrl-C again quits without waiting for it)" if stopped_by == "SIGINT" else ""))
                        if not save_now:
                            save(done)
                        ckpt.wait()
                        say(f"{stopped_by}: stopped after step {done} with a checkpoint in {ckpt.directory / str(done)}; "
                            "run the same command again (same --run-dir) to resume")
                        break
                book.flush()
            tokens_per_s, faults_per_step = book.totals()
            if start >= last:
                eval_metrics, eval_at = self.evaluate(state["params"], state["routing"]), start
        except BaseException as e:
            failure = e
        else:
            failure = None
        finally:
            if tracing:  # the run ended inside the traced steps
                jax.profiler.stop_trace()
            batches.close()
            if bar is not None:
                bar.close()
        if failure is not None:
            self._abort(failure, writer, ckpt, done, say)
        ckpt.close()  # waits for the checkpoint still being written
        latest = ckpt.latest_step()
        end = done if stopped_by else max(start, last)
        summary = TrainSummary(
            steps=end, steps_this_run=max(end - start, 0),
            final_loss=book.final_loss, eval_loss=eval_metrics.get("eval_loss"),
            eval_bits_per_byte=eval_metrics.get("eval_bits_per_byte"), eval_step=eval_at,
            tokens_per_s=tokens_per_s, first_step_s=book.first_step_s, wall_s=time.perf_counter() - t_start,
            checkpoint=str(ckpt.directory / str(latest)) if latest is not None else None, memory=memory,
            skipped_steps=book.skipped_steps, stopped_by=stopped_by, page_faults_per_step=faults_per_step,
            mfu=mfu_lib.mfu(tokens_per_s, self.flops_per_token, self.peak), model_flops_per_token=self.flops_per_token)
        try:
            writer.write("summary", summary.steps, {k: v for k, v in dataclasses.asdict(summary).items()
                                                    if k not in ("steps", "memory")})
            writer.close()
        except MetricsWriteError as e:
            raise self._write_error(e, ckpt, end) from None
        return summary

    def _abort(self, failure: BaseException, writer: MetricsWriter, ckpt: Checkpointer, done: int,
               say: Callable[[str], None]) -> None:
        """Ends a run that failed after ``done`` steps with one exception: ``failure`` itself, or
        for a failed write to the run dir, a :class:`CheckpointError` naming the directory and the
        last complete checkpoint."""
        try:
            writer.close()
        except MetricsWriteError:
            pass  # the failure below is the one to report (a failed write is reported as such)
        if isinstance(failure, KeyboardInterrupt):  # a second Ctrl-C: quit without waiting for the write
            good = ckpt.complete_steps()
            say("interrupted: not waiting for the checkpoint being written; the run resumes from "
                + (f"{ckpt.directory / str(good[-1])}" if good else "the start (no complete checkpoint)")
                + " (same command)")
            raise failure
        pending = None
        try:
            ckpt.close()  # waits for a checkpoint still being written, also when a step failed
        except CheckpointError as e:
            pending = e
        if isinstance(failure, MetricsWriteError):
            raise self._write_error(failure, ckpt, done) from None
        if pending is not None and not isinstance(failure, CheckpointError):
            say(f"warning: {pending}")
        raise failure

    def _write_error(self, e: OSError, ckpt: Checkpointer, done: int) -> CheckpointError:
        """A failed write to the run dir (metrics, TensorBoard events, config.yaml) as one error naming
        the directory, the step and the last complete checkpoint."""
        good = ckpt.complete_steps()
        where = (f"the last complete checkpoint, {ckpt.directory / str(good[-1])}, is intact: a rerun of the same "
                 f"command resumes from it and trains and logs the steps after it again" if good else
                 "there is no complete checkpoint yet: a rerun starts the run again")
        return CheckpointError(f"{e}; training stopped after step {done}: {where}. Free disk space or make "
                               f"{self.run_dir} writable first (df -h {self.run_dir}; ls -ld {self.run_dir})")

    def initialize(self, params: dict) -> Path:
        """Starts a new run from given parameters: writes its step-0 checkpoint (``params`` with a
        fresh optimizer state, routing state and step 0; no data position, so training reads the
        data from its start) and ``config.yaml``. ``moefast train --run-dir`` then continues it
        (``moefast import-hf`` uses this for imported weights).

        Args:
          params: parameters with the structure of :attr:`model_def` (e.g. from
            :func:`moefast.interop.hf.load_hf_params`), float32, ideally already in
            ``state_sharding["params"]``.

        Returns:
          The checkpoint's directory.

        Raises:
          CheckpointError: the run dir already holds a checkpoint (nothing is overwritten).
          ValueError: ``params`` do not have the model's structure and shapes.
        """
        want = jax.tree.map(lambda a: (a.shape, a.dtype), self.model_def.abstract_params)
        got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
        if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(want) != jax.tree.leaves(got):
            raise ValueError("params do not have the structure, shapes and dtypes of this config's model")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = Checkpointer(self.run_dir / "checkpoints", keep=self.cfg.checkpoint.keep, async_save=False,
                            log=self._ckpt_log)
        try:
            if ckpt.latest_step() is not None:
                raise CheckpointError(f"{ckpt.directory} already holds checkpoints (latest step {ckpt.latest_step()}); "
                                      "use a new --run-dir")
            sharding = self.state_sharding
            with jax.set_mesh(self.mesh):
                params = jax.device_put(params, sharding["params"])
                rest = jax.jit(lambda p: {"opt_state": make_optimizer(self.cfg).init(p),
                                          "routing": init_routing_state(self.cfg), "step": jnp.zeros((), jnp.int32)},
                               out_shardings={k: sharding[k] for k in ("opt_state", "routing", "step")})(params)
            ckpt.save(0, {"params": params, **rest}, None, self.cfg)
            ckpt.wait()
        finally:
            ckpt.close()
        if self.is_main:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        return ckpt.directory / "0"

    def restore_params(self) -> tuple[int, dict, dict]:
        """Step, parameters and routing state of the latest checkpoint in the run dir.

        Raises:
          CheckpointError: no checkpoint or an incompatible one.
        """
        ckpt = Checkpointer(self.run_dir / "checkpoints", keep=self.cfg.checkpoint.keep, async_save=False,
                            log=self._ckpt_log)
        try:
            r = ckpt.restore(self.abstract_state(), self.cfg)
        finally:
            ckpt.close()
        return r.step, r.state["params"], r.state["routing"]
