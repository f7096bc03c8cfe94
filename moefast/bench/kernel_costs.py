"""The replay's costs for moefast's own kernels, which XLA's GPU latency estimator charges a flat
10 µs a launch whatever their work (:mod:`moefast.bench.gpu_schedule` replays XLA's schedule with
these times): one rule for both precisions -- the fused attention kernels and the GEMM kernels
(bf16 and FP8) from their FLOPs at a stated share of their dtype's dense peak, the FP8 quantizers
from their bytes at a stated share of the memory bandwidth -- and what of a step is FP8
quantization. Each share is an assumption until ``scripts/gpu_check.py`` measures it.
"""

from __future__ import annotations

import re

__all__ = ["ATTENTION_KERNEL_UTILIZATION", "FP8_OVER_BF16", "GEMM_KERNEL_UTILIZATION", "MEMORY_KERNEL_UTILIZATION",
           "attention_kernel_flops", "check_gemm_utilization", "fp8_kernel_flops", "gemm_kernel_peak", "kernel_times",
           "quantization_times", "quantize_kernel_bytes"]

# The fused attention kernels' share of the GPU's dense bf16 peak where the replay costs them:
# FlashAttention-2 reaches 35 % on an H100 (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608,
# abstract); XLA's estimator charges any custom call a flat 10 µs whatever its work.
ATTENTION_KERNEL_UTILIZATION = 0.35
# Matmuls per (query, key) pair a launch of moefast's flash kernels computes (kernels/attention/
# flash.py), as (of the query/key width, of the value width): the forward S = QK^T and PV; the
# key/value kernel recomputes S, then dP = dO V^T, dV += P^T dO and dK += dS^T Q; the query kernel
# recomputes S and dP, then dQ += dS K (FlashAttention-2's backward, Dao 2023, arXiv 2307.08691,
# Algorithm 2, split into two kernels: 7 matmuls where the fused one does 5)
_ATTENTION_MATMULS = {"forward": (1, 1), "dkdv": (2, 2), "dq": (2, 1)}


# moefast's GEMM kernels -- the FP8 ones (kernels/fp8_matmul, through jax-triton) and the bf16
# grouped GEMM (kernels/grouped_matmul, Pallas) -- which XLA charges a flat 10 µs a launch, are
# costed in the replay by one rule: their FLOPs at this share of the dense peak of their inputs'
# dtype (bf16: the GPU's peak; e4m3: FP8_OVER_BF16 x it, H100 SXM 1,979 vs 989 TFLOP/s), the same
# share for both, while XLA's own GEMMs keep XLA's table in both precisions. An assumption, not a
# measurement: below the 1,550 TFLOP/s (78 % of H800's FP8 peak) DeepGEMM (deepseek-ai/DeepGEMM,
# README) reports for the same 1 x 128 / 128 x 128 scaling, as these kernels have none of its TMA
# loads, warp specialisation or persistent scheduling; scripts/gpu_check.py --only fp8_gemm times
# them on a GPU, bf16 and FP8 side by side.
GEMM_KERNEL_UTILIZATION = 0.5
FP8_OVER_BF16 = 2.0
# moefast's memory-bound kernels (the FP8 one-pass quantizer, moefast_fp8_gemm_quantize) at this share
# of the GPU's memory bandwidth (the target file's memory_bandwidth, which XLA's own roofline for its
# fusions reads): their bytes read and written / (share x bandwidth). Assumed, as above.
MEMORY_KERNEL_UTILIZATION = 0.7
_FP8_KERNEL = re.compile(r"moefast_fp8_gemm_(forward|dgrad|wgrad)")
_GROUPED_KERNEL = re.compile(r"grouped_matmul_(?:dw_)?m\d+")


def _shapes(text: str) -> list[list[int]]:
    return [[int(v) for v in m.split(",") if v] for m in re.findall(r"\w+\[([\d,]*)\]", text)]


def check_gemm_utilization(u: float) -> float:
    """``u`` when it is a share of the peak in (0, 1].

    Raises:
      ValueError: anything else (0, negative, above 1, NaN).
    """
    if not 0 < u <= 1:  # NaN fails too
        raise ValueError(f"--gemm-utilization {u}: the GEMM kernels' share of their dtype's peak, in (0, 1]")
    return u


def fp8_kernel_flops(op_name: str, line: str) -> float:
    """FLOPs of one launch of moefast's GEMM kernels: the FP8 ones (named scope
    ``moefast_fp8_gemm_{forward,dgrad,wgrad}`` in ``op_name``) and the bf16 grouped GEMM (its
    Pallas name ``grouped_matmul_m..`` / ``grouped_matmul_dw_m..`` in ``op_name`` or ``line``),
    ``2 M K N`` from the HLO ``line``: the result [M, N] (weight gradients: [G, K, N]) and the
    operands (``operand_layout_constraints``: A [M, K]; the FP8 wgrad: x transposed [K, M]; the
    grouped dw: x [M, K]). 0 for any other instruction."""
    fp8 = _FP8_KERNEL.search(op_name or "")
    grouped = None if fp8 else _GROUPED_KERNEL.search(op_name or "") or _GROUPED_KERNEL.search(line)
    result = re.search(r"=\s*\w+\[([\d,]+)\]", line)
    ops = re.search(r"operand_layout_constraints=\{(.*?\})\}", line)
    shapes = _shapes(ops.group(1)) if ops else []
    if not ((fp8 or grouped) and result and len(shapes) >= 2):
        return 0.0
    out = [int(v) for v in result.group(1).split(",")]
    if grouped:
        if "_dw_" in grouped.group(0):  # x [M, K] (after the table), dw [G, K, N]
            return 2.0 * shapes[1][0] * out[-2] * out[-1]
        return 2.0 * out[0] * shapes[1][1] * out[-1]  # x [M, K], y [M, N]
    a = shapes[1]
    return 2.0 * a[0] * a[1] * out[-1]


