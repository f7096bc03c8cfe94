"""Lightning-indexer scores (DeepSeek Sparse Attention's indexer): the jnp reference against a NumPy
float64 loop, and the Pallas kernel (interpreted on CPU; lowered for CUDA and compiled to PTX for a
compile-only H100) against the reference.

Shapes are small (the interpreter runs one grid step, and each head of it, one after another): T
and S not multiples of the query and key blocks, 1 to 3 heads, widths 8, 24 and 32 (below and off
the power-of-two block of 16/32), weights of both signs, both signs of the scale, bfloat16. The
compiled kernel's case runs on a GPU only (``gpu`` marker).
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
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.bench import gpu_compile
from moefast.kernels.lightning_indexer import (IMPLS, SCORES_NAME, lightning_indexer_scores,
                                               lightning_indexer_scores_pallas, lightning_indexer_scores_reference,
                                               resolve)

TOL = dict(rtol=1e-5, atol=1e-5)


def make_inputs(b=2, t=5, h=3, d=24, s=40, seed=0, dtype=jnp.float32):
    """q [B, T, Hi, Di] and k [B, S, Di] of ``dtype``, float32 w [B, T, Hi] of both signs (about a
    third negative: heads that vote a key down; both present from 6 weights on)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, d)), dtype)
    w = jnp.asarray(rng.normal(loc=0.5, size=(b, t, h)), jnp.float32)
    assert w.size < 6 or ((w < 0).any() and (w > 0).any())
    return q, w, k


def numpy_scores(q, w, k, scale):
    """Float64 loop over rows, queries and heads: ``sum_h w · relu(scale · q_h · k)``."""
    q, w, k = (np.asarray(x, np.float64) for x in (q, w, k))
    b, t, h, _ = q.shape
    out = np.zeros((b, t, k.shape[1]))
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                out[bi, ti] += w[bi, ti, hi] * np.maximum(scale * (k[bi] @ q[bi, ti, hi]), 0.0)
    return out


