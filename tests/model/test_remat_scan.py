"""Rematerialisation policies (bitwise equal to none, exchange not re-run by "minimal") and scan over
layers (same init, outputs and gradients as unrolled; layout conversion both ways)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast import parallel
from moefast.parallel import hlo as hlo_lib
from moefast.config import load_config
from moefast.data import ByteTokenizer
from moefast.model.layout import layer_layout, to_layout
from moefast.train import ModelDef, generate
from moefast.train.step import loss_and_grads

BASE = ["model.d_model=64", "model.num_heads=4", "model.head_dim=16", "model.d_ff=64", "model.max_seq_len=64",
        "data.seq_len=32", "data.batch_size=16", "moe.num_experts=8", "moe.top_k=2", "model.num_layers=2"]
STEP = jnp.asarray(1, jnp.int32)


def batch(b=16, t=32, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, t)).astype(np.int32)
    seg = np.ones((b, t), np.int32)
    seg[:, t - 5:] = 0  # padding
    seg[1] = np.where(np.arange(t) < t // 2, 1, 2)  # two packed documents
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    return {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(np.roll(tokens, -1, 1)),
            "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos),
            "loss_weight": jnp.asarray((seg != 0).astype(np.float32))}


def grads(*overrides, mesh_overrides=(), params=None, hlo=False):
    """(loss, (ce, aux, z), grads) of one step of a fresh model (or ``params``), and optionally the
    compiled step's HLO text."""
    cfg = load_config(None, [*BASE, *mesh_overrides, *overrides])
    md = ModelDef(cfg, 259)
    state = md.init_state(0)
    params = state["params"] if params is None else params
    fn = jax.jit(lambda p, r, b, k: loss_and_grads(md, p, r, b, k, STEP))
    args = (params, state["routing"], batch(), jax.random.key(7))
    mesh = parallel.make_mesh(cfg) if mesh_overrides else None
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        compiled = fn.lower(*args).compile()  # compiled once: run and read its HLO
        loss, terms, g = compiled(*args)
        text = compiled.as_text() if hlo else None
    out = (loss, terms[:3], g)
    return (out, text) if hlo else out


def all_to_alls(hlo: str) -> int:
    """The expert exchange's all-to-alls (issued in the shard_map; the partitioner's own aside)."""
    return sum(c.kind == "all-to-all" and "shard_map" in c.op_name for c in hlo_lib.collectives(hlo))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_close(a, b, atol=2e-6, rtol=2e-5):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


STATEFUL = ["model.dropout=0.1", "moe.warmup_steps=4"]  # dropout and warm-up keys inside the remat


@pytest.mark.parametrize("mesh_overrides", [(), ("mesh.data=2", "mesh.expert=4")], ids=["1-device", "data2-expert4"])
def test_remat_policies_are_bitwise_equal_to_none(mesh_overrides):
    """Every policy gives the same losses and gradients as no remat, bit for bit (fp32, CPU);
    "minimal" leaves the all-to-alls as they are, "full" and "save_dots" re-run the forward
    exchange in the backward pass."""
    ov = [*STATEFUL, "model.num_layers=1"]
    ref, ref_hlo = grads(*ov, "model.remat=none", mesh_overrides=mesh_overrides, hlo=True)
    counts = {}
    # every policy on the mesh (shard_map path); on one device the two that recompute most and least
    policies = ("full", "save_dots", "save_dots_no_batch", "minimal") if mesh_overrides else ("full", "minimal")
    for policy in policies:
        out, hlo = grads(*ov, f"model.remat={policy}", mesh_overrides=mesh_overrides, hlo=True)
        assert_trees_equal(out, ref)
        counts[policy] = all_to_alls(hlo)
    if mesh_overrides:  # expert axis 4: 2 forward + 2 backward exchanges without remat
        assert all_to_alls(ref_hlo) > 0
        assert counts["minimal"] == all_to_alls(ref_hlo)
        assert counts["full"] > all_to_alls(ref_hlo) and counts["save_dots"] > all_to_alls(ref_hlo)
        assert counts["full"] == 1.5 * all_to_alls(ref_hlo)  # the forward pair runs again


def test_remat_lowers_temporary_memory():
    """XLA's memory_analysis of the compiled step, with scanned layers (unrolled, XLA:CPU's scheduler
    runs most recomputation early and saves little: docs/perf.md)."""
    cfg = ["model.num_layers=3", "model.d_model=128", "model.d_ff=256", "data.seq_len=64", "model.max_seq_len=64",
           "model.scan_layers=true"]

    def temp(policy):
        c = load_config(None, [*BASE, *cfg, f"model.remat={policy}"])
        md = ModelDef(c, 259)
        abstract = md.abstract_state()
        b = jax.tree.map(lambda a: jax.ShapeDtypeStruct((16, 64), a.dtype), batch())
        fn = jax.jit(lambda p, r, b: loss_and_grads(md, p, r, b, None, STEP))
        return fn.lower(abstract["params"], abstract["routing"], b).compile().memory_analysis().temp_size_in_bytes

    none, full, minimal = temp("none"), temp("full"), temp("minimal")
    assert full < 0.5 * none, (full, none)
    assert minimal < none, (minimal, none)


PATTERNS = [[], ["model.num_layers=4", "model.num_dense_layers=1", "model.moe_every=2"]]  # prefix, 1 group, tail


