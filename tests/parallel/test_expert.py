"""Expert parallelism: the sharded MoE layer and train step equal the single-device reference; the
chunked expert exchange (the overlap lever) equals the unchunked one bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moefast.config import ConfigError, load_config
from moefast.config import MoEConfig
from moefast.parallel import MESH_AXES, make_mesh, moe_ffn
from moefast.parallel.expert import exchange_capacity
from moefast.parallel.hlo import HloModule, collectives, format_collectives
from moefast.train import ModelDef
from moefast.train.step import loss_fn

MESHES = [  # (data, fsdp, expert)
    (1, 1, 8), (2, 1, 4), (4, 1, 2), (8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 8, 1),
]
E, K, D, F = 8, 2, 16, 24


def mesh_of(data, fsdp, expert):
    return jax.make_mesh((data, fsdp, expert, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)


def weights(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], (D, E)), jax.random.normal(k[1], (E, D, 2 * F)) * 0.2,
            jax.random.normal(k[2], (E, F, D)) * 0.2)


def inputs(seed=1, batch=8, t=6):
    x = jax.random.normal(jax.random.key(seed), (batch, t, D))
    mask = jnp.ones((batch, t), bool).at[3, 4:].set(False)  # a little padding
    return x, mask


def layer_loss(x, mask, router, w_in, w_out, *, drop_tokens, capacity_factor=1.0):
    spec = MoEConfig(num_experts=E, top_k=K, capacity_factor=capacity_factor, min_capacity=1)
    y, s = moe_ffn(x, mask, router, w_in, w_out, spec, drop_tokens=drop_tokens)
    loss = jnp.sum(jnp.sin(y)) + s.aux_loss + 0.1 * s.z_loss
    return loss, (y, s)


grad_all = jax.value_and_grad(layer_loss, argnums=(0, 2, 3, 4), has_aux=True)


# The single-device references, jitted once for the module (same shapes in every mesh case: one
# compile each, and the drops reference's eight one-row groups are one program, not op-by-op dispatch).
reference_no_drops = jax.jit(functools.partial(grad_all, drop_tokens=False))
reference_with_drops = jax.jit(lambda *a: layer_loss(*a, drop_tokens=True)[1])


def run_on_mesh(mesh, fn, *args):
    with jax.set_mesh(mesh):
        return jax.jit(fn)(*args)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_layer_equals_single_device_reference(shape, devices):
    """No drops (capacity = tokens): outputs, losses, counts and gradients match exactly-ish."""
    x, mask = inputs()
    w = weights()
    fn = functools.partial(grad_all, drop_tokens=False)
    (ref_loss, (ref_y, ref_s)), ref_g = reference_no_drops(x, mask, *w)
    (loss, (y, s)), g = run_on_mesh(mesh_of(*shape), fn, x, mask, *w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(s.tokens_per_expert), np.asarray(ref_s.tokens_per_expert))
    np.testing.assert_allclose(float(s.aux_loss), float(ref_s.aux_loss), rtol=1e-6)
    np.testing.assert_allclose(float(s.z_loss), float(ref_s.z_loss), rtol=1e-6)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_layer_with_drops_equals_per_device_group_reference(shape, devices):
    """With capacity dropping, each device is one routing group: compare with the reference run on
    each group's tokens separately."""
    x, mask = inputs(batch=8, t=12)
    w = weights(2)
    sharded_y, sharded_s = run_on_mesh(mesh_of(*shape), lambda *a: layer_loss(*a, drop_tokens=True)[1], x, mask, *w)
    groups = 8  # one batch row per device
    ref = [reference_with_drops(x[i:i + 1], mask[i:i + 1], *w) for i in range(groups)]
    np.testing.assert_allclose(np.asarray(sharded_y), np.concatenate([np.asarray(r[0]) for r in ref]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(sharded_s.tokens_per_expert),
                                  np.sum([np.asarray(r[1].tokens_per_expert) for r in ref], axis=0))
    assert float(sharded_s.dropped_fraction) > 0  # the test exercises dropping


def test_expert_axis_size_one_issues_no_all_to_all(devices):
    x, mask = inputs()
    w = weights()
    f = lambda *a: layer_loss(*a, drop_tokens=True)[0]
    with jax.set_mesh(mesh_of(8, 1, 1)):
        hlo = jax.jit(f).lower(x, mask, *w).as_text()
    assert "all_to_all" not in hlo and "all-to-all" not in hlo
    with jax.set_mesh(mesh_of(2, 1, 4)):
        hlo = jax.jit(f).lower(x, mask, *w).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo


SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16", "model.d_ff=32",
         "model.max_seq_len=32", "moe.num_experts=8", "data.seq_len=16", "data.batch_size=8",
         "moe.capacity_factor=4.0"]  # capacity = tokens per device: nothing drops


