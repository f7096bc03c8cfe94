"""``moefast bench routing``: routing + dispatch + combine, forward and backward, side by side.

Three ways to move T tokens of width D to their top-k of E experts (capacity C per expert) and
back, each differentiated with respect to the tokens and the router logits:

* ``onehot`` — GShard-style dispatch/combine einsums over a [T, E, C] one-hot tensor (what most
  JAX MoE code does; the model's ``moe.dispatch=onehot``): memory and FLOPs grow as T·E·C, i.e. quadratically in T at a fixed capacity
  factor.
* ``sort`` — argsort the assignments by expert, rank inside each expert, scatter into [E, C, D].
* ``fused`` — moefast: :func:`moefast.kernels.routing.route` with ``impl="auto"`` (the compiled
  kernel on GPU; the jnp reference on CPU, where Pallas only interprets) plus slot-indexed
  gather/scatter dispatch and combine.

The experts are the identity (this measures the routing and data movement, not expert FLOPs).
Times are medians over ``repeats`` runs after one warm-up; ``temp_bytes`` is XLA's compiled
temporary allocation (``compiled.memory_analysis()``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

import jax
import jax.numpy as jnp

from moefast import routing
from moefast.bench.process import call_times, compile_timed, write_results

__all__ = ["IMPLS", "RoutingBenchRecord", "bench_routing", "format_table"]

IMPLS = ("onehot", "sort", "fused")
FULL_GRID = [(t, e) for t in (4096, 16384, 65536) for e in (8, 64, 256)]
QUICK_GRID = [(4096, 8), (4096, 64), (16384, 64), (65536, 64)]


@dataclasses.dataclass
class RoutingBenchRecord:
    impl: str
    tokens: int
    experts: int
    top_k: int
    d_model: int
    capacity: int
    time_ms: float | None  # median forward+backward, milliseconds
    temp_bytes: int | None  # compiled temporary memory, bytes
    runs: int = 0  # timed runs behind the median
    skipped: str | None = None  # why it did not run


def _onehot_fn(top_k: int, capacity: int):
    def f(x_td, logits_te):
        e = logits_te.shape[1]
        r = routing.route(logits_te, top_k=top_k, capacity=capacity, impl="reference")
        dispatch_tec, combine_tec = routing.onehot_masks(r, e, capacity)  # moe.dispatch=onehot's
        return routing.combine_onehot(routing.dispatch_onehot(x_td, dispatch_tec), combine_tec)
    return f


def _sort_fn(top_k: int, capacity: int):
    def f(x_td, logits_te):
        t, e = logits_te.shape
        d = x_td.shape[1]
        index = routing.route(logits_te, top_k=top_k, capacity=t, impl="reference")
        expert_flat = index.expert_index.T.reshape(-1)  # position order: [K*T]
        token_flat = jnp.tile(jnp.arange(t), top_k)
        gate_flat = index.gates.T.reshape(-1)
        order = jnp.argsort(expert_flat, stable=True)
        sorted_e = expert_flat[order]
        starts = jnp.searchsorted(sorted_e, jnp.arange(e), side="left")
        rank = jnp.arange(t * top_k) - starts[sorted_e]
        rank = jnp.where(rank < capacity, rank, capacity)  # capacity = dropped
        buf = jnp.zeros((e, capacity, d), x_td.dtype).at[sorted_e, rank].set(
            x_td[token_flat[order]], mode="drop")
        y = buf[sorted_e, jnp.minimum(rank, capacity - 1)] * jnp.where(rank < capacity, gate_flat[order], 0.0)[:, None]
        return jnp.zeros_like(x_td).at[token_flat[order]].add(y)
    return f


def _fused_fn(top_k: int, capacity: int):
    def f(x_td, logits_te):
        e = logits_te.shape[1]
        r = routing.route(logits_te, top_k=top_k, capacity=capacity, impl="auto")
        return routing.combine(routing.dispatch(x_td, r, e, capacity), r)
    return f


_FNS: dict[str, Callable] = {"onehot": _onehot_fn, "sort": _sort_fn, "fused": _fused_fn}


def _fwd_bwd(fn):
    def loss(x, logits):
        return jnp.sum(fn(x, logits) * jnp.cos(x))
    return jax.grad(loss, argnums=(0, 1))


def bench_routing(grid=QUICK_GRID, impls=IMPLS, *, top_k: int = 2, d_model: int = 256,
                  capacity_factor: float = 1.25, repeats: int = 5, onehot_max_bytes: float = 4e9,
                  time_budget_s: float = 10.0, log: Callable[[str], None] | None = print
                  ) -> list[RoutingBenchRecord]:
    """Runs the benchmark grid.

    Args:
      grid: (tokens, experts) pairs.
      impls: subset of :data:`IMPLS`.
      top_k, d_model, capacity_factor: workload.
      repeats: timed runs per point (the median is reported); fewer (at least 1) when one run
        takes more than ``time_budget_s / repeats`` seconds.
        onehot_max_bytes: skip ``onehot`` when its [T, E, C] float32 tensors would exceed this (they
        grow quadratically in tokens).
      log: progress printer.

    Returns:
      One record per (impl, tokens, experts).
    """
    out = []
    for tokens, experts in grid:
        capacity = routing.compute_capacity(tokens, experts, top_k, capacity_factor)
        kx, kl = jax.random.split(jax.random.key(tokens * 1000 + experts))
        x = jax.random.normal(kx, (tokens, d_model), jnp.float32)
        logits = jax.random.normal(kl, (tokens, experts), jnp.float32)
        for impl in impls:
            rec = RoutingBenchRecord(impl, tokens, experts, top_k, d_model, capacity, None, None)
            onehot_bytes = 4.0 * tokens * experts * capacity
            if impl == "onehot" and onehot_bytes > onehot_max_bytes:
                rec.skipped = f"[T, E, C] tensor would take {onehot_bytes / 1e9:.1f} GB"
                out.append(rec)
                continue
            compiled, _ = compile_timed(_fwd_bwd(_FNS[impl](top_k, capacity)), x, logits)
            mem = compiled.memory_analysis()
            rec.temp_bytes = int(mem.temp_size_in_bytes) if mem is not None else None
            times = call_times(compiled, x, logits, repeats=repeats, budget_s=time_budget_s)
            rec.time_ms, rec.runs = 1e3 * statistics.median(times), len(times)
            out.append(rec)
            if log:
                log(f"{impl:>6} tokens={tokens:>6} experts={experts:>3}: {rec.time_ms:9.2f} ms, "
                    f"temp {rec.temp_bytes / 2**20:9.1f} MiB")
    return out


def check_fused_matches_onehot(tokens: int = 256, experts: int = 8, top_k: int = 2) -> float:
    """Max |difference| of outputs and gradients between ``fused`` and ``onehot`` (sanity check
    that the benchmark compares equal computations)."""
    capacity = routing.compute_capacity(tokens, experts, top_k, 1.0)
    x = jax.random.normal(jax.random.key(0), (tokens, 16))
    logits = jax.random.normal(jax.random.key(1), (tokens, experts))
    err = 0.0
    for a, b in zip(jax.jit(_fwd_bwd(_FNS["fused"](top_k, capacity)))(x, logits),
                    jax.jit(_fwd_bwd(_FNS["onehot"](top_k, capacity)))(x, logits)):
        err = max(err, float(jnp.max(jnp.abs(a - b))))
    for impl in ("sort", "fused"):
        ya = _FNS[impl](top_k, capacity)(x, logits)
        yb = _FNS["onehot"](top_k, capacity)(x, logits)
        err = max(err, float(jnp.max(jnp.abs(ya - yb))))
    return err


def format_table(records: list[RoutingBenchRecord]) -> str:
    """Markdown table: time and temp memory per impl, with ratios to ``onehot`` and ``sort``."""
    by_point: dict[tuple[int, int], dict[str, RoutingBenchRecord]] = {}
    for r in records:
        by_point.setdefault((r.tokens, r.experts), {})[r.impl] = r
    impls = [i for i in IMPLS if any(i in v for v in by_point.values())]
    head = ["tokens", "experts"] + [f"{i} ms" for i in impls] + [f"{i} temp MiB" for i in impls]
    head += ["onehot / fused", "sort / fused"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (t, e), recs in sorted(by_point.items()):
        def ms(i):
            r = recs.get(i)
            return "skipped" if r is None or r.time_ms is None else f"{r.time_ms:.2f}"

        def mib(i):
            r = recs.get(i)
            return "—" if r is None or r.temp_bytes is None else f"{r.temp_bytes / 2**20:.1f}"

        def ratio(i):
            a, b = recs.get(i), recs.get("fused")
            if a is None or b is None or a.time_ms is None or b.time_ms is None:
                return "—"
            return f"{a.time_ms / b.time_ms:.1f}×"

        row = [str(t), str(e)] + [ms(i) for i in impls] + [mib(i) for i in impls] + [ratio("onehot"), ratio("sort")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_cli(*, quick: bool, json_out: str | None, repeats: int) -> int:
    err = check_fused_matches_onehot()
    print(f"check: fused vs onehot max |diff| (outputs and gradients) = {err:.2e}")
    if not err < 1e-4:
        print("error: the implementations disagree; not benchmarking")
        return 1
    records = bench_routing(QUICK_GRID if quick else FULL_GRID, repeats=repeats)
    table = format_table(records)
    print(f"\nrouting + dispatch + combine, forward+backward, top_k 2, d_model 256, capacity factor 1.25, "
          f"{jax.devices()[0].platform} ({jax.device_count()} device(s)), median of up to {repeats} runs "
          "(fewer for runs over 2 s)\n")
    print(table)
    if json_out:
        write_results(json_out, [dataclasses.asdict(r) for r in records], table)
    return 0
