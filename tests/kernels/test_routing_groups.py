"""Sigmoid scores, group-limited top-k and the routed scaling factor in every routing implementation.

Each case runs the reference (jnp), the Pallas kernel (interpreter) and the Triton kernel (Triton
interpreter, torch CPU tensors) and compares them with an independent NumPy port of DeepSeek's
gates as transformers writes them: ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` ("noaux_tc":
sigmoid, bias for choice only, group score = sum of the top-2 biased scores, other groups filled
with ``-inf``, gates = unbiased scores / (sum + 1e-20) * routed_scaling_factor) and
``DeepseekV2TopkRouter`` ("group_limited_greedy": softmax, group score = max probability, other
groups' probabilities filled with 0.0, gates = probabilities * routed_scaling_factor, never
renormalised). transformers leaves the order of tied scores to ``torch.topk``; moefast's rule (the
lower index wins, for groups too) is what the NumPy version does with a stable sort. Choices, slots
and counts are compared bitwise between the implementations; gates and statistics to float32
rounding. The routers of transformers themselves are run too, on tie-free logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.kernels.routing import Scoring, ops, route
from moefast.kernels.routing.reference import chosen_probs, finish

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
pytest.importorskip("triton", reason="triton (a test dependency) is not installed")

from moefast.kernels.routing import triton as triton_kernel  # noqa: E402

GATES = dict(rtol=2e-6, atol=1e-7)


def hf_route(logits, bias, *, top_k, score_func, n_group, topk_group, norm_topk_prob, scale):
    """NumPy transcription of transformers' routers (module docstring): ``(index [T, K], gates [T, K])``,
    the K experts best first (ties: lower index)."""
    x = np.asarray(logits, np.float32)
    t, e = x.shape
    if score_func == "sigmoid":
        s = (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)
        choice = (s + np.asarray(bias, np.float32)[None, :]).astype(np.float32)
        group = np.sort(choice.reshape(t, n_group, e // n_group), axis=-1)
        group_scores = group[..., -1] + group[..., -2]
    else:  # DeepSeek-V2: no correction bias
        z = np.exp(x - x.max(-1, keepdims=True))
        s = (z / z.sum(-1, keepdims=True)).astype(np.float32)
        choice = s
        group_scores = choice.reshape(t, n_group, e // n_group).max(-1)
    group_idx = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    group_mask = np.zeros((t, n_group), bool)
    np.put_along_axis(group_mask, group_idx, True, axis=-1)
    score_mask = np.repeat(group_mask, e // n_group, axis=-1)
    # V3/GLM: masked_fill(~score_mask, -inf) on the biased scores; V2: masked_fill(~score_mask, 0.0)
    # on the probabilities (never above a kept expert's)
    masked = np.where(score_mask, choice, np.float32(-np.inf if score_func == "sigmoid" else 0.0))
    index = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(s, index, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + (np.float32(1e-20) if score_func == "sigmoid" else 0))
    return index.astype(np.int32), (w * np.float32(scale)).astype(np.float32)


def _torch(x):
    return torch.from_numpy(np.array(x))


def triton_interpreted(logits, *, top_k, capacity, policy, mask, bias, scoring, block_tokens):
    """The Triton kernel under the Triton interpreter, then the global ranks and capacity exactly as
    :mod:`moefast.kernels.routing.ops` does after either kernel."""
    out = triton_kernel.routing_blocks_torch(_torch(logits), _torch(mask), _torch(bias), top_k=top_k,
                                             block_tokens=block_tokens, scoring=scoring)
    index, gates, block_rank, counts, prob_sum, z_sum = map(jnp.asarray, out)
    rank, tokens_per_expert = ops._position_ranks(block_rank, counts, index, block_tokens)
    score = chosen_probs(jnp.asarray(logits, jnp.float32), index, scoring) if policy == "priority" else None
    return finish(index, gates, rank, tokens_per_expert, prob_sum.sum(0), z_sum.sum(), mask, capacity=capacity,
                  policy=policy, priority_score=score)


def _logits(kind, t, e, seed):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return (2.0 * rng.standard_normal((t, e))).astype(np.float32)
    x = rng.integers(-1, 2, (t, e)).astype(np.float32)  # "ties": many equal scores and group scores
    x[::5] = 0.0  # all-equal rows: every group ties
    return x


def _bias(kind, e, seed):
    rng = np.random.default_rng(seed + 100)
    if kind == "none":
        return np.zeros(e, np.float32)
    if kind == "spread":  # large enough to change choices
        return (0.5 * rng.standard_normal(e)).astype(np.float32)
    if kind == "negative":  # many biased scores below 0: a 0.0 fill would let dropped groups win
        return np.full(e, -0.8, np.float32)
    if kind == "around-1":  # spread around -1: biased scores of both signs, most of them negative
        return (-1.0 + 0.5 * rng.standard_normal(e)).astype(np.float32)
    if kind == "all-negative":  # every biased score below 0 (sigmoid < 1)
        return np.full(e, -1.0, np.float32)
    if kind == "group0":  # unequal load: group 0 favoured
        return np.where(np.arange(e) < 4, 0.5, 0.0).astype(np.float32)
    raise ValueError(kind)


# name: (T, E, K, G, topk_groups, score_func, norm_topk_prob, scale, logits, bias, capacity, policy, Tb)
CASES = {
    # DeepSeek-V3 shape in small: 4 groups, 2 kept, spread bias, drops under the priority policy
    "v3-priority": (37, 16, 4, 4, 2, "sigmoid", True, 2.5, "normal", "spread", 6, "priority", 16),
    # biased scores < 0 in kept groups: dropped groups' experts must still never be chosen
    "v3-negative": (21, 16, 4, 4, 1, "sigmoid", True, 1.0, "normal", "negative", 21, "position", 8),
    "v3-mixed-sign": (33, 16, 4, 4, 2, "sigmoid", True, 2.5, "normal", "around-1", 33, "position", 16),
    # every biased score negative, many tied scores and tied groups (V3 and V2)
    "ties-negative": (24, 8, 2, 4, 2, "sigmoid", True, 2.5, "ties", "all-negative", 24, "position", 8),
    "v2-ties": (24, 8, 3, 4, 2, "softmax", False, 16.0, "ties", "none", 24, "position", 8),
    # E = 12 in a kernel padded to 16: experts 12..15 form a group of padding only, never kept
    "unequal-load": (40, 12, 3, 3, 2, "sigmoid", False, 2.5, "normal", "group0", 8, "position", 16),
    "ties": (24, 8, 2, 4, 2, "sigmoid", True, 2.5, "ties", "none", 24, "position", 8),
    # DeepSeek-V2 group_limited_greedy: softmax, max per group, raw gates x 16; padded groups 4, 5
    "v2": (29, 12, 3, 4, 2, "softmax", False, 16.0, "normal", "none", 29, "position", 16),
    # one group (GLM-4.5, Kimi K2): no limit at all
    "one-group": (19, 8, 2, 1, 1, "sigmoid", True, 2.5, "normal", "spread", 19, "position", 8),
    # DeepSeek-V3's ratios (256 experts, 8 groups, 4 kept, top-8) at 64 experts
    "v3-64": (9, 64, 8, 8, 4, "sigmoid", True, 2.5, "normal", "spread", 9, "position", 8),
}


@functools.lru_cache(maxsize=None)
def _case(name):
    t, e, k, g, tg, sf, norm, scale, lk, bk, cap, policy, bt = CASES[name]
    seed = sum(map(ord, name))
    logits, bias = _logits(lk, t, e, seed), _bias(bk, e, seed)
    mask = np.random.default_rng(seed + 1).random(t) < 0.8
    mask[0] = True
    kw = dict(top_k=k, capacity=cap, policy=policy, mask=jnp.asarray(mask), bias=jnp.asarray(bias),
              renormalize=norm, score_func=sf, num_groups=g, topk_groups=tg, routed_scaling_factor=scale)
    want = hf_route(logits, bias, top_k=k, score_func=sf, n_group=g, topk_group=tg, norm_topk_prob=norm, scale=scale)
    got = {impl: jax.jit(functools.partial(route, impl=impl, **kw))(jnp.asarray(logits))
           for impl in ("reference", "pallas")}
    scoring = Scoring(sf, g, tg, scale)
    tri = triton_interpreted(logits, top_k=k, capacity=cap, policy=policy, mask=jnp.asarray(mask),
                             bias=bias, scoring=scoring, block_tokens=bt)
    if not norm:  # as route() does after either kernel: raw gates from the logits
        tri = tri._replace(gates=got["reference"].gates)
    got["triton"] = tri
    return logits, bias, mask, want, got


@pytest.mark.parametrize("name", list(CASES))
def test_every_impl_matches_transformers_routing(name):
    logits, bias, mask, (want_index, want_gates), got = _case(name)
    ref = got["reference"]
    for impl, r in got.items():
        np.testing.assert_array_equal(np.asarray(r.expert_index)[mask], want_index[mask], err_msg=impl)
        np.testing.assert_allclose(np.asarray(r.gates)[mask], want_gates[mask], **GATES, err_msg=impl)
        assert not np.asarray(r.gates)[~mask].any(), impl
        for field in ("expert_index", "slot", "tokens_per_expert", "num_dropped"):
            np.testing.assert_array_equal(getattr(r, field), getattr(ref, field), err_msg=f"{impl} {field}")
        np.testing.assert_allclose(r.prob_sum, ref.prob_sum, rtol=1e-5, atol=1e-5, err_msg=impl)
        np.testing.assert_allclose(r.z_sum, ref.z_sum, rtol=1e-5, err_msg=impl)


def _kept_groups(logits, bias, g, topk_groups, score_func):
    """[T, G] bool: each token's ``topk_groups`` best groups (lower index first among ties), NumPy."""
    x = logits.astype(np.float32)
    if score_func == "sigmoid":
        by_group = np.sort((np.float32(1) / (np.float32(1) + np.exp(-x)) + bias).reshape(len(x), g, -1), -1)
        group_score = by_group[..., -1] + by_group[..., -2]
    else:
        group_score = x.reshape(len(x), g, -1).max(-1)
    kept = np.zeros(group_score.shape, bool)
    np.put_along_axis(kept, np.argsort(-group_score, -1, kind="stable")[:, :topk_groups], True, -1)
    return kept


