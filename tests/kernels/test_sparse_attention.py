"""Top-k sparse attention (DeepSeek Sparse Attention, MLA absorbed): the jnp reference against a
NumPy float64 loop and a dense masked softmax, and the Pallas kernels (interpreted on CPU; lowered
for CUDA) against the reference, outputs, log-sum-exp and gradients.

Shapes are small (the interpreter runs one grid step after another): a few queries, K not a
multiple of the slot block, rows with -1 slots and a row with none valid, 1, 3 and 20 heads (20:
two head blocks, the second padded), bfloat16. Indices are distinct per query by construction.
The compiled kernels' cases run on a GPU only (``gpu`` marker).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.bench import gpu_compile
from moefast.kernels.sparse_attention import (BACKWARD_NAME, FORWARD_NAME, IMPLS, resolve, sparse_attention,
                                              sparse_attention_pallas, sparse_attention_reference)

FWD_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = 1e-4  # absolute, relative to each gradient's largest entry
BF16_TOL = 2e-2  # bfloat16 probabilities and dS enter the kernels' products (as in flash attention)


def make_inputs(b=2, t=5, h=2, d=24, dv=16, s=40, top_k=20, seed=0, dtype=jnp.float32, short=True):
    """q, k, v of ``dtype`` and int32 indices [B, T, K]: distinct keys per query (a permutation's
    prefix); with ``short``, query 1 of row 0 keeps only 3 valid slots (the rest -1, scattered
    among the slots) and query 2 of row 0 none."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype) for shape in ((b, t, h, d), (b, s, d), (b, s, dv)))
    idx = np.stack([rng.permutation(s)[:top_k] for _ in range(b * t)]).reshape(b, t, top_k)
    if short and t > 2:
        keep = rng.permutation(top_k)[:3]
        idx[0, 1, np.setdiff1d(np.arange(top_k), keep)] = -1
        idx[0, 2] = -1
    return q, k, v, jnp.asarray(idx, jnp.int32)


