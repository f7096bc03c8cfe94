"""MoE layer policies: dropless, gate priority, dynamic capacity, aux-loss-free bias."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast.config import load_config
from moefast.parallel import MESH_AXES
from moefast.train.step import ModelDef, update_routing_state

from moe_reference import loop_reference  # tests/moe_reference.py


def layer_with(**kw):
    base = dict(d=16, f=24, e=4, k=2, cf=1.25, min_cap=1, seed=0)
    d, f, e, k = base["d"], base["f"], kw.pop("e", 4), kw.pop("k", 2)
    from moefast.model import MoELayer

    from moefast.config import MoEConfig

    names = {"policy": "routing_policy", "impl": "routing_impl"}
    moe = MoEConfig(num_experts=e, top_k=k, capacity_factor=kw.pop("cf", 1.25), min_capacity=1,
                    **{names.get(n, n): v for n, v in kw.items()})
    return MoELayer(d, f, moe, rngs=nnx.Rngs(0))


def apply(layer, x, mask, **kw):
    graphdef, state = nnx.split(layer)

    def f(params, x):
        y, s = nnx.merge(graphdef, params)(x, mask, **kw)
        return jnp.sum(jnp.sin(y)) + s.aux_loss, (y, s)

    # jitted: eagerly, the tiled grouped matmul's loop dispatches op by op (seconds per call)
    (_, (y, s)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(nnx.to_pure_dict(state), x)
    return y, s, g


@pytest.mark.parametrize("gmm", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (13, 4, 2), (32, 8, 2), (20, 3, 1), (300, 2, 2)])
def test_dropless_matches_loop_reference_and_dense_path(t, e, k, gmm):
    layer = layer_with(e=e, k=k, cf=0.0, grouped_matmul=gmm)
    x = jnp.asarray(np.random.default_rng(t).normal(size=(1, t, 16)).astype(np.float32))
    mask = jnp.ones((1, t), bool).at[0, t // 2].set(t == 1)  # one padding token (except t=1)
    y, s, g = apply(layer, x, mask)
    ref, kept = loop_reference(layer, np.asarray(x[0]), capacity=t, mask=np.asarray(mask[0]))
    np.testing.assert_allclose(np.asarray(y[0]), ref, rtol=2e-5, atol=2e-6)
    assert float(s.dropped_fraction) == 0.0
    # The grouped path (sort-free permutation + grouped matmul) equals the padded path with
    # capacity = T (a capacity factor of E makes every expert's capacity the whole group).
    dense = layer_with(e=e, k=k, cf=float(e))
    y2, s2, g2 = apply(dense, x, mask)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y2), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape,skew", [((1, 1, 8), False), ((2, 1, 4), False), ((1, 1, 8), True)],
                         ids=["8-expert-shards", "2x4", "8-expert-shards-all-on-one-device"])
def test_dropless_expert_parallel_equals_single_device(shape, skew, devices):
    """The exchange of routed rows only (a dense stand-in for ragged_all_to_all on CPU): with
    padding, and skewed so that every assignment of every device goes to experts 0 and 1 (one
    device receives the worst case, ep·T·K rows, and the others none)."""
    layer = layer_with(e=8, k=2, cf=0.0)
    x = jax.random.normal(jax.random.key(0), (8, 5, 16))
    mask = jnp.ones((8, 5), bool)
    if skew:
        layer.router[...] = jnp.zeros((16, 8)).at[:, :2].set(jnp.linspace(1.0, 2.0, 16)[:, None] * jnp.array([[1.0, 0.5]]))
        x = jnp.abs(x)  # every token's top two: experts 0 and 1
        mask = mask.at[3, 2:].set(False)
    ref_y, ref_s, ref_g = apply(layer, x, mask)
    if skew:
        assert np.asarray(ref_s.tokens_per_expert).tolist() == [37, 37, 0, 0, 0, 0, 0, 0]
    mesh = jax.make_mesh((*shape, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    with jax.set_mesh(mesh):
        y, s, g = jax.jit(functools.partial(apply, layer))(x, mask)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(s.tokens_per_expert), np.asarray(ref_s.tokens_per_expert))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def collapsed_inputs(t=16):
    """All tokens prefer expert 0 (top-1), with distinct router probabilities."""
    layer = layer_with(e=4, k=1, cf=1.0, policy="priority")
    router = np.zeros((16, 4), np.float32)
    router[0, 0] = 1.0
    layer.router[...] = jnp.asarray(router)
    x = np.zeros((1, t, 16), np.float32)
    x[0, :, 0] = np.random.default_rng(1).permutation(np.linspace(0.5, 3.0, t))  # logit of expert 0
    return layer, jnp.asarray(x)


def test_priority_layer_keeps_the_highest_router_probabilities():
    layer, x = collapsed_inputs()  # capacity = ceil(1.0 * 16 / 4) = 4
    y, s, _ = apply(layer, x, jnp.ones((1, 16), bool))
    nonzero = np.flatnonzero(np.any(np.asarray(y[0]) != 0, axis=-1))
    expected = np.argsort(-np.asarray(x[0, :, 0]))[:4]
    assert sorted(nonzero) == sorted(expected)
    np.testing.assert_allclose(float(s.dropped_fraction), 12 / 16)


def test_dynamic_capacity_limit_follows_the_load_average():
    layer = layer_with(e=4, k=1, cf=1.0, capacity_mode="dynamic", capacity_factor_min=0.5, capacity_factor_max=2.0)
    _, x = collapsed_inputs()
    layer.router[...] = collapsed_inputs()[0].router[...]
    mask = jnp.ones((1, 16), bool)
    kept = lambda ema: 16 - round(16 * float(apply(layer, x, mask, load_ema_e=jnp.asarray(ema))[1].dropped_fraction))
    # buffer = capacity at factor 2 = 8; limit = clip(ceil(1.0 * 16 * ema), cap(0.5)=2, 8)
    assert kept([0.25, 0.25, 0.25, 0.25]) == 4
    assert kept([0.7, 0.1, 0.1, 0.1]) == 8  # a hot expert gets more slots, up to the max bound
    assert kept([0.01, 0.33, 0.33, 0.33]) == 2  # ... a cold one fewer, down to the min bound


def test_selection_bias_moves_tokens():
    layer = layer_with(e=4, k=1, cf=4.0)
    x = jax.random.normal(jax.random.key(3), (1, 12, 16))
    mask = jnp.ones((1, 12), bool)
    _, s, _ = apply(layer, x, mask, bias_e=jnp.asarray([0.0, 0.0, 0.0, 5.0]))
    np.testing.assert_array_equal(np.asarray(s.tokens_per_expert), [0, 0, 0, 12])


def test_update_routing_state():
    cfg = load_config(None, ["moe.aux_free_bias_rate=0.1", "moe.load_ema_decay=0.5", "moe.num_experts=4"])

    class Stats:
        tokens_per_expert = jnp.asarray([[10, 0, 2, 4]])

    state = {"bias": jnp.zeros((1, 4)), "load_ema": jnp.full((1, 4), 0.25)}
    new = update_routing_state(cfg, state, Stats)
    np.testing.assert_allclose(np.asarray(new["bias"][0]), [-0.1, 0.1, 0.1, 0.0])
    np.testing.assert_allclose(np.asarray(new["load_ema"][0]), 0.5 * 0.25 + 0.5 * np.array([10, 0, 2, 4]) / 16)
    off = update_routing_state(load_config(None, ["moe.num_experts=4"]), state, Stats)
    np.testing.assert_array_equal(np.asarray(off["bias"]), 0.0)


def test_routing_state_is_not_trained():
    cfg = load_config(None, ["model.num_layers=2", "model.num_dense_layers=1"])
    md = ModelDef(cfg, 259)
    st = md.abstract_state()
    assert st["routing"]["bias"].shape == (1, 8) and st["routing"]["load_ema"].shape == (1, 8)
    opt_leaves = {tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(st["opt_state"])[0]}
    assert not any("routing" in str(p) or "bias" in str(p) for p in opt_leaves)


@pytest.mark.parametrize("policy", ["position", "priority"])
def test_layer_with_pallas_kernel_equals_reference(policy):
    x = jax.random.normal(jax.random.key(5), (2, 9, 16))
    mask = jnp.ones((2, 9), bool).at[1, 7:].set(False)
    outs = {}
    for impl in ("reference", "pallas"):
        layer = layer_with(e=4, k=2, cf=0.75, policy=policy, impl=impl)
        outs[impl] = apply(layer, x, mask, bias_e=jnp.asarray([0.0, 0.1, 0.0, -0.2]))
    (y1, s1, g1), (y2, s2, g2) = outs["reference"], outs["pallas"]
    np.testing.assert_array_equal(np.asarray(s1.tokens_per_expert), np.asarray(s2.tokens_per_expert))
    assert float(s1.dropped_fraction) == float(s2.dropped_fraction) > 0
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
