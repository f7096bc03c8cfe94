"""Expert-parallel MoE feed-forward under ``jax.shard_map``.

Dimension letters: B batch, T tokens, D d_model, F d_ff, E experts (El = E / expert-axis size local
experts), K top_k, C capacity.

Per device, on its own tokens (a routing group): route → pack an [E, C, D] send buffer by slot →
``all_to_all`` over the ``expert`` axis (each device receives, for its El local experts, the
buffers of every device: [El, ep·C, D]) → SwiGLU experts → ``all_to_all`` back → combine with the
gates. Capacity and every buffer shape are static (from the config and the per-device token count),
identical on every device and process, so collectives never see data-dependent shapes. With an
expert axis of size 1 no collective is issued. Routing statistics are summed over every token axis,
so the losses are those of the global batch whatever the mesh; the model sums them once, after its
layers (:class:`RoutingSums`), not in each layer.

Dropless (``moe.capacity_factor=0``) with an expert axis moves only the routed rows: each device
sorts its assignments by expert, sends each device exactly the rows of its experts
(``jax.lax.ragged_all_to_all`` when compiling for GPUs; on CPU, which cannot compile it, a dense
``all_to_all`` of T·K rows per peer with the same result), regroups what it received by local
expert for the grouped matmuls and returns the rows the same way (:func:`_dropless_exchange`).

Overlap (``moe.overlap_chunks`` = n, expert axis > 1): the [E, C, D] send buffer is split into n
chunks of C/n slots, and each chunk has its own chain dispatch ``all_to_all`` → local experts →
return ``all_to_all`` (a Python loop), the dispatches independent of each other and chunk i's
experts ordered after chunk i-1's (``jax.lax.optimization_barrier``; unordered, XLA:GPU merges the
chunks' matmuls into one), so XLA's scheduler can run chunk i+1's dispatch while chunk i's experts
compute and chunk i's return while chunk i+1 computes (Tutel's ``a2a_ffn_overlap_degree``, Hwang
et al. 2023). The capacity is rounded up to a
multiple of n (:func:`exchange_capacity`); AD chunks the backward pass the same way. Routing and
losses are bitwise those of n = 1; outputs and gradients equal them to float rounding (the experts'
matmuls see C/n instead of C rows, and XLA's dot kernels round differently for different row
counts: :func:`exchange_experts`). ``moe.overlap_chain`` ties chunk i's dispatch to chunk i-2's
expert output (``jax.lax.optimization_barrier``): at most two chunks' buffers are in flight.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moefast import routing
from moefast.config import MoEConfig
from moefast.kernels.grouped_matmul import grouped_matmul
from moefast.kernels.platform import target_platform
from moefast.kernels.vma import vary_together
from moefast.parallel.fp8 import fp8_dequantize, fp8_pack, fp8_quantize, fp8_unpack
from moefast.parallel.fp8_gemm import fp8_grouped_matmul, fp8_matmul
from moefast.parallel.hierarchical import hierarchical_exchange
from moefast.parallel.context import CONTEXT_AXIS
from moefast.parallel.mesh import BATCH_AXES, check_mesh_axes, reshard_for_shard_map, state_spec
from moefast.parallel.precision import expert_weights

__all__ = ["EXPERT_IN", "ExpertProjection", "EXPERT_OUT", "ROUTING", "MoEStats", "RoutingSums", "check_hierarchical", "exchange_capacity", "exchange_experts", "expert_ffn", "moe_ffn"]

EXPERT_AXIS = "expert"
# Names of the values the "minimal" remat policy keeps (``jax.ad_checkpoint.checkpoint_name``): the
# routing decisions and each expert buffer where it enters and leaves the experts, i.e. after the
# dispatch all-to-all and after the return all-to-all (expert axis > 1), so the backward pass never
# recomputes the routing or the exchange.
ROUTING = "moe_routing"
# Name scopes of the exchange's two all-to-alls (in the compiled program's op_name metadata).
DISPATCH = "moe_dispatch"
RETURN = "moe_return"
EXPERT_IN = "moe_expert_in"
EXPERT_OUT = "moe_expert_out"


class MoEStats(NamedTuple):
    """Routing statistics of one MoE layer over the whole (global) batch."""

    tokens_per_expert: jax.Array  # [E] int32, assignments per expert before capacity
    aux_loss: jax.Array  # [] float32, Switch load-balancing loss (before its coefficient)
    z_loss: jax.Array  # [] float32, ST-MoE router z-loss (before its coefficient)
    dropped_fraction: jax.Array  # [] float32, dropped assignments / routed assignments
    router_entropy: jax.Array  # [] float32, mean over tokens of the router softmax's entropy (nats)


class RoutingSums(NamedTuple):
    """One MoE layer's routing sums per token shard, not yet reduced over the mesh: S = the number
    of token shards (the product of the mesh's token axes; 1 without a mesh), split over them.

    The model returns these from every layer and reduces them once, after its layers
    (:meth:`stats`), so no all-reduce sits in a layer's forward or backward pass (a loop body when
    the layers are scanned). Leading dimensions (layers) are allowed before S.
    """

    tokens_per_expert: jax.Array  # [..., S, E] int32, assignments per expert before capacity
    prob_sum: jax.Array  # [..., S, E] float32, summed probabilities (carries the aux loss's gradient)
    z_sum: jax.Array  # [..., S] float32, summed squared logsumexp of the router logits
    num_tokens: jax.Array  # [..., S] float32, unmasked tokens
    dropped: jax.Array  # [..., S] int32, dropped assignments
    entropy_sum: jax.Array  # [..., S] float32, summed router entropy (nats)

    def stats(self, top_k: int) -> MoEStats:
        """:class:`MoEStats` over the global batch: the sums over S, then the losses (leading
        dimensions kept: fields [..., E] / [...])."""
        def one(s: RoutingSums) -> MoEStats:
            tpe, prob, z, n, dropped, ent = (jnp.sum(a, axis=0) for a in s)
            return MoEStats(tokens_per_expert=tpe, aux_loss=routing.load_balancing_loss(tpe, prob, n, top_k),
                            z_loss=routing.router_z_loss(z, n),
                            dropped_fraction=dropped.astype(jnp.float32) / jnp.maximum(n * top_k, 1.0),
                            router_entropy=ent / jnp.maximum(n, 1.0))
        for _ in range(self.z_sum.ndim - 1):
            one = jax.vmap(one)
        return one(self)

    @staticmethod
    def concatenate(parts: list[RoutingSums]) -> RoutingSums:
        """Layers' sums [L_i, S, ...] joined along the layer axis in order."""
        return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


