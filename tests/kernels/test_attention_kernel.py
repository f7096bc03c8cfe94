"""The fused attention kernel (Pallas interpreter on CPU) against the dense reference, and the model's
two attention paths against each other, alone and split over a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.kernels.attention import attention_reference, flash_attention, padded_length


def _inputs(t, b=2, h=4, g=2, hd=16, seed=0, dtype=jnp.float32, s=None, hv=None):
    """q [B, T, H, Hd], k [B, S, G, Hd], v [B, S, G, Hv], the queries' ids (the last T of the keys')
    and the keys' ids: two packed documents per row, the last row ending in padding (id 0)."""
    s = t if s is None else s
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, hd)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, g, hd)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, g, hv or hd)), dtype)
    cut = rng.integers(1, s + 1, size=b)
    seg = np.stack([np.where(np.arange(s) < c, 1, 2) for c in cut])
    seg[-1, s - s // 4:] = 0  # trailing padding attends only to padding
    return q, k, v, jnp.asarray(seg[:, s - t:], jnp.int32), jnp.asarray(seg, jnp.int32)


def _check(fns, args, weights, rtol=1e-4):
    """Both functions' outputs and their gradients (of the outputs weighted by ``weights``) equal."""
    outs = [jax.tree.leaves(jax.jit(fn)(*args)) for fn in fns]
    for a, e in zip(*outs):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    loss = lambda fn: lambda *a: sum((o * w).sum() for o, w in zip(jax.tree.leaves(fn(*a)), weights))  # noqa: E731
    # jitted: each function compiled as one program (the kernel still in the Pallas interpreter), not
    # dispatched op by op (CI time)
    grads = [jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(*args) for fn in fns]
    for a, e in zip(*grads):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("t", [1, 37, 130])  # one token; one block not a power of two; two blocks, padded
def test_flash_equals_reference_forward_and_gradients(t):
    q, k, v, seg, _ = _inputs(t)
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    _check([lambda q, k, v, fn=fn: fn(q, k, v, seg) for fn in (flash_attention, attention_reference)], (q, k, v), [w])


@pytest.mark.parametrize("t, s, hd, hv", [(20, 50, 12, 24), (64, 160, 16, 6)],
                         ids=["values-wider", "values-narrower-blocks"])
def test_flash_query_slice_with_its_log_sum_exp(t, s, hd, hv):
    """The last T queries of a row against its S keys (``q_offset = S - T``: the model's second
    sequence slice), keys and values of their own widths (MLA), grouped heads, an explicit scale,
    and the log-sum-exp an output whose cotangent reaches q and k."""
    q, k, v, qs, ks = _inputs(t, s=s, hd=hd, hv=hv, h=6, g=2)
    rng = np.random.default_rng(2)
    w = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((*q.shape[:3], hv), (2, 6, t))]
    kw = dict(kv_segment_ids_bs=ks, q_offset=s - t, return_lse=True, sm_scale=0.4)
    _check([lambda q, k, v, fn=fn: fn(q, k, v, qs, **kw) for fn in (flash_attention, attention_reference)],
           (q, k, v), w)


@pytest.mark.parametrize("window, sinks, offset", [(20, False, 0), (20, True, 30), (1, True, 0)],
                         ids=["window", "window-sinks-slice", "window-of-one-sinks"])
