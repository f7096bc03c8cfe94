"""``moefast bench cache``: the caching lever, measured side by side in one run.

Two measurements on a config (default: the tiny config):

* **step time, tables cached vs not** (``cache.tables`` true/false): both train steps compiled in
  this process; the timed steps alternate between the two (on, off, on, off, ...) so machine
  noise hits both alike; medians are reported.
* **time to first step, cold vs warm compilation cache**: fresh ``moefast train`` processes, one
  step each. A pair is a process with an empty ``cache.compile_dir`` (cold) followed by one with
  the directory the first filled (warm). The time is the run summary's time to first step (from
  the start of training to the first completed step: state init, tracing, compilation or cache
  load, the step). Whole-process wall times are reported too.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

import jax

from moefast.bench.process import alternating_step_times, train_process, write_results

__all__ = ["CacheBenchResult", "bench_cache", "first_step_times", "format_table", "step_times"]


@dataclasses.dataclass
class CacheBenchResult:
    config: str
    tokens_per_step: int
    platform: str
    step_time_on_s: float  # median seconds per train step, cache.tables=true
    step_time_off_s: float  # median seconds per train step, cache.tables=false
    step_runs: int  # timed steps per variant
    first_step_cold_s: float  # median time to first step, empty compilation cache
    first_step_warm_s: float  # median time to first step, filled compilation cache
    process_cold_s: float  # median wall time of the whole cold process (imports, data, one step, exit)
    process_warm_s: float
    launch_pairs: int  # cold/warm process pairs

    @property
    def step_ratio(self) -> float:
        return self.step_time_off_s / self.step_time_on_s

    @property
    def first_step_ratio(self) -> float:
        return self.first_step_cold_s / self.first_step_warm_s


def step_times(cfg, steps: int) -> tuple[float, float]:
    """Median train-step seconds with ``cache.tables`` on and off (alternating timed steps).

    Args:
      cfg: the experiment (its ``cache.tables`` is overridden).
      steps: timed steps per variant, after one warm-up step each.
    """
    from moefast.data import load_corpus, train_dataset
    from moefast.train import Trainer

    corpus = load_corpus(cfg.data)
    runners = []
    with tempfile.TemporaryDirectory() as tmp:
        for tables in (True, False):
            c = cfg.replace(cache=dataclasses.replace(cfg.cache, tables=tables))
            trainer = Trainer(c, Path(tmp) / str(tables), log=None, progress=False, corpus=corpus)
            batch = next(iter(train_dataset(corpus, c.data, seed=0)))
            with jax.set_mesh(trainer.mesh):
                batch = trainer.put_batch(batch)
                state = trainer.init_state()
            runners.append([trainer, trainer.compiled_train_step(), state, batch])
        times = alternating_step_times(runners, steps)
    return statistics.median(times[0]), statistics.median(times[1])


def _launch(run_dir: Path, compile_dir: Path, overrides: list[str], config: str | None) -> tuple[float, float]:
    summary, wall = train_process(run_dir, [*overrides, "train.steps=1", "train.eval_every=0", "train.eval_batches=1",
                                            f"cache.compile_dir={compile_dir}"], config)
    return float(summary["first_step_s"]), wall


def first_step_times(pairs: int, overrides: list[str], config: str | None = None) -> dict[str, list[float]]:
    """Times to first step of fresh processes, cold then warm compilation cache, ``pairs`` times."""
    out: dict[str, list[float]] = {"cold": [], "warm": [], "cold_wall": [], "warm_wall": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            compile_dir = Path(tmp) / f"xla{i}"
            for kind in ("cold", "warm"):
                first, wall = _launch(Path(tmp) / f"run{i}_{kind}", compile_dir, overrides, config)
                out[kind].append(first)
                out[f"{kind}_wall"].append(wall)
    return out


def bench_cache(config: str | None = None, overrides: list[str] | None = None, *, steps: int = 10,
                pairs: int = 2) -> CacheBenchResult:
    """Runs both measurements; see the module docstring."""
    from moefast.config import load_config

    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    on, off = step_times(cfg, steps)
    launches = first_step_times(pairs, overrides, config)
    med = statistics.median
    return CacheBenchResult(
        config=cfg.name, tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
        platform=f"{jax.devices()[0].platform} ({jax.device_count()} device(s))",
        step_time_on_s=on, step_time_off_s=off, step_runs=steps,
        first_step_cold_s=med(launches["cold"]), first_step_warm_s=med(launches["warm"]),
        process_cold_s=med(launches["cold_wall"]), process_warm_s=med(launches["warm_wall"]), launch_pairs=pairs)


def format_table(r: CacheBenchResult) -> str:
    tps = lambda s: f"{r.tokens_per_step / s:,.0f}"
    return "\n".join([
        "| measurement | cached | not cached | ratio |",
        "|---|---:|---:|---:|",
        f"| train step, s (tables on / off; tokens/s {tps(r.step_time_on_s)} / {tps(r.step_time_off_s)}) "
        f"| {r.step_time_on_s:.4f} | {r.step_time_off_s:.4f} | {r.step_ratio:.3f}× |",
        f"| time to first step, s (warm / cold compilation cache) | {r.first_step_warm_s:.2f} | "
        f"{r.first_step_cold_s:.2f} | {r.first_step_ratio:.2f}× |",
        f"| whole `moefast train` process, 1 step, s (warm / cold) | {r.process_warm_s:.2f} | "
        f"{r.process_cold_s:.2f} | {r.process_cold_s / r.process_warm_s:.2f}× |",
    ])


def run_cli(*, json_out: str | None, steps: int, pairs: int, config: str | None = None,
            overrides: list[str] | None = None) -> int:
    r = bench_cache(config, overrides, steps=steps, pairs=pairs)
    print(f"\ncaching lever, config {r.config} ({r.tokens_per_step} tokens/step), {r.platform}; "
          f"medians of {r.step_runs} alternating steps and of {r.launch_pairs} cold/warm process pairs\n")
    table = format_table(r)
    print(table)
    if json_out:
        rec = dataclasses.asdict(r) | {"step_ratio_off_over_on": r.step_ratio,
                                       "first_step_ratio_cold_over_warm": r.first_step_ratio}
        write_results(json_out, rec, table)
    return 0
