"""Pallas kernel for the routing operation: one pass over the logits, a grid over token blocks.

Dimension letters: T tokens, E experts, K top_k, B token blocks, Tb tokens per block
(``block_tokens``). Inside the kernel the expert and choice axes are padded to powers of two
(Ep >= E, Kp >= K) because the Triton lowering only accepts power-of-two block shapes; padded
experts are never chosen and padded choices are sliced off by :func:`routing_blocks`.

Per token block the kernel computes, in float32 whatever the logits' dtype:

* the softmax statistics (row max, logsumexp) and the probabilities, or, with sigmoid scores
  (:class:`.reference.Scoring`), the sigmoid affinities (:func:`.reference.sigmoid`);
* the choice scores (``logits + bias``, or ``sigmoid + bias``) and, with a group limit, each
  group's score (top-2 sum or max, per token: one masked max per group, a static loop over the G
  groups), the ``topk_groups`` best groups by ``topk_groups`` rounds of the max-then-lowest-index
  selection below (on the group score broadcast to the group's experts), and the other groups'
  experts replaced by -inf (never chosen), as :func:`.reference.group_limit` does;
* the top-k experts of the choice scores by K rounds (a ``fori_loop``) of "max over the experts
  not yet taken, then the lowest expert index that reaches it" (argmax written as
  ``min(where(x == max, iota, Ep))``, which lowers on GPU), so ties go to the lower expert index
  exactly as :func:`jax.lax.top_k` does (NaN scores are not supported);
* the gates: the chosen scores renormalised over the K choices (sigmoid: ``+ 1e-20`` in the
  denominator), times the scaling factor (0 for masked tokens);
* per choice rank k and expert e, the number of unmasked assignments in the block (``counts``),
  and each assignment's rank *within the block* among assignments of the same expert and the same
  choice rank: an inclusive prefix count over tokens of the one-hot ``[Tb, Ep]`` assignment
  matrix, read back at the chosen expert, minus one. ``rank_method="cumsum"`` (default) computes it
  with ``jnp.cumsum`` (lowered by the Triton backend to ``tt.scan``); ``"matmul"`` as a
  lower-triangular ``[Tb, Tb]`` bf16 matmul with float32 accumulation (exact for 0/1 entries; tensor
  cores; Triton's dot needs Tb >= 16 and pads Ep to >= 16);
* the block's partial ``prob_sum`` [Ep] and ``z_sum`` (sum of logsumexp² over unmasked tokens).

Compiled, the kernel goes through the Pallas Triton backend (``plt.CompilerParams``; deprecated
since jax 0.11 in favour of Mosaic GPU, still shipped); ``interpret=True`` runs it on CPU.

The global GShard position rank is then ``offset[k, block, e] + within-block rank``, where the
offsets are an exclusive prefix sum of ``counts`` over (k, block): see :mod:`.ops`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..platform import target_platform
from .reference import Scoring
from ..vma import out_struct as _out_struct, vary_together

__all__ = ["RANK_METHODS", "BlockOutputs", "check_block_tokens", "default_interpret", "next_power_of_2",
           "routing_blocks"]


class BlockOutputs(NamedTuple):
    """What the kernel produces for T tokens (already sliced back to T, K and E)."""

    expert_index: jax.Array  # [T, K] int32, chosen experts, best first
    gates: jax.Array  # [T, K] float32, renormalised chosen scores times the scale; 0 for masked tokens
    block_rank: jax.Array  # [T, K] int32, rank in the token block among same (k, expert); -1 masked
    counts: jax.Array  # [B, K, E] int32, unmasked assignments per block, choice rank and expert
    prob_sum: jax.Array  # [B, E] float32, per-block sum over unmasked tokens of the softmax (or normalised sigmoid)
    z_sum: jax.Array  # [B] float32, per-block sum over unmasked tokens of logsumexp**2


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_block_tokens(block_tokens: int, rank_method: str = "cumsum") -> None:
    """Raises ValueError unless ``block_tokens`` and ``rank_method`` can be compiled."""
    if rank_method not in RANK_METHODS:
        raise ValueError(f"rank_method={rank_method!r} is not one of {RANK_METHODS}")
    if not isinstance(block_tokens, int) or block_tokens < 1 or block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens={block_tokens} must be a positive power of two "
                         "(Triton block shapes are powers of two)")
    if rank_method == "matmul" and block_tokens < 16:
        raise ValueError(f"block_tokens={block_tokens} must be >= 16 with rank_method='matmul' (Triton dot)")


def default_interpret() -> bool:
    """Interpret mode by default when compiling for CPU (:func:`~moefast.kernels.platform.target_platform`),
    where Pallas kernels cannot be compiled."""
    return target_platform() == "cpu"


def _group_limit(sel, col, real, scoring: Scoring, num_experts: int):
    """:func:`.reference.group_limit` on one block [Tb, Ep] (padded experts: ``real`` False)."""
    ep = sel.shape[1]
    gs = num_experts // scoring.num_groups
    gid = col // gs  # >= G on padded experts
    group_score = jnp.zeros_like(sel)  # each expert holds its group's score
    for g in range(scoring.num_groups):  # static: G masked maxima over the block
        in_g = gid == g
        a = jnp.where(in_g, sel, -jnp.inf)
        m1 = jnp.max(a, axis=1, keepdims=True)
        if scoring.score_func == "sigmoid":  # sum of the two largest (a tie at the top counts twice)
            i1 = jnp.min(jnp.where(in_g & (a == m1), col, ep), axis=1, keepdims=True)
            m1 = m1 + jnp.max(jnp.where(col == i1, -jnp.inf, a), axis=1, keepdims=True)
        group_score = jnp.where(in_g, m1, group_score)
    kept = jnp.logical_not(real)  # padded experts never count as a group
    for _ in range(scoring.topk_groups):  # ties: the lower group index, as jax.lax.top_k
        avail = jnp.where(kept, -jnp.inf, group_score)
        best = jnp.max(avail, axis=1, keepdims=True)
        pick = jnp.min(jnp.where((avail == best) & jnp.logical_not(kept), gid, scoring.num_groups), axis=1)
        kept = kept | (gid == pick[:, None])
    return jnp.where(kept & real, sel, -jnp.inf)  # below every finite kept score: never chosen


def _routing_kernel(logits_ref, mask_ref, bias_ref, index_ref, gates_ref, rank_ref, counts_ref,
                    prob_sum_ref, z_ref, *, num_experts: int, top_k: int, rank_method: str,
                    scoring: Scoring = Scoring()):
    x = logits_ref[...].astype(jnp.float32)  # [Tb, Ep]
    tb, ep = x.shape
    kp = index_ref.shape[1]
    col = jax.lax.broadcasted_iota(jnp.int32, (tb, ep), 1)
    real = col < num_experts
    x = jnp.where(real, x, -jnp.inf)
    valid = mask_ref[...] != 0  # [Tb]
    sigmoid = scoring.score_func == "sigmoid"

    # The softmax as jax.nn.softmax computes it (max, exp, sum, divide). The sum's rounding order is
    # the backend's, so a probability may differ from the reference's in the last bit; the choice
    # does not depend on it (it is made on logits + bias, one exact float add).
    x_max = jnp.max(x, axis=1, keepdims=True)
    unnormalized = jnp.exp(x - x_max)
    denom = jnp.sum(unnormalized, axis=1, keepdims=True)
    probs = unnormalized / denom  # [Tb, Ep]; 0 on padded experts
    lse = jnp.log(denom[:, 0]) + x_max[:, 0]  # [Tb]

    if sigmoid:  # the reference's expression; 0 on padded experts (x = -inf)
        s = 1.0 / (1.0 + jnp.exp(-x))
        probs = s / jnp.sum(s, axis=1, keepdims=True)  # affinities normalised over the experts (statistics)
        score = s + bias_ref[...][None, :]
    else:
        s = probs
        score = x + bias_ref[...][None, :]  # selection on logits + bias: exact, identical in every impl
    if scoring.grouped:
        score = _group_limit(score, col, real, scoring, num_experts)
    kcol = jax.lax.broadcasted_iota(jnp.int32, (tb, kp), 1)
    krow = jax.lax.broadcasted_iota(jnp.int32, (kp, ep), 0)
    valid_te = valid[:, None]
    if rank_method == "matmul":  # tril[i, j] = 1 for j <= i
        tril = (jax.lax.broadcasted_iota(jnp.int32, (tb, tb), 1)
                <= jax.lax.broadcasted_iota(jnp.int32, (tb, tb), 0)).astype(jnp.bfloat16)

    def prefix_count(onehot):  # inclusive prefix sum over tokens, [Tb, Ep] int32
        if rank_method == "matmul":
            return jnp.dot(tril, onehot.astype(jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.int32)
        return jnp.cumsum(onehot, axis=0)

    def choose(k, carry):  # the k-th choice of every token in the block
        taken, index_acc, prob_acc, rank_acc, counts_acc, chosen_total = carry
        avail = jnp.where(taken, -jnp.inf, score)
        best = jnp.max(avail, axis=1, keepdims=True)
        idx = jnp.min(jnp.where((avail == best) & jnp.logical_not(taken), col, ep), axis=1)  # [Tb]
        hit = col == idx[:, None]  # [Tb, Ep] one-hot of the k-th choice
        p_k = jnp.sum(jnp.where(hit, s, 0.0), axis=1)  # exact: a single non-zero term
        onehot = (hit & valid_te).astype(jnp.int32)  # masked tokens count nowhere
        within = jnp.sum(prefix_count(onehot) * onehot, axis=1) - 1  # [Tb], -1 if masked
        at_k = kcol == k
        return (taken | hit,
                jnp.where(at_k, idx[:, None], index_acc),
                jnp.where(at_k, p_k[:, None], prob_acc),
                jnp.where(at_k, within[:, None], rank_acc),
                jnp.where(krow == k, jnp.sum(onehot, axis=0)[None, :], counts_acc),
                chosen_total + p_k)

    init = (jnp.logical_not(real),  # padded experts are never chosen
            jnp.zeros((tb, kp), jnp.int32), jnp.zeros((tb, kp), jnp.float32), jnp.full((tb, kp), -1, jnp.int32),
            jnp.zeros((kp, ep), jnp.int32), jnp.zeros((tb,), jnp.float32))
    _, index_acc, prob_acc, rank_acc, counts_acc, chosen_total = jax.lax.fori_loop(0, top_k, choose, init)

    if sigmoid:
        chosen_total = chosen_total + 1e-20
    gates = prob_acc / chosen_total[:, None]
    if scoring.scale != 1.0:
        gates = gates * jnp.float32(scoring.scale)
    index_ref[...] = index_acc
    gates_ref[...] = jnp.where(valid_te & (kcol < top_k), gates, 0.0)
    rank_ref[...] = rank_acc
    counts_ref[...] = counts_acc
    prob_sum_ref[...] = jnp.sum(jnp.where(valid_te, probs, 0.0), axis=0)
    z_ref[...] = jnp.sum(jnp.where(valid, lse * lse, 0.0))


RANK_METHODS = ("cumsum", "matmul")


@functools.partial(jax.jit, static_argnames=("top_k", "block_tokens", "interpret", "rank_method", "num_warps",
                                             "num_stages", "scoring"))
def routing_blocks(logits, mask, bias, *, top_k: int, block_tokens: int = 128, interpret: bool = True,
                   rank_method: str = "cumsum", num_warps: int | None = None,
                   num_stages: int | None = None, scoring: Scoring = Scoring()) -> BlockOutputs:
    """Runs the routing kernel over token blocks (no capacity, no global ranks).

    Args:
      logits: [T, E] router logits, any float dtype (read once, upcast to float32 in the kernel).
      mask: [T] bool, False for padding tokens.
      bias: [E] float32 selection-only bias (zeros for none).
      top_k: K in [1, E] (checked by the caller).
      block_tokens: Tb, tokens per grid step; a power of two. T need not divide it: the wrapper pads
        T up to a multiple of Tb with masked tokens.
      interpret: run the kernel with the Pallas interpreter (CPU) instead of compiling it.
      rank_method: ``"cumsum"`` or ``"matmul"``: how within-block ranks are counted (see above).
      num_warps, num_stages: Triton compiler parameters (compiled mode only); ``None``: a default
        from the block size.
      scoring: score function, group limit and gate scaling (:class:`.reference.Scoring`, checked
        by the caller).

    Returns:
      :class:`BlockOutputs` with B = ceil(T / Tb) blocks.

    Raises:
      ValueError: ``block_tokens`` not a positive power of two (or < 16 with ``"matmul"``), or an
        unknown ``rank_method``.
      NotImplementedError: ``interpret=True`` inside ``jax.shard_map(check_vma=True)`` on varying
        inputs (the Pallas interpreter cannot run there; the compiled kernel can).
    """
    check_block_tokens(block_tokens, rank_method)
    t, e = logits.shape
    tb = block_tokens
    nb = -(-t // tb)
    tp, ep, kp = nb * tb, next_power_of_2(e), next_power_of_2(top_k)
    if rank_method == "matmul":
        ep = max(ep, 16)
    if (tp, ep) != (t, e):  # a copy of the logits; none when Tb divides T and E == Ep
        logits = jnp.pad(logits, ((0, tp - t), (0, ep - e)))
    mask_i = jnp.pad(mask.astype(jnp.int32), (0, tp - t))
    bias_p = jnp.pad(bias.astype(jnp.float32), (0, ep - e))

    if num_warps is None:
        num_warps = 4 if tb * ep <= 8192 else 8
    kernel = functools.partial(_routing_kernel, num_experts=e, top_k=top_k, rank_method=rank_method,
                               scoring=scoring)
    # Under shard_map(check_vma=True) the outputs must declare the mesh axes they vary over (the
    # inputs' union; the inputs are made to agree). The Pallas interpreter cannot run there: it
    # re-traces the body on varying values and rejects every op mixing them with a constant.
    (logits, mask_i, bias_p), axes = vary_together(logits, mask_i, bias_p)
    if axes and interpret:
        raise NotImplementedError(
            f"the Pallas interpreter cannot run inside jax.shard_map(check_vma=True) on arrays varying over "
            f"{sorted(axes, key=str)}: use impl='reference' on CPU, or shard_map(..., check_vma=False)")
    out_struct = functools.partial(_out_struct, logits)

    tk_spec = pl.BlockSpec((tb, kp), lambda i: (i, 0))
    index, gates, rank, counts, prob_sum, z_sum = pl.pallas_call(
        kernel,
        grid=(nb,),
        in_specs=[pl.BlockSpec((tb, ep), lambda i: (i, 0)),
                  pl.BlockSpec((tb,), lambda i: (i,)),
                  pl.BlockSpec((ep,), lambda i: (0,))],
        out_specs=[tk_spec, tk_spec, tk_spec,
                   pl.BlockSpec((None, kp, ep), lambda i: (i, 0, 0)),
                   pl.BlockSpec((None, ep), lambda i: (i, 0)),
                   pl.BlockSpec((None,), lambda i: (i,))],
        out_shape=[out_struct((tp, kp), jnp.int32),
                   out_struct((tp, kp), jnp.float32),
                   out_struct((tp, kp), jnp.int32),
                   out_struct((nb, kp, ep), jnp.int32),
                   out_struct((nb, ep), jnp.float32),
                   out_struct((nb,), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="moe_routing",
    )(logits, mask_i, bias_p)
    return BlockOutputs(expert_index=index[:t, :top_k], gates=gates[:t, :top_k],
                        block_rank=rank[:t, :top_k], counts=counts[:, :top_k, :e], prob_sum=prob_sum[:, :e],
                        z_sum=z_sum)
