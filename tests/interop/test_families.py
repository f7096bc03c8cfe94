"""A Hugging Face family is one :class:`~moefast.interop.families.FamilySpec` (no torch needed).

A made-up family, built in the test from Mixtral's spec with other tensor names, another bias key and
no fused layout, is registered under a new ``model_type``: a tiny model round-trips through
``save_hf`` / ``load_hf`` exactly, with that family's names on disk, without touching the engine.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.config import PARAMETER_KEYS, load_config
from moefast.interop import families, hf

TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.d_ff=24", "model.max_seq_len=256", "model.vocab_size=96", "moe.num_experts=4", "moe.top_k=2",
        "model.attention_bias=all", "moe.norm_topk_prob=true"]


def _renamed(table, old: str, new: str):
    return {p: dataclasses.replace(t, names=tuple(n.replace(old, new) for n in t.names)) for p, t in table.items()}


def _toy_spec() -> families.FamilySpec:
    """Mixtral's spec as another family: GPT-2-like names, biases on all four projections."""
    mixtral = families.REGISTRY["mixtral"]
    layer = _renamed(_renamed(mixtral.layer_tensors, "model.layers.", "transformer.h."), "self_attn.", "attn.")
    moe = _renamed(mixtral.moe_tensors["per_expert"], "model.layers.", "transformer.h.")
    return dataclasses.replace(
        mixtral, model_type="toy_moe", architecture="ToyMoeForCausalLM", name="Toy-MoE",
        attention_bias=families.BiasKey("use_bias", "all"), layer_tensors=layer, moe_tensors={"per_expert": moe},
        global_tensors=_renamed(mixtral.global_tensors, "model.embed_tokens", "transformer.wte"))


def _random_params(cfg):
    shapes = hf._abstract_params(cfg, cfg.model.vocab_size)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), shapes)


def _fields(cfg):
    return {(sec, k): getattr(getattr(cfg, sec), k) for sec, keys in PARAMETER_KEYS.items() for k in keys}


def test_a_new_family_is_one_registry_entry(tmp_path, monkeypatch):
    monkeypatch.setitem(families.REGISTRY, "toy_moe", _toy_spec())
    cfg = load_config(None, TINY)
    assert hf.hf_family(cfg) == "toy_moe"  # Mixtral has no attention biases
    assert hf.FAMILIES["toy_moe"] == "ToyMoeForCausalLM"
    params = _random_params(cfg)

    out = hf.save_hf(cfg, params, tmp_path / "toy")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"], written["use_bias"]) == ("toy_moe", ["ToyMoeForCausalLM"],
                                                                                     True)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert {"transformer.wte.weight", "transformer.h.1.attn.o_proj.bias",
            "transformer.h.0.block_sparse_moe.experts.3.w2.weight"} <= names
    assert not any(n.startswith("model.layers.") for n in names)

    cfg2, params2 = hf.load_hf(out)
    assert _fields(cfg2) == _fields(cfg)
    assert (cfg2.moe.top_k, cfg2.moe.norm_topk_prob) == (cfg.moe.top_k, cfg.moe.norm_topk_prob)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), params, params2)
    with pytest.raises(hf.HFFormatError, match="no 'fused' expert layout"):
        hf.save_hf(cfg, params, tmp_path / "fused", layout="fused")


def test_unknown_model_type_is_one_error_naming_the_supported_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "jamba", "hidden_size": 32}))
    with pytest.raises(hf.HFFormatError, match="model_type 'jamba' is not supported") as e:
        hf.config_from_hf(tmp_path)
    assert all(t in str(e.value) for t in families.REGISTRY), str(e.value)
    with pytest.raises(hf.HFFormatError, match="not supported"):
        hf.load_hf_params(tmp_path, load_config(None, TINY))


def test_a_model_no_family_represents_names_each_familys_objection():
    cfg = load_config(None, TINY + ["moe.norm_topk_prob=false"])  # biases and raw gates: none of the four
    with pytest.raises(hf.HFFormatError, match="no Hugging Face family") as e:
        hf.hf_family(cfg)
    written = [t for t, spec in families.REGISTRY.items() if not spec.export_as]  # kimi_k2 is deepseek_v3
    assert all(f"as {t} it has" in str(e.value) for t in written) and "kimi_k2" not in str(e.value), str(e.value)
    assert "Mixtral always renormalises" in str(e.value)


@pytest.mark.parametrize("extra", [["model.attention=mla"], ["model.partial_rotary_factor=0.5"],
                                   ["model.rope_type=yarn", "model.rope_factor=4", "model.original_max_position_embeddings=32"]])