@pytest.mark.parametrize("name", ["v3-negative", "v3-mixed-sign", "ties-negative", "v2-ties"])
def test_dropped_groups_experts_are_never_chosen(name):
    """Whatever the sign of the biased scores, every chosen expert lies in one of the token's kept
    groups, on every path. For the sigmoid cases, filling the dropped groups with 0.0 (moefast's
    old rule) would choose otherwise: the cases do exercise negative biased scores."""
    t, e, k, g, tg, sf, *_ = CASES[name]
    logits, bias, mask, _, got = _case(name)
    kept = _kept_groups(logits, bias, g, tg, sf)
    for impl, r in got.items():
        chosen_group = np.asarray(r.expert_index) // (e // g)
        assert np.take_along_axis(kept, chosen_group, axis=1)[mask].all(), impl
    if sf == "sigmoid":
        s = np.float32(1) / (np.float32(1) + np.exp(-logits)) + bias
        zero_fill = np.where(np.repeat(kept, e // g, axis=1), s, np.float32(0.0))
        old = np.sort(np.argsort(-zero_fill, -1, kind="stable")[:, :k], -1)
        assert (old != np.sort(np.asarray(got["reference"].expert_index), -1)).any(axis=1)[mask].mean() > 0.3


def test_the_issues_token_chooses_the_kept_groups_on_every_path():
    """Biases of -1 make every biased score negative: DeepSeek-V3's gate keeps groups 1 and 2 and
    chooses experts 4, 5, 8, 9 (with a 0.0 fill, experts 0-3 of the dropped groups won)."""
    s = np.array([.95, .06, .05, .04, .6, .6, .1, .1, .55, .55, .1, .1, .9, .03, .02, .01], np.float32)
    logits = np.log(s / (1 - s))[None].astype(np.float32)
    bias = np.full(16, -1.0, np.float32)
    kw = dict(top_k=4, capacity=1, bias=jnp.asarray(bias), score_func="sigmoid", num_groups=4, topk_groups=2,
              routed_scaling_factor=2.5)
    for impl in ("reference", "pallas"):
        np.testing.assert_array_equal(route(jnp.asarray(logits), impl=impl, **kw).expert_index, [[4, 5, 8, 9]],
                                      err_msg=impl)
    tri = triton_interpreted(logits, top_k=4, capacity=1, policy="position", mask=jnp.ones(1, bool), bias=bias,
                             scoring=Scoring("sigmoid", 4, 2, 2.5), block_tokens=8)
    np.testing.assert_array_equal(tri.expert_index, [[4, 5, 8, 9]])


# transformers' group-limited routers: class -> (config class, module under transformers.models)
HF_ROUTERS = {"DeepseekV3TopkRouter": ("DeepseekV3Config", "deepseek_v3"),
              "Glm4MoeTopkRouter": ("Glm4MoeConfig", "glm4_moe"),
              "Glm4MoeLiteTopkRouter": ("Glm4MoeLiteConfig", "glm4_moe_lite"),
              "DeepseekV2TopkRouter": ("DeepseekV2Config", "deepseek_v2")}


@pytest.mark.parametrize("router", list(HF_ROUTERS))
def test_transformers_routers_choose_the_same_experts(router):
    """transformers' router modules themselves (the weight an identity, so their router logits are
    the given logits) on normal logits with biases spread around -1: the same chosen experts and
    gates as every moefast path (compared as sets: transformers returns them unsorted)."""
    import importlib

    transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    t, e, k, g, tg = 40, 16, 4, 4, 2
    config_cls, module = HF_ROUTERS[router]
    v2 = module == "deepseek_v2"
    cfg = getattr(transformers, config_cls)(hidden_size=e, num_attention_heads=4, num_key_value_heads=4,
                                            n_routed_experts=e, num_experts_per_tok=k, n_group=g, topk_group=tg,
                                            routed_scaling_factor=2.5, norm_topk_prob=not v2,
                                            topk_method="group_limited_greedy")
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    hf = getattr(modeling, router)(cfg)
    rng = np.random.default_rng(7)
    logits = (2.0 * rng.standard_normal((t, e))).astype(np.float32)
    bias = np.zeros(e, np.float32) if v2 else (-1.0 + 0.5 * rng.standard_normal(e)).astype(np.float32)
    with torch.no_grad():
        hf.weight.copy_(torch.eye(e))
        if not v2:
            hf.e_score_correction_bias.copy_(_torch(bias))
        _, w_hf, i_hf = hf(_torch(logits))
    order = np.argsort(i_hf.numpy(), -1)
    want_index = np.take_along_axis(i_hf.numpy(), order, -1)
    want_gates = np.take_along_axis(w_hf.numpy(), order, -1)
    sf = "softmax" if v2 else "sigmoid"
    kw = dict(top_k=k, capacity=t, bias=None if v2 else jnp.asarray(bias), renormalize=not v2, score_func=sf,
              num_groups=g, topk_groups=tg, routed_scaling_factor=2.5)
    got = {impl: route(jnp.asarray(logits), impl=impl, **kw) for impl in ("reference", "pallas")}
    tri = triton_interpreted(logits, top_k=k, capacity=t, policy="position", mask=jnp.ones(t, bool), bias=bias,
                             scoring=Scoring(sf, g, tg, 2.5), block_tokens=16)
    got["triton"] = tri if not v2 else tri._replace(gates=got["reference"].gates)
    for impl, r in got.items():
        order = np.argsort(np.asarray(r.expert_index), -1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(r.expert_index), order, -1), want_index,
                                      err_msg=impl)
        np.testing.assert_allclose(np.take_along_axis(np.asarray(r.gates), order, -1), want_gates, **GATES,
                                   err_msg=impl)


def test_one_group_is_no_group_limit():
    """G = 1 (GLM-4.5, Kimi K2 configs) chooses exactly what routing without groups chooses, on every impl."""
    logits, bias, mask, _, got = _case("one-group")
    free = jax.jit(functools.partial(route, top_k=2, capacity=19, score_func="sigmoid", routed_scaling_factor=2.5,
                                     impl="reference"))(jnp.asarray(logits), mask=jnp.asarray(mask),
                                                        bias=jnp.asarray(bias))
    for impl, r in got.items():
        np.testing.assert_array_equal(r.expert_index, free.expert_index, err_msg=impl)
        np.testing.assert_allclose(r.gates, free.gates, **GATES, err_msg=impl)


def test_bias_never_reaches_the_gates():
    """Gates are the unbiased sigmoid scores of the chosen experts (times the scale): where the bias
    leaves a token's choices as they were, its gates are bitwise the same as without the bias."""
    logits, bias, mask, _, _ = _case("v3-priority")
    kw = dict(top_k=4, capacity=6, policy="priority", mask=jnp.asarray(mask), score_func="sigmoid", num_groups=4,
              topk_groups=2, routed_scaling_factor=2.5)
    small = jnp.asarray(0.05 * bias)  # changes some tokens' choices, not all
    for impl in ("reference", "pallas"):
        with_bias = route(jnp.asarray(logits), bias=small, impl=impl, **kw)
        without = route(jnp.asarray(logits), bias=None, impl=impl, **kw)
        same = np.all(np.asarray(with_bias.expert_index) == np.asarray(without.expert_index), axis=1)
        assert same.any() and not same.all(), "the bias must change some choices and leave others"
        np.testing.assert_array_equal(np.asarray(with_bias.gates)[same], np.asarray(without.gates)[same],
                                      err_msg=impl)
    # raw gates (norm_topk_prob false) are exactly the chosen experts' unbiased sigmoid scores x 2.5
    logits, bias, mask, _, got = _case("unequal-load")
    s = 1.0 / (1.0 + jnp.exp(-jnp.asarray(logits)))
    want = jnp.take_along_axis(s, got["reference"].expert_index, axis=-1) * jnp.float32(2.5)
    np.testing.assert_array_equal(np.asarray(got["reference"].gates)[mask], np.asarray(want)[mask])


@pytest.mark.parametrize("impl", ["reference", "pallas", "triton"])
def test_scaling_applied_once(impl):
    """The gates with routed_scaling_factor 2.5 are 2.5 x those with 1.0 (and transformers' gates
    above are scaled once): not zero times, not twice, on every path."""
    logits, bias, mask, _, got = _case("v3-priority")
    scoring = Scoring("sigmoid", 4, 2, 1.0)
    if impl == "triton":
        one = triton_interpreted(logits, top_k=4, capacity=6, policy="priority", mask=jnp.asarray(mask), bias=bias,
                                 scoring=scoring, block_tokens=16)
    else:
        one = route(jnp.asarray(logits), top_k=4, capacity=6, policy="priority", mask=jnp.asarray(mask),
                    bias=jnp.asarray(bias), score_func="sigmoid", num_groups=4, topk_groups=2, impl=impl)
    np.testing.assert_array_equal(one.expert_index, got[impl].expert_index)
    np.testing.assert_allclose(got[impl].gates, 2.5 * np.asarray(one.gates), rtol=1e-6, atol=0)
    np.testing.assert_allclose(np.asarray(one.gates)[mask].sum(-1), 1.0, rtol=1e-6)


def test_pallas_gradient_matches_reference():
    """The kernel's custom VJP differentiates the sigmoid gates (renormalised, scaled) and the
    normalised-affinity statistics exactly as the reference does; the bias gets none."""
    logits, bias, mask, _, _ = _case("v3-priority")
    w = jax.random.normal(jax.random.key(3), (37, 4))
    kw = dict(top_k=4, capacity=6, policy="priority", mask=jnp.asarray(mask), score_func="sigmoid", num_groups=4,
              topk_groups=2, routed_scaling_factor=2.5)

    def loss(impl, lg, b):
        r = route(lg, bias=b, impl=impl, **kw)
        return jnp.sum(r.gates * w) + jnp.sum(r.prob_sum * jnp.arange(16.0)) + 1e-3 * r.z_sum

    grads = {impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1)))(jnp.asarray(logits),
                                                                                      jnp.asarray(bias))
             for impl in ("reference", "pallas")}
    g_ref, g_pal = grads["reference"], grads["pallas"]
    np.testing.assert_allclose(g_pal[0], g_ref[0], rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(g_ref[0]))))
    assert not np.asarray(g_pal[1]).any() and not np.asarray(g_ref[1]).any()


