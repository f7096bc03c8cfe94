"""Where a compiled XLA program's time goes: its HLO instructions classified by kind of work,
and a ``jax.profiler`` trace of it summed per kind (used by ``python benchmarks/peers.py --profile`` and
``moefast bench train --profile``).

Two classifications of the same instructions:

* :func:`classify_hlo` — by the operation (:data:`KINDS`: matmul, elementwise, gather/scatter,
  reduction, optimizer, data movement, other), to compare with PyTorch's op kinds;
* :func:`classify_work` — by what the work is for in an MoE step (:data:`WORK_KINDS`: matmul,
  routing, dispatch/combine, collectives, optimizer, other), from the source file each op was
  traced from.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import gzip
import os
import json
import re
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "WORK_KINDS", "classify_hlo", "classify_work", "latest_trace", "parse_hlo", "xla_trace_times"]

# Kinds of work by operation, comparable with torch.profiler's op kinds (benchmarks/peers.py).
KINDS = ("matmul", "elementwise/fusion", "gather/scatter", "reduction", "optimizer",
         "copy/transpose/concatenate", "other")

_MATMUL_OPS = {"dot", "convolution", "ragged-dot"}
_GATHER_OPS = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}
_REDUCE_OPS = {"reduce", "reduce-window", "select-and-scatter"}
_MOVE_OPS = {"copy", "transpose", "concatenate", "pad", "slice", "reverse", "broadcast", "reshape", "bitcast",
             "iota", "copy-start", "copy-done", "dynamic-reshape"}
_TRIVIAL_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
_OTHER_OPS = {"custom-call", "sort", "rng", "rng-bit-generator", "rng-get-and-update-state", "while", "conditional",
              "call", "after-all", "infeed", "outfeed", "send", "send-done", "recv", "recv-done", "partition-id",
              "replica-id", "optimization-barrier", "all-reduce", "all-gather", "all-to-all", "reduce-scatter",
              "collective-permute", "ragged-all-to-all", "async-start", "async-update", "async-done"}
_MATMUL_TARGET = re.compile(r"matmul|gemm|dot|conv", re.IGNORECASE)
_COMP_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")


@dataclasses.dataclass
class _Instr:
    opcode: str
    calls: list[str]  # computations whose ops make up this instruction (fusion bodies, call targets)
    target: str | None  # custom_call_target
    frame: int | None  # stack_frame_id


def parse_hlo(text: str) -> tuple[dict[str, _Instr], dict[str, list[str]], dict[int, tuple[str, str]]]:
    """Instructions by name, instruction names per computation, and stack frame id -> (innermost
    file, function) from a compiled module's text (``compiled.as_text()``)."""
    from moefast.parallel.hlo import split_type
    instrs: dict[str, _Instr] = {}
    comps: dict[str, list[str]] = {}
    tables: dict[str, dict[int, str]] = {}
    section, comp = None, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section, comp = line, None
            tables[section] = {}
            continue
        if section is not None:
            m = re.match(r"^(\d+)\s+(.*)$", line)
            if m:
                tables[section][int(m.group(1))] = m.group(2)
                continue
            section = None
        if not line.startswith(" "):
            h = _COMP_HEAD.match(line)
            comp = h.group(1) if h else None
            if comp is not None:
                comps[comp] = []
            continue
        m = _INSTR.match(line)
        if comp is None or not m:
            continue
        name, rest = m.group(1), split_type(m.group(2))[1]
        op = _OPCODE.match(rest)
        if not op:
            continue
        opcode = op.group(1)
        calls = re.findall(r"\bcalls=%?([\w.\-]+)", rest)
        if opcode == "call":
            calls += re.findall(r"\bto_apply=%?([\w.\-]+)", rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        frame = re.search(r"\bstack_frame_id=(\d+)", rest)
        instrs[name] = _Instr(opcode, calls, target.group(1) if target else None,
                              int(frame.group(1)) if frame else None)
        comps[comp].append(name)

    def field(entry: str, key: str) -> int | None:
        m = re.search(rf"\b{key}=(\d+)", entry)
        return int(m.group(1)) if m else None

    unquote = lambda s: s.strip().strip('"')
    frames: dict[int, tuple[str, str]] = {}
    for fid, entry in tables.get("StackFrames", {}).items():
        loc = tables.get("FileLocations", {}).get(field(entry, "file_location_id") or -1, "")
        frames[fid] = (unquote(tables.get("FileNames", {}).get(field(loc, "file_name_id") or -1, "")),
                       unquote(tables.get("FunctionNames", {}).get(field(loc, "function_name_id") or -1, "")))
    return instrs, comps, frames


def _leaves(instrs: dict[str, _Instr], comps: dict[str, list[str]], name: str, seen: set[str]) -> list[_Instr]:
    """The ops an instruction is made of: itself, or (a fusion, call, loop) the ops of the
    computations it calls, recursively (each computation once)."""
    ins = instrs[name]
    if not ins.calls:
        return [ins]
    out = []
    for c in ins.calls:
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for n in comps[c]:
            out += _leaves(instrs, comps, n, seen)
    return out or [ins]


def _is_optimizer_frame(frame: tuple[str, str] | None) -> bool:
    if frame is None:
        return False
    file, func = frame
    path = file.replace("\\", "/")
    if "/optax/" in path:
        return "/optax/losses/" not in path
    return path.endswith("moefast/train/step.py") and func.startswith("train_step")


def classify_hlo(text: str) -> dict[str, str]:
    """Kind (one of :data:`KINDS`) of every instruction of a compiled XLA module.

    A plain instruction's kind comes from its opcode; a fusion's (or a ``call``'s) from the ops
    inside it, recursively: any ``dot``/``convolution`` or a custom call whose target names a
    matmul → ``matmul``; else at least half of its non-trivial ops from optimizer code (innermost
    source frame in optax outside ``optax.losses``, or in moefast's ``train_step``) → ``optimizer``;
    else any gather/scatter/dynamic-slice → ``gather/scatter``; any reduce/reduce-window →
    ``reduction``; any custom call, sort or control flow → ``other``; any other computing op →
    ``elementwise/fusion``; only data movement (copy, transpose, concatenate, slice, pad,
    broadcast, iota) → ``copy/transpose/concatenate``.

    Args:
      text: ``compiled.as_text()`` of a ``jax.jit(...).lower(...).compile()`` result.

    Returns:
      ``{instruction name: kind}``; the names are those XLA:CPU's trace events carry.
    """
    instrs, comps, frames = parse_hlo(text)


    kinds = {}
    for name, ins in instrs.items():
        ops = [i for i in _leaves(instrs, comps, name, set()) if i.opcode not in _TRIVIAL_OPS]
        codes = {i.opcode for i in ops}
        if ins.opcode in ("while", "conditional") or (not ops and not ins.calls and ins.opcode != "bitcast"):
            kinds[name] = "other"  # a loop's body has trace events of its own; parameters, constants, tuples
        elif codes & _MATMUL_OPS or any(i.opcode == "custom-call" and _MATMUL_TARGET.search(i.target or "")
                                        for i in ops):
            kinds[name] = "matmul"
        elif ops and 2 * sum(_is_optimizer_frame(frames.get(i.frame)) for i in ops) >= len(ops):
            kinds[name] = "optimizer"
        elif codes & _GATHER_OPS:
            kinds[name] = "gather/scatter"
        elif codes & _REDUCE_OPS:
            kinds[name] = "reduction"
        elif codes & _OTHER_OPS:
            kinds[name] = "other"
        elif codes - _MOVE_OPS:
            kinds[name] = "elementwise/fusion"
        else:
            kinds[name] = "copy/transpose/concatenate"
    return kinds


WORK_KINDS = ("matmul", "routing", "dispatch/combine", "collectives", "optimizer", "other")

_COLLECTIVE_OPS = {"all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
                   "ragged-all-to-all", "all-reduce-start", "all-reduce-done", "all-gather-start", "all-gather-done",
                   "collective-permute-start", "collective-permute-done", "send", "recv", "send-done", "recv-done"}
_DISPATCH_FUNCS = {"_to_experts", "_from_experts", "_dropless_grouped", "exchange_experts"}
_ROUTING_FUNCS = {"_moe_local", "_warmup_logits", "_capacity", "_shard_index"}


def _work_frame(frame: tuple[str, str] | None) -> str | None:
    """The MoE kind of work an op traced from ``frame`` (innermost file, function) belongs to."""
    if frame is None:
        return None
    if _is_optimizer_frame(frame):
        return "optimizer"
    path, func = frame[0].replace("\\", "/"), frame[1]
    if path.endswith("moefast/routing/dispatch.py") or (path.endswith("moefast/parallel/expert.py")
                                                          and func in _DISPATCH_FUNCS):
        return "dispatch/combine"
    if ("/kernels/routing/" in path or path.endswith("moefast/routing/core.py")
            or (path.endswith("moefast/parallel/expert.py") and func in _ROUTING_FUNCS)):
        return "routing"
    return None


def classify_work(text: str) -> dict[str, str]:
    """Kind of work (one of :data:`WORK_KINDS`) of every instruction of a compiled XLA module.

    From the instruction's ops (a fusion's or call's ops inside it, recursively) and the source
    frame each op was traced from (its innermost frame; AD's transposed ops keep the frame of the
    op they transpose, so the backward pass is classified like the forward):

    1. any collective op (all-to-all, all-reduce, all-gather, reduce-scatter, collective-permute,
       their async start/done) → ``collectives``;
    2. at least half of its ops from :mod:`moefast.routing.dispatch` or the exchange's reshuffles
       in :mod:`moefast.parallel.expert` (``_to_experts``, ``_from_experts``, the dropless
       permutation) → ``dispatch/combine`` (so GShard's one-hot einsums count here, not as
       matmul); at least half from optax or ``train_step`` → ``optimizer``;
    3. any dot/convolution or matmul custom call → ``matmul`` (experts, attention, projections,
       router logits, LM head);
    4. at least half from the routing kernel (``moefast.kernels.routing``), :mod:`moefast.routing.core`
       or the routing code of :mod:`moefast.parallel.expert` → ``routing`` (top-k, gates, slots,
       capacity, loss statistics);
    5. anything else → ``other`` (norms, softmax of attention, activations, loss, embedding).

    Args:
      text: ``compiled.as_text()`` of a compiled train step.

    Returns:
      ``{instruction name: kind}``.
    """
    instrs, comps, frames = parse_hlo(text)


    kinds = {}
    for name, ins in instrs.items():
        ops = [i for i in _leaves(instrs, comps, name, set()) if i.opcode not in _TRIVIAL_OPS]
        codes = {i.opcode for i in ops}
        work = collections.Counter(_work_frame(frames.get(i.frame)) for i in ops)
        half = lambda k: ops and 2 * work[k] >= len(ops)
        if codes & _COLLECTIVE_OPS:
            kinds[name] = "collectives"
        elif half("dispatch/combine"):
            kinds[name] = "dispatch/combine"
        elif half("optimizer"):
            kinds[name] = "optimizer"
        elif codes & _MATMUL_OPS or any(i.opcode == "custom-call" and _MATMUL_TARGET.search(i.target or "")
                                        for i in ops):
            kinds[name] = "matmul"
        elif half("routing"):
            kinds[name] = "routing"
        else:
            kinds[name] = "other"
    return kinds


def _intervals_minus(a: float, b: float, cuts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pieces of [a, b] outside the (start-sorted) intervals ``cuts``."""
    out, cur = [], a
    for s, e in cuts:
        if e <= cur:
            continue
        if s >= b:
            break
        if s > cur:
            out.append((cur, s))
        cur = max(cur, e)
    if cur < b:
        out.append((cur, b))
    return out


def latest_trace(directory: str | Path) -> str:
    """The newest ``*.trace.json.gz`` that ``jax.profiler`` wrote under ``directory``.

    Raises:
      RuntimeError: there is none.
    """
    traces = sorted(glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not traces:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {directory}")
    return traces[-1]


def _op_name(event: dict[str, Any], kinds: dict[str, str]) -> str | None:
    """The HLO instruction a trace event ran: its name on XLA:CPU, ``args.hlo_op`` on GPU."""
    if event["name"] in kinds:
        return event["name"]
    op = (event.get("args") or {}).get("hlo_op")
    return op if op in kinds else None


def xla_trace_times(trace_path: str | Path, kinds: dict[str, str], steps: int,
                    kind_names: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """Thread time per kind in a ``jax.profiler`` trace of an XLA:CPU program.

    Each trace event of an HLO instruction (a key of ``kinds``: the event's name on XLA:CPU, its
    ``hlo_op`` argument on GPU) counts its exclusive
    duration (less nested op events on its thread) for its kind. XLA's worker threads also run
    intra-op parallel shards of an op launched on another thread; those show as thread-pool regions
    (``ThreadpoolListener::StartRegion`` … ``StopRegion``) outside any op of their own. Such time is
    credited to the op(s) running on the other threads at that moment (split evenly when several
    run), or reported as ``unattributed_worker_ms``.

    Args:
      trace_path: a ``*.trace.json.gz`` (Chrome trace JSON) from ``jax.profiler.trace``.
      kinds: from :func:`classify_hlo` (or :func:`classify_work`) for the traced program.
      steps: how many program runs the trace holds (the figures are per run).
      kind_names: every kind ``kinds`` may hold (:data:`KINDS` or :data:`WORK_KINDS`), in order.

    Returns:
      ``{"kinds": {kind: ms}, "kinds_launching_thread": {kind: ms}, "unattributed_worker_ms",
      "op_events", "threads", "top_other": [(name, ms), ...]}``, ms per run (``op_events``: matched
      events in the whole trace; ``threads``: threads that ran ops).

    Raises:
      RuntimeError: no event of the trace is named like an instruction in ``kinds``.
    """
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    by_thread: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in xs:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    own: dict[str, float] = collections.defaultdict(float)  # per instruction, launching thread
    helped: dict[str, float] = collections.defaultdict(float)  # per instruction, other threads' shards
    op_ivs: dict[Any, list[tuple[float, float, str]]] = {}
    busy: dict[Any, list[tuple[float, float]]] = {}
    regions: dict[Any, list[tuple[float, float]]] = {}
    matched = 0
    for t, es in by_thread.items():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        ops = [(e, n) for e in es if (n := _op_name(e, kinds)) is not None]
        matched += len(ops)
        stack: list[tuple[dict, str]] = []
        for e, n in ops:  # exclusive times: nested op events (e.g. a while body) are subtracted
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1][1]] -= e["dur"]
            own[n] += e["dur"]
            stack.append((e, n))
        op_ivs[t] = [(e["ts"], e["ts"] + e["dur"], n) for e, n in ops]
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in es if "wait for completion" in e["name"].lower()]
        busy[t] = sorted([(s, e) for s, e, _ in op_ivs[t]] + waits)
        start, rs = None, []
        for e in es:
            if e["name"].endswith("StartRegion"):
                start = e["ts"]
            elif e["name"].endswith("StopRegion") and start is not None:
                rs.append((start, e["ts"]))
                start = None
        regions[t] = rs
    if not matched:
        raise RuntimeError(f"{trace_path}: no trace event is named like an instruction of the compiled program; "
                           "the trace format of this jax version is not understood")
    unattributed = 0.0
    for t, rs in regions.items():
        others = sorted(iv for u, ivs in op_ivs.items() if u != t for iv in ivs)
        starts = [s for s, _, _ in others]
        longest = max((e - s for s, e, _ in others), default=0.0)
        for a, b in rs:
            for pa, pb in _intervals_minus(a, b, busy[t]):
                hits = []
                j = bisect.bisect_left(starts, pb) - 1  # ops starting before the piece ends, latest first
                while j >= 0 and starts[j] > pa - longest:
                    s, e, n = others[j]
                    ov = min(e, pb) - max(s, pa)
                    if ov > 0:
                        hits.append((n, ov))
                    j -= 1
                total = sum(ov for _, ov in hits)
                scale = min(1.0, (pb - pa) / total) if total else 0.0
                for n, ov in hits:
                    helped[n] += ov * scale
                unattributed += (pb - pa) - total * scale
    per_kind: dict[str, float] = {k: 0.0 for k in kind_names}
    per_kind_own: dict[str, float] = {k: 0.0 for k in kind_names}
    other_ops: dict[str, float] = collections.defaultdict(float)
    for n in set(own) | set(helped):
        k = kinds[n]
        per_kind[k] += (own[n] + helped[n]) / 1e3 / steps
        per_kind_own[k] += own[n] / 1e3 / steps
        if k == "other":
            other_ops[n] += (own[n] + helped[n]) / 1e3 / steps
    return {"kinds": per_kind, "kinds_launching_thread": per_kind_own,
            "unattributed_worker_ms": unattributed / 1e3 / steps, "op_events": matched,
            "threads": sum(1 for ivs in op_ivs.values() if ivs),
            "top_other": sorted(other_ops.items(), key=lambda kv: -kv[1])[:5]}
