#!/usr/bin/env python
"""One-shot GPU check of the kernels (routing, attention, grouped GEMM: correctness, timings) and of the train step (MFU).

Run on an NVIDIA GPU (written for an H200 with jax 0.11.2; budget ~8 minutes)::

    python scripts/gpu_check.py --out gpu_check.json

and on a CPU, tiny and in the Pallas interpreter, to check the script itself::

    python scripts/gpu_check.py --cpu-smoke --out /tmp/gpu_check_smoke.json

One file on purpose (~800 lines): the project keeps ONE script that checks and times every GPU path, copied
as it is to a lent GPU machine whose time is short. Checks, in order (each a function registered with
:func:`register_check`; add checks the same way):

0. ``lowering`` — the kernel lowers to a Triton custom call; deprecation warnings are recorded.
1. ``correctness`` — the compiled Pallas kernel (``impl="pallas"``; also ``impl="triton"`` where
   jax-triton runs) against the reference on a few shapes, up to 1024 experts: expert_index, slot, tokens_per_expert, num_dropped bitwise; gates, prob_sum, z_sum and
   the logits gradient to float32 tolerance. Mismatching elements are counted, not just flagged.
2. ``bandwidth`` — device memory bandwidth from a large elementwise copy (read + write).
2b. ``target`` — saves this GPU's XLA target description and the autotuning results of the
   train step (``configs/h200_1b.yaml``, 8 layers) next to ``--out`` (``<out>_xla/``), which
   ``moefast bench gpu-compile --gpu FILE --autotune FILE`` loads for later deviceless compiles.
3. ``kernel`` — the routing kernel alone (``routing_blocks``) over block sizes / warps, against the
   memory floor: (logits read once + kernel outputs written once) / measured bandwidth.
4. ``route`` — ``route(impl=...)`` forward and forward+backward for every impl and policy.
4b. ``attention`` — the fused attention kernel (``moefast.kernels.attention``) against the blocked
   einsums and the dense reference, forward + backward, bfloat16, packed documents, GQA.
4c. ``grouped_matmul`` — the Pallas grouped GEMM against ``ragged_dot`` and the dense reference,
   forward + both backward products, random expert loads: time, TFLOP/s of the exact work.
5. ``overlap`` — with 2+ GPUs: ``moefast bench overlap`` (:mod:`moefast.bench.overlap`): the train step
   of a 4-layer MoE on an expert axis over the GPUs for ``moe.overlap_chunks`` 1, 2, 4 (alternating
   timed steps) and the compiled program's all-to-alls: count, bytes, how many are asynchronous
   with compute scheduled between start and done. With one GPU it is a skipped row. moefast's GPU
   XLA flags (``moefast.parallel.xla_flags``) are set before JAX starts, as ``moefast train`` does;
   the ones added are in the environment record.
6. ``memory`` — ``moefast bench memory`` (:mod:`moefast.bench.memory`) on the GPU config: XLA's
   per-device memory of the compiled step for each ``model.remat`` policy with scanned layers (timed
   over a few interleaved steps), then unrolled layers without and with full remat.
7. ``train_step`` — ``moefast bench train --ablate`` (:mod:`moefast.bench.train`) on
   ``configs/h200_1b.yaml`` with 8 of its 16 layers (``TRAIN_GPU_OVERRIDES``; ``--train-override``
   adds overrides): the baseline (tables recomputed per layer, GShard one-hot dispatch, no chunks,
   no prefetch, reference routing), each lever alone and all levers, in 2 interleaved rounds of
   ``--train-runs`` steps: tokens/s, step time, MFU (model FLOPs of
   ``moefast.model.flops``, peak from ``moefast.train.mfu``'s table or ``--peak-tflops``), memory
   per device, compile time, ratios to the baseline and to all levers. It runs last and gets
   ``--train-reserve-s`` of the budget, ``memory`` ``--memory-reserve-s``: each check's deadline
   leaves the reserves of the checks after it, and a check that would not fit says "skipped
   (budget ...)"; ``--only train_step`` gives it the whole budget.
8. ``estimate`` — calibration of ``moefast bench gpu-compile``'s estimate: the "all levers" step of
   ``train_step`` compiled for a compile-only copy of this GPU (``target``'s files), XLA's estimated
   step (speed-of-light estimator, costing twin) next to the measured one, and their ratio.

Every row goes into one markdown table per check on stdout and into the JSON file (``--out``).
Timings are medians of ``--runs`` runs (train steps: ``--train-runs``) after a warm-up, each ended
with ``block_until_ready``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- Context and check registry --------------------------------------------------------------------

@dataclasses.dataclass
class Context:
    """What every check gets: parsed arguments, the deadline and shared measurements."""

    args: argparse.Namespace
    deadline: float  # time.monotonic() value after which checks skip remaining work
    interpret: bool  # Pallas interpreter (CPU smoke) instead of compiled kernels
    shared: dict = dataclasses.field(default_factory=dict)  # e.g. "bandwidth_gbs"

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


CHECKS: list[tuple[str, Callable[[Context], list[dict]]]] = []


def register_check(name: str):
    """Decorator: ``fn(ctx) -> list of row dicts`` runs (in registration order) as check ``name``."""
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn
    return wrap


# --- Measurement helpers (reusable by added checks) -------------------------------------------------

def time_fn(fn: Callable, *args, runs: int, warmup: int = 2) -> dict:
    """Median / min wall time in ms of ``fn(*args)`` (compiled): :func:`moefast.bench.process.call_times`."""
    from moefast.bench.process import call_times

    times = [1e3 * t for t in call_times(fn, *args, repeats=runs, warmup=warmup)]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": runs}


def compile_fn(fn: Callable, *args):
    """(compiled, compile seconds): :func:`moefast.bench.process.compile_timed`."""
    from moefast.bench.process import compile_timed

    return compile_timed(fn, *args)


def floor_ms(nbytes: float, bandwidth_gbs: float | None) -> float | None:
    return None if not bandwidth_gbs else nbytes / (bandwidth_gbs * 1e9) * 1e3


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"16384x64x2,65536x256x8"`` -> [(T, E, K), ...]."""
    out = []
    for item in text.split(","):
        t, e, k = (int(v) for v in item.lower().split("x"))
        out.append((t, e, k))
    return out


def error_row(**fields) -> dict:
    exc = sys.exc_info()[1]
    return {**fields, "status": "error", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def make_inputs(t: int, e: int, dtype: str, kind: str = "normal", seed: int = 0):
    import jax
    import jax.numpy as jnp
    key = jax.random.key(seed)
    if kind == "integer":  # many exact ties
        x = jax.random.randint(key, (t, e), -2, 3).astype(jnp.float32)
    else:
        x = 2.0 * jax.random.normal(key, (t, e))
    mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.9, (t,))
    return x.astype(dtype), mask