def check_loss_and_gradients_on_mesh(cfg, routing=None, d_model=32):
    """Loss and gradients of one batch on ``cfg``'s mesh equal the single-device ones."""
    md = ModelDef(cfg, 259)
    params = md.init_params(0)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (8, 16)), "targets": rng.integers(0, 256, (8, 16)),
             "segment_ids": np.ones((8, 16), np.int32), "positions": np.tile(np.arange(16), (8, 1)),
             "loss_weight": np.ones((8, 16), np.float32)}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    fn = jax.value_and_grad(lambda p, b, r: loss_fn(md, p, b, None, r)[0])
    ref_loss, ref_grads = jax.jit(fn)(params, batch, routing)

    from moefast.parallel import param_specs, shardings
    mesh = make_mesh(cfg)
    specs = param_specs(md.abstract_model_state, mesh)
    sharded = jax.device_put(params, shardings(mesh, specs))
    expert, fsdp = cfg.mesh.expert, cfg.mesh.fsdp
    if expert > 1:  # experts really are split
        w_in = sharded["blocks"][cfg.model.num_layers - 1]["ffn"]["w_in"]  # an MoE layer
        assert w_in.addressable_shards[0].data.shape[0] == 8 // expert
    if fsdp > 1:
        assert sharded["embed"].addressable_shards[0].data.shape[1] == d_model // fsdp
    batch_sh = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    loss, grads = run_on_mesh(mesh, fn, sharded, batch_sh, routing)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


