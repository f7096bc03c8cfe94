"""What the benchmarks share: a real ``moefast train`` process, and compiled train steps timed in
alternation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["alternating_step_times", "call_times", "compile_timed", "train_process", "write_results"]


def train_process(run_dir: Path, args: list[str], config: str | None = None, *,
                  stdout_to: Path | None = None) -> tuple[dict[str, Any], float]:
    """Runs ``python -m moefast train --run-dir RUN_DIR --no-progress [--config CONFIG] ARGS``.

    Args:
      run_dir: the run directory (its ``metrics.jsonl`` is read afterwards).
      args: further options and ``section.key=value`` overrides, in order (later ones win).
      config: YAML config path, or ``None`` for the default.
      stdout_to: if given, the process's standard output (its log lines, e.g. ``per device: ...``)
        is written to this file, also when the process failed.

    Returns:
      ``(summary, wall_s)``: the run's last ``summary`` record of ``metrics.jsonl`` and the wall time
      of the whole process, in seconds.

    Raises:
      RuntimeError: the process failed (the message ends with its stderr).
    """
    cmd = [sys.executable, "-m", "moefast", "train", "--run-dir", str(run_dir), "--no-progress",
           *(["--config", config] if config else []), *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - t0
    if stdout_to is not None:
        Path(stdout_to).write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "summary"][-1], wall


def write_results(json_out: str, records: Any, markdown: str) -> None:
    """Writes a benchmark's records to ``json_out`` (JSON) and its markdown to the same path with
    the suffix ``.md``, and says so."""
    with open(json_out, "w") as f:
        json.dump(records, f, indent=1)
    md = str(Path(json_out).with_suffix(".md"))
    with open(md, "w") as f:
        f.write(markdown.rstrip("\n") + "\n")
    print(f"\nwrote {json_out} and {md}")


def compile_timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """``jax.jit(fn).lower(*args).compile()`` and the seconds it took (tracing, lowering and XLA
    compilation; no persistent-cache read if the cache is off)."""
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def call_times(fn: Any, *args: Any, repeats: int, warmup: int = 1, budget_s: float | None = None) -> list[float]:
    """Seconds per call of ``fn(*args)`` (a compiled function), each ended by ``block_until_ready``.

    Args:
      fn, args: what to call (the same arguments every time: nothing is donated).
      repeats: timed calls, after ``warmup`` untimed ones (at least one warm-up is needed for
        ``budget_s``).
      budget_s: if given, at most ``budget_s / (last warm-up's seconds)`` timed calls (but at least
        one), so a slow point does not take ``repeats`` times its cost.

    Returns:
      The timed calls' wall times, seconds, in order (take the median).
    """
    import jax

    warm = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        warm = time.perf_counter() - t0
    if budget_s is not None and warmup:
        repeats = max(1, min(repeats, int(budget_s / max(warm, 1e-9))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def alternating_step_times(runners: list[list[Any]], steps: int) -> list[list[float]]:
    """Seconds per call of several compiled train steps, their calls interleaved (a, b, a, b, ...)
    so machine noise hits all alike; one untimed warm-up call each first.

    Args:
      runners: ``[trainer, compiled_step, state, batch]`` per variant; ``state`` is replaced by
        each call's new state (the step donates it).
      steps: timed calls per variant.
    """
    import jax

    times: list[list[float]] = [[] for _ in runners]
    for i in range(steps + 1):
        for j, r in enumerate(runners):
            trainer, step, state, batch = r
            t0 = time.perf_counter()
            with jax.set_mesh(trainer.mesh):
                state, metrics = step(state, batch, trainer.base_key)
            jax.block_until_ready((state, metrics))
            if i:
                times[j].append(time.perf_counter() - t0)
            r[2] = state
    return times

