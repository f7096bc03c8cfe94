"""The gated delta rule: the recurrence against a NumPy float64 loop, and the chunked form and the
Pallas kernels (interpreted on CPU; lowered for CUDA) against the recurrence, outputs, final states
and gradients, over packed documents. The Pallas backward kernels' gradients are also compared with
the chunked form's VJP (same chunk), and the lowered gradient program is checked to hold the
kernels and none of the chunked form's XLA ops. Decays per key channel (KDA): test_kda.py.

Shapes are small; chunks are mostly 16 tokens (some 64, and 1 and 5 for the jnp form) and T is
not a multiple of them, so the last chunk is padded; documents start inside chunks and on chunk
edges. The compiled kernel's cases run on a GPU only (``gpu`` marker); here they run in the
Pallas interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.recurrence_helpers import (FWD_TOL, GRAD_TOL, assert_close, packed_row_segments,  # noqa: F401
                                             run, with_vjp)
from tests.kernels.recurrence_helpers import assert_close_grads as _assert_close_grads
from moefast.kernels.gated_delta_rule import (IMPLS, gated_delta_rule, gated_delta_rule_chunked,
                                              gated_delta_rule_pallas, gated_delta_rule_reference, resolve)
from moefast.kernels.gated_delta_rule.chunked import chunked_core
from moefast.kernels.gated_delta_rule.pallas_bwd import gated_delta_rule_bwd_blocks
from moefast.kernels.gated_delta_rule.reference import run_ids

# Float32 math everywhere; the forms differ only in summation order (and exp(sum) vs prod(exp)).


def assert_close_grads(got, want, names=("q", "k", "v", "g", "beta", "initial_state")):
    _assert_close_grads(got, want, names)


def make_inputs(b=2, t=37, h=2, kd=8, vd=16, seed=0, dtype=jnp.float32):
    """q, k (L2-normalised), v, g (log decay in [-1.5, 0], a few exactly 0), beta in (0, 1), and a
    random float32 initial state."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(b, t, h, kd)))
    k = unit(rng.normal(size=(b, t, h, kd)))
    v = rng.normal(size=(b, t, h, vd))
    g = -rng.uniform(0.0, 1.5, size=(b, t, h)) * (rng.uniform(size=(b, t, h)) > 0.1)
    beta = rng.uniform(0.02, 0.98, size=(b, t, h))
    s0 = rng.normal(size=(b, h, kd, vd))
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(q), cast(k), cast(v), cast(g), cast(beta)), jnp.asarray(s0, jnp.float32)


def numpy_recurrence(q, k, v, g, beta, segment_ids=None, initial_state=None, scale=None):
    """The recurrence of transformers' ``torch_recurrent_gated_delta_rule`` in float64 loops, with
    the state zeroed wherever the segment id changes."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    scale = kd ** -0.5 if scale is None else scale
    o = np.zeros((b, t, h, vd))
    final = np.zeros((b, h, kd, vd))
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((kd, vd)) if initial_state is None else np.asarray(initial_state, np.float64)[bi, hi].copy()
            for ti in range(t):
                if segment_ids is not None and ti > 0 and segment_ids[bi, ti] != segment_ids[bi, ti - 1]:
                    s = np.zeros((kd, vd))
                s = s * np.exp(g[bi, ti, hi])
                kv = k[bi, ti, hi] @ s
                delta = beta[bi, ti, hi] * (v[bi, ti, hi] - kv)
                s = s + np.outer(k[bi, ti, hi], delta)
                o[bi, ti, hi] = (q[bi, ti, hi] * scale) @ s
            final[bi, hi] = s
    return o, final








def documents_alone(inputs, s0, starts, t):
    """Each document of the packed rows left-aligned in a row of its own (no segment ids): tokens
    after it have g = 0 and beta = 0, which leave the state as the document left it. The initial
    state goes to each row's first document only."""
    q, k, v, g, beta = inputs
    rows, state, where = [[] for _ in range(5)], [], []
    for r, row_starts in enumerate(starts):
        ends = row_starts[1:] + [t]
        for d, (s, e) in enumerate(zip(row_starts, ends)):
            for out, x, keep in zip(rows, (q, k, v, g, beta), (True, True, True, False, False)):
                doc = x[r, s:e]
                rest = x[r, : t - (e - s)] if keep else jnp.zeros_like(x[r, : t - (e - s)])
                out.append(jnp.concatenate([doc, rest], axis=0))
            state.append(s0[r] if d == 0 else jnp.zeros_like(s0[r]))
            where.append((r, s, e, d == len(row_starts) - 1))
    return tuple(jnp.stack(x) for x in rows), jnp.stack(state), where






