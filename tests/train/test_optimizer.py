"""``train.optimizer=muon``: the parameter table covers every shipped config; each matrix's update
(per expert, per fused part) equals ``optax.contrib.muon`` on that matrix alone, on one device and
on expert-parallel and ZeRO meshes, whose compiled update gathers no weight set; a Muon run resumes
bit for bit, and switching the optimizer of a run needs ``reset_optimizer``."""

import glob
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moefast.config import ConfigError, load_config
from moefast.parallel import make_mesh, shardings
from moefast.train import optimizer as opt
from moefast.train.checks import check_run
from moefast.train.step import ModelDef, learning_rate_schedule, make_optimizer

MUON = ["train.optimizer=muon", "train.grad_clip=0", "train.warmup_steps=0"]
# every kind of Muon matrix in one small model: GQA attention with an output gate, a dense first
# layer, a shared expert beside the routed ones
KINDS = ["model.num_dense_layers=1", "model.num_layers=3", "moe.shared_expert_d_ff=32",
         "model.attention_output_gate=true", "model.num_kv_heads=1"]


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_has_a_kind_for_each_parameter(path):
    """Hidden matrices get Muon, split as Hugging Face keeps them; the rest AdamW (PARAM_KINDS)."""
    cfg = load_config(path, ["train.optimizer=muon"])
    specs = opt.muon_specs(cfg)
    names = {p[-1]: s for p, s in specs.items()}
    for adam in ("embed", "lm_head", "router", "scale", "router_bias", "sinks", "A_log", "dt_bias", "conv"):
        assert names.get(adam) is None, adam
    for p, s in specs.items():  # q, k and v (k and q with keys as values): each its own matrix
        if p[-1] in ("qkv", "qk"):
            assert len(s.parts) == len(p[-1]) and s.parts[0] % cfg.model.num_heads == 0, p
            assert s.parts[1:] == (s.parts[1],) * (len(p[-1]) - 1), p
    for p, s in specs.items():
        if p[-1] in ("w_in", "shared_w_in"):  # gate and up: two matrices; relu² (not gated): one
            moe = "expert" in s.names or p[-1] == "shared_w_in"
            gated = cfg.moe.gated if moe else cfg.model.dense_activation != "relu2"
            assert len(s.parts) == (2 if gated else 1) and s.parts[0] == s.parts[-1], p
        if p[-1] in ("kv_b_proj", "o_proj", "eh_proj", "w_out"):
            assert s is not None and len(s.parts) == 1, p


def test_an_unknown_parameter_is_a_clear_error(small_config, devices, monkeypatch):
    cfg = small_config("train.optimizer=muon")
    monkeypatch.setitem(opt.PARAM_KINDS, "Attention", {k: v for k, v in opt.PARAM_KINDS["Attention"].items()
                                                        if k != "out"})
    opt.muon_specs.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"blocks/0/attn/out \(Attention.out.*PARAM_KINDS"):
            check_run(cfg, make_mesh(cfg, devices[:1]))
    finally:
        opt.muon_specs.cache_clear()
    with pytest.raises(ConfigError, match="lora"):
        check_run(small_config("train.optimizer=muon", "lora.rank=4"), make_mesh(cfg, devices[:1]))
    with pytest.raises(ConfigError, match="train.qk_clip"):
        small_config("train.qk_clip=-1")


def _two_updates(cfg, devices=None):
    """Muon's second update (momentum from two random gradients) of the initial parameters, and
    the compiled update's HLO and per-device FLOPs under the mesh."""
    md = ModelDef(cfg, 259)
    params = md.init_params(0)
    grads = [jax.tree.map(lambda p, k=k: jax.random.normal(jax.random.key(k), p.shape), params) for k in (1, 2)]
    tx = make_optimizer(cfg)
    if devices is None:
        update = jax.jit(tx.update)
        _, state = update(grads[0], tx.init(params), params)
        return params, grads, update(grads[1], state, params)[0], None
    mesh = make_mesh(cfg, devices)
    put = lambda t: jax.device_put(t, shardings(mesh, md.param_state_specs(mesh)))
    with jax.set_mesh(mesh):
        p, g0, g1 = put(params), put(grads[0]), put(grads[1])
        update = jax.jit(tx.update)
        _, state = update(g0, jax.jit(tx.init)(p), p)
        compiled = update.lower(g1, state, p).compile()
        return params, grads, jax.tree.map(np.asarray, update(g1, state, p)[0]), compiled