GPT_OSS_ALPHA = 1.702
"""gpt-oss's clamped SwiGLU: ``g * sigmoid(1.702 g)`` (Hugging Face ``GptOssExperts.alpha``)."""


def gated_unit(h: jax.Array, activation: str = "silu", limit: float = 7.0) -> jax.Array:
    """The experts' gated unit on a fused ``[..., 2F]`` gate|up projection -> ``[..., F]``
    (``moe.expert_activation``): ``"silu"``, ``silu(gate) * up`` (SwiGLU, Shazeer 2020);
    ``"gelu_tanh"``, ``gelu(gate) * up`` with GELU's tanh approximation (GeGLU, Shazeer 2020);
    ``"clamped_swiglu"``, gpt-oss's ``(clip(up, -L, L) + 1) * g * sigmoid(1.702 g)``, ``g =
    min(gate, L)``; ``"relu2"``, not gated: ``relu(h)²`` of an up projection ``[..., F]`` itself
    (Nemotron-H). In ``h``'s dtype."""
    if activation == "relu2":
        return jnp.square(jax.nn.relu(h))
    gate, up = jnp.split(h, 2, axis=-1)
    if activation == "silu":
        return jax.nn.silu(gate) * up
    if activation == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return ((up + 1) * (gate * jax.nn.sigmoid(gate * GPT_OSS_ALPHA))).astype(h.dtype)


class ExpertProjection(NamedTuple):
    """One projection of the routed experts as the expert path takes it (a pytree: absent parts are
    ``None``). A plain array, or the pair ``(weight, bias)``, is read as one too."""

    w: jax.Array  # [E, in, out] weight (float32 master, or a frozen bfloat16 base)
    b: jax.Array | None = None  # [E, out] bias (moe.expert_bias)
    lora_a: jax.Array | None = None  # [E, in, r] adapter A (lora)
    lora_b: jax.Array | None = None  # [E, r, out] adapter B, already times alpha / r


def _projection(w) -> ExpertProjection:
    if isinstance(w, ExpertProjection):
        return w
    return ExpertProjection(*w) if isinstance(w, tuple) else ExpertProjection(w)


def _weight_and_bias(w, dtype):
    """An expert projection (:class:`ExpertProjection`, a weight, or ``(weight, bias)``) in ``dtype``."""
    return jax.tree.map(lambda a: a.astype(dtype), _projection(w))


def _adapted(y, x, p: ExpertProjection, mm):
    """``y`` plus the projection's low-rank adapter ``(x A) B`` by the matmul ``mm`` (each expert's
    rows through its own A and B: two thin batched or grouped GEMMs), or ``y`` without one."""
    if p.lora_a is None:
        return y
    return y + mm(mm(x, p.lora_a), p.lora_b).astype(y.dtype)


def expert_ffn(x_ecd: jax.Array, w_in_edf, w_out_efd, dtype, activation: str = "silu",
               limit: float = 7.0, fp8: bool = False) -> jax.Array:
    """Gated experts (SwiGLU by default, Shazeer 2020; :func:`gated_unit`) on per-expert buffers.

    Args:
      x_ecd: [E, C, D] tokens per expert.
      w_in_edf: [E, D, 2F] fused gate|up projections, or the pair (that, [E, 2F] biases).
      w_out_efd: [E, F, D] down projections, or the pair (that, [E, D] biases).
      dtype: compute dtype.
      activation, limit: :func:`gated_unit`'s (``moe.expert_activation``, ``moe.swiglu_limit``).
      fp8: both GEMMs by the FP8 recipe (``model.precision: fp8``,
        :func:`moefast.parallel.fp8_gemm.fp8_matmul`).

    Returns:
      [E, C, D] in ``dtype``. With biases, empty slots hold the biases' output (never combined).
    """
    p_in, p_out = _weight_and_bias(w_in_edf, dtype), _weight_and_bias(w_out_efd, dtype)
    mm = functools.partial(fp8_matmul, dtype=dtype) if fp8 else jnp.matmul
    x = x_ecd.astype(dtype)
    h_ecf = _adapted(mm(x, p_in.w), x, p_in, jnp.matmul)
    if p_in.b is not None:
        h_ecf = h_ecf + p_in.b[:, None]
    a = gated_unit(h_ecf, activation, limit)
    y = _adapted(mm(a, p_out.w), a, p_out, jnp.matmul)
    return y if p_out.b is None else y + p_out.b[:, None]