# --- Checks -----------------------------------------------------------------------------------------

@register_check("lowering")
def check_lowering(ctx: Context) -> list[dict]:
    """Which GPU backend the kernel lowers to (a Triton custom call expected) and its warnings."""
    import jax
    import jax.numpy as jnp
    from moefast.kernels.routing.ops import route_pallas

    t, e, k = 4096, 64, 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            text = jax.jit(functools.partial(route_pallas, top_k=k, capacity=256, interpret=False)).trace(
                jax.ShapeDtypeStruct((t, e), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
            row = {"status": "ok", "triton_custom_call": "xla.gpu.triton" in text,
                   "mosaic_gpu_custom_call": "mosaic_gpu" in text}
        except Exception:
            row = error_row()
    row["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
    return [row]


@register_check("correctness")
def check_correctness(ctx: Context) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from moefast.kernels.routing import route
    from moefast.kernels.routing.ops import route_pallas
    from moefast.routing import compute_capacity

    from moefast.kernels.routing import triton as triton_kernel

    variants = [("position", "normal", "cumsum"), ("position", "integer", "cumsum"),
                ("priority", "normal", "cumsum"), ("priority", "integer", "cumsum"),
                ("position", "integer", "matmul")]
    if triton_kernel.available() is None:  # the Triton kernel through jax-triton (impl="triton")
        variants += [("position", "normal", "triton"), ("priority", "integer", "triton")]
    rows = []
    for (t, e, k) in parse_shapes(ctx.args.check_shapes):
        for policy, kind, method in variants:
            row = {"shape": f"{t}x{e}x{k}", "policy": policy, "logits": kind, "rank_method": method}
            if ctx.time_left() < 30:
                rows.append({**row, "status": "skipped (budget)"})
                continue
            try:
                logits, mask = make_inputs(t, e, ctx.args.dtype, kind, seed=t + e + k)
                kw = dict(top_k=k, capacity=compute_capacity(t, e, k, 1.0), policy=policy, mask=mask)

                def both(lg):
                    def loss(fn):
                        def f(x):
                            r = fn(x)
                            w = jnp.arange(1.0, k + 1.0)[None, :]
                            return jnp.sum(r.gates * w) + jnp.sum(r.prob_sum * jnp.arange(e)) + 1e-3 * r.z_sum, r
                        return jax.value_and_grad(f, has_aux=True)(lg)
                    kernel = (lambda x: route(x, impl="triton", **kw)) if method == "triton" else (
                        lambda x: route_pallas(x, interpret=ctx.interpret, rank_method=method, **kw))
                    return loss(kernel), loss(lambda x: route(x, impl="reference", **kw))

                ((_, got), g_got), ((_, want), g_want) = jax.jit(both)(logits)
                for name in ("expert_index", "slot", "tokens_per_expert", "num_dropped"):
                    a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
                    row[f"{name}_mismatches"] = int(np.sum(a != b))
                for name in ("gates", "prob_sum", "z_sum"):
                    a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
                    row[f"{name}_max_rel_err"] = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6)))
                a, b = np.asarray(g_got, np.float32), np.asarray(g_want, np.float32)
                row["grad_max_abs_err"] = float(np.max(np.abs(a - b)))
                row["grad_max_abs"] = float(np.max(np.abs(b)))
                bitwise = all(row[f"{n}_mismatches"] == 0 for n in
                              ("expert_index", "slot", "tokens_per_expert", "num_dropped"))
                close = (row["gates_max_rel_err"] < 1e-5
                         and max(row["prob_sum_max_rel_err"], row["z_sum_max_rel_err"]) < 1e-4
                         and row["grad_max_abs_err"] <= 1e-5 * max(1.0, row["grad_max_abs"]))
                near_tie = False
                if row["expert_index_mismatches"]:
                    # Different choices are legitimate only between scores equal to rounding: the
                    # kernel's softmax rounds differently from XLA's (see kernels/routing/pallas.py).
                    score = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))
                    gi, wi = np.asarray(got.expert_index), np.asarray(want.expert_index)
                    tt = np.nonzero(gi != wi)[0]
                    pick = functools.partial(np.take_along_axis, score[tt], axis=1)
                    gap = np.abs(pick(gi[tt]) - pick(wi[tt]))
                    row["choice_max_rel_gap"] = float(np.max(gap / np.max(score[tt], axis=1, keepdims=True)))
                    near_tie = row["choice_max_rel_gap"] < 1e-6
                row["status"] = ("ok" if bitwise and close else
                                 "near-tie" if near_tie and close else "MISMATCH")
            except Exception:
                row = error_row(**row)
            rows.append(row)
    ctx.shared["correct"] = all(r.get("status") == "ok" for r in rows)
    return rows


@register_check("bandwidth")
def check_bandwidth(ctx: Context) -> list[dict]:
    import jax.numpy as jnp
    nbytes = int(ctx.args.copy_mib * 2**20)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    compiled, _ = compile_fn(lambda a: a + 1.0, x)  # reads and writes nbytes
    t = time_fn(compiled, x, runs=ctx.args.runs)
    gbs = 2 * nbytes / (t["median_ms"] * 1e-3) / 1e9
    ctx.shared["bandwidth_gbs"] = gbs
    return [{"bytes_moved": 2 * nbytes, **t, "bandwidth_GBs": gbs}]


@register_check("target")
def check_target(ctx: Context) -> list[dict]:
    """This GPU's target description and XLA's autotuning results of the train step of
    ``configs/h200_1b.yaml`` with :data:`TRAIN_GPU_OVERRIDES` (one device), saved next to ``--out``
    (``<out>_xla/``) for deviceless compiles: ``moefast bench gpu-compile --gpu
    <out>_xla/gpu_target_config.txtpb --autotune <out>_xla/autotune_results.txtpb``. Autotuning
    results apply where a compile has the same fusions (same config and shapes per device)."""
    import glob
    import shutil
    import tempfile

    import jax

    from moefast.config import load_config
    from moefast.train import Trainer

    if ctx.args.cpu_smoke:
        return [{"status": "skipped (CPU: no GPU target to save)"}]
    if ctx.time_left() < 60:
        return [{"status": f"skipped (budget: {ctx.time_left():.0f} s left, needs ~60 s)"}]
    out = os.path.splitext(os.path.abspath(ctx.args.out))[0] + "_xla"
    os.makedirs(out, exist_ok=True)
    autotune = os.path.join(out, "autotune_results.txtpb")
    cfg = load_config(os.path.join(REPO, "configs", "h200_1b.yaml"), [*TRAIN_GPU_OVERRIDES, *ctx.args.train_override])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, os.path.join(tmp, "run"), log=None, progress=False, devices=jax.devices()[:1])
        t0 = time.perf_counter()
        trainer.lower_train_step().compile({**trainer.compiler_options(), "xla_dump_to": os.path.join(tmp, "dump"),
                                            "xla_gpu_dump_autotune_results_to": autotune})
        compile_s = time.perf_counter() - t0
        found = sorted(glob.glob(os.path.join(tmp, "dump", "*gpu_target_config.pbtxt")))
        target = os.path.join(out, "gpu_target_config.txtpb")
        if found:
            shutil.copy(found[0], target)
    return [{"status": "ok" if found else "error", "target_config": target if found else None,
             "autotune_results": autotune if os.path.isfile(autotune) else None, "compile_s": compile_s}]


