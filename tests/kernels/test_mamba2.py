"""Mamba-2's SSD scan: the recurrence against a NumPy float64 loop, and the chunked form and the
Pallas kernels (interpreted on CPU; lowered and compiled for CUDA) against the recurrence, outputs,
final states and gradients (x, dt, A, B, C, initial state), over packed documents. The Pallas
backward kernel's gradients are also compared with the chunked form's VJP (same chunk), and the
lowered gradient program is checked to hold the kernels and none of the chunked form's XLA ops.

Shapes are small; chunks are mostly 16 tokens (some 64 and 128, and 1 and 5 for the jnp form) and
T is not a multiple of them, so the last chunk is padded; documents start inside chunks and on
chunk edges; one group (every head shares B and C) and two. The compiled kernels' cases run on a
GPU only (``gpu`` marker); here they run in the Pallas interpreter.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.recurrence_helpers import (FWD_TOL, GRAD_TOL, assert_close, packed_row_segments,  # noqa: F401
                                             run, with_vjp)
from tests.kernels.recurrence_helpers import assert_close_grads as _assert_close_grads
from moefast.kernels.mamba2 import (BACKWARD_NAME, FORWARD_NAME, IMPLS, STATES_NAME, resolve, ssd, ssd_chunked,
                                    ssd_flops, ssd_pallas, ssd_reference)
from moefast.kernels.mamba2.chunked import chunked_core
from moefast.kernels.mamba2.pallas_bwd import ssd_bwd_blocks
from moefast.kernels.mamba2.reference import run_ids

# Float32 math everywhere; the forms differ only in summation order (and exp(sum) vs prod(exp)).
NAMES = ("x", "dt", "A", "B", "C", "initial_state")


def assert_close_grads(got, want, names=NAMES):
    _assert_close_grads(got, want, names)


def make_inputs(b=2, t=37, h=4, p=8, g=2, n=16, seed=0, dtype=jnp.float32):
    """x; dt in [0.01, 0.5] (softplus'd and clamped upstream); A in [-4, -0.5] float32; B and C
    scaled by N**-0.5; a random float32 initial state."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t, h, p))
    dt = rng.uniform(0.01, 0.5, size=(b, t, h))
    A = -rng.uniform(0.5, 4.0, size=(h,))
    B = rng.normal(size=(b, t, g, n)) * n ** -0.5
    C = rng.normal(size=(b, t, g, n)) * n ** -0.5
    s0 = rng.normal(size=(b, h, p, n))
    cast = lambda a: jnp.asarray(a, dtype)
    return (cast(x), cast(dt), jnp.asarray(A, jnp.float32), cast(B), cast(C)), jnp.asarray(s0, jnp.float32)


def numpy_recurrence(x, dt, A, B, C, segment_ids=None, initial_state=None):
    """The recurrence of transformers' Nemotron-H Mamba-2 mixer (``mamba2_chunk_scan`` without the
    D skip) in float64 loops, with the state zeroed wherever the segment id changes."""
    x, dt, A, B, C = (np.asarray(a, np.float64) for a in (x, dt, A, B, C))
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    y = np.zeros((b, t, h, p))
    final = np.zeros((b, h, p, n))
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // g)
            s = np.zeros((p, n)) if initial_state is None else np.asarray(initial_state, np.float64)[bi, hi].copy()
            for ti in range(t):
                if segment_ids is not None and ti > 0 and segment_ids[bi, ti] != segment_ids[bi, ti - 1]:
                    s = np.zeros((p, n))
                s = np.exp(dt[bi, ti, hi] * A[hi]) * s + dt[bi, ti, hi] * np.outer(x[bi, ti, hi], B[bi, ti, gi])
                y[bi, ti, hi] = s @ C[bi, ti, gi]
            final[bi, hi] = s
    return y, final








def documents_alone(inputs, s0, starts, t):
    """Each document of the packed rows left-aligned in a row of its own (no segment ids): tokens
    after it have dt = 0, which leaves the state as the document left it (no decay, no write). The
    initial state goes to each row's first document only."""
    x, dt, A, B, C = inputs
    rows, state, where = [[] for _ in range(4)], [], []
    for r, row_starts in enumerate(starts):
        ends = row_starts[1:] + [t]
        for d, (s, e) in enumerate(zip(row_starts, ends)):
            for out, a, keep in zip(rows, (x, dt, B, C), (True, False, True, True)):
                doc = a[r, s:e]
                rest = a[r, : t - (e - s)] if keep else jnp.zeros_like(a[r, : t - (e - s)])
                out.append(jnp.concatenate([doc, rest], axis=0))
            state.append(s0[r] if d == 0 else jnp.zeros_like(s0[r]))
            where.append((r, s, e, d == len(row_starts) - 1))
    x1, dt1, b1, c1 = (jnp.stack(a) for a in rows)
    return (x1, dt1, A, b1, c1), jnp.stack(state), where






def bound(fn, seg=None, **kw):
    """``(x, dt, A, B, C, s0) -> fn(..., segment_ids=seg, initial_state=s0, **kw)``."""
    return lambda x, dt, A, B, C, s0: fn(x, dt, A, B, C, segment_ids=seg, initial_state=s0, **kw)


# ---- the recurrence ------------------------------------------------------------------------------


@pytest.mark.parametrize("segmented", [False, True])
def test_reference_equals_numpy_float64_loop(segmented):
    inputs, s0 = make_inputs(b=2, t=70, seed=1)
    _, seg = packed_row_segments(70)
    seg = jnp.asarray(seg) if segmented else None
    y, s = run(bound(ssd_reference, seg), *inputs, s0)
    y_np, s_np = numpy_recurrence(*inputs, segment_ids=None if seg is None else np.asarray(seg), initial_state=s0)
    assert y.dtype == jnp.float32 and s.dtype == jnp.float32
    assert_close(y, y_np, err_msg="y")
    assert_close(s, s_np, err_msg="final_state")


def test_equals_transformers_nemotron_h_chunk_scan():
    """transformers' own Nemotron-H scan (``mamba2_chunk_scan``, its PyTorch fallback: dt given
    processed, no D skip) on the same float32 inputs, 4 heads in 2 groups, T = 37 in its chunks of
    16, an initial state: the recurrence and the chunked form give its outputs and final state."""
    torch = pytest.importorskip("torch")
    nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    inputs, s0 = make_inputs(t=37, seed=12)
    to_torch = lambda a: torch.from_numpy(np.array(a))  # a writable copy
    y_hf, s_hf = nemotron_h.mamba2_chunk_scan(*map(to_torch, inputs), chunk_size=16, initial_states=to_torch(s0),
                                              return_final_states=True)
    (y, s), (y_c, s_c) = run(lambda *a: (ssd_reference(*a, initial_state=s0),
                                         ssd_chunked(*a, initial_state=s0, chunk_size=16)), *inputs)
    for got, want, name in ((y, y_hf, "y"), (s, s_hf, "final_state"), (y_c, y_hf, "chunked y"),
                            (s_c, s_hf, "chunked final_state")):
        assert_close(got, want.numpy(), err_msg=name)


def test_reference_one_group_and_zero_initial_state():
    inputs, _ = make_inputs(b=1, t=9, h=3, p=4, g=1, n=5, seed=2)
    y, s = ssd_reference(*inputs)
    y_np, s_np = numpy_recurrence(*inputs)  # zero state; all three heads read the one group
    assert_close(y, y_np)
    assert_close(s, s_np)


# ---- the chunked form ----------------------------------------------------------------------------


@pytest.mark.parametrize("t,chunk,g,with_state", [
    (37, 16, 2, True),  # padded last chunk
    (37, 16, 1, False),  # one group for all heads
    (150, 128, 2, True),  # transformers' chunk of 128, T not a multiple
    (1, 16, 2, True),  # one token
    (37, 5, 1, False),  # a chunk that is no power of two
    (37, 1, 2, True),  # one token a chunk: the scan over chunks is the recurrence
])
def test_chunked_equals_reference(t, chunk, g, with_state):
    inputs, s0 = make_inputs(t=t, g=g, seed=t + chunk)
    s0 = s0 if with_state else None
    (y, s), (y_ref, s_ref) = run(lambda *a: (ssd_chunked(*a, initial_state=s0, chunk_size=chunk),
                                             ssd_reference(*a, initial_state=s0)), *inputs)
    assert y.shape == inputs[0].shape and s.shape == (2, 4, 8, 16)
    assert_close(y, y_ref, err_msg="y")
    assert_close(s, s_ref, err_msg="final_state")


def check_packed_documents(fn, seed, t=70):
    """``fn`` on packed rows equals ``fn`` on each document alone, and the recurrence on the rows."""
    inputs, s0 = make_inputs(t=t, seed=seed)
    starts, seg = packed_row_segments(t)
    alone, alone_s0, where = documents_alone(inputs, s0, starts, t)
    seg = jnp.asarray(seg)
    (y, s), (y1, s1), (y_ref, s_ref) = run(
        lambda a, b: (fn(*a, segment_ids=seg, initial_state=s0), fn(*b, initial_state=alone_s0),
                      ssd_reference(*a, segment_ids=seg, initial_state=s0)), inputs, alone)
    for i, (r, start, end, last) in enumerate(where):
        assert_close(y[r, start:end], y1[i, : end - start], err_msg=f"row {r}, document at {start}")
        if last:
            assert_close(s[r], s1[i], err_msg=f"final state of row {r}")
    assert_close(y, y_ref)
    assert_close(s, s_ref)


def test_packed_documents_chunked():
    """Documents packed in a row give exactly what each gives alone, with boundaries on a chunk edge
    and inside a chunk; and the packed rows equal the recurrence."""
    check_packed_documents(functools.partial(ssd_chunked, chunk_size=16), seed=5)


@pytest.mark.parametrize("g", [1, 2])
def test_chunked_gradients_equal_reference(g):
    """Every gradient (x, dt, A, B, C, initial state) of the chunked form equals the recurrence's,
    with packed documents (a start inside chunk 1, another on a chunk edge), T = 37 in chunks of 16
    (a padded tail) and random cotangents of y and of the final state."""
    t = 37
    inputs, s0 = make_inputs(t=t, g=g, seed=7 + g)
    seg = jnp.asarray(np.stack([np.where(np.arange(t) < 20, 0, 1), np.where(np.arange(t) < 32, 4, 5)]), jnp.int32)
    (out, grads), (out_ref, grads_ref) = run(
        lambda *a: (with_vjp(bound(ssd_chunked, seg, chunk_size=16))(*a), with_vjp(bound(ssd_reference, seg))(*a)),
        *inputs, s0)
    assert_close(out[0], out_ref[0])
    assert_close_grads(grads, grads_ref)


def test_bfloat16_inputs():
    """Any float dtype in; y in x's dtype, the state float32, the math float32 (compared with the
    recurrence on the same bfloat16 values upcast)."""
    inputs, s0 = make_inputs(t=21, seed=8, dtype=jnp.bfloat16)
    y, s = run(lambda *a: ssd(*a, initial_state=s0, impl="chunked", chunk_size=16), *inputs)
    y_ref, s_ref = numpy_recurrence(*inputs, initial_state=s0)
    assert y.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, rtol=1e-2, atol=2e-2)  # y rounded to bfloat16
    assert_close(s, s_ref)


