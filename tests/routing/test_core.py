"""Routing math against an independent NumPy loop reference."""

import functools
import itertools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moefast import routing


def np_route(logits, top_k, capacity, mask=None):
    """Loop reference: softmax in float64, stable top-k (lower index wins ties), GShard order."""
    logits = np.asarray(logits, np.float32).astype(np.float64)
    t, e = logits.shape
    mask = np.ones(t, bool) if mask is None else np.asarray(mask, bool)
    z = logits - logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    index = np.zeros((t, top_k), np.int64)
    gates = np.zeros((t, top_k))
    for i in range(t):
        order = sorted(range(e), key=lambda j: (-probs[i, j], j))[:top_k]
        index[i] = order
        if mask[i]:
            gates[i] = probs[i, order] / probs[i, order].sum()
    slot = -np.ones((t, top_k), np.int64)
    fill = np.zeros(e, np.int64)
    counts = np.zeros(e, np.int64)
    for k in range(top_k):  # all first choices, then all second choices, ...
        for i in range(t):
            if not mask[i]:
                continue
            ex = index[i, k]
            counts[ex] += 1
            if fill[ex] < capacity:
                slot[i, k] = fill[ex]
            fill[ex] += 1
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return dict(index=index, gates=gates, slot=slot, counts=counts,
                prob_sum=probs[mask].sum(0), z_sum=(lse[mask] ** 2).sum(), n=mask.sum())


