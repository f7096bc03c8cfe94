"""Mixed precision ops (moefast.parallel.precision) against plain JAX: values and gradients, on one
device and sharded over the 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from moefast.parallel import state_spec
from moefast.parallel.precision import dense, embed_lookup, expert_weights


def _inputs(seed=0, shape_x=(2, 5, 24), shape_w=(24, 16)):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, shape_x, jnp.float32), jax.random.normal(k2, shape_w, jnp.float32),
            jax.random.normal(k3, shape_x[:-1] + shape_w[-1:], jnp.float32))


@pytest.mark.parametrize("transposed", [False, True])
def test_dense_float32_is_the_plain_matmul(transposed):
    x, w, g = _inputs()
    w_stored = w.T if transposed else w
    plain = lambda x, w: jnp.sum((x @ (w.T if transposed else w)) * g)
    ours = lambda x, w: jnp.sum(dense(x, w, jnp.float32, ("embed", "mlp"), transposed=transposed) * g)
    np.testing.assert_allclose(ours(x, w_stored), plain(x, w_stored), rtol=1e-6)
    for a, b in zip(jax.grad(ours, (0, 1))(x, w_stored), jax.grad(plain, (0, 1))(x, w_stored)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dense_bfloat16_weight_gradient_is_float32():
    x, w, g = _inputs(1)
    out, vjp = jax.vjp(lambda x, w: dense(x, w, jnp.bfloat16, ("embed", "mlp")), x, w)
    assert out.dtype == jnp.bfloat16
    dx, dw = vjp(g.astype(jnp.bfloat16))
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    xb, gb = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
    want = jnp.einsum("bti,bto->io", xb, gb, preferred_element_type=jnp.float32)  # f32 result, not bf16
    np.testing.assert_array_equal(dw, want)
    assert not np.array_equal(dw, want.astype(jnp.bfloat16).astype(jnp.float32))  # a bf16 sum would differ


def test_embed_lookup_gradient_is_the_float32_scatter_add():
    table = jax.random.normal(jax.random.key(2), (11, 8), jnp.float32)
    ids = jnp.array([[1, 3, 3, 10], [0, 1, 1, 1]])
    g = jax.random.normal(jax.random.key(3), (2, 4, 8), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        f = lambda t: jnp.sum(embed_lookup(t, ids, dtype, ("vocab", "embed")).astype(jnp.float32) * g)
        np.testing.assert_array_equal(embed_lookup(table, ids, dtype, ("vocab", "embed")), table[ids].astype(dtype))
        # the cotangent reaching the lookup is g in `dtype`; the sum over repeated ids is float32
        want = jnp.zeros_like(table).at[ids].add(g.astype(dtype).astype(jnp.float32))
        np.testing.assert_allclose(jax.grad(f)(table), want, rtol=1e-6)


def test_sharded_weights_match_one_device(devices):
    """data 4 x fsdp 2: weights split as the train state holds them, gathered in bfloat16 for the
    matmul; the gradient (reduce-scattered in float32 by XLA) equals the one-device gradient."""
    mesh = jax.make_mesh((4, 2, 1), ("data", "fsdp", "expert"), axis_types=(AxisType.Auto,) * 3, devices=devices)
    x, w, g = _inputs(4, (8, 3, 24), (24, 16))
    names = ("embed", "mlp")
    spec = state_spec(names, w.shape, mesh)
    assert spec == P(("data", "fsdp"), None)  # in mesh order: one reduce-scatter
    loss = lambda x, w: jnp.sum(dense(x, w, jnp.bfloat16, names).astype(jnp.float32) * g)
    want = jax.grad(loss, (0, 1))(x, w)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
        ws = jax.device_put(w, NamedSharding(mesh, spec))
        got = jax.jit(jax.grad(loss, (0, 1)), out_shardings=(NamedSharding(mesh, P(("data", "fsdp", "expert"))),
                                                             NamedSharding(mesh, spec)))(xs, ws)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-2, atol=2e-2)  # bf16 compute, different tiling
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)  # f32 sums of the same bf16 products


def test_expert_weights_inside_shard_map(devices):
    """Gathered over data and fsdp inside shard_map, kept split over expert; the gradient is the
    sum over every device's tokens, returned to each device's shard."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "expert"), axis_types=(AxisType.Auto,) * 3, devices=devices)
    w = jax.random.normal(jax.random.key(5), (4, 8, 6), jnp.float32)  # [E, D, F]
    x = jax.random.normal(jax.random.key(6), (8, 8), jnp.float32)  # [tokens, D], split over all axes
    names, axes = ("expert", "embed", "mlp"), ("data", "fsdp", "expert")
    spec = state_spec(names, w.shape, mesh)
    assert spec == P(("expert", "data"), "fsdp", None)

    def local(x_td, w_local):  # this device's tokens through its experts
        we = expert_weights(w_local, jnp.float32, spec, axes, keep="expert")  # [E/2, D, F]
        return jax.lax.psum(jnp.sum(jnp.einsum("td,edf->tef", x_td, we) ** 2), axes)

    def loss_sharded(x, w):
        return jax.shard_map(local, in_specs=(P(axes), spec), out_specs=P())(x, w)

    # token t sits on the device with expert coordinate t % 2 (tokens split data-major over the
    # three axes, one per device), which holds experts 2 (t % 2) and 2 (t % 2) + 1
    mine = (jnp.arange(4)[None, :] // 2 == jnp.arange(8)[:, None] % 2)[:, :, None]

    def loss_ref(x, w):
        return jnp.sum(jnp.where(mine, jnp.einsum("td,edf->tef", x, w), 0.0) ** 2)

    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, spec))
        got = jax.jit(jax.grad(loss_sharded, 1), out_shardings=NamedSharding(mesh, spec))(x, ws)
    np.testing.assert_allclose(got, jax.grad(loss_ref, 1)(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape, names, spec", [
    ((4, 2), ("data", "fsdp"), P(None, ("data", "fsdp"), None)),  # ZeRO over data joined to fsdp's dimension
    ((4, 2), ("data", "context"), P(("data", "context"), None, None)),  # ZeRO over data and context
])
def test_expert_weights_gathered_in_the_shards_order(devices, mesh_shape, names, spec):
    """A dimension split over two axes holds block (i, j) of the (major, minor) axes at i * m + j:
    gathered minor axis first, the weight comes back whole in its order (gathered major first, the
    blocks came back interleaved: every expert's weights permuted on data x fsdp meshes); its
    gradient goes back to each device's own block."""
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * 2, devices=devices)
    w = jax.random.normal(jax.random.key(7), (8, 8, 4), jnp.float32)
    c = jax.random.normal(jax.random.key(8), (8, 8, 4), jnp.float32)

    def whole(w_local):
        return expert_weights(w_local, jnp.float32, spec, names, keep=None)

    def loss(w):  # every device sees the whole weight; the loss is one device's
        return jax.shard_map(lambda w_: jnp.sum(whole(w_) * c), in_specs=(spec,), out_specs=P(), check_vma=False)(w)

    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, spec))
        got = jax.jit(jax.shard_map(whole, in_specs=(spec,), out_specs=P(), check_vma=False))(ws)
        grad = jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, spec))(ws)
    np.testing.assert_array_equal(got, w)
    np.testing.assert_allclose(grad, c, rtol=1e-6)
