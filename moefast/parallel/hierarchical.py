"""Node-limited routing's hierarchical expert exchange (``moe.exchange: hierarchical``).

Dimension letters: T tokens (of this device), D d_model, E experts, K top_k, H hosts the expert
axis spans, G GPUs per host in it (the expert axis is H x G, host-major: rank ``h * G + g``), Eh =
E / H experts per host, El = E / (H G) experts per GPU, Ch host-rows per destination host, C2 slots
per expert on the second hop.

DeepSeek-V3 (Liu et al. 2024, sec. 2.1.2 "node-limited routing" and sec. 3.2.2) routes each token to
experts on at most M hosts (its group-limited top-k with groups aligned with hosts: M =
``topk_groups``) and sends it across the network once per destination host, then forwards it over
NVLink to the GPUs holding its experts there; the combine goes back the same two hops, summed
inside the host first. With the flat exchange (:func:`moefast.parallel.expert.exchange_experts`)
each device sends a capacity buffer for every expert, E x C rows of which (H - 1) / H cross
hosts whatever the routing. Here, per device and layer:

1. **Between hosts** (``all_to_all`` over the H ranks with this GPU's local index, one per host):
   each token's row once per host it routes to, in position order, at most Ch =
   ``ceil(capacity_factor * T * M / H)`` per host (a token over it loses that host's experts),
   with its K expert indices within that host (-1: elsewhere) and gates (one small collective of
   both, the indices' bits carried as float32).
2. **Inside the host** (``all_to_all`` over the G ranks of this host): the received H x Ch rows
   dispatched to the host's Eh experts by slot, C2 = ``ceil(capacity_factor * T * K / Eh)`` per
   expert (an assignment over it is dropped); the El experts of each GPU run on G x C2 rows.
3. Back inside the host, each row's outputs summed with its gates (float32, cast to the compute
   dtype), back between hosts, and summed over the hosts of each token.

Rows crossing hosts per device and exchange: H x Ch (7/8 of them remote on 8 hosts) instead of
E x C: for DeepSeek-V3 on 8 hosts, 20,480 instead of 40,960. When nothing is dropped the layer's
output equals the flat exchange's up to the order of the float sums (each host's partial sum is
rounded to the compute dtype once); with drops the two hops drop differently from one capacity
per expert. With ``moe.dispatch_dtype=float8_e4m3fn`` rows are quantized once at the source
(:func:`~moefast.parallel.fp8.fp8_quantize`) and travel both hops as e4m3 with their scales
packed into the same row (:func:`~moefast.parallel.fp8.fp8_pack`);
gradients pass straight through the rounding, in the compute dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from moefast.parallel.fp8 import fp8_dequantize, fp8_pack, fp8_quantize, fp8_unpack

__all__ = ["hierarchical_exchange", "host_capacity", "second_hop_capacity"]

EXPERT_AXIS = "expert"


def host_capacity(moe, tokens: int, hosts: int) -> int:
    """Ch: rows one device sends each destination host, ``ceil(cf * T * M / H)`` in
    [min_capacity, T], M = min(topk_groups, hosts, top_k) the hosts a token reaches at most."""
    m = min(moe.topk_groups if moe.num_groups > 1 else hosts, hosts, moe.top_k)
    return max(min(math.ceil(moe.capacity_factor * tokens * m / hosts), tokens), min(moe.min_capacity, tokens))


def second_hop_capacity(moe, tokens: int, hosts: int) -> int:
    """C2: rows one device sends each expert of its host on the second hop,
    ``ceil(cf * T * K / Eh)`` (the T x K assignments a device receives on average, over the host's
    Eh experts), at most every received assignment."""
    eh = moe.num_experts // hosts
    ch = host_capacity(moe, tokens, hosts)
    return max(min(math.ceil(moe.capacity_factor * tokens * moe.top_k / eh), hosts * ch * moe.top_k), moe.min_capacity)


def _groups(hosts: int, per_host: int) -> tuple[list[list[int]], list[list[int]]]:
    """(between hosts: the ranks of each local index; inside hosts: the ranks of each host)."""
    between = [[h * per_host + g for h in range(hosts)] for g in range(per_host)]
    inside = [[h * per_host + g for g in range(per_host)] for h in range(hosts)]
    return between, inside


def _a2a(x, groups):
    return jax.lax.all_to_all(x, EXPERT_AXIS, 0, 0, tiled=True, axis_index_groups=groups)


def _slots(onehot_nx: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Position-order slots of n items over x targets: (slot [n] int32, kept [n] bool)."""
    pos = jnp.cumsum(onehot_nx, axis=0) - 1
    slot = jnp.sum(jnp.where(onehot_nx, pos, 0), axis=1)
    return slot.astype(jnp.int32), jnp.any(onehot_nx, axis=1) & (slot < capacity)


def _table(target_n, slot_n, kept_n, targets: int, capacity: int, empty: int):
    """[targets, capacity] item index of each slot (``empty`` where none)."""
    n = target_n.shape[0]
    return jnp.full((targets, capacity), empty, jnp.int32).at[
        jnp.where(kept_n, target_n, targets), slot_n].set(jnp.arange(n, dtype=jnp.int32), mode="drop",
                                                         unique_indices=True)