def _to_experts(x_ecd: jax.Array, ep: int) -> jax.Array:
    """[E, C, D] by destination expert -> [El, ep·C, D]: local experts' tokens from every device."""
    e, c, d = x_ecd.shape
    x = x_ecd.reshape(ep, e // ep, c, *x_ecd.shape[2:])
    with jax.named_scope(DISPATCH):
        x = jax.lax.all_to_all(x, EXPERT_AXIS, split_axis=0, concat_axis=0, tiled=True)  # [ep(src), El, C, D]
    return jnp.swapaxes(x, 0, 1).reshape(e // ep, ep * c, *x_ecd.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _to_experts_fp8(x_ecd: jax.Array, ep: int) -> jax.Array:
    d = x_ecd.shape[-1]
    q, scale = fp8_unpack(_to_experts(fp8_pack(*fp8_quantize(x_ecd)), ep), d)
    return fp8_dequantize(q, scale, x_ecd.dtype)


def _to_experts_fp8_fwd(x_ecd, ep):
    return _to_experts_fp8(x_ecd, ep), None


def _to_experts_fp8_bwd(ep, _, g_lcd):
    # straight through the rounding: the gradient goes back by the exchange's transpose (a
    # permutation: its inverse), in g's dtype, as DeepSeek-V3 keeps the backward exchanges in bf16
    return (_from_experts(g_lcd, ep, scope=DISPATCH),)


_to_experts_fp8.defvjp(_to_experts_fp8_fwd, _to_experts_fp8_bwd)


def _from_experts(y_lcd: jax.Array, ep: int, scope: str = RETURN) -> jax.Array:
    """Inverse of :func:`_to_experts`: [El, ep·C, D] -> [E, C, D] back on the tokens' device
    (``scope``: the all-to-all's name scope; the dispatch's own transpose keeps ``DISPATCH``)."""
    el, epc, d = y_lcd.shape
    c = epc // ep
    y = y_lcd.reshape(el, ep, c, d).transpose(1, 0, 2, 3)  # [ep(dst), El, C, D]
    with jax.named_scope(scope):
        y = jax.lax.all_to_all(y, EXPERT_AXIS, split_axis=0, concat_axis=0, tiled=True)  # [ep(owner), El, C, D]
    return y.reshape(ep * el, c, d)


def exchange_capacity(capacity: int, chunks: int) -> int:
    """Capacity used with ``chunks`` overlap chunks: ``capacity`` rounded up to a multiple of
    ``chunks``, so the buffer splits evenly (at most ``chunks - 1`` more slots per expert)."""
    return -(-capacity // chunks) * chunks


def exchange_experts(x_ecd: jax.Array, w_in_edf, w_out_efd, dtype, *, ep: int, chunks: int = 1, chain: bool = False,
                     fp8_dispatch: bool = False, ffn=expert_ffn) -> jax.Array:
    """Expert-parallel SwiGLU experts of one device's send buffer, inside ``jax.shard_map`` over
    an ``expert`` axis of size ``ep``: ``chunks`` independent dispatch → experts → return chains.

    Args:
      x_ecd: [E, C, D] this device's tokens by destination expert (C divisible by ``chunks``).
      w_in_edf: [El, D, 2F], w_out_efd: [El, F, D]: this device's El = E / ep experts (each
        possibly a (weight, bias) pair: :func:`expert_ffn`).
      dtype: compute dtype of the experts.
      ep: size of the ``expert`` mesh axis (> 1).
      chunks: n, independent exchanges along the capacity axis (1: one exchange each way).
      chain: tie chunk i's dispatch to chunk i-2's expert output with
        ``jax.lax.optimization_barrier`` (at most two chunks' buffers in flight).
      fp8_dispatch: the dispatch moves e4m3 with a float32 scale per 128 channels, packed into
        one uint8 row (:mod:`moefast.parallel.fp8`; 1.03 bytes per value instead of 2 in
        bfloat16) and the experts get the dequantized rows; the return and every backward exchange
        stay in ``x_ecd``'s dtype (gradients pass straight through the rounding).
      ffn: the experts, ``(x_ecd, w_in, w_out, dtype) -> y_ecd`` (:func:`expert_ffn` with the
        layer's activation).

    Returns:
      [E, C, D] in ``dtype``: each slot's expert output, back on this device. The exchange moves
      data exactly; the experts' matmuls run on C/n instead of C slots per source device, and XLA's
      dot kernels round differently for different row counts, so results equal n = 1 to float
      rounding (not bitwise). AD transposes each chain into its own chain (the backward pass is
      chunked the same way).

    Raises:
      ValueError: C not divisible by ``chunks``, or ``chunks`` < 1.
    """
    e, c, _ = x_ecd.shape
    if chunks < 1 or c % chunks:
        raise ValueError(f"capacity {c} must be divisible by overlap_chunks={chunks} >= 1 (see exchange_capacity)")
    cn = c // chunks
    outs, computed = [], []
    for i in range(chunks):
        xc = x_ecd[:, i * cn:(i + 1) * cn]
        if chain and i >= 2:  # chunk i leaves only once chunk i-2's experts are done
            xc, _ = jax.lax.optimization_barrier((xc, outs[i - 2]))
        received = checkpoint_name(_to_experts_fp8(xc, ep) if fp8_dispatch else _to_experts(xc, ep), EXPERT_IN)
        if i:  # chunk i's experts after chunk i-1's: see the note below
            received, _ = jax.lax.optimization_barrier((received, computed[-1]))
        computed.append(ffn(received, w_in_edf, w_out_efd, dtype))
        outs.append(checkpoint_name(_from_experts(computed[-1], ep), EXPERT_OUT))
    # The experts of chunk i take their input together with chunk i-1's output: without that
    # ordering XLA:GPU's dot merger joins the chunks' matmuls on the same weights into one dot,
    # which waits for every dispatch, so nothing is left to overlap them with (compiled for H100:
    # the forward dispatches synchronous). Ordered, chunk i's dispatch runs during chunk i-1's
    # experts and chunk i-1's return during chunk i's.
    return outs[0] if chunks == 1 else jnp.concatenate(outs, axis=1)


def check_hierarchical(moe: MoEConfig, ep: int, tokens: int | None = None) -> None:
    """``moe.exchange=hierarchical`` on an expert axis of ``ep``: it spans whole hosts of
    ``moe.gpus_per_host``, with group-limited routing each group's experts sit on one host, and
    (given ``tokens``, a device's tokens per call) ``moe.overlap_chunks`` slices divide them.

    Raises:
      ValueError: what to change.
    """
    g = moe.gpus_per_host
    if ep <= g or ep % g:
        raise ValueError(f"moe.exchange=hierarchical: the expert axis (mesh.expert={ep}) must span several whole hosts of "
                         f"moe.gpus_per_host={g} GPUs (a multiple of {g}, more than {g}); with the expert axis inside "
                         "one host use moe.exchange=flat, or set moe.gpus_per_host to the GPUs per host")
    hosts = ep // g
    if moe.num_groups > 1 and moe.num_groups % hosts:
        raise ValueError(f"moe.exchange=hierarchical with group-limited routing: moe.num_groups={moe.num_groups} "
                         f"groups are not aligned with the {hosts} hosts of the expert axis (each group's experts must "
                         f"sit on one host: num_groups a multiple of {hosts}), so a token could reach more than "
                         f"moe.topk_groups={moe.topk_groups} hosts; set moe.num_groups to a multiple of {hosts}")
    if tokens is not None and tokens % moe.overlap_chunks:
        raise ValueError(f"moe.overlap_chunks={moe.overlap_chunks} with moe.exchange=hierarchical splits each device's "
                         f"{tokens} tokens into equal slices: use a number of chunks that divides {tokens}")


def _shard_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's linear index over the mesh ``axes`` (inside ``shard_map``)."""
    idx = jnp.zeros((), jnp.int32)
    for a in axes:
        idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return idx


def _warmup_logits(logits_te, key, active, moe: MoEConfig, token_axes: tuple[str, ...]):
    """Router logits randomised for expert warm-up (see ``MoEConfig.warmup_routing``) where
    ``active``; each token shard draws its own noise."""
    if token_axes:
        key = jax.random.fold_in(key, _shard_index(token_axes))
    if moe.warmup_routing == "uniform":
        noisy = 1e-3 * jax.random.gumbel(key, logits_te.shape, jnp.float32)
    else:
        noisy = logits_te + moe.warmup_noise * jax.random.normal(key, logits_te.shape, jnp.float32)
    return jnp.where(active, noisy, logits_te)


def _capacity(moe: MoEConfig, num_tokens: int, load_ema, drop_tokens: bool):
    """Buffer capacity (static int) and the optional dynamic per-expert limit [E] int32."""
    if not drop_tokens or moe.dropless:
        return num_tokens, None  # an expert receives each token at most once: nothing drops
    cap = lambda cf: routing.compute_capacity(num_tokens, moe.num_experts, moe.top_k, cf, moe.min_capacity)
    if moe.capacity_mode == "static" or load_ema is None:
        return cap(moe.capacity_factor), None
    c_max, c_min = cap(moe.capacity_factor_max), cap(moe.capacity_factor_min)
    want = jnp.ceil(moe.capacity_factor * num_tokens * moe.top_k * load_ema)
    return c_max, jnp.clip(want, c_min, c_max).astype(jnp.int32)


def _sort_by_expert(x_td, r, dtype):
    """Each kept assignment's row, grouped by expert in expert order (position-order slots, no
    sort): ``(x_sorted [T·K, D] in dtype, dest_tk [T, K] int32 — each assignment's row, T·K where
    dropped or masked)``. Row T·K and beyond stay zero."""
    t, d = x_td.shape
    k = r.expert_index.shape[1]
    counts = r.tokens_per_expert
    offsets = jnp.cumsum(counts) - counts
    dest_tk = jnp.where(r.slot >= 0, offsets[r.expert_index] + r.slot, t * k)  # t*k: masked, dropped
    # Which token fills each row: a scatter of T*K ints, then one gather of the rows (a float
    # scatter of the rows themselves is several times slower on XLA:CPU). Row T is the zero row.
    token_tk = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, k))
    src_n = jnp.full((t * k,), t, jnp.int32).at[dest_tk.reshape(-1)].set(
        token_tk.reshape(-1), mode="drop", unique_indices=True)
    return jnp.concatenate([x_td.astype(dtype), jnp.zeros((1, d), dtype)])[src_n], dest_tk


def _experts_grouped(x_nd, counts, w_in_edf, w_out_efd, dtype, impl: str, activation: str = "silu",
                     limit: float = 7.0, fp8: bool = False):
    """Gated experts (:func:`expert_ffn`'s, with its optional biases) on rows grouped by expert
    (:func:`moefast.kernels.grouped_matmul`; ``fp8``: :func:`~moefast.parallel.fp8_gemm.fp8_grouped_matmul`)."""
    p_in, p_out = _weight_and_bias(w_in_edf, dtype), _weight_and_bias(w_out_efd, dtype)
    gmm = fp8_grouped_matmul if fp8 else grouped_matmul
    thin = lambda x, w: grouped_matmul(x, w, counts, impl=impl)  # noqa: E731  (the adapters', in dtype)
    x_nd = x_nd.astype(dtype)
    h = _adapted(gmm(x_nd, p_in.w, counts, impl=impl), x_nd, p_in, thin)
    if p_in.b is not None or p_out.b is not None:  # each row's expert (rows past the counts: the last, unused)
        eid = jnp.repeat(jnp.arange(counts.shape[0]), counts, total_repeat_length=x_nd.shape[0])
    if p_in.b is not None:
        h = h + p_in.b[eid]
    a = gated_unit(h, activation, limit)
    y = _adapted(gmm(a, p_out.w, counts, impl=impl), a, p_out, thin)
    return y if p_out.b is None else y + p_out.b[eid]


def _dropless_grouped(x_td, r, w_in_edf, w_out_efd, dtype, impl: str, **act):
    """Dropless experts without capacity padding: tokens permuted by expert with the
    position-order slots (no sort), grouped matmuls (:func:`moefast.kernels.grouped_matmul`, ``impl``),
    permuted back."""
    x_sorted, dest_tk = _sort_by_expert(x_td, r, dtype)
    y_sorted = _experts_grouped(checkpoint_name(x_sorted, EXPERT_IN), r.tokens_per_expert, w_in_edf, w_out_efd,
                                dtype, impl, **act)
    return routing.combine_rows(checkpoint_name(y_sorted, EXPERT_OUT), dest_tk, r)


def _ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, max_rows: int,
                     ragged: bool):
    """:func:`jax.lax.ragged_all_to_all` over the ``expert`` axis (``ragged``: GPU), or the same
    semantics with a dense ``all_to_all`` of ``max_rows`` rows per peer (XLA:CPU cannot compile the
    ragged collective): peer j gets ``operand[input_offsets[j]:][:send_sizes[j]]`` written into its
    ``output`` at ``output_offsets[j]``; ``recv_sizes[j]`` rows arrive from peer j."""
    if ragged:
        # The collective's result is typed as varying like ``output``. A fresh zeros buffer varies over
        # no mesh axis, so the rows received would be typed as equal on every device: each use of them
        # with per-device values then casts them to varying, and the backward pass sums the
        # cotangents of every device over the whole mesh (a bfloat16 all-reduce, and wrong gradients).
        (output, _), _ = vary_together(output, operand)
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=EXPERT_AXIS)
    d = operand.shape[1]
    j = jnp.arange(max_rows, dtype=jnp.int32)
    rows = jnp.minimum(input_offsets[:, None] + j[None], operand.shape[0] - 1)
    send = jnp.where((j[None] < send_sizes[:, None])[..., None], operand[rows], jnp.zeros((), operand.dtype))
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True)  # [peers, max_rows, D]
    at = jax.lax.all_to_all(output_offsets, EXPERT_AXIS, 0, 0, tiled=True)  # where each peer's rows go here
    pos = jnp.where(j[None] < recv_sizes[:, None], at[:, None] + j[None], output.shape[0])
    return output.at[pos.reshape(-1)].set(recv.reshape(-1, d), mode="drop")