def check_against_reference(logits, top_k, capacity, mask=None, jit=False):
    """``jit``: route in one compiled program (the way the model runs it) rather than op by op, the
    same function at a fraction of the compile time (for the property test's many shapes)."""
    fn = functools.partial(routing.route, top_k=top_k, capacity=capacity)
    r = (jax.jit(fn) if jit else fn)(jnp.asarray(logits), mask_t=None if mask is None else jnp.asarray(mask))
    ref = np_route(logits, top_k, capacity, mask)
    valid = np.ones(len(logits), bool) if mask is None else np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(r.expert_index)[valid], ref["index"][valid])
    np.testing.assert_array_equal(np.asarray(r.slot), ref["slot"])
    np.testing.assert_array_equal(np.asarray(r.tokens_per_expert), ref["counts"])
    np.testing.assert_allclose(np.asarray(r.gates), ref["gates"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(r.prob_sum), ref["prob_sum"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(r.z_sum), ref["z_sum"], rtol=1e-5, atol=1e-5)
    assert float(r.num_tokens) == ref["n"]
    assert int(r.num_dropped) == int(ref["n"] * top_k - (ref["slot"] >= 0).sum())
    return r


@pytest.mark.parametrize("t,e,k,cap", [(1, 2, 1, 1), (13, 8, 2, 3), (64, 8, 2, 16), (33, 64, 4, 2), (7, 7, 7, 7)])
def test_route_matches_numpy_reference(t, e, k, cap):
    logits = np.random.default_rng(t * 100 + e).normal(size=(t, e)).astype(np.float32) * 3
    check_against_reference(logits, k, cap)


def test_ties_lower_expert_index_wins():
    logits = np.zeros((4, 6), np.float32)
    logits[1, [2, 4]] = 5.0  # tie between experts 2 and 4
    logits[2, :] = -1e4  # every probability ties
    logits[3, [5, 0]] = 1e4  # large ties (z-loss stays finite in float32: 1e8)
    r = check_against_reference(logits, 2, 4)
    np.testing.assert_array_equal(np.asarray(r.expert_index), [[0, 1], [2, 4], [0, 1], [0, 5]])


def test_capacity_drops_follow_position_order():
    # Five tokens all prefer expert 0 then expert 1; capacity 2.
    logits = np.tile(np.array([[3.0, 2.0, 0.0]], np.float32), (5, 1))
    r = check_against_reference(logits, 2, 2)
    # First choices: tokens 0, 1 get expert 0's slots; second choices: tokens 0, 1 get expert 1's.
    np.testing.assert_array_equal(np.asarray(r.slot), [[0, 0], [1, 1], [-1, -1], [-1, -1], [-1, -1]])
    # A later token's first choice is never displaced by an earlier token's second choice.
    logits = np.array([[0.0, 3.0], [3.0, 0.0]], np.float32)  # token 0: e1 then e0; token 1: e0 first
    r = routing.route(jnp.asarray(logits), top_k=2, capacity=1)
    np.testing.assert_array_equal(np.asarray(r.slot), [[0, -1], [0, -1]])


@settings(max_examples=8, deadline=None)  # each example compiles (CI time): jitted, one program each
@given(data=st.data(), t=st.integers(1, 40), e=st.integers(1, 12), cap=st.integers(1, 40))
def test_slots_unique_and_below_capacity(data, t, e, cap):
    k = data.draw(st.integers(1, e))
    logits = data.draw(hnp.arrays(np.float32, (t, e), elements=st.sampled_from([-2.0, 0.0, 0.5, 1.0, 7.0])))
    mask = data.draw(hnp.arrays(bool, (t,)))
    r = check_against_reference(logits, k, cap, mask, jit=True)
    slot, idx = np.asarray(r.slot), np.asarray(r.expert_index)
    kept = slot >= 0
    assert (slot[kept] < cap).all()
    pairs = list(zip(idx[kept].tolist(), slot[kept].tolist()))
    assert len(pairs) == len(set(pairs)), "two assignments share an expert slot"
    assert not kept[~mask].any(), "a masked token took a slot"
    assert int(np.asarray(r.tokens_per_expert).sum()) == int(mask.sum()) * k


def test_aux_loss_balanced_top1_is_one():
    e, per = 8, 4
    logits = np.full((e * per, e), -5.0, np.float32)
    for i in range(e * per):
        logits[i, i % e] = 5.0
    # Symmetric: P_i is equal for every expert, f_i = 1/E.
    r = routing.route(jnp.asarray(logits), top_k=1, capacity=per)
    aux = routing.load_balancing_loss(r.tokens_per_expert, r.prob_sum, r.num_tokens, 1)
    np.testing.assert_allclose(float(aux), 1.0, rtol=1e-6)
    coef = 0.01
    np.testing.assert_allclose(coef * float(aux), coef, rtol=1e-6)


def test_aux_loss_collapsed_routing_is_num_experts():
    e = 4
    logits = np.full((16, e), -1e4, np.float32)
    logits[:, 2] = 0.0
    r = routing.route(jnp.asarray(logits), top_k=1, capacity=16)
    aux = routing.load_balancing_loss(r.tokens_per_expert, r.prob_sum, r.num_tokens, 1)
    np.testing.assert_allclose(float(aux), float(e), rtol=1e-6)


def test_z_loss_is_mean_of_squares():
    logits = np.array([[0.0, 0.0], [math.log(3.0), 0.0], [2.0, -30.0]], np.float32)
    lse = [math.log(2.0), math.log(4.0), math.log(math.exp(2.0) + math.exp(-30.0))]
    r = routing.route(jnp.asarray(logits), top_k=1, capacity=3)
    z = float(routing.router_z_loss(r.z_sum, r.num_tokens))
    np.testing.assert_allclose(z, np.mean(np.square(lse)), rtol=1e-6)
    assert abs(z - np.mean(lse) ** 2) > 1e-3  # not the square of the mean


@pytest.mark.parametrize("t,e,k,cf", list(itertools.product([1, 2, 3, 7, 64], [2, 8, 64], [1, 2],
                                                            [0.01, 0.5, 1, 1.25, 4])))
def test_capacity_bounds(t, e, k, cf):
    cap = routing.compute_capacity(t, e, k, cf, min_capacity=1)
    assert 1 <= cap <= t
    assert cap == min(max(math.ceil(cf * t * k / e), 1), t)


@pytest.mark.parametrize("t,e,k", [(1, 2, 1), (3, 8, 2), (7, 64, 2), (64, 8, 1)])
@pytest.mark.parametrize("cf", [0.01, 1.25, 4])
def test_capacity_grid_forward_backward(t, e, k, cf):
    from moefast.model import MoELayer
    from flax import nnx

    from moefast.config import MoEConfig

    layer = MoELayer(8, 16, MoEConfig(num_experts=e, top_k=k, capacity_factor=cf, min_capacity=1), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, t, 8))

    def loss(x):
        y, s = layer(x, jnp.ones((1, t), bool))
        return jnp.sum(y ** 2) + s.aux_loss + s.z_loss

    g = jax.jit(jax.grad(loss))(x)  # one compiled program, not op-by-op dispatch (CI time)
    assert g.shape == x.shape and bool(jnp.all(jnp.isfinite(g)))


def test_compute_capacity_rejects_bad_input():
    with pytest.raises(ValueError, match="capacity_factor"):
        routing.compute_capacity(8, 4, 2, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        routing.compute_capacity(8, 4, 5, 1.0)
