"""Hugging Face import/export against transformers itself (offline: tiny random models built here).

For each family a tiny model is built with transformers (fp32, every norm weight and bias
re-randomised so defaults hide nothing, and a router selection bias spread so that it changes the
chosen experts), saved with ``save_pretrained`` in both expert layouts, read with
:func:`moefast.interop.hf.load_hf` (and the selection bias with :func:`~moefast.interop.hf.load_hf_routing`)
and run by moefast: logits within 1e-4 of transformers' on 128-token sequences with a padded row,
and the same experts chosen for every real token in every MoE layer (the indices transformers'
routers return). Then ``save_hf`` -> ``AutoModelForCausalLM.from_pretrained`` gives transformers'
weights, buffers, config keys and logits again, and ``load_hf(save_hf(x)) == x`` exactly.
"""

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

from moefast.interop import hf, hf_write  # noqa: E402
from moefast.config import ConfigError, load_config  # noqa: E402
from hf_oracle import hf_forward, module, ours, saved_layouts  # noqa: E402

V, B, T = 128, 2, 128
PAD_FROM = 88  # row 1 is padding from here on
COMMON = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, num_experts_per_tok=2, tie_word_embeddings=False)
FAMILIES = {
    # every layer MoE, renormalised gates
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=32,
                                                  num_local_experts=8),
    # a leading dense layer of its own width, a gated shared expert, q/k/v biases, raw gates
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, mlp_only_layers=[0], norm_topk_prob=False),
    # per-head q/k norms, biases on all four projections, head_dim != hidden / heads
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **{**COMMON, "head_dim": 32}, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, mlp_only_layers=[0], norm_topk_prob=True, attention_bias=True),
    # q/k norms over the whole projections, tied embeddings
    "olmoe": lambda: transformers.OlmoeConfig(
        **{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=2, intermediate_size=32, num_experts=8,
        attention_bias=True, eos_token_id=None, pad_token_id=None),
    # GLM-4.5: first layer dense of its own width, sigmoid routing over 4 groups keeping 2 with the
    # selection bias, gates renormalised then scaled, 2 ungated shared experts, q/k/v biases,
    # per-head q/k norms, half of each head rotated
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5),
    # DeepSeek-V3: MLA (low-rank query, interleaved RoPE columns) with YaRN past its original
    # context of 32 positions, 4 groups keeping 2, the first layer dense
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "head_dim")}, num_hidden_layers=3,
        first_k_dense_replace=1, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # DeepSeek-V2-Lite: MLA with a direct query projection, softmax routing over 4 groups keeping 2
    # by their best probability (top-3, so the limit changes choices: with K <= kept groups it
    # never does), raw gates scaled, 2 shared experts, YaRN, no dense layer
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "head_dim", "num_experts_per_tok")},
        num_experts_per_tok=3, num_hidden_layers=2,
        first_k_dense_replace=0, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=2, n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=16.0,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # GLM-4.7-Flash: MLA (interleaved RoPE) under GLM's router, dense layers listed per layer
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **{k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "head_dim")}, num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"], intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.8, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        **COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}),
}
# config.json keys that each family's export must give back as they were (beyond the shapes)
CONFIG_KEYS = {
    "glm4_moe": ("first_k_dense_replace", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                 "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                 "num_experts_per_tok", "attention_bias", "use_qk_norm", "rope_parameters"),
    "deepseek_v3": ("first_k_dense_replace", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                    "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "rope_interleave", "rope_parameters"),
    "glm4_moe_lite": ("intermediate_size", "moe_intermediate_size", "n_routed_experts",
                      "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                      "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "rope_interleave", "rope_parameters"),
    "deepseek_v2": ("first_k_dense_replace", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                    "n_shared_experts", "n_group", "topk_group", "topk_method", "routed_scaling_factor",
                    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "rope_parameters"),
}


def _hf_model(family: str, **changes):
    """The family's tiny transformers model (``changes``: config attributes set first), fp32."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    for k, v in changes.items():
        setattr(config, k, v)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise them so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") and family in SELECTION_BIAS:  # sigmoid scores away from 0.5
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # comparable to the scores' spread: it changes some choices
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


SELECTION_BIAS = {"glm4_moe", "deepseek_v3", "glm4_moe_lite", "minimax_m2"}
# a family whose models an earlier registered family represents exactly is exported as that one
EXPORTED_AS = {"glm4_moe_lite": "deepseek_v3"}  # represented by an earlier family too: its default export


def _inputs():
    tokens = np.random.default_rng(0).integers(0, V, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, PAD_FROM:] = 0
    return tokens, mask








@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, HF model, its directory per layout)."""
    family = request.param
    model = _hf_model(family)
    return family, model, saved_layouts(model, family, tmp_path_factory)


def test_saved_layouts_are_the_two_on_disk_layouts(saved):
    family, _, dirs = saved
    from safetensors import safe_open

    def keys(d):
        with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
            return list(f.keys())

    assert any(".experts.0." in k for k in keys(dirs["per_expert"]))
    assert any(k.endswith("experts.gate_up_proj") for k in keys(dirs["fused"]))


def _assert_same_as_transformers(model, directory, monkeypatch):
    """Reads ``directory`` (``model`` saved) and checks moefast's logits (1e-4) and chosen experts
    against ``model``'s on :func:`_inputs`; returns what the callers check further."""
    tokens, mask = _inputs()
    want, want_chosen = hf_forward(model, tokens, mask)
    cfg, params = hf.load_hf(directory)
    routing = hf.load_hf_routing(directory, cfg)
    got, got_chosen, unbiased = ours(cfg, params, routing, tokens, mask, monkeypatch, unbiased=True)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    assert len(got_chosen) == len(want_chosen) == sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    for layer, (g, w) in enumerate(zip(got_chosen, want_chosen)):
        assert np.array_equal(g[real.reshape(-1)], w[real.reshape(-1)]), f"MoE layer {layer}: other experts chosen"
    return cfg, params, routing, unbiased, want_chosen, real


def test_logits_and_chosen_experts_equal_transformers(saved, monkeypatch):
    family, model, dirs = saved
    cfg, params, routing, unbiased, want_chosen, real = _assert_same_as_transformers(model, dirs["per_expert"],
                                                                                     monkeypatch)
    if family in SELECTION_BIAS:  # the imported bias decides choices: without it others are chosen
        changed = [np.mean(np.any(u != w, axis=-1)[real.reshape(-1)]) for u, w in zip(unbiased, want_chosen)]
        assert min(changed) > 0.05, f"the selection bias changes too few choices to be tested: {changed}"
    else:
        assert not np.any(np.asarray(routing["bias"]))
    # the fused on-disk layout gives the very same parameters and routing state
    _, fused = hf.load_hf(dirs["fused"])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, fused)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), routing,
                 hf.load_hf_routing(dirs["fused"], cfg))