# data 2 x fsdp 2 x expert 2: test_deepseek_v3_loss_and_gradients_equal_single_device
@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4), (1, 8, 1)], ids=lambda s: "x".join(map(str, s)))
def test_model_loss_and_gradients_equal_single_device(shape, devices):
    data, fsdp, expert = shape
    check_loss_and_gradients_on_mesh(
        load_config(None, SMALL + [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.expert={expert}"]))


def test_routing_statistics_are_reduced_after_the_scanned_layers(devices):
    """The layers return per-shard routing sums; the model reduces them once, after its loop, so
    the scanned layers' loop body holds no all-reduce (it held two per layer: int and float sums)."""
    import re
    cfg = load_config(None, SMALL + ["model.scan_layers=true", "mesh.data=2", "mesh.expert=4"])
    md = ModelDef(cfg, 259)
    from moefast.parallel import param_specs, shardings
    mesh = make_mesh(cfg)
    params = jax.device_put(md.init_params(0), shardings(mesh, param_specs(md.abstract_model_state, mesh)))
    tokens = jax.device_put(jnp.zeros((8, 16), jnp.int32), NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    with jax.set_mesh(mesh):
        text = jax.jit(lambda p, t: md.module(p)(t).moe.aux_loss).lower(params, tokens).compile().as_text()
    hlo = HloModule(text)
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", text))
    assert bodies, "the scanned layers must compile to a while loop"
    in_bodies = [hlo.instrs[n].opcode for b in bodies for n in hlo.computations[b]]
    assert "all-to-all" in in_bodies or "all-to-all-start" in in_bodies, "the exchange runs in the loop"
    assert not [o for o in in_bodies if o.startswith("all-reduce")], "routing sums all-reduced inside the loop"
    assert any(c.kind == "all-reduce" for c in collectives(text)), "the sums are reduced once, after the loop"


def test_deepseek_v3_loss_and_gradients_equal_single_device(devices):
    """configs/tiny_deepseek_v3.yaml, shrunk, on data 2 x fsdp 2 x expert 2: MLA (fsdp-split
    low-rank projections), sigmoid routing in 2 of 4 groups with a non-zero selection bias, the
    ungated shared expert, the dense first layer and the MTP module match one device."""
    cfg = load_config("configs/tiny_deepseek_v3.yaml", [
        "model.d_model=32", "model.num_layers=3", "model.q_lora_rank=16", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.d_ff=32",
        "model.dense_d_ff=48", "moe.shared_expert_d_ff=32", "model.max_seq_len=32", "data.seq_len=16",
        "data.batch_size=8", "moe.capacity_factor=4.0", "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"])
    from moefast.model import init_routing_state
    routing = init_routing_state(cfg)
    bias = np.random.default_rng(1).normal(0, 0.3, routing["bias"].shape).astype(np.float32)
    routing = {**routing, "bias": jnp.asarray(bias)}  # spread: it moves choices
    check_loss_and_gradients_on_mesh(cfg, routing)


def test_warmup_noise_under_expert_parallelism_differs_per_shard(devices):
    """Expert warm-up inside shard_map: every token shard folds its own index into the key, so
    identical rows on different devices are routed differently; the statistics stay global."""
    router, w_in, w_out = weights()
    x = jnp.tile(jax.random.normal(jax.random.key(1), (1, 6, D)), (8, 1, 1))  # the same row on every device
    mask = jnp.ones((8, 6), bool)
    spec = MoEConfig(num_experts=E, top_k=K, capacity_factor=4.0, min_capacity=1, warmup_routing="uniform")

    def fn(x, mask, router, w_in, w_out, key):
        y, s = moe_ffn(x, mask, router, w_in, w_out, spec, warmup_key=key, warmup_active=jnp.asarray(True))
        return y, s.tokens_per_expert

    y, counts = run_on_mesh(mesh_of(2, 2, 2), fn, x, mask, router, w_in, w_out, jax.random.key(5))
    assert int(jnp.sum(counts)) == 8 * 6 * K
    assert not np.allclose(np.asarray(y[0]), np.asarray(y[7]))  # different shards, different routing
    y2, _ = run_on_mesh(mesh_of(2, 2, 2), fn, x, mask, router, w_in, w_out, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))


# ------------------------------------------------------------------ overlap: chunked expert exchange
OVERLAP_MESHES = [(1, 1, 8), (2, 1, 4), (4, 1, 2), (2, 2, 2)]  # (data, fsdp, expert)


def overlap_inputs(batch=8, t=16, seed=1):
    x = jax.random.normal(jax.random.key(seed), (batch, t, D))
    return x, jnp.ones((batch, t), bool).at[3, 9:].set(False)  # a little padding


def loss_and_grads(x, mask, router, w_in, w_out, *, chunks, chain=False, drop_tokens, capacity_factor=1.0):
    spec = MoEConfig(num_experts=E, top_k=K, capacity_factor=capacity_factor, min_capacity=1, overlap_chunks=chunks,
                       overlap_chain=chain)

    def loss(x, router, w_in, w_out):
        y, s = moe_ffn(x, mask, router, w_in, w_out, spec, drop_tokens=drop_tokens)
        return jnp.sum(jnp.sin(y)) + s.aux_loss + 0.1 * s.z_loss, (y, s)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, router, w_in, w_out)


@pytest.mark.parametrize("drop_tokens", [True, False], ids=["drops", "no-drops"])
@pytest.mark.parametrize("shape", OVERLAP_MESHES, ids=lambda s: "x".join(map(str, s)))
def test_chunked_exchange_equals_the_unchunked_one(shape, drop_tokens, devices):
    """n = 4 (and, on the 2 x 4 mesh, 2 and 4 chained) against n = 1: routing statistics and auxiliary losses bitwise;
    outputs, loss and every gradient to float rounding (XLA's dot kernels round differently for
    C/n rows than for C: a plain [1, 128, 16] x [16, 48] dot split into 32-row pieces differs by up
    to 3e-6). 16 tokens per device: capacity 4 at factor 1.0 (assignments drop), 16 without
    dropping, so all n use the same capacity."""
    x, mask = overlap_inputs()
    w = weights(3)
    mesh = mesh_of(*shape)
    run = lambda **kw: run_on_mesh(mesh, functools.partial(loss_and_grads, drop_tokens=drop_tokens, **kw),
                                   x, mask, *w)
    (ref_loss, (ref_y, ref_s)), ref_g = run(chunks=1)
    if drop_tokens:
        assert float(ref_s.dropped_fraction) > 0.05  # the case with drops really drops
    variants = [{"chunks": 4}]
    if shape == (2, 1, 4):  # the other variants on one mesh (each is a compile: CI time)
        variants += [{"chunks": 2}, {"chunks": 4, "chain": True}]
    for kw in variants:
        (loss, (y, s)), g = run(**kw)
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(ref_s)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(kw))
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=2e-6, err_msg=str(kw))
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
        for a, b in zip(g, ref_g):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6, err_msg=str(kw))


