"""A LoRA run out and in (moefast.interop.hf_adapter) against PEFT 0.21 and transformers themselves.

For tiny random transformers models of six families (Qwen3-MoE with a dense first layer,
Qwen3.5-MoE's hybrid text model, Qwen3-Next, gpt-oss, DeepSeek-V3 with MLA and a shared expert,
Mixtral), the
model is saved, imported with adapters on every kind of projection (float32 base), and every
adapter's A and B drawn at random. Then:

* the PEFT adapter, put on transformers' model by ``PeftModel.from_pretrained``, gives moefast's
  logits (1e-4), with no PEFT key missing or unexpected;
* the merged export loads in transformers and gives them too; each expert's merged tensor minus
  the base is non-zero and equals PEFT's own delta and ``(alpha / r) A_e B_e`` written by the
  family's table;
* reading the adapter back gives the run's adapters bit for bit (either layer layout), and the
  lora section it implies; an adapter PEFT trained continues in moefast with PEFT's logits;
* what a PEFT adapter cannot hold, and adapters that do not fit the run, are one clear error.
"""

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
peft = pytest.importorskip("peft", reason="peft (a test dependency) is not installed")

from moefast.config import LoRAConfig  # noqa: E402
from moefast.interop import families, hf, hf_adapter  # noqa: E402
from moefast.interop.hf_read import _flat_paths  # noqa: E402
from moefast.interop.hf_tables import _leaves  # noqa: E402
from moefast.model import lora  # noqa: E402
from moefast.model.layout import to_layout  # noqa: E402
from moefast.train.step import ModelDef  # noqa: E402

V, B, T = 272, 2, 24  # V above the byte tokenizer's 259 ids: import-hf takes it
COMMON = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, num_experts_per_tok=2, tie_word_embeddings=False)
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
FAMILIES = {  # transformers config, moefast lora overrides (ranks, scales: r != expert rank, alpha != r somewhere)
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        mlp_only_layers=[0], attention_bias=True), ["lora.rank=4", "lora.alpha=8", "lora.expert_rank=2"]),
    # Gated DeltaNet then gated full attention (q_proj holds the query and the output gate: two
    # moefast adapters, stacked at rank 2r), a gated shared expert
    "qwen3_5_moe_text": (lambda: transformers.Qwen3_5MoeTextConfig(
        **{**COMMON, "head_dim": 32}, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True}), ["lora.rank=3", "lora.alpha=5"]),
    # Qwen3-Next's projections grouped per key head: in_proj_qkvz holds two parts of moefast's
    # in_proj (q|k|v and z), in_proj_ba two more, q_proj the query and the gate (Parts of two
    # parameters): each stacked; a dense first layer
    "qwen3_next": (lambda: transformers.Qwen3NextConfig(
        **{**COMMON, "head_dim": 32}, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96,
        mlp_only_layers=[0], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4), ["lora.rank=2", "lora.alpha=3"]),
    # experts applied as x @ w (PEFT's is_transposed), gate/up interleaved, biases, sinks
    "gpt_oss": (lambda: transformers.GptOssConfig(
        **COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=4, sliding_window=8),
        ["lora.rank=2", "lora.expert_rank=3"]),
    # MLA with interleaved RoPE columns (a column permutation of q_b_proj and kv_a_proj_with_mqa)
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(
        **{k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "head_dim")}, **MLA,
        num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1, rope_interleave=True),
        ["lora.rank=4", "lora.alpha=16", "lora.expert_rank=2"]),
    "mixtral": (lambda: transformers.MixtralConfig(**COMMON, num_hidden_layers=1, intermediate_size=32,
                                                   num_local_experts=4), ["lora.rank=2"]),
}
ZERO_CENTRED = ("qwen3_next", "qwen3_5_moe_text")  # norms applied as 1 + w (the gated DeltaNet's own: w)