# ---- the recurrence ------------------------------------------------------------------------------


@pytest.mark.parametrize("segmented", [False, True])
def test_reference_equals_numpy_float64_loop(segmented):
    inputs, s0 = make_inputs(b=2, t=70, seed=1)
    _, seg = packed_row_segments(70)
    seg = jnp.asarray(seg) if segmented else None
    o, s = run(lambda *a: gated_delta_rule_reference(*a, segment_ids=seg, initial_state=s0, scale=0.3), *inputs)
    o_np, s_np = numpy_recurrence(*inputs, segment_ids=None if seg is None else np.asarray(seg),
                                  initial_state=s0, scale=0.3)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert_close(o, o_np, err_msg="o")
    assert_close(s, s_np, err_msg="final_state")


def test_reference_default_scale_and_zero_initial_state():
    inputs, _ = make_inputs(b=1, t=9, h=3, kd=4, vd=5, seed=2)
    o, s = gated_delta_rule_reference(*inputs)
    o_np, s_np = numpy_recurrence(*inputs)  # scale K**-0.5, zero state
    assert_close(o, o_np)
    assert_close(s, s_np)


# ---- the chunked form ----------------------------------------------------------------------------


@pytest.mark.parametrize("t,chunk,with_state", [(37, 16, False), (37, 16, True), (70, 64, True), (1, 16, True),
                                                (37, 5, False)])
def test_chunked_equals_reference(t, chunk, with_state):
    inputs, s0 = make_inputs(t=t, seed=t + chunk)
    kw = dict(initial_state=s0 if with_state else None)
    (o, s), (o_ref, s_ref) = run(lambda *a: (gated_delta_rule_chunked(*a, chunk_size=chunk, **kw),
                                             gated_delta_rule_reference(*a, **kw)), *inputs)
    assert o.shape == inputs[2].shape and s.shape == s0.shape
    assert_close(o, o_ref, err_msg="o")
    assert_close(s, s_ref, err_msg="final_state")


def test_packed_documents_chunked():
    """Documents packed in a row give exactly what each gives alone, with boundaries on a chunk edge
    and inside a chunk; and the packed rows equal the recurrence."""
    check_packed_documents(functools.partial(gated_delta_rule_chunked, chunk_size=16), seed=5)


def check_packed_documents(fn, seed, t=70):
    """``fn`` on a packed row equals ``fn`` on each document alone, and the recurrence on the row."""
    inputs, s0 = make_inputs(t=t, seed=seed)
    starts, seg = packed_row_segments(t)
    alone, alone_s0, where = documents_alone(inputs, s0, starts, t)
    (o, s), (o1, s1), (o_ref, s_ref) = run(
        lambda a, b: (fn(*a, segment_ids=jnp.asarray(seg), initial_state=s0), fn(*b, initial_state=alone_s0),
                      gated_delta_rule_reference(*a, segment_ids=jnp.asarray(seg), initial_state=s0)),
        inputs, alone)
    check_packed(o, s, o1, s1, where)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


def check_packed(o, s, o_alone, s_alone, where):
    for i, (r, start, end, last) in enumerate(where):
        assert_close(o[r, start:end], o_alone[i, : end - start], err_msg=f"row {r}, document at {start}")
        if last:
            assert_close(s[r], s_alone[i], err_msg=f"final state of row {r}")


def test_chunked_gradients_equal_reference():
    t = 37
    inputs, s0 = make_inputs(t=t, seed=7)
    seg = jnp.asarray(np.where(np.arange(t) < 20, 0, 1)[None].repeat(2, 0), jnp.int32)  # a start inside chunk 1
    fns = [lambda q, k, v, g, beta, s, fn=fn, kw=kw: fn(q, k, v, g, beta, segment_ids=seg, initial_state=s, **kw)
           for fn, kw in ((gated_delta_rule_chunked, dict(chunk_size=16)), (gated_delta_rule_reference, {}))]
    (out, grads), (out_ref, grads_ref) = run(lambda *a: (with_vjp(fns[0])(*a), with_vjp(fns[1])(*a)), *inputs, s0)
    assert_close(out[0], out_ref[0])
    assert_close_grads(grads, grads_ref)


