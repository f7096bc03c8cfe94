"""``moefast bench memory``: per-device memory of a config's train step for each rematerialisation
policy, with layers scanned or unrolled and with gradient accumulation, without running a step.

Every variant compiles the real train step for the config's mesh (``Trainer.compiled_train_step``,
persistent compilation cache off) and reads XLA's ``compiled.memory_analysis()``: the bytes of the
compiled arguments (parameters, optimizer state, routing state and the batch, per device) and of
its temporaries (activations kept for the backward pass, gradients, workspace). Parameter and
optimizer bytes per device come from the state's shardings. Nothing is allocated or run, so a
config sized for a GPU can be checked on a laptop: with ``--cpu-devices N`` and mesh overrides, the
figures are those of each of N devices. They are XLA:CPU's buffer assignment; a GPU's differs
somewhat (other fusions and scheduling), so leave headroom.

Variants: ``model.remat`` in :data:`REMAT_ORDER` x ``model.scan_layers`` false/true at the config's
``train.grad_accum_steps``, then ``train.grad_accum_steps`` 2 and 4 (where they divide the batch
over the mesh) at the config's remat and scan settings. A key set in the overrides is not varied:
``model.scan_layers=true`` gives the remat policies and accumulation with scanned layers only.
"""

from __future__ import annotations

import dataclasses
import datetime
import tempfile
import time
from typing import Callable

__all__ = ["MemoryBenchResult", "MemoryRecord", "REMAT_ORDER", "bench_memory", "format_table", "memory_variants"]

REMAT_ORDER = ("none", "save_dots", "save_dots_no_batch", "minimal", "full")
ACCUM_STEPS = (2, 4)
_VARIED = ("model.remat", "model.scan_layers", "train.grad_accum_steps")


@dataclasses.dataclass
class MemoryRecord:
    remat: str
    scan_layers: bool
    grad_accum_steps: int
    param_bytes: int  # per device
    optimizer_bytes: int
    argument_bytes: int | None  # compiled step's arguments (state + batch)
    temp_bytes: int | None  # compiled step's temporaries
    total_bytes: int | None  # arguments + temporaries
    compile_s: float  # trace + lower + compile
    fits: bool | None  # total_bytes <= device memory, when that is known
    step_ms: float | None = None  # --steps: median time of one step, the variants' steps interleaved
    tokens_per_s: float | None = None


@dataclasses.dataclass
class MemoryBenchResult:
    config: str
    platform: str
    mesh: dict[str, int]
    tokens_per_step: int
    device_bytes: int | None  # memory of one device (--device-gib, or the GPU's own limit)
    device_source: str
    records: list[MemoryRecord]
    overrides: list[str] = dataclasses.field(default_factory=list)  # the user's, on top of the config
    skipped: list[str] = dataclasses.field(default_factory=list)  # variants that do not fit the mesh
    steps: int = 0  # timed steps per variant (0: none run)
    jax: str = ""
    date: str = ""


def memory_variants(overrides: list[str], cfg, skipped: list[str] | None = None) -> list[list[str]]:
    """The overrides of each variant (see the module docstring), given the user's overrides and the
    config they load; accumulation steps that do not fit the batch over the mesh are left out and
    named in ``skipped`` (if given)."""
    from moefast.parallel.mesh import BATCH_AXES, mesh_shape
    import jax

    fixed = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    remats = [cfg.model.remat] if "model.remat" in fixed else list(REMAT_ORDER)
    scans = [cfg.model.scan_layers] if "model.scan_layers" in fixed else [False, True]
    m0 = cfg.train.grad_accum_steps
    out = [[f"model.remat={r}", f"model.scan_layers={str(s).lower()}", f"train.grad_accum_steps={m0}"]
           for s in scans for r in remats]
    if "train.grad_accum_steps" not in fixed:
        sizes = mesh_shape(cfg, jax.device_count())
        shards = 1
        for a in BATCH_AXES:
            shards *= sizes[a]
        for m in ACCUM_STEPS:
            if m == m0:
                continue
            if cfg.data.batch_size % (m * shards) == 0:
                out.append([f"model.remat={cfg.model.remat}", f"model.scan_layers={str(cfg.model.scan_layers).lower()}",
                            f"train.grad_accum_steps={m}"])
            elif skipped is not None:
                skipped.append(f"train.grad_accum_steps={m} (data.batch_size={cfg.data.batch_size} over {shards} "
                               "batch shards)")
    return out


def _device_bytes(device_gib: float | None) -> tuple[int | None, str]:
    import jax

    if device_gib is not None:
        return int(device_gib * 2**30), "--device-gib"
    stats = jax.devices()[0].memory_stats() or {}
    if jax.default_backend() != "cpu" and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{jax.devices()[0].device_kind} bytes_limit"
    return None, "unknown (pass --device-gib)"


