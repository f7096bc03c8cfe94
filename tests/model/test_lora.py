"""Low-rank adapters (``lora``): the adapted model at step 0 is the base model, the routed experts'
adapters' gradients equal a NumPy LoRA layer's on every expert path, every mesh gives the same
loss and adapter gradients, and a trained run changes the adapters only."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast import routing
from moefast.config import LoRAConfig, MoEConfig, load_config
from moefast.model import lora
from moefast.model.positional import document_positions
from moefast.parallel import make_mesh
from moefast.parallel.expert import ExpertProjection, moe_ffn
from moefast.train.step import ModelDef, loss_and_grads

LORA = ["lora.rank=4", "lora.alpha=8", "lora.base_dtype=float32"]
# every target kind in one small model: GQA attention with an output gate, a dense first layer,
# a shared expert beside the routed ones
ALL_TARGETS = ["model.num_dense_layers=1", "model.num_layers=3", "moe.shared_expert_d_ff=32",
               "model.attention_output_gate=true", "model.num_kv_heads=1"]


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    tokens = jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32)
    seg = jnp.ones((b, t), jnp.int32).at[:, t - 3:].set(0)
    return dict(tokens=tokens, targets=jnp.roll(tokens, -1, 1), segment_ids=seg, positions=document_positions(seg),
                loss_weight=(seg > 0).astype(jnp.float32))


def _random_b(params, seed=1):
    """``params`` with every adapter B drawn at random (B = 0 would give A no gradient)."""
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    return lora._walk(params, lambda p, v: 0.1 * jax.random.normal(next(keys), v.shape, v.dtype)
                      if str(p[-1]).endswith(lora.LORA_B) else v)


def test_step0_is_the_base_model_bitwise(small_config):
    base_cfg = small_config(*ALL_TARGETS)
    cfg = small_config(*ALL_TARGETS, *LORA)
    base, adapted = ModelDef(base_cfg, 259), ModelDef(cfg, 259)
    p0, p1 = base.init_params(0), adapted.init_params(0)
    train, frozen = adapted.split(p1)
    assert jax.tree.structure(frozen) == jax.tree.structure(p0)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(p0)))
    names = {str(p[-1].key) for p, _ in jax.tree_util.tree_flatten_with_path(train)[0]}
    # every kind of projection has its adapter: attention (qkv, gate, out), dense MLP, shared and routed experts
    assert {"qkv_lora_a", "gate_lora_b", "out_lora_a", "w_in_lora_a", "w_out_lora_b", "shared_w_in_lora_a",
            "shared_w_out_lora_b"} <= names
    batch = _batch(cfg)
    logits = [md.module(p)(batch["tokens"], batch["positions"], batch["segment_ids"]).logits
              for md, p in ((base, p0), (adapted, p1))]
    np.testing.assert_array_equal(logits[0], logits[1])


def read_records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def _silu(z):
    return z / (1 + np.exp(-z))


def _numpy_lora_experts(x, experts_tk, gates_tk, p_in, p_out, s, g):
    """A NumPy LoRA SwiGLU layer: y_t = sum_k gate_tk FFN_{e_tk}(x_t), FFN_e(x) = down(silu(gate)
    up) with each projection ``x W_e + s (x A_e) B_e``; and the gradients of sum(y * g) with
    respect to every expert's A and B (backpropagated by hand, float64)."""
    (w1, a1, b1), (w2, a2, b2) = p_in, p_out
    grads = {k: np.zeros_like(v) for k, v in (("a_in", a1), ("b_in", b1), ("a_out", a2), ("b_out", b2))}
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, gt in zip(experts_tk[t], gates_tk[t]):
            xt = x[t:t + 1]
            h = xt @ w1[e] + s * (xt @ a1[e]) @ b1[e]
            f = h.shape[1] // 2
            gate, up = h[:, :f], h[:, f:]
            act = _silu(gate) * up
            y[t] += gt * (act @ w2[e] + s * (act @ a2[e]) @ b2[e])[0]
            dy = gt * g[t:t + 1]
            grads["b_out"][e] += s * (act @ a2[e]).T @ dy
            grads["a_out"][e] += s * act.T @ (dy @ b2[e].T)
            dact = dy @ w2[e].T + s * (dy @ b2[e].T) @ a2[e].T
            sig = 1 / (1 + np.exp(-gate))
            dh = np.concatenate([dact * up * sig * (1 + gate * (1 - sig)), dact * _silu(gate)], axis=1)
            grads["b_in"][e] += s * (xt @ a1[e]).T @ dh
            grads["a_in"][e] += s * xt.T @ (dh @ b1[e].T)
    return y, grads