def numpy_attention(q, k, v, idx, scale):
    """Float64 loop over rows, queries and heads: softmax over the valid selected keys."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    idx = np.asarray(idx)
    b, t, h, _ = q.shape
    out = np.zeros((b, t, h, v.shape[-1]))
    lse = np.full((b, t, h), -np.inf)
    for bi in range(b):
        for ti in range(t):
            sel = [i for i in idx[bi, ti] if 0 <= i < k.shape[1]]
            if not sel:
                continue
            for hi in range(h):
                logits = k[bi, sel] @ q[bi, ti, hi] * scale
                m = logits.max()
                p = np.exp(logits - m)
                out[bi, ti, hi] = p @ v[bi, sel] / p.sum()
                lse[bi, ti, hi] = m + np.log(p.sum())
    return out, lse


def dense_masked_attention(q, k, v, idx, scale):
    """The dense form a model's reference uses: a [B, T, S] boolean mask from the indices and a
    masked softmax over all S keys (float32); 0 for a query with no key."""
    s = k.shape[1]
    mask = jnp.any(idx[..., None] == jnp.arange(s)[None, None, None, :], axis=2)  # [B, T, S]; -1 matches no key
    logits = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    logits = jnp.where(mask[:, :, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1, where=mask[:, :, None])
    p = jnp.where(mask[:, :, None], p, 0.0)
    return jnp.einsum("bths,bsv->bthv", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def assert_grads_close(got, want, tol=GRAD_TOL):
    for i, (a, e) in enumerate(zip(got, want)):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.all(np.isfinite(a)), i
        np.testing.assert_allclose(a, e, rtol=0, atol=tol * max(np.abs(e).max(), 1e-6), err_msg=f"grad {i}")


def vjp_of(fn, q, k, v, idx, seed=1):
    """``((o, lse), (dq, dk, dv))`` for random cotangents of o and of the finite log-sum-exps."""
    (o, lse), pull = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v)
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.normal(size=o.shape), o.dtype)
    dlse = jnp.where(jnp.isfinite(lse), jnp.asarray(rng.normal(size=lse.shape), jnp.float32), 0.0)
    return (o, lse), pull((do, dlse))


def test_reference_matches_numpy_float64():
    q, k, v, idx = make_inputs(h=3, seed=1)
    o, lse = jax.jit(lambda *a: sparse_attention_reference(*a, scale=0.3, return_lse=True))(q, k, v, idx)
    want_o, want_lse = numpy_attention(q, k, v, idx, 0.3)
    np.testing.assert_allclose(o, want_o, **FWD_TOL)
    np.testing.assert_allclose(lse, want_lse, **FWD_TOL)
    assert np.all(np.asarray(o[0, 2]) == 0) and np.all(np.isneginf(lse[0, 2]))  # no valid slot: 0, -inf


def test_gather_form_equals_dense_masked_softmax():
    """The gather form (reference and kernel) equals the dense masked softmax over all S keys; an
    index past the keys counts as unused, as -1 does."""
    q, k, v, idx = make_inputs(h=3, seed=2)
    idx = idx.at[1, 0, 4].set(k.shape[1] + 3)
    dense = dense_masked_attention(q, k, v, idx, 0.25)
    np.testing.assert_allclose(sparse_attention_reference(q, k, v, idx, scale=0.25), dense, **FWD_TOL)
    got = jax.jit(lambda *a: sparse_attention_pallas(*a, scale=0.25, interpret=True))(q, k, v, idx)
    np.testing.assert_allclose(got, dense, **FWD_TOL)


CASES = {  # name: (make_inputs keywords, kernel keywords)
    "k-tail": (dict(top_k=37, s=50), dict(block_k=16)),  # 3 slot blocks, the last 5 of 16 used
    "short-rows": (dict(h=4, top_k=20), {}),  # -1 slots and an empty query (make_inputs)
    "one-head": (dict(h=1, t=3), {}),
    "odd-heads": (dict(h=3, t=3), {}),
    "two-head-blocks": (dict(h=20, t=2, b=1), dict(block_h=16)),  # 20 heads: blocks of 16, the second padded
    "wide": (dict(h=2, t=2, b=1, d=72, dv=64, top_k=9), {}),  # MLA-like D = Dv + 8 (not a power of two)
}


@pytest.mark.parametrize("case", list(CASES))
def test_pallas_equals_reference_forward_and_gradients(case):
    shape_kw, kernel_kw = CASES[case]
    q, k, v, idx = make_inputs(**shape_kw, seed=10 + list(CASES).index(case))
    scale = q.shape[-1] ** -0.5

    def both(q, k, v, idx):
        kernel = lambda *a: sparse_attention_pallas(*a, scale=scale, return_lse=True, interpret=True, **kernel_kw)
        reference = lambda *a: sparse_attention_reference(*a, scale=scale, return_lse=True)
        return vjp_of(kernel, q, k, v, idx), vjp_of(reference, q, k, v, idx)

    ((o, lse), grads), ((want_o, want_lse), want_grads) = jax.jit(both)(q, k, v, idx)
    np.testing.assert_allclose(o, want_o, **FWD_TOL)
    np.testing.assert_allclose(lse, want_lse, **FWD_TOL)
    assert_grads_close(grads, want_grads)
    # each head's largest logit over its selected keys (QK-clip): the kernel's running maximum
    got_max, want_max = (jax.jit(lambda *a, f=f: f(*a, scale=scale, return_max=True, **kw)[1])(q, k, v, idx)
                         for f, kw in ((sparse_attention_pallas, dict(interpret=True, **kernel_kw)),
                                       (sparse_attention_reference, {})))
    np.testing.assert_allclose(got_max, want_max, **FWD_TOL)
    assert np.all(np.isfinite(want_max) == np.isfinite(want_lse))


def test_pallas_bfloat16():
    """bfloat16 inputs: outputs in bfloat16 and gradients in each input's dtype, close to the
    float32 reference of the same (bfloat16-rounded) inputs."""
    q, k, v, idx = make_inputs(h=3, t=4, top_k=21, seed=5, dtype=jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)

    def both(q, k, v, idx):
        kernel = lambda *a: sparse_attention_pallas(*a, scale=0.2, return_lse=True, interpret=True, block_k=16)
        reference = lambda q, k, v, i: sparse_attention_reference(f32(q), f32(k), f32(v), i, scale=0.2,
                                                                  return_lse=True)
        return vjp_of(kernel, q, k, v, idx), vjp_of(reference, q, k, v, idx)

    ((o, lse), grads), ((want_o, want_lse), want_grads) = jax.jit(both)(q, k, v, idx)
    assert o.dtype == jnp.bfloat16 and [g.dtype for g in grads] == [jnp.bfloat16] * 3
    np.testing.assert_allclose(f32(o), want_o, rtol=0, atol=BF16_TOL * float(jnp.abs(want_o).max()))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)
    assert_grads_close(grads, want_grads, tol=BF16_TOL)


def test_pallas_key_gradients_only_reach_selected_keys():
    """dk and dv are exactly 0 on keys no query selects and nonzero on those some query selects."""
    q, k, v, idx = make_inputs(b=1, t=4, h=2, s=60, top_k=10, seed=7)
    loss = lambda k, v: jnp.sum(jnp.sin(sparse_attention_pallas(q, k, v, idx, scale=0.3, interpret=True)))
    dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1)))(k, v)
    selected = np.zeros(60, bool)
    selected[np.asarray(idx)[np.asarray(idx) >= 0]] = True
    assert 0 < selected.sum() < 60
    for g in (np.asarray(dk[0]), np.asarray(dv[0])):
        assert np.all(g[~selected] == 0)
        assert np.all(np.abs(g[selected]).max(axis=-1) > 0)


def test_impl_dispatch_and_validation():
    q, k, v, idx = make_inputs(b=1, t=2, h=1, short=False)
    assert resolve("auto", "gpu") == "pallas" and resolve("auto", "cpu") == "reference"
    assert resolve("auto") == "reference" and IMPLS == ("reference", "pallas", "auto")  # this CPU machine
    with pytest.raises(ValueError, match="impl"):
        resolve("triton")
    np.testing.assert_array_equal(sparse_attention(q, k, v, idx, scale=0.5),
                                  sparse_attention_reference(q, k, v, idx, scale=0.5))
    with pytest.raises(ValueError, match="indices"):
        sparse_attention(q, k, v, idx.astype(jnp.float32), scale=0.5)
    with pytest.raises(ValueError, match="one float dtype"):
        sparse_attention(q, k.astype(jnp.bfloat16), v, idx, scale=0.5)
    with pytest.raises(ValueError, match=r"k must be"):
        sparse_attention(q, k[..., :-1], v, idx, scale=0.5)
    with pytest.raises(ValueError, match="power of two"):
        sparse_attention_pallas(q, k, v, idx, scale=0.5, block_k=24)
    with pytest.raises(ValueError, match="static"):
        jax.jit(lambda s: sparse_attention(q, k, v, idx, scale=s))(0.5)


def test_pallas_lowers_for_cuda_from_cpu():
    """The compiled path (``interpret=False``) lowers to Triton kernels at DeepSeek-V3.2's MLA widths
    (D = 512 + 64, Dv = 512), 16 heads (one device's share of 128 under 8-way tensor parallelism),
    K = 100 (not a multiple of the slot block), bfloat16: the forward is one kernel, the gradient
    program two (the forward again for the residuals, then the backward with its atomic adds), by
    name. This checks the Pallas -> Triton IR lowering (gathers, atomics, power-of-two blocks) on a
    CPU-only jaxlib; PTX and running need a GPU toolchain and a GPU."""
    b, t, h, d, dv, s, top_k = 2, 64, 16, 576, 512, 256, 100
    sd = jax.ShapeDtypeStruct
    args = (sd((b, t, h, d), jnp.bfloat16), sd((b, s, d), jnp.bfloat16), sd((b, s, dv), jnp.bfloat16),
            sd((b, t, top_k), jnp.int32))
    fwd = lambda q, k, v, i: sparse_attention(q, k, v, i, scale=d ** -0.5, impl="pallas", interpret=False)
    loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2)
    lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    text = lower(fwd)
    assert text.count("__gpu$xla.gpu.triton") == 1 and f'name = "{FORWARD_NAME}"' in text
    text = lower(jax.grad(loss, argnums=(0, 1, 2)))
    assert text.count("__gpu$xla.gpu.triton") == 2
    for name in (FORWARD_NAME, BACKWARD_NAME):
        assert f'name = "{name}"' in text, name


_COMPILE_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from moefast.bench import gpu_compile
    gpu_compile.prepare_process()
    from moefast.kernels.sparse_attention import sparse_attention
    devices = gpu_compile.compile_only_devices("h100", 1, 1)
    sharding = NamedSharding(jax.sharding.Mesh(devices, ("x",)), P())
    b, t, h, d, dv, s, top_k = 1, 32, 16, 576, 512, 256, 100
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    args = (sd((b, t, h, d), jnp.bfloat16), sd((b, s, d), jnp.bfloat16), sd((b, s, dv), jnp.bfloat16),
            sd((b, t, top_k), jnp.int32))
    fwd = lambda q, k, v, i: sparse_attention(q, k, v, i, scale=d ** -0.5, impl="pallas", interpret=False)
    loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2)
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile()
    print("compiled")
""")