@pytest.mark.parametrize("pattern", PATTERNS, ids=["all-moe", "dense-prefix-groups-tail"])
def test_scanned_layers_match_unrolled(pattern):
    """Same initial parameters (the scanned ones are the unrolled ones stacked), same losses and
    gradients to fp32 rounding, MoE statistics and routing-state rows in [L_moe, ...] order."""
    unrolled_def = ModelDef(load_config(None, [*BASE, *pattern]), 259)
    scanned_def = ModelDef(load_config(None, [*BASE, *pattern, "model.scan_layers=true"]), 259)
    p_unrolled = unrolled_def.init_params(0)
    p_scanned = scanned_def.init_params(0)
    assert_trees_equal(to_layout(p_unrolled, scanned_def.cfg.model, True), p_scanned)
    assert_trees_equal(to_layout(p_scanned, unrolled_def.cfg.model, False), p_unrolled)
    n_moe = sum(unrolled_def.cfg.model.is_moe_layer(i) for i in range(unrolled_def.cfg.model.num_layers))
    routing = {"bias": jnp.asarray(np.random.default_rng(0).normal(size=(n_moe, 8)) * 0.1, jnp.float32),
               "load_ema": jnp.full((n_moe, 8), 1 / 8, jnp.float32)}
    outs = [jax.jit(lambda p, md=md: md.module(p)(batch()["tokens"], routing_state=routing,
                                                   step_key=jax.random.key(1)))(p)
            for md, p in ((unrolled_def, p_unrolled), (scanned_def, p_scanned))]
    np.testing.assert_allclose(np.asarray(outs[0].logits), np.asarray(outs[1].logits), atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(outs[0].moe.tokens_per_expert), np.asarray(outs[1].moe.tokens_per_expert))
    assert outs[1].moe.tokens_per_expert.shape == (n_moe, 8)
    assert_trees_close(outs[0].moe, outs[1].moe)

    pattern_ov = [*pattern, *STATEFUL]
    ref = grads(*pattern_ov)
    out = grads(*pattern_ov, "model.scan_layers=true")
    assert_trees_close(out[:2], ref[:2])
    assert_trees_close(to_layout(out[2], unrolled_def.cfg.model, False), ref[2], atol=1e-6, rtol=1e-4)


def test_scan_with_remat_on_an_expert_mesh():
    ov = ["model.num_layers=2", *STATEFUL]
    mesh = ("mesh.data=2", "mesh.expert=4")
    ref = grads(*ov, mesh_overrides=mesh)
    out = grads(*ov, "model.scan_layers=true", "model.remat=minimal", mesh_overrides=mesh)
    md = ModelDef(load_config(None, [*BASE, *ov]), 259)
    assert_trees_close(out[:2], ref[:2])
    assert_trees_close(to_layout(out[2], md.cfg.model, False), ref[2], atol=1e-6, rtol=1e-4)


def test_generation_with_a_scanned_model_equals_unrolled():
    tok = ByteTokenizer()
    cfgs = [load_config(None, [*BASE, "model.num_layers=3", "model.moe_every=2", *ov]) for ov in ([], ["model.scan_layers=true"])]
    defs = [ModelDef(c, tok.vocab_size) for c in cfgs]
    params = [d.init_params(0) for d in defs]
    (t0, l0), (t1, l1) = [generate(d, p, tok, "def f(x):", max_new_tokens=12, temperature=0.0, return_logits=True)
                          for d, p in zip(defs, params)]
    assert t0 == t1
    np.testing.assert_allclose(np.asarray(l0), np.asarray(l1), atol=2e-5, rtol=1e-5)


def test_layout_of_every_pattern_covers_each_layer_once():
    for layers in range(1, 9):
        for dense in range(0, layers + 1):
            for every in (1, 2, 3):
                m = load_config(None, [f"model.num_layers={layers}", f"model.num_dense_layers={dense}",
                                       f"model.moe_every={every}"]).model
                lay = layer_layout(m)
                ids = [*lay.prefix, *(i for g in lay.groups for i in g), *lay.tail]
                assert sorted(ids) == list(range(layers))
                assert all(not m.is_moe_layer(i) for i in lay.prefix)
                for j, g in enumerate(lay.groups):  # a stack holds one kind of block
                    assert {m.is_moe_layer(i) for i in g} == {j == 0}
                assert len(lay.tail) < every


def test_weight_decay_skips_the_same_parameters_in_both_layouts():
    """Norm scales stacked to [L, D] are still vectors: with zero gradients the AdamW update is
    -lr * weight_decay * p on matrices only, identical in both layouts."""
    import optax

    from moefast.train.step import make_optimizer

    cfgs = [load_config(None, [*BASE, "model.num_layers=3", "model.moe_every=2", "train.warmup_steps=0", *ov])
            for ov in ([], ["model.scan_layers=true"])]
    updates = []
    for cfg in cfgs:
        params = ModelDef(cfg, 259).init_params(0)
        tx = make_optimizer(cfg)
        update = jax.jit(lambda p, tx=tx: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0])
        updates.append(update(params))
    assert_trees_equal(to_layout(updates[0], cfgs[1].model, True), updates[1])
    flat = dict(jax.tree_util.tree_leaves_with_path(updates[1]))
    norms = [v for k, v in flat.items() if "scale" in jax.tree_util.keystr(k)]
    assert norms and all(float(jnp.abs(v).max()) == 0.0 for v in norms)
    assert float(optax.tree_utils.tree_norm(updates[1])) > 0