@pytest.mark.parametrize("path,expert_axis", [("capacity", 1), ("dropless", 1), ("capacity", 4), ("dropless", 4),
                                              ("hierarchical", 4)])
def test_expert_adapter_gradients_equal_a_numpy_lora_layer(path, expert_axis, devices):
    """Every expert path: capacity buffers, dropless grouped GEMMs, each over an expert axis too,
    and the hierarchical exchange (2 hosts x 2 GPUs)."""
    e, d, f, r, s = 4, 8, 12, 3, 1.5
    two_hops = dict(exchange="hierarchical", gpus_per_host=2, min_capacity=1) if path == "hierarchical" else {}
    moe = MoEConfig(num_experts=e, top_k=2, capacity_factor=0.0 if path == "dropless" else 4.0, **two_hops)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 2, d)).astype(np.float32)  # 8 rows: one per device of an 8-device mesh
    router = rng.normal(size=(d, e)).astype(np.float32)
    w1, w2 = rng.normal(size=(e, d, 2 * f)) * 0.3, rng.normal(size=(e, f, d)) * 0.3
    a1, b1 = rng.normal(size=(e, d, r)) * 0.3, rng.normal(size=(e, r, 2 * f)) * 0.3
    a2, b2 = rng.normal(size=(e, f, r)) * 0.3, rng.normal(size=(e, r, d)) * 0.3
    g = rng.normal(size=(16, d))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731

    def loss(a1_, b1_, a2_, b2_):
        y, _ = moe_ffn(jnp.asarray(x), jnp.ones((8, 2), bool), jnp.asarray(router),
                       ExpertProjection(f32(w1), None, a1_, s * b1_), ExpertProjection(f32(w2), None, a2_, s * b2_),
                       moe, drop_tokens=True)
        return jnp.sum(y.reshape(16, d) * f32(g)), y

    args = tuple(map(f32, (a1, b1, a2, b2)))
    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    if expert_axis > 1:
        cfg = load_config(None, ["mesh.data=2", f"mesh.expert={expert_axis}", "moe.num_experts=4"])
        with jax.set_mesh(make_mesh(cfg, devices)):
            (_, y), grads = run(*args)
    else:
        (_, y), grads = run(*args)
    # the routing the layer made (float32 router logits, top-2 softmax renormalised like MoEConfig's default)
    r_ = routing.route(jnp.asarray(x.reshape(16, d)) @ jnp.asarray(router), top_k=2, capacity=16,
                       renormalize=moe.norm_topk_prob)
    y_ref, g_ref = _numpy_lora_experts(x.reshape(16, d).astype(np.float64), np.asarray(r_.expert_index),
                                       np.asarray(r_.gates, np.float64), (w1, a1, b1), (w2, a2, b2), s, g)
    np.testing.assert_allclose(np.asarray(y).reshape(16, d), y_ref, rtol=1e-5, atol=1e-5)
    for got, name in zip(grads, ("a_in", "b_in", "a_out", "b_out")):
        # the layer receives s * B, so its B gradient is s times the one of its argument
        np.testing.assert_allclose(np.asarray(got), g_ref[name], rtol=2e-5,
                                   atol=2e-5, err_msg=name)


def _adapter_loss_and_grads(cfg, devices=None):
    md = ModelDef(cfg, 259)
    params = _random_b(md.init_params(0))
    batch = _batch(cfg)
    f = jax.jit(lambda p: loss_and_grads(md, p, {}, batch, None, jnp.zeros((), jnp.int32)))
    if devices is None:
        loss, _, grads = f(params)
    else:
        with jax.set_mesh(make_mesh(cfg, devices)):
            loss, _, grads = f(params)
    return float(loss), jax.tree.map(np.asarray, grads)