# ---- the Pallas kernels: compiled on a GPU, interpreted here; lowered and compiled for CUDA -------


class _PallasCases:
    """The kernels' tests, shared by the compiled (GPU) and interpreted variants (jax's
    ``gpu_ops_test`` style). Compiled, the products are three-pass TF32 (about float32)."""

    INTERPRET = False

    def pallas(self, *args, **kw):
        return ssd_pallas(*args, interpret=self.INTERPRET, **kw)

    @pytest.mark.parametrize("t,p,g,n,chunk,dtype", [
        (37, 8, 2, 16, 16, jnp.float32),  # padded last chunk; P padded to 16 for the kernel
        (70, 12, 1, 20, 64, jnp.float32),  # one 64-token chunk and a padded one; widths not powers of two
        (1, 8, 2, 8, 16, jnp.float32),  # one token
        (21, 16, 2, 16, 16, jnp.bfloat16),  # bfloat16 in and out, float32 inside
    ])
    def test_equals_chunked_and_reference(self, t, p, g, n, chunk, dtype):
        inputs, s0 = make_inputs(t=t, p=p, g=g, n=n, seed=t + p, dtype=dtype)
        (y, s), (y_c, s_c), (y_ref, s_ref) = run(
            lambda *a: (self.pallas(*a, initial_state=s0, chunk_size=chunk),
                        ssd_chunked(*a, initial_state=s0, chunk_size=chunk),
                        ssd_reference(*a, initial_state=s0)), *inputs)
        assert y.dtype == dtype and y.shape == inputs[0].shape and s.dtype == jnp.float32 and s.shape == s0.shape
        if dtype == jnp.bfloat16:  # outputs rounded to bfloat16: at most an ulp apart
            np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_c, np.float32), rtol=1e-2, atol=1e-2)
        else:
            assert_close(y, y_c, err_msg="y vs chunked")
            assert_close(y, y_ref, err_msg="y vs reference")
        assert_close(s, s_c, err_msg="final_state vs chunked")
        assert_close(s, s_ref, err_msg="final_state vs reference")

    def test_packed_documents(self):
        check_packed_documents(functools.partial(self.pallas, chunk_size=16), seed=11)

    @pytest.mark.parametrize("t,h,g,chunk,segmented", [
        (1, 1, 1, 16, False),  # one token, one head
        (21, 3, 1, 16, True),  # an odd number of heads sharing one group; a document starts inside chunk 1
        (70, 4, 2, 64, True),  # chunks of 64, T not a multiple; documents on a chunk edge and inside one
    ])
    def test_gradients_equal_chunked_vjp_and_reference(self, t, h, g, chunk, segmented):
        """The backward kernels equal the XLA VJP of the chunked form (same chunk size) they
        replace and the recurrence's gradients, every gradient including A's and the initial
        state's, with random cotangents of y and of the final state."""
        inputs, s0 = make_inputs(b=2, t=t, h=h, g=g, p=8, n=16, seed=40 + t)
        seg = None
        if segmented:
            seg = jnp.asarray(np.stack([np.where(np.arange(t) < min(16, t - 1), 2, 3),
                                        np.where(np.arange(t) < t // 3, 0, 1)]), jnp.int32)
        fns = [bound(self.pallas, seg, chunk_size=chunk), bound(ssd_chunked, seg, chunk_size=chunk),
               bound(ssd_reference, seg)]
        (out, grads), *wants = run(lambda *a: tuple(with_vjp(f)(*a) for f in fns), *inputs, s0)
        for out_w, grads_w in wants:
            assert_close(out[0], out_w[0])
            assert_close(out[1], out_w[1])
            assert_close_grads(grads, grads_w)

    def test_bfloat16_gradients_take_the_inputs_dtypes(self):
        """bfloat16 x, dt, B, C (A float32): gradients in the inputs' dtypes (computed in float32),
        each within bfloat16 rounding of the chunked form's VJP."""
        inputs, s0 = make_inputs(t=21, seed=44, dtype=jnp.bfloat16)
        fns = [bound(self.pallas, chunk_size=16), bound(ssd_chunked, chunk_size=16)]
        (_, grads), (_, grads_c) = run(lambda *a: (with_vjp(fns[0])(*a), with_vjp(fns[1])(*a)), *inputs, s0)
        for name, a, e, x in zip(NAMES, grads, grads_c, (*inputs, s0)):
            assert a.dtype == x.dtype, name
            a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
            np.testing.assert_allclose(a, e, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(e).max()), err_msg=name)


@pytest.mark.gpu
class TestSsdPallas(_PallasCases):
    """The compiled kernels (Pallas Triton backend)."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if jax.default_backend() != "gpu":
            pytest.skip("the compiled Pallas kernels need an NVIDIA GPU (Pallas Triton backend); "
                        "TestSsdPallasInterpret runs the same tests in the Pallas interpreter")


class TestSsdPallasInterpret(_PallasCases):
    INTERPRET = True


pallas_interpret = functools.partial(ssd_pallas, interpret=True)


def test_backward_head_dim_blocks_and_groups_sum_to_the_chunked_vjp():
    """P = 40 split in head-dim blocks of 16 (Pp = 64: four programs per head, one all padding),
    H = 4 heads in G = 2 groups: dx and d(initial state) per block, d(dt) and d(a) summed over the
    blocks' shares, dB and dC over the blocks and the group's heads, against the chunked form's VJP
    in the same arguments (x, dt, a = dt·A, B, C, s0); packed documents, T = 37 in chunks of 16."""
    b, t, h, p, g, n = 2, 37, 4, 40, 2, 12
    (x, dt, A, B, C), s0 = make_inputs(b=b, t=t, h=h, p=p, g=g, n=n, seed=50)
    a = dt * A[None, None, :]
    run_bt = run_ids(jnp.asarray(np.stack([np.where(np.arange(t) < 16, 1, 2), np.where(np.arange(t) < 23, 0, 1)]),
                                 jnp.int32), b, t)
    rng = np.random.default_rng(52)
    dy, ds = jnp.asarray(rng.normal(size=x.shape), jnp.float32), jnp.asarray(rng.normal(size=s0.shape), jnp.float32)

    def both(x, dt, a, B, C, s0, dy, ds):
        got = ssd_bwd_blocks(x, dt, a, B, C, run_bt, s0, dy, ds, chunk_size=16, interpret=True, block_p=16)
        _, vjp = jax.vjp(lambda x, dt, a, B, C, s0: chunked_core(x, dt, a, B, C, run_bt, s0, chunk_size=16),
                         x, dt, a, B, C, s0)
        return got, vjp((dy, ds))

    got, want = run(both, x, dt, a, B, C, s0, dy, ds)
    assert_close_grads(got, want, names=("x", "dt (through dt·x)", "a", "B", "C", "initial_state"))


def test_document_start_after_strong_decay_keeps_float32_precision():
    """A document of 50 tokens with log decay -20 per token, then one of 20 tokens in the same
    64-token chunk: the decay summed over the chunk reaches -1000. The decays are sums over each
    document alone (no difference of chunk-wide cumulative sums, whose float32 ulp at 1000 is 6e-5),
    so the second document is exact. Outputs, final state and gradients (no inf or NaN from the
    masked exponentials) of the chunked form and the kernels against the recurrence."""
    t = 70
    (x, dt, A, B, C), s0 = make_inputs(b=1, t=t, h=2, g=1, seed=17)
    dt = jnp.where(jnp.arange(t)[None, :, None] < 50, 20.0 / -A[None, None, :], dt * 0.1)  # a = -20, then gentle
    seg = jnp.asarray(np.where(np.arange(t) < 50, 0, 1)[None], jnp.int32)
    fns = {"chunked": bound(ssd_chunked, seg, chunk_size=64), "pallas": bound(pallas_interpret, seg, chunk_size=64),
           "reference": bound(ssd_reference, seg)}
    args = (x, dt, A, B, C, s0)
    outs = run(lambda *a: {name: with_vjp(fn)(*a) for name, fn in fns.items()}, *args)
    (y_ref, s_ref), grads_ref = outs["reference"]
    for name in ("chunked", "pallas"):
        (y, s), grads = outs[name]
        assert_close(y, y_ref, err_msg=f"{name} y")
        assert_close(s, s_ref, err_msg=f"{name} final_state")
        assert all(np.isfinite(np.asarray(d)).all() for d in grads), name
        assert_close_grads(grads, grads_ref)


def test_pallas_lowers_for_cuda_from_cpu():
    """The compiled path (``interpret=False``) lowers to Triton kernels at Nemotron-H's widths
    (P = 64, N = 128, 8 heads in 2 groups, T = 300, bfloat16 inputs, packed documents): the forward
    is one kernel; the gradient program is three (the forward for y, then the backward's state
    recompute and its reverse loop, by name) and none of the chunked form's XLA VJP (its
    ``jax.lax.scan`` over chunks is a ``stablehlo.while``, which the same gradient through
    ``impl="chunked"`` has)."""
    b, t, h, p, g, n = 2, 300, 8, 64, 2, 128
    sd = jax.ShapeDtypeStruct
    args = (sd((b, t, h, p), jnp.bfloat16), sd((b, t, h), jnp.float32), sd((h,), jnp.float32),
            sd((b, t, g, n), jnp.bfloat16), sd((b, t, g, n), jnp.bfloat16), sd((b, t), jnp.int32),
            sd((b, h, p, n), jnp.float32))

    def fwd(x, dt, A, B, C, seg, s0, impl="pallas"):
        return ssd(x, dt, A, B, C, segment_ids=seg, initial_state=s0, impl=impl, interpret=False)

    def loss(*a, impl="pallas"):
        y, s = fwd(*a, impl=impl)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)

    lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    text = lower(fwd)
    assert text.count("__gpu$xla.gpu.triton") == 1 and f'name = "{FORWARD_NAME}"' in text
    grad_text = lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)))
    assert grad_text.count("__gpu$xla.gpu.triton") == 3
    for name in (FORWARD_NAME, STATES_NAME, BACKWARD_NAME):
        assert f'name = "{name}"' in grad_text, name
    assert "stablehlo.while" not in grad_text
    assert "stablehlo.while" in lower(jax.grad(functools.partial(loss, impl="chunked"), argnums=(0, 1, 2, 3, 4, 6)))


_COMPILE_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from moefast.bench import gpu_compile
    gpu_compile.prepare_process()
    from moefast.kernels.mamba2 import resolve, ssd
    devices = gpu_compile.compile_only_devices("h100", 1, 1)
    mesh = jax.sharding.Mesh(devices, ("x",))
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    b, t, h, p, g, n = 1, 256, 8, 64, 2, 128
    args = (sd((b, t, h, p), jnp.bfloat16), sd((b, t, h), jnp.float32), sd((h,), jnp.float32),
            sd((b, t, g, n), jnp.bfloat16), sd((b, t, g, n), jnp.bfloat16), sd((b, t), jnp.int32),
            sd((b, h, p, n), jnp.float32))

    def loss(x, dt, A, B, C, seg, s0):  # impl="auto", chunk_size=128, interpret=None: the defaults
        y, s = ssd(x, dt, A, B, C, segment_ids=seg, initial_state=s0)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)

    with jax.set_mesh(mesh):  # the kernels, compiled, because the mesh is H100s
        assert resolve("auto") == "pallas", resolve("auto")
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6))).trace(*args).lower().compile()
    print("compiled")
""")


def test_pallas_compiles_to_ptx_for_h100_from_cpu(tmp_path):
    """The gradient program at Nemotron-H's widths (P = 64, N = 128, bfloat16) with the public
    defaults (``impl="auto"``, ``chunk_size=128``) under a mesh of compile-only H100s, compiled
    through the CUDA PJRT plugin (``.venv/gpu-compile``): Triton emits the three named kernels' PTX
    for sm_90a, their products are Hopper's warpgroup MMA in three-pass TF32
    (``wgmma ... f32.tf32.tf32``, no IEEE FMA dots), and ptxas (``-v``) assembles each (it reports
    registers and spills: see :mod:`moefast.kernels.mamba2.pallas`). Nothing runs."""
    from moefast.bench import gpu_compile

    if not gpu_compile.plugin_path():
        pytest.skip(f"the CUDA PJRT plugin is not installed next to this environment; install it as README's test "
                    f"command does: {gpu_compile.INSTALL_HINT}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("TRITON_")}
    env["XLA_FLAGS"] = f"--xla_dump_to={tmp_path}"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
    ptx = {name: [p for p in sorted(tmp_path.glob("*.ptx")) if f".entry {name}(" in p.read_text()]
           for name in (FORWARD_NAME, STATES_NAME, BACKWARD_NAME)}
    assert all(len(files) == 1 for files in ptx.values()), {k: [p.name for p in v] for k, v in ptx.items()}
    ptxas = Path(gpu_compile.plugin_path()) / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    assert ptxas.is_file(), ptxas
    for name, (path,) in ptx.items():
        text = path.read_text()
        assert ".target sm_90a" in text, name
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k8\.f32\.tf32\.tf32", text), name
        assert len(text) < 2_000_000, (name, len(text))  # IEEE float32 dots unroll to FMAs: megabytes
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", os.devnull], capture_output=True,
                              text=True, timeout=300)
        assert info.returncode == 0, (name, info.stderr[-2000:])
        assert re.search(r"Used \d+ registers", info.stderr), (name, info.stderr)


def test_pallas_inside_shard_map():
    """Rows split over a 2-device mesh with ``jax.shard_map(check_vma=True)``: the compiled kernels
    lower for CUDA (their outputs declare the mesh axes they vary over), forward and gradient; the
    interpreter refuses with a clear error (it cannot run there)."""
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2], axis_types=(AxisType.Auto,))
    inputs, s0 = make_inputs(b=2, t=19, seed=21)
    seg = jnp.asarray(np.where(np.arange(19) < 7, 0, 1)[None].repeat(2, 0), jnp.int32)
    specs = dict(mesh=mesh, in_specs=(P("data"), P("data"), P(), P("data"), P("data"), P("data"), P("data")),
                 out_specs=(P("data"), P("data")))

    def per_shard(fn):
        return lambda x, dt, A, B, C, seg, s0: fn(x, dt, A, B, C, segment_ids=seg, initial_state=s0, chunk_size=16)

    args = (*inputs, seg, s0)
    with pytest.raises(NotImplementedError, match="check_vma"):
        jax.jit(jax.shard_map(per_shard(pallas_interpret), **specs)).trace(*args)
    compiled = jax.shard_map(per_shard(functools.partial(ssd_pallas, interpret=False)), **specs)

    def loss(*a):
        y, s = compiled(*a)
        return jnp.sum(y ** 2) + jnp.sum(s)

    lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lower(compiled).count("__gpu$xla.gpu.triton") == 1
    assert lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6))).count("__gpu$xla.gpu.triton") == 3


