"""Kimi Delta Attention (a decay per key channel, ``g`` [B, T, H, K]) in the gated delta rule's
kernels: the recurrence against a float64 NumPy loop (transformers' ``recurrent_kimi_delta_attention``),
the chunked form against the recurrence (outputs, final states, gradients; T not a multiple of the
chunk, T = 1, one head and an odd number; packed documents equal each document alone; channels
decaying past float32's exp range inside a chunk), and the Pallas kernels (forward and backward, in
the Pallas interpreter) against the chunked form's VJP and the recurrence, with packed documents and
an initial state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.kernels.gated_delta_rule import (gated_delta_rule, gated_delta_rule_chunked, gated_delta_rule_pallas,
                                              gated_delta_rule_reference, resolve)

TOL = dict(rtol=1e-5, atol=1e-5)


def inputs(b=2, t=37, h=3, kd=8, vd=6, seed=0, strong=False):
    """L2-normalised q, k; v; a per-channel log decay in [-1.5, 0] (``strong``: some channels at
    -6 a token, which pass exp's float32 range within 15 tokens); beta in (0, 1); an initial state."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    g = -rng.uniform(0.0, 1.5, size=(b, t, h, kd)) * (rng.uniform(size=(b, t, h, kd)) > 0.1)
    if strong:
        g[..., ::3] = -6.0
    arrays = (unit(rng.normal(size=(b, t, h, kd))), unit(rng.normal(size=(b, t, h, kd))),
              rng.normal(size=(b, t, h, vd)), g, rng.uniform(0.02, 0.98, size=(b, t, h)))
    return tuple(jnp.asarray(x, jnp.float32) for x in arrays), jnp.asarray(rng.normal(size=(b, h, kd, vd)), jnp.float32)


def numpy_kda(q, k, v, g, beta, segment_ids=None, initial_state=None):
    """transformers' ``recurrent_kimi_delta_attention`` in float64 loops (scale K**-0.5), the state
    zeroed where the segment id changes."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, kd = q.shape
    o, final = np.zeros((b, t, h, v.shape[-1])), np.zeros((b, h, kd, v.shape[-1]))
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((kd, v.shape[-1])) if initial_state is None else np.asarray(initial_state, np.float64)[bi, hi]
            for ti in range(t):
                if segment_ids is not None and ti and segment_ids[bi, ti] != segment_ids[bi, ti - 1]:
                    s = np.zeros_like(s)
                s = s * np.exp(g[bi, ti, hi])[:, None]
                delta = beta[bi, ti, hi] * (v[bi, ti, hi] - k[bi, ti, hi] @ s)
                s = s + np.outer(k[bi, ti, hi], delta)
                o[bi, ti, hi] = (q[bi, ti, hi] * kd ** -0.5) @ s
            final[bi, hi] = s
    return o, final


def close(got, want, tol=TOL):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)


def _value_and_grads(fn, args, seed=1):
    """``fn``'s outputs and its VJP of random cotangents, at ``args``."""
    out, vjp = jax.vjp(fn, *args)
    rng = np.random.default_rng(seed)
    return out, vjp(tuple(jnp.asarray(rng.normal(size=y.shape), jnp.float32) for y in out))


def _assert_same(got, want, what: str):
    """``(outputs, grads)`` pairs of :func:`_value_and_grads` equal: o and the final state, then
    each gradient (finite, 1e-4 relative, 2e-5 of its largest)."""
    (out, grads), (want_out, want_grads) = got, want
    close(out[0], want_out[0])
    close(out[1], want_out[1])
    for name, a, e in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, want_grads):
        assert np.all(np.isfinite(np.asarray(a))), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=2e-5 * max(1.0, np.abs(e).max()),
                                   err_msg=f"d/d{name} vs {what}")


def test_reference_equals_the_float64_recurrence():
    x, s0 = inputs(t=21)
    seg = np.repeat(np.where(np.arange(21) < 9, 1, 2)[None], 2, 0)
    o, s = jax.jit(lambda *a: gated_delta_rule_reference(*a, segment_ids=jnp.asarray(seg), initial_state=s0))(*x)
    o_np, s_np = numpy_kda(*x, segment_ids=seg, initial_state=s0)
    close(o, o_np)
    close(s, s_np)


@pytest.mark.parametrize("t,chunk,h,strong", [(37, 16, 3, False), (1, 16, 1, False), (40, 8, 1, True),
                                              (33, 64, 5, True)])
