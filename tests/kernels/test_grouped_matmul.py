"""The grouped matmul: every implementation equals the dense reference, forward and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from moefast.kernels.grouped_matmul import IMPLS, grouped_matmul, grouped_matmul_reference, resolve

TILE, GRANULE = 8, 4  # small tiles so the tests cover full tiles, partial pieces and empty groups
TOL = dict(rtol=2e-5, atol=2e-5)  # float32, sums of <= 64 products


def _inputs(sizes, n, i=12, o=10, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), i, o)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((n, o)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


def _value_and_vjp(fn, x, w, gs, dy):
    """y and the vjp's (dx, dw), compiled as one program (not dispatched op by op: CI time)."""
    def f(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, gs), x, w)
        return (y, *vjp(dy))
    return jax.jit(f)(x, w, gs, dy)


def _check(impl, sizes, n, **kw):
    x, w, gs, dy = _inputs(sizes, n)
    fast = jax.jit(functools.partial(grouped_matmul, impl=impl, **kw))
    got = _value_and_vjp(lambda x, w, gs: fast(x, w, gs), x, w, gs, dy)
    want = _value_and_vjp(grouped_matmul_reference, x, w, gs, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=f"{impl} {name} sizes={sizes}", **TOL)
    rest = int(np.sum(sizes))
    assert not np.any(np.asarray(got[0][rest:])), "rows after the last group must be 0"
    assert not np.any(np.asarray(got[1][rest:])), "rows after the last group get no gradient"


# Group sizes around the tile (0, 1, tile-1, tile, tile+1, several tiles), every row to one group,
# and groups that leave rows unused at the end.
AWKWARD = [
    ([0, 1, TILE - 1, TILE, TILE + 1, 2 * TILE + 3], 6 * TILE),
    ([5 * TILE + 2, 0, 0], 5 * TILE + 2),
    ([0, 0, 41], 41),
    ([3, 0, 2, 0], 20),
    ([0, 0], 7),
    ([1], 1),
]


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("sizes,n", AWKWARD, ids=lambda v: str(v))
def test_equals_dense_reference(impl, sizes, n):
    _check(impl, sizes, n, tile_rows=TILE, granule_rows=GRANULE)


@pytest.mark.parametrize("sizes", [[0, 1, 127, 128, 129, 511, 512, 513], [1500, 0, 4]], ids=str)
def test_default_tiles_equal_dense_reference(sizes):
    _check("tiled", sizes, int(np.sum(sizes)) + 3)


@settings(max_examples=8, deadline=None)  # each example compiles; the edge cases are the tests above
@given(st.lists(st.integers(0, 3 * TILE + 1), min_size=1, max_size=5), st.integers(0, 5),
       st.sampled_from([(TILE, GRANULE), (TILE, 1), (TILE, TILE)]))
def test_random_group_sizes(sizes, spare, tiles):
    if sum(sizes) + spare == 0:
        spare = 1
    _check("tiled", sizes, sum(sizes) + spare, tile_rows=tiles[0], granule_rows=tiles[1])


def test_traced_group_sizes_one_compilation():
    traces = []

    @jax.jit
    def f(x, w, gs):
        traces.append(1)
        return grouped_matmul(x, w, gs, impl="tiled", tile_rows=TILE, granule_rows=GRANULE)

    for sizes in ([10, 0, 6], [0, 16, 0], [1, 2, 3]):
        x, w, gs, _ = _inputs(sizes, 16)
        np.testing.assert_allclose(f(x, w, gs), grouped_matmul_reference(x, w, gs), **TOL)
    assert len(traces) == 1


def test_bfloat16_keeps_dtype_and_is_close():
    x, w, gs, _ = _inputs([9, 0, 13], 24)
    y = grouped_matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs, impl="tiled", tile_rows=TILE,
                       granule_rows=GRANULE)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), grouped_matmul_reference(x, w, gs), rtol=0.05, atol=0.15)


