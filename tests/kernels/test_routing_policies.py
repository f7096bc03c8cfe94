"""Routing policies on hand-built inputs (reference implementation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.kernels.routing import route


def all_to_expert_zero(t=16, e=4):
    """Every token's first choice is expert 0, with distinct gates that are not in token order."""
    rng = np.random.default_rng(0)
    logits = np.zeros((t, e), np.float32)
    logits[:, 0] = rng.permutation(np.linspace(1.0, 4.0, t)).astype(np.float32)
    return jnp.asarray(logits)


def test_position_keeps_the_first_four():
    r = route(all_to_expert_zero(), top_k=1, capacity=4, policy="position", impl="reference")
    np.testing.assert_array_equal(np.asarray(r.slot[:, 0]), [0, 1, 2, 3] + [-1] * 12)
    assert int(r.num_dropped) == 12 and int(r.tokens_per_expert[0]) == 16


def test_priority_keeps_the_four_largest_gates():
    logits = all_to_expert_zero()
    r = route(logits, top_k=1, capacity=4, policy="priority", impl="reference")
    slot = np.asarray(r.slot[:, 0])
    kept = np.flatnonzero(slot >= 0)
    top4 = np.argsort(-np.asarray(logits[:, 0]), kind="stable")[:4]
    assert sorted(kept) == sorted(top4)
    # The largest gate gets slot 0, the next slot 1, ...
    np.testing.assert_array_equal(slot[top4], [0, 1, 2, 3])
    assert int(r.num_dropped) == 12


def test_priority_ties_fall_back_to_position_order():
    logits = jnp.zeros((6, 2), jnp.float32).at[:, 0].set(1.0)  # identical gates
    r = route(logits, top_k=1, capacity=3, policy="priority", impl="reference")
    np.testing.assert_array_equal(np.asarray(r.slot[:, 0]), [0, 1, 2, -1, -1, -1])


def test_priority_counts_second_choices_too():
    # Two experts, top-2: each token sends one assignment to each; router probabilities decide.
    logits = jnp.asarray([[3.0, 0.0], [2.0, 1.9], [1.0, 0.0], [0.0, 2.5]], jnp.float32)
    r = route(logits, top_k=2, capacity=2, policy="priority", impl="reference")
    idx, slot = np.asarray(r.expert_index), np.asarray(r.slot)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    for e in range(2):
        sel = idx == e
        order = np.argsort(-probs[:, e][np.nonzero(sel)[0]], kind="stable")
        kept = slot[sel] >= 0
        assert kept.sum() == 2 and set(np.flatnonzero(kept)) == set(order[:2])


def test_capacity_limit_masks_slots_per_expert():
    logits = jnp.zeros((8, 2), jnp.float32).at[:4, 0].set(1.0).at[4:, 1].set(1.0)
    r = route(logits, top_k=1, capacity=4, capacity_limit=jnp.array([2, 4], jnp.int32), impl="reference")
    np.testing.assert_array_equal(np.asarray(r.slot[:, 0]), [0, 1, -1, -1, 0, 1, 2, 3])


def test_bias_changes_selection_not_gates():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32))
    plain = route(logits, top_k=1, capacity=1, impl="reference")
    biased = route(logits, top_k=1, capacity=1, bias=jnp.asarray([0.0, 0.0, 1.0]), impl="reference")
    assert int(plain.expert_index[0, 0]) == 0 and int(biased.expert_index[0, 0]) == 2
    two = route(logits, top_k=2, capacity=1, bias=jnp.asarray([0.0, 0.0, 1.0]), impl="reference")
    np.testing.assert_array_equal(np.asarray(two.expert_index[0]), [2, 0])
    np.testing.assert_allclose(np.asarray(two.gates[0]), [0.2 / 0.7, 0.5 / 0.7], rtol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(policy="random"), "policy"), (dict(impl="cuda"), "impl"), (dict(capacity=0), "capacity"),
    (dict(top_k=5), "top_k"), (dict(mask=jnp.ones(3, bool)), "mask"), (dict(bias=jnp.ones(3)), "bias"),
])
def test_bad_arguments_raise_at_trace_time(bad, match):
    kw = dict(top_k=2, capacity=2) | bad
    with pytest.raises(ValueError, match=match):
        route(jnp.zeros((4, 4)), **kw)


def test_gradients_flow_through_gates_and_statistics():
    logits = jax.random.normal(jax.random.key(0), (12, 6))

    def f(lg, policy):
        r = route(lg, top_k=2, capacity=3, policy=policy, impl="reference")
        return jnp.sum(r.gates * jnp.arange(2.0)[None, :]) + jnp.sum(r.prob_sum * jnp.arange(6.0)) + r.z_sum

    for policy in ("position", "priority"):
        g = jax.grad(f)(logits, policy)
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) > 0


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_raw_gates_are_the_chosen_probabilities_with_their_gradient(impl):
    """``renormalize=False`` (norm_topk_prob false): gates = softmax probabilities of the chosen
    experts, 0 for masked tokens; choices, slots and statistics as with renormalised gates; the
    gradient is that of the probabilities (checked against a jnp formula)."""
    logits = jax.random.normal(jax.random.key(0), (13, 8)) * 2
    mask = jnp.arange(13) < 11
    kw = dict(top_k=2, capacity=4, mask=mask, impl=impl)
    raw, norm = route(logits, renormalize=False, **kw), route(logits, **kw)
    probs = jax.nn.softmax(logits, axis=-1)
    want = jnp.where(mask[:, None], jnp.take_along_axis(probs, raw.expert_index, axis=-1), 0.0)
    np.testing.assert_allclose(raw.gates, want, rtol=1e-6, atol=1e-7)
    assert float(jnp.max(jnp.abs(jnp.sum(raw.gates[:11], -1) - 1))) > 1e-3  # really not renormalised
    for a, b in zip(raw._replace(gates=None), norm._replace(gates=None)):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    w = jax.random.normal(jax.random.key(1), (13, 2))
    g = jax.grad(lambda lg: jnp.sum(route(lg, renormalize=False, **kw).gates * w))(logits)
    g_want = jax.grad(lambda lg: jnp.sum(jnp.where(mask[:, None], jnp.take_along_axis(
        jax.nn.softmax(lg, axis=-1), raw.expert_index, axis=-1), 0.0) * w))(logits)
    np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_negative_zero_scores_tie_like_positive_zero(impl):
    """A -0.0 logit plus a -0.0 bias entry ties with +0.0 (lower expert index first), in the
    reference as in the kernels (jax.lax.top_k alone would rank -0.0 below +0.0)."""
    logits = jnp.asarray([[-0.0, 0.0], [0.0, -0.0]])
    r = route(logits, top_k=1, capacity=2, bias=jnp.asarray([-0.0, 0.0]), impl=impl)
    np.testing.assert_array_equal(r.expert_index, [[0], [0]])