def test_capacity_is_rounded_up_to_a_multiple_of_the_chunks(devices):
    assert [exchange_capacity(c, 4) for c in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert exchange_capacity(3, 1) == 3
    # 12 tokens per device at factor 1.0: capacity 3, rounded to 4 with n = 2 — fewer drops, and the
    # layer runs.
    x, mask = overlap_inputs(t=12)
    w = weights(3)
    mesh = mesh_of(2, 1, 4)
    stats = {n: run_on_mesh(mesh, functools.partial(loss_and_grads, chunks=n, drop_tokens=True), x, mask, *w)[0][1][1]
             for n in (1, 2)}
    assert float(stats[2].dropped_fraction) < float(stats[1].dropped_fraction)


def test_overlap_chunks_are_bounded(devices):
    for bad in ("moe.overlap_chunks=0", "moe.overlap_chunks=17"):
        with pytest.raises(ConfigError, match="moe.overlap_chunks"):
            load_config(None, [bad])
    # more chunks than slots (capacity 4 per expert here): one clear error when the layer is traced
    x, mask = overlap_inputs()
    spec = MoEConfig(num_experts=E, top_k=K, capacity_factor=1.0, min_capacity=1, overlap_chunks=8)
    with jax.set_mesh(mesh_of(2, 1, 4)), pytest.raises(ValueError, match="more than the capacity"):
        jax.eval_shape(lambda x, w: moe_ffn(x, mask, *w, spec)[0], x, weights(3))


def _exchange_hlo(chunks, chain=False, compiled=True):
    x, mask = overlap_inputs()
    spec = MoEConfig(num_experts=E, top_k=K, capacity_factor=1.0, min_capacity=1, overlap_chunks=chunks, overlap_chain=chain)
    f = lambda x, r, wi, wo: moe_ffn(x, mask, r, wi, wo, spec)[0]
    with jax.set_mesh(mesh_of(2, 1, 4)):
        lowered = jax.jit(f).lower(x, *weights(3))
        return HloModule(lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo"))


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_compiled_layer_has_2n_independent_all_to_alls(chunks, devices):
    """In the compiled forward of one MoE layer: 2n all-to-alls; n dispatches that depend on no
    other all-to-all (chunk i+1 leaves without waiting for chunk i's experts), and n returns that
    each depend on exactly one dispatch, a different one each."""
    m = _exchange_hlo(chunks)
    a2a = [c for c in m.collectives() if c.kind == "all-to-all"]
    assert len(a2a) == 2 * chunks
    deps = {c.name: [o.name for o in a2a if o is not c and m.depends_on(c.name, o.name)] for c in a2a}
    assert {n: set(d) for n, d in deps.items()} == m.dependencies([c.name for c in a2a])  # one pass, same answer
    dispatch = [n for n, d in deps.items() if not d]
    returns = {n: d for n, d in deps.items() if d}
    assert len(dispatch) == chunks and len(returns) == chunks
    assert all(len(d) == 1 for d in returns.values()) and sorted(d[0] for d in returns.values()) == sorted(dispatch)
    # The chunks' buffers add up to the unchunked one: 8 tokens x 2 choices ... per device, [E, C, D] f32.
    assert sum(c.bytes for c in a2a) == 2 * 8 * 4 * D * 4


def test_chained_chunks_wait_for_the_chunk_two_before(devices):
    """The barrier is in the program XLA is given (XLA:CPU drops barriers when it compiles; its
    collectives are synchronous anyway)."""
    m = _exchange_hlo(4, chain=True, compiled=False)
    a2a = [c.name for c in m.collectives() if c.kind == "all-to-all"]
    dispatch = [n for n in a2a if not any(m.depends_on(n, o) for o in a2a if o != n)]
    assert len(dispatch) == 2  # chunks 0 and 1; chunks 2 and 3 wait on the barrier


def test_hlo_report_of_async_collectives():
    text = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %all-reduce-start = f32[8,4]{1,0} all-reduce-start(%p), replica_groups={}, to_apply=%add
  %fusion = f32[8,4]{1,0} fusion(%p), kind=kLoop, calls=%add
  %dot = f32[8,4]{1,0} dot(%fusion, %fusion), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %all-reduce-done = f32[8,4]{1,0} all-reduce-done(%all-reduce-start)
  %all-gather = bf16[16,4]{1,0} all-gather(%dot), dimensions={0}
  ROOT %r = f32[8,4]{1,0} add(%all-reduce-done, %dot)
}
"""
    items = collectives(text)
    assert [(c.kind, c.bytes, c.is_async, c.compute_between) for c in items] == [
        ("all-reduce", 128, True, 2), ("all-gather", 128, False, 0)]
    m = HloModule(text)
    assert m.depends_on("r", "p") and m.depends_on("all-gather", "fusion") and not m.depends_on("fusion", "dot")
    assert "| all-reduce-start | all-reduce |" in format_collectives(items)


_COMPILE_MESHES = """
import sys
sys.path.insert(0, {tests!r})
import jax
from conftest import SMALL_MODEL
from moefast.config import load_config
from moefast.train import Trainer
for mesh in ({meshes!r}):
    cfg = load_config(None, SMALL_MODEL + ["data.source={source}", *mesh])
    Trainer(cfg, {run_dir!r} + "/" + "_".join(mesh), log=None, progress=False).compiled_train_step()
    print("compiled", mesh, flush=True)
"""


def test_mixed_meshes_compile_without_involuntary_rematerialization(text_dir, tmp_path):
    """XLA's SPMD partitioner warns "Involuntary full rematerialization" when it has to replicate
    a tensor to reshard it; data x expert and data x fsdp x expert meshes used to, for the
    activations feeding the weight-gradient dots (the state's ZeRO sharding propagated back
    into them), and a context axis (rows split over data x expert, their tokens over context)
    did for the embedding's scatter-add. The warnings go to the C++ log (stderr), so the train
    steps compile in a fresh process here."""
    import os
    import subprocess
    import sys

    meshes = (["mesh.data=2", "mesh.expert=4"], ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
              ["mesh.data=2", "mesh.expert=2", "mesh.context=2"])
    code = _COMPILE_MESHES.format(tests=os.path.dirname(os.path.dirname(__file__)), meshes=meshes,
                                  source=text_dir, run_dir=str(tmp_path))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == len(meshes)
    assert "Involuntary full rematerialization" not in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("shape", [None, (2, 1, 4)], ids=["one-device", "2x1x4"])
def test_onehot_dispatch_equals_slot_dispatch(shape, devices):
    """moe.dispatch=onehot (GShard's [T, E, C] einsums, the ablation baseline): same routing, same
    outputs and gradients as dispatch by slot, with drops and padding, alone and expert-parallel."""
    x, mask = inputs()
    router, w_in, w_out = weights()

    def run(dispatch):
        def f(x, router, w_in, w_out):
            spec = MoEConfig(num_experts=E, top_k=K, capacity_factor=0.5, min_capacity=1, dispatch=dispatch)  # drops
            y, s = moe_ffn(x, mask, router, w_in, w_out, spec, drop_tokens=True)
            return jnp.sum(jnp.sin(y)) + s.aux_loss + 0.1 * s.z_loss, (y, s)
        g = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)
        return jax.jit(g)(x, router, w_in, w_out) if shape is None else run_on_mesh(mesh_of(*shape), g, x, router,
                                                                                    w_in, w_out)

    (l_slot, (y_slot, s_slot)), g_slot = run("slot")
    (l_hot, (y_hot, s_hot)), g_hot = run("onehot")
    assert float(s_slot.dropped_fraction) > 0.1  # the case has drops
    np.testing.assert_array_equal(np.asarray(s_hot.tokens_per_expert), np.asarray(s_slot.tokens_per_expert))
    np.testing.assert_array_equal(float(s_hot.dropped_fraction), float(s_slot.dropped_fraction))
    np.testing.assert_allclose(np.asarray(y_hot), np.asarray(y_slot), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(l_hot), float(l_slot), rtol=1e-6)
    for a, b in zip(g_hot, g_slot):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_onehot_dispatch_needs_a_capacity():
    with pytest.raises(ConfigError, match=r"moe\.dispatch: 'onehot' needs a capacity"):
        load_config(None, ["moe.dispatch=onehot", "moe.capacity_factor=0"])


# ------------------------------------------------------------------ FP8 dispatch
def test_fp8_quantize_round_trip():
    """Per-(row, 128 channels) scales: each value within 2^-4 of its tile's max-abs after the round
    trip (e4m3: 3 mantissa bits); zero tiles stay exactly zero; values at a tile's max-abs exact."""
    from moefast.parallel.fp8 import fp8_dequantize, fp8_quantize

    x = jax.random.normal(jax.random.key(0), (3, 5, 256)) * jnp.array([1e-3, 1.0, 1e3])[:, None, None]
    x = x.at[1, 2, :128].set(0.0)
    q, scale = fp8_quantize(x)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (3, 5, 2)
    back = fp8_dequantize(q, scale, jnp.float32)
    tile_max = jnp.repeat(jnp.max(jnp.abs(x.reshape(3, 5, 2, 128)), axis=-1), 128, axis=-1)
    assert float(jnp.max(jnp.abs(back - x) / jnp.where(tile_max > 0, tile_max, 1.0))) <= 2.0**-4
    assert float(jnp.max(jnp.abs(back[1, 2, :128]))) == 0.0
    at_max = jnp.abs(x) == tile_max
    np.testing.assert_allclose(np.asarray(back[at_max]), np.asarray(x[at_max]), rtol=1e-6)


def test_fp8_dispatch_against_the_compute_dtype(devices):
    """moe.dispatch_dtype=float8_e4m3fn on a 2 x 4 (data x expert) mesh, bfloat16 experts, against
    the same layer dispatching bfloat16: routing statistics and losses bitwise (routing happens
    before the dispatch); outputs within 2^-4 of the largest output (the experts' inputs rounded to
    e4m3 per 128-channel tile); gradients with cosine similarity > 0.99 to the bfloat16 ones (they
    pass straight through the rounding). The dispatch all-to-all XLA is given moves each row's 128
    e4m3 bytes and its float32 scale's 4 bytes as one uint8 row (132 bytes instead of 256 in bf16);
    the return and the two backward exchanges move the compute or input dtype."""
    d = 128
    k = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(k[0], (8, 16, d))
    mask = jnp.ones((8, 16), bool).at[3, 9:].set(False)
    w = (jax.random.normal(k[1], (d, E)), jax.random.normal(k[2], (E, d, 2 * F)) * 0.1,
         jax.random.normal(k[3], (E, F, d)) * 0.1)

    def run(dispatch_dtype):
        spec = MoEConfig(num_experts=E, top_k=K, capacity_factor=1.0, min_capacity=1, dispatch_dtype=dispatch_dtype)

        def loss(x, router, w_in, w_out):
            y, s = moe_ffn(x, mask, router, w_in, w_out, spec, dtype=jnp.bfloat16)
            return jnp.sum(jnp.sin(y.astype(jnp.float32))) + s.aux_loss, (y, s)

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        with jax.set_mesh(mesh_of(2, 1, 4)):
            return f(x, *w), HloModule(f.lower(x, *w).as_text(dialect="hlo"))  # (XLA:CPU widens f8, bf16)

    ((_, (ref_y, ref_s)), ref_g), _ = run("compute")
    ((_, (y, s)), g), hlo = run("float8_e4m3fn")
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(ref_s)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref_y.astype(jnp.float32))))
    assert 0 < err <= 2.0**-4 * float(jnp.max(jnp.abs(ref_y.astype(jnp.float32))))
    for a, b in zip(g, ref_g):
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99
    a2a = [c for c in hlo.collectives() if c.kind == "all-to-all" and c.bytes >= 4096]
    shapes = [c.shape.split("{")[0].lstrip("(") for c in a2a]
    assert shapes.count("u8[4,2,4,132]") == 1 and len(shapes) == 4, shapes
    assert not any(s.startswith(("u8", "f8")) for s in shapes if s != "u8[4,2,4,132]"), shapes


