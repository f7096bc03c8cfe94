"""moe.exchange=hierarchical: node-limited routing's two-hop expert exchange on 8 virtual CPU
devices, the expert axis split into hosts x GPUs by moe.gpus_per_host."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.config import ConfigError, MoEConfig, load_config
from moefast.parallel import MESH_AXES, moe_ffn
from moefast.parallel.hlo import HloModule

E, K, F = 8, 2, 24


def mesh_of(data, expert):
    return jax.make_mesh((data, 1, expert, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)


def case(d=16, seed=3, scale=0.2):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (8, 16, d))
    mask = jnp.ones((8, 16), bool).at[3, 9:].set(False)
    w = (jax.random.normal(k[1], (d, E)), jax.random.normal(k[2], (E, d, 2 * F)) * scale,
         jax.random.normal(k[3], (E, F, d)) * scale)
    return x, mask, w


def run(mesh, x, mask, w, dtype=jnp.float32, hlo=False, **moe):
    spec = MoEConfig(num_experts=E, top_k=K, min_capacity=1, **moe)

    def loss(x, router, w_in, w_out):
        y, s = moe_ffn(x, mask, router, w_in, w_out, spec, dtype=dtype)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))) + s.aux_loss + 0.1 * s.z_loss, (y, s)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    with jax.set_mesh(mesh):
        out = f(x, *w)
        return (out, f.lower(x, *w).as_text(dialect="hlo")) if hlo else out


# (data, expert, gpus_per_host, chunks, routing): 2 hosts x 2 GPUs with one group per host and one
# host per token (node-limited, sigmoid, DeepSeek-V3's group score), the tokens in two slices
# (moe.overlap_chunks=2); 4 hosts x 2 with 4 groups, 2 per token, one slice
CASES = [(2, 4, 2, 2, dict(num_groups=2, topk_groups=1, score_func="sigmoid")),
         (1, 8, 2, 1, dict(num_groups=4, topk_groups=2))]


@pytest.mark.parametrize("data, expert, per_host, chunks, routing", CASES, ids=["2x2-hosts-2-slices", "4x2-hosts"])
def test_equals_the_flat_exchange_when_nothing_drops(data, expert, per_host, chunks, routing, devices):
    """Capacity factor 8 (no hop drops anything): routing statistics and losses bitwise those of
    the flat exchange (same routing), outputs and gradients to float rounding (each host's partial
    sum is taken first: a different order of float32 sums), with the tokens in one slice or two.
    The exchange's all-to-alls run over groups of the ranks sharing a GPU index (between hosts) and
    of each host's ranks, each slice its own."""
    x, mask, w = case()
    mesh = mesh_of(data, expert)
    (ref_loss, (ref_y, ref_s)), ref_g = run(mesh, x, mask, w, capacity_factor=8.0, **routing)
    ((loss, (y, s)), g), hlo = run(mesh, x, mask, w, hlo=True, capacity_factor=8.0, exchange="hierarchical",
                                   gpus_per_host=per_host, overlap_chunks=chunks, **routing)
    # per slice 5 forward (metadata, rows and their return on each hop) and their 5 transposes
    assert len(re.findall(r"all-to-all\(", hlo)) == 10 * chunks
    assert float(s.dropped_fraction) == 0.0 == float(ref_s.dropped_fraction)
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(ref_s)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-6)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)
    # the exchange's all-to-alls (not the flat exchange's one group of the whole axis)
    sizes = {len(g.split(",")) for g in re.findall(r"all-to-all\([^\n]*?replica_groups=\{((?:\{[\d,]+\},?)+)\}", hlo)
             for g in re.findall(r"\{([\d,]+)\}", g)}
    assert sizes == {expert // per_host, per_host}, sizes


def test_drops_per_hop_and_counts_them(devices):
    """Capacity factor 1 on 2 hosts x 2: some assignments drop on one hop or the other; the
    dropped fraction is what the two hops dropped over the global batch, a dropped assignment
    contributes exactly nothing (tokens with every assignment dropped get 0), and the layer's
    routing statistics are the flat exchange's (routing itself drops nothing)."""
    x, mask, w = case()
    mesh = mesh_of(2, 4)
    (_, (y, s)), _ = run(mesh, x, mask, w, capacity_factor=1.0, exchange="hierarchical", gpus_per_host=2)
    (_, (_, ref)), _ = run(mesh, x, mask, w, capacity_factor=1.0)
    assert 0.0 < float(s.dropped_fraction) < 0.5
    np.testing.assert_array_equal(np.asarray(s.tokens_per_expert), np.asarray(ref.tokens_per_expert))
    assert float(jnp.max(jnp.abs(y[3, 9:]))) == 0.0  # padding: never routed


def test_fp8_dispatch_over_both_hops(devices):
    """moe.dispatch_dtype=float8_e4m3fn with the hierarchical exchange: rows quantized once at the
    source travel both hops as e4m3 with their float32 scales in the same uint8 row (one all-to-all
    per hop, besides the one of the routing metadata); outputs within 2^-4 of the largest
    output of the bf16-free reference, gradients with cosine similarity > 0.99."""
    x, mask, w = case(d=128, seed=4, scale=0.1)  # outputs of order 1: sin(y) stays smooth in y
    mesh = mesh_of(2, 4)
    kw = dict(capacity_factor=8.0, exchange="hierarchical", gpus_per_host=2)
    (_, (ref_y, _)), ref_g = run(mesh, x, mask, w, **kw)
    ((_, (y, _)), g), hlo = run(mesh, x, mask, w, hlo=True, dispatch_dtype="float8_e4m3fn", **kw)
    err = float(jnp.max(jnp.abs(y - ref_y)))
    assert 0 < err <= 2.0**-4 * float(jnp.max(jnp.abs(ref_y)))
    for a, b in zip(g, ref_g):
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99
    a2a = [c for c in HloModule(hlo).collectives() if c.kind == "all-to-all"]
    packed = [c for c in a2a if c.shape.startswith("u8") and c.shape.split("]")[0].endswith(f",{128 + 4}")]
    assert len(packed) == 2, [c.shape for c in a2a]  # one per hop, forward only
    assert sum(c.shape.startswith(f"f32[2,16,{2 * K}]") for c in a2a) == 2  # routing metadata: forward, gates back


def test_bad_input(devices):
    x, mask, w = case()
    for overrides, match in (
            (["moe.exchange=hierarchical", "moe.capacity_factor=0"], "own two capacities"),
            (["moe.gpus_per_host=0"], "moe.gpus_per_host")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
    for mesh, moe, match in (
            (mesh_of(2, 4), dict(gpus_per_host=4), "span several whole hosts"),  # one host
            (mesh_of(2, 4), dict(gpus_per_host=3), "span several whole hosts"),  # 4 not a multiple of 3
            (mesh_of(1, 8), dict(gpus_per_host=2, num_groups=2, topk_groups=1), "not aligned with the 4 hosts"),
            (mesh_of(2, 4), dict(gpus_per_host=2, overlap_chunks=3), "a number of chunks that divides 16")):
        spec = MoEConfig(num_experts=E, top_k=K, exchange="hierarchical", **moe)
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda x, w: moe_ffn(x, mask, *w, spec)[0], x, w)


def test_trainer_refuses_slices_that_do_not_divide_the_tokens(tmp_path, devices):
    """moe.overlap_chunks with the hierarchical exchange must divide each device's tokens per
    micro-batch (8 rows x 16 tokens over 8 devices: 16): the Trainer says so before compiling or
    writing anything."""
    from moefast.train import Trainer

    cfg = load_config(None, ["model.d_model=32", "model.num_heads=2", "model.head_dim=16", "model.d_ff=32",
                             "moe.num_experts=8", "data.seq_len=16", "data.batch_size=8", "mesh.data=2",
                             "mesh.expert=4", "moe.exchange=hierarchical", "moe.gpus_per_host=2",
                             "moe.overlap_chunks=3"])
    with pytest.raises(ConfigError, match="use a number of chunks that divides 16"):
        Trainer(cfg, tmp_path / "run", log=None, progress=False, devices=jax.devices()[:8])
    assert not (tmp_path / "run").exists()