def test_chunked_equals_reference_forward_and_gradients(t, chunk, h, strong):
    """T not a multiple of the chunk, T = 1, one head and odd head counts; strongly decaying
    channels (exp of the chunk's decay below float32's range) stay finite and exact."""
    x, s0 = inputs(t=t, h=h, seed=t, strong=strong)
    fns = [lambda *a, c=c: gated_delta_rule_chunked(*a[:5], initial_state=a[5], chunk_size=c) for c in (chunk,)]
    fns.append(lambda *a: gated_delta_rule_reference(*a[:5], initial_state=a[5]))

    got, want = jax.jit(lambda *a: tuple(_value_and_grads(f, a) for f in fns))(*x, s0)
    _assert_same(got, want, "reference")


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_packed_documents_equal_each_document_alone(impl):
    """Row 0 holds documents starting at 0, 16 (a chunk edge) and 21 (inside a chunk); each gives,
    packed, what it gives alone (padded after it with g = 0, beta = 0, which keep the state), in
    the chunked form and the Pallas kernel (interpreted)."""
    t = 40
    x, _ = inputs(b=1, t=t, seed=4)
    starts = [0, 16, 21, t]
    seg = np.zeros((1, t), np.int32)
    for i, (a, e) in enumerate(zip(starts, starts[1:])):
        seg[0, a:e] = i + 1
    kw = {"interpret": True} if impl == "pallas" else {}
    fn = jax.jit(lambda *a, seg=None: gated_delta_rule(*a, segment_ids=seg, impl=impl, chunk_size=16, **kw))
    o, s = fn(*x, seg=jnp.asarray(seg))
    for a, e in zip(starts, starts[1:]):
        rest = lambda i, y: jnp.zeros_like(y[:, : t - (e - a)]) if i >= 3 else y[:, : t - (e - a)]  # g, beta: 0
        alone = tuple(jnp.concatenate([y[:, a:e], rest(i, y)], axis=1) for i, y in enumerate(x))
        o1, s1 = fn(*alone)
        close(o[:, a:e], o1[:, : e - a])
    close(s, s1)  # the row's final state is its last document's


def test_auto_follows_the_platform_for_a_per_channel_decay():
    """``"auto"`` is ``"chunked"`` on this CPU machine and ``"pallas"`` when compiling for GPUs,
    whatever the decay's shape; the Pallas kernels take a per-channel g; a g of neither shape is
    refused naming both."""
    x, _ = inputs(b=1, t=5, h=1)
    assert resolve("auto") == "chunked" and resolve("auto", "gpu") == "pallas"
    o, _ = gated_delta_rule(*x, impl="auto")
    want = gated_delta_rule_reference(*x)[0]
    close(o, want)
    close(gated_delta_rule_pallas(*x, interpret=True, chunk_size=16)[0], want)
    with pytest.raises(ValueError, match=r"g must be a float \[B, T, H\]=\[1, 5, 1\] .* or \[B, T, H, K\]"):
        gated_delta_rule_reference(x[0], x[1], x[2], x[3][..., :3], x[4])




@pytest.mark.parametrize("t,chunk,h,strong,packed", [
    (37, 16, 3, False, True),  # T not a multiple of the chunk, three heads, documents inside chunks
    (1, 16, 1, False, False),  # one token, one head
    (40, 16, 1, True, True),  # channels at -6 a token: past float32's exp range within a chunk
    (33, 64, 1, True, False),  # one 64-token chunk, strong decays
])
def test_pallas_equals_chunked_and_reference_forward_and_gradients(t, chunk, h, strong, packed):
    """The Pallas kernels (interpreted) with a decay per key channel: o, the final state and every
    gradient (initial state included) equal the chunked form's (its XLA VJP, same chunk) and the
    recurrence's; documents packed in rows reset the state; strong decays stay finite and exact."""
    x, s0 = inputs(t=t, h=h, seed=60 + t, strong=strong)
    seg = None
    if packed:
        seg = jnp.asarray(np.stack([np.where(np.arange(t) < 21, 1, 2), np.where(np.arange(t) < 16, 0, 1)]), jnp.int32)
    fns = [lambda *a, fn=fn, kw=kw: fn(*a[:5], segment_ids=seg, initial_state=a[5], **kw)
           for fn, kw in ((gated_delta_rule_pallas, dict(chunk_size=chunk, interpret=True)),
                          (gated_delta_rule_chunked, dict(chunk_size=chunk)), (gated_delta_rule_reference, {}))]
    results = jax.jit(lambda *a: tuple(_value_and_grads(f, a) for f in fns))(*x, s0)
    for want, what in zip(results[1:], ("chunked", "reference")):
        _assert_same(results[0], want, what)