def gemm_kernel_peak(op_name: str, line: str) -> float:
    """The dense peak multiple of a GEMM kernel's inputs' dtype: :data:`FP8_OVER_BF16` for moefast's
    FP8 kernels, 1 for bf16 ones."""
    return FP8_OVER_BF16 if _FP8_KERNEL.search(op_name or "") else 1.0


def quantize_kernel_bytes(op_name: str, line: str) -> float:
    """Bytes one launch of the FP8 one-pass quantizer (``moefast_fp8_gemm_quantize``) reads and
    writes: its operand and every result of its tuple (unused outputs are 1-element). 0 for any
    other instruction."""
    if "moefast_fp8_gemm_quantize" not in (op_name or ""):
        return 0.0
    from moefast.parallel.hlo import shape_bytes

    head, _, rest = line.partition("custom-call(")
    ops = re.search(r"operand_layout_constraints=\{(.*?\})\}", rest)
    result = head.split("=", 1)[-1]
    return float(shape_bytes(result.strip())) + (float(shape_bytes(ops.group(1))) if ops else 0.0)


def attention_kernel_flops(op_name: str, operands: str) -> float:
    """FLOPs of one launch of moefast's fused attention kernels (``kernels/attention``), named in
    ``op_name`` (:func:`moefast.kernels.attention.kernel_name`: kind, blocks, query offset,
    window), from its first three operands: queries [B, T, H, Hd], keys [B, S, G, Hd], values [B,
    S, G, Hv]. The (query, key) pairs its programs' loops visit
    (:func:`moefast.kernels.attention.visited_pairs`: whole blocks, causal, the window's blocks
    only) x ``2 B H`` x each matmul's width, rounded up to a power of two as the blocks run it
    (``_ATTENTION_MATMULS``). 0 for any other instruction.
    """
    from moefast.kernels.attention import KERNEL_NAME, visited_pairs

    m = KERNEL_NAME.search(op_name)
    dims = re.findall(r"\w+\[(\d+),(\d+),(\d+),(\d+)\]", operands)[:3] if m else []
    if len(dims) < 3:
        return 0.0
    kind, bq, bk, offset, window = m.group(1), *(int(v) for v in m.groups()[1:])
    (b, t, h, hd), (_, s, _, _), (_, _, _, hv) = ([int(v) for v in d] for d in dims)
    pow2 = lambda n: 1 << max(0, n - 1).bit_length()  # noqa: E731
    n_d, n_v = _ATTENTION_MATMULS[kind]
    return 2.0 * b * h * visited_pairs(kind, t, s, bq, bk, offset, window) * (n_d * pow2(hd) + n_v * pow2(hv))


def kernel_times(ordered, instrs: dict, raw: dict[str, str], *, peak_tflops: float, hbm_bytes_per_s: float | None,
                 gemm_utilization: float) -> dict[str, float]:
    """µs of each of moefast's kernel launches in a computation's schedule (``ordered``: its
    ``(instruction, start, end)``; ``instrs``: the module's instructions; ``raw``: their HLO lines)
    by the rule above: attention and GEMM kernels from their FLOPs (``peak_tflops``: the GPU's
    dense bf16 peak), the quantizers from their bytes (when ``hbm_bytes_per_s`` is known)."""
    out = {}
    for name, _, _ in ordered:
        ins = instrs.get(name)
        if ins is None or ins.opcode != "custom-call":
            continue
        line = raw.get(name, "")
        f = attention_kernel_flops(ins.op_name, line.split("custom-call(", 1)[-1])
        if f:
            out[name] = f / (ATTENTION_KERNEL_UTILIZATION * peak_tflops * 1e6)
        f8 = fp8_kernel_flops(ins.op_name, line)
        if f8:
            out[name] = f8 / (gemm_utilization * gemm_kernel_peak(ins.op_name, line) * peak_tflops * 1e6)
        qb = quantize_kernel_bytes(ins.op_name, line) if hbm_bytes_per_s else 0.0
        if qb:
            out[name] = qb / (MEMORY_KERNEL_UTILIZATION * hbm_bytes_per_s) * 1e6
    return out


def quantization_times(ordered, instrs: dict, kernel_us: dict[str, float]) -> tuple[float, float]:
    """µs of a computation's schedule in FP8 quantization: (moefast's quantizer kernels, at their
    re-costed times ``kernel_us``; XLA's own passes under :data:`moefast.parallel.fp8.QUANTIZE_SCOPE`,
    at XLA's times)."""
    from moefast.parallel.fp8 import QUANTIZE_SCOPE

    in_kernels = in_xla = 0.0
    for name, start, end in ordered:
        op = getattr(instrs.get(name), "op_name", "") or ""
        if QUANTIZE_SCOPE in op:
            in_xla += end - start
        elif "moefast_fp8_gemm_quantize" in op and name in kernel_us:
            in_kernels += kernel_us[name]
    return in_kernels, in_xla