def test_fp8_dispatch_bad_input(devices):
    with pytest.raises(ConfigError, match="moe.dispatch_dtype"):
        load_config(None, ["moe.dispatch_dtype=float8_e4m3fn", "moe.capacity_factor=0"])
    with pytest.raises(ConfigError, match="multiple of 128"):
        load_config(None, ["moe.dispatch_dtype=float8_e4m3fn", "model.d_model=200"])


def _gpt_oss_reference(x, mask, router, router_bias, w_in, b_in, w_out, b_out, limit=7.0):
    """gpt-oss's MoE block written from Hugging Face's description (``GptOssTopKRouter``,
    ``GptOssExperts``), dense over experts, float32: logits with the router's bias, softmax over
    the top-k logits, each chosen expert's clamped SwiGLU with biases, the gated sum."""
    x = x.reshape(-1, x.shape[-1])
    logits = x @ router + router_bias[None]
    top, idx = jax.lax.top_k(logits, K)
    gates = jax.nn.softmax(top, axis=-1)
    h = jnp.einsum("td,edf->tef", x, w_in) + b_in[None]
    gate, up = h[..., :F], h[..., F:]
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    y_te = jnp.einsum("tef,efd->ted", (up + 1) * gate * jax.nn.sigmoid(1.702 * gate), w_out) + b_out[None]
    y = jnp.einsum("tk,tkd->td", gates, jnp.take_along_axis(y_te, idx[..., None], axis=1))
    return jnp.where(mask.reshape(-1, 1), y, 0.0)


