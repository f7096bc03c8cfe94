"""``moefast bench precision``: the config trained with a baseline and a candidate value of one
key (``vary``; by default ``model.precision=bf16`` and ``=fp8``; e.g. ``lora.base_dtype=bfloat16``
and ``=nf4``: LoRA on a bfloat16 base against QLoRA), the same seeds, data and steps, one
``moefast train`` process each, and their losses compared.

The loss figures are the mean training loss over the last ``window`` logged records (a single
step's loss is one batch's: noisy) and the validation loss at the end, each averaged over
``seeds`` seeds (``train.seed`` = the config's, +1, ...): one short run's final loss moves by a few
percent with the seed or any perturbation of its trajectory, so a bound of 2 % is read on the
means, one-sided: the candidate's mean losses at most 2 % above the baseline's (lower is within). Only numbers are compared here, never speed:
on CPU fp8 is emulated (:mod:`moefast.parallel.fp8_gemm`).
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
    seed: int
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
    seeds: int
    mean_train: dict[str, float]  # precision -> mean over the seeds of the final training loss
    mean_eval: dict[str, float | None]
    relative_train: float  # the candidate's mean final loss / the baseline's - 1
    relative_eval: float | None
    within: bool
    jax: str
    date: str
    vary: tuple[str, str, str] = ("model.precision", "bf16", "fp8")  # key, baseline, candidate


def _run(config, overrides, key, value, steps, log_every, tmp) -> tuple[list[dict], float]:
    from moefast.bench.process import train_process

    run_dir = Path(tmp) / value
    _, wall = train_process(run_dir, [*overrides, f"{key}={value}", f"train.steps={steps}",
                                      f"train.log_every={log_every}", _EVAL_EVERY.format(steps=steps),
                                      f"train.checkpoint_every={steps}"], config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, wall


def bench_precision(config: str | None = None, overrides: list[str] | None = None, *, steps: int = 300,
                    seeds: int = 1, window: int = 5, log_every: int = 10, bound: float = 0.02,
                    vary: tuple[str, str, str] = ("model.precision", "bf16", "fp8"), log=None) -> PrecisionBenchResult:
    """Trains the config with the baseline and the candidate value of a key and compares the losses
    (module docstring).

    Args:
      config: YAML config (``None``: configs/tiny.yaml); overrides: ``section.key=value``.
      vary: ``(key, baseline, candidate)``, e.g. ``("lora.base_dtype", "bfloat16", "nf4")``.
      steps: optimizer steps of each run.
      seeds: runs per precision, with ``train.seed`` the config's, +1, ...
      window: logged records the final training loss averages over.
      log_every: steps between logged records.
      bound: the largest relative loss difference reported as within.

    Raises:
      ValueError: ``steps`` < 1, ``window`` < 1, or fewer than ``window`` logged records.
      RuntimeError: a training process failed.
    """
    import jax

    from moefast.config import load_config

    if steps < 1 or window < 1 or seeds < 1 or steps // log_every < window:
        raise ValueError(f"steps={steps}, seeds={seeds}, log_every={log_every}, window={window}: need steps and "
                         "seeds >= 1 and at least window logged records (steps / log_every >= window)")
    say = log or (lambda _: None)
    user = list(overrides or [])
    key, *values = vary
    seed0 = load_config(config, user).train.seed
    for v in values:  # a bad key or value: one clear error before any run
        load_config(config, [*user, f"{key}={v}"])
    runs = []
    with tempfile.TemporaryDirectory(prefix="moefast-bench-precision-") as tmp:
        for seed in range(seed0, seed0 + seeds):
            for precision in values:
                records, wall = _run(config, [*user, f"train.seed={seed}"], key, precision, steps, log_every,
                                     Path(tmp) / str(seed))
                runs.append(_summary(precision, seed, records, wall, window))
                r = runs[-1]
                ev = "n/a" if r.eval_loss is None else f"{r.eval_loss:.4f}"
                say(f"{key}={precision}, seed {seed}: final train loss {r.final_loss:.4f} (mean of the last {window} "
                    f"logged), eval {ev}, {wall:.0f} s")
    return _verdict(config, user, steps, window, bound, runs, seeds, jax.__version__, tuple(vary))


def _summary(precision: str, seed: int, records: list[dict], wall: float, window: int) -> PrecisionRun:
    """One run's figures from its ``metrics.jsonl`` records."""
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    final = sum(v for _, v in train[-window:]) / len(train[-window:])
    nonfinite = int(sum(r.get("nonfinite", 0) for r in records if r["kind"] == "train"))
    return PrecisionRun(precision, seed, final, evals[-1]["eval_loss"] if evals else None, train, wall, nonfinite)


