"""``moefast bench sparse-attention``: DeepSeek Sparse Attention's top-k kernel against dense causal
flash attention, forward + backward compiled for one GPU (compile-only, no GPU needed).

Dimension letters: T tokens of a row, H heads, K selected keys per query (``index_topk``).

DeepSeek-V3.2's MLA shapes (128 heads; kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
128, v_head_dim 128; index_topk 2,048) on one row of T tokens, bfloat16:

* ``sparse``: :func:`moefast.kernels.sparse_attention.sparse_attention` in MLA's absorbed form,
  every query attending to K = 2,048 keys (q [T, H, 576], one shared key [T, 576] and value
  [T, 512] a token; the indices are an input: the indexer's cost is not in this table);
* ``dense``: :func:`moefast.kernels.attention.flash_attention`, MLA's training path (keys and
  values expanded per head: [T, H, 192] and [T, H, 128]), causal;
* ``indexer``: the selection itself, the model's :meth:`moefast.model.mla.LightningIndexer.top_keys`
  on a training row (64 heads of 128; its projections, the scores by
  :mod:`moefast.kernels.lightning_indexer` 256 queries at a time, the top K), forward only (no
  gradient reaches it; its own KL loss, ``train.indexer_stage``, is not in the table). Its
  analytical FLOPs are the scores' 2·T·T·64·128 (the kernel scores every key of the row, the
  causally masked ones too).

For each, ``jax.value_and_grad`` of the outputs' sum of squares with respect to q, k and v is
compiled and read: XLA's temporaries and the kernels in the program, with the analytical FLOPs of
each form (XLA counts none inside a Pallas kernel): per (query, key) pair 2·H·(Dqk + Dv) forward
and 2·H·(3·Dqk + 2·Dv) backward (the backward recomputes the scores), over T·K pairs (sparse;
fewer where a query sees fewer than K keys: T·K - K(K - 1)/2) or T(T + 1)/2 (dense, causal). These
are compiled figures; times need a GPU.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SparseAttentionRecord", "attention_flops", "bench_sparse_attention", "format_table", "run_cli"]

TOKENS = (4096, 16384, 65536, 131072)
QUICK_TOKENS = (4096,)
HEADS, LATENT, ROPE, NOPE, V_HEAD, TOP_K = 128, 512, 64, 128, 128, 2048
INDEX_HEADS, INDEX_DIM, D_MODEL, Q_LORA = 64, 128, 7168, 1536


@dataclasses.dataclass
class SparseAttentionRecord:
    impl: str  # "sparse", "dense" or "indexer"
    tokens: int
    top_k: int | None
    compile_s: float
    temp_bytes: int
    xla_flops: float | None
    model_flops: float  # attention_flops: forward + backward
    kernels: dict[str, int]
    while_loops: int


def attention_flops(impl: str, tokens: int) -> float:
    """Forward + backward FLOPs of the attention alone at this bench's shapes (module docstring);
    the indexer's forward scores for ``impl="indexer"``."""
    if impl == "indexer":
        return 2.0 * tokens * tokens * INDEX_HEADS * INDEX_DIM
    if impl == "sparse":
        dqk, dv = LATENT + ROPE, LATENT
        k = min(TOP_K, tokens)
        pairs = tokens * k - k * (k - 1) / 2  # query t sees min(t + 1, K) keys
    else:
        dqk, dv = NOPE + ROPE, V_HEAD
        pairs = tokens * (tokens + 1) / 2
    return pairs * 2 * HEADS * ((dqk + dv) + (3 * dqk + 2 * dv))