def close(got, want, tol=TOL):
    """Scores agree to ``tol``, relative to the largest score (they sum signed terms: a score near 0
    may be the difference of large ones)."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol["atol"] + tol["rtol"] * np.abs(want).max())


@pytest.mark.parametrize("scale", [0.3, -0.2])
def test_reference_matches_numpy_float64(scale):
    q, w, k = make_inputs(seed=1)
    got = jax.jit(lambda *a: lightning_indexer_scores_reference(*a, scale=scale))(q, w, k)
    assert got.shape == (2, 5, 40) and got.dtype == jnp.float32
    want = numpy_scores(q, w, k, scale)
    close(got, want)
    assert (want < 0).any() and (want > 0).any()  # negative weights make negative scores


CASES = {  # name: (make_inputs keywords, kernel keywords)
    "s-tail": (dict(s=40), dict(block_s=16)),  # 3 key blocks, the last 8 of 16 used
    "t-tail": (dict(b=1, t=20, h=2, s=20), dict(block_t=16)),  # 2 query blocks, the last 4 of 16; S = 20
    "default-blocks": (dict(b=1, t=5, h=2, d=32, s=20), {}),  # Tq = Sk = Wd = 32: one block, tails masked
    "width-8": (dict(b=1, t=3, h=2, d=8, s=64), dict(block_s=32)),  # Di = 8 computed in a block of 16
    "one-query-one-key": (dict(b=2, t=1, h=1, d=8, s=1, seed=12), {}),  # q·k > 0 in row 0, < 0 in row 1
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scale", [0.25, -0.4])
def test_pallas_equals_reference(case, scale):
    shape_kw, kernel_kw = CASES[case]
    q, w, k = make_inputs(**{"seed": 10 + list(CASES).index(case), **shape_kw})

    def both(*a):
        return (lightning_indexer_scores_pallas(*a, scale=scale, interpret=True, **kernel_kw),
                lightning_indexer_scores_reference(*a, scale=scale))

    got, want = jax.jit(both)(q, w, k)
    assert got.shape == want.shape == (q.shape[0], q.shape[1], k.shape[1]) and got.dtype == jnp.float32
    close(got, want)
    assert np.any(np.asarray(want) != 0)


def test_pallas_bfloat16():
    """bfloat16 q and k: float32 scores, equal to the float32 reference of the same (bfloat16)
    values to float32 rounding: products of bfloat16 numbers are exact in float32, and the kernel
    accumulates in float32 (the interpreter as the tensor cores do)."""
    q, w, k = make_inputs(b=1, t=17, h=3, d=32, s=50, seed=5, dtype=jnp.bfloat16)
    got = jax.jit(lambda *a: lightning_indexer_scores_pallas(*a, scale=0.2, interpret=True, block_t=16,
                                                            block_s=16))(q, w, k)
    assert got.dtype == jnp.float32
    close(got, lightning_indexer_scores_reference(q.astype(jnp.float32), w, k.astype(jnp.float32), scale=0.2))
    close(lightning_indexer_scores_reference(q, w, k, scale=0.2), numpy_scores(q, w, k, 0.2))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_scores_carry_no_gradient(impl):
    """The public function has no gradient (zeros) with either implementation, although the
    reference itself is differentiable (its gradient is not zero) and the kernel alone cannot be
    differentiated at all."""
    q, w, k = make_inputs(b=1, t=3, h=2, d=8, s=20, seed=3)

    def public(q, w, k):
        return jnp.sum(jnp.sin(lightning_indexer_scores(q, w, k, scale=0.5, impl=impl, interpret=True)))

    def reference(q, w, k):
        return jnp.sum(jnp.sin(lightning_indexer_scores_reference(q, w, k, scale=0.5)))

    grads = jax.jit(jax.grad(public, argnums=(0, 1, 2)))(q, w, k)
    for g, x in zip(grads, (q, w, k), strict=True):
        assert g.shape == x.shape and np.all(np.asarray(g) == 0)
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.grad(reference, argnums=(0, 1, 2))(q, w, k))


def test_impl_dispatch_and_validation():
    q, w, k = make_inputs(b=1, t=2, h=2, d=8, s=10)
    assert resolve("auto", "gpu") == "pallas" and resolve("auto", "cpu") == "reference"
    assert resolve("auto") == "reference" and IMPLS == ("reference", "pallas", "auto")  # this CPU machine
    with pytest.raises(ValueError, match="impl"):
        resolve("triton")
    np.testing.assert_array_equal(lightning_indexer_scores(q, w, k, scale=0.5),
                                  lightning_indexer_scores_reference(q, w, k, scale=0.5))
    bad = {  # message: (q, w, k)
        r"k must be \[batch=1, keys>0, width=8\]": (q, w, k[..., :-1]),
        r"keys>0": (q, w, k[:, :0]),
        r"q must be \[batch, tokens, heads, width\]": (q[:, :, 0], w, k),
        r"w must be a float32 \[batch=1, tokens=2, heads=2\]": (q, w[..., :1], k),
        r"w must be a float32": (q, w.astype(jnp.bfloat16), k),
        r"share one dtype": (q, w, k.astype(jnp.bfloat16)),
        r"share one dtype among": (q.astype(jnp.int32), w, k.astype(jnp.int32)),
    }
    for message, args in bad.items():
        for impl in ("reference", "pallas"):
            with pytest.raises(ValueError, match=message):
                lightning_indexer_scores(*args, scale=0.5, impl=impl)
    with pytest.raises(ValueError, match="power of two"):
        lightning_indexer_scores_pallas(q, w, k, scale=0.5, block_s=24)
    with pytest.raises(ValueError, match="power of two"):
        lightning_indexer_scores_pallas(q, w, k, scale=0.5, block_t=8)
    with pytest.raises(ValueError, match="static"):
        jax.jit(lambda s: lightning_indexer_scores(q, w, k, scale=s))(0.5)
    with pytest.raises(ValueError, match="static"):
        lightning_indexer_scores(q, w, k, scale=True)


DEEPSEEK = dict(b=1, t=256, h=64, d=128, s=1000)  # DeepSeek-V3.2's indexer; S not a multiple of the key block


def test_pallas_lowers_for_cuda_from_cpu():
    """The compiled path (``interpret=False``) lowers to one Triton kernel, by name, at DeepSeek-V3.2's
    indexer sizes (Hi = 64, Di = 128, a block of T = 256 queries, S = 1000), bfloat16 and float32,
    and holds no [T, Hi, S] logits: the reference's lowering does (the memory the kernel saves).
    This checks the Pallas -> Triton IR lowering (masks, the head loop) on a CPU-only jaxlib; PTX
    and running need a GPU toolchain and a GPU."""
    b, t, h, d, s = DEEPSEEK.values()
    logits = f"tensor<{b}x{t}x{h}x{s}xf32>"

    def lower(impl, dtype):
        sd = jax.ShapeDtypeStruct
        args = (sd((b, t, h, d), dtype), sd((b, t, h), jnp.float32), sd((b, s, d), dtype))
        fn = functools.partial(lightning_indexer_scores, scale=d ** -0.5, impl=impl, interpret=False)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    for dtype in (jnp.bfloat16, jnp.float32):
        text = lower("pallas", dtype)
        assert text.count("__gpu$xla.gpu.triton") == 1 and f'name = "{SCORES_NAME}"' in text
        assert logits not in text and f"tensor<{b}x{t}x{s}xf32>" in text
        assert logits in lower("reference", dtype)


_COMPILE_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from moefast.bench import gpu_compile
    gpu_compile.prepare_process()
    from moefast.kernels.lightning_indexer import lightning_indexer_scores, resolve
    devices = gpu_compile.compile_only_devices("h100", 1, 1)
    mesh = jax.sharding.Mesh(devices, ("x",))
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    b, t, h, d, s = {shape}
    with jax.set_mesh(mesh):  # impl="auto", interpret=None: the kernel, compiled, because the mesh is H100s
        assert resolve("auto") == "pallas", resolve("auto")
        for dtype in (jnp.bfloat16, jnp.float32):
            args = (sd((b, t, h, d), dtype), sd((b, t, h), jnp.float32), sd((b, s, d), dtype))
            fn = lambda q, w, k: lightning_indexer_scores(q, w, k, scale=d ** -0.5)
            jax.jit(fn).trace(*args).lower().compile()
    print("compiled")
""").format(shape=tuple(DEEPSEEK.values()))


