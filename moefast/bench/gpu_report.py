"""The trip-weighted estimate of :func:`moefast.bench.gpu_schedule.read_estimate` as the
markdown lines of ``moefast bench gpu-compile``'s report: the step and what it implies (tokens/s,
TFLOP/s per GPU, MFU: estimates), the exposed collectives by kind, tier and mesh axis, the replay
with the collectives between hosts re-costed, the NIC's floor, each scheduled computation and how
the estimator costs GEMMs."""

from __future__ import annotations

from moefast.bench.gpu_schedule import BETWEEN, INSIDE
from moefast.bench.kernel_costs import ATTENTION_KERNEL_UTILIZATION, MEMORY_KERNEL_UTILIZATION

__all__ = ["format_estimate"]


def _secs(us: float) -> str:
    return f"{us / 1e6:,.3f} s" if us >= 1e6 else f"{us / 1e3:,.2f} ms"


def _size(b: float) -> str:
    return f"{b / 2**30:,.2f} GiB" if b >= 2**30 else f"{b / 2**20:,.1f} MiB"


def format_estimate(est: dict, *, tokens: int, gpus: int, model_flops: float, peak_tflops: float | None,
                    network: str, as_compiled: dict | None, custom_calls: dict | None = None) -> list[str]:
    """Markdown lines of a trip-weighted estimate (:func:`read_estimate` as a dict): the step and
    what it implies, exposed collectives by kind and tier, each scheduled computation, and how the
    estimator costs GEMMs."""
    unit, step = est["unit"], est["step"]
    timed = unit == "µs"
    net = f"network {network}" if network else "XLA's default network (25 GB/s per GPU between hosts, 8 GPUs per node)"
    on = ("costing twin" if est.get("twin") else "the program as compiled (--no-twin: its float32-result GEMMs "
          "mis-costed)")
    if est.get("profiled"):
        on += (", scheduled by XLA with the re-costed collectives between hosts and attention kernels below as its "
               "profile (PGLE)")
    lines = ["", f"**Estimate** (XLA's {'speed-of-light' if timed else 'fixed-cost'} latency estimator, "
             f"{'microseconds' if timed else 'its per-operation constants, not a time: not comparable with µs'}; "
             f"{net}; each loop body x its trip count; {on}; no autotuning: compiled, not run)", "",
             "| estimate | value |", "|---|---:|"]
    if timed:
        s = step / 1e6
        tflops = model_flops / s / gpus / 1e12
        head = f"**{_secs(step)}**" if est.get("profiled") else _secs(step)  # with the profile XLA's is the headline
        lines += [f"| step time (estimate) | {head} |",
                  f"| tokens/s (estimate) | {tokens / s:,.0f} |",
                  f"| model TFLOP/s per GPU (estimate; 6 N_active + attention, moefast.model.flops) | {tflops:,.1f} |"]
        if peak_tflops:
            lines.append(f"| MFU (estimate, of {peak_tflops:,.1f} dense bf16 TFLOP/s) | {tflops / peak_tflops:.1%} |")
    else:
        lines.append(f"| step ({unit}) | {step:,.0f} |")
    ex = est["exposed"]
    lines.append(f"| collectives the compute stream waits on (exposed) | {ex:,.0f} {unit} ({ex / step:.1%}) |")
    for k, v in sorted(est["exposed_by_kind"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| &nbsp; {k} | {v:,.0f} {unit} ({v / step:.1%}) |")
    for t in (INSIDE, BETWEEN):
        v = est["exposed_by_tier"].get(t, 0.0)
        b = est["bytes_by_tier"].get(t, 0.0)
        lines.append(f"| &nbsp; {t}: exposed / collective bytes per GPU and step | {v:,.0f} {unit} ({v / step:.1%}) / "
                     f"{_size(b)} |")
    if est.get("exposed_by_axis"):
        lines.append("| &nbsp; by the mesh axes a collective spans: exposed | " + ", ".join(
            f"{a} {v:,.0f} {unit} ({v / step:.1%})" for a, v in sorted(est["exposed_by_axis"].items(),
                                                                      key=lambda kv: -kv[1])) + " |")
    rc = est.get("recosted") or {}
    if rc.get("step"):
        rs = rc["step"]
        calls = custom_calls or {}
        gemms = any("moefast_fp8_gemm" in k or "grouped_matmul" in k for k in calls)
        share = "given" if rc.get("gemm_utilization_given") else "assumed"
        kern = (f"; the fused attention kernels, which XLA charges a flat 10 µs, costed from their FLOPs at "
                f"{ATTENTION_KERNEL_UTILIZATION:.0%} of peak (FlashAttention-2 on H100; attention_kernel_flops)"
                + (f", moefast's GEMM kernels at {rc.get('gemm_utilization', 0):.0%} of their dtype's peak (bf16 or "
                   f"FP8, the same share; {share}; fp8_kernel_flops)" if gemms else "")
                + (f", the FP8 quantizer's bytes at {MEMORY_KERNEL_UTILIZATION:.0%} of the memory bandwidth "
                   "(assumed; quantize_kernel_bytes)" if any("moefast_fp8_gemm_quantize" in k for k in calls) else "")
                if rc.get("kernels") else "")
        lines.append(f"| **replayed with the collectives between hosts re-costed** (XLA's own formulas on each group's "
                     f"real shape, moefast.bench.gpu_schedule.between_hosts_us{kern}; XLA's schedule and other costs "
                     f"kept): step time (estimate) | {_secs(rs) if est.get('profiled') else f'**{_secs(rs)}**'} |")
        tf = model_flops / (rs / 1e6) / gpus / 1e12
        lines.append(f"| &nbsp; model TFLOP/s per GPU / MFU (estimate, re-costed) | {tf:,.1f}"
                     + (f" / {tf / peak_tflops:.1%}" if peak_tflops else "") + " |")
        lines.append(f"| &nbsp; exposed (re-costed) | {rc['exposed']:,.0f} µs ({rc['exposed'] / rs:.1%}): "
                     + ", ".join(f"{k} {v / rs:.1%}" for k, v in sorted(rc["exposed_by_kind"].items(), key=lambda kv: -kv[1]))
                     + "; " + ", ".join(f"{k} {v / rs:.1%}" for k, v in sorted(rc["exposed_by_tier"].items())) + " |")
    nf = est.get("network_floor") or {}
    if nf.get("step") and rc.get("step"):
        lines.append(f"| **the NIC's floor**: each computation's bytes between hosts per GPU at {nf['gbps']:g} GB/s "
                     f"(gpu_schedule.nic_bytes; no schedule can be shorter; the estimators cost each collective "
                     f"alone, so transfers in flight together share no bandwidth there) | {_secs(nf['step'])} "
                     f"({nf['step'] / rc['step']:.0%} of the re-costed step) |")
        lines.append(f"| &nbsp; re-costed step with each computation at least its floor (estimate) | "
                     f"{_secs(nf['bounded'])} |")
    fb = est.get("fallback") or {}
    if fb.get("count"):
        how = "costed by the profile here" if est.get("profiled") else "each charged its fixed 5,000 µs"
        lines.append(f"| collectives between hosts XLA's model cannot cost (replica groups whose number does not divide "
                     f"the GPUs per node: "
                     f"{how}): count / bytes / exposed | {fb['count']:,} / {_size(fb['bytes'])} / "
                     f"{fb.get('exposed', 0):,.0f} µs ({fb.get('exposed', 0) / step:.1%}) |")
    up = est.get("unprofiled")
    if up and up.get("step"):
        urs = (up.get("recosted") or {}).get("step")
        lines.append(f"| the twin as XLA scheduled it on its own costs, before the profile: step (XLA / re-costed) | "
                     f"{_secs(up['step'])} / {_secs(urs) if urs else '—'} |")
    if as_compiled and as_compiled.get("step"):
        lines.append(f"| the program as compiled (float32 weight-gradient GEMMs costed by XLA's fallback) | "
                     f"{as_compiled['step']:,.0f} {unit} ({as_compiled['step'] / step:.2f}x the twin) |")
    lines += ["", f"| scheduled computation | trips | length ({unit}, once) | x trips | exposed | share of step | "
              "exposed, re-costed |", "|---|---:|---:|---:|---:|---:|---:|"]
    for c in est["computations"]:
        share = c["length"] * c["trips"] / step
        if share < 0.005 and c["exposed"] / max(c["length"], 1e-9) < 0.25:
            continue
        rex = f"{c['recosted_exposed'] / c['recosted_length']:.1%}" if c.get("recosted_length") else "—"
        lines.append(f"| {c['label']} `{c['name']}` | {c['trips']} | {c['length']:,.0f} | {c['length'] * c['trips']:,.0f} | "
                     f"{c['exposed'] / max(c['length'], 1e-9):.1%} | {share:.1%} | {rex} |")
    if est["unscheduled_loops"]:
        lines.append(f"| loop bodies without an asynchronous collective (not scheduled, not in the estimate) | "
                     f"{len(est['unscheduled_loops'])} | | | | | |")
    if est["unknown_trips"]:
        lines.append(f"| loops of unknown trip count (counted once) | {len(est['unknown_trips'])} | | | | | |")
    if timed:
        lines += ["", "| GEMMs as the estimator costs them | count x trips | TFLOP | estimated time | TFLOP/s (all) | "
                  "median TFLOP/s |", "|---|---:|---:|---:|---:|---:|"]
        gemms = [("twin" if est.get("twin") else "as compiled", g) for g in est["gemms"]] + [("as compiled", g) for g in (as_compiled or {}).get("gemms", [])
                                                       if "f32" in g["kind"].split("->")[-1]]
        for which, g in gemms:
            lines.append(f"| {g['kind']} ({which}) | {g['count']} | {g['flops'] / 1e12:,.3g} | {_secs(g['time'])} | "
                         f"{g['flops'] / g['time'] / 1e6:,.1f} | {g['median_tflops']:,.1f} |")
    return lines
