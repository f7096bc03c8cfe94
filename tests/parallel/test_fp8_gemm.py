"""FP8 training GEMMs (``model.precision: fp8``, moefast/parallel/fp8_gemm.py) against an
independent NumPy version of DeepSeek-V3's recipe (ml_dtypes' e4m3 casts, float64 products)."""

import re
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moefast.config import ConfigError, load_config
from moefast.parallel.fp8 import quantize_blocks, quantize_tiles
from moefast.parallel.fp8_gemm import check_device, fp8_grouped_matmul, fp8_matmul

E4M3 = ml_dtypes.float8_e4m3fn
TINY = np.finfo(np.float32).tiny


def np_tiles(x):
    """1 x 128 tiles along the last axis: (e4m3 values [..., Kp], float32 scales [..., Kp/128])."""
    x = np.asarray(x, np.float32)
    kp = -(-x.shape[-1] // 128) * 128
    t = np.zeros(x.shape[:-1] + (kp,), np.float32)
    t[..., :x.shape[-1]] = x
    t = t.reshape(*x.shape[:-1], kp // 128, 128)
    amax = np.abs(t).max(-1)
    s = np.where(amax > 0, np.maximum(amax / np.float32(448), TINY), 1).astype(np.float32)
    q = np.clip(t * (np.float32(1) / s)[..., None], -448, 448).astype(E4M3)
    return q.reshape(*x.shape[:-1], kp), s


def np_fq_tiles(x):
    q, s = np_tiles(x)
    k = np.asarray(x).shape[-1]
    back = q.astype(np.float64).reshape(*s.shape, 128) * s[..., None]
    return back.reshape(q.shape)[..., :k]


def np_fq_blocks(w):
    w = np.asarray(w, np.float32)
    *lead, i, o = w.shape
    ip, op = -(-i // 128) * 128, -(-o // 128) * 128
    p = np.zeros((*lead, ip, op), np.float32)
    p[..., :i, :o] = w
    b = p.reshape(*lead, ip // 128, 128, op // 128, 128)
    amax = np.abs(b).max(axis=(-3, -1))
    s = np.where(amax > 0, np.maximum(amax / np.float32(448), TINY), 1).astype(np.float32)
    q = np.clip(b * (np.float32(1) / s)[..., :, None, :, None], -448, 448).astype(E4M3)
    return (q.astype(np.float64) * s[..., :, None, :, None]).reshape(*lead, ip, op)[..., :i, :o]


def np_fq_tokens(a):
    """[*B, M, C] in 128 x 1 tiles (128 tokens of a channel)."""
    return np.swapaxes(np_fq_tiles(np.swapaxes(a, -1, -2)), -1, -2)


def test_quantizers_equal_numpy_and_pad_odd_sizes():
    """Tiles and blocks: the same e4m3 bytes and float32 scales as the NumPy version, for sizes that
    are not multiples of 128 (zero padding), an all-zero tile (scale 1) and values spanning 2^±20."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 300)) * 2.0 ** rng.integers(-20, 20, (3, 1))).astype(np.float32)
    x[1, 128:256] = 0
    q, s = quantize_tiles(jnp.asarray(x))
    nq, ns = np_tiles(x)
    assert q.shape == (3, 384) and s.shape == (3, 3) and s[1, 1] == 1
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), nq.view(np.uint8))
    np.testing.assert_allclose(np.asarray(s), ns, rtol=3e-7)  # XLA may divide by 448 as a product
    w = rng.standard_normal((2, 300, 200)).astype(np.float32)
    qw, sw = quantize_blocks(jnp.asarray(w))
    assert qw.shape == (2, 384, 256) and sw.shape == (2, 3, 2)
    back = np.asarray(qw).astype(np.float64).reshape(2, 3, 128, 2, 128) * np.asarray(sw)[:, :, None, :, None]
    np.testing.assert_allclose(back.reshape(2, 384, 256)[:, :300, :200], np_fq_blocks(w), rtol=3e-7)


@pytest.mark.parametrize("batched", [False, True], ids=["dense", "experts"])
def test_three_gemms_follow_the_recipe(batched):
    """Forward, dgrad and wgrad equal the NumPy recipe: x in 1 x 128 tiles and w in 128 x 128
    blocks; dy in 1 x 128 tiles for dx; x and dy in 128 x 1 token tiles for dw (float32 sums vs
    float64: 1e-5). Dense: [2, 130, 300] tokens (260 rows, not a multiple of 128); experts: [3, 150,
    256] x [3, 256, 200] (the token tiles run across the experts' 150-row buffers)."""
    rng = np.random.default_rng(1)
    if batched:
        x, w, g = rng.standard_normal((3, 150, 256)), rng.standard_normal((3, 256, 200)), rng.standard_normal((3, 150, 200))
    else:
        x, w, g = rng.standard_normal((2, 130, 300)), rng.standard_normal((300, 200)), rng.standard_normal((2, 130, 200))
    x, w, g = (a.astype(np.float32) for a in (x, w, g))
    y, vjp = jax.vjp(lambda a, b: fp8_matmul(a, b, jnp.float32), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    fw = np_fq_blocks(w)
    np.testing.assert_allclose(np.asarray(y), np_fq_tiles(x) @ fw, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx), np_fq_tiles(g) @ np.swapaxes(fw, -1, -2), rtol=1e-5, atol=1e-4)
    # token tiles over all rows in order (experts: across the experts' buffers), each expert's own sum
    flat = lambda a: np_fq_tokens(a.reshape(-1, a.shape[-1])).reshape(a.shape[0] if batched else 1, -1, a.shape[-1])  # noqa: E731
    want_dw = (np.swapaxes(flat(x), -1, -2) @ flat(g)).reshape(w.shape)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-3)
    # and e4m3's error against the exact product stays a few percent
    exact = x.astype(np.float64) @ w
    assert 0 < np.abs(np.asarray(y) - exact).max() / np.abs(exact).max() < 0.08


def test_grouped_gemms_follow_the_recipe():
    """The dropless experts' grouped GEMM: each row's tiles, each group's blocks; the weight
    gradient from 128-row tiles of the whole sorted array (the tile over rows 128-255 spans two
    groups); an empty group gets a zero gradient, rows after the last group 0."""
    rng = np.random.default_rng(2)
    sizes = np.array([100, 0, 150], np.int32)
    x, w = rng.standard_normal((300, 256)).astype(np.float32), rng.standard_normal((3, 256, 160)).astype(np.float32)
    g = rng.standard_normal((300, 160)).astype(np.float32)
    y, vjp = jax.vjp(lambda a, b: fp8_grouped_matmul(a, b, jnp.asarray(sizes)), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    fx, fw, fg = np_fq_tiles(x), np_fq_blocks(w), np_fq_tiles(g)
    xt, gt = np_fq_tokens(x), np_fq_tokens(g)
    want_y, want_dx, want_dw = np.zeros((300, 160)), np.zeros((300, 256)), np.zeros((3, 256, 160))
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        want_y[rows] = fx[rows] @ fw[e]
        want_dx[rows] = fg[rows] @ fw[e].T
        want_dw[e] = xt[rows].T @ gt[rows]
        start += n
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-3)
    assert not np.asarray(dw[1]).any() and not np.asarray(y[250:]).any()


def test_scale_floors_of_export_and_training(tmp_path):
    """A 128 x 128 block whose largest magnitude is subnormal (1e-44: max/448 rounds to 0), one of
    tiny normals (1e-37: max/448 is subnormal, which XLA flushes to 0) and an all-zero block: the
    export (``export-hf --dtype fp8``) and the training quantizers give finite codes and scales of at
    least the smallest normal float32 (the old export rule, max/448 with only 0 guarded, gave scale
    0 and NaN codes), and the export reads back through moefast's reader with its zeros zero."""
    import json

    from safetensors.numpy import save_file

    from moefast.interop import hf_files, hf_write

    w = np.zeros((256, 384), np.float32)
    w[0, 0], w[:128, 128:256] = 1e-44, 1e-37  # block (0, 0): one subnormal, the rest zeros
    w[128:, :128] = np.random.default_rng(0).standard_normal((128, 128))  # block (1, 0): ordinary
    q, s = hf_write._fp8_blocks(w)
    assert np.isfinite(s).all() and (s >= TINY).all() and s[0, 2] == 1.0, s
    assert not np.isnan(q.astype(np.float32)).any()
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": hf_write.FP8_BLOCK_CONFIG}))
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "model.safetensors"))
    f = hf_files._Files(tmp_path)
    try:
        back = f.get("w")
    finally:
        f.close()
    assert np.isfinite(back).all() and (back[w == 0] == 0).all()
    ordinary = w[128:, :128]
    assert np.abs(back[128:, :128] - ordinary).max() <= np.abs(ordinary).max() * 2.0 ** -4
    # training: the same blocks through the weights' and the activations' quantizers
    for quantize in (quantize_blocks, quantize_tiles):
        qj, sj = quantize(jnp.asarray(w))
        assert np.isfinite(np.asarray(sj)).all() and (np.asarray(sj) >= TINY).all()
        assert not np.isnan(np.asarray(qj, np.float32)).any()
        assert (np.asarray(qj, np.float32)[w == 0] == 0).all()


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"])
def test_export_refuses_non_finite_weights(name):
    """A non-finite weight cannot be encoded (nor spread over a block by its scale): one clear error
    naming the tensor, before any write -- a quantized matrix's, or a norm's that stays bfloat16."""
    from moefast.interop import hf_write

    w = np.ones((128, 128) if "proj" in name else (128,), np.float32)
    w.flat[3] = np.nan
    with pytest.raises(ValueError, match=re.escape(name) + " holds non-finite values"):
        list(hf_write._fp8_rows([("model.embed_tokens.weight", np.ones((4, 8), np.float32)), (name, w)]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_nan_or_overflow_with_scales_at_their_limits(dtype):
    """Activations near the dtype's largest value (1e38), subnormal ones (1e-40, where max/448
    underflows), zeros, and a gradient row as large: finite outputs and gradients, each value's
    error within e4m3's (2^-4 of its tile's max-abs; for the subnormal tile, see below)."""
    big = float(jnp.finfo(dtype).max) / 4
    x = np.zeros((4, 256), np.float32)
    x[0, :128] = big * np.linspace(-1, 1, 128)
    x[1, :128] = 1e-40 * np.linspace(-1, 1, 128) if dtype == jnp.float32 else 1e-30
    x[2] = np.random.default_rng(3).standard_normal(256)
    w = np.eye(256, 8, dtype=np.float32)  # picks channels: each output is one quantized value
    xj = jnp.asarray(x).astype(dtype)
    y, vjp = jax.vjp(lambda a, b: fp8_matmul(a, b, jnp.float32), xj, jnp.asarray(w))
    g = np.ones((4, 8), np.float32)
    g[3] = big  # x's row 3 is 0: no product overflows float32
    dx, dw = vjp(jnp.asarray(g))
    for a in (y, dx, dw):
        assert np.isfinite(np.asarray(a, np.float32)).all()
    ref = np.asarray(xj, np.float64)[:, :8]
    err = np.abs(np.asarray(y, np.float64) - ref)
    # subnormal float32 values may be flushed to 0 (XLA flushes subnormals; the scale stops at the
    # smallest normal so it never divides by 0): an error below that normal
    assert (err <= np.abs(ref).max(axis=1, keepdims=True) * 2.0 ** -4 + TINY).all()


def test_model_runs_the_named_gemms_in_fp8():
    """A model with every named layer (GQA projections, a dense MLP, routed and shared experts;
    MLA's six projections in a second model; Gated DeltaNet's projections and MTP's eh_proj in a
    third): one pair of e4m3 casts (x tiles, w blocks) per GEMM in
    the forward pass and none with precision bf16 (the router, embeddings and LM head stay); logits
    within e4m3's error of bf16's, gradients finite."""
    from moefast.train import ModelDef

    base = ["model.d_model=128", "model.num_layers=2", "model.num_heads=2", "model.head_dim=64", "model.d_ff=128",
            "model.max_seq_len=64", "moe.num_experts=4", "model.num_dense_layers=1", "moe.shared_expert_d_ff=128",
            "data.seq_len=32"]
    mla = ["model.attention=mla", "model.q_lora_rank=64", "model.kv_lora_rank=64", "model.qk_nope_head_dim=32",
           "model.qk_rope_head_dim=32", "model.v_head_dim=32"]
    # a Gated DeltaNet layer (in_proj, out) before the attention layer, and an MTP module (eh_proj,
    # then a full-attention MoE block)
    gdn_mtp = ["model.layer_types=[linear_attention,full_attention]", "model.linear_num_key_heads=1",
               "model.linear_num_value_heads=2", "model.linear_key_head_dim=32", "model.linear_value_head_dim=32",
               "model.linear_attention_impl=reference", "model.mtp_depth=1"]
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 32)), jnp.int32)
    # the third model: its casts only (traced, not compiled: the first two check logits and gradients)
    md = ModelDef(load_config(None, [*base, *gdn_mtp, "model.precision=fp8"]), 259)
    jaxpr = str(jax.make_jaxpr(lambda p: md.module(p)(ids, drop_tokens=False).logits)(md.init_params(seed=0)))
    assert jaxpr.count("new_dtype=float8_e4m3fn") == 2 * (2 + 2 + 2 + 2 + 2 + 1 + 2 + 2 + 2)
    for extra, gemms in (([], 2 * 2 + 2 + 2 + 2), (mla, 2 * 5 + 2 + 2 + 2)):  # per layer: attention, MLP or experts
        out = {}
        for precision in ("bf16", "fp8"):
            md = ModelDef(load_config(None, [*base, *extra, f"model.precision={precision}"]), 259)
            params = md.init_params(seed=0)
            f = lambda p: md.module(p)(ids, drop_tokens=False).logits  # noqa: E731
            casts = str(jax.make_jaxpr(f)(params)).count("new_dtype=float8_e4m3fn")
            out[precision] = (casts, np.asarray(jax.jit(f)(params)))
            if precision == "fp8":
                grads = jax.grad(lambda p: jnp.mean(f(p) ** 2))(params)
                assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(grads))
        assert out["bf16"][0] == 0 and out["fp8"][0] == 2 * gemms, (extra, out["fp8"][0])
        ref = out["bf16"][1]
        assert 0 < np.abs(out["fp8"][1] - ref).max() < 0.1 * np.abs(ref).max()


def test_fp8_refused_on_gpus_without_fp8_tensor_cores():
    """One clear error for an A100 (8.0); Hopper and CPU get the emulation note."""
    a100 = types.SimpleNamespace(compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match="model.precision.*8.9.*A100.*8.0.*model.precision=bf16"):
        check_device("gpu", a100)
    h100 = types.SimpleNamespace(compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3")
    assert "emulated" in check_device("gpu", h100) and "cpu" in check_device("cpu", jax.devices()[0])
    with pytest.raises(ConfigError, match="precision"):
        load_config(None, ["model.precision=fp16"])
    with pytest.raises(ConfigError, match="did you mean 'fp8'"):
        load_config(None, ["model.precision=FP8"])