def bench_memory(config: str | None = None, overrides: list[str] | None = None, *, device_gib: float | None = None,
                 steps: int = 0, log: Callable[[str], None] | None = None) -> MemoryBenchResult:
    """Compiles each variant's train step and reads its memory (module docstring); with ``steps``,
    also times that many steps of each variant, the variants' steps interleaved (one untimed step
    each first; every variant holds its own train state, so this is for configs that fit).

    Args:
      config, overrides: the experiment (YAML path or ``None`` for the tiny config; ``section.key=value``).
      device_gib: memory of one device in GiB (``None``: the accelerator's own limit; unknown on CPU).
      steps: timed steps per variant (0: compile only, nothing allocated).
      log: progress printer; ``None`` prints nothing.

    Raises:
      ConfigError: a bad config.
      ValueError: ``steps`` < 0.
    """
    import statistics

    import jax

    from moefast.bench.process import alternating_step_times
    from moefast.config import load_config
    from moefast.data import load_corpus, train_dataset
    from moefast.train import Trainer

    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    overrides = list(overrides or [])
    base = load_config(config, overrides)
    device_bytes, device_source = _device_bytes(device_gib)
    corpus = load_corpus(base.data) if steps else None
    batch = None
    records: list[MemoryRecord] = []
    runners = []
    mesh = None
    with tempfile.TemporaryDirectory(prefix="moefast-bench-memory-") as tmp:
        skipped: list[str] = []
        for i, variant in enumerate(memory_variants(overrides, base, skipped)):
            cfg = load_config(config, [*overrides, *variant, "cache.compile_dir=null"])
            trainer = Trainer(cfg, f"{tmp}/{i}", log=None, progress=False, corpus=corpus)
            mesh = dict(trainer.mesh.shape)
            t0 = time.perf_counter()
            compiled = trainer.compiled_train_step()
            compile_s = time.perf_counter() - t0
            mem = trainer.memory_per_device()
            args, temp = mem.get("compiled_argument_bytes"), mem.get("compiled_temp_bytes")
            total = None if args is None or temp is None else args + temp
            rec = MemoryRecord(remat=cfg.model.remat, scan_layers=cfg.model.scan_layers,
                               grad_accum_steps=cfg.train.grad_accum_steps, param_bytes=mem["param_bytes"],
                               optimizer_bytes=mem["optimizer_bytes"], argument_bytes=args, temp_bytes=temp,
                               total_bytes=total, compile_s=compile_s,
                               fits=None if device_bytes is None or total is None else total <= device_bytes)
            records.append(rec)
            if log:
                log(f"  {_name(rec)}: temporaries {_gib(temp)}, total {_gib(total)} per device, compiled in "
                    f"{compile_s:.1f} s")
            if steps:
                if batch is None:  # one batch for every variant: the same work in each
                    batch = next(iter(train_dataset(corpus, cfg.data, seed=cfg.train.seed,
                                                    process_index=jax.process_index(),
                                                    process_count=jax.process_count())))
                runners.append([trainer, compiled, trainer.init_state(), trainer.put_batch(batch)])
            del trainer
        if steps:
            if log:
                log(f"timing {steps} steps per variant, interleaved ...")
            for rec, times in zip(records, alternating_step_times(runners, steps)):
                rec.step_ms = 1e3 * statistics.median(times)
                rec.tokens_per_s = base.data.batch_size * base.data.seq_len / statistics.median(times)
    return MemoryBenchResult(
        config=config or "configs/tiny.yaml", platform=jax.default_backend(), mesh=mesh or {},
        tokens_per_step=base.data.batch_size * base.data.seq_len, device_bytes=device_bytes,
        device_source=device_source, records=records, overrides=overrides, skipped=skipped, steps=steps,
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"))


def _name(r: MemoryRecord) -> str:
    return f"remat={r.remat} scan={'on' if r.scan_layers else 'off'} accum={r.grad_accum_steps}"


def _gib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**30:,.3f} GiB"


def format_table(r: MemoryBenchResult) -> str:
    """Markdown table: one row per variant, bytes per device in GiB."""
    fit = r.device_bytes is not None
    head = ["remat", "scan_layers", "grad_accum_steps", "params GiB", "optimizer GiB", "arguments GiB",
            "temporaries GiB", "total GiB", "vs first", "compile s"] + ([f"fits {r.device_bytes / 2**30:,.1f} GiB"]
                                                                      if fit else [])
    if r.steps:
        head += ["step ms", "tokens/s", "step time vs first"]
    first_ms = r.records[0].step_ms if r.records else None
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = r.records[0].total_bytes if r.records else None
    g = lambda b: "n/a" if b is None else f"{b / 2**30:,.3f}"
    for x in r.records:
        rel = f"{x.total_bytes / first:.2f}x" if first and x.total_bytes else "n/a"
        row = [x.remat, "on" if x.scan_layers else "off", str(x.grad_accum_steps), g(x.param_bytes),
               g(x.optimizer_bytes), g(x.argument_bytes), g(x.temp_bytes), g(x.total_bytes), rel, f"{x.compile_s:.1f}"]
        if fit:
            row.append("yes" if x.fits else "no")
        if r.steps:
            row += [f"{x.step_ms:,.1f}", f"{x.tokens_per_s:,.0f}", f"{x.step_ms / first_ms:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_cli(*, json_out: str | None, config: str | None, overrides: list[str] | None,
            device_gib: float | None, steps: int = 0) -> int:
    r = bench_memory(config, overrides, device_gib=device_gib, steps=steps, log=print)
    header = (f"train-step memory per device, config {r.config}"
              + (f" with {' '.join(r.overrides)}" if r.overrides else "")
              + f" ({r.tokens_per_step:,} tokens/step), mesh {r.mesh}, {r.platform}, jax {r.jax}, {r.date}; "
              "memory: XLA memory_analysis of the compiled step; device memory: "
              + (f"{_gib(r.device_bytes)} [{r.device_source}]" if r.device_bytes else r.device_source)
              + (f"; step times: median of {r.steps} steps per variant, interleaved" if r.steps else "")
              + (f"; left out (do not fit the mesh): {', '.join(r.skipped)}" if r.skipped else ""))
    table = format_table(r)
    print(f"\n{header}\n\n{table}")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, dataclasses.asdict(r), f"{header}\n\n{table}\n")
    return 0

