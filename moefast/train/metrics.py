"""Metric records: ``<run-dir>/metrics.jsonl`` (one JSON object per line) and TensorBoard events."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MetricsWriter"]


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Floats are written at full precision (``json`` uses ``repr``). Non-finite floats are written as
    ``NaN``/``Infinity`` (Python's JSON extension) rather than dropped.

    Args:
      run_dir: the run directory.
      enabled: False on processes other than 0 (nothing is written).
    """

    def __init__(self, run_dir: str | Path, *, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, kind: str, step: int, record: dict[str, Any]) -> None:
        """Writes one record, e.g. ``write("train", 100, {"loss": 2.1, "tokens_per_s": 3900.0})``."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), **{k: _jsonable(v) for k, v in record.items()}}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        for k, v in record.items():
            if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool):
                if math.isfinite(float(v)):
                    self._tb.add_scalar(f"{kind}/{k}", float(v), step)
            elif isinstance(v, np.ndarray) and k == "tokens_per_expert" and v.ndim == 2:
                frac = v / np.maximum(v.sum(axis=1, keepdims=True), 1)
                for layer, row in enumerate(frac):
                    self._tb.add_histogram(f"{kind}/expert_load/moe_layer_{layer}",
                                           np.repeat(np.arange(row.size), np.round(row * 1000).astype(int)),
                                           step, bins=np.arange(row.size + 1) - 0.5)
            elif isinstance(v, np.ndarray) and v.ndim == 1:
                for layer, x in enumerate(v):
                    self._tb.add_scalar(f"{kind}/{k}/moe_layer_{layer}", float(x), step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()
