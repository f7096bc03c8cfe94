"""Fused (flash) causal attention over packed documents: moefast's Pallas Triton kernel, forward and
backward, with queries that may start past the first key and a differentiable log-sum-exp.

Dimension letters: B batch, T queries, S keys, H query heads, G key/value heads, Hd head dimension
of queries and keys, Hv of values.

Online softmax over key blocks (Dao et al. 2022, FlashAttention, Algorithm 1; the backward of Dao
2023, FlashAttention-2, Algorithm 2, recomputing the probabilities from the saved log-sum-exp). Its
memory is linear in T and S: nothing of size T × S is ever stored. Beyond a plain causal kernel:

* **a query offset**: query t sits at position ``q_offset + t`` of the keys' sequence, so a slice of
  a row's queries attends to the whole row's keys (moefast carries two sequence slices through the
  layers: the second slice's queries start at ``q_offset = T``);
* **the log-sum-exp as an output**, differentiable: two attentions over disjoint key sets merge
  exactly (``o = Σ_i exp(lse_i − lse) · o_i`` with ``lse = logsumexp_i lse_i``). Its cotangent
  enters the backward as ``dS = P ∘ (dP − D + dlse)``, ``D = rowsum(dO ∘ O)`` (FlashAttention-2,
  Algorithm 2, line 19, with the extra term of ``∂lse/∂S = P``);
* **grouped-query heads natively**: query head h reads key/value head ``h // (H / G)`` (no repeated
  keys in memory); the key/value gradients of a group's query heads are summed after the kernel;
* **key and value widths of their own** (MLA: Hd = 192 against Hv = 128 in DeepSeek-V3): each is
  loaded in a block of the next power of two, masked, nothing padded in memory;
* **a sliding window** (gpt-oss, Gemma, MiniMax): query t sees only its W latest keys; key blocks
  wholly outside the window are skipped by each kernel's loop bounds, so its work grows linearly
  in T;
* **attention sinks** (gpt-oss): a learned logit per head joins the denominator of every softmax
  in the forward's last step. The backward kernels need nothing new (the saved log-sum-exp holds
  the sink); the sink's gradient, ``dσ_h = Σ_t exp(σ_h − lse_t) (dlse_t − D_t)``, is a sum over
  the saved rows outside the kernels: no second pass over the keys;
* **each query's largest logit as an output** (``return_max``), not differentiated: the forward's
  running row maximum before the sink joins it, in natural units (the logit ``q·k·scale``), for
  QK-clip (MuonClip; Kimi K2, arXiv 2507.20534, sec. 2.1) at no extra pass over the keys;
* rows whose every key is masked give zeros (and a log-sum-exp of −inf), not NaN.

On GPU the kernels are compiled by Triton; on CPU they run in the Pallas interpreter (slow: tests).
Written after reading (not copying) JAX's ``jax.experimental.pallas.ops.gpu.attention``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..platform import target_platform
from .reference import validate, validate_options

__all__ = ["KERNEL_NAME", "flash_attention", "kernel_name", "padded_length", "visited_pairs"]

BLOCK = 128  # query and key rows per forward block
BACKWARD_BLOCK = 32  # query and key rows per backward block (two accumulators of a block live in registers)
_LOG2E = math.log2(math.e)


def padded_length(t: int, block: int = BLOCK) -> tuple[int, int]:
    """``(block rows, padded T)``: a power-of-two block of at most ``block`` rows (at least 16, for
    the tensor cores) and T rounded up to a multiple of it."""
    rows = min(block, max(16, 1 << (t - 1).bit_length()))
    return rows, -(-t // rows) * rows


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _Mask:
    """Who sees whom, static: query t sits at key position ``q_offset + t`` and sees key s when
    ``s <= q_offset + t`` (causal), ``s < kv_len`` (not padding), the two segment ids are equal
    and, with a ``window`` W > 0, ``q_offset + t - s < W`` (the W latest keys, itself included)."""
    q_offset: int
    kv_len: int
    window: int = 0

    def logits(self, q, k, q_seg, k_seg, q_start, k_start, scale: float):
        """Masked base-2 logits of a [bq, Hd] query block against a [bk, Hd] key block, and the mask."""
        s = plgpu.dot(q, k.T) * (scale * _LOG2E)
        q_pos = self.q_offset + q_start + jnp.arange(q.shape[0])
        k_pos = k_start + jnp.arange(k.shape[0])
        mask = (q_pos[:, None] >= k_pos[None, :]) & (k_pos < self.kv_len)[None, :] & (q_seg[:, None] == k_seg[None, :])
        if self.window:
            mask &= q_pos[:, None] - k_pos[None, :] < self.window
        return jnp.where(mask, s, -jnp.inf), mask

    def key_blocks(self, q_block, block_q: int, block_k: int, n_k: int):
        """Key blocks [lo, hi) that query block ``q_block`` may see: causal up to its last
        position; with a window, from the first key its first query still sees (blocks wholly
        outside are skipped, not masked)."""
        first_q = self.q_offset + q_block * block_q
        hi = jnp.minimum(lax.div(first_q + block_q + block_k - 1, block_k), n_k)
        lo = lax.div(jnp.maximum(first_q - self.window + 1, 0), block_k) if self.window else 0
        return lo, hi

    def query_blocks(self, k_block, block_q: int, block_k: int, n_q: int):
        """Query blocks [lo, hi) that see some key of ``k_block`` (the transpose of :meth:`key_blocks`)."""
        lo = lax.div(jnp.maximum(k_block * block_k - self.q_offset, 0), block_q)
        if not self.window:
            return lo, n_q
        last_q = (k_block + 1) * block_k - 1 + self.window - 1 - self.q_offset  # the last query index seeing it
        return lo, jnp.clip(lax.div(jnp.maximum(last_q, -1) + block_q, block_q), lo, n_q)

    def probabilities(self, q, k, q_seg, k_seg, lse2, q_start, k_start, scale: float):
        s, mask = self.logits(q, k, q_seg, k_seg, q_start, k_start, scale)
        return jnp.where(mask, jnp.exp2(s - jnp.where(lse2 == -jnp.inf, 0.0, lse2)[:, None]), 0.0)


def kernel_name(kind: str, block_q: int, block_k: int, mask: _Mask) -> str:
    """A launch's name, ``moefast_flash_{kind}_q{block_q}_k{block_k}_o{q_offset}_w{window}``
    (``kind``: forward, dkdv, dq; window 0: none): what :func:`visited_pairs` needs to count the
    launch's work from its grid (the compiled program names its kernels so)."""
    return f"moefast_flash_{kind}_q{block_q}_k{block_k}_o{mask.q_offset}_w{mask.window}"


