"""Step-time and metrics book-keeping of a run (:class:`StepBook`): what each step's metrics cost to
read back (nothing until a log, save or evaluation point), the log lines and records, tokens/s and
page faults per step, and the non-finite-step policy."""

from __future__ import annotations

import contextlib
import resource
import time
from typing import Any, Callable

import jax
import numpy as np

from moefast.config import ExperimentConfig
from moefast.model.layout import attention_layer_names
from moefast.train import mfu as mfu_lib
from moefast.train.checkpoint import Checkpointer
from moefast.train.metrics import MetricsWriter
from moefast.train.monitor import ExpertLoadMonitor, load_stats
from moefast.train.summary import TrainingError

__all__ = ["StepBook"]

_FETCH_EVERY_STEP = ("loss", "grad_norm", "nonfinite")  # what a flush reads of a step that is not logged


class StepBook:
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
        self.layer_names = cfg.model.moe_layer_names()  # each per-layer row's (MTP modules last)
        self.attention_layer_names = attention_layer_names(cfg.model)  # each max_logit_per_layer row's
        self.monitor = ExpertLoadMonitor(cfg.monitor.max_load_ratio, cfg.monitor.patience, self.layer_names)
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
                "check the data) and restart from an earlier checkpoint or in a new run dir.")

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
            if len(self.layer_names) == len(m["tokens_per_expert"]):  # what each row of the per-layer arrays is
                rec["layer_names"] = self.layer_names
        if "max_logit_per_layer" in m:  # the largest pre-softmax attention logit (QK-clip's S_max), per layer
            rec["max_logit"] = float(np.max(m["max_logit_per_layer"]))
            if len(self.attention_layer_names) == len(m["max_logit_per_layer"]):  # also indexer_loss_per_layer's rows
                rec["attention_layer_names"] = self.attention_layer_names
        self.writer.write("train", step, rec)
        drop = float(np.mean(m["dropped_fraction"])) if "dropped_fraction" in m else 0.0
        load = f" | max/mean load {float(np.max(rec['max_load_ratio'])):.2f}" if "max_load_ratio" in rec else ""
        mtp = f" | mtp {rec['mtp_loss']:.3f}" if "mtp_loss" in rec else ""  # model.mtp_depth > 0
        mtp += f" | indexer {rec['indexer_loss']:.3g}" if "indexer_loss" in rec else ""  # train.indexer_stage
        logit = f" | attn logit {rec['max_logit']:.3g}" if "max_logit" in rec else ""
        self.say(f"step {step:>6} | loss {rec['loss']:.4f}{mtp} | aux {rec['aux_loss']:.4f} | "
                 f"z {rec['z_loss']:.3f} | dropped {drop:.3f}{load}{logit} | lr {rec['learning_rate']:.2e} | "
                 + (f"{rate:,.0f} tokens/s" if rate is not None else self.untimed or "compiled")
                 + (f" | MFU {100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else ""))
        for alert in alerts:
            self.writer.write("alert", step, alert)
            self.say(f"warning: step {step}: {alert['layer_name']}: {alert['reason']}")
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