@pytest.mark.parametrize("saved", sorted(SELECTION_BIAS), indirect=True)
def test_selection_biases_around_minus_one_equal_transformers(saved, tmp_path, monkeypatch):
    """Selection biases spread around -1 (a long aux-loss-free run's overloaded experts): most
    biased scores are negative, and the experts of dropped groups must still never be chosen
    (transformers fills them with -inf), so logits and choices equal transformers' as before."""
    family, model, _ = saved
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(-1.0 + 0.5 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(tmp_path)
    _, _, routing, *_ = _assert_same_as_transformers(model, tmp_path, monkeypatch)
    bias = np.asarray(routing["bias"])
    assert bias.max() < 0 and bias.mean() < -0.7, bias  # with sigmoid scores in (0, 1): both signs


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_export_reloads_in_transformers_and_round_trips_exactly(saved, layout, tmp_path):
    family, model, dirs = saved
    cfg, params = hf.load_hf(dirs["per_expert"])
    routing = hf.load_hf_routing(dirs["per_expert"], cfg)
    assert hf.hf_family(cfg) == EXPORTED_AS.get(family, family)  # the default: the first that fits
    out = hf.save_hf(cfg, params, tmp_path / "export", routing_state=routing, layout=layout, family=family)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert type(reloaded).__name__ == hf.FAMILIES[family]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want_sd, got_sd = model.state_dict(), reloaded.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name, w in want_sd.items():  # every weight and persistent buffer (selection biases) bit for bit
        assert torch.equal(got_sd[name], w), name
    for key in CONFIG_KEYS.get(family, ()):
        assert getattr(reloaded.config, key) == getattr(model.config, key), key
    tokens, mask = _inputs()
    want, _ = hf_forward(model, tokens, mask)
    got, _ = hf_forward(reloaded.eval(), tokens, mask)
    # the same weights; torch's expert kernels may round differently for other memory layouts
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    cfg2, params2 = hf.load_hf(out)
    assert cfg2.model == cfg.model and cfg2.moe == cfg.moe
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), routing,
                 hf.load_hf_routing(out, cfg2))


