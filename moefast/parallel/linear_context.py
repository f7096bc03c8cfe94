"""Context parallelism through linear-attention layers (Gated DeltaNet, KDA): the recurrent state
passed between the devices of the ``context`` axis, not the activations.

Dimension letters: B batch, T tokens of a row, L = T / 2c tokens of a piece, c the context axis's
size, H heads, K key width, V value width, W conv kernel width, Ch conv channels.

The rows arrive in :mod:`moefast.parallel.context`'s balanced order: device j holds pieces j and
2c - 1 - j of every row (tokens in the row's order inside each piece). A linear-attention layer
is a recurrence over the whole row, so each piece needs what came before it in the row, wherever
that lives. Two things cross the pieces' boundaries, both small:

* **The short convolution's halo.** Each piece's last W - 1 inputs and their document ids are
  all-gathered along the axis (2c · (W - 1) tokens a row); each piece prepends its predecessor's
  (zeros before the row's start) and the convolution masks taps in another document as it does
  inside a piece (:func:`moefast.model.gated_deltanet.causal_conv`).

* **The recurrent state.** The gated delta rule's state update is affine in the state:
  ``S_t = A_t S_{t-1} + beta_t k_t v_t^T`` with ``A_t = diag(exp(g_t)) (I - beta_t k_t k_t^T)``
  (Yang et al. 2024, arXiv:2412.06464, eq. 10; KDA: g per key channel). So is every output,
  ``o_t = scale q_t^T S_t``. Each piece is run once from the zero state with the values widened by
  K zero columns and the initial state ``[0 | I]`` [K, V + K]: the first V columns give the
  piece's outputs and final state from zero (``o_loc``, ``S_loc``), the last K give ``scale q_t^T
  P_t`` with ``P_t = A_t ... A_1`` (zero after a document start inside the piece) and the piece's
  transition ``M = P_L`` [K, K]. The pieces' ``(M, S_loc)`` [H, K, K + V] float32 and first and
  last document ids are all-gathered along the axis; every device folds them in the row's order,
  ``S_in(p) = [doc continues] (M_{p-1} S_in(p-1) + S_loc_{p-1})``, and corrects its outputs:
  ``o = o_loc + (scale q^T P) S_in``. This is the state passing of fla's context parallelism
  (flash-linear-attention PR #691) in a single kernel call per piece: the kernel does (V + K) / V
  of the work of an unsplit layer, and the exchange is 2c states a row per layer, independent of T.

Reverse-mode AD goes through both exchanges (the all-gathers' transposes are reduce-scatters), so
gradients equal those of whole rows. The balanced order is kept (each device's two pieces are
independent runs), so the attention layers' load balance costs the linear layers nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moefast.parallel.context import CONTEXT_AXIS, context_size
from moefast.parallel.mesh import reshard_for_shard_map, token_shards

__all__ = ["HALO", "STATES", "context_causal_conv", "context_delta_rule", "state_bytes"]

# the exchanges' names in the compiled program's op names (the gpu-compile report counts their bytes)
HALO, STATES = "linear_context_halo", "linear_context_states"


def _pieces(c: int) -> tuple[list[int], list[int]]:
    """For the row's pieces in order p = 0 .. 2c-1: the device holding it and its slot (0, 1) there."""
    return [p if p < c else 2 * c - 1 - p for p in range(2 * c)], [0 if p < c else 1 for p in range(2 * c)]


def _in_row_order(gathered):
    """[c, B, 2, ...] (device, row, slot) gathered along the axis -> [2c, B, ...] in the row's order."""
    dev, slot = _pieces(gathered.shape[0])
    return jnp.stack([gathered[d, :, s] for d, s in zip(dev, slot)])


def _own(row_order, c: int):
    """This device's two entries [B, 2, ...] of [2c, B, ...] (pieces j and 2c - 1 - j)."""
    j = jax.lax.axis_index(CONTEXT_AXIS)
    return jnp.stack([row_order[j], row_order[2 * c - 1 - j]], axis=1)


def _split(arrays, where: str):
    c = context_size()
    b, t = arrays[0].shape[:2]
    if t % (2 * c):
        raise ValueError(f"{where}: context parallelism over {c} devices needs a row length that is a multiple of "
                         f"{2 * c}, got {t}")
    rows = token_shards(where)[0] or None
    return c, t // (2 * c), P(rows, CONTEXT_AXIS)


