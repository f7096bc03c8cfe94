"""Model FLOPs utilisation: achieved model FLOP/s over the hardware's peak.

``MFU = tokens/s * model_flops_per_token / peak FLOP/s`` (PaLM, Chowdhery et al. 2022, sec. 4.1
and appendix B), with the FLOPs of :func:`moefast.model.flops.model_flops_per_token`.

The peak per device comes from, in order: ``train.peak_tflops``; the table :data:`PEAK_TFLOPS` of
known accelerators (dense bfloat16 tensor-core figures from the vendors' data sheets, whatever
``model.dtype`` is — the convention of PaLM and MaxText); on CPU, a measured estimate
(:func:`cpu_matmul_peak`). On CPU the virtual devices (``--cpu-devices``) share one processor, so
the whole CPU counts as one device.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

__all__ = ["PEAK_TFLOPS", "Peak", "cpu_matmul_peak", "mfu", "peak_flops"]

# (substring of jax's device_kind, dense bf16 TFLOP/s per chip, source). First match wins, so the
# more specific names come first. NVIDIA's data sheets quote bf16 "with sparsity": dense is half.
PEAK_TFLOPS: tuple[tuple[str, float, str], ...] = (
    ("H200 NVL", 835.5, "NVIDIA H200 NVL data sheet (1,671 TFLOPS bf16 with sparsity)"),
    ("H200", 989.4, "NVIDIA H200 SXM data sheet (1,979 TFLOPS bf16 with sparsity)"),
    ("H100 NVL", 835.5, "NVIDIA H100 NVL data sheet (1,671 TFLOPS bf16 with sparsity)"),
    ("H100 PCIe", 756.0, "NVIDIA H100 PCIe data sheet (1,513 TFLOPS bf16 with sparsity)"),
    ("H100", 989.4, "NVIDIA H100 SXM data sheet (1,979 TFLOPS bf16 with sparsity)"),
    ("A100", 312.0, "NVIDIA A100 data sheet (312 TFLOPS bf16 dense)"),
    ("TPU v6 lite", 918.0, "Google Cloud TPU v6e (Trillium) documentation (918 TFLOPS bf16)"),
    ("TPU v5 lite", 197.0, "Google Cloud TPU v5e documentation (197 TFLOPS bf16)"),
    ("TPU v5", 459.0, "Google Cloud TPU v5p documentation (459 TFLOPS bf16)"),
    ("TPU v4", 275.0, "Google Cloud TPU v4 documentation (275 TFLOPS bf16)"),
)

PROBE_SIZE = 1024  # the CPU probe multiplies two [N, N] float32 matrices (2 N^3 FLOPs)
PROBE_RUNS = 10


class Peak(NamedTuple):
    """Peak FLOP/s of the devices a run uses."""

    flops_per_s: float | None  # all devices together; None: unknown (no MFU is reported)
    per_device_tflops: float | None
    devices: int  # devices counted (1 on CPU, whatever the virtual device count)
    source: str  # where the figure comes from, for the log


@functools.cache
def cpu_matmul_peak() -> float:
    """Estimated peak FLOP/s of this CPU: the best of :data:`PROBE_RUNS` timed float32
    [1024, 1024] x [1024, 1024] matmuls compiled by XLA on this process's first CPU device (after one untimed
    run), measured once per process. An estimate: it is what
    XLA's matmul reaches on a large square product, not the vendor's peak; on a machine that other
    work keeps busy it is too low (half, with one of two cores taken), and the MFU against it too
    high, even above 1."""
    import jax
    import numpy as np

    dev = jax.local_devices(backend="cpu")[0]  # this process's own: never a peer's device
    a = jax.device_put(np.random.default_rng(0).standard_normal((PROBE_SIZE, PROBE_SIZE), np.float32), dev)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(PROBE_RUNS):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * PROBE_SIZE**3 / best


def peak_flops(devices, override_tflops: float | None = None) -> Peak:
    """Peak FLOP/s of ``devices`` (see the module docstring for the order of sources).

    Args:
      devices: the run's devices (``jax.Device`` list, all of one kind).
      override_tflops: ``train.peak_tflops``: TFLOP/s of one device (of the whole CPU on CPU).
    """
    devices = list(devices)
    d0 = devices[0]
    n = 1 if d0.platform == "cpu" else len(devices)
    if override_tflops is not None:
        return Peak(override_tflops * 1e12 * n, override_tflops, n, "train.peak_tflops")
    kind = getattr(d0, "device_kind", "") or ""
    for key, tflops, source in PEAK_TFLOPS:
        if key.lower() in kind.lower():
            return Peak(tflops * 1e12 * n, tflops, n, f"{kind}: {source}")
    if d0.platform == "cpu":
        est = cpu_matmul_peak()
        return Peak(est, est / 1e12, 1, f"CPU estimate: best float32 {PROBE_SIZE}x{PROBE_SIZE} matmul measured "
                                        "at start (all cores; virtual devices share them)")
    return Peak(None, None, n, f"unknown device kind {kind!r}: set train.peak_tflops (TFLOP/s per device) for MFU")


def mfu(tokens_per_s: float | None, flops_per_token: float, peak: Peak) -> float | None:
    """Model FLOPs utilisation, a fraction (``None`` when the rate or the peak is unknown). Above 1
    means the peak is underestimated: a CPU probe taken while the machine was busy, or a wrong
    ``train.peak_tflops``."""
    if tokens_per_s is None or not peak.flops_per_s:
        return None
    return tokens_per_s * flops_per_token / peak.flops_per_s