def _regroup(counts_ab, rows: int):
    """For a buffer of ``rows`` rows holding, a-major, ``counts_ab[a, b]`` rows per (a, b): the
    a-major position of each row of the b-major order (``rows``: no row, the zero row)."""
    na, nb = counts_ab.shape
    start_ab = (jnp.cumsum(counts_ab.reshape(-1)) - counts_ab.reshape(-1)).reshape(na, nb)
    seg = counts_ab.T.reshape(-1)  # segments in b-major order
    ends = jnp.cumsum(seg)
    p = jnp.arange(rows, dtype=jnp.int32)
    q = jnp.searchsorted(ends, p, side="right").astype(jnp.int32)
    valid = q < na * nb
    q = jnp.minimum(q, na * nb - 1)
    src = start_ab[q % na, q // na] + p - (ends[q] - seg[q])
    return jnp.where(valid, src, rows)


def _dropless_exchange(x_td, r, w_in_edf, w_out_efd, dtype, impl: str, ep: int, **act):
    """Dropless experts over an expert axis moving only the routed rows: each device sorts its
    assignments by expert (so by the experts' device), sends each device exactly its rows
    (:func:`_ragged_exchange`), regroups what it received by local expert, runs the grouped matmuls,
    and sends the rows back the same way. Buffers are sized for the worst case (every assignment of
    every device on this device's experts: ep·T·K rows); only real rows move on GPU."""
    t, d = x_td.shape
    k = r.expert_index.shape[1]
    e = r.tokens_per_expert.shape[0]
    el = e // ep
    n, nr = t * k, ep * t * k
    x_sorted, dest_tk = _sort_by_expert(x_td, r, dtype)
    counts = r.tokens_per_expert.astype(jnp.int32).reshape(ep, el)  # my rows per (device, its expert)
    send = jnp.sum(counts, axis=1)
    send_off = jnp.cumsum(send) - send
    got = jax.lax.all_to_all(counts, EXPERT_AXIS, 0, 0, tiled=True)  # [source, local expert]: rows to come
    recv = jnp.sum(got, axis=1)
    recv_off = jnp.cumsum(recv) - recv
    every = jax.lax.all_gather(send, EXPERT_AXIS)  # [source, destination]
    me = jax.lax.axis_index(EXPERT_AXIS)
    out_off = (jnp.cumsum(every, axis=0) - every)[me]  # where my rows start on each destination
    ragged = target_platform() == "gpu"
    exchange = functools.partial(_ragged_exchange, max_rows=n, ragged=ragged)
    with jax.named_scope(DISPATCH):
        received = exchange(x_sorted, jnp.zeros((nr, d), dtype), send_off, send, out_off, recv)
    by_expert = jnp.concatenate([received, jnp.zeros((1, d), dtype)])[_regroup(got, nr)]
    y = _experts_grouped(checkpoint_name(by_expert, EXPERT_IN), jnp.sum(got, axis=0), w_in_edf, w_out_efd, dtype,
                         impl, **act)
    y_by_source = jnp.concatenate([y, jnp.zeros((1, d), y.dtype)])[_regroup(got.T, nr)]
    back_at = jax.lax.all_to_all(send_off, EXPERT_AXIS, 0, 0, tiled=True)  # my rows' place on each source
    with jax.named_scope(RETURN):
        y_sorted = exchange(y_by_source, jnp.zeros((n, d), y.dtype), recv_off, recv, back_at, send)
    return routing.combine_rows(checkpoint_name(y_sorted, EXPERT_OUT), dest_tk, r)


def _moe_local(x_btd, mask_bt, router_x_btd, router_de, w_in_edf, w_out_efd, bias_e, load_ema_e, router_bias_e,
               expert_scale_e, *warmup,
               moe: MoEConfig, drop_tokens, dtype, ep: int, reduce_axes: tuple[str, ...], w_specs: tuple = (),
               reduce_stats=True, fp8=False):
    b, t, d = x_btd.shape
    if w_specs:  # this device's shards -> its experts' whole weights (and biases), in the compute dtype
        keep = EXPERT_AXIS if ep > 1 else None
        gather = lambda w, spec: expert_weights(w, dtype, spec, reduce_axes, keep)  # noqa: E731
        w_in_edf = jax.tree.map(gather, w_in_edf, w_specs[0])
        w_out_efd = jax.tree.map(gather, w_out_efd, w_specs[1])
    act = dict(activation=moe.expert_activation, limit=moe.swiglu_limit, fp8=fp8)
    ffn = functools.partial(expert_ffn, **act)
    num_experts = moe.num_experts
    x_td, mask_t = x_btd.reshape(b * t, d), mask_bt.reshape(b * t)
    chunks = moe.overlap_chunks if ep > 1 else 1  # no exchange, nothing to overlap
    capacity, limit = _capacity(moe, b * t, load_ema_e, drop_tokens)
    hierarchical = moe.exchange == "hierarchical" and ep > 1 and drop_tokens
    if hierarchical:  # the two hops have their own capacities: the routing itself drops nothing
        capacity, limit = b * t, None
    if chunks > capacity:
        raise ValueError(f"moe.overlap_chunks={chunks} is more than the capacity ({capacity} slots per expert "
                         "on a device): every chunk would hold at most one slot; use fewer chunks")
    if not hierarchical:  # the buffer splits evenly (a dynamic limit stays below it); hierarchical splits tokens
        capacity = exchange_capacity(capacity, chunks)
    logits_te = router_x_btd.reshape(b * t, -1).astype(jnp.float32) @ router_de.astype(jnp.float32)
    if moe.router_bias:
        logits_te = logits_te + router_bias_e.astype(jnp.float32)[None]
    if warmup:  # (key, active)
        logits_te = _warmup_logits(logits_te, *warmup, moe, reduce_axes)
    r = routing.route(logits_te, top_k=moe.top_k, capacity=capacity, mask_t=mask_t, policy=moe.routing_policy,
                      impl=moe.routing_impl, bias=bias_e, capacity_limit=limit, renormalize=moe.norm_topk_prob,
                      score_func=moe.score_func, num_groups=moe.num_groups, topk_groups=moe.topk_groups,
                      routed_scaling_factor=moe.routed_scaling_factor)
    if moe.per_expert_scale:  # each chosen expert's learned scale of its gate (Gemma 4), the choice unchanged
        r = r._replace(gates=r.gates * expert_scale_e.astype(jnp.float32)[r.expert_index])
    r = jax.tree.map(lambda a: checkpoint_name(a, ROUTING), r)

    num_dropped = r.num_dropped
    if hierarchical:
        y_td, num_dropped = hierarchical_exchange(x_td, r, w_in_edf, w_out_efd, dtype, moe, ep=ep,
                                                  per_host=moe.gpus_per_host, expert_ffn=ffn,
                                                  checkpoint=checkpoint_name, names=(EXPERT_IN, EXPERT_OUT),
                                                  chunks=chunks)
    elif moe.dropless and ep == 1:
        y_td = _dropless_grouped(x_td, r, w_in_edf, w_out_efd, dtype, moe.grouped_matmul, **act)
    elif moe.dropless:
        y_td = _dropless_exchange(x_td, r, w_in_edf, w_out_efd, dtype, moe.grouped_matmul, ep, **act)
    else:
        onehot = moe.dispatch == "onehot" and drop_tokens and not moe.dropless
        if onehot:  # the GShard baseline; without capacity (C = T) its [T, E, C] tensors would be [T, E, T]
            dispatch_tec, combine_tec = routing.onehot_masks(r, num_experts, capacity)
            x_ecd = routing.dispatch_onehot(x_td, dispatch_tec)
        else:
            x_ecd = routing.dispatch(x_td, r, num_experts, capacity)
        if ep > 1:  # names the buffers on the experts' side of the exchange
            y_ecd = exchange_experts(x_ecd, w_in_edf, w_out_efd, dtype, ep=ep, chunks=chunks,
                                     chain=moe.overlap_chain, fp8_dispatch=moe.dispatch_dtype == "float8_e4m3fn",
                                     ffn=ffn)
        else:
            y_ecd = checkpoint_name(ffn(checkpoint_name(x_ecd, EXPERT_IN), w_in_edf, w_out_efd, dtype), EXPERT_OUT)
        y_td = routing.combine_onehot(y_ecd, combine_tec) if onehot else routing.combine(y_ecd, r)

    logp_te = jax.nn.log_softmax(jax.lax.stop_gradient(logits_te), axis=-1)
    entropy_sum = jnp.sum(jnp.where(mask_t, -jnp.sum(jnp.exp(logp_te) * logp_te, axis=-1), 0.0))
    sums = RoutingSums(tokens_per_expert=r.tokens_per_expert, prob_sum=r.prob_sum, z_sum=r.z_sum,
                       num_tokens=r.num_tokens, dropped=num_dropped, entropy_sum=entropy_sum)
    sums = jax.tree.map(lambda a: a[None], sums)  # this shard's row of [S, ...]
    if reduce_stats:
        if reduce_axes:
            sums = jax.lax.psum(sums, reduce_axes)
        return y_td.reshape(b, t, d).astype(x_btd.dtype), sums.stats(moe.top_k)
    return y_td.reshape(b, t, d).astype(x_btd.dtype), sums


def moe_ffn(x_btd: jax.Array, mask_bt: jax.Array, router_de: jax.Array, w_in_edf, w_out_efd, moe: MoEConfig, *,
            drop_tokens: bool = True, dtype=jnp.float32, fp8: bool = False, bias_e: jax.Array | None = None,
            load_ema_e: jax.Array | None = None, warmup_key: jax.Array | None = None,
            warmup_active: jax.Array | None = None, reduce_stats: bool = True,
            router_bias_e: jax.Array | None = None, router_x_btd: jax.Array | None = None,
            expert_scale_e: jax.Array | None = None) -> tuple[jax.Array, MoEStats | RoutingSums]:
    """Routed gated experts (SwiGLU by default), expert-parallel when a mesh is set (``jax.set_mesh``).

    Args:
      x_btd: [B, T, D] normalised hidden states; B split over the mesh's token axes.
      mask_bt: [B, T] bool, False for padding (never routed, counted nowhere).
      router_de: [D, E] router weights (used in float32).
      w_in_edf: [E, D, 2F]; w_out_efd: [E, F, D] — split over ``expert`` under a mesh; with
        ``moe.expert_bias`` each the pair (weight, bias [E, 2F] / [E, D]).
      moe: the MoE options (static; hashable): routing, capacity, warm-up, dispatch and overlap.
        Capacities count the tokens of one device.
      drop_tokens: False sets capacity = tokens per device, so nothing drops (evaluation,
        generation).
      dtype: compute dtype of the experts.
      fp8: the experts' GEMMs by the FP8 recipe (``model.precision: fp8``,
        :mod:`moefast.parallel.fp8_gemm`).
      bias_e: [E] float32 selection bias (aux-loss-free balancing); ``None``: none.
      load_ema_e: [E] float32 average share of assignments per expert (dynamic capacity).
      warmup_key: PRNG key of this layer's warm-up routing noise (``moe.warmup_routing``);
        ``None``: no warm-up.
      warmup_active: [] bool, whether this step is in the warm-up (traced, so one compiled step
        serves the whole run).
      reduce_stats: True: the statistics over the global batch (an all-reduce over the token
        axes in this call). False: :class:`RoutingSums` per token shard, reduced later by
        :meth:`RoutingSums.stats` (the model reduces all its layers' at once, after them).
      router_bias_e: [E] bias of the router's logits (``moe.router_bias``; required then).
      router_x_btd: [B, T, Dr] what the router reads (Dr = ``router_de``'s rows), where it differs
        from the experts' input (``moe.branch_norms``: its own norm of the residual stream;
        ``moe.latent_size``: the full width, the experts reading the latent one); ``None``: ``x_btd``.
      expert_scale_e: [E] each expert's gate multiplier (``moe.per_expert_scale``; required then).

    Returns:
      ``(y_btd, stats)``: [B, T, D] in ``x_btd.dtype`` (exactly 0 for dropped/masked tokens) and
      :class:`MoEStats` over the global batch, or with ``reduce_stats=False`` :class:`RoutingSums`
      [S, ...] (S token shards).

    Raises:
      ValueError: the expert axis does not divide E, or the batch is not divisible by the token
        shards, or the router's E is not ``moe.num_experts``, or ``x_btd`` is not a float array, or
        the mesh has an axis longer than 1 that is not ``data``, ``fsdp`` or ``expert``
        (:func:`~moefast.parallel.mesh.check_mesh_axes`), or ``moe.overlap_chunks`` is more than
        the capacity; with ``moe.exchange=hierarchical``: the expert axis not whole hosts of
        ``moe.gpus_per_host``, groups not aligned with hosts (:func:`check_hierarchical`), or
        ``moe.overlap_chunks`` not dividing the tokens per device.
    """
    if not jnp.issubdtype(x_btd.dtype, jnp.floating):
        raise ValueError(f"moe_ffn: x_btd must be float hidden states (e.g. float32 or bfloat16), got {x_btd.dtype}; "
                         "token ids go through the model's embedding first")
    num_experts = moe.num_experts
    w_in_edf, w_out_efd = _projection(w_in_edf), _projection(w_out_efd)
    w_lead = w_in_edf.w.shape[0]
    if router_de.shape[1] != num_experts or w_lead != num_experts:
        raise ValueError(f"router [D, {router_de.shape[1]}] and experts [{w_lead}, ...] do not match "
                         f"moe.num_experts={num_experts}")
    if (w_in_edf.b is not None) != moe.expert_bias or (w_out_efd.b is not None) != moe.expert_bias:
        raise ValueError(f"moe.expert_bias={moe.expert_bias}: pass each expert projection as "
                         f"{'(weight, bias)' if moe.expert_bias else 'a weight alone'}")
    if moe.router_bias and (router_bias_e is None or router_bias_e.shape != (num_experts,)):
        raise ValueError(f"moe.router_bias: pass router_bias_e of shape [{num_experts}], got "
                         f"{None if router_bias_e is None else list(router_bias_e.shape)}")
    if moe.per_expert_scale and (expert_scale_e is None or expert_scale_e.shape != (num_experts,)):
        raise ValueError(f"moe.per_expert_scale: pass expert_scale_e of shape [{num_experts}], got "
                         f"{None if expert_scale_e is None else list(expert_scale_e.shape)}")
    if router_x_btd is not None and router_x_btd.shape != (*x_btd.shape[:2], router_de.shape[0]):
        raise ValueError(f"router_x_btd must be [B, T] = {tuple(x_btd.shape[:2])} rows of the router's width "
                         f"{router_de.shape[0]}, got {tuple(router_x_btd.shape)}")
    if router_bias_e is None:
        router_bias_e = jnp.zeros((num_experts,), jnp.float32)
    if expert_scale_e is None:
        expert_scale_e = jnp.ones((num_experts,), jnp.float32)
    if router_x_btd is None:
        router_x_btd = x_btd
    if bias_e is None:
        bias_e = jnp.zeros((num_experts,), jnp.float32)
    if load_ema_e is None:
        load_ema_e = jnp.full((num_experts,), 1.0 / num_experts, jnp.float32)
    kw = dict(moe=moe, drop_tokens=drop_tokens, dtype=dtype, reduce_stats=reduce_stats, fp8=bool(fp8))
    args = (x_btd, mask_bt, router_x_btd, router_de, w_in_edf, w_out_efd, bias_e, load_ema_e, router_bias_e,
            expert_scale_e)
    if warmup_key is not None:
        args += (warmup_key, jnp.asarray(True if warmup_active is None else warmup_active))
    mesh = jax.sharding.get_abstract_mesh()
    check_mesh_axes(mesh, "moe_ffn")
    if mesh.empty or mesh.size == 1:
        return _moe_local(*args, ep=1, reduce_axes=(), **kw)
    token_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    # a context axis splits each row's tokens (T): one more token axis for the exchange and statistics
    context = CONTEXT_AXIS if mesh.shape.get(CONTEXT_AXIS, 1) > 1 else None
    ep = mesh.shape.get(EXPERT_AXIS, 1)
    if num_experts % ep:
        raise ValueError(f"the expert axis ({ep}) must divide num_experts={num_experts}")
    shards = 1
    for a in token_axes:
        shards *= mesh.shape[a]
    if x_btd.shape[0] % shards:
        raise ValueError(f"batch {x_btd.shape[0]} is not divisible by the {shards} token shards {token_axes}")
    if moe.exchange == "hierarchical":  # without dropping (evaluation) the exchange is flat: any token count
        per_row = x_btd.shape[1] // (mesh.shape[CONTEXT_AXIS] if context else 1)
        check_hierarchical(moe, ep, x_btd.shape[0] // shards * per_row if drop_tokens else None)
    # The expert weights enter as the train state holds them (float32 shards, split over expert,
    # fsdp and data) and are gathered inside in the compute dtype (moefast.parallel.precision).
    def names(e, i, o):  # each part's logical axes; the adapters' rank dimension is not split
        return ExpertProjection((e, i, o), (e, o), (e, i, None), (e, None, o))

    names = (names("expert", "embed", "mlp"), names("expert", "mlp", "embed"))
    w_specs = tuple(ExpertProjection(*(None if a is None else state_spec(n, a.shape, mesh) for n, a in zip(ns, w)))
                    for ns, w in zip(names, (w_in_edf, w_out_efd)))
    all_axes = token_axes + ((context,) if context else ())
    fn = lambda *a: _moe_local(*a, ep=ep, reduce_axes=all_axes, w_specs=w_specs, **kw)
    tokens = P(token_axes, context) if context else P(token_axes)
    in_specs = (tokens, tokens, tokens, P(), *w_specs, P(), P(), P(), P()) + (P(),) * (len(args) - 10)
    out_specs = (tokens, P() if reduce_stats else P(all_axes))
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs)(*reshard_for_shard_map(args, in_specs))