@pytest.mark.parametrize("mesh_shape, extra", [
    ((8, 1, 1), dict(capacity_factor=8.0)),  # capacity buffers, one device's experts
    ((2, 1, 4), dict(capacity_factor=8.0, overlap_chunks=2)),  # the exchange in two chunks
    ((2, 1, 4), dict(capacity_factor=0.0)),  # dropless: grouped rows, moved by the ragged exchange
    ((2, 1, 4), dict(capacity_factor=8.0, exchange="hierarchical", gpus_per_host=2)),  # two hops
], ids=["capacity", "exchange-2-chunks", "dropless-exchange", "hierarchical"])
def test_gpt_oss_experts_with_biases_and_clamped_swiglu(mesh_shape, extra, devices):
    """moe.router_bias, moe.expert_bias and moe.expert_activation=clamped_swiglu (gpt-oss) on every
    expert path: outputs equal the dense reference (nothing drops), and the biases' gradients flow
    (equal to the reference's)."""
    k = jax.random.split(jax.random.key(7), 4)
    router, w_in, w_out = weights(3)
    b_in, b_out = jax.random.normal(k[0], (E, 2 * F)), jax.random.normal(k[1], (E, D)) * 0.3
    router_bias = jax.random.normal(k[2], (E,))
    x, mask = inputs()
    x = x * 3.0  # some gate and up values past the clamp (7)
    spec = MoEConfig(num_experts=E, top_k=K, min_capacity=1, router_bias=True, expert_bias=True,
                     expert_activation="clamped_swiglu", aux_loss_coef=0.0, z_loss_coef=0.0, **extra)

    def loss(fn):
        return lambda bi, bo, rb: jnp.sum(jnp.sin(fn(bi, bo, rb)))

    ours = lambda bi, bo, rb: moe_ffn(x, mask, router, (w_in, bi), (w_out, bo), spec, router_bias_e=rb)[0]  # noqa: E731
    ref = lambda bi, bo, rb: _gpt_oss_reference(x, mask, router, rb, w_in, bi, w_out, bo).reshape(x.shape)  # noqa: E731
    want, want_g = jax.jit(ref)(b_in, b_out, router_bias), jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(
        b_in, b_out, router_bias)
    assert float(jnp.max(jnp.abs(jnp.einsum("btd,edf->btef", x, w_in)))) > 7.0
    with jax.set_mesh(mesh_of(*mesh_shape)):
        got = jax.jit(ours)(b_in, b_out, router_bias)
        got_g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(b_in, b_out, router_bias)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for a, e in zip(got_g, want_g):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="router_bias_e of shape"):
        moe_ffn(x, mask, router, (w_in, b_in), (w_out, b_out), spec)


