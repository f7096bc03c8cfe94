"""MoE layer: per-expert loop reference, dropped tokens, padding, float32 router."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast import routing
from moefast.config import load_config
from moefast.model import build_model, rope_cos_sin
from moefast.parallel import expert as expert_module
from moefast.model.transformer import Block
from moe_reference import loop_reference, make_layer  # tests/moe_reference.py


def apply(layer, x, mask):
    """``layer(x, mask)`` compiled as one program (nnx.jit): the same layer code, seconds faster
    than op-by-op dispatch."""
    return nnx.jit(lambda m, x, mask: m(x, mask))(layer, x, mask)


@pytest.mark.parametrize("t,e,k,cf", [(1, 4, 2, 1.25), (13, 4, 2, 0.5), (32, 8, 2, 1.25), (20, 3, 1, 4.0)])
def test_layer_matches_per_expert_loop(t, e, k, cf):
    layer = make_layer(e=e, k=k, cf=cf)
    x = np.random.default_rng(t).normal(size=(1, t, 16)).astype(np.float32)
    y, stats = apply(layer, jnp.asarray(x), jnp.ones((1, t), bool))
    cap = routing.compute_capacity(t, e, k, cf, 1)
    ref, kept = loop_reference(layer, x[0], cap)
    np.testing.assert_allclose(np.asarray(y[0]), ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(stats.dropped_fraction), 1 - kept.mean(), rtol=1e-6)


def test_gradients_match_loop_reference_by_finite_differences():
    layer = make_layer(e=4, k=2, cf=4.0)
    x = jax.random.normal(jax.random.key(0), (1, 6, 16))

    graphdef, params = nnx.split(layer)

    def f(w_out):
        p = nnx.to_pure_dict(params)
        p["w_out"] = w_out
        y, _ = nnx.merge(graphdef, p)(x, jnp.ones((1, 6), bool))
        return jnp.sum(jnp.sin(y))

    w = layer.w_out[...]
    g = jax.jit(jax.grad(f))(w)
    f = jax.jit(f)
    direction = jax.random.normal(jax.random.key(1), w.shape)
    eps = 1e-3
    fd = (f(w + eps * direction) - f(w - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.sum(g * direction)), float(fd), rtol=2e-3)


def collapsed_layer(e=2, t=8):
    layer = make_layer(e=e, k=1, cf=0.25)  # capacity ceil(0.25 * 8 / 2) = 1
    router = np.zeros((16, e), np.float32)
    router[:, 0] = 1.0
    layer.router[...] = jnp.asarray(router)
    x = np.abs(np.random.default_rng(0).normal(size=(1, t, 16))).astype(np.float32) + 0.5  # all -> expert 0
    return layer, jnp.asarray(x)


def test_dropped_tokens_give_exactly_zero():
    layer, x = collapsed_layer()
    y, stats = apply(layer, x, jnp.ones((1, 8), bool))
    y = np.asarray(y[0])
    assert np.any(y[0] != 0), "the token that kept its slot must get an expert output"
    assert np.all(y[1:] == 0.0), "dropped tokens must get exactly 0 from the MoE branch"
    np.testing.assert_allclose(float(stats.dropped_fraction), 7 / 8)


def test_block_output_equals_residual_for_dropped_tokens():
    cfg = load_config(None, ["model.d_model=16", "model.num_heads=2", "model.head_dim=8", "model.d_ff=24",
                             "moe.num_experts=2", "moe.top_k=1", "moe.capacity_factor=0.25", "moe.min_capacity=1"])
    block = Block(cfg, 0, rngs=nnx.Rngs(0))
    router = np.zeros((16, 2), np.float32)
    router[:, 0] = 50.0
    block.ffn.router[...] = jnp.asarray(router)
    block.ffn_norm.scale[...] = jnp.ones(16)
    x = jnp.asarray(np.abs(np.random.default_rng(1).normal(size=(1, 8, 16))).astype(np.float32) + 1.0)
    rope = rope_cos_sin(jnp.arange(8)[None], 64, 8, 10000.0)
    mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]
    out, stats, _ = block(x, 0, rope, mask, jnp.ones((1, 8), bool), cache=None, cache_index=0,
                          step_key=None, drop_tokens=True)
    attn, _ = block.attn(block.attn_norm(x), rope, mask, None, 0)
    residual = x + attn
    stats = stats.stats(cfg.moe.top_k)  # the block returns routing sums per token shard
    assert int(stats.tokens_per_expert[0]) == 8
    np.testing.assert_array_equal(np.asarray(out[0, 1:]), np.asarray(residual[0, 1:]))
    assert not np.array_equal(np.asarray(out[0, 0]), np.asarray(residual[0, 0]))


def test_padding_changes_nothing():
    layer = make_layer(e=4, k=2, cf=1.0)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 12, 16)).astype(np.float32)
    mask = np.ones((1, 12), bool)
    mask[0, [2, 7, 8, 11]] = False
    x2 = x.copy()
    x2[~mask] = rng.normal(size=(int((~mask).sum()), 16)) * 10  # different padding -> different logits

    graphdef, state = nnx.split(layer)

    def run(xx):
        def loss(params):
            y, s = nnx.merge(graphdef, params)(jnp.asarray(xx), jnp.asarray(mask))
            return jnp.sum(jnp.where(jnp.asarray(mask)[..., None], y, 0) ** 2) + s.aux_loss + s.z_loss, (y, s)
        params = nnx.to_pure_dict(state)
        (l, (y, s)), g = jax.value_and_grad(loss, has_aux=True)(params)
        return l, y, s, g

    run = jax.jit(run)  # one program for both inputs
    l1, y1, s1, g1 = run(x)
    l2, y2, s2, g2 = run(x2)
    np.testing.assert_array_equal(np.asarray(s1.tokens_per_expert), np.asarray(s2.tokens_per_expert))
    assert int(np.asarray(s1.tokens_per_expert).sum()) == int(mask.sum()) * 2
    np.testing.assert_array_equal(np.asarray(s1.aux_loss), np.asarray(s2.aux_loss))
    np.testing.assert_array_equal(np.asarray(s1.z_loss), np.asarray(s2.z_loss))
    np.testing.assert_array_equal(np.asarray(y1)[mask], np.asarray(y2)[mask])
    np.testing.assert_array_equal(np.asarray(y1)[~mask], 0.0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gradient_wrt_padding_logits_is_exactly_zero():
    logits = jax.random.normal(jax.random.key(0), (10, 4)) * 3
    mask = jnp.array([1, 1, 0, 1, 0, 1, 1, 1, 0, 1], bool)
    w = jax.random.normal(jax.random.key(1), (10, 2))

    def loss(lg):
        r = routing.route(lg, top_k=2, capacity=3, mask_t=mask)
        aux = routing.load_balancing_loss(r.tokens_per_expert, r.prob_sum, r.num_tokens, 2)
        z = routing.router_z_loss(r.z_sum, r.num_tokens)
        return aux + z + jnp.sum(r.gates * w)

    g = np.asarray(jax.jit(jax.grad(loss))(logits))
    assert np.all(g[~np.asarray(mask)] == 0.0)
    assert np.any(g[np.asarray(mask)] != 0.0)


def test_router_is_float32_in_bfloat16_model(monkeypatch):
    seen = {}
    real_route = routing.route

    def spy(logits_te, **kw):
        seen["logits"] = logits_te.dtype
        r = real_route(logits_te, **kw)
        seen["gates"] = r.gates.dtype
        return r

    monkeypatch.setattr(expert_module.routing, "route", spy)
    cfg = load_config(None, ["model.dtype=bfloat16", "model.num_layers=1", "model.d_model=32",
                             "model.num_heads=2", "model.head_dim=16", "model.d_ff=32", "moe.num_experts=4"])
    model = build_model(cfg, 259)
    out = nnx.jit(lambda m, x: m(x))(model, jnp.zeros((2, 8), jnp.int32))  # eagerly: op by op, seconds
    assert seen == {"logits": jnp.float32, "gates": jnp.float32}
    assert out.moe.aux_loss.dtype == jnp.float32 and out.moe.z_loss.dtype == jnp.float32
    assert out.logits.dtype == jnp.float32
    r = routing.route(jnp.ones((4, 4), jnp.bfloat16), top_k=2, capacity=2)
    assert r.gates.dtype == jnp.float32 and r.prob_sum.dtype == jnp.float32