@pytest.mark.parametrize("kw,match", [
    (dict(num_groups=3), "num_groups=3 must be an int >= 1 dividing num_experts=8"),
    (dict(num_groups=4, topk_groups=5), "topk_groups=5"),
    (dict(num_groups=8, topk_groups=2, score_func="sigmoid"), "groups need >= 2 experts"),
    (dict(num_groups=4, topk_groups=1, top_k=3), "top_k=3 is more than the 2 experts"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(score_func="tanh"), "score_func"),
])
def test_bad_scoring_raises_at_trace_time(kw, match):
    args = {"top_k": 2, "capacity": 4, **kw}
    for impl in ("reference", "pallas"):
        with pytest.raises(ValueError, match=match):
            route(jnp.zeros((4, 8)), impl=impl, **args)


def test_grouped_sigmoid_kernel_lowers_for_cuda_from_cpu():
    """The compiled (non-interpreted) Pallas kernel with DeepSeek-V3's options lowers for GPUs: the
    group loop and the sigmoid go through the Pallas Triton lowering (forward and custom VJP)."""
    f = functools.partial(ops.route_pallas, top_k=8, capacity=64, interpret=False, block_tokens=128,
                          scoring=Scoring("sigmoid", 8, 4, 2.5))

    def loss(lg):
        r = f(lg)
        return jnp.sum(r.gates) + jnp.sum(r.prob_sum)

    text = jax.jit(jax.grad(loss)).trace(jnp.zeros((200, 64), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
