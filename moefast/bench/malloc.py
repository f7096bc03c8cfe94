"""``moefast bench malloc``: ``moefast train`` with moefast's host ``malloc`` settings against glibc's
defaults (:mod:`moefast.host_memory`, ``MOEFAST_HOST_MALLOC=keep`` vs ``system``).

Per round (``rounds``, default 3), one real ``moefast train`` process per setting
(:func:`moefast.bench.process.train_process`; the order alternates between rounds so drift of the
machine's speed hits both alike), ``steps`` optimizer steps logged in three windows, no evaluation
or checkpoint before the end. Each record holds what the run's ``metrics.jsonl`` says: minor page
faults per step of the last log window (the heap has grown to its working size by then) and of the
whole run (``getrusage`` around the timed steps), the summary's tokens/s, and the final loss (the
same computation either way: the losses must match).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from moefast import host_memory

__all__ = ["MODES", "MallocRecord", "bench_malloc", "format_table", "run_cli"]

MODES = ("keep", "system")  # moefast's settings, glibc's defaults


@dataclasses.dataclass
class MallocRecord:
    """One ``moefast train`` process."""

    round: int  # 1-based
    mode: str  # MOEFAST_HOST_MALLOC of the process
    steps: int  # optimizer steps of the run
    tokens_per_s: float  # the run summary's tokens/s (compiling first step, evaluation, checkpoint excluded)
    faults_per_step_last_window: float  # minor page faults per step in the last log window
    faults_per_step_run: float  # the same over the whole run (includes the heap's one-off growth)
    final_loss: float  # loss of the last log window, nats/token
    wall_s: float  # wall time of the whole process

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def _host_malloc_env(mode: str):
    """``$MOEFAST_HOST_MALLOC = mode`` for the child processes started inside, restored after."""
    old = os.environ.get(host_memory.ENV_VAR)
    os.environ[host_memory.ENV_VAR] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(host_memory.ENV_VAR, None)
        else:
            os.environ[host_memory.ENV_VAR] = old


def bench_malloc(config: str | None = None, overrides: list[str] | None = None, *, rounds: int = 3,
                 steps: int = 12, log: Callable[[str], None] | None = print) -> list[MallocRecord]:
    """Runs the rounds; see the module docstring.

    Args:
      config: YAML config (``None``: configs/tiny.yaml); overrides: ``section.key=value`` strings
        for every run.
      rounds: processes per setting.
      steps: optimizer steps per run (at least 3: three log windows).
      log: printer of one line per process.

    Raises:
      ValueError: ``steps < 3`` or ``rounds < 1``.
      RuntimeError: a train process failed (its stderr is in the message).
    """
    from moefast.bench.process import train_process

    if steps < 3 or rounds < 1:
        raise ValueError(f"bench malloc: --steps must be >= 3 (three log windows) and --rounds >= 1, got {steps} "
                         f"and {rounds}")
    args = [*(overrides or []), f"train.steps={steps}", f"train.log_every={steps // 3}", "train.stop_at=null",
            "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=0"]
    out = []
    with tempfile.TemporaryDirectory(prefix="moefast-malloc-") as tmp:
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                run_dir = Path(tmp) / f"{mode}{r}"
                with _host_malloc_env(mode):
                    summary, wall = train_process(run_dir, args, config)
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                last = [x for x in records if x["kind"] == "train"][-1]
                rec = MallocRecord(round=r + 1, mode=mode, steps=steps, tokens_per_s=float(summary["tokens_per_s"]),
                                   faults_per_step_last_window=float(last["page_faults_per_step"]),
                                   faults_per_step_run=float(summary["page_faults_per_step"]),
                                   final_loss=float(last["loss"]), wall_s=wall)
                out.append(rec)
                if log:
                    log(f"round {rec.round}/{rounds} {mode}: {rec.tokens_per_s:,.0f} tokens/s | page faults per step "
                        f"{rec.faults_per_step_last_window:,.0f} (last window), {rec.faults_per_step_run:,.0f} (run)")
    return out


def format_table(records: list[MallocRecord]) -> str:
    """Markdown: one row per setting, medians over its processes."""
    lines = ["| host malloc | processes | tokens/s | page faults/step, last window | page faults/step, run | "
             "final loss |", "|---|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        rs = [r for r in records if r.mode == mode]
        if not rs:
            continue
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        name = "moefast's settings (`keep`)" if mode == "keep" else "glibc defaults (`system`)"
        lines.append(f"| {name} | {len(rs)} | {med(lambda r: r.tokens_per_s):,.0f} | "
                     f"{med(lambda r: r.faults_per_step_last_window):,.0f} | "
                     f"{med(lambda r: r.faults_per_step_run):,.0f} | "
                     f"{med(lambda r: r.final_loss):.6f} |")
    return "\n".join(lines)


def run_cli(*, json_out: str | None, rounds: int, steps: int, config: str | None = None,
            overrides: list[str] | None = None) -> int:
    """``moefast bench malloc``: the rounds, the table, the records to ``json_out``."""
    records = bench_malloc(config, overrides, rounds=rounds, steps=steps)
    table = format_table(records)
    print(f"\nmoefast train, host malloc kept mapped vs glibc's defaults, {steps} steps per process, medians over "
          f"{rounds} process(es) per setting\n")
    print(table)
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, [r.to_dict() for r in records], table)
    return 0