def kernel_io_bytes(t: int, e: int, k: int, block_tokens: int, itemsize: int, rank_method: str) -> int:
    """Bytes the routing kernel must move: logits and mask in, [T, K] outputs and block stats out."""
    from moefast.kernels.routing.pallas import next_power_of_2
    nb, ep, kp = -(-t // block_tokens), next_power_of_2(e), next_power_of_2(k)
    ep = max(ep, 16) if rank_method == "matmul" else ep
    tp = nb * block_tokens
    return (tp * ep * itemsize + tp * 4 + ep * 4  # logits, mask, bias
            + 3 * tp * kp * 4  # expert_index, gates, block_rank
            + nb * (kp * ep + ep + 1) * 4)  # counts, prob_sum, z_sum


@register_check("kernel")
def check_kernel(ctx: Context) -> list[dict]:
    import jax.numpy as jnp
    from moefast.kernels.routing.pallas import routing_blocks

    rows = []
    gbs = ctx.shared.get("bandwidth_gbs")
    for (t, e, k) in parse_shapes(ctx.args.shapes):
        logits, mask = make_inputs(t, e, ctx.args.dtype)
        bias = jnp.zeros((e,), jnp.float32)
        for bt, method, nw in itertools.product([int(v) for v in ctx.args.block_tokens.split(",")],
                                                ctx.args.rank_methods.split(","),
                                                [int(v) for v in ctx.args.num_warps.split(",")]):
            row = {"shape": f"{t}x{e}x{k}", "block_tokens": bt, "rank_method": method, "num_warps": nw}
            if ctx.time_left() < 20:
                rows.append({**row, "status": "skipped (budget)"})
                continue
            try:
                fn = functools.partial(routing_blocks, top_k=k, block_tokens=bt, interpret=ctx.interpret,
                                       rank_method=method, num_warps=None if ctx.interpret else nw)
                compiled, secs = compile_fn(fn, logits, mask, bias)
                tm = time_fn(compiled, logits, mask, bias, runs=ctx.args.runs)
                nbytes = kernel_io_bytes(t, e, k, bt, logits.dtype.itemsize, method)
                fl = floor_ms(nbytes, gbs)
                rows.append({**row, "status": "ok", "compile_s": secs, **tm, "io_bytes": nbytes,
                             "floor_ms": fl, "x_floor": tm["median_ms"] / fl if fl else None})
            except Exception:
                rows.append(error_row(**row))
    ok = [r for r in rows if r.get("status") == "ok"]
    for shape in {r["shape"] for r in ok}:
        best = min((r for r in ok if r["shape"] == shape), key=lambda r: r["median_ms"])
        best["best"] = True
    return rows


@register_check("route")
def check_route(ctx: Context) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from moefast.kernels.routing import IMPLS, route
    from moefast.routing import compute_capacity

    impls = [i for i in ctx.args.impls.split(",") if i]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"--impls: {unknown} not in {IMPLS}")
    gbs = ctx.shared.get("bandwidth_gbs")
    rows = []
    from moefast.kernels.routing import triton as triton_kernel

    why = triton_kernel.available()
    if "triton" in impls and why:
        impls = [i for i in impls if i != "triton"]
        rows.append({"impl": "triton", "status": f"skipped ({why})"})
    for (t, e, k) in parse_shapes(ctx.args.shapes):
        logits, mask = make_inputs(t, e, ctx.args.dtype)
        itemsize = logits.dtype.itemsize
        out_bytes = t * k * 12 + e * 8 + 16  # expert_index, gates, slot; tokens_per_expert, prob_sum; scalars
        for policy in ctx.args.policies.split(","):
            for impl in impls:
                kw = dict(top_k=k, capacity=compute_capacity(t, e, k, ctx.args.capacity_factor), policy=policy,
                          impl=impl, mask=mask)

                def fwd(lg, kw=kw):
                    return route(lg, **kw)

                def loss(lg, kw=kw):  # the result is returned too, so no output is dead code
                    r = route(lg, **kw)
                    return jnp.sum(r.gates) + 1e-2 * jnp.sum(r.prob_sum) + 1e-3 * r.z_sum, r

                for mode, fn, nbytes in (
                        ("fwd", fwd, t * e * itemsize + t + out_bytes),
                        ("fwd+bwd", jax.value_and_grad(loss, has_aux=True), 3 * t * e * itemsize + t + out_bytes)):
                    row = {"shape": f"{t}x{e}x{k}", "policy": policy, "impl": impl, "mode": mode}
                    if ctx.time_left() < 20:
                        rows.append({**row, "status": "skipped (budget)"})
                        continue
                    try:
                        compiled, secs = compile_fn(fn, logits)
                        tm = time_fn(compiled, logits, runs=ctx.args.runs)
                        fl = floor_ms(nbytes, gbs)
                        rows.append({**row, "status": "ok", "compile_s": secs, **tm, "floor_ms": fl,
                                     "x_floor": tm["median_ms"] / fl if fl else None,
                                     "tokens_per_s": t / (tm["median_ms"] * 1e-3)})
                    except Exception:
                        rows.append(error_row(**row))
    return rows


# --- Train step: the compiled moefast step of a ~1B-parameter MoE -----------------------------------

# The GPU config is configs/h200_1b.yaml (its header gives its size and memory). train_step takes
# half its layers, so five compiles (the ablation's variants) fit the budget; the step's shapes are
# the config's. --train-override model.num_layers=16 for all of them.
TRAIN_GPU_OVERRIDES = ("model.num_layers=8",)
# --cpu-smoke: the same code path on a model that compiles and steps on a CPU in seconds.
TRAIN_STEP_SMOKE = (
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16",
    "model.d_ff=64", "model.max_seq_len=32", "model.dtype=bfloat16",
    "moe.num_experts=4", "moe.top_k=2", "moe.capacity_factor=1.25",
    "data.seq_len=32", "data.batch_size=8",
)