def test_attention_variants_without_a_family_are_refused(extra):
    """MLA and YaRN only DeepSeek-V3's family represents, partial rotary only GLM-4.5's: a softmax
    model with them is refused with the field named rather than written as a model that differs."""
    field = extra[0].split("=")[0]
    with pytest.raises(hf.HFFormatError, match=f"(?s)no Hugging Face family.*{field}=") as e:
        hf.hf_family(load_config(None, [t for t in TINY if "kv_heads" not in t and "bias" not in t] + extra))
    assert f"as mixtral it has {field}=" in str(e.value) or f"; {field}=" in str(e.value), str(e.value)


def test_registry_specs_are_complete():
    for model_type, spec in families.REGISTRY.items():
        assert spec.model_type == model_type
        assert {("ffn", "router"), ("ffn", "w_in"), ("ffn", "w_out")} <= set(spec.moe_tensors["per_expert"])
    with pytest.raises(ValueError, match="hf_defaults lacks"):
        dataclasses.replace(families.REGISTRY["mixtral"], hf_defaults={"rope_theta": 1e4})


# ------------------------------------------- DeepSeek-style keys: dense first layers, router, selection bias
V3_TINY = ["model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
           "model.d_ff=24", "model.dense_d_ff=40", "model.num_dense_layers=1", "model.max_seq_len=256",
           "model.vocab_size=260", "moe.num_experts=8", "moe.top_k=2", "moe.norm_topk_prob=true", "moe.score_func=sigmoid",
           "moe.num_groups=4", "moe.topk_groups=2", "moe.routed_scaling_factor=2.5", "moe.shared_expert_d_ff=48",
           "moe.shared_expert_gate=false"]


def _v3_like_spec() -> families.FamilySpec:
    """A made-up family with every DeepSeek-style key: the first layers dense, sigmoid routing with
    group limits, gate scaling and a selection bias, ungated shared experts counted in expert widths,
    ``scoring_func`` / ``topk_method`` written."""
    qwen = families.REGISTRY["qwen2_moe"]
    return dataclasses.replace(
        qwen, model_type="toy_v3", architecture="ToyV3ForCausalLM", name="Toy-V3", attention_bias=None,
        hf_defaults={**qwen.hf_defaults, "routed_scaling_factor": 1.0, "n_shared_experts": 1},
        moe_layers=families.FirstKDense(default=1),
        shared_expert=families.SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=families.Router("sigmoid", {"noaux_tc": True, "greedy": False}, "noaux_tc", write_method=True,
                               scaling_key="routed_scaling_factor",
                               selection_bias="model.layers.{i}.mlp.gate.e_score_correction_bias"),
        moe_tensors=families._moe_tables(shared="mlp.shared_experts."), export_constants={})


@pytest.fixture
def v3_family(monkeypatch):
    """Only the toy V3-like family is registered (no other family can take its models)."""
    monkeypatch.setattr(families, "REGISTRY", {"toy_v3": _v3_like_spec()})
    cfg = load_config(None, V3_TINY)
    params = _random_params(cfg)
    from moefast.model import init_routing_state

    routing = {k: np.array(v) for k, v in init_routing_state(cfg).items()}
    routing["bias"] = np.random.default_rng(1).standard_normal(routing["bias"].shape).astype(np.float32)
    return cfg, params, routing


def _edited(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    written = json.loads((dst / "config.json").read_text())
    written.update(changes)
    (dst / "config.json").write_text(json.dumps(written))
    return dst


def test_dense_first_layers_router_keys_and_selection_bias_round_trip(v3_family, tmp_path):
    cfg, params, routing = v3_family
    out = hf.save_hf(cfg, params, tmp_path / "v3", routing_state=routing, dtype="bfloat16")
    written = json.loads((out / "config.json").read_text())
    assert {k: written[k] for k in ("first_k_dense_replace", "intermediate_size", "moe_intermediate_size",
                                    "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                                    "scoring_func", "topk_method", "norm_topk_prob")} == {
        "first_k_dense_replace": 1, "intermediate_size": 40, "moe_intermediate_size": 24, "n_shared_experts": 2,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "norm_topk_prob": True}
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        bias = [f.get_tensor(f"model.layers.{i}.mlp.gate.e_score_correction_bias") for i in (1, 2)]
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.gate.") for n in names)  # the dense layer has no router
    assert all(b.dtype == np.float32 for b in bias)  # the bias stays float32 in a bf16 export
    np.testing.assert_array_equal(np.stack(bias), routing["bias"])

    cfg2, params2 = hf.load_hf(out)
    assert _fields(cfg2) == _fields(cfg)
    assert cfg2.moe == cfg.moe and cfg2.model.num_dense_layers == 1 and cfg2.model.dense_d_ff == 40
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.astype(jnp.bfloat16).astype(np.float32), np.asarray(b)),
                 params, params2)
    routing2 = hf.load_hf_routing(out, cfg2)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), routing, routing2)

    # topk_method greedy ignores the groups; another score function or method is refused by name
    greedy = hf.config_from_hf(_edited(out, tmp_path / "greedy", topk_method="greedy"))
    assert (greedy.moe.num_groups, greedy.moe.topk_groups) == (1, 1)
    for key, value in (("scoring_func", "softmax"), ("topk_method", "group_limited_greedy")):
        with pytest.raises(hf.HFFormatError, match=f"{key}='{value}'"):
            hf.config_from_hf(_edited(out, tmp_path / value, **{key: value}))
    with pytest.raises(hf.HFFormatError, match="pass routing_state"):
        hf.save_hf(cfg, params, tmp_path / "no-bias")
    no_limit = dataclasses.replace(cfg.moe, topk_groups=4)  # every group kept: topk_method noaux_tc all the same
    hf.save_hf(cfg.replace(moe=no_limit), params, tmp_path / "all-groups", routing_state=routing)
    assert json.loads((tmp_path / "all-groups" / "config.json").read_text())["topk_group"] == 4