def test_under_shard_map_with_an_expert_axis(devices):
    """Each device holds its own rows and two local experts: the grouped matmul inside shard_map
    equals the reference per device, forward and gradients."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(3)
    n, i, o, local = 3 * TILE + 1, 6, 5, 2
    sizes = np.array([[0, 0], [1, TILE], [TILE - 1, TILE + 1], [n, 0], [0, n], [TILE, TILE], [2, 3], [0, 1]],
                     np.int32)
    x = jnp.asarray(rng.standard_normal((8 * n, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8 * local, i, o)), jnp.float32)
    gs = jnp.asarray(sizes.reshape(-1))

    def loss(fn, x, w):
        def per_device(x, w, gs):
            return jnp.sum(jnp.sin(fn(x, w, gs)))[None]
        return jnp.sum(jax.shard_map(per_device, mesh=mesh, in_specs=(P("expert"),) * 3,
                                     out_specs=P("expert"))(x, w, gs))

    tiled = functools.partial(grouped_matmul, impl="tiled", tile_rows=TILE, granule_rows=GRANULE)
    got = jax.jit(jax.value_and_grad(functools.partial(loss, tiled), argnums=(0, 1)))(x, w)
    want = jax.value_and_grad(functools.partial(loss, grouped_matmul_reference), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_auto_is_tiled_on_cpu_pallas_on_gpu_ragged_dot_on_tpu():
    assert resolve("auto", "cpu") == "tiled"
    assert resolve("auto", "gpu") == "pallas" and resolve("auto", "tpu") == "ragged_dot"
    assert resolve("auto") == "tiled"  # the tests run on CPU
    assert set(IMPLS) == {"auto", "pallas", "ragged_dot", "tiled"}


# The Pallas kernel in the interpreter, 16-row tiles: groups of 0, 1, 15, 16, 17 and 3 tiles + 3 rows
# (boundaries inside and on tile edges), N not a multiple of the tile and rows after the last group;
# feature sizes that are not multiples of 16 (zero-padded for Triton's dot).
PALLAS_CASES = [([0, 1, 15, 16, 17, 51], 103, 32, 48), ([40, 0, 0], 40, 12, 10)]


@pytest.mark.parametrize("sizes,n,i,o", PALLAS_CASES, ids=str)
def test_pallas_kernel_equals_dense_reference(sizes, n, i, o):
    """Forward, dx (the transposed weight read) and dw (per expert; empty experts exactly 0)."""
    from moefast.kernels.grouped_matmul.pallas import grouped_matmul_pallas

    x, w, gs, dy = _inputs(sizes, n, i=i, o=o)
    got = _value_and_vjp(functools.partial(grouped_matmul_pallas, tile_rows=16), x, w, gs, dy)
    want = _value_and_vjp(grouped_matmul_reference, x, w, gs, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=f"pallas {name} sizes={sizes}", rtol=1e-5,
                                   atol=1e-4)
    rest = int(np.sum(sizes))
    assert not np.any(np.asarray(got[0][rest:])) and not np.any(np.asarray(got[1][rest:]))
    for e in np.flatnonzero(np.asarray(sizes) == 0):
        assert not np.any(np.asarray(got[2][e])), "an expert without rows gets a zero gradient"


def test_pallas_tile_table_and_tile_choice():
    """Each (row tile, expert) pair once, in order, covering exactly the experts' rows; the tile is the
    largest whose worst case wastes <= 10 % of the rows."""
    from moefast.kernels.grouped_matmul.pallas import table_pairs, tile_rows_for, tile_table

    sizes = np.array([0, 1, 15, 16, 17, 51, 0])
    table = np.asarray(tile_table(jnp.asarray(sizes, jnp.int32), 112, 16))
    assert table.shape == (4, table_pairs(112, 7, 16)) == (4, 13)
    used = table[:, table[0] >= 0]
    rows = np.concatenate([np.arange(lo, hi) for lo, hi in used[2:].T])
    assert np.array_equal(rows, np.arange(sizes.sum()))  # every real row once, in order
    assert np.array_equal(used[0], np.repeat(np.arange(7), [0, 1, 1, 1, 2, 4, 0]))
    assert np.all(used[1] % 16 == 0) and np.all((used[2] >= used[1]) & (used[3] <= used[1] + 16))
    assert tile_rows_for(4096, 8) == 32 and tile_rows_for(32768, 8) == 128 and tile_rows_for(512, 8) == 16


def test_bad_arguments_raise_clear_errors():
    x, w, gs, _ = _inputs([2, 2], 4)
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(x, w, gs, impl="dense")
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="same 'in'"):
        grouped_matmul(x[:, :3], w, gs)
    with pytest.raises(ValueError, match="multiple of granule_rows"):
        grouped_matmul(x, w, gs, impl="tiled", tile_rows=6, granule_rows=4)
    for impl in IMPLS:  # every implementation rejects alike
        with pytest.raises(ValueError, match="one float dtype"):
            grouped_matmul(x, w.astype(jnp.bfloat16), gs, impl=impl)
        with pytest.raises(ValueError, match="one float dtype"):
            grouped_matmul(x.astype(jnp.int32), w.astype(jnp.int32), gs, impl=impl)
        with pytest.raises(ValueError, match="at least one row and one group"):
            grouped_matmul(x[:0], w, gs, impl=impl)