def _hf_model(family):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]()).float().eval()
    with torch.no_grad():  # defaults (norms 1 or 0, biases 0) hide mappings: randomise them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if family in ZERO_CENTRED and "linear_attn" not in name else 1.0)
                        + 0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks", "A_log", "dt_bias")):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@dataclasses.dataclass
class Run:
    family: str
    hf_dir: object  # its directory
    model: object  # transformers' base model
    cfg: object
    base: dict  # the imported base model's parameters
    params: dict  # the adapted model's, every adapter random
    routing: dict
    logits: np.ndarray  # moefast's [B, T, V]
    adapter: object  # its PEFT adapter directory
    peft_model: object  # PeftModel.from_pretrained(model, adapter)


def _tokens():
    return np.random.default_rng(0).integers(0, V, (B, T))


def _logits(model):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(_tokens()), attention_mask=torch.ones(B, T, dtype=torch.long))
    return out.logits.numpy()


def _random_adapters(params, seed=1):
    rng = np.random.default_rng(seed)
    return lora._walk(params, lambda p, v: jnp.asarray(0.2 * rng.standard_normal(v.shape), v.dtype)
                      if lora.is_adapter(p) else v)


@pytest.fixture(scope="module", params=list(FAMILIES))
def run(request, tmp_path_factory):
    family = request.param
    model = _hf_model(family)
    d = tmp_path_factory.mktemp(family)
    model.save_pretrained(d)
    cfg = hf.config_from_hf(d, [*FAMILIES[family][1], "lora.base_dtype=float32"])
    md = ModelDef(cfg, V)
    base = hf.load_hf_params(d, cfg)
    params = _random_adapters(lora.from_base(cfg.lora, base, md.init_params(0)))
    routing = hf.load_hf_routing(d, cfg)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(md.module(params)(jnp.asarray(_tokens()), segment_ids_bt=jnp.ones((B, T), jnp.int32),
                                              drop_tokens=False, routing_state=routing).logits)
    adapter = hf_adapter.save_peft_adapter(cfg, params, tmp_path_factory.mktemp(family + "-adapter") / "a",
                                           family=family)  # as export-hf: the family imported from
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter).eval()
    return Run(family, d, model, cfg, base, params, routing, logits, adapter, peft_model)


def test_peft_adapter_gives_moefast_logits(run):
    sd = run.peft_model.state_dict()
    from safetensors.numpy import load_file

    saved = load_file(str(run.adapter / "adapter_model.safetensors"))
    for key, x in saved.items():  # every tensor in place, none left over
        np.testing.assert_array_equal(sd[key.replace(".weight", ".default.weight")].numpy(), x, err_msg=key)
    assert sum(".lora_" in k for k in sd) == len(saved)
    got = _logits(run.peft_model)
    np.testing.assert_allclose(run.logits, got, atol=1e-4, rtol=0)
    assert np.abs(got - _logits(run.model)).max() > 0.1  # the adapters change the model


def _experts_of(model):
    return {n: m for n, m in model.named_modules() if n.endswith("experts") and hasattr(m, "down_proj")}


