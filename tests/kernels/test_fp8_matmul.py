"""The FP8 grouped GEMM kernels (kernels/fp8_matmul): run by the Triton interpreter on CPU against
the recipe's numbers (moefast.parallel.fp8's quantizers, float64 products), and compiled for sm_90
to Hopper's FP8 tensor-core instruction (``wgmma ... e4m3.e4m3``), not an upcast."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
pytest.importorskip("triton", reason="triton (a test dependency) is not installed")

from moefast.kernels.fp8_matmul import (scaled_grouped_matmul_torch, scaled_weight_grads_torch,  # noqa: E402
                                        tile_rows)
from moefast.kernels.grouped_matmul.pallas import tile_table  # noqa: E402
from moefast.parallel.fp8 import quantize_blocks, quantize_tiles  # noqa: E402


def _t(a):
    a = np.asarray(a)
    if a.dtype == jnp.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(a.copy())


def _deq_tiles(q, s):
    q = np.asarray(q).astype(np.float64)
    return (q.reshape(*q.shape[:-1], -1, 128) * np.asarray(s)[..., None]).reshape(q.shape)


def _deq_blocks(q, s):
    g, i, o = q.shape
    b = np.asarray(q).astype(np.float64).reshape(g, i // 128, 128, o // 128, 128)
    return (b * np.asarray(s)[:, :, None, :, None]).reshape(g, i, o)


@pytest.fixture
def rn_cast(monkeypatch):
    """The Triton interpreter's float32 -> e4m3 cast made round-to-nearest-even with saturation, as
    Hopper's ``cvt.rn.satfinite.e4m3x2.f32`` (what the compiled kernel emits; checked below): the
    interpreter's own cast (triton 3.9, ``interpreter._convert_float``) drops the carry of its
    rounding into the exponent (7.96 becomes 4), which no GPU does."""
    import ml_dtypes
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def rounded(data, src, dst, mode):
        if dst == tl.float8e4nv and src == tl.float32:
            return np.clip(np.asarray(data, np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return convert(data, src, dst, mode)

    monkeypatch.setattr(interpreter, "_convert_float", rounded)


def test_one_pass_quantizers_equal_the_recipe_bitwise(rn_cast):
    """The GPU quantizers give moefast.parallel.fp8's codes and scales bit for bit, over magnitudes
    1e-13..1e13, an all-zero row and tiny normals (1e-37), padding with zeros to multiples of 128:
    the activations' (one read of x [300, 200]: its 1 x 128 tiles, and its 128-token tiles written
    transposed) as quantize_tiles of x and of x.T, the weights' (128 x 128 blocks, from float32 and
    from bfloat16) as quantize_blocks."""
    from moefast.kernels.fp8_matmul import quantize_torch, quantize_weights_torch

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 200)) * np.exp(rng.uniform(-30, 30, (300, 1)))).astype(np.float32)
    x[5], x[7, :128] = 0, 1e-37
    q, s, qt, st = quantize_torch(torch.from_numpy(x), rows=True, cols=True)
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    for (got_q, got_s), ref in (((q, s), x), ((qt, st), x.T)):
        want_q, want_s = quantize_tiles(jnp.asarray(ref))
        rows = ref.shape[0]
        np.testing.assert_array_equal(bits(got_q.view(torch.uint8).numpy()[:rows]), bits(want_q))
        np.testing.assert_array_equal(got_s.numpy()[:rows], np.asarray(want_s))
        assert not got_q.view(torch.uint8).numpy()[rows:].any()  # padding rows: zeros
    (q_only, s_only) = quantize_torch(torch.from_numpy(x), rows=True, cols=False)
    assert torch.equal(q_only.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_only, s)
    # the weights' quantizer: 128 x 128 blocks of [2, 300, 200] (float32 and bfloat16), as quantize_blocks
    w = np.stack([x, -0.5 * x[::-1]])
    for dtype in (jnp.float32, jnp.bfloat16):
        wj = jnp.asarray(w, dtype)
        got_q, got_s = quantize_weights_torch(_t(wj) if dtype == jnp.float32 else
                                              torch.from_numpy(np.asarray(wj, np.float32)).to(torch.bfloat16))
        want_q, want_s = quantize_blocks(wj)
        np.testing.assert_array_equal(got_q.view(torch.uint8).numpy(), bits(want_q))
        np.testing.assert_array_equal(got_s.numpy(), np.asarray(want_s))


def test_interpreted_kernels_equal_the_recipe():
    """Forward (A @ B[g]), dgrad (A @ B[g]^T, B read transposed) and wgrad (128-token tiles) on
    groups of 100, 0 and 150 rows out of 384 (a 128-row tile spans two groups; rows past the
    groups stay unwritten): the e4m3 values times their scales, summed in float64, to 1e-5."""
    rng = np.random.default_rng(0)
    sizes = np.array([100, 0, 150], np.int32)
    m, k, n = 384, 256, 128
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[250:] = 0
    w = rng.standard_normal((3, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    dy[250:] = 0
    xq, sx = quantize_tiles(jnp.asarray(x))
    wq, sw = quantize_blocks(jnp.asarray(w))
    gq, sg = quantize_tiles(jnp.asarray(dy))
    bm = tile_rows(m, 3)
    table = _t(tile_table(jnp.asarray(sizes), m, bm))
    y = scaled_grouped_matmul_torch(_t(xq), _t(sx), _t(wq), _t(sw), table, out_dtype=torch.float32,
                                    block_rows=bm).numpy()
    dx = scaled_grouped_matmul_torch(_t(gq), _t(sg), _t(wq), _t(sw), table, transpose_b=True,
                                     out_dtype=torch.float32, block_rows=bm).numpy()
    xtq, sxt = quantize_tiles(jnp.asarray(x.T))
    gtq, sgt = quantize_tiles(jnp.asarray(dy.T))
    ends = np.cumsum(sizes)
    dw = scaled_weight_grads_torch(_t(xtq), _t(sxt), _t(gtq), _t(sgt),
                                   _t(np.concatenate([ends - sizes, ends]).astype(np.int32))).numpy()
    fx, fw, fg = _deq_tiles(xq, sx), _deq_blocks(wq, sw), _deq_tiles(gq, sg)
    xt, gt = _deq_tiles(xtq, sxt).T, _deq_tiles(gtq, sgt).T
    start = 0
    for e, rows_n in enumerate(sizes):
        rows = slice(start, start + rows_n)
        np.testing.assert_allclose(y[rows], fx[rows] @ fw[e], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(dx[rows], fg[rows] @ fw[e].T, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(dw[e], xt[rows].T @ gt[rows], rtol=1e-5, atol=1e-3)
        start += rows_n
    assert not dw[1].any() and not y[250:].any() and not dx[250:].any()


_ASSEMBLE = """
import re, sys
sys.path.insert(0, sys.argv[1])
from moefast.kernels.fp8_matmul import compile_for
for kind in ("forward", "dgrad", "wgrad", "quantize", "quantize_weights"):
    ptx = compile_for(kind)
    pattern = (r"wgmma\\.mma_async[.a-z0-9_]*|mma\\.sync[.a-z0-9_]*|cvt\\.rn[.a-z0-9_]*e4m3x2[.a-z0-9]*"
               r"|div\\.[a-z0-9.]*f32")
    print(kind, sorted(set(re.findall(pattern, ptx))))
