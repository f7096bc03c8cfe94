"""``moefast bench gpu-compile --ablate``: lever tables estimated for GPUs (compiled, nothing run).

Each row compiles the train step for compile-only GPUs (:func:`moefast.bench.gpu_compile.gpu_compile`)
and reads XLA's trip-weighted estimate of its costing twin (:mod:`moefast.bench.gpu_schedule`):
estimated step, its exposed collectives, the worst loop body's exposed share, the estimated model
TFLOP/s per GPU, and the program's own peak memory. Two tables:

* ``levers`` (``--ablate``): the seed's levers, each alone against a baseline with all of them off
  (:data:`SEED_BASELINE`), and all together;
* ``exchange`` (``--ablate exchange``): the expert exchange's levers (:data:`EXCHANGE_LEVERS`), each
  alone added to the config as given (the baseline), and all together; for expert-parallel
  configs across hosts (``--network``);
* ``precision`` (``--ablate-precision``): the config with ``model.precision`` bf16, then fp8
  (:data:`PRECISION_ROWS`). XLA's own estimate charges each launch of the kernels a flat 10 µs
  (a custom call): only the re-costed columns, which cost them by one rule for both precisions
  (:data:`moefast.bench.kernel_costs.GEMM_KERNEL_UTILIZATION`), compare the two.
"""

from __future__ import annotations

import datetime
from typing import Callable

__all__ = ["EXCHANGE_LEVERS", "PRECISION_ROWS", "SEED_BASELINE", "SEED_LEVERS", "ablate", "format_ablation",
           "run_ablation"]

# The levers of the seed's table, each a switch of its own (the baseline has them all off).
SEED_BASELINE = ["cache.tables=false", "moe.dispatch=onehot", "moe.routing_impl=reference",
                 "model.attention_impl=blocked", "moe.overlap_chunks=1"]
SEED_LEVERS = {
    "+caching (positional tables and mask once per step)": ["cache.tables=true"],
    "+slot dispatch (vs GShard one-hot einsums)": ["moe.dispatch=slot"],
    "+fused routing kernel (vs reference routing)": ["moe.routing_impl=auto"],
    "+fused attention (vs block-causal einsums)": ["model.attention_impl=auto"],
    "+overlap (expert exchange in 2 chunks)": ["moe.overlap_chunks=2"],
    "+overlap (expert exchange in 4 chunks)": ["moe.overlap_chunks=4"],
}
# The expert exchange's levers across hosts, each added to the config as given.
EXCHANGE_LEVERS = {
    "+hierarchical exchange (node-limited: once per host, then NVLink)": ["moe.exchange=hierarchical"],
    "+FP8 dispatch (e4m3, a scale per 128 channels)": ["moe.dispatch_dtype=float8_e4m3fn"],
    "+4 collectives in flight (XLA's parallel collective overlap limit)": ["overlap.collectives_in_flight=4"],
    "+exchange in 2 independent chunks (hierarchical: token slices; flat: capacity slices)": ["moe.overlap_chunks=2"],
    "+2 sequence slices through the layers (one slice's exchange under the other's compute)":
        ["model.sequence_slices=2"],
}
# The GEMMs' input format (model.precision), the rest of the config as given.
PRECISION_ROWS = {
    "bf16 GEMMs (model.precision=bf16)": ["model.precision=bf16"],
    "fp8 GEMMs (e4m3, 1 x 128 / 128 x 128 scales; the Triton FP8 kernels)": ["model.precision=fp8"],
}
TABLES = ("levers", "exchange", "precision")


