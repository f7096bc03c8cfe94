"""NF4 storage (moefast.parallel.nf4) against a NumPy port written here from bitsandbytes' sources."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from moefast.parallel.nf4 import NF4, NF4_BLOCK, NF4_CODE, nf4_bytes, nf4_dequantize, nf4_quantize

# Typed from bitsandbytes csrc/kernels.cu `nf4_dequantization_lut` (commit 95f9af3; the same values as
# QLoRA arXiv:2305.14314 Appendix E and bitsandbytes/functional.py `get_4bit_type("nf4")`).
BNB_NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)
# The thresholds of bitsandbytes' decision tree `dQuantizeNF4` (csrc/kernels.cu), ascending: a value
# strictly above threshold k takes a level above k.
BNB_THRESHOLDS = np.array([
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011], dtype=np.float32)


def ref_quantize(w):
    """NumPy port: blocks of 64 along the last axis, x / absmax, index = thresholds below x."""
    w = np.asarray(w, np.float32)
    *lead, o = w.shape
    nb = -(-o // 64)
    x = np.zeros((*lead, nb * 64), np.float32)
    x[..., :o] = w
    x = x.reshape(*lead, nb, 64)
    absmax = np.abs(x).max(-1)
    scaled = x / np.where(absmax == 0, np.float32(1), absmax)[..., None]
    idx = (scaled[..., None] > BNB_THRESHOLDS).sum(-1).astype(np.uint8).reshape(*lead, nb * 64)
    return idx[..., 0::2] | (idx[..., 1::2] << 4), absmax


def ref_dequantize(codes, absmax, o):
    idx = np.empty((*codes.shape[:-1], codes.shape[-1] * 2), np.uint8)
    idx[..., 0::2], idx[..., 1::2] = codes & 15, codes >> 4
    vals = BNB_NF4[idx].reshape(*absmax.shape, 64) * absmax[..., None]
    return vals.reshape(idx.shape)[..., :o]


def special_rows(o):
    """Rows [8, o] with an all-zero block, exact levels, bitsandbytes' thresholds (ties) and the
    floats just above and below them, each scaled by a power of two (x / absmax stays exact)."""
    rng = np.random.default_rng(1)
    thr = np.concatenate([BNB_THRESHOLDS, np.nextafter(BNB_THRESHOLDS, np.float32(2)),
                          np.nextafter(BNB_THRESHOLDS, np.float32(-2)), BNB_NF4, -BNB_NF4])
    rows = []
    for scale in (1.0, 0.25, 8.0):
        r = np.resize(rng.permutation(thr), o) * np.float32(scale)
        r[::NF4_BLOCK] = scale  # every block's absmax is the power of two
        rows.append(r)
    rows.append(np.zeros(o, np.float32))
    rows += [np.where(np.arange(o) < 64, 0.0, r) for r in rows[:3]]  # first block all zero
    rows.append(-rows[0])
    return np.stack(rows).astype(np.float32)


def test_code_table():
    assert NF4_CODE.dtype == np.float32 and NF4_CODE.shape == (16,)
    np.testing.assert_array_equal(NF4_CODE, BNB_NF4)
    assert (NF4_CODE[0], NF4_CODE[7], NF4_CODE[15]) == (-1.0, 0.0, 1.0)
    assert np.all(np.diff(NF4_CODE) > 0)
    # bitsandbytes' thresholds are the float32 midpoints of the levels.
    np.testing.assert_array_equal((BNB_NF4[:-1] + BNB_NF4[1:]) / np.float32(2), BNB_THRESHOLDS)


@pytest.mark.parametrize("shape", [(3, 64), (5, 100), (2, 3, 130), (1, 1), (4, 192), (7, 63), (65,)])
def test_matches_numpy_port(shape):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, shape[:-1] + (1,))).astype(np.float32)
    q = nf4_quantize(jnp.asarray(w))
    codes, absmax = ref_quantize(w)
    assert q.codes.dtype == jnp.uint8 and q.absmax.dtype == jnp.float32 and q.width == shape[-1]
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.absmax, absmax)
    np.testing.assert_array_equal(nf4_dequantize(q, jnp.float32), ref_dequantize(codes, absmax, shape[-1]))
    bf = nf4_dequantize(q, jnp.bfloat16)
    assert bf.dtype == jnp.bfloat16 and bf.shape == shape
    np.testing.assert_array_equal(bf, ref_dequantize(codes, absmax, shape[-1]).astype(jnp.bfloat16))


@pytest.mark.parametrize("o", [64, 200])
def test_special_values(o):
    w = special_rows(o)
    q = nf4_quantize(jnp.asarray(w))
    codes, absmax = ref_quantize(w)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.absmax, absmax)
    deq = np.asarray(nf4_dequantize(q))
    assert np.all(np.isfinite(deq))
    np.testing.assert_array_equal(deq[3], 0.0)  # the all-zero row
    np.testing.assert_array_equal(deq[4:7, :64], 0.0)  # all-zero first blocks
    # Exact levels come back exactly; a threshold takes the level below it, the next float above it
    # the level above (bitsandbytes' `x > threshold`).
    for r, scale in zip(range(3), (1.0, 0.25, 8.0)):
        x = w[r] / np.float32(scale)
        lvl = np.isin(x, BNB_NF4)
        np.testing.assert_array_equal(deq[r][lvl], w[r][lvl])
        k = np.searchsorted(BNB_THRESHOLDS, x)
        on = np.isin(x, BNB_THRESHOLDS)
        assert on.any() and lvl.any()
        np.testing.assert_array_equal(deq[r][on], BNB_NF4[k[on]] * np.float32(scale))
        above = np.isin(x, np.nextafter(BNB_THRESHOLDS, np.float32(2)))
        np.testing.assert_array_equal(deq[r][above], BNB_NF4[k[above]] * np.float32(scale))


def test_round_trip_error_bound():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((4, 6, 300)) * np.exp(rng.uniform(-4, 4, (4, 6, 1)))).astype(np.float32)
    w[0, 0, 17] = 50.0  # an outlier block
    q = nf4_quantize(jnp.asarray(w))
    err = np.abs(w - np.asarray(nf4_dequantize(q)))
    amax = np.repeat(np.asarray(q.absmax), 64, axis=-1)[..., :300]
    half_gap = np.diff(BNB_NF4.astype(np.float64)).max() / 2
    # Slack: float32 rounding of x / absmax, the midpoint and code * absmax, a few ulps of absmax.
    assert np.all(err <= amax * (half_gap + 4 * np.finfo(np.float32).eps))
    # Each value's level is a nearest one (up to the same rounding).
    dist = np.abs(w[..., None] / amax[..., None] - BNB_NF4)
    assert np.all(err / amax <= dist.min(-1) + 4 * np.finfo(np.float32).eps)


def test_jit_and_shard_map_match_unsharded(devices):
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((4, 8, 100)), jnp.bfloat16)  # [E, I, O], O not a multiple of 64
    ref = nf4_quantize(w)
    ref_deq = nf4_dequantize(ref, jnp.bfloat16)

    traces = []

    def round_trip(w):
        traces.append(1)
        q = nf4_quantize(w)
        return q, nf4_dequantize(q, jnp.bfloat16)

    q, deq = jax.jit(round_trip)(w)
    jax.jit(round_trip)(w + 1)
    assert len(traces) == 1 and isinstance(q, NF4) and q.width == 100
    for a, b in zip(jax.tree.leaves((q, deq)), jax.tree.leaves((ref, ref_deq))):
        np.testing.assert_array_equal(a, b)

    mesh = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Explicit,), devices=devices[:2])
    ws = jax.device_put(w, NamedSharding(mesh, P("expert")))
    local = jax.shard_map(round_trip, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    q2, deq2 = jax.jit(local)(ws)
    assert q2.width == 100 and {s.data.shape for s in q2.codes.addressable_shards} == {(2, 8, 64)}
    for a, b in zip(jax.tree.leaves((q2, deq2)), jax.tree.leaves((ref, ref_deq))):
        np.testing.assert_array_equal(a, b)
    # A sharded NF4 pytree as an argument: dequantized per shard equals the unsharded result.
    deq3 = jax.jit(jax.shard_map(lambda q: nf4_dequantize(q, jnp.float32), mesh=mesh, in_specs=P("expert"),
                                 out_specs=P("expert")))(q2)
    np.testing.assert_array_equal(deq3, nf4_dequantize(ref, jnp.float32))


def test_bytes():
    assert nf4_bytes((1024, 1024)) == 1024 * 1024 // 2 + 1024 * 1024 // 64 * 4
    for shape in [(1024, 1024), (3, 5, 100), (7, 1), (65,)]:
        q = jax.eval_shape(nf4_quantize, jax.ShapeDtypeStruct(shape, jnp.float32))
        assert nf4_bytes(shape) == q.codes.size * 1 + q.absmax.size * 4
        assert q.codes.shape == shape[:-1] + (-(-shape[-1] // 64) * 32,)


def test_errors():
    with pytest.raises(ValueError, match="scalar"):
        nf4_quantize(jnp.float32(1.0))
    q = nf4_quantize(jnp.ones((2, 100)))
    with pytest.raises(ValueError, match="disagree"):
        nf4_dequantize(NF4(q.codes, q.absmax, 200))