def test_pallas_compiles_to_ptx_for_h100_from_cpu(tmp_path):
    """The gradient program (forward and backward kernels, MLA widths, bfloat16) compiled for a
    compile-only H100 through the CUDA PJRT plugin (``.venv/gpu-compile``): Triton emits PTX for
    both kernels, named, and the backward's dk/dv accumulation is float32 global atomic adds
    (``atom.global...add...f32``). Nothing runs: PTX -> cubin by ptxas is part of the compile."""
    assert gpu_compile.plugin_path(), (
        "the CUDA PJRT plugin is not installed next to this environment; install it as README's test command "
        "does: pip install -c constraints.txt --no-deps --target .venv/gpu-compile jax-cuda12-pjrt "
        "jax-cuda12-plugin nvidia-cuda-nvcc-cu12 jax-triton")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("TRITON_")}
    env["XLA_FLAGS"] = f"--xla_dump_to={tmp_path}"
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
    ptx = {p.name: p.read_text() for p in tmp_path.glob("*.ptx")}
    fwd = [t for t in ptx.values() if f".entry {FORWARD_NAME}(" in t]
    bwd = [t for t in ptx.values() if f".entry {BACKWARD_NAME}(" in t]
    assert fwd and bwd, sorted(ptx)
    assert any("atom.global" in line and ".add" in line and "f32" in line for line in bwd[0].splitlines())


@pytest.mark.gpu
def test_compiled_kernels_equal_reference_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled Pallas kernels need an NVIDIA GPU (Pallas Triton backend); the interpreter "
                    "runs the same comparisons above")
    q, k, v, idx = make_inputs(b=2, t=33, h=16, d=576, dv=512, s=300, top_k=100, seed=9, dtype=jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)
    kernel = lambda *a: sparse_attention_pallas(*a, scale=0.05, return_lse=True, interpret=False)
    reference = lambda q, k, v, i: sparse_attention_reference(f32(q), f32(k), f32(v), i, scale=0.05, return_lse=True)
    ((o, _), grads), ((want_o, _), want_grads) = jax.jit(lambda *a: (vjp_of(kernel, *a), vjp_of(reference, *a)))(
        q, k, v, idx)
    np.testing.assert_allclose(f32(o), want_o, rtol=0, atol=BF16_TOL * float(jnp.abs(want_o).max()))
    assert_grads_close(grads, want_grads, tol=BF16_TOL)
