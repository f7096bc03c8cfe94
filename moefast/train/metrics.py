"""Metric records: ``<run-dir>/metrics.jsonl`` (one JSON object per line) and TensorBoard events.

Resume and replayed steps: the training loop writes every record of steps up to ``S`` before it
starts checkpoint ``S`` (and :meth:`MetricsWriter.sync` makes them durable then). A run that is
killed later resumes from ``S`` and replays the steps after it, so when a :class:`MetricsWriter`
opens a run dir at ``resume_step=S`` it first removes the records of steps after ``S`` (written
by the killed process; they are written again by the replay) and a cut last line (a process
killed while writing it). ``metrics.jsonl`` therefore holds each step's records once, in step
order. TensorBoard gets the same through its purge mechanism: a new events file per start whose
first event (a ``SessionLog.START`` at step ``S + 1``) tells TensorBoard to drop the older files'
events from step ``S + 1`` on.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MetricsWriteError", "MetricsWriter"]

_files = itertools.count()  # events file names: unique within a process too


class MetricsWriteError(OSError):
    """``metrics.jsonl`` or the TensorBoard events file could not be written or repaired (disk
    full, read-only file system, ...); the message names the file and the operating system's
    reason."""


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


_ROW_NAMES = {"max_logit_per_layer": ("attention_layer_names", "layer"),
              "indexer_loss_per_layer": ("attention_layer_names", "layer")}
"""Per-layer keys whose rows are not the MoE layers: the record's key naming their rows, and the
tag's fallback stem (``max_logit_per_layer``, ``indexer_loss_per_layer``: one row per
softmax-attention layer)."""


def _row_tag(names: Any, row: int, rows: int, fallback: str = "moe_layer") -> str:
    """The TensorBoard tag of row ``row`` of a per-layer array of ``rows`` rows: its name in the
    record's ``layer_names`` (or the names :data:`_ROW_NAMES` gives its key) made a tag (``"MoE
    layer 3"`` -> ``moe_layer_3``, ``"MTP module 1"`` -> ``mtp_module_1``, ``"attention layer 3"``
    -> ``attention_layer_3``), else ``<fallback>_<row>``."""
    if isinstance(names, list) and len(names) == rows and isinstance(names[row], str):
        return re.sub(r"[^0-9a-z]+", "_", names[row].lower()).strip("_")
    return f"{fallback}_{row}"


def _step_of(line: bytes) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # not a record of ours: kept where it is


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Floats are written at full precision (``json`` uses ``repr``). Non-finite floats are written as
    ``NaN``/``Infinity`` (Python's JSON extension) rather than dropped. Each record is one
    ``write`` system call of a whole line, so a killed process leaves at most a cut last line,
    which the next :class:`MetricsWriter` of the run dir removes.

    Args:
      run_dir: the run directory.
      enabled: False on processes other than 0 (nothing is written).
      resume_step: the step this start of the run continues from (0 for a new run): records of
        later steps, left by an earlier start that was killed before its next checkpoint, are
        removed (the steps are replayed), see the module docstring. ``None``: nothing is removed.

    Attributes:
      removed: records removed on opening (replayed steps and a cut last line).

    Raises:
      MetricsWriteError: the files cannot be opened, repaired or written (from the constructor,
        :meth:`write`, :meth:`sync` and :meth:`close`).
    """

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, resume_step: int | None = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.removed = 0
        self._fd: int | None = None
        self._tb = None
        self._tb_dir = Path(run_dir) / "tensorboard"
        if not enabled:
            return
        tb_dir = self._tb_dir
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                self.removed = self._drop_after(int(resume_step))
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._error(self.path, e) from None
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        try:
            tb_dir.mkdir(parents=True, exist_ok=True)
            # A new file per start (the pid keeps two starts in one second apart). Its START event
            # makes TensorBoard drop the older files' events of the steps replayed from here.
            self._tb = EventsWriter(str(tb_dir / "events"), f".{os.getpid()}.{next(_files)}")
            if resume_step is not None:
                self._tb.write_event(Event(step=int(resume_step) + 1, session_log=SessionLog(status=SessionLog.START)))
        except OSError as e:
            raise self._error(tb_dir, e) from None

    @staticmethod
    def _error(path: Path, e: OSError) -> MetricsWriteError:
        err = MetricsWriteError(e.errno, f"cannot write {path}: {e.strerror or e}")
        err.filename = str(path)
        return err

    def _drop_after(self, step: int) -> int:
        """Removes the records of steps after ``step`` and a cut last line; returns how many."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        lines, offsets, pos = [], [], 0
        for line in data.splitlines(keepends=True):
            lines.append(line)
            offsets.append(pos)
            pos += len(line)
        cut = bool(lines) and not lines[-1].endswith(b"\n")  # a process killed while writing it
        complete = lines[:-1] if cut else lines
        steps = [_step_of(line) for line in complete]
        later = [i for i, s in enumerate(steps) if s is not None and s > step]
        if not later and not cut:
            return 0
        first = later[0] if later else len(complete)
        if all(s is None or s > step for s in steps[first:]):  # the usual case: a tail to cut off
            with open(self.path, "r+b") as f:
                f.truncate(offsets[first] if first < len(lines) else len(data))
                os.fsync(f.fileno())
        else:  # records of earlier steps after later ones (e.g. written by an older moefast): rewrite
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.writelines(line for line, s in zip(complete, steps) if s is None or s <= step)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        return len(later) + int(cut)

    def write(self, kind: str, step: int, record: dict[str, Any]) -> None:
        """Writes one record, e.g. ``write("train", 100, {"loss": 2.1, "tokens_per_s": 3900.0})``.

        Finite scalars go to TensorBoard as ``<kind>/<key>``; the rows of a per-layer array ([L]
        values, ``tokens_per_expert`` [L, E] as expert-load histograms) as ``<kind>/<key>/<row>``,
        ``<row>`` named after the record's ``layer_names`` when it has one name per row
        (``moe_layer_0``, ..., ``mtp_module_1``: the multi-token prediction blocks' rows, see
        :meth:`moefast.config.ModelConfig.moe_layer_names`), else ``moe_layer_<i>``; the rows of
        ``max_logit_per_layer`` (one per softmax-attention layer) after the record's
        ``attention_layer_names`` (``attention_layer_3``, ``mtp_module_1``:
        :func:`moefast.model.layout.attention_layer_names`), else ``layer_<i>``."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), **{k: _jsonable(v) for k, v in record.items()}}
        try:
            _write_all(self._fd, (json.dumps(rec) + "\n").encode())
        except OSError as e:
            raise self._error(self.path, e) from None
        from tensorboardX import summary
        from tensorboardX.proto.event_pb2 import Event

        names = record.get("layer_names")
        values = []
        for k, v in record.items():
            if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool):
                if math.isfinite(float(v)):
                    values.append(summary.scalar(f"{kind}/{k}", float(v)))
            elif isinstance(v, np.ndarray) and k == "tokens_per_expert" and v.ndim == 2:
                frac = v / np.maximum(v.sum(axis=1, keepdims=True), 1)
                for layer, row in enumerate(frac):
                    values.append(summary.histogram(f"{kind}/expert_load/{_row_tag(names, layer, len(frac))}",
                                                    np.repeat(np.arange(row.size), np.round(row * 1000).astype(int)),
                                                    bins=np.arange(row.size + 1) - 0.5))
            elif isinstance(v, np.ndarray) and v.ndim == 1:
                names_key, stem = _ROW_NAMES.get(k, ("layer_names", "moe_layer"))
                for layer, x in enumerate(v):
                    tag = _row_tag(record.get(names_key), layer, len(v), stem)
                    values.append(summary.scalar(f"{kind}/{k}/{tag}", float(x)))
        try:
            for s in values:
                self._tb.write_event(Event(step=int(step), summary=s))
        except OSError as e:
            raise self._error(self._tb_dir, e) from None

    def sync(self) -> None:
        """Makes every record written so far durable (flushes the events file, ``fsync`` on both);
        the training loop calls it before each checkpoint."""
        if not self.enabled:
            return
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise self._error(self.path, e) from None
        try:
            self._tb.flush()
        except OSError as e:
            raise self._error(self._tb_dir, e) from None

    def close(self) -> None:
        """Flushes and closes both files (also after a failed write: the files are closed either way)."""
        if not self.enabled or self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.close(fd)
            self._tb.close()
        except OSError as e:
            raise self._error(self._tb_dir, e) from None