def context_causal_conv(conv, x_btc: jax.Array, w_wc: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """``conv`` (:func:`moefast.model.gated_deltanet.causal_conv`) over rows split along ``context``
    in the balanced order, each piece continuing its predecessor in the row (module docstring).

    Args:
      conv: ``(x [N, L, Ch], w, prev [N, W-1, Ch], ids [N, L], prev_ids [N, W-1]) -> (out, last)``.
      x_btc: [B, T, Ch] the convolution's inputs, any float dtype, balanced order, T over ``context``.
      w_wc: [W, Ch] float32 taps (whole on every device; their gradient summed over the mesh).
      segment_ids_bt: [B, T] int document ids in the balanced order.

    Returns:
      [B, T, Ch] in x's dtype, balanced order, split like x.

    Raises:
      ValueError: T not a multiple of 2c, or a piece (T / 2c tokens) shorter than W - 1.
    """
    c, piece, split = _split((x_btc,), "linear attention")
    w = w_wc.shape[0]
    if piece < w - 1:
        raise ValueError(f"linear attention with context parallelism: each device's pieces hold T / 2c = {piece} "
                         f"tokens, fewer than the convolution's {w - 1} earlier taps; raise data.seq_len or lower "
                         f"mesh.context")

    def local(x, seg, taps):
        b, _, ch = x.shape
        x, seg = x.reshape(b, 2, piece, ch), seg.reshape(b, 2, piece)
        with jax.named_scope(HALO):
            # float32: the taps' gradients come back reduce-scattered in float32, not rounded to bfloat16
            tails = jax.lax.all_gather((x[:, :, piece - (w - 1):].astype(jnp.float32), seg[:, :, piece - (w - 1):]),
                                       CONTEXT_AXIS)
        # the piece before p in the row: zeros (and no document) before the row's first piece
        before = [jnp.concatenate([jnp.full_like(a[:1], fill), a[:-1]]) for a, fill in
                  zip(map(_in_row_order, tails), (0, -1))]
        prev_x, prev_seg = (_own(a, c) for a in before)  # [B, 2, W-1, ...]
        out, _ = conv(x.reshape(2 * b, piece, ch), taps, prev_x.reshape(2 * b, w - 1, ch),
                      seg.reshape(2 * b, piece), prev_seg.reshape(2 * b, w - 1))
        return out.reshape(b, 2 * piece, ch)

    args, specs = (x_btc, segment_ids_bt, w_wc), (split, split, P())
    return jax.shard_map(local, in_specs=specs, out_specs=split, check_vma=False)(*reshard_for_shard_map(args, specs))


def context_delta_rule(rule, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                       segment_ids_bt: jax.Array) -> jax.Array:
    """The gated delta rule over rows split along ``context`` in the balanced order, the state
    passed between pieces (module docstring).

    Args:
      rule: ``(q, k, v, g, beta, segment_ids=, initial_state=) -> (o, final_state)``: the chosen
        implementation of :func:`moefast.kernels.gated_delta_rule.gated_delta_rule` (on one
        device's rows, inside ``jax.shard_map``).
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or [B, T, H, K] log decays; beta: [B, T, H];
        all in the balanced order, T split over ``context`` (as :func:`gated_delta_rule` takes them).
      segment_ids_bt: [B, T] int document ids in the balanced order.

    Returns:
      o [B, T, H, V] in v's dtype, balanced order, split like q: equal to the unsplit rows' outputs.

    Raises:
      ValueError: T not a multiple of 2c.
    """
    c, piece, split = _split((q,), "linear attention")
    h, kd, vd = q.shape[2], q.shape[3], v.shape[3]

    def local(q, k, v, g, beta, seg):
        b = q.shape[0]
        two = lambda a: a.reshape(2 * b, piece, *a.shape[2:])  # [B, 2L, ...] -> [2B, L, ...]: a run per piece
        wide = jnp.concatenate([v, jnp.zeros((*v.shape[:3], kd), v.dtype)], axis=-1)
        s0 = jnp.broadcast_to(jnp.concatenate([jnp.zeros((kd, vd), jnp.float32), jnp.eye(kd, dtype=jnp.float32)], 1),
                              (2 * b, h, kd, vd + kd))
        o, s = rule(two(q), two(k), two(wide), two(g), two(beta), segment_ids=two(seg), initial_state=s0)
        seg = seg.reshape(b, 2, piece)
        with jax.named_scope(STATES):
            summary = jax.lax.all_gather((s.reshape(b, 2, h, kd, vd + kd), seg[:, :, 0], seg[:, :, -1]), CONTEXT_AXIS)
        s_all, first, last = map(_in_row_order, summary)  # [2c, B, ...]
        incoming, state = [], jnp.zeros((b, h, kd, vd), jnp.float32)
        for p in range(2 * c):  # static: the row's pieces in order
            cont = (first[p] == last[p - 1])[:, None, None, None] if p else False
            state = jnp.where(cont, state, 0.0)
            incoming.append(state)
            state = jnp.einsum("bhkj,bhjv->bhkv", s_all[p, ..., vd:], state,
                               precision=jax.lax.Precision.HIGHEST) + s_all[p, ..., :vd]
        s_in = _own(jnp.stack(incoming), c).reshape(2 * b, h, kd, vd)
        fix = jnp.einsum("nthk,nhkv->nthv", o[..., vd:].astype(jnp.float32), s_in, precision=jax.lax.Precision.HIGHEST)
        return (o[..., :vd].astype(jnp.float32) + fix).astype(v.dtype).reshape(b, 2 * piece, h, vd)

    args, specs = (q, k, v, g, beta, segment_ids_bt), (split,) * 6
    return jax.shard_map(local, in_specs=specs, out_specs=split, check_vma=False)(*reshard_for_shard_map(args, specs))


def state_bytes(batch: int, heads: int, key_dim: int, value_dim: int, context: int) -> int:
    """Bytes of the states' all-gather result on one device, per linear-attention layer and
    forward pass, with context parallelism over ``context`` devices: every device's 2 pieces a row
    of ``(M, S_loc)`` float32 [H, K, K + V] and two int32 document ids; the device receives
    (context - 1) / context of it (the convolution's halo, 2 (W - 1) tokens a row, is apart).
    ``batch`` counts this device's rows; independent of the row length."""
    return context * batch * 2 * (heads * key_dim * (key_dim + value_dim) * 4 + 8)
