"""The ragged expert exchange's types under ``jax.shard_map`` (traced on CPU, no GPU needed)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moefast.kernels.vma import varying_axes
from moefast.parallel import expert


def test_received_rows_vary_over_the_mesh_and_their_gradient_is_not_summed(devices):
    """``jax.lax.ragged_all_to_all`` types its result like its ``output`` buffer. Given a fresh zeros
    buffer (varying over no axis), the rows received were typed as equal on every device, and the
    backward pass summed every device's cotangent over the mesh (found as a bfloat16 all-reduce in
    the dropless expert-parallel step compiled for GPUs). Traced, not compiled: XLA:CPU cannot
    compile the ragged collective."""
    mesh = jax.make_mesh((2, 4), ("data", expert.EXPERT_AXIS), devices=devices)
    seen = {}

    def exchange(x):
        n, d = x.shape
        sizes = jnp.full((4,), n // 4, jnp.int32)
        offsets = jnp.cumsum(sizes) - sizes
        y = expert._ragged_exchange(x, jnp.zeros((n, d), x.dtype), offsets, sizes, offsets, sizes, max_rows=n,
                                    ragged=True)
        seen["axes"] = varying_axes(y)
        w = jnp.arange(n, dtype=x.dtype)[:, None] * (1 + jax.lax.axis_index("data"))  # per-device use
        return (y * w).sum(keepdims=True)

    f = jax.shard_map(exchange, mesh=mesh, in_specs=P(("data", expert.EXPERT_AXIS)),
                      out_specs=P(("data", expert.EXPERT_AXIS)))
    x = jax.device_put(jnp.asarray(np.ones((64, 8)), jnp.bfloat16),
                       NamedSharding(mesh, P(("data", expert.EXPERT_AXIS))))
    grad = str(jax.make_jaxpr(jax.grad(lambda v: f(v).astype(jnp.float32).sum()))(x))
    assert seen["axes"] == {"data", expert.EXPERT_AXIS}
    assert "ragged_all_to_all" in grad
    assert "psum" not in grad, "a cotangent of the exchange is summed over the mesh"
