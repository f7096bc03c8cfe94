"""The fused attention kernel (Pallas interpreter on CPU) against the dense reference, and the model's
two attention paths against each other, alone and split over a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.kernels.attention import attention_reference, flash_attention, padded_length


def _inputs(t, b=2, h=4, g=2, hd=16, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, hd)), dtype) for n in (h, g, g))
    cut = rng.integers(1, t + 1, size=b)
    seg = np.stack([np.where(np.arange(t) < c, 1, 2) for c in cut])  # two packed documents
    seg[-1, t - t // 4:] = 0  # trailing padding attends only to padding
    return q, k, v, jnp.asarray(seg, jnp.int32)


@pytest.mark.parametrize("t", [1, 37, 130])  # one token; one block not a power of two; two blocks, padded
def test_flash_equals_reference_forward_and_gradients(t):
    q, k, v, seg = _inputs(t)
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    # jitted: each function compiled as one program (the kernel still in the Pallas interpreter), not
    # dispatched op by op (CI time)
    np.testing.assert_allclose(jax.jit(flash_attention)(q, k, v, seg), jax.jit(attention_reference)(q, k, v, seg),
                               rtol=1e-5, atol=1e-5)
    grads = [jax.jit(jax.grad(lambda *a, fn=fn: (fn(*a, seg) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
             for fn in (flash_attention, attention_reference)]
    for a, e in zip(*grads):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hv", [6, 24], ids=["values-narrower", "values-wider"])
def test_flash_with_value_width_unlike_the_key_width(hv):
    """MLA's shapes (values of ``v_head_dim`` features, queries/keys of ``qk_nope + qk_rope``): the
    narrower side is padded with zero features inside the wrapper; an explicit scale is kept."""
    q, k, _, seg = _inputs(20, h=2, g=2, hd=12)
    v = jnp.asarray(np.random.default_rng(2).normal(size=(*k.shape[:3], hv)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(*q.shape[:3], hv)), jnp.float32)
    fns = [lambda q, k, v, fn=fn: fn(q, k, v, seg, sm_scale=0.4) for fn in (flash_attention, attention_reference)]
    outs = [jax.jit(fn)(q, k, v) for fn in fns]
    assert outs[0].shape == (*q.shape[:3], hv)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    grads = [jax.jit(jax.grad(lambda *a, fn=fn: (fn(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v) for fn in fns]
    for a, e in zip(*grads):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def test_flash_bfloat16_and_shapes():
    q, k, v, seg = _inputs(40, dtype=jnp.bfloat16)
    out = flash_attention(q, k, v, seg)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    ref = attention_reference(*(a.astype(jnp.float32) for a in (q, k, v)), seg)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2)
    assert padded_length(37) == (64, 64) and padded_length(130) == (128, 256) and padded_length(1) == (16, 16)
    with pytest.raises(ValueError, match="kv_heads dividing"):
        flash_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), seg)
    with pytest.raises(ValueError, match="segment_ids"):
        flash_attention(q, k, v, seg[:, :5])
    with pytest.raises(ValueError, match="one float dtype"):
        flash_attention(q, k.astype(jnp.float32), v, seg)
    with pytest.raises(ValueError, match="power-of-two block"):
        flash_attention(q, k, v, seg, block=100)


def test_model_attention_paths_agree_on_a_mesh(small_config, devices):
    """``model.attention_impl=flash`` (the kernel inside shard_map over the 8 token shards) and
    ``blocked``: same logits and parameter gradients for packed rows with padding; ``auto`` is the
    blocked path on CPU."""
    from flax import nnx

    from moefast.model import build_model
    from moefast.model.transformer import attention_impl

    cfgs = {impl: small_config("model.num_kv_heads=1", "moe.capacity_factor=8", f"model.attention_impl={impl}")
            for impl in ("flash", "blocked")}
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (8, 32)), jnp.int32)
    seg = jnp.asarray(np.where(np.arange(32)[None] < rng.integers(1, 33, (8, 1)), 1, 2), jnp.int32).at[:, 28:].set(0)
    mesh = jax.make_mesh((8,), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))

    def loss_and_grads(cfg):
        model = build_model(cfg, 259, seed=0)
        graphdef, params = nnx.split(model)

        @jax.jit
        def f(params):
            def loss(p):
                logits = nnx.merge(graphdef, p)(tokens, None, seg).logits
                return jnp.sum(jnp.where(seg[..., None] > 0, jnp.tanh(logits), 0.0)), logits
            return jax.grad(loss, has_aux=True)(params)

        with jax.set_mesh(mesh):
            return f(params)

    (g_flash, l_flash), (g_blocked, l_blocked) = loss_and_grads(cfgs["flash"]), loss_and_grads(cfgs["blocked"])
    np.testing.assert_allclose(l_flash, l_blocked, rtol=1e-4, atol=1e-4)
    for a, e in zip(jax.tree.leaves(g_flash), jax.tree.leaves(g_blocked)):
        np.testing.assert_allclose(a, e, rtol=1e-3, atol=1e-5)
    with jax.set_mesh(mesh):
        assert attention_impl("auto", 8) == "blocked"
        with pytest.raises(ValueError, match="not divisible by the 8 token shards"):
            attention_impl("flash", 4)