def test_adapter_gradients_equal_on_every_mesh(small_config, devices):
    """1 device = data 2 x expert 4 = fsdp 2 x expert 2 (x data 2): loss and adapter gradients (1e-6)."""
    common = (*ALL_TARGETS, *LORA, "moe.capacity_factor=0", "model.dtype=float32")
    ref_loss, ref = _adapter_loss_and_grads(small_config(*common))
    assert {str(p[-1].key) for p, _ in jax.tree_util.tree_flatten_with_path(ref)[0]} <= {
        n + s for n in ("qkv", "gate", "out", "w_in", "w_out", "shared_w_in", "shared_w_out")
        for s in (lora.LORA_A, lora.LORA_B)}  # the gradient holds adapters only
    for mesh in (["mesh.data=2", "mesh.expert=4"], ["mesh.fsdp=2", "mesh.expert=2"]):
        loss, grads = _adapter_loss_and_grads(small_config(*common, *mesh), devices)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), mesh
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(b).max()),
                                       err_msg=f"{mesh} {jax.tree_util.keystr(path)}")


def test_config_rejects_unknown_targets():
    with pytest.raises(ValueError, match="lora.targets"):
        LoRAConfig(rank=4, targets=("experts", "router"))
    with pytest.raises(ValueError, match="lora.train"):
        LoRAConfig(rank=4, train=("experts",))
    assert LoRAConfig(rank=8, alpha=16).scale("attention") == 2.0
    assert LoRAConfig(rank=8, alpha=16, expert_rank=4).scale("experts") == 4.0
    assert dataclasses.replace(LoRAConfig(), rank=0).enabled is False


def test_trained_run_changes_the_adapters_only_and_resumes_exactly(small_config, tmp_path):
    """A QLoRA run (NF4 base, scanned layers, 2 micro-batches, the router trained too): the loss
    falls; the frozen base is bitwise what it was; the optimizer holds the adapters and the router
    only; every routed expert that received tokens ends with a non-zero delta in both projections;
    10 steps equal 5 + a resume to 10 bit for bit."""
    from moefast.data import load_corpus
    from moefast.train import Trainer

    common = [*ALL_TARGETS, "lora.rank=4", "lora.base_dtype=nf4", "lora.train=[router]", "model.scan_layers=true",
              "train.grad_accum_steps=2", "data.batch_size=16", "train.steps=10", "train.log_every=1", "train.eval_every=0",
              "train.checkpoint_every=0", "train.learning_rate=1e-2", "train.warmup_steps=2"]
    cfg = small_config(*common)
    corpus = load_corpus(cfg.data)
    full, split = tmp_path / "full", tmp_path / "split"
    lines = []
    trainer = Trainer(cfg, full, log=lines.append, progress=False, corpus=corpus)
    init = jax.tree.map(np.asarray, trainer.init_state()["params"])  # what the run starts from
    trainer.run()
    Trainer(small_config(*common, "train.stop_at=5"), split, log=None, progress=False, corpus=corpus).run()
    Trainer(small_config(*common), split, log=None, progress=False, corpus=corpus).run()
    losses = [r["loss"] for r in read_records(full, "train")]
    assert [r["loss"] for r in read_records(split, "train")] == losses  # exact resume
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert any(ln.startswith("lora: rank 4") and "trainable" in ln and "frozen base" in ln for ln in lines)

    step, params, _ = trainer.restore_params()
    assert step == 10
    params = jax.tree.map(np.asarray, params)
    train0, frozen0 = trainer.model_def.split(init)
    train1, frozen1 = trainer.model_def.split(params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(frozen1)[0], jax.tree.leaves(frozen0)):
        assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)
    assert {np.dtype(a.dtype).name for a in jax.tree.leaves(frozen1)} == {"uint8", "float32", "bfloat16"}
    state = trainer.abstract_state()
    opt_names = {str(p[-1].key) for p, _ in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
                 if hasattr(p[-1], "key")}
    assert opt_names and all(n.endswith((lora.LORA_A, lora.LORA_B)) or n == "router" for n in opt_names)
    assert not np.array_equal(train1["groups"][0]["ffn"]["router"], train0["groups"][0]["ffn"]["router"])
    ffn = train1["groups"][0]["ffn"]  # the scanned MoE layers: [L, E, ...]
    tokens = np.sum([r["tokens_per_expert"] for r in read_records(full, "train")], axis=0)  # [L_moe, E]
    for name in ("w_in", "w_out"):
        delta = np.einsum("leir,lero->leio", ffn[name + lora.LORA_A], ffn[name + lora.LORA_B])
        moved = np.abs(delta).max(axis=(2, 3)) > 0  # [L, E]
        assert np.array_equal(moved, tokens > 0), (name, moved, tokens)


