"""The body of the Triton routing kernel (:mod:`.triton`): a plain function over ``triton.language``.

Kept undecorated in a module of its own that imports triton at the top, so that
:func:`.triton._kernel` can wrap it with ``triton.jit`` for the compiler or for the Triton
interpreter (which patches this module's ``tl``); importing :mod:`.triton` never imports triton.
"""

import triton.language as tl


def routing_kernel(logits_ptr, mask_ptr, bias_ptr, num_tokens, num_experts, index_ptr, gates_ptr, rank_ptr,
                   counts_ptr, prob_sum_ptr, z_ptr, TOP_K: tl.constexpr, TB: tl.constexpr, EP: tl.constexpr,
                   KP: tl.constexpr, SIGMOID: tl.constexpr = False, NUM_GROUPS: tl.constexpr = 1,
                   TOPK_GROUPS: tl.constexpr = 1, GROUP_SIZE: tl.constexpr = 1, SCALE: tl.constexpr = 1.0):
    # Parameter order is jax-triton's calling convention: the inputs (arrays and scalars) as passed
    # to triton_call, then one pointer per output of out_type, then the constexprs. NUM_GROUPS > 1
    # means a group limit that removes experts (the launchers pass 1 otherwise); SCALE the gates'
    # routed_scaling_factor (see kernels/routing/reference.py).
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
    col2 = cols[None, :] + tl.zeros((TB, EP), tl.int32)  # [Tb, Ep] expert ids
    if SIGMOID:  # the reference's expression; 0 on padded experts (x = -inf)
        s = 1.0 / (1.0 + tl.exp(-x))
        probs = s / tl.sum(s, axis=1)[:, None]  # affinities normalised over the experts (statistics)
        score = s + bias[None, :]
    else:
        s = probs
        score = x + bias[None, :]
    if NUM_GROUPS > 1:  # group-limited top-k: as kernels/routing/pallas.py _group_limit
        gid = col2 // GROUP_SIZE  # >= NUM_GROUPS on padded experts
        group_score = tl.zeros((TB, EP), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_g = gid == g
            a = tl.where(in_g, score, float("-inf"))
            m1 = tl.max(a, axis=1)
            if SIGMOID:  # sum of the two largest (a tie at the top counts twice)
                i1 = tl.min(tl.where(in_g & (a == m1[:, None]), col2, EP), axis=1)
                m1 = m1 + tl.max(tl.where(col2 == i1[:, None], float("-inf"), a), axis=1)
            group_score = tl.where(in_g, m1[:, None], group_score)
        kept = col2 >= num_experts  # padded experts never count as a group
        for _ in tl.static_range(TOPK_GROUPS):  # ties: the lower group index
            g_avail = tl.where(kept, float("-inf"), group_score)
            g_best = tl.max(g_avail, axis=1)
            pick = tl.min(tl.where((g_avail == g_best[:, None]) & (kept == 0), gid, NUM_GROUPS), axis=1)
            kept = kept | (gid == pick[:, None])
        kept = kept & (col2 < num_experts)
        score = tl.where(kept, score, float("-inf"))  # dropped groups' experts are never chosen
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
        p_k = tl.sum(tl.where(hit, s, 0.0), axis=1)
        onehot = (hit & valid[:, None]).to(tl.int32)
        within = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # -1 if masked
        at_k = kcol[None, :] == k
        index_acc = tl.where(at_k, idx[:, None], index_acc)
        prob_acc = tl.where(at_k, p_k[:, None], prob_acc)
        rank_acc = tl.where(at_k, within[:, None], rank_acc)
        counts_acc = tl.where(kcol[:, None] == k, tl.sum(onehot, axis=0)[None, :], counts_acc)
        taken = taken | hit
        chosen_total += p_k

    if SIGMOID:
        chosen_total += 1e-20
    gates = prob_acc / chosen_total[:, None]
    if SCALE != 1.0:
        gates = gates * SCALE
    gates = tl.where(valid[:, None] & (kcol[None, :] < TOP_K), gates, 0.0)
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