def test_pallas_compiles_to_ptx_for_h100_from_cpu(tmp_path):
    """The scores at DeepSeek-V3.2's indexer sizes, bfloat16 and float32, compiled for a compile-only
    H100 through the CUDA PJRT plugin (``.venv/gpu-compile``) with ``impl="auto"`` under a mesh of
    those H100s: Triton emits the named kernel's PTX for sm_90a, each head's product is Hopper's
    warpgroup MMA (``wgmma``, bf16 -> f32; three-pass TF32 for float32), and ptxas (``-v``) fits
    both in registers without spilling. Nothing runs."""
    assert gpu_compile.plugin_path(), (
        "the CUDA PJRT plugin is not installed next to this environment; install it as README's test command "
        "does: pip install -c constraints.txt --no-deps --target .venv/gpu-compile jax-cuda12-pjrt "
        "jax-cuda12-plugin nvidia-cuda-nvcc-cu12 jax-triton")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("TRITON_")}
    env["XLA_FLAGS"] = f"--xla_dump_to={tmp_path}"
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
    ptx = [p for p in sorted(tmp_path.glob("*.ptx")) if f".entry {SCORES_NAME}(" in p.read_text()]
    assert len(ptx) == 2, sorted(p.name for p in tmp_path.glob("*.ptx"))
    texts = [p.read_text() for p in ptx]
    assert all(".target sm_90a" in text for text in texts)
    mma = sorted(kind for text in texts for kind in ("f32.bf16.bf16", "f32.tf32.tf32")
                 if re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.{re.escape(kind)}", text))
    assert mma == ["f32.bf16.bf16", "f32.tf32.tf32"], mma  # one kernel each
    assert not any("mma.sync" in text for text in texts)  # no pre-Hopper MMA fallback
    ptxas = Path(gpu_compile.plugin_path()) / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    assert ptxas.is_file(), ptxas
    for p in ptx:
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(p), "-o", os.devnull], capture_output=True,
                              text=True, timeout=120)
        assert info.returncode == 0, info.stderr[-2000:]
        assert "0 bytes spill stores, 0 bytes spill loads" in info.stderr, (p.name, info.stderr)


@pytest.mark.gpu
def test_compiled_kernel_equals_reference_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled Pallas kernel needs an NVIDIA GPU (Pallas Triton backend); the interpreter "
                    "runs the same comparisons above")
    for dtype in (jnp.bfloat16, jnp.float32):
        q, w, k = make_inputs(b=2, t=100, h=64, d=128, s=1000, seed=9, dtype=dtype)
        got = jax.jit(lambda *a: lightning_indexer_scores_pallas(*a, scale=128 ** -0.5, interpret=False))(q, w, k)
        want = lightning_indexer_scores_reference(q.astype(jnp.float32), w, k.astype(jnp.float32), scale=128 ** -0.5)
        close(got, want)  # bfloat16: exact products, float32 sums; float32: three-pass TF32 (about float32)
