"""``moefast bench linear-attention``: the gated delta rule's forward + backward compiled for one
GPU (compile-only, no GPU needed), the Pallas kernels against the chunked form in XLA ops.

Dimension letters: T tokens, H heads, K key width, V value width, C tokens per chunk.

For each decay (``head``: Gated DeltaNet's g [B, T, H]; ``channel``: KDA's g [B, T, H, K]), each
implementation (``pallas``, ``chunked``) and each row length, ``jax.value_and_grad`` of a
weighted sum of the outputs with respect to q, k, v, g and beta is compiled for one ``--gpu``
and read: XLA's temporaries (``memory_analysis``), XLA's FLOP count (which counts no FLOPs inside
a Pallas kernel: a custom call), the analytical FLOPs MFU counts (:func:`chunked_flops`), the kernels in the program and what is left of the chunked form's XLA
ops (while loops over chunks). The shapes are Qwen3.5-35B-A3B's and Kimi Linear's linear layers
(32 heads, K = V = 128) on one row, bfloat16 inputs, chunks of 64 tokens for both forms.

``mamba2``: Mamba-2's SSD scan (:func:`moefast.kernels.mamba2.ssd`) with respect to x, dt, B and
C at Nemotron 3 Nano's shapes (64 heads of P = 64, B and C in 8 groups of N = 128; the record's
``heads``, ``value_dim`` and ``key_dim``), the Pallas kernels in chunks of 64 against the chunked
form in chunks of 128; its analytical FLOPs are :mod:`moefast.model.flops`' Mamba-2 count. These
are compiled figures; times need a GPU (``scripts/gpu_check.py``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

__all__ = ["LinearAttentionRecord", "bench_linear_attention", "chunked_flops", "compile_and_read", "format_table",
           "kernel_list", "report", "run_cli"]

TOKENS = (4096, 16384, 65536)
QUICK_TOKENS = (4096,)
HEADS, KEY_DIM, VALUE_DIM, CHUNK = 32, 128, 128, 64
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_GROUPS, MAMBA_STATE = 64, 64, 8, 128  # Nemotron 3 Nano


@dataclasses.dataclass
class LinearAttentionRecord:
    decay: str  # "head" (Gated DeltaNet), "channel" (KDA) or "mamba2" (Mamba-2's SSD scan)
    impl: str  # "pallas" or "chunked"
    tokens: int
    heads: int
    key_dim: int
    value_dim: int
    chunk_size: int
    compile_s: float
    temp_bytes: int  # XLA's temporaries of the compiled forward + backward
    xla_flops: float | None  # XLA's count (custom calls, i.e. the Pallas kernels, count nothing)
    model_flops: float  # chunked_flops: forward + backward, moefast.model.flops' count
    kernels: dict[str, int]  # Pallas kernels in the program, by name
    while_loops: int  # XLA while loops left (the chunked form's scan over chunks)


def chunked_flops(tokens: int, kind: str = "head") -> float:
    """Forward + backward FLOPs of the chunked gated delta rule (or, ``kind="mamba2"``, the SSD
    scan) at this bench's shapes: :mod:`moefast.model.flops`' count per token (the one MFU uses;
    chunks of its ``DELTA_RULE_CHUNK``, or 128), times ``tokens``, times 3 (the backward as twice
    the forward)."""
    from moefast.config import ModelConfig
    from moefast.model.flops import _delta_rule_flops

    if kind == "mamba2":
        m = ModelConfig(num_layers=1, layer_types=("linear_attention",), linear_attention_kind="mamba2",
                        linear_num_key_heads=MAMBA_GROUPS, linear_num_value_heads=MAMBA_HEADS,
                        linear_key_head_dim=MAMBA_STATE, linear_value_head_dim=MAMBA_HEAD_DIM)
    else:
        m = ModelConfig(num_layers=1, layer_types=("linear_attention",), linear_num_key_heads=HEADS,
                        linear_num_value_heads=HEADS, linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM)
    return 3.0 * tokens * _delta_rule_flops(m)


def compile_and_read(fn, args) -> dict:
    """``jax.jit(fn)`` lowered for ``args`` (ShapeDtypeStructs on compile-only devices) and
    compiled: ``compile_s``, XLA's ``temp_bytes``, ``xla_flops`` (None when XLA gives none), the
    Pallas ``kernels`` by name and the ``while_loops`` left in the program."""
    import jax

    from moefast.bench.gpu_compile import _custom_calls, _flops

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    kernels = {k.removeprefix("kernel "): v for k, v in _custom_calls(text).items() if k.startswith("kernel ")}
    return dict(compile_s=compile_s, temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                xla_flops=_flops(compiled), kernels=kernels, while_loops=len(re.findall(r"\bwhile\(", text)))


def _record(fn, args, decay: str, impl: str, tokens: int) -> LinearAttentionRecord:
    mamba = decay == "mamba2"
    return LinearAttentionRecord(decay=decay, impl=impl, tokens=tokens, heads=MAMBA_HEADS if mamba else HEADS,
                                 key_dim=MAMBA_STATE if mamba else KEY_DIM,
                                 value_dim=MAMBA_HEAD_DIM if mamba else VALUE_DIM,
                                 chunk_size=(64 if impl == "pallas" else 128) if mamba else CHUNK,
                                 model_flops=chunked_flops(tokens, decay), **compile_and_read(fn, args))


def bench_linear_attention(gpu: str = "h100", tokens=TOKENS, decays=("head", "channel", "mamba2"),
                           impls=("pallas", "chunked"),
                           log=print) -> list[LinearAttentionRecord]:
    """Compiles and reads every (decay, impl, tokens) case (module docstring) for one ``gpu``
    (a key of :data:`moefast.bench.gpu_compile.GPUS`). Needs :func:`~moefast.bench.gpu_compile.prepare_process`
    first (the CLI calls it).

    Raises:
      RuntimeError: the CUDA PJRT plugin is missing (:func:`~moefast.bench.gpu_compile.compile_only_devices`).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from moefast.bench.gpu_compile import compile_only_devices
    from moefast.kernels.gated_delta_rule import gated_delta_rule
    from moefast.kernels.mamba2 import ssd

    mesh = jax.sharding.Mesh(np.array(compile_only_devices(gpu, 1, 1)), ("data",))
    whole = NamedSharding(mesh, P())
    records = []
    for decay in decays:
        for t in tokens:
            if decay == "mamba2":
                records += _mamba2_records(t, impls, whole, mesh, gpu, ssd, log)
                continue
            shapes = {"q": ((1, t, HEADS, KEY_DIM), jnp.bfloat16), "k": ((1, t, HEADS, KEY_DIM), jnp.bfloat16),
                      "v": ((1, t, HEADS, VALUE_DIM), jnp.bfloat16),
                      "g": ((1, t, HEADS) + ((KEY_DIM,) if decay == "channel" else ()), jnp.float32),
                      "beta": ((1, t, HEADS), jnp.float32), "w": ((1, t, HEADS, VALUE_DIM), jnp.float32)}
            args = [jax.ShapeDtypeStruct(s, d, sharding=whole) for s, d in shapes.values()]
            for impl in impls:
                def loss(q, k, v, g, beta, w, impl=impl):
                    o, _ = gated_delta_rule(q, k, v, g, beta, impl=impl, chunk_size=CHUNK,
                                            **({"interpret": False} if impl == "pallas" else {}))
                    return jnp.sum(o.astype(jnp.float32) * w)

                fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
                log(f"compiling {impl} ({decay} decay) at {t:,} tokens for {gpu} ...")
                with jax.set_mesh(mesh):
                    records.append(_record(fn, args, decay, impl, t))
    return records