def _verdict(config, user, steps, window, bound, runs, seeds, jax_version,
             vary=("model.precision", "bf16", "fp8")) -> PrecisionBenchResult:
    """The means over the seeds and the candidate's relative to the baseline's; within when neither of
    the candidate's is more than ``bound`` above the baseline's (a lower loss is within)."""
    _, base, cand = vary
    def mean(precision, field):
        vals = [getattr(r, field) for r in runs if r.precision == precision]
        return None if any(v is None for v in vals) else sum(vals) / len(vals)

    train = {p: mean(p, "final_loss") for p in (base, cand)}
    ev = {p: mean(p, "eval_loss") for p in (base, cand)}
    rel = train[cand] / train[base] - 1
    rel_eval = ev[cand] / ev[base] - 1 if ev[base] and ev[cand] is not None else None
    within = rel <= bound and (rel_eval is None or rel_eval <= bound)
    return PrecisionBenchResult(config or "configs/tiny.yaml", user, steps, window, bound, runs, seeds, train, ev, rel,
                                rel_eval, within, jax_version, datetime.date.today().isoformat(), tuple(vary))


def format_table(r: PrecisionBenchResult) -> str:
    """Markdown: one row per precision, then the verdict."""
    f = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    key, base, cand = r.vary
    lines = [f"| {key} | seed | train loss (mean of last {r.window} logged) | eval loss | steps with "
             "non-finite values | wall s |", "|---|---:|---:|---:|---:|---:|"]
    for x in r.runs:
        lines.append(f"| {x.precision} | {x.seed} | {x.final_loss:.4f} | {f(x.eval_loss)} | {x.nonfinite_steps} | "
                     f"{x.wall_s:.0f} |")
    if r.seeds > 1:
        lines += [f"| {p} | mean of {r.seeds} | {r.mean_train[p]:.4f} | {f(r.mean_eval[p])} | | |" for p in (base, cand)]
    ev = "n/a" if r.relative_eval is None else f"{r.relative_eval:+.2%}"
    lines += ["", f"{cand} vs {base}{' (means over the seeds)' if r.seeds > 1 else ''}: train loss {r.relative_train:+.2%}, "
              f"eval loss {ev}: " + ("within" if r.within else "NOT within") + f" {r.bound:.0%}"]
    return "\n".join(lines)


def run_cli(*, json_out: str | None, config: str | None, overrides: list[str] | None, steps: int | None,
            seeds: int = 2, vary: tuple[str, str, str] = ("model.precision", "bf16", "fp8")) -> int:
    """Returns 0 when the candidate is within the bound, 1 when not."""
    r = bench_precision(config, overrides, steps=steps or 300, seeds=seeds, vary=vary, log=print)
    key, base, cand = r.vary
    header = (f"{key}: {base} vs {cand} training loss, config {r.config}" +
              (f" with {' '.join(r.overrides)}" if r.overrides else "") +
              f", {r.steps} steps each, {r.seeds} seed(s), jax {r.jax}, {r.date}; numbers only" +
              (" (fp8 emulated off GPU)" if key == "model.precision" else ""))
    table = format_table(r)
    print(f"\n{header}\n\n{table}")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, dataclasses.asdict(r), f"{header}\n\n{table}\n")
    return 0 if r.within else 1