def test_a_named_target_must_adapt_something():
    assert load_config(None, ["lora.rank=4"]).lora.target_kinds == ("attention", "mlp", "shared_experts", "experts")
    with pytest.raises(ValueError, match=r"lora.targets: 'mlp' adapts nothing in this model \(it has no dense MLP "
                                         r"layers\); leave it out \(lora.targets=\[experts\]\)"):
        load_config(None, ["lora.rank=4", "lora.targets=[mlp,experts]"])


def test_no_dense_expert_delta_in_the_compiled_step(small_config):
    """The experts' adapters run as thin GEMMs on the routed tokens: no dot of the compiled LoRA
    step yields an [E, in, out] tensor (a base weight's gradient or a merged delta), while the full
    fine-tuning step computes the experts' weight gradients as such dots."""
    from moefast.train.step import train_step

    def expert_sized_dots(*overrides):
        cfg = small_config(*overrides)
        md = ModelDef(cfg, 259)
        state = jax.eval_shape(lambda: md.init_state(0))
        batch = jax.eval_shape(lambda: _batch(cfg))
        hlo = jax.jit(lambda s, b: train_step(md, s, b, jax.random.key(0))).lower(state, batch).compile().as_text()
        e, d, f = cfg.moe.num_experts, cfg.model.d_model, cfg.model.d_ff
        shapes = [f"[{e},{d},{2 * f}]", f"[{e},{f},{d}]"]
        return sum(1 for line in hlo.splitlines() if " dot(" in line and any(s in line.split("=")[1].split("dot(")[0]
                                                                              for s in shapes))

    assert expert_sized_dots() >= 2
    assert expert_sized_dots("lora.rank=4", "lora.targets=[experts]") == 0


def test_routing_state_frozen_or_updating_and_the_bias_warning():
    from moefast.model import MoEStats
    from moefast.train import config_warnings
    from moefast.train.step import update_routing_state

    stats = MoEStats(tokens_per_expert=jnp.asarray([[5, 1, 1, 1]], jnp.int32), aux_loss=jnp.zeros(1),
                     z_loss=jnp.zeros(1), dropped_fraction=jnp.zeros(1), router_entropy=jnp.zeros(1))
    state = {"bias": jnp.zeros((1, 4)), "load_ema": jnp.full((1, 4), 0.25)}
    moving = ["lora.rank=4", "moe.aux_free_bias_rate=0.01"]
    updated = update_routing_state(load_config(None, moving), state, stats)
    assert not np.array_equal(updated["bias"], state["bias"])
    frozen = update_routing_state(load_config(None, [*moving, "lora.routing=frozen"]), state, stats)
    assert all(np.array_equal(frozen[k], state[k]) for k in state)
    assert any("a PEFT adapter (export-hf --adapter) does not" in w for w in config_warnings(load_config(None, moving)))
    assert not any("PEFT" in w for w in config_warnings(load_config(None, [*moving, "lora.routing=frozen"])))


@pytest.mark.parametrize("extra", [[], ["lora.targets=[experts]", "model.num_dense_layers=1", "model.num_layers=3"]])
def test_a_lora_state_converts_between_layer_layouts(extra):
    """A resume may change model.scan_layers: the adapters' optimizer moments (a tree of some
    layers' leaves only; with experts alone, the dense layer has none) convert with the parameters."""
    from moefast.model.layout import to_layout

    scanned, unrolled = (load_config(None, [f"model.scan_layers={s}", "lora.rank=4", *extra]) for s in ("true", "false"))
    states = [jax.eval_shape(lambda c=c: ModelDef(c, 259).init_state(0)) for c in (scanned, unrolled)]
    for state, other, to_scanned in ((states[0], states[1], False), (states[1], states[0], True)):
        converted = to_layout(state, scanned.model, scanned=to_scanned)
        assert jax.tree.structure(converted) == jax.tree.structure(other)
        assert [a.shape for a in jax.tree.leaves(converted)] == [a.shape for a in jax.tree.leaves(other)]


def test_lora_keys_without_a_rank_are_refused(devices):
    """lora.* set with lora.rank 0 would silently train every parameter in float32: refused with
    the platform's checks, before anything compiles."""
    from moefast.train.checks import check_run

    mesh = make_mesh(load_config(None, ["mesh.data=1"]), devices[:1])
    with pytest.raises(ValueError, match=r"lora.base_dtype: is set but lora.rank is 0 .*set lora.rank"):
        check_run(load_config(None, ["lora.base_dtype=nf4", "mesh.data=1"]), mesh)
    check_run(load_config(None, ["lora.rank=4", "lora.base_dtype=nf4", "mesh.data=1"]), mesh)