KERNEL_NAME = re.compile(r"moefast_flash_(forward|dkdv|dq)_q(\d+)_k(\d+)_o(\d+)_w(\d+)")
"""Parses :func:`kernel_name`: kind, block_q, block_k, q_offset, window."""


def visited_pairs(kind: str, t: int, s: int, block_q: int, block_k: int, q_offset: int = 0, window: int = 0) -> int:
    """(query, key) pairs one head of one row of a launch computes — its blocks' rows x columns
    over the key blocks each program's loop visits (the forward's and dQ's per query block, dK/dV's
    per key block; the loop bounds of :class:`_Mask`), for T queries and S keys (padded to the
    blocks). Linear in T with a ``window`` (each loop visits at most ceil((W + bq - 1) / bk) + 1
    blocks), quadratic without."""
    mask = _Mask(q_offset, s, window)
    n_q, n_k = -(-t // block_q), -(-s // block_k)
    total = 0
    if kind in ("forward", "dq"):
        for i in range(n_q):
            lo, hi = mask.key_blocks(i, block_q, block_k, n_k)
            total += max(int(hi) - int(lo), 0)
    else:
        for j in range(n_k):
            lo, hi = mask.query_blocks(j, block_q, block_k, n_q)
            total += max(int(hi) - int(lo), 0)
    return total * block_q * block_k


def _feature_masks(qk_ref, v_ref, hd: int, hv: int):
    """[1, width] masks of the real features of a query/key block and a value block (each loaded
    in a block of the next power of two)."""
    return (jnp.arange(qk_ref.shape[-1]) < hd)[None, :], (jnp.arange(v_ref.shape[-1]) < hv)[None, :]


def _offset(mask: _Mask, off_ref) -> _Mask:
    """The mask with the query offset read from ``off_ref`` (an int32 [1] operand: a traced offset,
    each device its own under ``shard_map``), or as it is when the offset is static."""
    return mask if off_ref is None else dataclasses.replace(mask, q_offset=jnp.max(off_ref[...]))


def _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, sink_ref, off_ref, o_ref, lse_ref, *max_ref, scale,
                    mask: _Mask, block_k, hd, hv):
    """One query block of one head: the output rows, their base-2 log-sum-exp and, with a
    ``max_ref`` (``_Static.record_max``), each row's largest scaled logit in natural units (−inf for
    a row that sees no key; the sink not included)."""
    block_q = q_ref.shape[0]
    mask = _offset(mask, off_ref)
    i = pl.program_id(0)
    qmask, vmask = _feature_masks(q_ref, v_ref, hd, hv)
    q = plgpu.load(q_ref, mask=qmask, other=0.0)
    q_seg = qseg_ref[...]

    def body(j, carry):
        o, m, l = carry
        keys = pl.ds(j * block_k, block_k)
        k = plgpu.load(k_ref.at[keys, :], mask=qmask, other=0.0)
        s, seen = mask.logits(q, k, q_seg, kseg_ref[keys], i * block_q, j * block_k, scale)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row masked so far: exp2 of -inf, not NaN
        p = jnp.where(seen, jnp.exp2(s - m_safe[:, None]), 0.0)
        correction = jnp.exp2(m - m_safe)
        v = plgpu.load(v_ref.at[keys, :], mask=vmask, other=0.0)
        o = correction[:, None] * o + plgpu.dot(p.astype(v.dtype), v)
        return o, m_new, correction * l + p.sum(axis=-1)

    carry = (jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    o, m, l = lax.fori_loop(*mask.key_blocks(i, block_q, block_k, k_ref.shape[0] // block_k), body, carry)
    if max_ref:  # the running maximum is base-2 (scaled by log2 e): back to the logit q·k·scale
        max_ref[0][...] = m / _LOG2E
    if sink_ref is not None:  # the head's sink logit joins the denominator (no value: it adds nothing to o)
        sink2 = sink_ref[...].astype(jnp.float32) * _LOG2E  # [1], not scaled: a logit as it is
        m_new = jnp.maximum(m, sink2)
        correction = jnp.exp2(m - m_new)
        o, m, l = correction[:, None] * o, m_new, correction * l + jnp.exp2(sink2 - m_new)
    seen = l > 0
    o = jnp.where(seen[:, None], o / jnp.where(seen, l, 1.0)[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)  # base 2
    plgpu.store(o_ref, o.astype(o_ref.dtype), mask=vmask)


def _dkdv_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, off_ref, dk_ref, dv_ref, *,
                 scale, mask: _Mask, block_q, hd, hv):
    block_k = k_ref.shape[0]
    mask = _offset(mask, off_ref)
    j = pl.program_id(2)
    qmask, vmask = _feature_masks(k_ref, v_ref, hd, hv)
    k = plgpu.load(k_ref, mask=qmask, other=0.0)
    v = plgpu.load(v_ref, mask=vmask, other=0.0)
    k_seg = kseg_ref[...]

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(i * block_q, block_q)
        q = plgpu.load(q_ref.at[rows, :], mask=qmask, other=0.0)
        do = plgpu.load(do_ref.at[rows, :], mask=vmask, other=0.0)
        p = mask.probabilities(q, k, qseg_ref[rows], k_seg, lse_ref[rows], i * block_q, j * block_k, scale)
        dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
        ds = p * (plgpu.dot(do, v.T) - delta_ref[rows][:, None])
        dk = dk + plgpu.dot(ds.astype(q.dtype).T, q)
        return dk, dv

    dk, dv = lax.fori_loop(*mask.query_blocks(j, block_q, block_k, q_ref.shape[0] // block_q), body,
                           (jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32),
                            jnp.zeros((block_k, v_ref.shape[-1]), jnp.float32)))
    plgpu.store(dk_ref, (dk * scale).astype(dk_ref.dtype), mask=qmask)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=vmask)


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, off_ref, dq_ref, *,
               scale, mask: _Mask, block_k, hd, hv):
    block_q = q_ref.shape[0]
    mask = _offset(mask, off_ref)
    i = pl.program_id(2)
    qmask, vmask = _feature_masks(q_ref, v_ref, hd, hv)
    q = plgpu.load(q_ref, mask=qmask, other=0.0)
    do = plgpu.load(do_ref, mask=vmask, other=0.0)
    q_seg, lse2, delta = qseg_ref[...], lse_ref[...], delta_ref[...]

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        k = plgpu.load(k_ref.at[keys, :], mask=qmask, other=0.0)
        v = plgpu.load(v_ref.at[keys, :], mask=vmask, other=0.0)
        p = mask.probabilities(q, k, q_seg, kseg_ref[keys], lse2, i * block_q, j * block_k, scale)
        ds = p * (plgpu.dot(do, v.T) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(*mask.key_blocks(i, block_q, block_k, k_ref.shape[0] // block_k), body,
                       jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
    plgpu.store(dq_ref, (dq * scale).astype(dq_ref.dtype), mask=qmask)


def _params(block_a: int, block_b: int, width: int):
    return plgpu.CompilerParams(num_warps=4 if block_a * block_b < 128 * 128 or width <= 64 else 8, num_stages=2)


@dataclasses.dataclass(frozen=True)
class _Static:
    """The kernels' static parameters (hashable: one non-differentiable argument)."""
    scale: float
    mask: _Mask
    sinks: bool  # the forward reads a sink logit per head
    dynamic: bool  # the query offset is an int32 [1] operand (mask.q_offset only names the kernels)
    block_q: int
    block_k: int
    bwd_q: int
    bwd_k: int
    interpret: bool
    record_max: bool = False  # the forward also writes each query row's largest logit [B, H, T]


def _offset_spec(c: _Static):
    return pl.BlockSpec((1,), lambda *_: (0,)) if c.dynamic else None


def _forward(q, k, v, qseg, kseg, sinks, qoff, c: _Static):
    b, t, h, hd = q.shape
    s, g, hv = k.shape[1], k.shape[2], v.shape[-1]
    rep, wq, wv = h // g, _pow2(hd), _pow2(hv)
    kernel = functools.partial(_forward_kernel, scale=c.scale, mask=c.mask, block_k=c.block_k, hd=hd, hv=hv)
    bq = c.block_q
    sink_spec = pl.BlockSpec((1,), lambda i, bi, hi: (hi,)) if c.sinks else None
    rows = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))
    row_shape = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(t // bq, b, h),
        in_specs=[pl.BlockSpec((None, bq, None, wq), lambda i, bi, hi: (bi, i, hi, 0)),
                  pl.BlockSpec((None, s, None, wq), lambda i, bi, hi: (bi, 0, hi // rep, 0)),
                  pl.BlockSpec((None, s, None, wv), lambda i, bi, hi: (bi, 0, hi // rep, 0)),
                  pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i)),
                  pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0)),
                  sink_spec, _offset_spec(c)],
        out_specs=[pl.BlockSpec((None, bq, None, wv), lambda i, bi, hi: (bi, i, hi, 0)), rows,
                   *([rows] if c.record_max else [])],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, hv), q.dtype), row_shape, *([row_shape] if c.record_max else [])],
        compiler_params=_params(bq, c.block_k, max(wq, wv)),
        interpret=c.interpret, name=kernel_name("forward", bq, c.block_k, c.mask),
    )(q, k, v, qseg, kseg, sinks if c.sinks else None, qoff if c.dynamic else None)