@pytest.mark.parametrize("mesh_shape, extra", [
    ((8, 1, 1), dict(capacity_factor=8.0)),  # capacity buffers, one device's experts
    ((2, 1, 4), dict(capacity_factor=0.0)),  # dropless: grouped rows, moved by the ragged exchange
], ids=["capacity", "dropless-exchange"])
def test_relu2_experts_are_not_gated(mesh_shape, extra, devices):
    """moe.expert_activation=relu2 (Nemotron-H): one up projection [E, D, F], relu(h)², on the
    capacity and the dropless expert-parallel paths: outputs and weight gradients equal a dense
    reference (softmax over the top-k logits, nothing drops)."""
    router, w_in, w_out = weights(5)
    w_in = w_in[..., :F]  # the up projection alone
    x, mask = inputs()
    spec = MoEConfig(num_experts=E, top_k=K, min_capacity=1, expert_activation="relu2", aux_loss_coef=0.0,
                     z_loss_coef=0.0, **extra)

    def ref(w_in, w_out):
        xt = x.reshape(-1, D)
        top, idx = jax.lax.top_k(xt @ router, K)
        h = jnp.square(jax.nn.relu(jnp.einsum("td,edf->tef", xt, w_in)))
        y_te = jnp.einsum("tef,efd->ted", h, w_out)
        y = jnp.einsum("tk,tkd->td", jax.nn.softmax(top, axis=-1), jnp.take_along_axis(y_te, idx[..., None], axis=1))
        return jnp.where(mask.reshape(-1, 1), y, 0.0).reshape(x.shape)

    ours = lambda w_in, w_out: moe_ffn(x, mask, router, w_in, w_out, spec)[0]  # noqa: E731
    loss = lambda fn: lambda *w: jnp.sum(jnp.sin(fn(*w)))  # noqa: E731
    want, want_g = jax.jit(ref)(w_in, w_out), jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(w_in, w_out)
    with jax.set_mesh(mesh_of(*mesh_shape)):
        got, got_g = jax.jit(ours)(w_in, w_out), jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(w_in, w_out)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for a, e in zip(got_g, want_g):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4)