def test_each_matrix_update_equals_optax_muon_on_every_mesh(small_config, devices):
    """Per expert and per fused part, 1e-6 from ``optax.contrib.muon`` (Moonlight's scale, weight
    decay, the run's schedule) on that matrix alone; data 2 x expert 4 and fsdp 2 x expert 2 x
    data 2 equal one device, their compiled update all-gathers nothing and each device does an
    eighth of the Newton-Schulz work (padding aside)."""
    cfg = small_config(*KINDS, *MUON)
    params, grads, got, _ = _two_updates(cfg)
    ref_tx = optax.contrib.muon(learning_rate_schedule(cfg), weight_decay=cfg.train.weight_decay, consistent_rms=0.2)

    @jax.jit
    @jax.vmap  # each matrix alone: optax's Muon on a 2-D parameter, once per expert
    def reference(w, g0, g1):
        state = ref_tx.init(w)
        for g in (g0, g1):
            update, state = ref_tx.update(g, state, w)
        return update

    checked = set()
    for path, spec in opt.muon_specs(cfg).items():
        if spec is None:
            continue
        bounds = np.cumsum((0, *spec.parts))
        for a, b in zip(bounds[:-1], bounds[1:]):  # each fused part: [E or 1, in, out_p]
            pick = lambda t: _get(t, path).reshape(-1, *_get(t, path).shape[-2:])[..., a:b]
            np.testing.assert_allclose(pick(got), reference(pick(params), *map(pick, grads)), rtol=0, atol=1e-6,
                                       err_msg=str(path))
        checked.add(path[-1])
    assert {"qkv", "gate", "out", "w_in", "w_out", "shared_w_in", "shared_w_out"} <= checked
    flops = {}
    for mesh in (["mesh.data=2", "mesh.expert=4"], ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=2"]):
        _, _, sharded, compiled = _two_updates(small_config(*KINDS, *MUON, *mesh), devices)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(sharded)[0], jax.tree.leaves(got)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"{mesh} {jax.tree_util.keystr(path)}")
        hlo = compiled.as_text()
        assert " all-gather(" not in hlo and " all-gather-start(" not in hlo, mesh
        assert " all-to-all(" in hlo, mesh  # whole matrices moved to their home devices and back
        flops[tuple(mesh)] = compiled.cost_analysis()["flops"]
    single = jax.jit(make_optimizer(cfg).update).lower(grads[0], make_optimizer(cfg).init(params), params)
    one = single.compile().cost_analysis()["flops"]
    assert all(f < one / 5 for f in flops.values()), (one, flops)


def test_a_switch_of_optimizer_needs_reset(small_config, tmp_path):
    """A Muon run with FP8 GEMMs on context 2 x data 4 (its bit-exact resume is test_train.py's
    test_resume_is_exact). Resuming it with AdamW is refused, nothing written; with
    ``reset_optimizer`` it goes on from the checkpoint's weights with a fresh AdamW state and the
    learning-rate schedule where it was."""
    from moefast.data import load_corpus
    from moefast.train import CheckpointError, Trainer

    common = [*KINDS, "mesh.context=2", "model.precision=fp8", "train.log_every=1", "train.eval_every=0",
              "train.checkpoint_every=0"]
    cfg = small_config(*common, "train.optimizer=muon", "train.steps=4")
    corpus = load_corpus(cfg.data)
    lines = []
    Trainer(cfg, tmp_path, log=lines.append, progress=False, corpus=corpus).run()
    assert any(line.startswith("optimizer: muon on ") for line in lines)
    switched = [*common, "train.optimizer=adamw", "train.steps=6"]
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="train.optimizer=muon.*--reset-optimizer"):
        Trainer(small_config(*switched), tmp_path, log=None, progress=False, corpus=corpus).run()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    lines = []
    Trainer(small_config(*switched), tmp_path, log=lines.append, progress=False, corpus=corpus,
            reset_optimizer=True).run()
    assert any("--reset-optimizer: a fresh adamw state (was muon)" in line and "update 4" in line for line in lines)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6] and all(np.isfinite(r["loss"]) for r in resumed)
    lr = learning_rate_schedule(small_config(*switched))
    assert resumed[-1]["learning_rate"] == pytest.approx(float(lr(5)))