def ablate(table: str, config: str | None, overrides: list[str] | None, *, gpu: str = "h100", devices: str = "8",
           network: str | None = None, twin: bool = True, autotune: str | None = None,
           log: Callable[[str], None] | None = None, gemm_utilization: float | None = None) -> list[dict]:
    """The rows of lever table ``table`` (module docstring); ``twin``, ``autotune``, ``network`` and
    ``gemm_utilization`` as in :func:`~moefast.bench.gpu_compile.gpu_compile`.

    Raises:
      ValueError: an unknown ``table``.
      ConfigError: ``levers`` on a dropless config (the baseline's one-hot dispatch needs a
        capacity); ``exchange`` on a config without an expert axis across hosts.

    Returns:
      One dict per row: ``name``, ``overrides``, ``step`` (estimate; µs under XLA's speed-of-light
      estimator), ``speedup`` (baseline / row), ``exposed`` and ``exposed_all_to_all`` (shares of the
      row's step), ``worst_body`` (the largest exposed share of a loop body), ``tflops`` (estimated
      model TFLOP/s per GPU), ``unit``, ``peak_bytes``, ``fits``.
    """
    from moefast.bench.gpu_compile import gpu_compile, parse_devices
    from moefast.config import ConfigError, load_config
    from moefast.parallel import mesh_shape

    if table not in TABLES:
        raise ValueError(f"--ablate {table!r}: the tables are {', '.join(TABLES)}")
    cfg = load_config(config, list(overrides or []))
    hosts, per_host = parse_devices(devices)
    ep = mesh_shape(cfg, hosts * per_host)["expert"]
    if table == "levers":
        if cfg.moe.dropless:
            raise ConfigError("moe.capacity_factor: --ablate compares against GShard's one-hot dispatch, which needs a "
                              "capacity; dropless (0) has none: compile it without --ablate, or set a capacity_factor > 0")
        base = SEED_BASELINE
        rows = [("baseline", [])] + [(k, v) for k, v in SEED_LEVERS.items() if ep > 1 or "overlap" not in k]
        rows.append(("all levers", [o for name, v in rows for o in v if "4 chunks" not in name]))  # 2 chunks
    elif table == "precision":
        base, rows = [], list(PRECISION_ROWS.items())
    else:
        if ep <= per_host or hosts == 1:
            raise ConfigError(f"--ablate-exchange compares ways of crossing hosts: the expert axis (mesh.expert={ep}) "
                              f"must span several hosts of --devices {devices}")
        base = []
        rows = [("baseline (the config as given)", [])] + list(EXCHANGE_LEVERS.items())
        rows.append(("all levers", [o for _, v in EXCHANGE_LEVERS.items() for o in v]))
    out = []
    for name, extra in rows:
        if log:
            log(f"[{name}]")
        r = gpu_compile(config, [*(overrides or []), *base, *extra], gpu=gpu, devices=devices, network=network,
                        gemm_utilization=gemm_utilization,
                        twin=twin, autotune=autotune)
        e = r.estimate or {}
        step = e.get("step", 0.0)
        gpus = hosts * per_host
        bodies = [c["exposed"] / c["length"] for c in e.get("computations", []) if c["loop_body"] and c["length"]]
        rc = e.get("recosted") or {}
        rbodies = [c["recosted_exposed"] / c["recosted_length"] for c in e.get("computations", [])
                   if c["loop_body"] and c.get("recosted_length")]
        out.append({"name": name, "overrides": extra, "step": step, "unit": e.get("unit", ""),
                    "recosted_step": rc.get("step", 0.0),
                    "recosted_exposed": rc["exposed"] / rc["step"] if rc.get("step") else 0.0,
                    "recosted_worst_body": max(rbodies, default=0.0),
                    "quantize_kernels": rc["quantize_kernels"] / rc["step"] if rc.get("step") else 0.0,
                    "quantize_xla": rc["quantize_xla"] / rc["step"] if rc.get("step") else 0.0,
                    "network_floor": (e.get("network_floor") or {}).get("step", 0.0),
                    "exposed": e.get("exposed", 0.0) / step if step else 0.0,
                    "exposed_all_to_all": e.get("exposed_by_kind", {}).get("all-to-all", 0.0) / step if step else 0.0,
                    "worst_body": max(bodies, default=0.0),
                    "tflops": r.model_flops_per_step / (step / 1e6) / gpus / 1e12 if step and e.get("unit") == "µs"
                    else None,
                    "peak_bytes": r.peak_bytes, "fits": r.fits, "baseline": base})
    for row in out:
        row["speedup"] = out[0]["step"] / row["step"] if row["step"] else float("nan")
        row["recosted_speedup"] = out[0]["recosted_step"] / row["recosted_step"] if row["recosted_step"] else float("nan")
        row["recosted_tflops"] = (row["tflops"] * row["step"] / row["recosted_step"]
                                  if row["tflops"] and row["recosted_step"] else None)
    return out


