"""``moefast bench train``: tokens/s, step time, MFU, memory and compile time of a config's
training step, and with ``--ablate`` the table of moefast's three levers on that config.

Variants (``--ablate``; without it, only the config as given):

* **baseline**: what most JAX MoE code runs — positional tables and masks recomputed in every
  layer (``cache.tables=false``), GShard's one-hot dispatch/combine einsums
  (``moe.dispatch=onehot``), one expert exchange (``moe.overlap_chunks=1``), no device prefetch
  (``data.prefetch=0``), the reference routing (``moe.routing_impl=reference``);
* **+caching**, **+overlap**, **+slot dispatch**, **+fused routing kernel**: the baseline with one
  lever on (:data:`LEVERS`);
* **all levers**: every lever on.

The levers, as moefast runs them: *caching* = ``cache.tables=true``; *overlap* =
``data.prefetch=1`` and, with an expert axis > 1, ``moe.overlap_chunks=2``; *slot dispatch* =
``moe.dispatch=slot`` (tokens gathered into the experts' buffers by the routing's slots instead of
GShard's one-hot einsums); *fused routing kernel* = ``moe.routing_impl=auto`` (the compiled Pallas
kernel on GPU; on CPU ``auto`` is the reference routing, since the kernel only runs in the Pallas
interpreter there, so that row is left out of a CPU table). The persistent compilation cache (also
part of the caching lever) is off in every variant so compile times are real; ``moefast bench
cache`` measures it. ``moefast bench gpu-compile --ablate`` estimates the same levers (and the
fused attention) for GPUs from XLA's schedule.

Method: every variant is compiled in this process on the config's mesh; they share one train state
(the levers change how the step computes, not the state), each reads its own data pipeline
through its own prefetcher. In each of ``rounds`` rounds every variant runs one untimed step and
then ``steps`` timed ones (each timed from fetching its batch to the new state being ready), the
order of the variants rotating between rounds so machine drift hits every variant alike.
tokens/s is the median over rounds of each round's tokens / time; step time is the median and the
10th-90th percentiles of every timed step. MFU = tokens/s x model FLOPs per token / peak
(:mod:`moefast.train.mfu`). Memory is XLA's ``memory_analysis`` of the compiled step per device
(arguments + temporaries).

With ``--profile DIR``, each variant then runs 3 more steps under ``jax.profiler``; the traces go
to ``DIR/<variant>/`` and the time per step is split by kind of work
(:func:`moefast.bench.xla_profile.classify_work`: matmul, routing, dispatch/combine, collectives,
optimizer, other).
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["BASELINE", "LEVERS", "PROFILE_STEPS", "TrainBenchResult", "VariantRecord", "bench_train",
           "format_profile_table", "format_table", "variant_overrides"]

BASELINE = ["cache.tables=false", "moe.dispatch=onehot", "moe.overlap_chunks=1", "data.prefetch=0",
            "moe.routing_impl=reference"]
LEVERS = ("caching", "overlap", "slot dispatch", "fused routing kernel")
PROFILE_STEPS = 3
_FIXED = ["cache.compile_dir=null", "train.eval_every=0", "train.checkpoint_every=0"]


def lever_overrides(lever: str, expert_axis: int) -> list[str]:
    """The overrides that turn ``lever`` on (see the module docstring)."""
    if lever == "caching":
        return ["cache.tables=true"]
    if lever == "overlap":
        return ["data.prefetch=1"] + (["moe.overlap_chunks=2"] if expert_axis > 1 else [])
    if lever == "slot dispatch":
        return ["moe.dispatch=slot"]
    if lever == "fused routing kernel":
        return ["moe.routing_impl=auto"]
    raise ValueError(f"unknown lever {lever!r}; levers: {LEVERS}")


def variant_overrides(ablate: bool, expert_axis: int, platform: str = "cpu") -> list[tuple[str, list[str], list[str]]]:
    """``[(variant name, overrides applied after the user's, what it changes from the baseline)]``
    in table order; on CPU without the fused routing kernel (its ``auto`` is the reference there)."""
    if not ablate:
        return [("config", [], [])]
    levers = [lv for lv in LEVERS if platform != "cpu" or lv != "fused routing kernel"]
    out = [("baseline", list(BASELINE), list(BASELINE))]
    for lever in levers:
        on = lever_overrides(lever, expert_axis)
        out.append((f"+{lever}", [*BASELINE, *on], on))
    on = [o for lever in levers for o in lever_overrides(lever, expert_axis)]
    out.append(("all levers", [*BASELINE, *on], on))
    return out


@dataclasses.dataclass
class VariantRecord:
    name: str
    overrides: list[str]  # what the variant sets on top of the user's config
    settings: list[str]  # what it changes from the baseline (the baseline: its own settings)
    tokens_per_s: float  # median over rounds
    tokens_per_s_rounds: list[float]
    step_ms: float  # median of all timed steps
    step_ms_p10: float
    step_ms_p90: float
    mfu: float | None
    compile_s: float  # lower + compile of the train step (no persistent cache)
    memory_bytes: int | None  # per device: compiled arguments + temporaries
    memory: dict[str, int]  # Trainer.memory_per_device()
    profile: dict[str, Any] | None = None  # --profile: ms per step by kind of work


@dataclasses.dataclass
class TrainBenchResult:
    config: str
    platform: str
    mesh: dict[str, int]
    tokens_per_step: int
    steps: int
    rounds: int
    model_flops_per_token: float
    peak_tflops: float | None  # all devices together
    peak_source: str
    records: list[VariantRecord]
    jax: str = ""  # jax version
    date: str = ""  # when it ran (UTC, ISO 8601)

    def record(self, name: str) -> VariantRecord:
        return next(r for r in self.records if r.name == name)


class _Runner:
    """One variant: its Trainer, compiled step, data pipeline and the times of its timed steps."""

    def __init__(self, name: str, overrides: list[str], settings: list[str], cfg, corpus, run_dir: Path):
        import jax

        from moefast.data import train_dataset
        from moefast.train import Trainer
        from moefast.train.prefetch import DevicePrefetcher

        self.name, self.overrides, self.settings = name, overrides, settings
        self.trainer = Trainer(cfg, run_dir, log=None, progress=False, corpus=corpus)
        t0 = time.perf_counter()
        self.step = self.trainer.compiled_train_step()
        self.compile_s = time.perf_counter() - t0
        self.memory = self.trainer.memory_per_device()
        data = iter(train_dataset(corpus, cfg.data, seed=cfg.train.seed, process_index=jax.process_index(),
                                  process_count=jax.process_count()))
        self.batches = DevicePrefetcher(data, self.trainer.put_batch, cfg.data.prefetch_batches(self.trainer.platform))
        self.step_s: list[float] = []
        self.round_s: list[float] = []

    def run(self, state, steps: int, *, timed: bool = True):
        import jax

        total = 0.0
        with jax.set_mesh(self.trainer.mesh):
            for _ in range(steps):
                t0 = time.perf_counter()
                batch, _ = next(self.batches)
                state, _ = self.step(state, batch, self.trainer.base_key)
                jax.block_until_ready(state)
                dt = time.perf_counter() - t0
                total += dt
                if timed:
                    self.step_s.append(dt)
        if timed:
            self.round_s.append(total)
        return state


def _profile(runner: _Runner, state, out_dir: Path):
    import jax

    from moefast.bench.xla_profile import WORK_KINDS, classify_work, latest_trace, xla_trace_times

    out_dir.mkdir(parents=True, exist_ok=True)
    state = runner.run(state, 1, timed=False)
    t0 = time.perf_counter()
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        state = runner.run(state, PROFILE_STEPS, timed=False)
    wall = (time.perf_counter() - t0) / PROFILE_STEPS
    trace = latest_trace(out_dir)
    times = xla_trace_times(trace, classify_work(runner.step.as_text()), PROFILE_STEPS, kind_names=WORK_KINDS)
    return state, {"kinds_ms": times["kinds"], "profiled_step_ms": 1e3 * wall, "trace": trace,
                   "unattributed_worker_ms": times["unattributed_worker_ms"]}


def bench_train(config: str | None = None, overrides: list[str] | None = None, *, steps: int = 10, rounds: int = 3,
                ablate: bool = False, profile_dir: str | Path | None = None,
                log: Callable[[str], None] | None = None) -> TrainBenchResult:
    """Runs the measurements of the module docstring.

    Args:
      config, overrides: the experiment (YAML path or ``None`` for the tiny config; ``section.key=value``).
      steps: timed steps per variant and round (after one untimed step).
      rounds: rounds over the variants.
      ablate: the five variants of the lever table instead of the config alone.
      profile_dir: also profile each variant (traces under ``profile_dir/<variant>``).
      log: progress printer (``print``-like); ``None`` prints nothing.

    Raises:
      ConfigError: a bad config, or ``--ablate`` on a dropless config (the one-hot baseline needs a
        capacity).
      ValueError: ``steps`` or ``rounds`` < 1.
    """
    import jax

    from moefast.config import ConfigError, load_config
    from moefast.data import load_corpus
    from moefast.parallel import make_mesh, platform
    from moefast.train.mfu import mfu

    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got {steps} and {rounds}")
    user = list(overrides or [])
    cfg0 = load_config(config, [*user, *_FIXED])
    if ablate and cfg0.moe.dropless:
        raise ConfigError("moe.capacity_factor: --ablate compares against GShard's one-hot dispatch, which needs a "
                          "capacity; dropless (0) has none: benchmark it without --ablate, or set a capacity_factor > 0")
    say = log or (lambda _: None)
    tokens_per_step = cfg0.data.batch_size * cfg0.data.seq_len
    mesh0 = make_mesh(cfg0)
    mesh = dict(mesh0.shape)
    corpus = load_corpus(cfg0.data)
    say(f"corpus: {corpus.summary()} | mesh {mesh}")
    runners: list[_Runner] = []
    with tempfile.TemporaryDirectory(prefix="moefast-bench-train-") as tmp:
        for name, extra, settings in variant_overrides(ablate, mesh.get("expert", 1), platform(mesh0)):
            cfg = load_config(config, [*user, *_FIXED, *extra])
            runners.append(_Runner(name, extra, settings, cfg, corpus, Path(tmp) / str(len(runners))))
            say(f"compiled {name} in {runners[-1].compile_s:.1f} s")
        first = runners[0].trainer
        with jax.set_mesh(first.mesh):
            state = first.init_state()
        try:
            for r in range(rounds):
                k = r % len(runners)
                for runner in runners[k:] + runners[:k]:
                    state = runner.run(state, 1, timed=False)  # warm: the switch between programs is not timed
                    state = runner.run(state, steps)
                say(f"round {r + 1}/{rounds}: " + ", ".join(
                    f"{v.name} {tokens_per_step * steps / v.round_s[-1]:,.0f} tokens/s" for v in runners))
            profiles = {}
            if profile_dir is not None:
                for i, runner in enumerate(runners):
                    state, profiles[runner.name] = _profile(runner, state, Path(profile_dir) / _slug(runner.name, i))
                    say(f"profiled {runner.name}")
        finally:
            for runner in runners:
                runner.batches.close()
    peak = first.peak
    records = []
    for runner in runners:
        tps_rounds = [tokens_per_step * steps / s for s in runner.round_s]
        tps = statistics.median(tps_rounds)
        ms = sorted(1e3 * s for s in runner.step_s)
        mem = runner.memory
        mem_bytes = (mem["compiled_argument_bytes"] + mem["compiled_temp_bytes"]
                     if "compiled_temp_bytes" in mem else None)
        records.append(VariantRecord(
            name=runner.name, overrides=runner.overrides, settings=runner.settings, tokens_per_s=tps, tokens_per_s_rounds=tps_rounds,
            step_ms=statistics.median(ms), step_ms_p10=_percentile(ms, 10), step_ms_p90=_percentile(ms, 90),
            mfu=mfu(tps, first.flops_per_token, peak), compile_s=runner.compile_s, memory_bytes=mem_bytes,
            memory=mem, profile=profiles.get(runner.name)))
    return TrainBenchResult(
        config=cfg0.name, platform=f"{jax.devices()[0].platform} ({jax.device_count()} device(s))", mesh=mesh,
        tokens_per_step=tokens_per_step, steps=steps, rounds=rounds, model_flops_per_token=first.flops_per_token,
        peak_tflops=None if peak.flops_per_s is None else peak.flops_per_s / 1e12, peak_source=peak.source,
        records=records, jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _slug(name: str, i: int) -> str:
    return f"{i}_" + "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an ascending list."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def format_table(r: TrainBenchResult) -> str:
    """Markdown: one row per variant; ratios of tokens/s to the baseline and to all levers (ablation)."""
    ablate = len(r.records) > 1
    head = "| variant | tokens/s | step ms, median (p10–p90) | MFU | "
    head += "vs baseline | vs all levers | " if ablate else ""
    head += "memory / device, GiB | compile s | settings" + (" (changes from the baseline)" if ablate else "") + " |"
    lines = [head, "|---|" + "---:|" * (head.count("|") - 3) + "---|"]
    base = r.records[0].tokens_per_s
    allv = r.records[-1].tokens_per_s
    for v in r.records:
        row = (f"| {v.name} | {v.tokens_per_s:,.0f} | {v.step_ms:.1f} ({v.step_ms_p10:.1f}–{v.step_ms_p90:.1f}) | "
               + ("n/a" if v.mfu is None else f"{100 * v.mfu:.1f}%") + " | ")
        if ablate:
            row += f"{v.tokens_per_s / base:.2f}× | {v.tokens_per_s / allv:.2f}× | "
        mem = "n/a" if v.memory_bytes is None else f"{v.memory_bytes / 2**30:.2f}"
        row += f"{mem} | {v.compile_s:.1f} | {' '.join(v.settings) or 'as configured'} |"
        lines.append(row)
    return "\n".join(lines)


def format_profile_table(r: TrainBenchResult) -> str:
    """Markdown: share of the traced step time by kind of work, one column per profiled variant."""
    from moefast.bench.xla_profile import WORK_KINDS

    profiled = [v for v in r.records if v.profile]
    if not profiled:
        return ""
    lines = ["| kind of work | " + " | ".join(v.name for v in profiled) + " |",
             "|---|" + "---:|" * len(profiled)]
    totals = {v.name: sum(v.profile["kinds_ms"].values()) or 1.0 for v in profiled}
    for k in WORK_KINDS:
        lines.append(f"| {k} | " + " | ".join(
            f"{100 * v.profile['kinds_ms'][k] / totals[v.name]:.0f}% ({v.profile['kinds_ms'][k]:.1f} ms)"
            for v in profiled) + " |")
    lines.append("| op time summed over XLA's threads, ms/step | " + " | ".join(f"{totals[v.name]:.1f}" for v in profiled) + " |")
    lines.append("| wall time, ms/step (profiled) | " + " | ".join(f"{v.profile['profiled_step_ms']:.1f}"
                                                                for v in profiled) + " |")
    return "\n".join(lines)


def run_cli(*, json_out: str | None, steps: int, rounds: int, ablate: bool, config: str | None = None,
            overrides: list[str] | None = None, profile_dir: str | None = None) -> int:
    r = bench_train(config, overrides, steps=steps, rounds=rounds, ablate=ablate, profile_dir=profile_dir, log=print)
    peak = "unknown" if r.peak_tflops is None else f"{r.peak_tflops:,.3g} TFLOP/s"
    header = (f"train step, config {r.config} ({r.tokens_per_step:,} tokens/step, "
              f"{r.model_flops_per_token / 1e6:,.1f} MFLOP/token), mesh {r.mesh}, {r.platform}, jax {r.jax}, {r.date}; "
              f"{r.rounds} round(s) of {r.steps} timed steps per variant; MFU against {peak} [{r.peak_source}]")
    print(f"\n{header}\n")
    table = format_table(r)
    print(table)
    prof = format_profile_table(r)
    if prof:
        print(f"\nshare of traced op time by kind of work ({PROFILE_STEPS} profiled steps per variant; traces in "
              f"{profile_dir})\n")
        print(prof)
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, dataclasses.asdict(r), f"{header}\n\n{table}\n" + (f"\n{prof}\n" if prof else ""))
    return 0