def bench_sparse_attention(gpu: str = "h100", tokens=TOKENS, log=print) -> list[SparseAttentionRecord]:
    """Compiles and reads both forms at each row length for one ``gpu`` (module docstring).
    Needs :func:`~moefast.bench.gpu_compile.prepare_process` first (the CLI calls it).

    Raises:
      RuntimeError: the CUDA PJRT plugin is missing.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from moefast.bench.gpu_compile import compile_only_devices
    from moefast.bench.linear_attention import compile_and_read
    from flax import nnx

    from moefast.kernels.attention import flash_attention
    from moefast.kernels.sparse_attention import sparse_attention
    from moefast.model.mla import LightningIndexer

    mesh = jax.sharding.Mesh(np.array(compile_only_devices(gpu, 1, 1)), ("data",))
    whole = NamedSharding(mesh, P())
    bf16 = jnp.bfloat16

    def shape(s, dtype=bf16):
        return jax.ShapeDtypeStruct(s, dtype, sharding=whole)

    def squares(out):
        return 0.5 * jnp.sum(jnp.square(out.astype(jnp.float32)))

    indexer = nnx.eval_shape(lambda: LightningIndexer(D_MODEL, Q_LORA, num_heads=INDEX_HEADS, head_dim=INDEX_DIM,
                                                      rope_dim=ROPE, topk=TOP_K, dtype=bf16, init_std=0.02,
                                                      rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(indexer)
    params = jax.tree.map(lambda a: shape(a.shape, a.dtype), params)

    def select(params, x, q_lat, keys, seg):  # the model's selection on a training row (no RoPE: no cost)
        return nnx.merge(graphdef, params).top_keys(x, q_lat, None, keys, seg)

    records = []
    for t in tokens:
        sparse = (lambda q, k, v, idx: squares(sparse_attention(q, k, v, idx, scale=(NOPE + ROPE) ** -0.5,
                                                                 impl="pallas", interpret=False)),
                  (shape((1, t, HEADS, LATENT + ROPE)), shape((1, t, LATENT + ROPE)), shape((1, t, LATENT)),
                   shape((1, t, min(TOP_K, t)), jnp.int32)))
        dense = (lambda q, k, v, seg: squares(flash_attention(q, k, v, seg, interpret=False)),
                 (shape((1, t, HEADS, NOPE + ROPE)), shape((1, t, HEADS, NOPE + ROPE)), shape((1, t, HEADS, V_HEAD)),
                  shape((1, t), jnp.int32)))
        index = (select, (params, shape((1, t, D_MODEL)), shape((1, t, Q_LORA)),
                          shape((1, t, INDEX_DIM), jnp.float32), shape((1, t), jnp.int32)))
        for impl, (fn, args) in (("sparse", sparse), ("dense", dense), ("indexer", index)):
            log(f"compiling {impl} attention at {t:,} tokens for {gpu} ...")
            with jax.set_mesh(mesh):
                read = compile_and_read(fn if impl == "indexer" else jax.value_and_grad(fn, argnums=(0, 1, 2)), args)
            records.append(SparseAttentionRecord(impl=impl, tokens=t, top_k=TOP_K if impl == "sparse" else None,
                                                 model_flops=attention_flops(impl, t), **read))
    return records


def format_table(records: list[SparseAttentionRecord], gpu: str) -> str:
    """Markdown: a row per case, the sparse form against the dense one at the same length."""
    from moefast.bench.linear_attention import kernel_list

    dense = {r.tokens: r for r in records if r.impl == "dense"}
    index = {r.tokens: r for r in records if r.impl == "indexer"}
    lines = [f"MLA attention forward + backward compiled for one {gpu} (compile-only; one row, H = {HEADS}, "
             f"DeepSeek-V3.2's widths, bfloat16; sparse: K = {TOP_K} keys a query; indexer: the selection, "
             "forward)", "",
             "| impl | tokens | temporaries (MiB) | analytical TFLOP | vs dense | sparse + indexer vs dense | kernels |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in records:
        ref = dense.get(r.tokens)
        ratio = f"{r.model_flops / ref.model_flops:.3f}x" if ref else "—"
        both = "—"
        if r.impl == "sparse" and ref and r.tokens in index:
            both = f"{(r.model_flops + index[r.tokens].model_flops) / ref.model_flops:.3f}x"
        lines.append(f"| {r.impl} | {r.tokens:,} | {r.temp_bytes / 2**20:,.1f} | {r.model_flops / 1e12:,.2f} | "
                     f"{ratio} | {both} | {kernel_list(r.kernels)} |")
    return "\n".join(lines)


def run_cli(*, gpu: str, quick: bool, json_out: str | None) -> int:
    """``moefast bench sparse-attention``: prints the table; with ``json_out`` writes the records
    and the table (``.md`` beside). Returns 0."""
    from moefast.bench.linear_attention import report

    records = bench_sparse_attention(gpu, QUICK_TOKENS if quick else TOKENS)
    return report(records, format_table(records, gpu), json_out)