OVERLAP_GPU = ("model.d_model=1024", "model.num_layers=4", "model.num_heads=8", "model.head_dim=128",
               "model.d_ff=1280", "model.max_seq_len=1024", "model.dtype=bfloat16", "moe.num_experts=16",
               "moe.top_k=2", "data.seq_len=1024")


def _fwd_bwd(fn, cotangent):
    """``args -> (out, grads of sum(out * cotangent) w.r.t. every float arg)``, jitted."""
    import jax
    import jax.numpy as jnp

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32) * cotangent)

    return jax.jit(lambda *args: (fn(*args), jax.grad(loss, argnums=tuple(
        i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)))(*args)))


def _max_err(got, want) -> float:
    import jax
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _against_reference(ctx: Context, row: dict, impls: dict, args: tuple, cotangent) -> list[dict]:
    """One row per implementation in ``impls`` (name -> fn(*args)): forward + backward time and the
    largest difference of its outputs and gradients from ``impls["reference"]`` (when present)."""
    import jax

    rows, want = [], None
    for name, fn in impls.items():
        r = {**row, "impl": name}
        if ctx.time_left() < 20:
            rows.append({**r, "status": "skipped (budget)"})
            continue
        try:
            step = _fwd_bwd(fn, cotangent)
            out = jax.block_until_ready(step(*args))
            if want is None and "reference" in impls:
                want = jax.block_until_ready(_fwd_bwd(impls["reference"], cotangent)(*args))
            rows.append({**r, "status": "ok", **time_fn(step, *args, runs=ctx.args.runs),
                         "max_err_vs_reference": None if want is None else _max_err(out, want)})
        except Exception:
            rows.append(error_row(**r))
    return rows


@register_check("attention")
def check_attention(ctx: Context) -> list[dict]:
    """Fused attention (``moefast.kernels.attention.flash_attention``, moefast's Pallas Triton
    kernel) against JAX's own Pallas kernel (``jax.experimental.pallas.ops.gpu.attention.mha``, the
    one moefast used before: keys repeated per query head), the model's blocked einsums and the
    dense reference: forward + backward time and the largest difference from the reference,
    packed documents, grouped-query heads, bfloat16; and the second half of a row's queries against
    the whole row (``q_offset``: the model's second sequence slice); Gemma 4's 512-wide full heads
    and 1,024-key window against the reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    from moefast.kernels.attention import attention_reference, flash_attention
    from moefast.model.transformer import causal_attention

    rows = []
    shapes = [(1, 40, 2, 1, 16)] if ctx.args.cpu_smoke else [(4, 2048, 16, 8, 64), (1, 8192, 16, 8, 64)]
    for b, t, h, g, hd in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, hd)), jnp.bfloat16) for n in (h, g, g))
        seg = jnp.asarray(np.where(np.arange(t)[None] < rng.integers(1, t, (b, 1)), 1, 2), jnp.int32)
        ct = jnp.asarray(rng.normal(size=(b, t, h, hd)), jnp.float32)
        causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
        mask = ((seg[:, :, None] == seg[:, None, :]) & causal[None])[:, None]
        rep = lambda x: jnp.repeat(x, h // g, axis=2)  # noqa: E731
        impls = {"flash": lambda q, k, v: flash_attention(q, k, v, seg, interpret=ctx.interpret),
                 "jax_mha": lambda q, k, v: jax_attention.mha(q, rep(k), rep(v), seg, sm_scale=hd ** -0.5,
                                                              causal=True, interpret=ctx.interpret),
                 "blocked": lambda q, k, v: causal_attention(q, k, v, mask, causal=True),
                 "reference": lambda q, k, v: attention_reference(q, k, v, seg)}
        if t < 128:  # JAX's kernel needs T a multiple of its 128-row block
            del impls["jax_mha"]
        if t > 4096:  # the dense reference's [T, T] float32 scores: compared up to 4k tokens
            del impls["reference"]
        rows += _against_reference(ctx, {"shape": f"B{b} T{t} H{h} G{g} Hd{hd}"}, impls, (q, k, v), ct)
        if t <= 4096:  # the row's second half of queries against all its keys
            half = t // 2
            kw = dict(kv_segment_ids_bs=seg, q_offset=t - half)
            sliced = {"flash": lambda q, k, v: flash_attention(q, k, v, seg[:, half:], interpret=ctx.interpret, **kw),
                      "reference": lambda q, k, v: attention_reference(q, k, v, seg[:, half:], **kw)}
            rows += _against_reference(ctx, {"shape": f"B{b} T{half} of S{t} H{h} G{g} Hd{hd}"}, sliced,
                                        (q[:, half:], k, v), ct[:, half:])
    # Gemma 4 26B-A4B's attention at 4,096 tokens: a full layer's 512-wide heads (2 KV heads, the
    # kernel's 32-row blocks) and a sliding layer's 1,024-key window at 256, logits scaled 1
    gemma = [] if ctx.args.cpu_smoke else [(4096, 2, 512, None), (4096, 8, 256, 1024)]
    for t, g, hd, window in gemma:
        rng = np.random.default_rng(1)
        q, k, v = (jnp.asarray(rng.normal(size=(1, t, n, hd)) / hd ** 0.25, jnp.bfloat16) for n in (16, g, g))
        seg = jnp.ones((1, t), jnp.int32)
        ct = jnp.asarray(rng.normal(size=(1, t, 16, hd)), jnp.float32)
        kw = dict(window=window, sm_scale=1.0)
        impls = {"flash": lambda q, k, v, kw=kw: flash_attention(q, k, v, seg, interpret=ctx.interpret, **kw),
                 "reference": lambda q, k, v, kw=kw: attention_reference(q, k, v, seg, **kw)}
        rows += _against_reference(ctx, {"shape": f"B1 T{t} H16 G{g} Hd{hd} window {window} (Gemma 4)"}, impls,
                                    (q, k, v), ct)
    return rows


@register_check("gated_delta_rule")
def check_gated_delta_rule(ctx: Context) -> list[dict]:
    """Gated DeltaNet's and KDA's recurrence (``moefast.kernels.gated_delta_rule``, a decay per head
    and per key channel): the Pallas kernels (forward and backward, chunks of 64) against the
    chunked XLA form and the token-by-token reference, forward + backward time and the largest
    difference from the reference, packed documents, bfloat16 inputs, Qwen3.5's and Kimi Linear's
    head widths (K = V = 128)."""
    import jax.numpy as jnp
    import numpy as np

    from moefast.kernels.gated_delta_rule import gated_delta_rule

    rows = []
    shapes = [(1, 40, 2, 16, 16)] if ctx.args.cpu_smoke else [(2, 4096, 32, 128, 128), (1, 16384, 32, 128, 128)]
    for (b, t, h, kd, vd), decay in ((shape, decay) for decay in ("head", "channel") for shape in shapes):
        rng = np.random.default_rng(0)
        unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
        q, k = (jnp.asarray(unit(rng.normal(size=(b, t, h, kd))), jnp.bfloat16) for _ in range(2))
        v = jnp.asarray(rng.normal(size=(b, t, h, vd)), jnp.bfloat16)
        g = jnp.asarray(-np.log1p(np.exp(rng.normal(size=(b, t, h) + ((kd,) if decay == "channel" else ())))),
                        jnp.float32)
        beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(b, t, h)))), jnp.float32)
        seg = jnp.asarray(np.where(np.arange(t)[None] < rng.integers(1, t, (b, 1)), 1, 2), jnp.int32)
        ct = jnp.asarray(rng.normal(size=(b, t, h, vd)), jnp.float32)
        run = lambda impl, cs: (lambda q, k, v, g, beta: gated_delta_rule(  # noqa: E731
            q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=cs,
            **({"interpret": ctx.interpret} if impl == "pallas" else {}))[0])
        impls = {"pallas": run("pallas", 64), "chunked": run("chunked", 16), "reference": run("reference", 64)}
        if t > 4096:  # the recurrence is T sequential steps: compared up to 4k tokens
            del impls["reference"]
        rows += _against_reference(ctx, {"shape": f"B{b} T{t} H{h} K{kd} V{vd}", "decay": decay}, impls,
                                    (q, k, v, g, beta), ct)
    return rows


@register_check("mamba2")
def check_mamba2(ctx: Context) -> list[dict]:
    """Mamba-2's SSD scan (``moefast.kernels.mamba2``): the Pallas kernels (forward and backward,
    chunks of 64) against the chunked XLA form (chunks of 128) and the token-by-token reference,
    forward + backward time and the largest difference from the reference, packed documents,
    bfloat16 inputs, Nemotron 3 Nano's heads (64 of 64, 8 groups of 128 state channels)."""
    import jax.numpy as jnp
    import numpy as np

    from moefast.kernels.mamba2 import ssd

    rows = []
    shapes = [(1, 40, 2, 16, 1, 16)] if ctx.args.cpu_smoke else [(2, 4096, 64, 64, 8, 128), (1, 16384, 64, 64, 8, 128)]
    for b, t, h, p, g, n in shapes:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(b, t, h, p)), jnp.bfloat16)
        dt = jnp.asarray(np.log1p(np.exp(rng.normal(size=(b, t, h)) - 2)), jnp.float32)
        bg, cg = (jnp.asarray(rng.normal(size=(b, t, g, n)) / n ** 0.5, jnp.bfloat16) for _ in range(2))
        a = -jnp.asarray(np.arange(1, h + 1), jnp.float32)
        seg = jnp.asarray(np.where(np.arange(t)[None] < rng.integers(1, t, (b, 1)), 1, 2), jnp.int32)
        ct = jnp.asarray(rng.normal(size=(b, t, h, p)), jnp.float32)
        run = lambda impl, cs: (lambda x, dt, bg, cg: ssd(  # noqa: E731
            x, dt, a, bg, cg, segment_ids=seg, impl=impl, chunk_size=cs,
            **({"interpret": ctx.interpret} if impl == "pallas" else {}))[0])
        impls = {"pallas": run("pallas", 64), "chunked": run("chunked", 128), "reference": run("reference", 128)}
        if t > 4096:  # the recurrence is T sequential steps: compared up to 4k tokens
            del impls["reference"]
        rows += _against_reference(ctx, {"shape": f"B{b} T{t} H{h} P{p} G{g} N{n}"}, impls, (x, dt, bg, cg), ct)
    return rows