def test_merged_export_gives_moefast_logits_and_each_experts_delta(run, tmp_path):
    out = hf.save_hf(run.cfg, run.params, tmp_path / "merged", routing_state=run.routing, layout="fused",
                     family=run.family)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(run.logits, _logits(merged), atol=1e-4, rtol=0)
    base_sd, merged_sd = run.model.state_dict(), merged.state_dict()
    # PEFT's own delta of each experts' tensor (the ParamWrappers, outer down_proj around gate_up_proj)
    wrappers = {f"{n.replace('base_model.model.', '').replace('.base_layer', '')}.{m.parameter_name}": m
                for n, m in run.peft_model.named_modules() if hasattr(m, "parameter_name") and m.num_experts > 1}
    cfg = run.cfg.replace(lora=LoRAConfig())
    unrolled = dict(_flat_paths(run.params))
    leaves = _leaves(families.REGISTRY[run.family], cfg, "fused",
                     {p: v.shape for p, v in unrolled.items() if not lora.is_adapter(p)})
    checked = 0
    for path, leaf in leaves.items():
        if not leaf.expert_axis or path[-1] not in ("w_in", "w_out"):
            continue
        a, b = (np.asarray(unrolled[path[:-1] + (path[-1] + s,)]) for s in (lora.LORA_A, lora.LORA_B))
        ((name, want),) = leaf.write(run.cfg.lora.scale("experts") * np.einsum("eir,ero->eio", a, b))
        delta = (merged_sd[name] - base_sd[name]).numpy()
        np.testing.assert_allclose(delta, want, atol=1e-6, rtol=0, err_msg=name)
        np.testing.assert_allclose(delta, wrappers[name].get_delta_weight("default").detach().numpy(), atol=1e-6,
                                   rtol=0, err_msg=name)
        assert np.all(np.abs(delta).max(axis=(1, 2)) > 1e-3), f"{name}: an expert without a delta"
        checked += 1
    assert checked == 2 * sum(run.cfg.model.is_moe_layer(i) for i in range(run.cfg.model.num_layers))


def test_adapter_reads_back_exactly_with_the_lora_section_it_implies(run, tmp_path):
    cfg = run.cfg
    kinds = {lora.TARGETS[type(m).__name__][n] for _, m, n in lora.adapted(ModelDef(cfg, V).module(run.params))}
    derived = hf_adapter.adapter_lora_config(cfg.replace(lora=LoRAConfig(base_dtype="float32")), run.adapter,
                                               family=run.family)
    assert derived == dataclasses.replace(cfg.lora, targets=derived.targets) and set(derived.targets) == kinds
    assert hf_adapter.adapter_lora_config(cfg, run.adapter, family=run.family) == cfg.lora
    fresh = lora.from_base(cfg.lora, run.base, ModelDef(cfg, V).init_params(3))  # other A, B = 0
    notes = []
    back = hf_adapter.load_peft_adapter(cfg, run.adapter, fresh, family=run.family, log=notes.append)
    want, got = dict(_flat_paths(run.params)), dict(_flat_paths(back))
    adapters = [p for p in want if lora.is_adapter(p)]
    assert adapters and sorted(got, key=str) == sorted(want, key=str)
    for p in adapters:
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(want[p]), err_msg=str(p))
    assert len(notes) == 1 and notes[0].startswith("read ") and "fresh" not in notes[0], notes
    # the scanned layer layout (model.scan_layers) writes the same adapter and reads back into its own
    scanned_cfg = cfg.replace(model=dataclasses.replace(cfg.model, scan_layers=True))
    scanned = to_layout(run.params, cfg.model, scanned=True)
    again = hf_adapter.save_peft_adapter(scanned_cfg, scanned, tmp_path / "scanned", family=run.family)
    assert _tensors(again).keys() == _tensors(run.adapter).keys()
    for name, x in _tensors(run.adapter).items():
        np.testing.assert_array_equal(_tensors(again)[name], x, err_msg=name)
    back = hf_adapter.load_peft_adapter(scanned_cfg, run.adapter, to_layout(fresh, cfg.model, scanned=True),
                                        family=run.family)
    assert jax.tree.structure(back) == jax.tree.structure(scanned)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, scanned)


def _tensors(adapter):
    from safetensors.numpy import load_file

    return load_file(str(adapter / "adapter_model.safetensors"))


