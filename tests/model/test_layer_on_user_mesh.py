"""MoELayer inside a user's own program: the mesh they build, the inputs they pass (docs/layer.md,
"The MoE layer in your own model")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast import MoELayer
from moefast.config import MoEConfig


def _layer():
    # capacity for every assignment: capacity is per device, so drops would differ from one device's
    return MoELayer(16, 32, MoEConfig(num_experts=8, top_k=2, capacity_factor=8.0), rngs=nnx.Rngs(0))


def _call(layer, x, mask):
    return jax.jit(lambda x, m: layer(x, m))(x, mask)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_layer_on_jax_make_mesh_is_expert_parallel_and_equal_to_one_device(axis_type, devices):
    """jax.make_mesh's default (Explicit axes, jax 0.10) used to die with a raw shard_map error;
    the inputs are resharded to the layer's specs, the experts exchange tokens (all-to-alls in
    the compiled step) and the result equals the layer without a mesh."""
    layer = _layer()
    x = jax.random.normal(jax.random.key(0), (8, 4, 16))
    mask = jnp.ones((8, 4), bool)
    want, _ = _call(layer, x, mask)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
    with jax.set_mesh(mesh):
        got, stats = _call(layer, x, mask)
        hlo = jax.jit(lambda x, m: layer(x, m)).lower(x, mask).compile().as_text()
    assert hlo.count("all-to-all(") >= 2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_mesh_with_other_axis_names_is_one_clear_error(devices):
    """("dp", "ep") used to run with no expert parallelism at all (0 all-to-alls), silently."""
    layer = _layer()
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"MoELayer: mesh axes 'dp' \(2\), 'ep' \(4\) are not "
                                                             r"among moefast's .*jax.make_mesh\(\(2, 4\), \('data', 'expert'\)\)"):
        _call(layer, jnp.ones((8, 4, 16)), jnp.ones((8, 4), bool))
    # an extra axis of length 1 changes nothing and is allowed
    mesh = jax.make_mesh((8, 1), ("expert", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        assert _call(layer, jnp.ones((8, 4, 16)), jnp.ones((8, 4), bool))[0].shape == (8, 4, 16)


def test_integer_hidden_states_are_refused():
    """They used to return an int32 array of zeros."""
    with pytest.raises(ValueError, match="x_btd must be float hidden states .* got int32"):
        _layer()(jnp.ones((2, 4, 16), jnp.int32), jnp.ones((2, 4), bool))