@register_check("sparse_attention")
def check_sparse_attention(ctx: Context) -> list[dict]:
    """DeepSeek Sparse Attention: the top-k kernel (``moefast.kernels.sparse_attention``, MLA's absorbed
    form, forward and backward) against its gather reference at DeepSeek-V3.2's widths (128 heads,
    576 / 512, 2,048 keys a query), and the lightning indexer's scores kernel
    (``moefast.kernels.lightning_indexer``, forward) against its reference: time and largest difference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moefast.kernels.lightning_indexer import lightning_indexer_scores
    from moefast.kernels.sparse_attention import sparse_attention

    rows = []
    shapes = [(40, 4, 16, 8)] if ctx.args.cpu_smoke else [(4096, 128, 576, 2048)]
    for t, h, dqk, k in shapes:
        rng = np.random.default_rng(0)
        dv = dqk * 8 // 9
        q = jnp.asarray(rng.normal(size=(1, t, h, dqk)) / dqk ** 0.25, jnp.bfloat16)
        kk = jnp.asarray(rng.normal(size=(1, t, dqk)) / dqk ** 0.25, jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=(1, t, dv)), jnp.bfloat16)
        idx = np.full((1, t, k), -1, np.int32)
        for i in range(t):  # each query's min(i + 1, K) keys at random among the visible ones
            idx[0, i, : min(i + 1, k)] = rng.permutation(i + 1)[:k]
        idx = jnp.asarray(idx)
        ct = jnp.asarray(rng.normal(size=(1, t, h, dv)), jnp.float32)
        run = lambda impl: (lambda q, kk, v: sparse_attention(  # noqa: E731
            q, kk, v, idx, scale=dqk ** -0.5, impl=impl, **({"interpret": ctx.interpret} if impl == "pallas" else {})))
        rows += _against_reference(ctx, {"shape": f"T{t} H{h} D{dqk} K{k} (sparse attention)"},
                                    {"pallas": run("pallas"), "reference": run("reference")}, (q, kk, v), ct)
    index_shapes = [(1, 40, 2, 16, 40)] if ctx.args.cpu_smoke else [(1, 256, 64, 128, 32768)]
    for b, tq, hi, di, s in index_shapes:
        rng = np.random.default_rng(1)
        q = jnp.asarray(rng.normal(size=(b, tq, hi, di)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(b, tq, hi)), jnp.float32)
        keys = jnp.asarray(rng.normal(size=(b, s, di)), jnp.bfloat16)
        row = {"shape": f"Tq{tq} Hi{hi} Di{di} S{s} (indexer scores)"}
        want = None
        for impl in ("pallas", "reference"):
            r = {**row, "impl": impl}
            if ctx.time_left() < 20:
                rows.append({**r, "status": "skipped (budget)"})
                continue
            try:
                fn = jax.jit(lambda q, w, keys, impl=impl: lightning_indexer_scores(
                    q, w, keys, scale=di ** -0.5, impl=impl,
                    **({"interpret": ctx.interpret} if impl == "pallas" else {})))
                out = jax.block_until_ready(fn(q, w, keys))
                if impl == "pallas":
                    want = out
                rows.append({**r, "status": "ok", **time_fn(fn, q, w, keys, runs=ctx.args.runs),
                             "max_err_vs_reference": None if impl == "pallas" else _max_err(want, out)})
            except Exception:
                rows.append(error_row(**r))
    return rows


@register_check("grouped_matmul")
def check_grouped_matmul(ctx: Context) -> list[dict]:
    """The dropless experts' grouped matmul, forward + both backward products: the Pallas kernel
    (``moefast.kernels.grouped_matmul`` ``pallas``) against ``jax.lax.ragged_dot`` (dense one-hot
    work on XLA:GPU 0.10.2) and the dense reference, random expert loads (some experts empty)."""
    from moefast.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

    shapes = [(64, 4, 32, 48)] if ctx.args.cpu_smoke else [(4096, 8, 1024, 5120), (32768, 8, 1024, 5120),
                                                           (16384, 64, 2048, 1408)]
    impls = {"pallas": lambda x, w, gs: grouped_matmul(x, w, gs, impl="pallas"),
             "ragged_dot": lambda x, w, gs: grouped_matmul(x, w, gs, impl="ragged_dot"),
             "reference": grouped_matmul_reference}
    return _grouped_rows(ctx, shapes, impls)


def _grouped_rows(ctx: Context, shapes, impls: dict) -> list[dict]:
    """:func:`_against_reference` rows of grouped GEMMs ``impls`` (name -> fn(x, w, group_sizes)) for
    each (rows, groups, in, out) of ``shapes``: random loads (some groups empty), bf16 inputs, the
    TFLOP/s of the real rows' forward, dx and dw."""
    import jax.numpy as jnp
    import numpy as np

    rows = []
    for n, e, i, o in shapes:
        rng = np.random.default_rng(0)
        sizes = rng.multinomial(n, rng.dirichlet(np.full(e, 0.5))).astype(np.int32)
        x = jnp.asarray(rng.normal(size=(n, i)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(e, i, o)) / np.sqrt(i), jnp.bfloat16)
        ct = jnp.asarray(rng.normal(size=(n, o)), jnp.float32)
        row = {"shape": f"N{n} E{e} I{i} O{o}", "empty_experts": int(np.sum(sizes == 0)),
               "exact_gflop": 3 * 2 * n * i * o / 1e9}  # forward, dx and dw of the routed rows
        for r in _against_reference(ctx, row, impls, (x, w, jnp.asarray(sizes)), ct):
            rows.append({**r, "tflops_exact": r["exact_gflop"] / r["median_ms"]} if "median_ms" in r else r)
    return rows