@pytest.mark.parametrize("run", ["qwen3_5_moe_text"], indirect=True)
def test_a_peft_trained_adapter_continues_in_moefast(run, tmp_path):
    """An adapter PEFT made (one A for q_proj, whose rows are two moefast adapters: the query of
    ``qkv`` and the output ``gate``; the experts at their own rank): the run's lora section comes
    from it, the sites it leaves out keep fresh adapters, and moefast computes PEFT's logits."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "in_proj_qkv"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                             rank_pattern={"experts.gate_up_proj": 4, "experts.down_proj": 4})
    trained = peft.get_peft_model(copy.deepcopy(run.model), config)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    trained.save_pretrained(tmp_path / "trained")
    base_cfg = run.cfg.replace(lora=LoRAConfig(base_dtype="float32"))
    lc = hf_adapter.adapter_lora_config(base_cfg, tmp_path / "trained", family=run.family)
    assert (lc.rank, lc.alpha, lc.expert_rank, lc.targets) == (2, 3.0, 4, ("attention", "experts"))
    cfg = base_cfg.replace(lora=lc)
    notes = []
    params = hf_adapter.load_peft_adapter(cfg, tmp_path / "trained", lora.from_base(lc, run.base, ModelDef(
        cfg, V).init_params(0)), family=run.family, log=notes.append)
    assert "read 6 of the 13 adapted sites" in notes[0] and "keep fresh adapters (B = 0)" in notes[0], notes
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ModelDef(cfg, V).module(params)(jnp.asarray(_tokens()), segment_ids_bt=jnp.ones(
            (B, T), jnp.int32), drop_tokens=False).logits)
    np.testing.assert_allclose(got, _logits(trained.eval()), atol=1e-4, rtol=0)


@pytest.mark.parametrize("run", ["deepseek_v3"], indirect=True)
def test_what_a_peft_adapter_cannot_hold_is_one_clear_error(run, tmp_path):
    cfg = run.cfg
    trains = cfg.replace(lora=dataclasses.replace(cfg.lora, train=("router",)))
    with pytest.raises(hf.HFFormatError, match=r"lora.train=\['router'\] trains those parameters in full, and a PEFT "
                                               r"LoRA adapter holds only the low-rank adapters; export the merged"):
        hf_adapter.save_peft_adapter(trains, run.params, tmp_path / "a")
    mtp = cfg.replace(model=dataclasses.replace(cfg.model, mtp_depth=1))
    with pytest.raises(hf.HFFormatError, match=r"DeepSeek-V3's mtp/0/block/attn/q_a_proj \(lora.targets: attention\) "
                                               r"cannot be expressed as a PEFT adapter: transformers' "
                                               r"DeepseekV3ForCausalLM has no multi-token-prediction layers"):
        hf_adapter.save_peft_adapter(mtp, ModelDef(mtp, V).abstract_params, tmp_path / "b")
    with pytest.raises(ValueError, match=r"no adapters \(lora.rank=0\)"):
        hf_adapter.save_peft_adapter(cfg.replace(lora=LoRAConfig()), run.base, tmp_path / "c")
    assert not any((tmp_path / x).exists() for x in "abc")


def _edited(adapter, dst, config=None, tensors=None):
    """A copy of the adapter directory with ``config`` merged into its config and ``tensors`` changed."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    conf = {**json.loads((adapter / "adapter_config.json").read_text()), **(config or {})}
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    weights = {**load_file(str(adapter / "adapter_model.safetensors")), **(tensors or {})}
    save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize("run", ["qwen3_5_moe_text"], indirect=True)