def test_families_without_the_routing_keys_refuse_them(tmp_path):
    plain = [t for t in TINY if t != "model.attention_bias=all"]
    cfg = load_config(None, plain)  # Mixtral: softmax top-k, no selection bias
    params = _random_params(cfg)
    from moefast.model import init_routing_state

    routing = {k: np.array(v) for k, v in init_routing_state(cfg).items()}
    hf.save_hf(cfg, params, tmp_path / "zero", routing_state=routing)  # a zero bias is no bias
    routing["bias"][0, 1] = 0.5
    with pytest.raises(hf.HFFormatError, match="non-zero selection bias"):
        hf.save_hf(cfg, params, tmp_path / "bias", routing_state=routing)
    for extra, said in ((["moe.aux_free_bias_rate=0.001"], "has no selection bias"),
                        (["moe.routed_scaling_factor=2.0"], "never scales"),
                        (["moe.num_groups=2", "moe.topk_groups=1"], "no group-limited routing"),
                        (["moe.score_func=sigmoid"], "scores experts by softmax"),
                        (["model.num_layers=3", "model.num_dense_layers=1", "model.moe_every=2"], "dense layers")):
        with pytest.raises(hf.HFFormatError, match=said):
            hf.hf_family(load_config(None, plain + extra))


def test_first_k_dense_refuses_dense_layers_between_moe_layers(v3_family):
    cfg, _, _ = v3_family
    spaced = cfg.replace(model=dataclasses.replace(cfg.model, moe_every=2))  # dense, MoE, dense
    with pytest.raises(hf.HFFormatError, match="dense layers after the first MoE layer"):
        hf.hf_family(spaced)
    with pytest.raises(hf.HFFormatError, match="not a multiple of model.d_ff"):
        hf.hf_family(cfg.replace(moe=dataclasses.replace(cfg.moe, shared_expert_d_ff=30)))