def _backward(q, k, v, qseg, kseg, sinks, qoff, o, lse2, do, dlse, c: _Static):
    b, t, h, hd = q.shape
    s, g, hv = k.shape[1], k.shape[2], v.shape[-1]
    rep, wq, wv = h // g, _pow2(hd), _pow2(hv)
    bq, bk = c.bwd_q, c.bwd_k
    # D = rowsum(dO ∘ O) less the natural log-sum-exp's cotangent
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32)) - dlse
    common = dict(scale=c.scale, mask=c.mask, hd=hd, hv=hv)
    rows_t = pl.BlockSpec((None, None, t), lambda bi, hi, _: (bi, hi, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=bq, **common),
        grid=(b, h, s // bk),
        in_specs=[pl.BlockSpec((None, t, None, wq), lambda bi, hi, _: (bi, 0, hi, 0)),
                  pl.BlockSpec((None, bk, None, wq), lambda bi, hi, j: (bi, j, hi // rep, 0)),
                  pl.BlockSpec((None, bk, None, wv), lambda bi, hi, j: (bi, j, hi // rep, 0)),
                  pl.BlockSpec((None, t), lambda bi, hi, _: (bi, 0)),
                  pl.BlockSpec((None, bk), lambda bi, hi, j: (bi, j)),
                  pl.BlockSpec((None, t, None, wv), lambda bi, hi, _: (bi, 0, hi, 0)),
                  rows_t, rows_t, _offset_spec(c)],
        out_specs=[pl.BlockSpec((None, bk, None, wq), lambda bi, hi, j: (bi, j, hi, 0)),
                   pl.BlockSpec((None, bk, None, wv), lambda bi, hi, j: (bi, j, hi, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, s, h, hd), k.dtype), jax.ShapeDtypeStruct((b, s, h, hv), v.dtype)],
        compiler_params=_params(bq, bk, max(wq, wv)),
        interpret=c.interpret, name=kernel_name("dkdv", bq, bk, c.mask),
    )(q, k, v, qseg, kseg, do, lse2, delta, qoff if c.dynamic else None)
    rows_q = pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=bk, **common),
        grid=(b, h, t // bq),
        in_specs=[pl.BlockSpec((None, bq, None, wq), lambda bi, hi, i: (bi, i, hi, 0)),
                  pl.BlockSpec((None, s, None, wq), lambda bi, hi, _: (bi, 0, hi // rep, 0)),
                  pl.BlockSpec((None, s, None, wv), lambda bi, hi, _: (bi, 0, hi // rep, 0)),
                  pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i)),
                  pl.BlockSpec((None, s), lambda bi, hi, _: (bi, 0)),
                  pl.BlockSpec((None, bq, None, wv), lambda bi, hi, i: (bi, i, hi, 0)),
                  rows_q, rows_q, _offset_spec(c)],
        out_specs=pl.BlockSpec((None, bq, None, wq), lambda bi, hi, i: (bi, i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(bq, bk, max(wq, wv)),
        interpret=c.interpret, name=kernel_name("dq", bq, bk, c.mask),
    )(q, k, v, qseg, kseg, do, lse2, delta, qoff if c.dynamic else None)
    if rep > 1:  # a key/value head's gradient: the sum over its query heads
        dk = dk.reshape(b, s, g, rep, hd).sum(3, dtype=jnp.float32).astype(k.dtype)
        dv = dv.reshape(b, s, g, rep, hv).sum(3, dtype=jnp.float32).astype(v.dtype)
    dsinks = None
    if c.sinks:  # the sink enters only through the log-sum-exp: dσ_h = Σ_bt exp(σ_h - lse_bht) (dlse - D)
        p_sink = jnp.exp2(sinks.astype(jnp.float32)[None, :, None] * _LOG2E - lse2)
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, dsinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, qseg, kseg, sinks, qoff, c: _Static):
    """``(o, natural lse)``, and the rows' largest logits with ``c.record_max`` (not differentiated:
    the backward ignores their cotangent)."""
    return _flash_fwd(q, k, v, qseg, kseg, sinks, qoff, c)[0]


def _flash_fwd(q, k, v, qseg, kseg, sinks, qoff, c: _Static):
    o, lse2, *row_max = _forward(q, k, v, qseg, kseg, sinks, qoff, c)
    return (o, lse2 * math.log(2.0), *row_max), (q, k, v, qseg, kseg, sinks, qoff, o, lse2)


def _flash_bwd(c: _Static, res, cotangents):
    q, k, v, qseg, kseg, sinks, qoff, o, lse2 = res
    do, dlse = cotangents[:2]  # a third, the row maxima's, is ignored (they are not differentiated)
    dq, dk, dv, dsinks = _backward(q, k, v, qseg, kseg, sinks, qoff, o, lse2, do, dlse.astype(jnp.float32), c)
    return dq, dk, dv, None, None, dsinks, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check(q, k, v, seg, kv_seg, q_offset, window, sinks_h, block: int, dynamic_q_offset) -> None:
    """:func:`flash_attention`'s argument checks (its Raises)."""
    validate(q, k, v, seg, kv_seg)
    if not jnp.issubdtype(q.dtype, jnp.floating) or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    validate_options(q.shape[2], q_offset, window, sinks_h)
    if q.shape[1] < 1 or k.shape[1] < 1:
        raise ValueError(f"flash attention needs at least one query and one key; got T={q.shape[1]}, S={k.shape[1]}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16 (the tensor cores' tile), got {block}")
    if dynamic_q_offset is not None and (jnp.shape(dynamic_q_offset) != () or not jnp.issubdtype(
            jnp.result_type(dynamic_q_offset), jnp.integer)):
        raise ValueError(f"dynamic_q_offset must be an int [] array, got {jnp.result_type(dynamic_q_offset)}"
                         f"{list(jnp.shape(dynamic_q_offset))}")


def _pad(q, k, v, seg, kv_seg, tp: int, sp: int):
    """Queries to ``tp`` rows and keys and values to ``sp``, with int32 segment ids. Padding comes
    after every real query and key: the kernels mask padded keys by position (past S); padded
    queries are cut off (their cotangent is 0: they add nothing to the gradients)."""
    t, s = q.shape[1], k.shape[1]
    qseg = seg.astype(jnp.int32)
    kseg = qseg if kv_seg is None else kv_seg.astype(jnp.int32)
    if tp != t:
        q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
        qseg = jnp.pad(qseg, ((0, 0), (0, tp - t)), constant_values=-2)
    if sp != s:
        k, v = (jnp.pad(x, ((0, 0), (0, sp - s), (0, 0), (0, 0))) for x in (k, v))
        kseg = jnp.pad(kseg, ((0, 0), (0, sp - s)), constant_values=-1)
    return q, k, v, qseg, kseg


def flash_attention(q_bthd: jax.Array, k_bsgd: jax.Array, v_bsgd: jax.Array, segment_ids_bt: jax.Array, *,
                    kv_segment_ids_bs: jax.Array | None = None, q_offset: int = 0, window: int | None = None,
                    sinks_h: jax.Array | None = None, return_lse: bool = False, return_max: bool = False,
                    sm_scale: float | None = None, block: int = BLOCK, interpret: bool | None = None,
                    dynamic_q_offset: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """Causal grouped-query attention inside each packed document, without a [T, S] matrix.

    Args:
      q_bthd: [B, T, H, Hd] queries, float16/bfloat16/float32.
      k_bsgd: [B, S, G, Hd] keys, v_bsgd: [B, S, G, Hv] values, in the queries' dtype (H divisible
        by G; Hv may differ from Hd: MLA). S = T unless ``kv_segment_ids_bs`` is given.
      segment_ids_bt: [B, T] int document ids of the queries: query t sees key s when
        ``s <= q_offset + t`` and the two ids are equal.
      kv_segment_ids_bs: [B, S] int document ids of the keys; ``None``: ``segment_ids_bt`` (S = T).
      q_offset: static int >= 0, the keys' position of query 0 (a later slice of a row's queries
        against the row's keys: ``q_offset = S - T``). With ``dynamic_q_offset`` it only names the
        kernels (:func:`kernel_name`, read by cost models): pass the traced offset's mean.
      dynamic_q_offset: int32 [] traced offset used in place of ``q_offset`` inside the kernels
        (loop bounds and masks read it at run time), e.g. each device its own under
        ``jax.shard_map`` (context parallelism's chunks, :mod:`moefast.parallel.context`); the
        caller keeps it in ``[0, S - T]``. ``None``: ``q_offset``.
      window: static int W >= 1: a sliding window, query t sees only keys s with
        ``q_offset + t - s < W`` (the W latest positions, itself included: Hugging Face's
        ``sliding_window``); key blocks wholly outside it are skipped, not masked. ``None``: all.
      sinks_h: [H] learned sink logits (gpt-oss; Xiao et al. 2023, "attention sinks"): each head's
        logit joins every softmax's denominator, unscaled, with no value (a query may attend to
        "nothing"); differentiable. ``None``: none.
      return_lse: also return the [B, H, T] float32 natural log-sum-exp of each query's scaled
        logits (the sink's included; −inf where a query sees no key and there is no sink),
        differentiable: two attentions over disjoint keys merge exactly through it.
      return_max: also return the [B, H, T] float32 largest scaled logit ``q·k·sm_scale`` of each
        query over the keys it sees (the logit entering the softmax; masked keys and the sink
        excluded; −inf where it sees none): the forward kernel's running row maximum, written
        beside the log-sum-exp (no extra pass). Not differentiated (``stop_gradient``: its
        cotangent is ignored). For QK-clip (MuonClip; Kimi K2, arXiv 2507.20534, sec. 2.1).
      sm_scale: logit scale; ``None``: ``Hd ** -0.5``.
      block: rows of the forward kernel's query and key blocks (a power of two >= 16); at most 64
        for head widths above 128 and 32 above 256 (shared memory).
      interpret: run in the Pallas interpreter; ``None``: when compiling for CPU
        (:func:`~moefast.kernels.platform.target_platform`).

    Returns:
      [B, T, H, Hv] in the queries' dtype, then the log-sum-exp when ``return_lse``, then the
      largest logits when ``return_max`` (a tuple when either is asked for);
      differentiable (``jax.grad``/``jax.vjp``; not ``jax.jvp``) with respect to q, k, v and the
      sinks. Equals
      :func:`.reference.attention_reference` to float rounding; queries that see no key give 0.

    Raises:
      ValueError: bad shapes (:func:`.reference.validate`: S != T without ``kv_segment_ids_bs``),
        bad options (:func:`.reference.validate_options`: ``q_offset`` not a static int >= 0, a
        window below 1, sinks not a float [H] array), q/k/v not of one float dtype, T or S = 0, or
        ``block`` not a power of two >= 16.
    """
    _check(q_bthd, k_bsgd, v_bsgd, segment_ids_bt, kv_segment_ids_bs, q_offset, window, sinks_h, block,
           dynamic_q_offset)
    b, t, h, hd = q_bthd.shape
    s, hv = k_bsgd.shape[1], v_bsgd.shape[-1]
    if interpret is None:
        interpret = target_platform() == "cpu"
    if max(hd, hv) > 128:
        # Triton keeps a query block and two pipeline stages of key and value blocks in shared memory
        # (227 KiB per block on H100/H200): 128 rows of width 256 (MLA's 192, in a block of 256) need 320 KiB,
        # and so do 64 rows of width 512 (Gemma 4's full layers): those take 32.
        block = min(block, 64 if max(hd, hv) <= 256 else 32)
    block_q, tp = padded_length(t, block)
    block_k, sp = padded_length(s, block)
    bwd_q, bwd_k = min(BACKWARD_BLOCK, block_q), min(BACKWARD_BLOCK, block_k)
    q, k, v, qseg, kseg = _pad(q_bthd, k_bsgd, v_bsgd, segment_ids_bt, kv_segment_ids_bs, tp, sp)
    dynamic, scale = dynamic_q_offset is not None, hd ** -0.5 if sm_scale is None else float(sm_scale)
    static = _Static(scale, _Mask(int(q_offset), s, int(window or 0)), sinks_h is not None, dynamic, block_q, block_k,
                     bwd_q, bwd_k, bool(interpret), bool(return_max))
    sink_arr = jnp.zeros((h,), jnp.float32) if sinks_h is None else sinks_h
    qoff = jnp.reshape(jnp.asarray(dynamic_q_offset, jnp.int32), (1,)) if dynamic else jnp.zeros((1,), jnp.int32)
    o, lse, *row_max = _flash(q, k, v, qseg, kseg, sink_arr, qoff, static)
    row_max = [lax.stop_gradient(m) for m in row_max]
    if tp != t:
        o, lse, row_max = o[:, :t], lse[..., :t], [m[..., :t] for m in row_max]
    out = (o, *((lse,) if return_lse else ()), *row_max)
    return out if len(out) > 1 else o