def test_an_adapter_that_does_not_fit_the_run_is_one_clear_error(run, tmp_path):
    cfg, a, f = run.cfg, run.adapter, run.family
    other = cfg.replace(lora=dataclasses.replace(cfg.lora, rank=4))
    with pytest.raises(hf.HFFormatError, match=r"does not fit the run's lora section: lora.rank=4 \(the adapter's r: "
                                               r"3\); lora.expert_rank=None \(= lora.rank 4; the adapter's: 3\); "
                                               r"leave lora.rank unset"):
        hf_adapter.load_peft_adapter(other, a, run.params, family=f)
    fewer = cfg.replace(lora=dataclasses.replace(cfg.lora, targets=("attention", "experts")))
    with pytest.raises(hf.HFFormatError, match=r"lora section: lora.targets=\['attention', 'experts'\] lacks "
                                               r"'shared_experts'; leave lora.rank unset"):
        hf_adapter.load_peft_adapter(fewer, a, run.params, family=f)
    head = {f"base_model.model.lm_head.lora_{x}.weight": np.zeros((3, 3), np.float32) for x in "AB"}
    with pytest.raises(hf.HFFormatError, match=r"2 tensors adapt what this Qwen3.5-MoE run has no adapter for "
                                               r"\(lora.targets\), or another model's modules, e.g. \['base_model"):
        hf_adapter.load_peft_adapter(cfg, _edited(a, tmp_path / "head", tensors=head), run.params, family=f)
    with pytest.raises(hf.HFFormatError, match="use_dora=True: moefast's LoRA has only low-rank adapters"):
        hf_adapter.adapter_lora_config(cfg, _edited(a, tmp_path / "dora", {"use_dora": True}), family=f)
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"  # query and gate stacked: [2·H·Hd, 2r]
    from safetensors.numpy import load_file

    b = load_file(str(a / "adapter_model.safetensors"))[key]
    assert b.shape[1] == 6
    mixed = b.copy()
    mixed[0, 5] = 1.0  # head 0's first query row: its gate's rank block
    with pytest.raises(hf.HFFormatError, match=r"model.layers.1.self_attn.q_proj's lora_B mixes the 2 moefast "
                                               r"adapters its rank 6 stacks"):
        hf_adapter.load_peft_adapter(cfg, _edited(a, tmp_path / "mixed", tensors={key: mixed}), run.params, family=f)


@pytest.mark.parametrize("run", ["qwen3_moe"], indirect=True)
def test_cli_imports_an_adapter_and_exports_it_and_the_merged_model(run, tmp_path, capsys):
    from safetensors.numpy import load_file

    from moefast import cli
    from moefast.train import load_run_config

    r = tmp_path / "run"
    assert cli.main(["import-hf", str(run.hf_dir), "--run-dir", str(r), "--adapter", str(run.adapter),
                     "lora.base_dtype=float32"]) == 0
    said = capsys.readouterr().out
    assert "note: read 13 of the 13 adapted sites of Qwen3-MoE" in said and f"with the adapter {run.adapter}" in said
    cfg = load_run_config(r)
    assert cfg.lora == dataclasses.replace(run.cfg.lora, targets=cfg.lora.targets)
    assert cli.main(["export-hf", "--run-dir", str(r), "--adapter", str(tmp_path / "a"), str(tmp_path / "m")]) == 0
    said = capsys.readouterr().out
    assert "step 0: wrote a PEFT LoRA adapter for qwen3_moe" in said
    assert "step 0: wrote qwen3_moe (per_expert experts, float32, LoRA adapters merged into the weights)" in said
    for name, x in load_file(str(run.adapter / "adapter_model.safetensors")).items():
        np.testing.assert_array_equal(load_file(str(tmp_path / "a" / "adapter_model.safetensors"))[name], x)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    np.testing.assert_allclose(run.logits, _logits(merged), atol=1e-4, rtol=0)
    assert cli.main(["export-hf", "--run-dir", str(r)]) == 2
    assert "give OUT_DIR (the model), --adapter ADAPTER_DIR" in capsys.readouterr().err