def test_import_hf_puts_the_selection_bias_in_the_routing_state_and_export_writes_it(v3_family, tmp_path, capsys):
    """``moefast import-hf`` -> the step-0 checkpoint's routing state holds the imported bias (not
    the parameters); ``moefast export-hf`` writes it back bit for bit."""
    from moefast import cli
    from moefast.train import Trainer, load_run_config

    cfg, params, routing = v3_family
    src = hf.save_hf(cfg, params, tmp_path / "src", routing_state=routing)
    assert cli.main(["import-hf", str(src), "--run-dir", str(tmp_path / "run")]) == 0
    said = capsys.readouterr().out
    assert "selection bias (e_score_correction_bias) is the run's routing state" in said
    assert "moe.aux_free_bias_rate=0.0: it stays as imported" in said  # configs/tiny.yaml's rate
    assert "config.json gives the byte tokenizer's PAD/BOS/EOS ids (256/257/258" in said  # moefast's own export
    assert "not the tokenizer the model was trained with" not in said
    trainer = Trainer(load_run_config(tmp_path / "run"), tmp_path / "run", progress=False)
    step, params2, routing2 = trainer.restore_params()
    assert step == 0 and routing2["bias"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(routing2["bias"]), routing["bias"])
    assert not any("bias" in str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params2)[0])
    assert json.loads((tmp_path / "run" / cli.IMPORTED_FROM).read_text())["model_type"] == "toy_v3"
    assert cli.main(["export-hf", "--run-dir", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    routing3 = hf.load_hf_routing(tmp_path / "out", hf.config_from_hf(tmp_path / "out"))
    np.testing.assert_array_equal(np.asarray(routing3["bias"]), routing["bias"])


def _signals_fail_the_test():
    """SIGINT / SIGTERM handlers that fail the test (not the test process) if one reaches them:
    ``moefast import-hf`` takes both itself and puts these back."""
    import signal

    def unhandled(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the test's handler")

    return {sig: signal.signal(sig, unhandled) for sig in (signal.SIGINT, signal.SIGTERM)}, unhandled


@pytest.mark.parametrize("sig,how", [("SIGINT", "swallowed"), ("SIGTERM", "raised"), ("SIGINT", "during the write")])
def test_a_signal_before_import_hf_commits_aborts_it_even_if_swallowed(v3_family, tmp_path, monkeypatch, capsys,
                                                                      sig, how):
    """Ctrl-C (or SIGTERM) before the import commits: nothing is left, one line, 130 (143).
    ``swallowed``: after step 0 is written, the signal arrives in a gc callback, where Python drops
    the ``KeyboardInterrupt`` (as in JAX's ``_xla_gc_callback``): the import must still stop.
    ``during the write``: taken once step 0 is written (orbax's threads would write on into the
    directory being removed), then it is removed."""
    import gc
    import os
    import signal

    from moefast import cli
    from moefast.train import Trainer

    cfg, params, routing = v3_family
    src = hf.save_hf(cfg, params, tmp_path / "src", routing_state=routing)
    run, real_initialize, real_settle, written, fired = (tmp_path / "run", Trainer.initialize,
                                                         cli._ImportSignals.settle, [], [])

    def send():
        fired.append(sig)
        os.kill(os.getpid(), signal.Signals[sig])

    def initialize(self, *args, **kwargs):
        if how == "during the write" and not fired:
            send()
        written.append(real_initialize(self, *args, **kwargs))
        return written[-1]

    def settle(self):  # once step 0 and imported_from.json are written: the signal comes just before the commit
        if how != "during the write" and (run / "checkpoints" / "0").is_dir() and not fired:
            if how == "raised":
                send()
            else:
                def in_gc(phase, info):
                    if phase == "start":
                        send()

                gc.callbacks.append(in_gc)
                try:
                    gc.collect()
                finally:
                    gc.callbacks.remove(in_gc)
        real_settle(self)

    monkeypatch.setattr(Trainer, "initialize", initialize)
    monkeypatch.setattr(cli._ImportSignals, "settle", settle)
    previous, unhandled = _signals_fail_the_test()
    try:
        code = cli.main(["import-hf", str(src), "--run-dir", str(run)])
        assert all(signal.getsignal(s) is unhandled for s in previous)  # import-hf put them back
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    out, err = capsys.readouterr()
    assert fired and written and code == (143 if sig == "SIGTERM" else 130), (code, out, err)
    assert err == f"interrupted{' (SIGTERM)' if sig == 'SIGTERM' else ''}: nothing was imported into {run}\n", err
    assert "imported toy_v3" not in out and not run.exists()
    assert cli.main(["import-hf", str(src), "--run-dir", str(run)]) == 0  # a retry starts afresh


def test_a_signal_after_import_hf_commits_changes_nothing(v3_family, tmp_path, monkeypatch, capsys):
    """Ctrl-C once the import has committed (step 0 and imported_from.json written), before and after
    the line saying so: exit 0 as printed, the run complete."""
    import builtins
    import os
    import signal

    from moefast import cli
    from moefast.cli import hf as cli_hf
    from moefast.train import Trainer, load_run_config

    cfg, params, routing = v3_family
    src = hf.save_hf(cfg, params, tmp_path / "src", routing_state=routing)
    run, said = tmp_path / "run", []

    def interrupted_print(*args, **kwargs):
        done = bool(args) and str(args[0]).startswith("imported toy_v3")
        if done:
            os.kill(os.getpid(), signal.SIGINT)
        builtins.print(*args, **kwargs)
        if done:
            said.append(args[0])
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cli_hf, "print", interrupted_print, raising=False)  # where import-hf prints
    previous, unhandled = _signals_fail_the_test()
    try:
        code = cli.main(["import-hf", str(src), "--run-dir", str(run)])
        assert all(signal.getsignal(s) is unhandled for s in previous)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    out, err = capsys.readouterr()
    assert said and code == 0 and "interrupted" not in err, (code, out, err)
    assert (run / cli.IMPORTED_FROM).is_file() and (run / "config.yaml").is_file()
    step, params2, _ = Trainer(load_run_config(run), run, progress=False).restore_params()
    assert step == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), params, params2)
