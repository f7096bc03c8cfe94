"""``moefast bench optimizer``: AdamW against Muon (``train.optimizer``) on one config, the same
data, seeds and steps, one ``moefast train`` process a run.

Procedure (CPU time kept down): for each optimizer, each learning rate of the grid (the same grid
for both, ``train.learning_rate`` with the config's warm-up + cosine schedule) is trained with the
first seed (``train.seed`` as the config has it); each optimizer's learning rate is the one with the
lowest final validation loss (on a tie the first of the grid); then the remaining seeds (``train.seed`` + 1, ...)
at the picked rate only: ``2 x len(grid) + 2 x (seeds - 1)`` runs. A run whose training stops on
non-finite losses (``train.max_consecutive_nonfinite``) is kept as diverged and never picked.

Reported per optimizer, at its picked learning rate, mean over the seeds: the validation-loss
curve (``train.eval_every`` steps apart, ``train.eval_batches`` batches each, as the config has it),
the final validation loss, the first evaluated step at which the mean curve is at or below AdamW's
final mean validation loss (the speed-up's resolution is ``eval_every`` steps), Muon's steps to it
over AdamW's (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv 2502.16982, sec. 3,
report about 2x compute efficiency: the target here is <= 0.8), the mean step time and the optimizer
state's memory per device. Step time is ``data.batch_size x data.seq_len`` over the run's summary
tokens/s, which the trainer measures over the steps after the first (the first includes
compilation), evaluation excluded. Optimizer memory is the run's own ``per device: ... optimizer X
MiB`` log line (:meth:`moefast.train.Trainer.memory_per_device`, printed to 0.1 MiB).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import tempfile
import time
from pathlib import Path

__all__ = ["DEFAULT_LR_GRID", "OPTIMIZERS", "TARGET_RATIO", "OptimizerBenchResult", "OptimizerRun",
           "OptimizerSummary", "bench_optimizer", "format_table", "run_cli", "steps_to_reach", "verdict_line"]

OPTIMIZERS = ("adamw", "muon")
DEFAULT_LR_GRID = (1e-3, 3e-3, 1e-2)
TARGET_RATIO = 0.8  # Muon's steps to AdamW's final validation loss, over AdamW's: at most this
_DIVERGED = "consecutive steps with non-finite loss"  # moefast.train.TrainingError's message
_OPTIMIZER_MIB = re.compile(r"^per device: .*\boptimizer ([0-9.]+) MiB", re.M)


@dataclasses.dataclass
class OptimizerRun:
    optimizer: str
    learning_rate: float
    seed: int
    eval_curve: list[tuple[int, float]]  # (step, validation loss in nats/token), as evaluated
    final_eval_loss: float | None  # the last evaluation's; None: the run diverged
    step_s: float | None  # seconds per optimizer step after the first (module docstring)
    optimizer_mib: float | None  # optimizer state per device, MiB, as the run logged it
    wall_s: float  # the whole process, seconds
    diverged: bool = False


@dataclasses.dataclass
class OptimizerSummary:
    optimizer: str
    learning_rate: float  # picked: lowest final validation loss with the first seed
    seeds: list[int]  # the seeds averaged (diverged runs left out)
    curve: list[tuple[int, float]]  # (step, mean validation loss over the seeds)
    final_eval_loss: float
    steps_to_target: int | None  # first step of `curve` <= AdamW's final mean loss; None: never
    step_s: float | None  # mean over the seeds, seconds per step
    optimizer_mib: float | None


@dataclasses.dataclass
class OptimizerBenchResult:
    config: str
    overrides: list[str]
    steps: int
    eval_every: int
    eval_batches: int
    lr_grid: list[float]
    seeds: int
    runs: list[OptimizerRun]  # the grid (first seed), then the other seeds at the picked rates
    summaries: dict[str, OptimizerSummary]  # optimizer -> its figures at the picked rate
    target_loss: float  # AdamW's final mean validation loss
    ratio: float | None  # Muon's steps_to_target / AdamW's; None: Muon never reached it
    target_ratio: float
    met: bool  # ratio <= target_ratio
    jax: str
    date: str


def _fixed(steps: int, eval_every: int, optimizer: str, lr: float, seed: int) -> list[str]:
    """What the comparison fixes in each run (after the user's overrides, so these win)."""
    return [f"train.optimizer={optimizer}", f"train.learning_rate={lr!r}", f"train.seed={seed}",
            f"train.steps={steps}", f"train.eval_every={eval_every}", f"train.log_every={eval_every}",
            "train.checkpoint_every=0"]


def _run(config, overrides, run_dir: Path, tokens_per_step: int, optimizer: str, lr: float,
         seed: int) -> OptimizerRun:
    """One ``moefast train`` process and its figures (``overrides`` include :func:`_fixed`'s)."""
    from moefast.bench.process import train_process

    log = run_dir.parent / f"{run_dir.name}.stdout"
    t0 = time.perf_counter()
    try:
        summary, _ = train_process(run_dir, overrides, config, stdout_to=log)
    except RuntimeError as e:
        if _DIVERGED not in str(e):
            raise
        summary = None
    wall = time.perf_counter() - t0
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    evals = [(int(r["step"]), r["eval_loss"]) for r in records if r["kind"] == "eval"]
    curve = [(step, float(v)) for step, v in evals if v is not None and math.isfinite(v)]
    final = curve[-1][1] if summary is not None and evals and curve[-1:] == evals[-1:] else None
    mib = _OPTIMIZER_MIB.search(log.read_text()) if log.exists() else None
    rate = summary.get("tokens_per_s") if summary else None
    return OptimizerRun(optimizer, lr, seed, curve, final, tokens_per_step / rate if rate else None,
                        float(mib[1]) if mib else None, wall, diverged=final is None)


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first step of ``curve`` ((step, loss) in step order) whose loss is <= ``target``; None
    if none is."""
    return next((step for step, loss in curve if loss <= target), None)


def _pick(runs: list[OptimizerRun], optimizer: str, seed: int) -> float:
    """The learning rate of ``optimizer``'s lowest final validation loss with ``seed`` (the first
    of the grid on a tie).

    Raises:
      RuntimeError: every learning rate of the grid diverged.
    """
    done = [r for r in runs if r.optimizer == optimizer and r.seed == seed and not r.diverged]
    if not done:
        raise RuntimeError(f"train.optimizer={optimizer}: every learning rate of the grid diverged "
                           f"({', '.join(repr(r.learning_rate) for r in runs if r.optimizer == optimizer)}); "
                           "give lower ones with --lr-grid")
    return min(done, key=lambda r: r.final_eval_loss).learning_rate


def _mean_of(runs: list[OptimizerRun], optimizer: str, lr: float) -> OptimizerSummary:
    """``optimizer``'s figures at ``lr``, averaged over its runs that did not diverge (the curve at
    the steps every one of them evaluated); ``steps_to_target`` is left for :func:`_verdict`."""
    mine = [r for r in runs if r.optimizer == optimizer and r.learning_rate == lr and not r.diverged]
    steps = sorted(set.intersection(*(set(s for s, _ in r.eval_curve) for r in mine)))
    curve = [(s, sum(dict(r.eval_curve)[s] for r in mine) / len(mine)) for s in steps]
    times = [r.step_s for r in mine]
    return OptimizerSummary(optimizer, lr, [r.seed for r in mine], curve, curve[-1][1], None,
                            None if None in times else sum(times) / len(times), mine[0].optimizer_mib)


def _verdict(config, user, steps, eval_every, eval_batches, lr_grid, seeds, runs,
             jax_version) -> OptimizerBenchResult:
    """The summaries at the picked learning rates, the steps to AdamW's final mean validation
    loss and Muon's ratio to AdamW's."""
    seed0 = min(r.seed for r in runs)
    summaries = {opt: _mean_of(runs, opt, _pick(runs, opt, seed0)) for opt in OPTIMIZERS}
    target = summaries["adamw"].final_eval_loss
    for s in summaries.values():
        s.steps_to_target = steps_to_reach(s.curve, target)
    muon, adamw = summaries["muon"].steps_to_target, summaries["adamw"].steps_to_target
    ratio = None if muon is None else muon / adamw
    return OptimizerBenchResult(config or "configs/tiny.yaml", list(user), steps, eval_every, eval_batches,
                                list(lr_grid), seeds, runs, summaries, target, ratio, TARGET_RATIO,
                                ratio is not None and ratio <= TARGET_RATIO, jax_version,
                                datetime.date.today().isoformat())


def _check(config, user, steps, seeds, lr_grid, eval_every):
    """The loaded config (AdamW's); every run's overrides loaded once and Muon's parameter table
    checked, so a bad value fails before any run.

    Raises:
      ValueError: a bad argument, or a parameter Muon's table does not name.
      ConfigError: a bad override or config.
    """
    from moefast.config import ConfigError, load_config
    from moefast.train.optimizer import muon_specs

    if not (steps >= eval_every >= 1 and seeds >= 1 and lr_grid
            and all(math.isfinite(lr) and lr > 0 for lr in lr_grid)):
        raise ValueError(f"steps={steps}, eval_every={eval_every}, seeds={seeds}, lr_grid={lr_grid}: need "
                         "steps >= eval_every >= 1, seeds >= 1 and learning rates > 0")
    fixed = {f.split("=", 1)[0] for f in _fixed(steps, eval_every, "adamw", 1.0, 0)} - {"train.seed"}
    given = [o for o in user if o.split("=", 1)[0].strip() in fixed]
    if given:
        raise ConfigError(f"{given[0]}: moefast bench optimizer sets {given[0].split('=', 1)[0]} itself (both "
                          "optimizers, --lr-grid, --steps, --eval-every); leave it out of the overrides")
    seed = load_config(config, user).train.seed
    cfgs = {(opt, lr): load_config(config, [*user, *_fixed(steps, eval_every, opt, lr, seed)])
            for opt in OPTIMIZERS for lr in lr_grid}
    muon_specs(cfgs["muon", lr_grid[0]])
    return cfgs["adamw", lr_grid[0]]


def bench_optimizer(config: str | None = None, overrides: list[str] | None = None, *, steps: int = 300,
                    seeds: int = 2, lr_grid: tuple[float, ...] = DEFAULT_LR_GRID, eval_every: int = 25,
                    log=None) -> OptimizerBenchResult:
    """Trains the config with AdamW and with Muon over a learning-rate grid and seeds and compares
    their validation-loss curves (module docstring).

    Args:
      config: YAML config (``None``: configs/tiny.yaml); overrides: ``section.key=value``.
      steps: optimizer steps of each run (``train.steps``).
      seeds: runs per optimizer at its picked learning rate, ``train.seed`` the config's, +1, ...
      lr_grid: the learning rates tried with the first seed, the same for both optimizers.
      eval_every: steps between evaluations (``train.eval_every``); the steps-to-target resolution.
      log: called with a line after each run (``None``: silent).

    Returns:
      The runs (``2 * len(lr_grid) + 2 * (seeds - 1)``), each optimizer's summary and the verdict.

    Raises:
      ValueError: a bad argument (``steps < eval_every``, ``seeds < 1``, a learning rate <= 0), or a
        parameter that Muon's table does not name.
      ConfigError: a bad config or override.
      RuntimeError: a training process failed other than by diverging, or all of an optimizer's
        grid diverged.
    """
    import jax

    say = log or (lambda _: None)
    user = list(overrides or [])
    cfg = _check(config, user, steps, seeds, tuple(lr_grid), eval_every)
    seed0, tokens = cfg.train.seed, cfg.data.batch_size * cfg.data.seq_len
    runs: list[OptimizerRun] = []
    with tempfile.TemporaryDirectory(prefix="moefast-bench-optimizer-") as tmp:
        def train(opt, lr, seed):
            say(f"{opt}, lr {lr:g}, seed {seed}: training {steps} steps ...")
            runs.append(_run(config, [*user, *_fixed(steps, eval_every, opt, lr, seed)],
                             Path(tmp) / f"{opt}-lr{lr!r}-seed{seed}", tokens, opt, lr, seed))
            r = runs[-1]
            loss = "diverged" if r.diverged else f"final validation loss {r.final_eval_loss:.4f}"
            say(f"{opt}, lr {lr:g}, seed {seed}: {loss}, {r.wall_s:.0f} s")

        for opt in OPTIMIZERS:
            for lr in lr_grid:
                train(opt, lr, seed0)
        for opt in OPTIMIZERS:
            lr = _pick(runs, opt, seed0)
            for seed in range(seed0 + 1, seed0 + seeds):
                train(opt, lr, seed)
    return _verdict(config, user, steps, eval_every, cfg.train.eval_batches, lr_grid, seeds, runs, jax.__version__)


def verdict_line(r: OptimizerBenchResult) -> str:
    """The one-line verdict: Muon's steps to AdamW's final validation loss over AdamW's."""
    if r.ratio is None:
        return (f"Muon does not reach AdamW's final validation loss ({r.target_loss:.4f}) in {r.steps} steps "
                f"(target <= {r.target_ratio} x AdamW's steps)")
    return (f"Muon reaches AdamW's final validation loss in {r.ratio:.2f} x AdamW's steps "
            f"(target <= {r.target_ratio})")


def format_table(r: OptimizerBenchResult) -> str:
    """Markdown: each optimizer's summary, the mean curves, every run, then the verdict."""
    f = lambda v, spec=".4f": "n/a" if v is None else format(v, spec)  # noqa: E731
    s = [r.summaries[o] for o in OPTIMIZERS]
    lines = ["| optimizer | picked lr | seeds | final val loss | steps to AdamW's final val loss | s/step | "
             "optimizer MiB/device |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {x.optimizer} | {x.learning_rate:g} | {len(x.seeds)} | {x.final_eval_loss:.4f} | "
              f"{f(x.steps_to_target, 'd')} | {f(x.step_s)} | {f(x.optimizer_mib, '.1f')} |" for x in s]
    curves = [dict(x.curve) for x in s]
    lines += ["", "| step | " + " | ".join(f"{o} val loss (lr {x.learning_rate:g})" for o, x in zip(OPTIMIZERS, s))
              + " |", "|---:|---:|---:|"]
    lines += [f"| {step} | " + " | ".join(f(c.get(step)) for c in curves) + " |"
              for step in sorted(set().union(*curves))]
    lines += ["", "| optimizer | lr | seed | final val loss | wall s |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {x.optimizer} | {x.learning_rate:g} | {x.seed} | "
              f"{'diverged' if x.diverged else f(x.final_eval_loss)} | {x.wall_s:.0f} |" for x in r.runs]
    return "\n".join([*lines, "", verdict_line(r)])


def run_cli(*, json_out: str | None, config: str | None, overrides: list[str] | None, steps: int = 300,
            seeds: int = 2, lr_grid: tuple[float, ...] = DEFAULT_LR_GRID, eval_every: int = 25) -> int:
    """Runs :func:`bench_optimizer`, prints the tables and writes them (``json_out``, and its
    ``.md``). Returns 0 when Muon reaches AdamW's final validation loss in at most
    :data:`TARGET_RATIO` of AdamW's steps, 1 when not."""
    r = bench_optimizer(config, overrides, steps=steps, seeds=seeds, lr_grid=lr_grid, eval_every=eval_every,
                        log=print)
    header = (f"AdamW vs Muon (train.optimizer), config {r.config}" +
              (f" with {' '.join(r.overrides)}" if r.overrides else "") +
              f", {r.steps} steps each, validation every {r.eval_every} steps on {r.eval_batches} batches, "
              f"lr grid {', '.join(f'{lr:g}' for lr in r.lr_grid)} with the first seed, {r.seeds} seed(s) at the "
              f"picked lr, jax {r.jax}, {r.date}; s/step after the first step, evaluation excluded")
    table = format_table(r)
    print(f"\n{header}\n\n{table}")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, dataclasses.asdict(r), f"{header}\n\n{table}\n")
    return 0 if r.met else 1
