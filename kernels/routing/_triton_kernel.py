"""The body of the Triton routing kernel (:mod:`.triton`): a plain function over ``triton.language``.

Kept undecorated in a module of its own that imports triton at the top, so that
:func:`.triton._kernel` can wrap it with ``triton.jit`` for the compiler or for the Triton
interpreter (which patches this module's ``tl``); importing :mod:`.triton` never imports triton.
"""

import triton.language as tl


def routing_kernel(logits_ptr, mask_ptr, bias_ptr, num_tokens, num_experts, index_ptr, gates_ptr, rank_ptr,
                   counts_ptr, prob_sum_ptr, z_ptr, TOP_K: tl.constexpr, TB: tl.constexpr, EP: tl.constexpr,
                   KP: tl.constexpr):
    # Parameter order is jax-triton's calling convention: the inputs (arrays and scalars) as passed
    # to triton_call, then one pointer per output of out_type, then the constexprs.
    pid = tl.program_id(0)
    rows = pid * TB + tl.arange(0, TB)  # [Tb]
    cols = tl.arange(0, EP)  # [Ep]
    kcol = tl.arange(0, KP)  # [Kp]
    in_t = rows < num_tokens
    real = cols < num_experts
    x = tl.load(logits_ptr + rows[:, None] * num_experts + cols[None, :], mask=in_t[:, None] & real[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(real[None, :], x, float("-inf"))  # padded experts; rows past T are zeros (masked)
    valid = tl.load(mask_ptr + rows, mask=in_t, other=0) != 0

    x_max = tl.max(x, axis=1)
    unnormalized = tl.exp(x - x_max[:, None])
    denom = tl.sum(unnormalized, axis=1)
    probs = unnormalized / denom[:, None]
    lse = tl.log(denom) + x_max

    bias = tl.load(bias_ptr + cols, mask=real, other=0.0)
    score = x + bias[None, :]
    col2 = cols[None, :] + tl.zeros((TB, EP), tl.int32)  # [Tb, Ep] expert ids
    taken = col2 >= num_experts  # padded experts are never chosen
    index_acc = tl.zeros((TB, KP), tl.int32)
    prob_acc = tl.zeros((TB, KP), tl.float32)
    rank_acc = tl.full((TB, KP), -1, tl.int32)
    counts_acc = tl.zeros((KP, EP), tl.int32)
    chosen_total = tl.zeros((TB,), tl.float32)
    for k in tl.static_range(TOP_K):
        avail = tl.where(taken, float("-inf"), score)
        best = tl.max(avail, axis=1)
        idx = tl.min(tl.where((avail == best[:, None]) & (taken == 0), col2, EP), axis=1)  # [Tb]
        hit = col2 == idx[:, None]
        p_k = tl.sum(tl.where(hit, probs, 0.0), axis=1)
        onehot = (hit & valid[:, None]).to(tl.int32)
        within = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # -1 if masked
        at_k = kcol[None, :] == k
        index_acc = tl.where(at_k, idx[:, None], index_acc)
        prob_acc = tl.where(at_k, p_k[:, None], prob_acc)
        rank_acc = tl.where(at_k, within[:, None], rank_acc)
        counts_acc = tl.where(kcol[:, None] == k, tl.sum(onehot, axis=0)[None, :], counts_acc)
        taken = taken | hit
        chosen_total += p_k

    gates = tl.where(valid[:, None] & (kcol[None, :] < TOP_K), prob_acc / chosen_total[:, None], 0.0)
    tk = rows[:, None] * TOP_K + kcol[None, :]
    tk_mask = in_t[:, None] & (kcol[None, :] < TOP_K)
    tl.store(index_ptr + tk, index_acc, mask=tk_mask)
    tl.store(gates_ptr + tk, gates, mask=tk_mask)
    tl.store(rank_ptr + tk, rank_acc, mask=tk_mask)
    ke = (pid * TOP_K + kcol[:, None]) * num_experts + cols[None, :]
    tl.store(counts_ptr + ke, counts_acc, mask=(kcol[:, None] < TOP_K) & real[None, :])
    tl.store(prob_sum_ptr + pid * num_experts + cols, tl.sum(tl.where(valid[:, None], probs, 0.0), axis=0),
             mask=real)
    tl.store(z_ptr + pid, tl.sum(tl.where(valid, lse * lse, 0.0), axis=0))