@register_check("fp8_gemm")
def check_fp8_gemm(ctx: Context) -> list[dict]:
    """``model.precision=fp8``'s GEMMs, forward + both backward products: the Triton FP8 kernels
    (``moefast.kernels.fp8_matmul`` through ``moefast.parallel.fp8_gemm``, e4m3 with 1 x 128 / 128 x
    128 scales, each operand quantized once by the one-pass kernels) against the bf16 grouped GEMM
    and XLA's own bf16 GEMM (the reference; the error is e4m3's: a few % of the largest value),
    side by side; each row's share of its dtype's dense peak (``of_peak``: FP8 at twice the bf16
    peak) is the measured counterpart of the replay's assumed
    ``moefast.bench.kernel_costs.GEMM_KERNEL_UTILIZATION`` (the same share for both dtypes). Then
    the one-pass quantizer's bytes per second against the copy bandwidth (``bandwidth`` check)
    and the target's memory bandwidth, the measured counterpart of
    ``MEMORY_KERNEL_UTILIZATION``."""
    import jax
    import jax.numpy as jnp

    from moefast.bench.kernel_costs import FP8_OVER_BF16
    from moefast.kernels import fp8_matmul
    from moefast.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
    from moefast.parallel.fp8_gemm import fp8_grouped_matmul
    from moefast.train.mfu import peak_flops

    shapes = [(256, 4, 128, 256)] if ctx.args.cpu_smoke else [(16384, 1, 7168, 2048), (32768, 8, 2048, 1408),
                                                            (16384, 64, 2048, 1408)]
    impls = {"fp8": lambda x, w, gs: fp8_grouped_matmul(x, w, gs, impl="pallas"),
             "bf16_pallas": lambda x, w, gs: grouped_matmul(x, w, gs, impl="pallas"),
             "reference": grouped_matmul_reference}
    rows = _grouped_rows(ctx, shapes, impls)
    peak = peak_flops(jax.devices()[:1]).per_device_tflops
    for r in rows:
        if peak and r.get("tflops_exact"):
            r["of_peak"] = r["tflops_exact"] / (peak * (FP8_OVER_BF16 if r["impl"] == "fp8" else 1.0))
    if ctx.args.cpu_smoke or fp8_matmul.available() is not None or ctx.time_left() < 20:
        return rows
    x = jax.random.normal(jax.random.key(0), (16384, 7168), jnp.bfloat16)
    quantize = jax.jit(lambda a: fp8_matmul.quantize(a, rows=True, cols=True))
    t = time_fn(quantize, x, runs=ctx.args.runs)
    moved = x.size * (2 + 1 + 1) + 2 * 4 * x.size // 128  # bf16 in; e4m3 rows and columns, their scales out
    gbs = moved / (t["median_ms"] * 1e-3) / 1e9
    rows.append({"shape": "quantize [16384, 7168] bf16, rows + columns", "impl": "fp8_quantize", "status": "ok", **t,
                 "GBs": gbs, "of_copy_bandwidth": gbs / ctx.shared["bandwidth_gbs"]
                 if ctx.shared.get("bandwidth_gbs") else None})
    return rows


@register_check("overlap")
def check_overlap(ctx: Context) -> list[dict]:
    """``moefast bench overlap`` (:func:`moefast.bench.overlap.bench_overlap`) on an expert axis over
    every GPU (needs 2+): the train step for ``moe.overlap_chunks`` 1, 2, 4 in alternating timed
    steps, and the compiled program's all-to-alls (how many, whether asynchronous with compute
    scheduled between start and done). Leaves the reserves of memory and train_step."""
    import jax
    from moefast.bench.overlap import CHUNKS, bench_overlap

    n_dev = len(jax.devices())
    if n_dev < 2:
        return [{"chunks": "-", "status": f"skipped (an expert axis needs 2+ devices; this machine has {n_dev})"}]
    smoke = ctx.args.cpu_smoke
    min_s = 10.0 if smoke else 90.0  # three compiles of the 4-layer model and the alternating steps
    if ctx.time_left() < min_s:
        return [{"chunks": "-", "status": f"skipped (budget: {ctx.time_left():.0f} s left, needs ~{min_s:.0f} s)"}]
    experts = 4 if smoke else 16  # moe.num_experts of TRAIN_STEP_SMOKE / OVERLAP_GPU
    ep = max(d for d in (2, 4, 8, 16) if d <= n_dev and n_dev % d == 0 and experts % d == 0)
    overrides = [*(TRAIN_STEP_SMOKE if smoke else OVERLAP_GPU), f"mesh.expert={ep}", f"mesh.data={n_dev // ep}",
                 f"data.batch_size={2 * n_dev}", "cache.compile_dir=null"]
    r = bench_overlap(None, overrides, steps=ctx.args.train_runs, rounds=0)
    return [{"chunks": n, "status": "ok", "mesh": r.mesh, "median_ms": 1e3 * r.step_s[n], "runs": r.steps,
             "x_chunks_1": r.ratio(n), "tokens_per_s": r.tokens_per_step / r.step_s[n], **r.collectives[n]}
            for n in CHUNKS]


