"""``moefast bench overlap``: the overlap lever, measured side by side in one run.

On a mesh with an expert axis (default ``mesh.data=2 mesh.expert=4``, 8 devices: ``moefast bench
overlap`` starts 8 virtual CPU devices unless ``--cpu-devices`` says otherwise):

* **train-step time per chunk count** n (``moe.overlap_chunks`` in ``CHUNKS``): every compiled
  step in this process, timed steps alternating between them (n = 1, 2, 4, 1, 2, 4, ...), medians;
* **the compiled program's collectives** per n (:mod:`moefast.parallel.hlo`): all-to-alls per
  step and their bytes, whether the n dispatches of each MoE layer's forward are independent (no
  dispatch depends on another all-to-all), and, on GPU, how many all-to-alls are asynchronous with
  compute scheduled inside;
* **device prefetch on / off** (``data.prefetch`` as on a GPU — ``auto`` is 1 — vs 0): tokens/s of
  real ``moefast train`` processes (their summaries), alternating.

XLA:CPU runs collectives synchronously, so on CPU the chunks cannot overlap anything: there the
point is that chunking costs little (and the results are right, see the tests).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

import jax

from moefast.bench.process import alternating_step_times, train_process, write_results

__all__ = ["CHUNKS", "DEFAULT_MESH", "OverlapBenchResult", "bench_overlap", "exchange_report", "format_table"]

CHUNKS = (1, 2, 4)
DEFAULT_MESH = ["mesh.data=2", "mesh.expert=4"]


@dataclasses.dataclass
class OverlapBenchResult:
    config: str
    mesh: dict[str, int]
    platform: str
    tokens_per_step: int
    steps: int  # timed steps per chunk count
    step_s: dict[int, float]  # chunk count -> median seconds per train step
    collectives: dict[int, dict[str, Any]]  # chunk count -> exchange_report()
    prefetch_tokens_per_s: dict[int, list[float]]  # data.prefetch -> tokens/s of each train process

    def ratio(self, n: int) -> float:
        """Step time of n chunks over one."""
        return self.step_s[n] / self.step_s[1]


def exchange_report(hlo_text: str, moe_layers: int, chunks: int) -> dict[str, Any]:
    """All-to-alls of a compiled train step: count, bytes, async ones, and whether each MoE layer's
    forward dispatches are independent.

    The forward of a layer has ``chunks`` dispatches and ``chunks`` returns; the backward the same
    again. A dispatch of the forward depends on no other all-to-all of its layer; with XLA's
    dependency walk (:meth:`HloModule.depends_on`) the report counts, over the whole step, the
    all-to-alls that depend on no other all-to-all at all: the first layer's forward dispatches,
    which must be ``chunks`` (not 1, which would mean the chunks were chained).
    """
    from moefast.parallel.hlo import HloModule

    m = HloModule(hlo_text)
    # the expert exchange's: issued inside the expert shard_map (the partitioner may add its own,
    # e.g. moving the embedding's gradient rows to the devices that hold them)
    a2a = [c for c in m.collectives() if c.kind == "all-to-all" and "shard_map" in c.op_name]
    deps = m.dependencies([c.name for c in a2a])
    roots = [n for n, d in deps.items() if not d]
    return {"all_to_alls": len(a2a), "expected": 4 * chunks * moe_layers,
            "bytes": sum(c.bytes for c in a2a), "independent_first_dispatches": len(roots),
            "async": sum(c.is_async for c in a2a),
            "async_with_compute_inside": sum(c.is_async and c.compute_between > 0 for c in a2a)}


def _step_times(cfg, steps: int) -> tuple[dict[int, float], dict[int, dict[str, Any]]]:
    from moefast.data import load_corpus, train_dataset
    from moefast.train import Trainer

    corpus = load_corpus(cfg.data)
    runners, reports = {}, {}
    moe_layers = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    with tempfile.TemporaryDirectory() as tmp:
        for n in CHUNKS:
            c = cfg.replace(moe=dataclasses.replace(cfg.moe, overlap_chunks=n))
            trainer = Trainer(c, Path(tmp) / str(n), log=None, progress=False, corpus=corpus)
            batch = next(iter(train_dataset(corpus, c.data, seed=0)))
            with jax.set_mesh(trainer.mesh):
                batch, state = trainer.put_batch(batch), trainer.init_state()
            step = trainer.compiled_train_step()
            reports[n] = exchange_report(step.as_text(), moe_layers, n)
            runners[n] = [trainer, step, state, batch]
        times = alternating_step_times(list(runners.values()), steps)
    return {n: statistics.median(t) for n, t in zip(runners, times)}, reports


def _prefetch_runs(overrides: list[str], config: str | None, steps: int, rounds: int,
                   cpu_devices: int, on: int) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {on: [], 0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for p in (on, 0) if r % 2 == 0 else (0, on):
                summary, _ = train_process(Path(tmp) / f"p{p}_{r}", [
                    "--cpu-devices", str(cpu_devices), *overrides, f"data.prefetch={p}", f"train.steps={steps + 1}",
                    "train.eval_every=0", "train.checkpoint_every=0", f"train.log_every={steps + 1}"], config)
                out[p].append(float(summary["tokens_per_s"]))
    return out


def bench_overlap(config: str | None = None, overrides: list[str] | None = None, *, steps: int = 10,
                  rounds: int = 3, cpu_devices: int = 8) -> OverlapBenchResult:
    """Runs the three measurements of the module docstring.

    Args:
      config, overrides: the experiment (default: the tiny config on ``DEFAULT_MESH``; overrides
        come after the default mesh, so ``mesh.expert=8`` etc. replace it).
      steps: timed steps per chunk count (after one warm-up each), and per train process.
      rounds: train processes per prefetch setting (0: no prefetch comparison).
      cpu_devices: devices of the train processes (as ``--cpu-devices``).

    Raises:
      ValueError: the mesh has no expert axis (nothing to chunk).
    """
    from moefast.config import load_config

    from moefast.parallel import make_mesh

    overrides = [*DEFAULT_MESH, *(overrides or [])]
    cfg = load_config(config, overrides)
    mesh = dict(make_mesh(cfg).shape)  # resolves mesh.* = -1 against this process's devices
    if mesh["expert"] < 2:
        raise ValueError(f"bench overlap needs an expert axis of 2 or more devices, got mesh {mesh} (set mesh.expert, "
                         "and --cpu-devices for more virtual CPU devices)")
    step_s, reports = _step_times(cfg, steps)
    prefetch = _prefetch_runs(overrides, config, steps, rounds, cpu_devices, max(cfg.data.prefetch_batches("gpu"), 1))
    return OverlapBenchResult(
        config=cfg.name, mesh=mesh, platform=f"{jax.devices()[0].platform} "
        f"({jax.device_count()} device(s))", tokens_per_step=cfg.data.batch_size * cfg.data.seq_len, steps=steps,
        step_s=step_s, collectives=reports, prefetch_tokens_per_s=prefetch)


def format_table(r: OverlapBenchResult) -> str:
    lines = ["| overlap_chunks | step, ms (median) | tokens/s | step / n=1 | all-to-alls per step (expected) | "
             "all-to-all MiB per step | independent first-layer dispatches | async (with compute inside) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in CHUNKS:
        c = r.collectives[n]
        lines.append(f"| {n} | {1e3 * r.step_s[n]:.1f} | {r.tokens_per_step / r.step_s[n]:,.0f} | {r.ratio(n):.3f} | "
                     f"{c['all_to_alls']} ({c['expected']}) | {c['bytes'] / 2**20:.2f} | "
                     f"{c['independent_first_dispatches']} | {c['async']} ({c['async_with_compute_inside']}) |")
    med = {p: statistics.median(v) for p, v in r.prefetch_tokens_per_s.items() if v}
    if not med:
        return "\n".join(lines)
    on = max(med)
    lines += ["", "| data.prefetch | moefast train tokens/s (each process) | median |", "|---:|---|---:|"]
    for p in (on, 0):
        lines.append(f"| {p} | {', '.join(f'{v:,.0f}' for v in r.prefetch_tokens_per_s[p])} | {med[p]:,.0f} |")
    lines.append(f"\nprefetch on / off: {med[on] / med[0]:.3f}×")
    return "\n".join(lines)


def run_cli(*, json_out: str | None, steps: int, rounds: int, config: str | None = None,
            overrides: list[str] | None = None, cpu_devices: int = 8) -> int:
    r = bench_overlap(config, overrides, steps=steps, rounds=rounds, cpu_devices=cpu_devices)
    print(f"\noverlap lever, config {r.config} ({r.tokens_per_step} tokens/step), mesh {r.mesh}, {r.platform}; "
          f"medians of {r.steps} alternating steps; {rounds} train process(es) per prefetch setting\n")
    table = format_table(r)
    print(table)
    if json_out:
        write_results(json_out, dataclasses.asdict(r), table)
    return 0
