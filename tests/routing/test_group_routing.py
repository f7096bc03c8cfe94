"""DeepSeek-V3 routing options at the layer: MoEConfig's checks, and on an expert-parallel mesh the
scaling factor applied once and dropped groups never chosen with biases around -1, against a NumPy
MoE layer (the kernel-level cases are tests/kernels/test_routing_groups.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.config import ConfigError, MoEConfig
from moefast.parallel import MESH_AXES, moe_ffn

E, K, D, F = 8, 2, 16, 32
V3 = MoEConfig(num_experts=E, top_k=K, score_func="sigmoid", num_groups=4, topk_groups=2,
               routed_scaling_factor=2.5)


@pytest.mark.parametrize("kw,field", [
    (dict(num_groups=3), "moe.num_groups"),
    (dict(num_groups=4, topk_groups=5), "moe.topk_groups"),
    (dict(num_groups=4, topk_groups=0), "moe.topk_groups"),
    (dict(num_groups=8, topk_groups=2, score_func="sigmoid"), "moe.num_groups"),
    (dict(num_groups=4, topk_groups=1, top_k=3), "moe.topk_groups"),
    (dict(routed_scaling_factor=0.0), "moe.routed_scaling_factor"),
    (dict(score_func="tanh"), "moe.score_func"),
])
def test_config_refuses_impossible_groups_naming_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        MoEConfig(**{"num_experts": 8, "top_k": 2, **kw})


def test_config_accepts_the_families():
    MoEConfig(num_experts=256, top_k=8, score_func="sigmoid", num_groups=8, topk_groups=4,
              routed_scaling_factor=2.5)  # DeepSeek-V3 / Kimi K2 (n_group 1 there)
    MoEConfig(num_experts=160, top_k=6, num_groups=8, topk_groups=3, norm_topk_prob=False,
              routed_scaling_factor=16.0)  # DeepSeek-V2 group_limited_greedy
    MoEConfig(num_experts=128, top_k=8, score_func="sigmoid", routed_scaling_factor=2.5)  # GLM-4.5: one group
    MoEConfig(num_experts=8, top_k=8, num_groups=8, topk_groups=8)  # every group kept: no limit


def _weights(seed=0):
    k = iter(jax.random.split(jax.random.key(seed), 4))
    return (jax.random.normal(next(k), (D, E)), 0.1 * jax.random.normal(next(k), (E, D, 2 * F)),
            0.1 * jax.random.normal(next(k), (E, F, D)), 0.3 * jax.random.normal(next(k), (E,)))


def _layer(x, mask, router, w_in, w_out, bias, *, moe):
    return moe_ffn(x, mask, router, w_in, w_out, moe, drop_tokens=False, bias_e=bias)


def _numpy_layer(x, mask, router, w_in, w_out, bias, scale):
    """The MoE layer in NumPy (float64) with DeepSeek-V3's gate: sigmoid scores, 4 groups scored by
    their two best biased scores, 2 kept, the others' experts at -inf, top-2, gates renormalised and
    scaled; SwiGLU experts ([E, D, 2F] gate|up, [E, F, D] down). Masked tokens give 0."""
    x = np.asarray(x, np.float64).reshape(-1, D)
    s = 1.0 / (1.0 + np.exp(-(x @ np.asarray(router, np.float64))))
    choice = (s + np.asarray(bias, np.float64)).reshape(-1, 4, E // 4)
    group = np.sort(choice, -1)[..., -2:].sum(-1)
    kept = np.zeros(group.shape, bool)
    np.put_along_axis(kept, np.argsort(-group, -1, kind="stable")[:, :2], True, -1)
    choice = np.where(np.repeat(kept, E // 4, -1), choice.reshape(len(x), E), -np.inf)
    index = np.argsort(-choice, -1, kind="stable")[:, :K]
    gates = np.take_along_axis(s, index, -1)
    gates = scale * gates / gates.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    w_in, w_out = np.asarray(w_in, np.float64), np.asarray(w_out, np.float64)
    for t in range(len(x)):
        for e, g in zip(index[t], gates[t]):
            h = x[t] @ w_in[e]
            y[t] += g * ((h[:F] / (1 + np.exp(-h[:F]))) * h[F:]) @ w_out[e]
    return (y * np.asarray(mask, np.float64).reshape(-1, 1)).reshape(np.shape(mask) + (D,))


@pytest.mark.parametrize("bias_around", [0.0, -1.0])
def test_expert_parallel_mesh_matches_a_numpy_layer(bias_around):
    """On a data x expert mesh, moe_ffn's output with routed_scaling_factor 2.5 is 2.5 x its output
    with 1.0 (no shared expert), and equals a NumPy layer with DeepSeek-V3's gate and the
    single-device output (sigmoid, 4 groups, 2 kept), with selection biases near 0 and around -1
    (biased scores of both signs: dropped groups' experts must still never be chosen)."""
    x = jax.random.normal(jax.random.key(1), (4, 6, D))
    mask = jnp.ones((4, 6), bool).at[1, 3:].set(False)
    router, w_in, w_out, bias = _weights()
    bias = bias_around + bias
    args = (x, mask, router, w_in, w_out, bias)
    one = dataclasses.replace(V3, routed_scaling_factor=1.0)
    local = jax.jit(functools.partial(_layer, moe=V3))(*args)[0]
    mesh = jax.make_mesh((2, 1, 2, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    with jax.set_mesh(mesh):
        sharded = {m: jax.jit(functools.partial(_layer, moe=m))(*args)[0] for m in (V3, one)}
    want = _numpy_layer(x, mask, router, w_in, w_out, bias, 2.5)
    np.testing.assert_allclose(sharded[V3], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sharded[V3], 2.5 * np.asarray(sharded[one]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sharded[V3], local, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(local))) > 0.1  # a test that cannot pass on zeros