def test_latent_relu2_moe_layer_on_an_expert_mesh_equals_one_device(devices):
    """Nemotron 3 Super's MoE block (moe.latent_size, relu² experts, a relu² shared expert on the full
    width) equals a dense reference on one device, and on data 2 x expert 4 the same outputs and
    parameter gradients (nothing drops)."""
    from flax import nnx

    from moefast.model.moe import MoELayer

    spec = MoEConfig(num_experts=E, top_k=K, expert_activation="relu2", latent_size=12, shared_expert_d_ff=20,
                     shared_expert_gate=False, capacity_factor=8.0, min_capacity=1, aux_loss_coef=0.0, z_loss_coef=0.0)
    layer = MoELayer(D, F, spec, init_std=0.3, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(layer)
    x, mask = inputs()
    mask = jnp.ones_like(mask)

    def ref(p):
        p = nnx.to_pure_dict(p)
        xt = x.reshape(-1, D)
        top, idx = jax.lax.top_k(xt @ p["router"], K)  # the router reads the full width
        lat = xt @ p["fc1_latent_proj"]
        y_te = jnp.einsum("tef,efl->tel", jnp.square(jax.nn.relu(jnp.einsum("tl,elf->tef", lat, p["w_in"]))), p["w_out"])
        y = jnp.einsum("tk,tkl->tl", jax.nn.softmax(top, axis=-1), jnp.take_along_axis(y_te, idx[..., None], axis=1))
        shared = jnp.square(jax.nn.relu(xt @ p["shared_w_in"])) @ p["shared_w_out"]
        return (y @ p["fc2_latent_proj"] + shared).reshape(x.shape)

    def ours(p):
        return nnx.merge(graphdef, p)(x, mask)[0]

    loss = lambda fn: lambda p: jnp.sum(jnp.sin(fn(p)))  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want = jax.jit(ref)(params)
        one, g_one = jax.jit(ours)(params), jax.jit(jax.grad(loss(ours)))(params)
        with jax.set_mesh(mesh_of(2, 1, 4)):
            ep, g_ep = jax.jit(ours)(params), jax.jit(jax.grad(loss(ours)))(params)
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ep, one, rtol=1e-5, atol=1e-5)
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g_ep), jax.tree.leaves(g_one)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