def test_bfloat16_inputs():
    """Any float dtype in; o in v's dtype, the state float32, the math float32 (compared with the
    recurrence on the same bfloat16 values upcast)."""
    inputs, s0 = make_inputs(t=21, seed=8, dtype=jnp.bfloat16)
    o, s = run(lambda *a: gated_delta_rule(*a, initial_state=s0, impl="chunked", chunk_size=16), *inputs)
    o_ref, s_ref = numpy_recurrence(*inputs, initial_state=s0)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), o_ref, rtol=1e-2, atol=2e-2)  # o rounded to bfloat16
    assert_close(s, s_ref)


# ---- the Pallas kernel: compiled on a GPU, interpreted here; lowered for CUDA --------------------


class _PallasCases:
    """The kernel's tests, shared by the compiled (GPU) and interpreted variants (jax's
    ``gpu_ops_test`` style)."""

    INTERPRET = False

    def pallas(self, *args, **kw):
        return gated_delta_rule_pallas(*args, interpret=self.INTERPRET, **kw)

    @pytest.mark.parametrize("t,kd,vd,chunk,dtype", [
        (37, 8, 16, 16, jnp.float32),  # padded last chunk; K and V padded to 16 for the kernel
        (70, 12, 20, 64, jnp.float32),  # one 64-token chunk and a padded one; widths not powers of two
        (1, 8, 8, 16, jnp.float32),  # one token
        (21, 16, 16, 16, jnp.bfloat16),  # bfloat16 in and out, float32 inside
    ])
    def test_equals_chunked_and_reference(self, t, kd, vd, chunk, dtype):
        inputs, s0 = make_inputs(t=t, kd=kd, vd=vd, seed=t + kd, dtype=dtype)
        (o, s), (o_c, s_c), (o_ref, s_ref) = run(
            lambda *a: (self.pallas(*a, initial_state=s0, chunk_size=chunk, scale=0.4),
                        gated_delta_rule_chunked(*a, initial_state=s0, chunk_size=chunk, scale=0.4),
                        gated_delta_rule_reference(*a, initial_state=s0, scale=0.4)), *inputs)
        assert o.dtype == dtype and o.shape == inputs[2].shape and s.dtype == jnp.float32 and s.shape == s0.shape
        if dtype == jnp.bfloat16:  # outputs rounded to bfloat16: at most an ulp apart
            np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_c, np.float32), rtol=1e-2, atol=1e-2)
        else:
            assert_close(o, o_c, err_msg="o vs chunked")
            assert_close(o, o_ref, err_msg="o vs reference")
        assert_close(s, s_c, err_msg="final_state vs chunked")
        assert_close(s, s_ref, err_msg="final_state vs reference")

    def test_packed_documents(self):
        check_packed_documents(functools.partial(self.pallas, chunk_size=16), seed=11)

    @pytest.mark.parametrize("t,h,chunk,segmented", [
        (1, 1, 16, False),  # one token, one head
        (21, 3, 16, True),  # an odd number of heads; a document starts inside the second chunk
        (70, 1, 64, True),  # chunks of 64, T not a multiple; documents on a chunk edge and inside one
    ])
    def test_gradients_equal_chunked_vjp(self, t, h, chunk, segmented):
        """The backward kernels equal the XLA VJP of the chunked form (same chunk size) they
        replace and the recurrence's gradients, every gradient including the initial state's,
        with random cotangents of o and of the final state."""
        inputs, s0 = make_inputs(b=2, t=t, h=h, kd=8, vd=16, seed=40 + t)
        seg = None
        if segmented:
            seg = jnp.asarray(np.stack([np.where(np.arange(t) < min(16, t - 1), 2, 3),
                                        np.where(np.arange(t) < t // 3, 0, 1)]), jnp.int32)
        fns = [lambda q, k, v, g, beta, s, fn=fn, kw=kw: fn(q, k, v, g, beta, segment_ids=seg, initial_state=s, **kw)
               for fn, kw in ((self.pallas, dict(chunk_size=chunk)), (gated_delta_rule_chunked, dict(chunk_size=chunk)),
                              (gated_delta_rule_reference, {}))]
        (out, grads), *wants = run(lambda *a: tuple(with_vjp(f)(*a) for f in fns), *inputs, s0)
        for out_w, grads_w in wants:
            assert_close(out[0], out_w[0])
            assert_close(out[1], out_w[1])
            assert_close_grads(grads, grads_w)

    def test_bfloat16_gradients_take_the_inputs_dtypes(self):
        """bfloat16 q, k, v, g, beta: gradients in bfloat16 (computed in float32), the initial
        state's in float32, each within bfloat16 rounding of the chunked form's VJP."""
        inputs, s0 = make_inputs(t=21, seed=44, dtype=jnp.bfloat16)
        fns = [lambda q, k, v, g, beta, s, fn=fn: fn(q, k, v, g, beta, initial_state=s, chunk_size=16)
               for fn in (self.pallas, gated_delta_rule_chunked)]
        (_, grads), (_, grads_c) = run(lambda *a: (with_vjp(fns[0])(*a), with_vjp(fns[1])(*a)), *inputs, s0)
        for name, a, e, x in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads_c, (*inputs, s0)):
            assert a.dtype == x.dtype, name
            a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
            np.testing.assert_allclose(a, e, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(e).max()), err_msg=name)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_backward_value_blocks_sum_to_the_chunked_vjp(per_channel):
    """V = 40 split in value blocks of 16 (Vp = 64: four programs per head, one all padding): dv
    and d(initial state) per block, dq, dk, dg and dbeta summed over the blocks' shares, against
    the chunked form's VJP; packed documents, T = 37 in chunks of 16."""
    b, t, h, kd, vd = 2, 37, 1, 8, 40
    (q, k, v, g, beta), s0 = make_inputs(b=b, t=t, h=h, kd=kd, vd=vd, seed=50)
    if per_channel:
        g = jnp.asarray(-np.random.default_rng(51).uniform(0.0, 1.5, size=(b, t, h, kd)), jnp.float32)
    run_bt = run_ids(jnp.asarray(np.stack([np.where(np.arange(t) < 16, 1, 2), np.where(np.arange(t) < 23, 0, 1)]),
                                 jnp.int32), b, t)
    rng = np.random.default_rng(52)
    do, ds = jnp.asarray(rng.normal(size=v.shape), jnp.float32), jnp.asarray(rng.normal(size=s0.shape), jnp.float32)

    def both(q, k, v, g, beta, s0, do, ds):
        got = gated_delta_rule_bwd_blocks(q, k, v, g, beta, run_bt, s0, do, ds, scale=0.4, chunk_size=16,
                                          interpret=True, block_v=16)
        _, vjp = jax.vjp(lambda *a: chunked_core(*a[:5], run_bt, a[5], scale=0.4, chunk_size=16), q, k, v, g, beta, s0)
        return got, vjp((do, ds))

    got, want = run(both, q, k, v, g, beta, s0, do, ds)
    assert_close_grads(got, want)


@pytest.mark.gpu
class TestGatedDeltaRulePallas(_PallasCases):
    """The compiled kernel (Pallas Triton backend)."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if jax.default_backend() != "gpu":
            pytest.skip("the compiled Pallas kernel needs an NVIDIA GPU (Pallas Triton backend); "
                        "TestGatedDeltaRulePallasInterpret runs the same tests in the Pallas interpreter")


class TestGatedDeltaRulePallasInterpret(_PallasCases):
    INTERPRET = True


pallas_interpret = functools.partial(gated_delta_rule_pallas, interpret=True)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_pallas_lowers_for_cuda_from_cpu(per_channel):
    """The compiled path (``interpret=False``) lowers to Triton kernels at a realistic head size
    (K = V = 128, chunks of 64, bfloat16 inputs, packed documents), for a decay per head and per
    key channel: the forward is one kernel; the gradient program is three (the forward for o,
    then the backward's state recompute and its reverse loop, by name) and none of the chunked
    form's XLA VJP (its ``jax.lax.scan`` over chunks is a ``stablehlo.while``, which the same
    gradient through ``impl="chunked"`` has; no triangular solve either). This checks the
    Pallas -> Triton IR lowering (power-of-two tensors, supported primitives) on a CPU-only
    jaxlib; compiling the Triton IR to PTX needs a GPU toolchain."""
    b, t, h, kd, vd = 2, 300, 4, 128, 128
    sd = jax.ShapeDtypeStruct
    g = sd((b, t, h, kd), jnp.float32) if per_channel else sd((b, t, h), jnp.float32)
    args = (sd((b, t, h, kd), jnp.bfloat16), sd((b, t, h, kd), jnp.bfloat16), sd((b, t, h, vd), jnp.bfloat16),
            g, sd((b, t, h), jnp.float32), sd((b, t), jnp.int32), sd((b, h, kd, vd), jnp.float32))

    def fwd(q, k, v, g, beta, seg, s0, impl="pallas"):
        return gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=s0, impl=impl, chunk_size=64,
                                interpret=False)

    def loss(q, k, v, g, beta, seg, s0, impl="pallas"):
        o, s = fwd(q, k, v, g, beta, seg, s0, impl)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)

    lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lower(fwd).count("__gpu$xla.gpu.triton") == 1
    grad_text = lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)))
    assert grad_text.count("__gpu$xla.gpu.triton") == 3
    for name in ("gated_delta_rule", "gated_delta_rule_states", "gated_delta_rule_bwd"):
        assert f'name = "{name}"' in grad_text, name
    assert "stablehlo.while" not in grad_text and "triangular_solve" not in grad_text
    chunked_text = lower(jax.grad(functools.partial(loss, impl="chunked"), argnums=(0, 1, 2, 3, 4, 6)))
    assert "stablehlo.while" in chunked_text  # what the assertion above would find on the old path


def test_pallas_inside_shard_map():
    """Rows split over a 2-device mesh with ``jax.shard_map``: the compiled kernel lowers for CUDA
    with ``check_vma=True`` (its outputs declare the mesh axes they vary over), and so does its
    gradient (the forward and the two backward kernels); the interpreter
    runs with ``check_vma=False`` and equals the chunked form, and refuses ``check_vma=True`` with a
    clear error."""
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2], axis_types=(AxisType.Auto,))
    inputs, s0 = make_inputs(b=2, t=19, seed=21)
    seg = jnp.asarray(np.where(np.arange(19) < 7, 0, 1)[None].repeat(2, 0), jnp.int32)
    specs = dict(mesh=mesh, in_specs=(P("data"),) * 7, out_specs=(P("data"), P("data")))

    def per_shard(fn, **kw):
        return lambda q, k, v, g, beta, seg, s0: fn(q, k, v, g, beta, segment_ids=seg, initial_state=s0,
                                                    chunk_size=16, **kw)

    args = (*inputs, seg, s0)
    got, want = run(lambda *a: (jax.shard_map(per_shard(pallas_interpret), check_vma=False, **specs)(*a),
                                jax.shard_map(per_shard(gated_delta_rule_chunked), **specs)(*a)), *args)
    for a, e in zip(got, want):
        assert_close(a, e)
    with pytest.raises(NotImplementedError, match="check_vma"):
        jax.jit(jax.shard_map(per_shard(pallas_interpret), **specs)).trace(*args)
    compiled = functools.partial(gated_delta_rule_pallas, interpret=False)
    text = jax.jit(jax.shard_map(per_shard(compiled), **specs)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text

    def loss(*a):
        o, s = jax.shard_map(per_shard(compiled), **specs)(*a)
        return jnp.sum(o ** 2) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_pallas_rejects_a_chunk_that_is_no_triton_block():
    inputs, _ = make_inputs(t=5)
    for chunk in (8, 24):
        with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16"):
            jax.eval_shape(lambda *a: gated_delta_rule(*a, impl="pallas", chunk_size=chunk), *inputs)


def test_document_start_after_strong_decay_keeps_float32_precision():
    """A document of 50 tokens with log decay -20 per token, then one of 20 tokens in the same
    64-token chunk: the cumulative decay reaches -1000 inside the chunk. The segmented cumulative
    decay restarts at the second document, so its decays are exact; differences of chunk-wide
    cumulative sums (a float32 ulp of 6e-5 at 1000) would be off by ~1e-4. Outputs, final state and
    gradients (no inf or NaN from the masked exponentials) against the recurrence."""
    t = 70
    inputs, s0 = make_inputs(b=1, t=t, h=2, seed=17)
    q, k, v, g, beta = inputs
    g = jnp.where(jnp.arange(t)[None, :, None] < 50, -20.0, g * 0.1)
    seg = jnp.asarray(np.where(np.arange(t) < 50, 0, 1)[None], jnp.int32)
    fns = {name: (lambda q, k, v, g, beta, s, fn=fn: fn(q, k, v, g, beta, segment_ids=seg, initial_state=s, **kw))
           for name, fn, kw in (("chunked", gated_delta_rule_chunked, dict(chunk_size=64)),
                                ("pallas", pallas_interpret, dict(chunk_size=64)),
                                ("reference", gated_delta_rule_reference, {}))}
    args = (q, k, v, g, beta, s0)
    outs = run(lambda *a: {name: fn(*a) for name, fn in fns.items()}, *args)
    for name in ("chunked", "pallas"):
        assert_close(outs[name][0], outs["reference"][0], err_msg=f"{name} o")
        assert_close(outs[name][1], outs["reference"][1], err_msg=f"{name} final_state")
    (_, grads), (_, grads_ref) = run(lambda *a: (with_vjp(fns["chunked"])(*a), with_vjp(fns["reference"])(*a)), *args)
    assert all(np.isfinite(np.asarray(x)).all() for x in grads)
    assert_close_grads(grads, grads_ref)
    _, grads_pallas = run(with_vjp(fns["pallas"]), *args)  # the backward kernels
    assert all(np.isfinite(np.asarray(x)).all() for x in grads_pallas)
    assert_close_grads(grads_pallas, grads_ref)


# ---- the public entry point ----------------------------------------------------------------------


def test_auto_follows_the_target_platform():
    assert resolve("auto", "gpu") == "pallas" and resolve("auto", "cpu") == "chunked"
    assert resolve("auto") == "chunked"  # this CPU machine
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices("cpu")[:1], axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        assert resolve("auto") == "chunked"
    with pytest.raises(ValueError, match="impl"):
        resolve("fast")


def test_impls_agree_through_the_entry_point():
    inputs, s0 = make_inputs(t=19, seed=9)
    outs = {impl: gated_delta_rule(*inputs, initial_state=s0, impl=impl, chunk_size=16) for impl in IMPLS}
    for impl, (o, s) in outs.items():
        assert_close(o, outs["reference"][0], err_msg=impl)
        assert_close(s, outs["reference"][1], err_msg=impl)


def _bad_cases():
    (q, k, v, g, beta), s0 = make_inputs(b=2, t=5, h=2, kd=4, vd=6)
    seg = jnp.zeros((2, 5), jnp.int32)
    good = dict(q=q, k=k, v=v, g=g, beta=beta)
    return good, [
        (dict(q=q[0]), {}, "q must"),
        (dict(q=q[:, :0], k=k[:, :0], v=v[:, :0], g=g[:, :0], beta=beta[:, :0]), {}, "q must"),
        (dict(q=q.astype(jnp.int32)), {}, "q must"),
        (dict(k=k[..., :3]), {}, "k must"),
        (dict(k=k[:, :, :1]), {}, "k must"),
        (dict(v=v[:, :4]), {}, "v must"),
        (dict(v=v[:, :, :1]), {}, "v must"),
        (dict(g=g[..., None]), {}, "g must"),
        (dict(beta=beta[:, :4]), {}, "beta must"),
        (dict(beta=beta.astype(jnp.int32)), {}, "beta must"),
        ({}, dict(segment_ids=seg[:, :4]), "segment_ids must"),
        ({}, dict(segment_ids=seg.astype(jnp.float32)), "segment_ids must"),
        ({}, dict(initial_state=s0[:, :, :, :5]), "initial_state must"),
        ({}, dict(initial_state=s0[0]), "initial_state must"),
        ({}, dict(scale="0.5"), "scale must"),
        ({}, dict(chunk_size=0, impl="chunked"), "chunk_size must"),
        ({}, dict(chunk_size=16.0, impl="chunked"), "chunk_size must"),
        ({}, dict(impl="fast"), "impl"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases()[1])))
def test_bad_arguments_raise_value_error_naming_them(case):
    good, cases = _bad_cases()
    arrays, kw, match = cases[case]
    args = {**good, **arrays}
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a: gated_delta_rule(**a, **kw), args)