"""


def test_kernels_compile_to_hopper_fp8_tensor_core_instructions(tmp_path):
    """Compiled for sm_90 (no GPU; the PTX version JAX's CUDA 12 ptxas assembles), each kernel's
    products are Hopper's e4m3 warpgroup MMA with a float32 accumulator, with no f16 upcast: what
    ``max_num_imprecise_acc=128`` buys (Pallas' lowering, without it, gets ``mma.sync`` on f16).
    In a subprocess without TRITON_INTERPRET (the interpreter replaces the compiler)."""
    from moefast.bench import gpu_compile

    root = gpu_compile.plugin_path()
    assert root, "the GPU compile tools are not installed next to this environment (README's test command)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _ASSEMBLE, root], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 5, proc.stdout
    for line in lines[:3]:
        assert line.endswith("['wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3']"), line
    # the quantizers: IEEE division (as XLA's) and the saturating round-to-nearest-even e4m3 cast
    assert lines[3] == "quantize ['cvt.rn.satfinite.e4m3x2.f32', 'div.rn.f32']", lines[3]
    assert lines[4] == "quantize_weights ['cvt.rn.satfinite.e4m3x2.f32', 'div.rn.f32']", lines[4]


def _interpreted(monkeypatch):
    """moefast's GPU path of model.precision=fp8 (quantize, launch, unpad) with the kernels run by the
    Triton interpreter through jax.pure_callback in place of jax-triton."""
    import threading

    import jax

    from moefast.kernels import fp8_matmul

    lock = threading.Lock()  # the interpreter patches triton.language while it runs: one launch at a time

    def grouped(a, sa, b, sb, group_sizes, *, transpose_b=False, out_dtype=None, block_rows=None):
        bm = block_rows or tile_rows(a.shape[0], b.shape[0])
        table = tile_table(group_sizes, a.shape[0], bm)
        n = b.shape[1] if transpose_b else b.shape[2]
        out = jax.ShapeDtypeStruct((a.shape[0], n), out_dtype or jnp.bfloat16)

        def run(table, *arrays):
            with lock:
                y = scaled_grouped_matmul_torch(*map(_t, arrays), _t(table), transpose_b=transpose_b,
                                                out_dtype=torch.float32, block_rows=bm)
            return y.numpy().astype(out.dtype)

        return jax.pure_callback(run, out, table, a, sa, b, sb)

    def wgrad(xt, sxt, dyt, sdyt, group_sizes, *, out_dtype=None):
        ends = jnp.cumsum(group_sizes)
        bounds = jnp.concatenate([ends - group_sizes, ends]).astype(jnp.int32)
        out = jax.ShapeDtypeStruct((group_sizes.shape[0], xt.shape[0], dyt.shape[0]), out_dtype or jnp.float32)

        def run(*arrays):
            with lock:
                return scaled_weight_grads_torch(*map(_t, arrays)).numpy().astype(out.dtype)

        return jax.pure_callback(run, out, xt, sxt, dyt, sdyt, bounds)

    def quantize(x, *, rows=True, cols=False):
        mp, kp = (-(-v // 128) * 128 for v in x.shape)
        f8, f32 = jnp.float8_e4m3fn, jnp.float32
        outs = ([jax.ShapeDtypeStruct((mp, kp), f8), jax.ShapeDtypeStruct((mp, kp // 128), f32)] if rows else []) + \
            ([jax.ShapeDtypeStruct((kp, mp), f8), jax.ShapeDtypeStruct((kp, mp // 128), f32)] if cols else [])

        def run(a):
            with lock:
                got = fp8_matmul.quantize_torch(_t(a.astype(np.float32)), rows=rows, cols=cols)
            return tuple(g.view(torch.uint8).numpy().view(jnp.float8_e4m3fn) if g.dtype == torch.float8_e4m3fn
                         else g.numpy() for g in got)

        return jax.pure_callback(run, tuple(outs), x)

    monkeypatch.setattr(fp8_matmul, "available", lambda platform=None: None)
    monkeypatch.setattr(fp8_matmul, "quantize", quantize)
    # the weights' quantizer as moefast.parallel.fp8.quantize_blocks, whose bits it has
    # (test_one_pass_quantizers_equal_the_recipe_bitwise): one more callback per weight, replicated
    # over the 8 devices inside shard_map, deadlocks XLA:CPU's callback threads
    monkeypatch.setattr(fp8_matmul, "quantize_weights", quantize_blocks)
    monkeypatch.setattr(fp8_matmul, "scaled_grouped_matmul", grouped)
    monkeypatch.setattr(fp8_matmul, "scaled_weight_grads", wgrad)


def test_gpu_path_equals_the_emulation(monkeypatch, devices, rn_cast):
    """The kernels' path through moefast.parallel.fp8_gemm (odd sizes padded to 128, dense layers as
    one group, capacity experts as equal groups, dropless groups; on an 8-device mesh a dense
    layer's launches inside shard_map with the weight gradient summed over the token shards, each
    shard tiling its own tokens) gives the emulation's forward and gradients, to float32 rounding."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from moefast.parallel import fp8_gemm

    rng = np.random.default_rng(5)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    cases = [("dense", r(2, 72, 200), r(200, 136), None), ("experts", r(4, 40, 128), r(4, 128, 96), None),
             ("dropless", r(300, 128), r(3, 128, 136), jnp.asarray([90, 0, 150], jnp.int32))]

    def run(x, w, sizes):
        if sizes is None:
            f = lambda a, b: fp8_gemm.fp8_matmul(a, b, jnp.float32)  # noqa: E731
        else:
            f = lambda a, b: fp8_gemm.fp8_grouped_matmul(a, b, sizes, dtype=jnp.float32)  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        # a fixed cotangent: one computed from y would differ by y's rounding, and its e4m3 rounding could flip
        return (y, *vjp(jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)))

    emulated = {name: run(x, w, s) for name, x, w, s in cases}
    _interpreted(monkeypatch)
    for name, x, w, s in cases:
        for got, want in zip(run(x, w, s), emulated[name]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-4, err_msg=name)
    # a dense layer under GSPMD: batch over data x expert, each shard's launches local
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AxisType.Auto,) * 2, devices=devices)
    x, w = r(8, 16, 200), r(200, 136)
    want = jax.vjp(lambda a, b: fp8_gemm.fp8_matmul(a, b, jnp.float32), x, w)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))

        @jax.jit
        def sharded(a, b, g):
            y, payload = fp8_gemm.gspmd_forward(a, b, jnp.float32)
            return y, *fp8_gemm.gspmd_grads(payload, g, b.shape, a.dtype)

        y, dx, dw = sharded(xs, w, jnp.cos(want[0]))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want[0]), rtol=2e-5, atol=2e-4)
    g = jnp.cos(want[0])
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want[1](g)[0]), rtol=2e-5, atol=2e-4)
    # each device tiles its own tokens for the weight gradient: the sum of the shards' own
    shards = [jax.vjp(lambda b: fp8_gemm.fp8_matmul(x[i:i + 1], b, jnp.float32), w)[1](g[i:i + 1])[0] for i in range(8)]
    np.testing.assert_allclose(np.asarray(dw), np.asarray(sum(shards)), rtol=2e-5, atol=2e-3)
