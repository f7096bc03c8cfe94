"""Expert parallelism: the sharded MoE layer and train step equal the single-device reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moefast.config import load_config
from moefast.parallel import MESH_AXES, RoutingSpec, make_mesh, moe_ffn
from moefast.train import ModelDef
from moefast.train.step import loss_fn

MESHES = [  # (data, fsdp, expert)
    (1, 1, 8), (2, 1, 4), (4, 1, 2), (8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 8, 1),
]
E, K, D, F = 8, 2, 16, 24


def mesh_of(data, fsdp, expert):
    return jax.make_mesh((data, fsdp, expert), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def weights(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], (D, E)), jax.random.normal(k[1], (E, D, 2 * F)) * 0.2,
            jax.random.normal(k[2], (E, F, D)) * 0.2)


def inputs(seed=1, batch=8, t=6):
    x = jax.random.normal(jax.random.key(seed), (batch, t, D))
    mask = jnp.ones((batch, t), bool).at[3, 4:].set(False)  # a little padding
    return x, mask


def layer_loss(x, mask, router, w_in, w_out, *, drop_tokens, capacity_factor=1.0):
    spec = RoutingSpec(top_k=K, capacity_factor=capacity_factor, min_capacity=1)
    y, s = moe_ffn(x, mask, router, w_in, w_out, spec, drop_tokens=drop_tokens)
    loss = jnp.sum(jnp.sin(y)) + s.aux_loss + 0.1 * s.z_loss
    return loss, (y, s)


grad_all = jax.value_and_grad(layer_loss, argnums=(0, 2, 3, 4), has_aux=True)


def run_on_mesh(mesh, fn, *args):
    with jax.set_mesh(mesh):
        return jax.jit(fn)(*args)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_layer_equals_single_device_reference(shape, devices):
    """No drops (capacity = tokens): outputs, losses, counts and gradients match exactly-ish."""
    x, mask = inputs()
    w = weights()
    fn = functools.partial(grad_all, drop_tokens=False)
    (ref_loss, (ref_y, ref_s)), ref_g = jax.jit(fn)(x, mask, *w)
    (loss, (y, s)), g = run_on_mesh(mesh_of(*shape), fn, x, mask, *w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(s.tokens_per_expert), np.asarray(ref_s.tokens_per_expert))
    np.testing.assert_allclose(float(s.aux_loss), float(ref_s.aux_loss), rtol=1e-6)
    np.testing.assert_allclose(float(s.z_loss), float(ref_s.z_loss), rtol=1e-6)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_layer_with_drops_equals_per_device_group_reference(shape, devices):
    """With capacity dropping, each device is one routing group: compare with the reference run on
    each group's tokens separately."""
    x, mask = inputs(batch=8, t=12)
    w = weights(2)
    sharded_y, sharded_s = run_on_mesh(mesh_of(*shape), lambda *a: layer_loss(*a, drop_tokens=True)[1], x, mask, *w)
    groups = 8  # one batch row per device
    ref = [layer_loss(x[i:i + 1], mask[i:i + 1], *w, drop_tokens=True)[1] for i in range(groups)]
    np.testing.assert_allclose(np.asarray(sharded_y), np.concatenate([np.asarray(r[0]) for r in ref]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(sharded_s.tokens_per_expert),
                                  np.sum([np.asarray(r[1].tokens_per_expert) for r in ref], axis=0))
    assert float(sharded_s.dropped_fraction) > 0  # the test exercises dropping


def test_expert_axis_size_one_issues_no_all_to_all(devices):
    x, mask = inputs()
    w = weights()
    f = lambda *a: layer_loss(*a, drop_tokens=True)[0]
    with jax.set_mesh(mesh_of(8, 1, 1)):
        hlo = jax.jit(f).lower(x, mask, *w).as_text()
    assert "all_to_all" not in hlo and "all-to-all" not in hlo
    with jax.set_mesh(mesh_of(2, 1, 4)):
        hlo = jax.jit(f).lower(x, mask, *w).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo


SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16", "model.d_ff=32",
         "model.max_seq_len=32", "moe.num_experts=8", "data.seq_len=16", "data.batch_size=8",
         "moe.capacity_factor=4.0"]  # capacity = tokens per device: nothing drops


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4), (2, 2, 2), (1, 8, 1)], ids=lambda s: "x".join(map(str, s)))
def test_model_loss_and_gradients_equal_single_device(shape, devices):
    data, fsdp, expert = shape
    cfg = load_config(None, SMALL + [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.expert={expert}"])
    md = ModelDef(cfg, 259)
    params = md.init_params(0)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (8, 16)), "targets": rng.integers(0, 256, (8, 16)),
             "segment_ids": np.ones((8, 16), np.int32), "positions": np.tile(np.arange(16), (8, 1)),
             "loss_weight": np.ones((8, 16), np.float32)}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    fn = jax.value_and_grad(lambda p, b: loss_fn(md, p, b, None)[0])
    ref_loss, ref_grads = jax.jit(fn)(params, batch)

    from moefast.parallel import param_specs, shardings
    mesh = make_mesh(cfg)
    specs = param_specs(md.abstract_model_state, mesh)
    sharded = jax.device_put(params, shardings(mesh, specs))
    if expert > 1:  # experts really are split
        w_in = sharded["blocks"][0]["ffn"]["w_in"]
        assert w_in.addressable_shards[0].data.shape[0] == 8 // expert
    if fsdp > 1:
        assert sharded["embed"].addressable_shards[0].data.shape[1] == 32 // fsdp
    batch_sh = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    loss, grads = run_on_mesh(mesh, fn, sharded, batch_sh)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_warmup_noise_under_expert_parallelism_differs_per_shard(devices):
    """Expert warm-up inside shard_map: every token shard folds its own index into the key, so
    identical rows on different devices are routed differently; the statistics stay global."""
    router, w_in, w_out = weights()
    x = jnp.tile(jax.random.normal(jax.random.key(1), (1, 6, D)), (8, 1, 1))  # the same row on every device
    mask = jnp.ones((8, 6), bool)
    spec = RoutingSpec(top_k=K, capacity_factor=4.0, min_capacity=1, warmup_routing="uniform")

    def fn(x, mask, router, w_in, w_out, key):
        y, s = moe_ffn(x, mask, router, w_in, w_out, spec, warmup_key=key, warmup_active=jnp.asarray(True))
        return y, s.tokens_per_expert

    y, counts = run_on_mesh(mesh_of(2, 2, 2), fn, x, mask, router, w_in, w_out, jax.random.key(5))
    assert int(jnp.sum(counts)) == 8 * 6 * K
    assert not np.allclose(np.asarray(y[0]), np.asarray(y[7]))  # different shards, different routing
    y2, _ = run_on_mesh(mesh_of(2, 2, 2), fn, x, mask, router, w_in, w_out, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