def test_pallas_rejects_a_chunk_that_is_no_triton_block():
    inputs, _ = make_inputs(t=5)
    for chunk in (8, 24):
        with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16"):
            jax.eval_shape(lambda *a: ssd(*a, impl="pallas", chunk_size=chunk), *inputs)


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
    """Every ``impl`` with the default chunk (128; the kernels take it in chunks of 64) on T = 150:
    two chunks of the jnp form, three of the kernels, the same outputs."""
    inputs, s0 = make_inputs(b=1, t=150, h=2, g=1, seed=9)
    outs = run(lambda *a: {impl: ssd(*a, initial_state=s0, impl=impl) for impl in IMPLS}, *inputs)
    for impl, (y, s) in outs.items():
        assert_close(y, outs["reference"][0], err_msg=impl)
        assert_close(s, outs["reference"][1], err_msg=impl)


def _dot_flops(jaxpr) -> int:
    """FLOPs of every contracting ``dot_general`` in ``jaxpr`` and the jaxprs inside it (2 per
    multiply-add); ``jnp.einsum`` also emits elementwise products (batch dimensions only, nothing
    contracted) as ``dot_general``: not counted, as :func:`ssd_flops` counts no elementwise work."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and eqn.params["dimension_numbers"][0][0]:
            (contract, _), _ = eqn.params["dimension_numbers"]  # (lhs, rhs) contracting, (lhs, rhs) batch
            lhs = eqn.invars[0].aval.shape
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[i] for i in contract]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _dot_flops(sub)
    return total


@pytest.mark.parametrize("b,t,h,p,g,n,chunk", [(2, 37, 4, 8, 2, 16, 16), (1, 300, 6, 12, 3, 20, 128)])
def test_ssd_flops_counts_the_chunked_forms_products(b, t, h, p, g, n, chunk):
    """:func:`ssd_flops` equals the products the chunked form traces (every ``dot_general`` of its
    jaxpr) plus the state passing's multiply-add per state element and chunk (elementwise, in the
    scan); it grows with T only through the padded length."""
    (x, dt, A, B, C), s0 = make_inputs(b=b, t=t, h=h, p=p, g=g, n=n)
    jaxpr = jax.make_jaxpr(lambda *a: ssd_chunked(*a, initial_state=s0, chunk_size=chunk))(x, dt, A, B, C).jaxpr
    chunks = -(-t // chunk)
    assert ssd_flops(b, t, h, p, g, n, chunk) == _dot_flops(jaxpr) + 2 * b * chunks * h * p * n
    assert ssd_flops(b, chunks * chunk, h, p, g, n, chunk) == ssd_flops(b, t, h, p, g, n, chunk)
    with pytest.raises(ValueError, match="divide"):
        ssd_flops(b, t, 5, p, 2, n, chunk)
    with pytest.raises(ValueError, match="positive int"):
        ssd_flops(b, 0, h, p, g, n, chunk)


def _bad_cases():
    (x, dt, A, B, C), s0 = make_inputs(b=2, t=5, h=4, p=3, g=2, n=6)
    seg = jnp.zeros((2, 5), jnp.int32)
    return dict(x=x, dt=dt, A=A, B=B, C=C), [
        (dict(x=x[0]), {}, "x must"),
        (dict(x=x[:, :0], dt=dt[:, :0], B=B[:, :0], C=C[:, :0]), {}, "x must"),
        (dict(x=x.astype(jnp.int32)), {}, "x must"),
        (dict(dt=dt[:, :4]), {}, "dt must"),
        (dict(dt=dt[..., None]), {}, "dt must"),
        (dict(A=A[:3]), {}, "A must"),
        (dict(A=A.astype(jnp.int32)), {}, "A must"),
        (dict(B=B[:, :, :, None]), {}, "B must"),
        (dict(B=jnp.concatenate([B, B[:, :, :1]], axis=2), C=jnp.concatenate([C, C[:, :, :1]], axis=2)), {},
         "B must"),  # three groups do not divide four heads
        (dict(B=B[:1]), {}, "B must"),
        (dict(C=C[..., :5]), {}, "C must"),
        (dict(C=C.astype(jnp.int32)), {}, "C must"),
        ({}, dict(segment_ids=seg[:, :4]), "segment_ids must"),
        ({}, dict(segment_ids=seg.astype(jnp.float32)), "segment_ids must"),
        ({}, dict(initial_state=s0[..., :5]), "initial_state must"),
        ({}, dict(initial_state=s0[0]), "initial_state must"),
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
        jax.eval_shape(lambda a: ssd(**a, **kw), args)
