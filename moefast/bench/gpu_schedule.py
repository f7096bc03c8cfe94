"""XLA's estimate of a compiled GPU step, read from the latency-hiding scheduler's dump: per
computation, weighted by loop trip counts, split by network tier (inside a host, between hosts).

What XLA's scheduler does (XLA at the commit jaxlib 0.10.2 pins, ``5a9e73cb``; checked against
the CUDA plugin's strings and by compiling probes):

* For an H100 or H200 target its latency estimator is the speed-of-light one
  (``SolLatencyEstimator``, ``xla/service/gpu/model/sol_latency_estimator.cc``) whenever the
  module has only the collectives it models (all-gather, all-reduce, reduce-scatter, all-to-all,
  collective-permute): costs in **microseconds**. GEMMs are costed from a table of GEMMs measured
  on H100 (``matmul_interpolator_data.h``, key ``sm_90``), other fusions by a roofline of
  ``GpuPerformanceModel``, collectives inside a node from measured NCCL throughputs
  (``collective_interpolator_data.h``) and collectives between nodes by a NIC model
  (``SolGPUCostModel``: per-GPU NIC speed in GB/s, round-trip time, launch and chunk costs, GPUs
  per node), the options of :data:`NETWORKS`. A module with a ``ragged-all-to-all`` (dropless
  expert exchange) falls back to fixed per-operation costs (``GpuLatencyEstimator``: 1, 1,000 or
  5,000 per operation): not a time.
* The scheduler orders each computation that holds an asynchronous collective; a ``while`` loop's
  body is a computation of its own, and the loop itself costs 0.01 in its parent: nothing
  multiplies a body by its trip count. Its ``scheduler_statistics`` describe the order *before*
  scheduling; the per-instruction timestamps (``start_timestamp_cycles``, ``end_timestamp_cycles``)
  are the schedule it chose. ``cycles_per_microsecond`` is 1.

So :func:`read_estimate` reads the timestamps: a computation's length is its last end; a gap
between one instruction's end and the next one's start is time the compute stream idles, and the
part of it during which an asynchronous collective is in flight (between its start and its done)
is that collective left exposed (split between collectives in flight together; the rest is the
estimator's 1 µs per dependency edge). Each computation counts ``trips`` times: the product of the
``known_trip_count`` of the loops around it (1 for the entry). Computations the scheduler left out
(no asynchronous collective inside) are listed, not estimated.

XLA's speed-of-light model also mis-costs collectives between hosts on meshes with several groups
per collective (data x expert): ``SolGPUCostModel::NumGpusPerComm`` divides the GPUs per node by
the number of replica groups, which fails when they do not divide it (the scheduler then charges the
fixed-cost estimator's 5,000, read as microseconds), and the call takes a group's size as its
number of hosts. :func:`read_estimate` therefore also replays each computation's schedule with
every collective between hosts costed by XLA's own formulas on the group's real shape
(:func:`between_hosts_us`), the others keeping the time XLA's schedule gave them; replayed with
XLA's own times, the replay reproduces XLA's length to 0.1 %.

Another defect of the estimator to know: its GEMM table holds bf16 x bf16 -> bf16, f32 and fp8 GEMMs,
not bf16 x bf16 -> f32, and a fallback interpolator costs those (the weight gradients moefast
accumulates in float32, and any bf16 GEMM whose float32 cast XLA fuses into it: the key is the
fusion's result type) at about 12 TFLOP/s, some 60x below what the same table gives the same
shapes with a bf16 result. :class:`GemmRates` shows it in every report; ``moefast bench
gpu-compile`` estimates the step on a costing twin whose weight-gradient GEMMs return bfloat16
(:func:`moefast.parallel.precision.costing_twin`) for that reason.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import math
import os
import re
import statistics
from pathlib import Path

from moefast.bench.kernel_costs import (GEMM_KERNEL_UTILIZATION, check_gemm_utilization, kernel_times,
                                        quantization_times)

__all__ = ["NETWORKS", "ComputationEstimate", "GemmRate", "ScheduleEstimate", "network_flag", "network_options",
           "nic_bytes", "pgle_profile",
           "read_estimate"]

# --network name -> file in moefast/bench/gpu_targets/ (key=value lines of XLA's
# xla_gpu_analytical_latency_estimator_options, with their sources in comments)
NETWORKS = {"dgx-h100": "dgx_h100.network", "dgx-h200": "dgx_h200.network"}
_XLA_FLAG = "--xla_gpu_analytical_latency_estimator_options"
_KEYS = ("nccl_op_launch_us", "nic_speed_gbps", "chunk_prep_us", "rtt_us", "gpus_per_node", "chunk_size_bytes",
         "partition_size")
INSIDE, BETWEEN = "inside a host", "between hosts"


def network_options(network: str) -> dict[str, str]:
    """The options of ``network`` (a key of :data:`NETWORKS` or a file of ``key=value`` lines).

    Raises:
      ValueError: an unknown network, an unknown key or a value that is not a positive number.
    """
    path = Path(__file__).parent / "gpu_targets" / NETWORKS[network] if network in NETWORKS else Path(network)
    if network not in NETWORKS and not path.is_file():
        raise ValueError(f"--network {network!r}: no such network and no such file; known networks are "
                         f"{sorted(NETWORKS)}, or give a file of key=value lines ({', '.join(_KEYS)})")
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, value = (s.strip() for s in line.partition("="))
        try:
            ok = key in _KEYS and float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--network {network}: line {n} {line!r}: expected key=positive number with a key of "
                             f"{', '.join(_KEYS)} (XLA's xla_gpu_analytical_latency_estimator_options)")
        out[key] = value
    return out


def network_flag(network: str) -> str:
    """The ``XLA_FLAGS`` entry that hands ``network`` to XLA's speed-of-light estimator. A map
    option: XLA reads it from ``XLA_FLAGS`` only (the per-compilation options take scalars)."""
    return _XLA_FLAG + "=" + ",".join(f"{k}={v}" for k, v in network_options(network).items())


# XLA's SolGPUCostModel values for "NVIDIA H100 80GB HBM3" (sol_gpu_cost_model.cc), where a
# network file leaves a key out
_XLA_H100 = {"nccl_op_launch_us": 45.0, "nic_speed_gbps": 25.0, "chunk_prep_us": 6.0, "rtt_us": 31.0,
             "gpus_per_node": 8.0, "chunk_size_bytes": 4194304.0}
_HEADER_OVERHEAD = 0.025  # SolGPUCostModel's kHeaderOverhead on every transfer


def between_hosts_us(kind: str, nbytes: float, group: int, per_host: int, net: dict[str, str] | None) -> float:
    """A collective between hosts costed with XLA's own speed-of-light formulas
    (``SolGPUCostModel::AllToAllLatency`` and ``RingLatency``) and the network's options, with the
    group's real shape: ``group`` members, ``per_host`` of them on each host. XLA's own call takes
    the group size as the number of hosts and divides the GPUs per node by the number of groups,
    which fails (a fixed 5,000 µs) or treats every peer as remote on data x expert meshes.

    Args:
      kind: ``all-to-all``, ``all-gather``, ``reduce-scatter`` or ``all-reduce``.
      nbytes: bytes per device XLA's cost analysis moves (an all-to-all's or all-gather's result, a
        reduce-scatter's operand, an all-reduce's result).

    Returns:
      Microseconds.
    """
    o = {**_XLA_H100, **{k: float(v) for k, v in (net or {}).items()}}

    def hop(b: float) -> float:  # one message: its transfer over the NIC, its chunks' preparation and a round trip
        return (b / (o["nic_speed_gbps"] * 1e3)) * (1 + _HEADER_OVERHEAD) + \
            math.ceil(b / o["chunk_size_bytes"]) * o["chunk_prep_us"] + o["rtt_us"]

    n = max(group, 2)
    if kind == "all-to-all":
        return (n - per_host) * hop(nbytes / (n - 1)) + o["nccl_op_launch_us"]
    rounds = 2 if kind == "all-reduce" else 1
    return hop(nbytes / n) * (n - 1) / per_host * rounds + o["nccl_op_launch_us"]


def _replay(ordered, pairs: dict[str, str], latency: dict[str, float], cost: dict[str, float] | None = None):
    """XLA's schedule of one computation replayed with other collective latencies: the
    instructions in its order, each for its own estimated time (``cost[name]`` where given), a
    ``*-done`` waiting until its start plus ``latency[start]``. Returns (length, {start: wait})."""
    cost = cost or {}
    t, started, waits = 0.0, {}, collections.Counter()
    done_of = {d: st for st, d in pairs.items()}
    for name, s, e in ordered:
        st = done_of.get(name)
        if st is not None and st in started:
            ready = started[st] + latency[st]
            if ready > t:
                waits[st] += ready - t
                t = ready
        t += cost.get(name, e - s)
        if name in pairs:
            started[name] = t
    return t, waits


@dataclasses.dataclass
class ComputationEstimate:
    name: str
    trips: int  # times one step runs it (product of the enclosing loops' trip counts)
    length: float  # its schedule, once
    exposed: float  # of which the compute stream waits on collectives, once
    exposed_by_kind: dict[str, float]
    loop_body: bool
    label: str = ""  # what runs in it (from the JAX operations it holds): "forward layer", ...
    recosted_length: float = 0.0  # replayed with the collectives between hosts re-costed (once)
    recosted_exposed: float = 0.0
    network_floor: float = 0.0  # its bytes between hosts at the NIC's rate (once): it cannot be shorter


@dataclasses.dataclass
class GemmRate:
    """How the estimator costs one kind of GEMM: FLOPs per estimated second, trip-weighted."""

    kind: str  # "bf16 x bf16 -> f32", ...
    count: int
    flops: float
    time: float  # estimator units (µs under the speed-of-light estimator)
    median_tflops: float  # of the GEMMs' own rates (µs units)


@dataclasses.dataclass
class ScheduleEstimate:
    unit: str  # "µs" (a time) or "fixed costs" (XLA's per-operation constants, not a time)
    step: float  # trip-weighted
    exposed: float
    exposed_by_kind: dict[str, float]
    exposed_by_tier: dict[str, float]
    bytes_by_tier: dict[str, float]  # collective results, per device and step, trip-weighted
    computations: list[ComputationEstimate]
    unscheduled_loops: list[str]  # loop bodies without an asynchronous collective: not in the estimate
    unknown_trips: list[str]  # loops whose trip count XLA did not know (counted once)
    gemms: list[GemmRate]
    once: dict[str, float]  # the scheduler's own statistics summed with every computation once (pre-schedule)
    # collectives between hosts XLA's speed-of-light model cannot cost (charged its fixed 5,000):
    # {"count": trip-weighted, "bytes": per device and step, "exposed": the step's wait on them}
    fallback: dict[str, float] = dataclasses.field(default_factory=dict)
    # the same schedule replayed with every collective between hosts costed by XLA's formulas on the
    # group's real shape (between_hosts_us), the others keeping the time XLA's schedule gave them:
    # {"step", "exposed", "exposed_by_kind", "exposed_by_tier"}
    recosted: dict = dataclasses.field(default_factory=dict)
    # the NIC's floor: {"step": every computation's bytes between hosts per GPU at the NIC's rate,
    # trip-weighted; "bounded": the re-costed step with each computation at least its floor; "gbps"}
    network_floor: dict = dataclasses.field(default_factory=dict)
    # the replay's own costs (µs) by instruction name, and the module's fingerprint_before_lhs:
    # handed back to XLA as a profile (pgle_profile) so its scheduler plans with them
    profile: dict = dataclasses.field(default_factory=dict)
    fingerprint: str = ""
    # exposed time by the mesh axes a collective's groups span ("context", "data+expert", ...;
    # trip-weighted): which parallelism the compute stream waits on
    exposed_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)


def pgle_profile(est: ScheduleEstimate) -> str:
    """The replay's costs as XLA's profile-guided latency estimator reads them
    (``tensorflow.profiler.ProfiledInstructionsProto`` in text form, for
    ``xla_gpu_pgle_profile_file_or_directory_path``): each collective between hosts at
    :func:`between_hosts_us` and each fused attention kernel at its FLOPs' time, keyed
    ``fingerprint::name`` so that only the same module (the same ``fingerprint_before_lhs``) uses
    them; everything else XLA keeps costing itself. What a profile measured on GPUs (JAX's PGLE)
    would tell XLA, from the model instead of a run.
    """
    return "".join(f'costs {{ name: "{est.fingerprint}::{n}" cost_us: {c:.3f} }}\n'
                   for n, c in sorted(est.profile.items()))


def _proto_index(text: str):
    """From the dump's ``hlo_module``: instruction id -> name; the scheduler's blocks."""
    head, _, rest = text.partition("\ncomputation_schedules {")
    names = {}
    for m in re.finditer(r'\n    instructions \{\n      name: "([^"]+)"\n', head):
        idm = re.compile(r"\n      id: (\d+)\n").search(head, m.end())
        if idm:
            names[int(idm.group(1))] = m.group(1)
    blocks = ("computation_schedules {" + rest).split("\ncomputation_schedules {")
    return names, blocks


def _timeline(block: str, names: dict[int, str]) -> list[tuple[str, float, float]]:
    out = []
    for m in re.finditer(r"instructions \{\n    id: (\d+)\n((?:    \w+: [^\n]*\n)*)  \}", block):
        fields = dict(re.findall(r"    (\w+): ([^\n]*)", m.group(2)))
        out.append((names.get(int(m.group(1)), ""), float(fields.get("start_timestamp_cycles", 0)),
                    float(fields.get("end_timestamp_cycles", 0))))
    return out


def _groups(attrs: str, n: int) -> list[list[int]] | None:
    """Replica groups of a collective's attribute text: ``{{0,1},{2,3}}`` or the iota form
    ``[G,S]<=[d0,d1,...]T(perm)`` (ids 0..n-1 reshaped, transposed, then cut into G groups of S)."""
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if not m:
        return None
    import numpy as np

    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()


_DOT = re.compile(r"= (\w+)\[([\d,]*)\][^\n]*? dot\(%([\w.\-]+), %([\w.\-]+)\)[^\n]*?lhs_contracting_dims=\{([\d,]*)\}")


def _gemm(result: str, body: str) -> tuple[str, float] | None:
    """(kind, FLOPs) of a GEMM fusion (``result``: its result type, which XLA's estimator keys its
    table on) from its body's HLO text."""
    m = _DOT.search(body)
    if not m:
        return None
    lhs = re.search(r"%" + re.escape(m.group(3)) + r" = (\w+)\[([\d,]*)\]", body)
    rhs = re.search(r"%" + re.escape(m.group(4)) + r" = (\w+)\[([\d,]*)\]", body)
    if not lhs or not rhs:
        return None
    dims = [int(x) for x in lhs.group(2).split(",") if x]
    k = 1
    for c in filter(None, m.group(5).split(",")):
        k *= dims[int(c)]
    out = 1
    for x in filter(None, m.group(2).split(",")):
        out *= int(x)
    return f"{lhs.group(1)} x {rhs.group(1)} -> {result.split('[')[0].lstrip('(') or m.group(1)}", 2.0 * out * k


def _label(ops: list[str]) -> str:
    backward = sum("transpose(" in o for o in ops)
    return "backward" if backward > len(ops) / 2 else "forward"


def read_estimate(dump_dir: str, hlo_text: str, hosts_of_partition: list[int], *, time_unit: bool,
                  network: dict[str, str] | None = None, peak_tflops: float | None = None,
                  axes_of_partition: list[dict[str, int]] | None = None,
                  hbm_bytes_per_s: float | None = None,
                  gemm_utilization: float | None = None) -> ScheduleEstimate | None:
    """The trip-weighted estimate of the train step from a compilation's dump.

    Args:
      dump_dir: where XLA dumped (``xla_dump_to`` with ``xla_dump_latency_hiding_schedule``).
      hlo_text: the optimized module (``compiled.as_text()``).
      hosts_of_partition: the host of each SPMD partition (``mesh.devices.flat[p].process_index``).
      time_unit: whether the estimator's costs are microseconds (the speed-of-light estimator) or
        XLA's fixed per-operation costs.
      network: the network model's options (:func:`network_options`; ``None``: XLA's defaults).
      peak_tflops: the GPU's dense bf16 peak; given, the replay also costs the fused attention
        kernels and moefast's GEMM kernels, FP8 and bf16, from their FLOPs
        (:mod:`moefast.bench.kernel_costs`).
      axes_of_partition: each SPMD partition's coordinate on every mesh axis longer than 1
        (``{"data": 0, "context": 3}``); given, the exposed time is also split by the axes each
        collective's groups span (``exposed_by_axis``).
      hbm_bytes_per_s: the GPU's memory bandwidth (the target's ``memory_bandwidth``); given, the
        replay costs the FP8 quantizers' launches from their bytes.
      gemm_utilization: the GEMM kernels' share of their dtype's peak in place of the assumed
        :data:`~moefast.bench.kernel_costs.GEMM_KERNEL_UTILIZATION` (e.g. what
        ``scripts/gpu_check.py --only fp8_gemm`` measured), in (0, 1].

    Returns:
      ``None`` when XLA wrote no schedule (its scheduler did not run).
    """
    from moefast.parallel.hlo import HloModule, shape_bytes

    gemm_u = GEMM_KERNEL_UTILIZATION if gemm_utilization is None else check_gemm_utilization(gemm_utilization)
    gpus_per_node = int(float((network or {}).get("gpus_per_node", 8)))
    nic_rate = float((network or {}).get("nic_speed_gbps", _XLA_H100["nic_speed_gbps"])) * 1e3  # bytes per µs

    files = [f for f in glob.glob(os.path.join(dump_dir, "*schedule.txt")) if "train" in os.path.basename(f)
             or "counted_step" in os.path.basename(f)] or glob.glob(os.path.join(dump_dir, "*schedule.txt"))
    if not files:
        return None
    text = Path(files[0]).read_text()
    names, blocks = _proto_index(text)
    module = HloModule(hlo_text)
    raw = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=", line)
        if m:
            raw[m.group(1)] = line
    bodies = {}  # computation text for GEMM fusions
    for m in re.finditer(r"\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo_text, re.S):
        bodies[m.group(1)] = m.group(2)

    # trip weights: the entry 1, a loop body its parent's times its known trip count
    loops = collections.defaultdict(list)  # parent computation -> [(body, trips or None)]
    for name, ins in module.instrs.items():
        if ins.opcode == "while":
            line = raw.get(name, "")
            body = re.search(r"body=%?([\w.\-]+)", line)
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            if body:
                loops[ins.computation].append((body.group(1), int(n.group(1)) if n else None))
    weight, unknown, stack = {module.entry: 1}, [], [module.entry]
    while stack:
        c = stack.pop()
        for body, n in loops.get(c, []):
            if n is None:
                unknown.append(body)
            weight[body] = weight.get(body, 0) + weight[c] * (n or 1)
            stack.append(body)
        for nm in module.computations.get(c, []):
            for callee in module.instrs[nm].calls:  # calls / to_apply (async wrappers, called computations)
                if callee not in weight and module.instrs[nm].opcode in ("call", "async-start", "conditional"):
                    weight[callee] = weight[c]
                    stack.append(callee)
    loop_bodies = {b for v in loops.values() for b, _ in v}

    def attrs_of(start_name: str) -> str:
        """A collective's attribute text (an async-start's: its wrapped collective's)."""
        ins = module.instrs.get(start_name)
        if ins is not None and ins.opcode == "async-start":
            return " ".join(raw.get(nm, "") for comp in ins.calls for nm in module.computations.get(comp, []))
        return raw.get(start_name, "")

    @functools.cache
    def tier(start_name: str) -> str:
        attrs = attrs_of(start_name)
        if "source_target_pairs" in attrs:
            pairs = re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=", 1)[1])
            cross = any(hosts_of_partition[int(a)] != hosts_of_partition[int(b)] for a, b in pairs)
            return BETWEEN if cross else INSIDE
        groups = _groups(attrs, len(hosts_of_partition))
        if groups is None:  # one group of every partition
            return BETWEEN if len(set(hosts_of_partition)) > 1 else INSIDE
        cross = any(len({hosts_of_partition[i] for i in g}) > 1 for g in groups)
        return BETWEEN if cross else INSIDE

    def group_shape(start_name: str) -> tuple[int, int] | None:
        """(members of each replica group, members per host) of a collective whose groups all
        have that shape; ``None`` otherwise."""
        groups = _groups(attrs_of(start_name), len(hosts_of_partition))
        if groups is None:
            groups = [list(range(len(hosts_of_partition)))]
        shapes = {(len(g), max(collections.Counter(hosts_of_partition[i] for i in g).values())) for g in groups}
        return shapes.pop() if len(shapes) == 1 else None

    @functools.cache
    def axes(start_name: str) -> str:
        """The mesh axes along which a collective's groups (or pairs) vary, joined by "+"."""
        if not axes_of_partition:
            return ""
        attrs = attrs_of(start_name)
        if "source_target_pairs" in attrs:
            groups = [[int(a), int(b)] for a, b in
                      re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=", 1)[1])]
        else:
            groups = _groups(attrs, len(axes_of_partition)) or [list(range(len(axes_of_partition)))]
        names = axes_of_partition[0].keys()
        varying = [a for a in names if any(len({axes_of_partition[i][a] for i in g}) > 1 for g in groups)]
        return "+".join(varying) or "one device"

    @functools.cache
    def uncosted(start_name: str) -> bool:
        """XLA's speed-of-light model cannot cost a collective between hosts whose replica groups
        do not divide its GPUs per node (SolGPUCostModel::NumGpusPerComm returns an error): the
        scheduler then charges the fixed-cost estimator's 5,000 as microseconds."""
        if not time_unit or tier(start_name) != BETWEEN:
            return False
        groups = _groups(attrs_of(start_name), len(hosts_of_partition))
        return groups is not None and gpus_per_node % len(groups) != 0

    comps, once = [], collections.Counter()
    profile = {}  # instruction -> µs: what the replay re-costs, as a PGLE profile (pgle_profile)
    step = exposed = 0.0
    by_kind, by_tier, bytes_tier = collections.Counter(), collections.Counter(), collections.Counter()
    by_axis = collections.Counter()
    fallback = {"count": 0, "bytes": 0, "exposed": 0.0}
    recost = {"step": 0.0, "exposed": 0.0, "by_kind": collections.Counter(), "by_tier": collections.Counter(),
              "floor": 0.0, "bounded": 0.0, "kernels": 0, "quantize_xla": 0.0, "quantize_kernels": 0.0}
    gemm_acc = collections.defaultdict(lambda: [0, 0.0, 0.0, []])
    for block in blocks:
        st = re.search(r"scheduler_statistics \{([^}]*)\}", block)
        if st:
            for key, value in re.findall(r"(\w+):\s*([-\d.eE+]+)", st.group(1)):
                once[key] += float(value)
        timeline = _timeline(block, names)
        named = [t for t in timeline if t[0] in module.instrs]
        if not named:
            continue
        comp = module.instrs[named[0][0]].computation
        w = weight.get(comp, 1)
        ordered = sorted(timeline, key=lambda t: (t[1], t[2]))
        at = {name: (s, e) for name, s, e in ordered}
        flight = []  # (from, to, kind, tier): an asynchronous collective in flight
        pairs, latency, pair_kind = {}, {}, {}
        for name, s, e in ordered:
            done = module._users_of_async.get(name)
            kind = module._wrapped_kind(module.instrs[name]) if name in module.instrs else None
            if kind and done in at:
                flight.append((e, at[done][0], kind, tier(name), uncosted(name), axes(name)))
                pairs[name], pair_kind[name] = done, (kind, tier(name))
                latency[name] = at[done][0] - e  # what XLA's schedule gave it (exact where the done waited)
        floor = 0.0  # µs the NIC needs for this computation's bytes between hosts
        for name, _, _ in ordered:  # every collective between hosts, asynchronous or not
            ins = module.instrs.get(name)
            kind = module._wrapped_kind(ins) if ins is not None else None
            if not kind or not time_unit or tier(name) != BETWEEN or not (
                    ins.opcode.endswith("-start") or ins.opcode == kind):
                continue
            shape = group_shape(name)
            if not shape:
                continue
            done = module._users_of_async.get(name)
            size = shape_bytes(module.instrs[done].shape if done else ins.shape)
            size *= shape[0] if kind == "reduce-scatter" else 1  # the operand: what the formulas take
            floor += nic_bytes(kind, size, *shape) / nic_rate
            if name in pairs:  # an asynchronous one: the replay's latency (and the profile's)
                latency[name] = profile[name] = between_hosts_us(kind, size, shape[0], shape[1], network)
        kernel_us = {} if not (time_unit and peak_tflops) else kernel_times(
            ordered, module.instrs, raw, peak_tflops=peak_tflops, hbm_bytes_per_s=hbm_bytes_per_s, gemm_utilization=gemm_u)
        profile.update(kernel_us)
        re_len, re_waits = _replay(ordered, pairs, latency, kernel_us)
        re_ex = sum(re_waits.values())
        for st, v in re_waits.items():
            recost["by_kind"][pair_kind[st][0]] += v * w
            recost["by_tier"][pair_kind[st][1]] += v * w
        recost["kernels"] += len(kernel_us) * w
        in_kernels, in_xla = quantization_times(ordered, module.instrs, kernel_us)
        recost["quantize_kernels"] += in_kernels * w
        recost["quantize_xla"] += in_xla * w
        recost["step"] += re_len * w
        recost["exposed"] += re_ex * w
        recost["floor"] += floor * w
        recost["bounded"] += max(re_len, floor) * w
        length, prev, gap_kind, ex = 0.0, 0.0, collections.Counter(), 0.0
        for name, s, e in ordered:
            if s - prev > 1e-9:  # the compute stream idles: on what is in flight then
                hits = [(min(s, b) - max(prev, a), k, t, u, ax) for a, b, k, t, u, ax in flight
                        if min(s, b) > max(prev, a)]
                if hits:
                    share = min(s - prev, max(h[0] for h in hits)) / sum(h[0] for h in hits)
                    for h, k, t, u, ax in hits:
                        gap_kind[k] += h * share
                        ex += h * share
                        by_tier[t] += h * share * w
                        if ax:
                            by_axis[ax] += h * share * w
                        if u:
                            fallback["exposed"] += h * share * w
            prev = max(prev, e)
            length = max(length, e)
            ins = module.instrs.get(name)
            if ins is not None and ins.opcode == "fusion" and ins.calls and e > s:
                g = _gemm(ins.shape, bodies.get(ins.calls[0], ""))
                if g:
                    acc = gemm_acc[g[0]]
                    acc[0] += w
                    acc[1] += g[1] * w
                    acc[2] += (e - s) * w
                    acc[3].append(g[1] / (e - s) / 1e6)
        for nm in module.computations.get(comp, []):  # bytes by tier
            ins = module.instrs[nm]
            kind = module._wrapped_kind(ins)
            if kind and (ins.opcode.endswith("-start") or ins.opcode in ("all-to-all", "all-gather", "all-reduce",
                                                                            "reduce-scatter", "collective-permute")):
                done = module._users_of_async.get(nm)
                shape = module.instrs[done].shape if done else ins.shape
                bytes_tier[tier(nm)] += shape_bytes(shape) * w
                if uncosted(nm):
                    fallback["count"] += w
                    fallback["bytes"] += shape_bytes(shape) * w
        ops = [module.instrs[n].op_name for n, _, _ in named if module.instrs[n].op_name]
        label = _label(ops) + " loop body" if comp in loop_bodies else "outside loops" if comp == module.entry \
            else "called"
        comps.append(ComputationEstimate(comp, w, length, ex, dict(gap_kind), comp in loop_bodies, label, re_len, re_ex,
                                         floor))
        step += length * w
        exposed += ex * w
        for k, v in gap_kind.items():
            by_kind[k] += v * w
    scheduled = {c.name for c in comps}
    gemms = [GemmRate(k, a[0], a[1], a[2], statistics.median(a[3])) for k, a in sorted(gemm_acc.items())]
    return ScheduleEstimate(
        unit="µs" if time_unit else "fixed costs", step=step, exposed=exposed, exposed_by_kind=dict(by_kind),
        exposed_by_tier=dict(by_tier), bytes_by_tier=dict(bytes_tier),
        computations=sorted(comps, key=lambda c: -c.length * c.trips),
        unscheduled_loops=sorted(b for b in loop_bodies if b not in scheduled), unknown_trips=sorted(set(unknown)),
        gemms=gemms, once=dict(once), fallback=fallback,
        recosted={"step": recost["step"], "exposed": recost["exposed"], "exposed_by_kind": dict(recost["by_kind"]),
                  "exposed_by_tier": dict(recost["by_tier"]), "kernels": recost["kernels"],
                  "quantize_xla": recost["quantize_xla"], "quantize_kernels": recost["quantize_kernels"],
                  "gemm_utilization": gemm_u, "gemm_utilization_given": gemm_utilization is not None}
        if time_unit else {},
        network_floor={"step": recost["floor"], "bounded": recost["bounded"], "gbps": nic_rate / 1e3}
        if time_unit else {},
        profile=profile if time_unit else {}, exposed_by_axis=dict(by_axis),
        fingerprint=(re.search(r'fingerprint_before_lhs="([^"]*)"', hlo_text) or [None, ""])[1])


def nic_bytes(kind: str, nbytes: float, group: int, per_host: int) -> float:
    """Bytes one GPU's NIC sends for a collective between hosts, ``group`` members of which
    ``per_host`` on each host, one NIC per GPU: an all-to-all sends the share of its rows bound
    for other hosts, ``nbytes (n - m) / n``; a ring (all-gather, reduce-scatter; all-reduce twice)
    moves ``nbytes (n - 1) / n`` over every link, and its host-crossing links spread over the m
    GPUs' NICs, ``/ m`` (the same traffic XLA's ``RingLatency`` charges).

    Args:
      nbytes: as in :func:`between_hosts_us` (a reduce-scatter's operand, the others' result).
    """
    n, m = max(group, 1), max(per_host, 1)
    if kind in ("all-to-all", "collective-permute"):
        return nbytes * max(n - m, 0) / n if kind == "all-to-all" else nbytes
    return nbytes * (n - 1) / n / m * (2 if kind == "all-reduce" else 1)