def test_flash_sliding_window_and_sinks(window, sinks, offset):
    """A sliding window over 16-row blocks (key blocks outside it skipped by the loops' bounds, the
    forward's and both backward kernels'), with learned sinks per head (gpt-oss) and a later slice
    of the queries: outputs, log-sum-exp and the gradients of q, k, v and the sinks equal the
    reference's."""
    t = 70
    q, k, v, qs, ks = _inputs(t, s=t + offset, h=4, g=2)
    rng = np.random.default_rng(5)
    sink = jnp.asarray(rng.normal(size=4), jnp.float32) if sinks else None
    w = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in (q.shape, (2, 4, t))]
    kw = dict(kv_segment_ids_bs=ks, q_offset=offset, window=window, return_lse=True)

    def fns(fn, **extra):
        if sink is None:
            return lambda q, k, v: fn(q, k, v, qs, **kw, **extra)
        return lambda q, k, v, s: fn(q, k, v, qs, sinks_h=s, **kw, **extra)

    args = (q, k, v) if sink is None else (q, k, v, sink)
    outs = [jax.jit(f)(*args) for f in (fns(flash_attention, block=16), fns(attention_reference))]
    for a, e in zip(*outs):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: sum((o * x).sum() for o, x in zip(f(*a), w))  # noqa: E731
    grads = [jax.jit(jax.grad(loss(f), argnums=tuple(range(len(args)))))(*args)
             for f in (fns(flash_attention, block=16), fns(attention_reference))]
    for a, e in zip(*grads):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def test_two_key_ranges_merge_through_the_log_sum_exp():
    """Attention over keys [0, S) equals the merge of attention over [0, S1) (no causal constraint
    left: every query is past them) and over [S1, S) (causal, offset), weighted by their
    log-sum-exps; queries that see no key in a range give 0 and -inf, not NaN."""
    q, k, v, qs, ks = _inputs(24, s=72, g=4)
    whole = flash_attention(q, k, v, qs, kv_segment_ids_bs=ks, q_offset=48)
    s1 = 40
    o1, l1 = flash_attention(q, k[:, :s1], v[:, :s1], qs, kv_segment_ids_bs=ks[:, :s1], q_offset=48, return_lse=True)
    o2, l2 = flash_attention(q, k[:, s1:], v[:, s1:], qs, kv_segment_ids_bs=ks[:, s1:], q_offset=48 - s1,
                             return_lse=True)
    assert np.isneginf(np.asarray(l1)).any() and not np.isnan(np.asarray(o1)).any()  # the second document
    lse = jnp.logaddexp(l1, l2)
    merged = sum(o * jnp.exp(l - lse).transpose(0, 2, 1)[..., None] for o, l in ((o1, l1), (o2, l2)))
    np.testing.assert_allclose(merged, whole, rtol=1e-5, atol=1e-5)


def test_flash_bfloat16_and_shapes():
    q, k, v, seg, _ = _inputs(40, dtype=jnp.bfloat16)
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
    with pytest.raises(ValueError, match="power of two >= 16"):
        flash_attention(q, k, v, seg, block=100)
    # the options: one check each, the same in the kernel and the reference
    for fn in (flash_attention, attention_reference):
        with pytest.raises(ValueError, match="q_offset must be >= 0"):
            fn(q, k, v, seg, q_offset=-1)
        with pytest.raises(ValueError, match="q_offset must be a static Python int"):
            fn(q, k, v, seg, q_offset=2.5)
        with pytest.raises(ValueError, match="window must be >= 1"):
            fn(q, k, v, seg, window=0)
        with pytest.raises(ValueError, match=r"one float logit per query head, a \[4\] array; got list"):
            fn(q, k, v, seg, sinks_h=[0.0] * 4)
        with pytest.raises(ValueError, match="pass the keys' document ids as kv_segment_ids_bs"):
            fn(q[:, :10], k, v, seg[:, :10], q_offset=30)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        flash_attention(q, k, v, seg, kv_segment_ids_bs=seg[:, :5])


def test_model_attention_paths_agree_on_a_mesh(small_config, devices):
    """``model.attention_impl=flash`` (the kernel inside shard_map over the 8 token shards) and
    ``blocked``: same logits and parameter gradients for packed rows with padding, a sliding-window
    layer (5 keys) before a full one, and attention sinks (their gradient included); ``auto`` is the
    blocked path on CPU. Each head's largest pre-softmax logit (QK-clip) is the same on both."""
    from flax import nnx

    from moefast.model import build_model
    from moefast.model.transformer import attention_impl

    cfgs = {impl: small_config("model.num_kv_heads=1", "moe.capacity_factor=8", f"model.attention_impl={impl}",
                               "model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=5",
                               "model.attention_sinks=true")
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
                out = nnx.merge(graphdef, p)(tokens, None, seg)
                return jnp.sum(jnp.where(seg[..., None] > 0, jnp.tanh(out.logits), 0.0)), (out.logits, out.max_logits)
            return jax.grad(loss, has_aux=True)(params)

        with jax.set_mesh(mesh):
            return f(params)

    (g_flash, (l_flash, m_flash)), (g_blocked, (l_blocked, m_blocked)) = (loss_and_grads(cfgs["flash"]),
                                                                          loss_and_grads(cfgs["blocked"]))
    np.testing.assert_allclose(l_flash, l_blocked, rtol=1e-4, atol=1e-4)
    assert m_flash.shape == (2, 2)  # [L_attn, H]
    np.testing.assert_allclose(m_flash, m_blocked, rtol=1e-5)
    for a, e in zip(jax.tree.leaves(g_flash), jax.tree.leaves(g_blocked)):
        np.testing.assert_allclose(a, e, rtol=1e-3, atol=1e-5)
    with jax.set_mesh(mesh):
        assert attention_impl("auto", 8) == "blocked"
        with pytest.raises(ValueError, match="not divisible by the 8 token shards"):
            attention_impl("flash", 4)