@register_check("memory")
def check_memory(ctx: Context) -> list[dict]:
    """``moefast bench memory`` (:func:`moefast.bench.memory.bench_memory`) on ``configs/h200_1b.yaml``
    with :data:`TRAIN_GPU_OVERRIDES`: XLA's per-device memory of the compiled train step for each
    ``model.remat`` policy with scanned layers, each timed over interleaved steps (the remat step-time
    cost on the GPU), then unrolled layers without and with full remat (memory only: does remat pay
    off without scan on the GPU's scheduler, as it does not on XLA:CPU's)."""
    from moefast.bench.memory import bench_memory

    smoke = ctx.args.cpu_smoke
    min_s = 5.0 if smoke else 90.0  # the scanned variants' compiles and 3 steps of each
    if ctx.time_left() < min_s:
        return [{"variant": "-", "status": f"skipped (budget: {ctx.time_left():.0f} s left, needs ~{min_s:.0f} s)"}]
    config = None if smoke else os.path.join(REPO, "configs", "h200_1b.yaml")
    base = [*(TRAIN_STEP_SMOKE if smoke else TRAIN_GPU_OVERRIDES), *ctx.args.train_override, "train.grad_accum_steps=1"]
    runs = [(bench_memory(config, [*base, "model.scan_layers=true"], steps=3), "scanned, timed")]
    for policy in ("none", "full"):
        if ctx.time_left() > min_s / 4:
            runs.append((bench_memory(config, [*base, "model.scan_layers=false", f"model.remat={policy}"]), "unrolled"))
    rows = []
    for r, what in runs:
        for x in r.records:
            rows.append({"variant": f"remat={x.remat} scan={'on' if x.scan_layers else 'off'}", "status": "ok",
                         "what": what, "temp_GiB": None if x.temp_bytes is None else x.temp_bytes / 2**30,
                         "total_GiB": None if x.total_bytes is None else x.total_bytes / 2**30,
                         "param_GiB": x.param_bytes / 2**30, "optimizer_GiB": x.optimizer_bytes / 2**30,
                         "compile_s": x.compile_s, "step_ms": x.step_ms, "tokens_per_s": x.tokens_per_s})
    return rows


@register_check("train_step")
def check_train_step(ctx: Context) -> list[dict]:
    """``moefast bench train --ablate`` (:func:`moefast.bench.train.bench_train`) on
    ``configs/h200_1b.yaml`` with :data:`TRAIN_GPU_OVERRIDES`: tokens/s, step time, MFU (peak from
    moefast's accelerator table unless ``--peak-tflops``), memory and compile time of the baseline,
    each lever alone and all levers, on the machine's devices (data-parallel)."""
    from moefast.bench.train import bench_train

    smoke = ctx.args.cpu_smoke
    min_s = 5.0 if smoke else 150.0  # five compiles of the GPU config and the rounds
    if ctx.time_left() < min_s:
        return [{"variant": "-", "status": f"skipped (budget: {ctx.time_left():.0f} s left, needs ~{min_s:.0f} s)"}]
    config = None if smoke else os.path.join(REPO, "configs", "h200_1b.yaml")
    overrides = [*(TRAIN_STEP_SMOKE if smoke else TRAIN_GPU_OVERRIDES), *ctx.args.train_override,
                 *([f"train.peak_tflops={ctx.args.peak_tflops}"] if ctx.args.peak_tflops else [])]
    r = bench_train(config, overrides, steps=ctx.args.train_runs, rounds=2, ablate=True)
    base, every = r.records[0].tokens_per_s, r.records[-1].tokens_per_s
    ctx.shared["train_step_ms"] = r.records[-1].step_ms  # all levers: the config as it trains (estimate check)
    rows = [{"variant": "config", "status": "ok", "config": r.config, "overrides": " ".join(overrides),
             "tokens_per_step": r.tokens_per_step, "model_flops_per_token": r.model_flops_per_token,
             "peak_tflops": r.peak_tflops, "peak_source": r.peak_source, "mesh": r.mesh}]
    for v in r.records:
        rows.append({"variant": v.name, "status": "ok", "tokens_per_s": v.tokens_per_s, "step_ms": v.step_ms,
                     "step_ms_p10": v.step_ms_p10, "step_ms_p90": v.step_ms_p90, "mfu": v.mfu,
                     "x_baseline": v.tokens_per_s / base, "x_all_levers": v.tokens_per_s / every,
                     "memory_GiB": None if v.memory_bytes is None else v.memory_bytes / 2**30,
                     "compile_s": v.compile_s, "settings": " ".join(v.settings)})
    return rows