@pytest.mark.parametrize("run", ["qwen3_moe"], indirect=True)
def test_import_train_export_gives_peft_the_trained_model(run, tmp_path, text_dir):
    """The whole path a user takes: ``import-hf ... lora.*``, 20 steps of ``moefast train`` (the
    loss falls; the base, bitwise as imported; the optimizer state, adapters only), ``export-hf
    --adapter``: PEFT on transformers' base model gives the trained moefast model's logits."""
    from moefast import cli
    from moefast.train import Trainer, load_run_config

    r = tmp_path / "run"
    assert cli.main(["import-hf", str(run.hf_dir), "--run-dir", str(r), "lora.rank=4", "lora.base_dtype=float32",
                     f"data.source={text_dir}", "data.seq_len=32", "data.batch_size=8", "train.steps=20",
                     "train.log_every=5", "train.eval_every=0", "train.checkpoint_every=0", "train.learning_rate=3e-2",
                     "train.warmup_steps=2"]) == 0
    assert cli.main(["train", "--run-dir", str(r), "--no-progress"]) == 0
    losses = [rec["loss"] for rec in map(json.loads, (r / "metrics.jsonl").read_text().splitlines())
              if rec["kind"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    trainer = Trainer(load_run_config(r), r, progress=False)
    step, params, routing = trainer.restore_params()
    assert step == 20
    trained, frozen = trainer.model_def.split(jax.tree.map(np.asarray, params))
    base = lora.stored(trainer.cfg.lora, jax.tree.map(np.asarray, run.base))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(frozen)[0], jax.tree.leaves(lora.split(
            trainer.cfg.lora, base)[1])):
        assert np.array_equal(a, b), jax.tree_util.keystr(path)
    opt = jax.tree_util.tree_flatten_with_path(trainer.abstract_state()["opt_state"])[0]
    assert all(str(p[-1].key).endswith((lora.LORA_A, lora.LORA_B)) for p, _ in opt if hasattr(p[-1], "key"))
    assert all(np.abs(b).max() > 0 for p, b in jax.tree_util.tree_flatten_with_path(trained)[0]
               if str(p[-1].key).endswith(lora.LORA_B))  # every adapter trained
    assert cli.main(["export-hf", "--run-dir", str(r), "--adapter", str(tmp_path / "a")]) == 0
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(trainer.model_def.module(params)(jnp.asarray(_tokens()),
                                                           segment_ids_bt=jnp.ones((B, T), jnp.int32),
                                                           drop_tokens=False, routing_state=routing).logits)
    theirs = _logits(peft.PeftModel.from_pretrained(copy.deepcopy(run.model), tmp_path / "a").eval())
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("run", ["qwen3_moe"], indirect=True)
def test_cli_checks_before_it_writes(run, tmp_path, capsys):
    """import-hf --adapter: lora.* overrides that disagree with the adapter are refused, the others
    taken; export-hf: both destinations checked before anything is written; a run whose selection
    bias stayed frozen exports to a family without one."""
    from moefast import cli
    from moefast.train import load_run_config

    for bad in ("lora.expert_rank=4", "lora.rank=8", "lora.targets=[attention]"):
        assert cli.main(["import-hf", str(run.hf_dir), "--run-dir", str(tmp_path / "x"), "--adapter",
                         str(run.adapter), bad]) == 2
        assert "--adapter: lora." in capsys.readouterr().err and not (tmp_path / "x" / "checkpoints").exists()
    r = tmp_path / "r"
    assert cli.main(["import-hf", str(run.hf_dir), "--run-dir", str(r), "--adapter", str(run.adapter),
                     "lora.base_dtype=nf4", "lora.routing=frozen", "moe.aux_free_bias_rate=0.01"]) == 0
    cfg = load_run_config(r)
    assert (cfg.lora.base_dtype, cfg.lora.rank, cfg.lora.expert_rank) == ("nf4", 4, 2)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("x")
    for out, adapter in ((tmp_path / "m", tmp_path / "taken"), (tmp_path / "m2", tmp_path / "m2" / "a")):
        assert cli.main(["export-hf", "--run-dir", str(r), str(out), "--adapter", str(adapter)]) == 2
        capsys.readouterr()
        assert not out.exists() and not (adapter.exists() and adapter != tmp_path / "taken")
    assert cli.main(["export-hf", "--run-dir", str(r), str(tmp_path / "m"), "--adapter", str(tmp_path / "a")]) == 0
