"""``moefast bench precision``: the config trained with ``model.precision=bf16`` and ``=fp8`` (the
same seed, data and steps, one ``moefast train`` process each) and their losses compared.

The loss figure is the mean training loss over the last ``window`` logged records (a single step's
loss is one batch's: noisy) and the validation loss at the end. The verdict is the fp8 run's loss
relative to the bf16 run's; the bound (default 2 %) is the issue's acceptance figure for the tiny
config (``model.dtype=bfloat16`` both times). Only numbers are compared here, never speed: on CPU
fp8 is emulated (:mod:`moefast.parallel.fp8_gemm`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import tempfile
from pathlib import Path

__all__ = ["PrecisionBenchResult", "bench_precision", "format_table", "run_cli"]

# what the comparison fixes (overrides given by the user come first; these win)
_EVAL_EVERY = "train.eval_every={steps}"


@dataclasses.dataclass
class PrecisionRun:
    precision: str
    final_loss: float  # mean training loss over the last `window` logged records (nats/token)
    eval_loss: float | None
    losses: list[tuple[int, float]]  # (step, training loss) as logged
    wall_s: float
    nonfinite_steps: int


@dataclasses.dataclass
class PrecisionBenchResult:
    config: str
    overrides: list[str]
    steps: int
    window: int
    bound: float
    runs: list[PrecisionRun]
    relative_train: float  # fp8's final loss / bf16's - 1
    relative_eval: float | None
    within: bool
    jax: str
    date: str


def _run(config, overrides, precision, steps, log_every, tmp) -> tuple[list[dict], float]:
    from moefast.bench.process import train_process

    run_dir = Path(tmp) / precision
    _, wall = train_process(run_dir, [*overrides, f"model.precision={precision}", f"train.steps={steps}",
                                      f"train.log_every={log_every}", _EVAL_EVERY.format(steps=steps),
                                      f"train.checkpoint_every={steps}"], config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, wall


def bench_precision(config: str | None = None, overrides: list[str] | None = None, *, steps: int = 300,
                    window: int = 5, log_every: int = 10, bound: float = 0.02, log=None) -> PrecisionBenchResult:
    """Trains the config in bf16 and in fp8 and compares the losses (module docstring).

    Args:
      config: YAML config (``None``: configs/tiny.yaml); overrides: ``section.key=value``.
      steps: optimizer steps of each run.
      window: logged records the final training loss averages over.
      log_every: steps between logged records.
      bound: the largest relative loss difference reported as within.

    Raises:
      ValueError: ``steps`` < 1, ``window`` < 1, or fewer than ``window`` logged records.
      RuntimeError: a training process failed.
    """
    import jax

    if steps < 1 or window < 1 or steps // log_every < window:
        raise ValueError(f"steps={steps}, log_every={log_every}, window={window}: need steps >= 1 and at least "
                         f"window logged records (steps / log_every >= window)")
    say = log or (lambda _: None)
    user = list(overrides or [])
    runs = []
    with tempfile.TemporaryDirectory(prefix="moefast-bench-precision-") as tmp:
        for precision in ("bf16", "fp8"):
            records, wall = _run(config, user, precision, steps, log_every, tmp)
            train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
            evals = [r for r in records if r["kind"] == "eval"]
            final = sum(v for _, v in train[-window:]) / len(train[-window:])
            nonfinite = int(sum(r.get("nonfinite", 0) for r in records if r["kind"] == "train"))
            runs.append(PrecisionRun(precision, final, evals[-1]["eval_loss"] if evals else None, train, wall, nonfinite))
            say(f"{precision}: final train loss {final:.4f} (mean of the last {window} logged), "
                f"eval {runs[-1].eval_loss}, {wall:.0f} s")
    bf, f8 = runs
    rel = f8.final_loss / bf.final_loss - 1
    rel_eval = f8.eval_loss / bf.eval_loss - 1 if bf.eval_loss and f8.eval_loss is not None else None
    within = abs(rel) <= bound and (rel_eval is None or abs(rel_eval) <= bound)
    return PrecisionBenchResult(config or "configs/tiny.yaml", user, steps, window, bound, runs, rel, rel_eval, within,
                                jax.__version__, datetime.date.today().isoformat())


def format_table(r: PrecisionBenchResult) -> str:
    """Markdown: one row per precision, then the verdict."""
    lines = [f"| model.precision | train loss (mean of last {r.window} logged) | eval loss | steps with "
             "non-finite values | wall s |", "|---|---|---|---|---|"]
    for x in r.runs:
        ev = "n/a" if x.eval_loss is None else f"{x.eval_loss:.4f}"
        lines.append(f"| {x.precision} | {x.final_loss:.4f} | {ev} | {x.nonfinite_steps} | {x.wall_s:.0f} |")
    ev = "n/a" if r.relative_eval is None else f"{r.relative_eval:+.2%}"
    lines += ["", f"fp8 vs bf16: train loss {r.relative_train:+.2%}, eval loss {ev}: "
              + ("within" if r.within else "NOT within") + f" {r.bound:.0%}"]
    return "\n".join(lines)


def run_cli(*, json_out: str | None, config: str | None, overrides: list[str] | None, steps: int | None) -> int:
    """Returns 0 when fp8 is within the bound, 1 when not."""
    r = bench_precision(config, overrides, steps=steps or 300, log=print)
    header = (f"bf16 vs fp8 training loss, config {r.config}" + (f" with {' '.join(r.overrides)}" if r.overrides else "")
              + f", {r.steps} steps each, jax {r.jax}, {r.date}; numbers only (fp8 emulated off GPU)")
    table = format_table(r)
    print(f"\n{header}\n\n{table}")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, dataclasses.asdict(r), f"{header}\n\n{table}\n")
    return 0 if r.within else 1