def _mamba2_records(t: int, impls, whole, mesh, gpu: str, ssd, log) -> list[LinearAttentionRecord]:
    """The SSD scan's cases at ``t`` tokens (module docstring)."""
    import jax
    import jax.numpy as jnp

    h, p, g, n = MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_GROUPS, MAMBA_STATE
    shapes = [((1, t, h, p), jnp.bfloat16), ((1, t, h), jnp.float32), ((1, t, g, n), jnp.bfloat16),
              ((1, t, g, n), jnp.bfloat16), ((1, t, h, p), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=whole) for s, d in shapes]
    a = -jnp.arange(1, h + 1, dtype=jnp.float32)
    records = []
    for impl in impls:
        def loss(x, dt, b, c, w, impl=impl):
            y, _ = ssd(x, dt, a, b, c, impl=impl, chunk_size=64 if impl == "pallas" else 128,
                       **({"interpret": False} if impl == "pallas" else {}))
            return jnp.sum(y.astype(jnp.float32) * w)

        log(f"compiling {impl} (Mamba-2 SSD) at {t:,} tokens for {gpu} ...")
        with jax.set_mesh(mesh):
            records.append(_record(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), args, "mamba2", impl, t))
    return records


def format_table(records: list[LinearAttentionRecord], gpu: str) -> str:
    """Markdown: a row per case, the chunked form's temporaries beside each Pallas row."""
    base = {(r.decay, r.tokens): r for r in records if r.impl == "chunked"}
    lines = [f"Gated delta rule forward + backward compiled for one {gpu} (compile-only; B = 1, H = {HEADS}, "
             f"K = V = {KEY_DIM}, C = {CHUNK}, bfloat16 inputs; mamba2: the SSD scan, H = {MAMBA_HEADS} of "
             f"P = {MAMBA_HEAD_DIM}, {MAMBA_GROUPS} groups of N = {MAMBA_STATE}, C = 64 Pallas / 128 chunked)", "",
             "| decay | impl | tokens | temporaries (MiB) | vs chunked | XLA GFLOP (Pallas kernels count 0) | "
             "analytical GFLOP (moefast.model.flops, fwd + bwd) | kernels | while loops |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in records:
        ref = base.get((r.decay, r.tokens))
        ratio = f"{r.temp_bytes / ref.temp_bytes:.2f}x" if ref and ref.temp_bytes else "—"
        flops = "n/a" if r.xla_flops is None else f"{r.xla_flops / 1e9:,.1f}"
        lines.append(f"| {r.decay} | {r.impl} | {r.tokens:,} | {r.temp_bytes / 2**20:,.1f} | {ratio} | {flops} | "
                     f"{r.model_flops / 1e9:,.1f} | {kernel_list(r.kernels)} | {r.while_loops} |")
    return "\n".join(lines)


def kernel_list(kernels: dict[str, int]) -> str:
    """Markdown: the Pallas kernels of a program by name and count, or a dash."""
    return ", ".join(f"`{k}` x{v}" for k, v in sorted(kernels.items())) or "—"


def run_cli(*, gpu: str, quick: bool, json_out: str | None) -> int:
    """``moefast bench linear-attention``: prints the table; with ``json_out`` writes the records
    and the table (``.md`` beside). Returns 0."""
    records = bench_linear_attention(gpu, QUICK_TOKENS if quick else TOKENS)
    return report(records, format_table(records, gpu), json_out)


def report(records: list, table: str, json_out: str | None) -> int:
    """Prints ``table``; with ``json_out`` writes the records (dataclasses) there and the table
    beside it (``.md``). Returns 0."""
    print(table)
    if json_out:
        with open(json_out, "w") as f:
            json.dump([dataclasses.asdict(r) for r in records], f, indent=1)
        with open(re.sub(r"\.json$", "", json_out) + ".md", "w") as f:
            f.write(table + "\n")
    return 0