def _with_mtp_layer(src, dst):
    """A copy of HF directory ``src`` with one multi-token-prediction layer ``L`` (L =
    num_hidden_layers) in its own file, as DeepSeek-V3 and GLM-4.5 checkpoints keep it: the decoder
    layer is layer L - 1's tensors times 2 (exact in float32, so moefast's MTP block must equal twice
    its last block, interleave permutation included, and reading layer L - 1 by mistake shows),
    random enorm, hnorm, eh_proj and shared_head.norm, and exact copies of the embedding and head.
    Returns ``(dst, {name: tensor} of the MTP layer)``."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    hf_cfg = json.loads((dst / "config.json").read_text())
    n, d = hf_cfg["num_hidden_layers"], hf_cfg["hidden_size"]
    hf_cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(hf_cfg))
    rng = np.random.default_rng(3)
    with safe_open(str(dst / "model.safetensors"), framework="numpy") as f:
        last = f"model.layers.{n - 1}."
        mtp = {f"model.layers.{n}." + k[len(last):]: 2 * f.get_tensor(k) for k in f.keys() if k.startswith(last)}
        mtp[f"model.layers.{n}.embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
        mtp[f"model.layers.{n}.shared_head.head.weight"] = f.get_tensor("lm_head.weight")
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{n}.{name}.weight"] = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    mtp[f"model.layers.{n}.eh_proj.weight"] = (0.1 * rng.standard_normal((d, 2 * d))).astype(np.float32)
    save_file(mtp, str(dst / "mtp.safetensors"))
    return dst, mtp


@pytest.mark.parametrize("saved", ["deepseek_v3", "glm4_moe"], indirect=True)
def test_multi_token_prediction_layers_are_read_exactly_and_round_trip(saved, tmp_path):
    """A checkpoint with num_nextn_predict_layers=1 and that layer's tensors imports with
    model.mtp_depth=1: the MTP module's parameters and routing row are the layer's tensors bit for
    bit; the export writes the very same tensors (copies of the embedding and head included) and
    num_nextn_predict_layers; the MTP logits equal those of transformers' MtpModel (1e-4) and the
    MTP loss is finite (DeepSeek-V3); model.mtp_depth=0 reads the
    same main model and says what it skips; an incomplete layer gives depth 0; a copy of the
    embedding that differs is refused; without num_nextn_predict_layers the layer is an error."""
    from safetensors import safe_open

    from moefast.model.layout import to_layout

    family, _, dirs = saved
    src, mtp = _with_mtp_layer(dirs["per_expert"], tmp_path / "src")
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    cfg, params = hf.load_hf(src)
    assert cfg.model.mtp_depth == 1
    assert hf.config_from_hf(dirs["per_expert"]).model.mtp_depth == 0  # the key, but no layer on disk
    routing = hf.load_hf_routing(src, cfg)
    got = params["mtp"][0]
    for path, name in ((("enorm", "scale"), "enorm"), (("hnorm", "scale"), "hnorm"),
                       (("head_norm", "scale"), "shared_head.norm")):
        np.testing.assert_array_equal(np.asarray(got[path[0]][path[1]]), mtp[f"model.layers.{n}.{name}.weight"])
    np.testing.assert_array_equal(np.asarray(got["eh_proj"]), mtp[f"model.layers.{n}.eh_proj.weight"].T)
    last = to_layout(params, cfg.model, scanned=False)["blocks"][n - 1]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), 2 * np.asarray(b)), got["block"], last)
    bias = np.asarray(routing["bias"])
    assert bias.shape[0] == sum(cfg.model.is_moe_layer(i) for i in range(n)) + 1
    np.testing.assert_array_equal(bias[-1], 2 * bias[-2])

    out = hf.save_hf(cfg, params, tmp_path / "out", routing_state=routing)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1

    def tensors(d):
        res = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="numpy") as h:
                res.update({k: h.get_tensor(k) for k in h.keys()})
        return res
    want, written = tensors(src), tensors(out)
    assert sorted(written) == sorted(want)
    for name, x in want.items():
        np.testing.assert_array_equal(written[name], x, err_msg=name)

    if family == "deepseek_v3":  # the model runs with its MTP module (also read into the scanned layout)
        _, scanned = hf.load_hf(src, ["model.scan_layers=true"])  # MTP modules stay unrolled in both layouts
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params["mtp"],
                     scanned["mtp"])
        tokens, mask = _inputs()
        with jax.default_matmul_precision("highest"):  # as the parity test: its eager ops' compilations are reused
            y = module(cfg, params)(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(mask, jnp.int32),
                                     drop_tokens=False, routing_state=routing)
        import optax

        ce = optax.softmax_cross_entropy_with_integer_labels(y.mtp_logits[0][:, :-2], jnp.asarray(tokens)[:, 2:])
        assert len(y.mtp_logits) == 1 and np.isfinite(float(jnp.mean(ce))) and float(jnp.mean(ce)) > 0
        # transformers' MtpModel (its speculative-decoding drafter) reads the export's MTP layer and
        # predicts t_{i+2} from h_i and Emb(t_{i+1}) as moefast's module does. It finds the layer by
        # the main model's ignore pattern, which names DeepSeek-V3's layer 61: point it at layer n.
        from transformers.modeling_layers import MtpModel

        main = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
        drafter = MtpModel.from_pretrained(main).float().eval()
        real = PAD_FROM - 1  # rows whose t_{i+1} is real in both sequences (transformers' mask is causal only)
        with torch.no_grad():
            h = main.model(input_ids=torch.tensor(tokens[:, :real])).last_hidden_state
            ids, pos = torch.tensor(tokens[:, 1:real + 1]), torch.arange(real)[None].expand(B, real)
            want_mtp = drafter._project_to_logits(drafter.forward_layer(0, h, pos, None, input_ids=ids)).numpy()
        np.testing.assert_allclose(np.asarray(y.mtp_logits[0])[:, :real], want_mtp, atol=1e-4, rtol=0)

    notes = []
    cfg0 = hf.config_from_hf(src, ["model.mtp_depth=0"])
    params0 = hf.load_hf_params(src, cfg0, log=notes.append)
    assert len(notes) == 1 and f"{len(mtp)} tensors of the checkpoint's multi-token-prediction" in notes[0]
    assert "mtp" not in params0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 {k: v for k, v in params.items() if k != "mtp"}, params0)
    with pytest.raises(hf.HFFormatError, match="no place for"):
        hf.load_hf(_edit_config(src, tmp_path / "no-mtp", num_nextn_predict_layers=0))
    with pytest.raises(hf.HFFormatError, match=r"holds 1 multi-token-prediction layer \("):
        hf.load_hf(src, ["model.mtp_depth=2"])
    from safetensors.numpy import save_file

    mtp[f"model.layers.{n}.embed_tokens.weight"] = mtp[f"model.layers.{n}.embed_tokens.weight"] + 1
    save_file(mtp, str(src / "mtp.safetensors"))
    with pytest.raises(hf.HFFormatError, match="embed_tokens.weight differs from model.embed_tokens.weight"):
        hf.load_hf(src)
    save_file({k: v for k, v in mtp.items() if not k.endswith("enorm.weight")}, str(src / "mtp.safetensors"))
    assert hf.config_from_hf(src).model.mtp_depth == 0  # an incomplete layer is not a module (and is skipped)


@pytest.mark.parametrize("saved", ["deepseek_v3"], indirect=True)
def test_kimi_k2_reads_as_deepseek_v3_and_exports_as_it(saved, tmp_path):
    """Kimi K2's config.json is DeepSeek-V3's with model_type kimi_k2 (remote code): the same model
    and routing state are read, and the export is a deepseek_v3 directory transformers loads."""
    _, _, dirs = saved
    kimi = _edit_config(dirs["per_expert"], tmp_path / "kimi", model_type="kimi_k2")
    cfg, params = hf.load_hf(dirs["per_expert"])
    cfg_k, params_k = hf.load_hf(kimi)
    assert (cfg_k.model, cfg_k.moe) == (cfg.model, cfg.moe)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params_k)
    routing = hf.load_hf_routing(kimi, cfg_k)
    assert hf.hf_family(cfg_k) == hf.hf_family(cfg_k, "kimi_k2") == "deepseek_v3"  # transformers has no kimi_k2
    lines = []
    out = hf.save_hf(cfg_k, params_k, tmp_path / "out", routing_state=routing, family="kimi_k2", log=lines.append)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3"
    assert lines[0].startswith("wrote deepseek_v3 ") and lines[0].endswith(
        "; model_type deepseek_v3, not kimi_k2: transformers does not know kimi_k2; deepseek_v3 "
        "(DeepseekV3ForCausalLM) is the same architecture"), lines
    # as the hub's DeepSeek-V3 config.json: vLLM and SGLang create the selection bias only for noaux_tc
    assert (written["topk_method"], written["scoring_func"]) == ("noaux_tc", "sigmoid")
    with pytest.raises(hf.HFFormatError, match=r"qwen3_moe cannot represent this model: it has .*model.attention=mla"):
        hf.save_hf(cfg_k, params_k, tmp_path / "q", routing_state=routing, family="qwen3_moe")
    with pytest.raises(hf.HFFormatError, match="family 'llama' is not one moefast writes; known: mixtral"):
        hf.hf_family(cfg_k, "llama")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("saved", ["glm4_moe_lite"], indirect=True)
def test_export_hf_writes_the_family_the_run_was_imported_from(saved, tmp_path):
    """A GLM-4.7-Flash import is written back as glm4_moe_lite by ``moefast export-hf`` (read from
    the run's imported_from.json), though deepseek_v3 represents the same model; a record that no
    longer fits, or none, falls back to the first family that fits."""
    from moefast import cli

    _, _, dirs = saved
    cfg, _ = hf.load_hf(dirs["per_expert"])
    run = tmp_path / "run"
    run.mkdir()
    assert cli._imported_family(run, cfg) is None  # trained from scratch: hf_family's choice
    for model_type, want in (("glm4_moe_lite", "glm4_moe_lite"), ("qwen3_moe", None), ("kimi_k2", "kimi_k2")):
        (run / cli.IMPORTED_FROM).write_text(json.dumps({"model_type": model_type, "path": "x"}))
        assert cli._imported_family(run, cfg) == want, model_type


@pytest.mark.parametrize("saved", ["deepseek_v3"], indirect=True)
def test_mla_reads_into_the_scanned_layout(saved):
    """Dense MLA prefix and MoE MLA group stacks (with the interleave permutation) equal the unrolled
    read stacked."""
    from moefast.model.layout import to_layout

    _, _, dirs = saved
    cfg, params = hf.load_hf(dirs["per_expert"])
    _, scanned = hf.load_hf(dirs["per_expert"], ["model.scan_layers=true"])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 to_layout(params, cfg.model, scanned=True), scanned)


def test_scanned_layout_sharded_index_and_bf16(tmp_path):
    """Reading into the scanned layout equals the unrolled read stacked; a sharded export (index)
    reads back; bf16 tensors read back as the bf16-rounded parameters."""
    model = _hf_model("qwen2_moe")
    model.save_pretrained(tmp_path / "src")
    cfg, params = hf.load_hf(tmp_path / "src")
    scfg, sparams = hf.load_hf(tmp_path / "src", ["model.scan_layers=true"])
    from moefast.model.layout import to_layout

    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 to_layout(params, cfg.model, scanned=True), sparams)
    out = hf.save_hf(scfg, sparams, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    _, again = hf.load_hf(out)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, again)
    half = hf.save_hf(cfg, params, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    _, p16 = hf.load_hf(half)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a).astype(jnp.bfloat16).astype(np.float32),
                                                            np.asarray(b)), params, p16)


def test_loading_streams_into_shardings(tmp_path, devices):
    """With an expert mesh each device's shard holds exactly its experts' weights."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    model = _hf_model("mixtral")
    model.save_pretrained(tmp_path / "src", save_original_format=False)
    cfg, params = hf.load_hf(tmp_path / "src")
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "expert"))
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, P("expert") if path[-1].key in ("w_in", "w_out") else P()), params)
    sharded = hf.load_hf_params(tmp_path / "src", cfg, shardings=shardings)
    w_in = sharded["blocks"][0]["ffn"]["w_in"]
    assert w_in.sharding == shardings["blocks"][0]["ffn"]["w_in"]
    for shard in w_in.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(params["blocks"][0]["ffn"]["w_in"])[shard.index])


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("family,change,field", [
    ("mixtral", {"sliding_window": 64}, "sliding_window"),
    ("mixtral", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_type"),
    ("mixtral", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    # Qwen's guide adds rope_scaling next to 5.x's rope_parameters; transformers then uses YaRN
    ("mixtral", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2_moe", {"mlp_only_layers": [2]}, "mlp_only_layers"),  # MoE, MoE, dense: no moe_every pattern
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ("mixtral", {"model_type": "jamba"}, "model_type"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),  # moefast's MLA has no projection biases
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("glm4_moe", {"scoring_func": "softmax"}, "scoring_func"),  # GLM-4.5's router is sigmoid only
])
def test_unsupported_options_name_the_field(tmp_path, family, change, field):
    model = _hf_model(family)
    model.save_pretrained(tmp_path / "src")
    bad = _edit_config(tmp_path / "src", tmp_path / "bad", **change)
    with pytest.raises(hf.HFFormatError, match=field):
        hf.load_hf(bad)


def _config_only(family, tmp_path, name, **changes):
    """A directory holding only the family's tiny config.json, edited (enough for config_from_hf)."""
    d = tmp_path / name
    FAMILIES[family]().save_pretrained(d)
    written = json.loads((d / "config.json").read_text())
    written.update(changes)
    (d / "config.json").write_text(json.dumps(written))
    return d


def test_yarn_layer_and_routing_keys_read_as_transformers_reads_them(tmp_path):
    """YaRN's factor and original context default as in transformers 5 (a null factor is
    max_position_embeddings / the original context; a missing original context is
    max_position_embeddings; factor 1 is plain RoPE); the errors name config.json's keys."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}
    m = hf.config_from_hf(_config_only("deepseek_v3", tmp_path, "null", max_position_embeddings=256,
                                       rope_parameters={**yarn, "factor": None})).model
    assert (m.rope_type, m.rope_factor, m.original_max_position_embeddings) == ("yarn", 8.0, 32)
    no_original = {k: v for k, v in yarn.items() if k != "original_max_position_embeddings"}
    m = hf.config_from_hf(_config_only("deepseek_v3", tmp_path, "orig", max_position_embeddings=512,
                                       rope_parameters=no_original)).model
    assert (m.rope_factor, m.original_max_position_embeddings) == (4.0, 512)
    m = hf.config_from_hf(_config_only("deepseek_v3", tmp_path, "one", rope_parameters={**yarn, "factor": 1.0})).model
    assert m.rope_type == "default"
    bad = [("nofactor", "deepseek_v3", {"rope_parameters": {k: v for k, v in yarn.items() if k != "factor"}},
            "rope_parameters=.* YaRN needs its context-extension factor; the 'factor' key is missing"),
           ("linear", "deepseek_v3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "plain RoPE and YaRN for DeepSeek-V3"),
           ("groups", "deepseek_v3", {"n_group": 3}, "n_group=3 gives moe.num_groups"),
           ("types", "glm4_moe_lite", {"mlp_layer_types": ["dense", "sparse"]},
            r"mlp_layer_types=\['dense', 'sparse'\] .* 2 entries for num_hidden_layers=3: one per layer"),
           ("moe", "glm4_moe_lite", {"mlp_layer_types": ["dense", "moe", "sparse"]},
            r"3 entries for num_hidden_layers=3, with 'moe': one per layer, each 'dense' or 'sparse'")]
    for name, family, change, match in bad:
        with pytest.raises(hf.HFFormatError, match=match):
            hf.config_from_hf(_config_only(family, tmp_path, name, **change))
    with pytest.raises(ConfigError, match="model.rope_factor: must be a finite number > 1 with model.rope_type=yarn"):
        load_config(None, ["model.rope_type=yarn", "model.original_max_position_embeddings=64"])


def test_mismatched_files_and_overrides_are_clear_errors(tmp_path):
    model = _hf_model("mixtral")
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(hf.HFFormatError, match="shape"):
        hf.load_hf(_edit_config(tmp_path / "src", tmp_path / "wide", intermediate_size=48))
    with pytest.raises(hf.HFFormatError, match="missing"):
        hf.load_hf(_edit_config(tmp_path / "src", tmp_path / "deep", num_hidden_layers=3))
    with pytest.raises(hf.HFFormatError, match="model.d_model is fixed"):
        hf.config_from_hf(tmp_path / "src", ["model.d_model=128"])
    cfg, params = hf.load_hf(tmp_path / "src")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    with pytest.raises(hf.HFFormatError, match="not an empty directory"):
        hf.save_hf(cfg, params, tmp_path / "taken")
    assert (tmp_path / "taken" / "x").read_text() == "keep me"
    with pytest.raises(hf.HFFormatError, match="norm_topk_prob"):
        hf.save_hf(cfg.replace(moe=cfg.moe.__class__(**{**cfg.moe.__dict__, "norm_topk_prob": False})), params,
                   tmp_path / "raw")


def _moefast(*args, timeout=300):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "moefast", *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_import_fine_tune_export_from_the_cli(tmp_path, text_dir):
    """DeepSeek-V3 (MLA with interleaved RoPE and YaRN, grouped sigmoid routing with a non-zero
    selection bias, a dense first layer): moefast import-hf -> train 5 steps -> generate -> export-hf
    -> transformers loads the fine-tuned model (with its tokenizer) and computes the logits of
    moefast's final checkpoint (its parameters and routing state). The other families share every
    step of this chain but the tensor tables, which the tests above check."""
    from tokenizers import ByteLevelBPETokenizer

    from moefast.train import Trainer, load_run_config

    src = tmp_path / "src"
    model = _hf_model("deepseek_v3", vocab_size=320, num_hidden_layers=2)
    assert all(b.abs().min() > 0 for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    model.save_pretrained(src)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([p.read_text() for p in sorted(text_dir.glob("*.py"))[:4]], vocab_size=300,
                            min_frequency=1, show_progress=False, special_tokens=["<|endoftext|>"])
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
    (src / "chat_template.jinja").write_text(template)  # where recent transformers keep a model's template
    first, run, out = tmp_path / "first", tmp_path / "run", tmp_path / "out"
    said = _moefast("import-hf", str(src / "config.json"), "--run-dir", str(first), "data.source=/no/such/dir",
                    "data.seq_len=64", "data.batch_size=8", "train.eval_batches=1", "train.warmup_steps=1")
    assert "imported deepseek_v3" in said and (first / "checkpoints" / "0").is_dir()
    assert (first / "tokenizer" / "tokenizer.json").is_file()  # the run keeps its own copy
    assert (first / "tokenizer" / "chat_template.jinja").read_text() == template  # SFT needs it
    shutil.move(first, run)  # found relative to the run dir: the run can move
    # nothing trained yet: data.* may still change (here: the typo made at import)
    said = _moefast("train", "--run-dir", str(run), "--no-progress", "train.steps=5", "train.log_every=5",
                    "train.eval_every=5", f"data.source={text_dir}")
    assert "resuming from step 0" in said and "steps 5 (5 this run)" in said
    assert "not a resume of the original schedule" not in said  # nothing was trained before
    assert _moefast("generate", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "5").startswith("def ")
    assert "step 5: wrote deepseek_v3" in _moefast("export-hf", "--run-dir", str(run), str(out))

    assert (out / "chat_template.jinja").read_text() == template
    cfg = load_run_config(run)
    step, tuned, routing_state = Trainer(cfg, run, progress=False).restore_params()
    _, original = hf.load_hf(src)
    assert step == 5 and not np.array_equal(np.asarray(tuned["embed"]), np.asarray(original["embed"]))  # it trained
    np.testing.assert_array_equal(np.asarray(routing_state["bias"]), np.asarray(hf.load_hf_routing(src, cfg)["bias"]))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = np.random.default_rng(1).integers(0, 300, (1, T))
    with torch.no_grad():
        want = reloaded(input_ids=torch.tensor(tokens)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(module(cfg, tuned)(jnp.asarray(tokens), drop_tokens=False,
                                             routing_state=routing_state).logits)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    from moefast.data import HFTokenizer

    text = (text_dir / sorted(p.name for p in text_dir.glob("*.py"))[0]).read_text()[:500]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == HFTokenizer(out).encode(text).tolist()


def test_a_failed_import_leaves_nothing(tmp_path):
    from moefast import cli

    _hf_model("mixtral").save_pretrained(tmp_path / "src")
    bad = _edit_config(tmp_path / "src", tmp_path / "bad", intermediate_size=48)
    assert cli.main(["import-hf", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()


FP8_BLOCK = (20, 24)  # [BO, BI]: not square (a transposed scale grid shows), most dims here ragged in it
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(FP8_BLOCK)}


def _fp8_quantized(name, w):
    """Whether DeepSeek-V3's FP8 checkpoints store 2-D ``name`` quantized: every Linear weight but
    the router's (``mlp.gate``), the embedding and the output head."""
    return (w.ndim == 2 and name.endswith(".weight") and not name.endswith("mlp.gate.weight")
            and name not in ("model.embed_tokens.weight", "lm_head.weight"))


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """(FP8 directory, directory of its dequantized float32 weights): a tiny DeepSeek-V3 saved by
    transformers, its Linear weights then block-quantized as DeepSeek-V3's checkpoints are (per
    [BO, BI] block: scale_inv = absmax / 448, w_fp8 = w / scale_inv in float8_e4m3fn), and the
    reference computed here with torch: w_fp8.float() * scale_inv repeated over each block, cropped."""
    from safetensors.torch import load_file, save_file

    src = tmp_path_factory.mktemp("fp8-src")
    _hf_model("deepseek_v3").save_pretrained(src)
    fp8, ref = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("fp8-dequantized")
    for d in (fp8, ref):
        shutil.copytree(src, d, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    bo, bi = FP8_BLOCK
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if not _fp8_quantized(name, w):
            quantized[name] = dequantized[name] = w
            continue
        o, i = w.shape
        po, pi = -(-o // bo) * bo, -(-i // bi) * bi
        padded = torch.nn.functional.pad(w, (0, pi - i, 0, po - o))
        scale = padded.abs().reshape(po // bo, bo, pi // bi, bi).amax(dim=(1, 3)) / 448.0
        full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:o, :i]
        w8 = (w / full).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = w8, scale
        dequantized[name] = w8.float() * full
    save_file(quantized, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": FP8_CONFIG}))
    assert sum(w.dtype == torch.float8_e4m3fn for w in quantized.values()) >= 20
    return fp8, ref, dequantized


def test_fp8_block_quantized_checkpoint_reads_as_its_dequantized_weights(fp8_dirs, tmp_path):
    """Parameters and routing state read from the FP8 directory equal, bit for bit, those read from
    the dequantized float32 one; a row slice starting and ending mid-block equals the rows of the
    reference; the export is plain float32 without quantization_config and transformers loads
    the same weights from it as from the dequantized directory."""
    fp8, ref, dequantized = fp8_dirs
    with pytest.warns(UserWarning, match=r"FP8 block-quantized weights \(block 20×24\) dequantized to float32"):
        cfg, params = hf.load_hf(fp8)
    cfg_ref, params_ref = hf.load_hf(ref)
    assert (cfg.model, cfg.moe) == (cfg_ref.model, cfg_ref.moe)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params_ref)
    routing = hf.load_hf_routing(fp8, cfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), routing,
                 hf.load_hf_routing(ref, cfg_ref))

    files = hf._Files(fp8)
    try:
        assert not any(n.endswith("_scale_inv") for n in files.where)  # consumed, never "unexpected"
        name = "model.layers.0.mlp.gate_proj.weight"  # dense [96, 64]: 5 row blocks of 20, the last ragged
        assert name in files.fp8
        want = dequantized[name].numpy()
        for rows in (slice(5, 37), slice(0, 20), slice(39, 41), slice(90, 96), None):
            got = files.get(name, rows)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want if rows is None else want[rows], err_msg=str(rows))
    finally:
        files.close()

    out = hf.save_hf(cfg, params, tmp_path / "export", routing_state=routing)
    exported = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in exported and exported["model_type"] == "deepseek_v3"
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want_sd = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).state_dict()
    got_sd = reloaded.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name, w in want_sd.items():
        assert torch.equal(got_sd[name], w), name

    # and back to FP8 (export-hf --dtype fp8): DeepSeek-V3's layout with 128 x 128 blocks, which this
    # reader takes: the projections within e4m3's rounding of their block's largest value, the router,
    # embeddings and norms bfloat16-rounded
    out8 = hf.save_hf(cfg, params, tmp_path / "export-fp8", routing_state=routing, dtype="fp8")
    assert json.loads((out8 / "config.json").read_text())["quantization_config"] == hf_write.FP8_BLOCK_CONFIG
    files = hf._Files(out8)
    try:
        assert {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.0.gate_proj.weight",
                "model.layers.1.mlp.shared_experts.down_proj.weight"} <= set(files.fp8)
        assert not any(k.endswith(("mlp.gate.weight", "embed_tokens.weight", "lm_head.weight")) for k in files.fp8)
    finally:
        files.close()
    # other families' names: Mixtral's per-expert w1/w2/w3 and fused experts are matrices too; routers not
    names = {"model.layers.0.block_sparse_moe.experts.3.w2.weight": True, "model.layers.0.mlp.experts.gate_up_proj": True,
             "model.layers.0.block_sparse_moe.gate.weight": False, "model.layers.0.mlp.router.weight": False,
             "model.norm.weight": False, "model.layers.0.linear_attn.conv1d.weight": False}
    got = {n for n, _ in hf_write._fp8_rows((n, np.ones((4, 256, 128), np.float32)) for n in names)}
    assert {n for n, q in names.items() if q} == {n[:-len("_scale_inv")] for n in got if n.endswith("_scale_inv")}
    with pytest.warns(UserWarning, match=r"FP8 block-quantized weights \(block 128×128\)"):
        _, back = hf.load_hf(out8)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(back)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        bound = np.abs(a).max() * 2.0 ** -4 if a.ndim >= 2 else np.abs(a).max() * 2.0 ** -8
        assert np.abs(a - b).max() <= bound, jax.tree_util.keystr(path)


@pytest.mark.parametrize("quant,field", [
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "quant_method='compressed-tensors'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method='gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size=None"),  # per-tensor FP8
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt='e5m2'"),
])
def test_other_quantizations_are_one_clear_error(fp8_dirs, tmp_path, quant, field):
    fp8, _, _ = fp8_dirs
    bad = _edit_config(fp8, tmp_path / "bad", quantization_config=quant)
    with pytest.raises(hf.HFFormatError, match=rf"quantization_config\.{field}.*dequantize the checkpoint first"):
        hf.load_hf(bad)


def test_fp8_weights_without_their_scales_are_clear_errors(fp8_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8, _, _ = fp8_dirs
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors = load_file(str(fp8 / "model.safetensors"))
    assert tensors[name].dtype == torch.float8_e4m3fn
    for case, change in (("missing", lambda t: t.pop(name + "_scale_inv")),
                         ("shape", lambda t: t.update({name + "_scale_inv": t[name + "_scale_inv"].T.contiguous()}))):
        bad = _edit_config(fp8, tmp_path / case)
        t = dict(tensors)
        change(t)
        save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(hf.HFFormatError, match=(rf"FP8 tensor {name} has no {name}_scale_inv" if case == "missing"
                                                     else rf"{name}_scale_inv has shape \[1, 6\].*needs \[6, 1\]")):
            hf.load_hf(bad)
    no_config = _edit_config(fp8, tmp_path / "no-config", quantization_config=None)
    with pytest.raises(hf.HFFormatError, match="is F8_E4M3, but config.json has no quantization_config"):
        hf.load_hf(no_config)