def format_ablation(rows: list[dict], first: str = "variant (each lever alone, then all)") -> str:
    """Two column groups per row: XLA's estimate, then the same schedule replayed with the
    collectives between hosts re-costed (:mod:`moefast.bench.gpu_schedule`) and the NIC's floor
    (the bytes between hosts at the NIC's rate: no step is shorter); ``first``: the first column's
    heading."""
    unit = rows[0]["unit"] if rows else ""
    recost = any(r.get("recosted_step") for r in rows)
    head = (f"| {first} | XLA: step ({unit}) | XLA: speed-up | XLA: exposed | XLA: exposed "
            "all-to-all | XLA: worst loop body exposed | XLA: model TFLOP/s per GPU |")
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if recost:
        head += (" re-costed: step (µs) | re-costed: speed-up | re-costed: exposed | re-costed: worst loop body exposed "
                 "| re-costed: model TFLOP/s per GPU | the NIC's floor (µs) |")
        rule += "---:|---:|---:|---:|---:|---:|"
    quant = any(r.get("quantize_kernels") or r.get("quantize_xla") for r in rows)
    if quant:
        head += (" re-costed: FP8 quantization in moefast's kernels | re-costed: FP8 quantization outside kernels "
                 "(XLA) |")
        rule += "---:|---:|"
    lines = [head + " peak GiB per GPU | overrides |", rule + "---:|---|"]
    num = lambda v: "n/a" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.2g}"
    for r in rows:
        over = " ".join(r["overrides"]) or ("(" + " ".join(r["baseline"]) + ")" if r["baseline"] else "")
        line = (f"| {r['name']} | {r['step']:,.0f} | {r['speedup']:.2f}x | {r['exposed']:.1%} | "
                f"{r['exposed_all_to_all']:.1%} | {r['worst_body']:.1%} | {num(r['tflops'])} |")
        if recost:
            line += (f" {r['recosted_step']:,.0f} | {r['recosted_speedup']:.2f}x | {r['recosted_exposed']:.1%} | "
                     f"{r['recosted_worst_body']:.1%} | {num(r['recosted_tflops'])} | {r.get('network_floor', 0):,.0f} |")
        if quant:
            line += f" {r.get('quantize_kernels', 0):.1%} | {r.get('quantize_xla', 0):.1%} |"
        lines.append(line + f" {r['peak_bytes'] / 2**30:.2f}{'' if r['fits'] else ' (does not fit)'} | {over} |")
    return "\n".join(lines)


def run_ablation(table: str, *, json_out: str | None, config: str | None, overrides: list[str] | None, gpu: str,
                 devices: str, network: str | None, twin: bool = True, autotune: str | None = None,
                 gemm_utilization: float | None = None) -> int:
    import jax

    rows = ablate(table, config, overrides, gpu=gpu, devices=devices, network=network, twin=twin, autotune=autotune,
                  log=print, gemm_utilization=gemm_utilization)
    on = "each row's costing twin" if twin else "each row's program as compiled (--no-twin)"
    header = (f"Lever table '{table}' estimated for {devices} x {gpu} (compiled, nothing run; XLA's speed-of-light "
              f"latency estimator on {on}, loop bodies x trip counts, {'autotuned GEMMs, ' if autotune else ''}"
              f"{'network ' + network if network else 'XLA default network'}: an estimate, not a measurement), jax {jax.__version__}, {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%MZ')}; "
              f"config {config or 'configs/tiny.yaml'} {' '.join(overrides or [])}")
    text = format_ablation(rows, "precision" if table == "precision" else "variant (each lever alone, then all)")
    if table == "precision":
        from moefast.bench.kernel_costs import (ATTENTION_KERNEL_UTILIZATION, GEMM_KERNEL_UTILIZATION,
                                                MEMORY_KERNEL_UTILIZATION)

        u = GEMM_KERNEL_UTILIZATION if gemm_utilization is None else gemm_utilization
        text += ("\n\nXLA's own estimate (the first columns) charges each kernel launch a flat 10 µs: compare the "
                 "re-costed columns. Their rule, the same for both precisions: moefast's GEMM kernels (FP8, and the "
                 f"bf16 grouped GEMM) cost their FLOPs at {u:.0%} of their dtype's dense peak "
                 f"({'assumed, GEMM_KERNEL_UTILIZATION' if gemm_utilization is None else 'given, --gemm-utilization'}), the "
                 f"FP8 quantizers their bytes at {MEMORY_KERNEL_UTILIZATION:.0%} of the memory bandwidth (assumed), "
                 f"the attention kernels their FLOPs at {ATTENTION_KERNEL_UTILIZATION:.0%} of the bf16 peak; XLA's own "
                 "GEMMs and fusions keep XLA's costs in both.")
    print(f"\n{header}\n\n{text}")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, {"table": table, "rows": rows, "gpu": gpu, "devices": devices, "network": network},
                      f"{header}\n\n{text}\n")
    return 0