def _pad(x):
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])


def _move(x, table1, table2, between, inside, hosts, per_host):
    """The dispatch's data movement of rows ``x`` [T, ...] (any dtype, any trailing width): rows
    by host (``table1`` [H, Ch]) → between hosts → by expert of the host (``table2`` [Eh, C2]) →
    inside the host → [El, G·C2, ...]. Linear in ``x``."""
    sent = _pad(x)[table1]  # [H, Ch, ...]
    got = _a2a(sent, between).reshape(-1, *x.shape[1:])  # [H·Ch, ...] rows from each host's peer
    by_expert = _pad(got)[table2]  # [Eh, C2, ...]
    eh, c2 = by_expert.shape[:2]
    el = eh // per_host
    y = _a2a(by_expert.reshape(per_host, el, c2, *x.shape[1:]), inside)  # [G(src), El, C2, ...]
    return jnp.swapaxes(y, 0, 1).reshape(el, per_host * c2, *x.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _move_fp8(x, table1, table2, between, inside, hosts, per_host, dtype):
    moved = _move(fp8_pack(*fp8_quantize(x)), table1, table2, between, inside, hosts, per_host)
    return fp8_dequantize(*fp8_unpack(moved, x.shape[-1]), dtype)


def _move_fp8_fwd(x, table1, table2, between, inside, hosts, per_host, dtype):
    return _move_fp8(x, table1, table2, between, inside, hosts, per_host, dtype), (x, table1, table2)


def _move_fp8_bwd(between, inside, hosts, per_host, dtype, res, g):
    x, table1, table2 = res  # straight through the rounding: the movement's transpose, in g's dtype
    _, vjp = jax.vjp(lambda a: _move(a, table1, table2, between, inside, hosts, per_host).astype(g.dtype),
                     x.astype(g.dtype))
    return vjp(g)[0].astype(x.dtype), None, None


_move_fp8.defvjp(_move_fp8_fwd, _move_fp8_bwd)


def hierarchical_exchange(x_td, r, w_in_edf, w_out_efd, dtype, moe, *, ep: int, per_host: int,
                          expert_ffn, checkpoint=lambda a, name: a, names: tuple[str, str] = ("", ""),
                          chunks: int = 1):
    """The routed experts' gated sum of this device's tokens by the two-hop exchange (module
    docstring), inside ``jax.shard_map`` over an ``expert`` axis of ``ep`` = H x ``per_host``.

    Args:
      x_td: [T, D] this device's tokens.
      r: their routing (:class:`~moefast.routing.RoutingResult`) with a capacity of T (nothing
        dropped there: the two hops have their own capacities); ``slot < 0`` marks masked tokens.
      w_in_edf, w_out_efd: this device's El experts, [El, D, 2F] and [El, F, D].
      dtype: the experts' compute dtype.
      moe: the MoE options (capacity_factor, min_capacity, num_groups, topk_groups, top_k,
        dispatch_dtype).
      ep, per_host: the expert axis's size and its GPUs per host (G; ep divisible by G).
      expert_ffn: ``(x_ecd, w_in, w_out, dtype) -> y_ecd``, the experts.
      checkpoint: ``(array, name) -> array`` naming the experts' input and output for remat.
      names: those two names (the remat policies' ``EXPERT_IN`` and ``EXPERT_OUT``).
      chunks: n, the tokens in n slices in position order, each exchanged on its own two hops with
        capacities for T/n tokens, slice i's experts ordered after slice i-1's
        (``jax.lax.optimization_barrier``: unordered, XLA:GPU's dot merger joins them into one dot
        that waits for every dispatch). Independent chains, so XLA's scheduler can run one slice's
        exchange while another's experts compute (``moe.overlap_chunks``; the two micro-batches of
        DeepSeek-V3's overlap, sec. 3.2.1, inside one layer). Nothing dropped: equal to n = 1 to
        float rounding.

    Raises:
      ValueError: T not divisible by ``chunks``.

    Returns:
      ``(y_td, dropped)``: [T, D] in ``dtype`` and the [] int32 assignments this device dropped
      (on either hop: the first hop's on the sending device, the second's on the receiving one).
    """
    t = x_td.shape[0]
    if chunks < 1 or t % chunks:  # moe_ffn and the Trainer check it first (expert.check_hierarchical)
        raise ValueError(f"{chunks} slices do not divide {t} tokens")
    tn = t // chunks
    ys, dropped, prev = [], jnp.zeros((), jnp.int32), None
    for i in range(chunks):
        def ffn(x, w_in, w_out, dt, prev=prev):
            if prev is not None:  # this slice's experts after the previous slice's (docstring)
                x, _ = jax.lax.optimization_barrier((x, prev))
            return expert_ffn(x, w_in, w_out, dt)
        part = slice(i * tn, (i + 1) * tn)
        y_td, dropped_i, prev = _two_hops(x_td[part], r.slot[part], r.expert_index[part], r.gates[part], w_in_edf,
                                          w_out_efd, dtype, moe, ep=ep, per_host=per_host, expert_ffn=ffn,
                                          checkpoint=checkpoint, names=names)
        ys.append(y_td)
        dropped = dropped + dropped_i
    return (ys[0] if chunks == 1 else jnp.concatenate(ys)), dropped


def _two_hops(x_td, slot_tk, expert_index_tk, gates_tk, w_in_edf, w_out_efd, dtype, moe, *, ep, per_host, expert_ffn,
              checkpoint, names):
    """:func:`hierarchical_exchange` of one slice of tokens: ``(y_td, dropped, the experts' output)``."""
    t, d = x_td.shape
    k = expert_index_tk.shape[1]
    e = moe.num_experts
    hosts = ep // per_host
    eh = e // hosts
    ch = host_capacity(moe, t, hosts)
    c2 = second_hop_capacity(moe, t, hosts)
    between, inside = _groups(hosts, per_host)

    # hop 1: each token's row once per destination host, in position order
    valid_tk = slot_tk >= 0
    host_tk = expert_index_tk // eh
    to_th = jnp.any((host_tk[:, :, None] == jnp.arange(hosts)[None, None]) & valid_tk[..., None], axis=1)
    pos_th = jnp.cumsum(to_th, axis=0) - 1
    kept_th = to_th & (pos_th < ch)
    table1 = jnp.full((hosts, ch), t, jnp.int32).at[
        jnp.where(kept_th, jnp.arange(hosts)[None], hosts), pos_th].set(
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, hosts)), mode="drop")
    # each host-row's experts within that host (-1: elsewhere or masked) and gates
    here_thk = (host_tk[:, None, :] == jnp.arange(hosts)[None, :, None]) & valid_tk[:, None, :]
    local_thk = jnp.where(here_thk, expert_index_tk[:, None, :] - jnp.arange(hosts)[None, :, None] * eh, -1)
    gate_thk = jnp.where(here_thk, gates_tk[:, None, :], 0.0)
    rows = jnp.arange(hosts)[:, None]
    meta_e = _pad(local_thk)[table1, rows]  # [H, Ch, K]
    meta_e = jnp.where((table1 < t)[..., None], meta_e, -1)
    meta_g = _pad(gate_thk)[table1, rows]  # [H, Ch, K] float32
    # one collective for both (the indices' bits carried as float32): a small all-to-all between
    # hosts costs its launch and round trips whatever its size
    meta = jnp.concatenate([jax.lax.bitcast_convert_type(meta_e, jnp.float32), meta_g], axis=-1)
    got = _a2a(meta, between).reshape(hosts * ch, 2 * k)  # rows received, by source host
    got_e = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(got[:, :k]), jnp.int32)
    got_g = got[:, k:]
    dropped1 = jnp.sum(jnp.where(to_th & ~kept_th, jnp.sum(here_thk, axis=2), 0))

    # hop 2: the received assignments by expert of this host, position order over (row, choice)
    n = hosts * ch * k
    ex_n = got_e.reshape(n)
    onehot = (ex_n[:, None] == jnp.arange(eh)[None]) & (ex_n[:, None] >= 0)
    slot_n, kept_n = _slots(onehot, c2)
    table2_n = _table(ex_n, slot_n, kept_n, eh, c2, n)  # assignment index of each (expert, slot)
    table2 = jnp.where(table2_n < n, table2_n // k, hosts * ch)  # -> received row (hosts*ch: zero row)
    dropped2 = jnp.sum((ex_n >= 0) & ~kept_n)

    x = x_td.astype(dtype)
    if moe.dispatch_dtype == "float8_e4m3fn":
        xin = _move_fp8(x, table1, table2, between, inside, hosts, per_host, jnp.dtype(dtype))
    else:
        xin = _move(x, table1, table2, between, inside, hosts, per_host)
    el = eh // per_host
    y = expert_ffn(checkpoint(xin, names[0]), w_in_edf, w_out_efd, dtype)  # [El, G·C2, D]
    y = checkpoint(y, names[1])
    # back inside the host, gated sums per received row, back between hosts, summed per token
    y = _a2a(jnp.swapaxes(y.reshape(el, per_host, c2, d), 0, 1), inside).reshape(eh * c2, d)
    row_n = jnp.where(kept_n, ex_n * c2 + slot_n, eh * c2)
    y_n = _pad(y)[row_n].astype(jnp.float32) * jnp.where(kept_n, got_g.reshape(n), 0.0)[:, None]
    y_rows = jnp.sum(y_n.reshape(hosts * ch, k, d), axis=1).astype(dtype)  # [H·Ch, D]
    back = _a2a(y_rows.reshape(hosts, ch, d), between)  # [H(dest host), Ch, D]
    y_th = _pad(back.reshape(hosts * ch, d))[jnp.where(kept_th, jnp.arange(hosts)[None] * ch + pos_th, hosts * ch)]
    y_td = jnp.sum(jnp.where(kept_th[..., None], y_th.astype(jnp.float32), 0.0), axis=1)
    return y_td.astype(dtype), (dropped1 + dropped2).astype(jnp.int32), y