@register_check("estimate")
def check_estimate(ctx: Context) -> list[dict]:
    """Calibration of ``moefast bench gpu-compile``'s estimate: the same step as ``train_step``'s
    "all levers" row (``configs/h200_1b.yaml`` with :data:`TRAIN_GPU_OVERRIDES`, one GPU) compiled
    for a compile-only copy of this GPU (the target description and autotuning results the
    ``target`` check saved) in a subprocess, its estimated step (XLA's speed-of-light estimator,
    costing twin) and its replay with the fused attention kernels costed from their FLOPs next to
    the step measured by ``train_step``, and their ratios (which calibrate the kernels' assumed
    utilization)."""
    import subprocess
    import tempfile

    if ctx.args.cpu_smoke:
        return [{"status": "skipped (CPU: nothing measured to calibrate against)"}]
    measured = ctx.shared.get("train_step_ms")
    out = os.path.splitext(os.path.abspath(ctx.args.out))[0] + "_xla"
    target, autotune = os.path.join(out, "gpu_target_config.txtpb"), os.path.join(out, "autotune_results.txtpb")
    if measured is None or not os.path.isfile(target):
        return [{"status": "skipped (needs the train_step and target checks' results)"}]
    if ctx.time_left() < 90:
        return [{"status": f"skipped (budget: {ctx.time_left():.0f} s left, needs ~90 s)"}]
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "estimate.json")
        cmd = [sys.executable, "-m", "moefast", "bench", "gpu-compile", "--config",
               os.path.join(REPO, "configs", "h200_1b.yaml"), "--gpu", target, "--devices", "1", "--json", js,
               *(["--autotune", autotune] if os.path.isfile(autotune) else []), *TRAIN_GPU_OVERRIDES,
               *ctx.args.train_override]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, int(ctx.time_left())))
        if proc.returncode != 0 or not os.path.isfile(js):
            return [error_row(status="error", stderr=proc.stderr[-2000:])]
        with open(js) as f:
            est = json.load(f)["estimate"] or {}
    step = est.get("step")
    if not step or est.get("unit") != "µs":
        return [{"status": "error", "why": f"no estimate in microseconds ({est.get('unit')})"}]
    row = {"status": "ok", "estimated_step_ms": step / 1e3, "measured_step_ms": measured,
           "measured_over_estimate": measured / (step / 1e3), "estimated_exposed": est["exposed"] / step}
    recosted = (est.get("recosted") or {}).get("step")
    if recosted:  # the replay's fused attention kernels at moefast.bench.kernel_costs.ATTENTION_KERNEL_UTILIZATION
        row.update(recosted_step_ms=recosted / 1e3, measured_over_recosted=measured / (recosted / 1e3))
    return [row]


# --- Driver -----------------------------------------------------------------------------------------

def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols and c != "warnings"]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v).replace("|", "/")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="gpu_check.json", help="JSON results path")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU in the Pallas interpreter (checks the script, times nothing useful)")
    p.add_argument("--budget-s", type=float, default=440.0,
                   help="seconds after which remaining work is skipped (the whole run must stay under 8 min)")
    p.add_argument("--shapes", default="16384x64x2,65536x256x8", help="timed shapes TxExK")
    p.add_argument("--check-shapes", default="1x8x1,4099x7x2,16384x64x2,65536x256x8,4096x1024x8",
                   help="correctness shapes TxExK")
    p.add_argument("--impls", default="reference,pallas,triton",
                   help="route impls to time (triton: skipped where jax-triton or a GPU is missing)")
    p.add_argument("--policies", default="position,priority", help="policies to time")
    p.add_argument("--dtype", default="float32", help="logits dtype")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--block-tokens", default="16,32,64,128", help="kernel block sizes to sweep")
    p.add_argument("--num-warps", default="4,8", help="Triton warps to sweep")
    p.add_argument("--rank-methods", default="cumsum,matmul", help="kernel within-block rank methods to sweep")
    p.add_argument("--runs", type=int, default=20, help="timed runs per measurement (median)")
    p.add_argument("--copy-mib", type=float, default=2048, help="size of the bandwidth copy, MiB")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="train_step: device peak for MFU, TFLOP/s (default: moefast's table, 989.4 for an H200)")
    p.add_argument("--train-runs", type=int, default=10,
                   help="train_step: timed steps per variant and round; overlap: timed steps per variant")
    p.add_argument("--train-override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="train_step: a moefast config override on top of the built-in config (repeatable)")
    p.add_argument("--train-reserve-s", type=float, default=240.0,
                   help="seconds of --budget-s kept for train_step: the checks before it see an earlier deadline")
    p.add_argument("--memory-reserve-s", type=float, default=100.0,
                   help="seconds of --budget-s kept for memory (before train_step's reserve)")
    p.add_argument("--only", default="", help="comma-separated subset of checks to run, of: "
                   + ", ".join(name for name, _ in CHECKS))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = sorted({c for c in args.only.split(",") if c} - {name for name, _ in CHECKS})
    if unknown:
        parser.error(f"--only: no check named {', '.join(unknown)}; the checks: {', '.join(n for n, _ in CHECKS)}")
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        # 8 virtual devices, so the overlap check has an expert axis (the others use one device)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        args.shapes, args.check_shapes = "256x8x2,130x64x4", "13x7x2,64x8x2"
        args.block_tokens, args.num_warps, args.runs, args.copy_mib = "32,128", "4", 3, 64
        args.train_runs = min(args.train_runs, 3)
    # needs moefast installed (pip install -e .): the kernels are imported as moefast.kernels
    from moefast.parallel import xla_flags

    flags = xla_flags.configure(True)  # the GPU collective-overlap flags, before JAX starts (as moefast train)
    import jax

    if not args.cpu_smoke and jax.default_backend() != "gpu":
        print(f"gpu_check: the default backend is {jax.default_backend()!r}, not a GPU; "
              "use --cpu-smoke to check the script on CPU", file=sys.stderr)
        return 2
    start = time.monotonic()
    ctx = Context(args=args, deadline=start + args.budget_s, interpret=args.cpu_smoke)
    env = {"jax": jax.__version__, "backend": jax.default_backend(), "xla_flags_added": flags,
           "devices": [d.device_kind for d in jax.devices()], "python": platform.python_version(),
           "argv": sys.argv[1:], "cpu_smoke": args.cpu_smoke}
    print(f"# gpu_check\n\n{json.dumps(env)}\n")
    only = {c for c in args.only.split(",") if c}
    # each check's deadline leaves the reserves of the checks after it (memory, then train_step: last)
    reserves = {"memory": 5.0 if args.cpu_smoke else args.memory_reserve_s, "train_step": args.train_reserve_s}
    chosen = [name for name, _ in CHECKS if not only or name in only]
    results: dict[str, Any] = {"env": env, "checks": {}}
    for name, fn in CHECKS:
        if only and name not in only:
            continue
        later = chosen[chosen.index(name) + 1:]
        ctx.deadline = start + args.budget_s - sum(reserves.get(n, 0.0) for n in later)
        t0 = time.monotonic()
        try:
            rows = fn(ctx)
        except Exception:
            rows = [error_row(check=name, traceback=traceback.format_exc()[-2000:])]
        results["checks"][name] = {"seconds": time.monotonic() - t0, "rows": rows}
        print(f"## {name} ({time.monotonic() - t0:.1f} s)\n\n{markdown_table(rows)}\n", flush=True)
        for r in rows:
            for w in r.get("warnings", []):
                print(f"warning: {w}")
    results["total_seconds"] = time.monotonic() - start
    results["shared"] = ctx.shared
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    failed = [n for n, c in results["checks"].items()
              if any(r.get("status") in ("error", "MISMATCH") for r in c["rows"])]
    print(f"total {results['total_seconds']:.1f} s; wrote {args.out}; "
          f"{'problems in: ' + ', '.join(failed) if failed else 'no errors or mismatches'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
