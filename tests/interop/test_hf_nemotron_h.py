"""Hugging Face import/export of Nemotron-H / Nemotron 3 (``nemotron_h``: a pattern of single pre-norm
sublayers, Mamba-2, GQA without RoPE, relu² MLPs and latent relu² MoEs) against transformers'
``NemotronHForCausalLM`` itself (its torch fallbacks: no mamba_ssm kernels here).

A tiny random model is built offline (fp32; the pattern ``ME*-M-*E``: every kind twice, Mamba-2 with
8 heads in 2 groups, chunk_size 16 against 40 tokens; 8 experts in 2 groups, one group kept, gates
renormalised and scaled, a latent width of 24, a shared expert; every norm weight, A_log, dt_bias, D,
conv bias and selection bias random, the projections at unit gain, so that every term moves the
logits), saved with ``save_pretrained`` in both on-disk layouts (the hub's ``backbone.*`` with one
tensor per expert, and transformers' in-memory ``model.*`` with fused experts), read with
:func:`moefast.interop.hf.load_hf` and run by moefast: logits within 1e-4 of transformers' on the real
tokens of 2 x 40 tokens with a right-padded row, the same experts for every real token in both MoE
sublayers. Then ``save_hf`` -> ``AutoModelForCausalLM.from_pretrained`` gives transformers' weights
bit for bit (and its logits), and ``load_hf(save_hf(x)) == x`` exactly. The legacy
``hybrid_override_pattern`` reads as ``layers_block_type``; multi-token-prediction tensors are
skipped with one note; a bad pattern character, a missing Mamba-2 tensor and keys moefast cannot
represent: one clear error each.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
if not hasattr(transformers, "NemotronHConfig"):
    pytest.skip("this transformers has no nemotron_h", allow_module_level=True)

from moefast.config import load_config  # noqa: E402
from moefast.interop import hf  # noqa: E402
from hf_oracle import (equal_trees, hf_forward, ours, padded_batch, reload_bit_for_bit, rewrite,  # noqa: E402
                       saved_layouts, tensors)

V, B, T = 128, 2, 40
PAD_FROM = 27  # row 1 is padding from here on
PATTERN = "ME*-M-*E"  # hybrid_override_pattern's letters: Mamba-2, MoE, attention, MLP; each twice
KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
CONFIG = dict(vocab_size=V, hidden_size=64, layers_block_type=[KINDS[c] for c in PATTERN], num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
              ssm_state_size=16, conv_kernel=4, chunk_size=16, time_step_min=0.05, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=48, moe_latent_size=24, routed_scaling_factor=2.5,
              norm_topk_prob=True, layer_norm_epsilon=1e-5, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


def _hf_model(seed: int = 0):
    """transformers' model of :data:`CONFIG`, fp32, every weight random: norms 1 + 0.2 N, A_log of
    decays in [0.5, 4.5), dt_bias N - 1 (some steps below time_step_min: the clamp acts), D and the
    conv bias N, router 0.1 N, selection biases 0.05 N, embeddings N, every other weight N / sqrt(fan-in)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.NemotronHConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight")):  # sublayer, gated Mamba-2 and final norms
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.5 + 4 * torch.rand_like(p)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) - 1.0)
            elif name.endswith(("mixer.D", "conv1d.bias", "embeddings.weight")):
                p.copy_(torch.randn_like(p))
            elif name.endswith("mixer.gate.weight"):  # routing margins well above float rounding
                p.copy_(0.1 * torch.randn_like(p))
            else:  # projections, conv taps, experts
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(HF model, its directory per on-disk layout, moefast's config, params and routing state)."""
    model = _hf_model()
    dirs = saved_layouts(model, "nemotron_h", tmp_path_factory)
    cfg, params = hf.load_hf(dirs["per_expert"])
    return model, dirs, cfg, params, hf.load_hf_routing(dirs["per_expert"], cfg)


def test_logits_and_chosen_experts_equal_transformers(saved, monkeypatch):
    model, dirs, cfg, params, routing_state = saved
    m, e = cfg.model, cfg.moe
    assert m.layer_types == tuple(KINDS[c] for c in PATTERN) and m.sublayers and m.num_layers == 8
    assert (m.linear_attention_kind, m.position_encoding, m.dense_activation, m.num_dense_layers, m.moe_every) == \
        ("mamba2", "none", "relu2", 0, 1)
    assert (m.linear_num_value_heads, m.linear_value_head_dim, m.linear_num_key_heads, m.linear_key_head_dim,
            m.linear_conv_kernel_dim, m.time_step_min) == (8, 8, 2, 16, 4, 0.05)
    assert (m.num_heads, m.kv_heads, m.head_dim, m.d_ff, m.dense_ff, m.norm_eps, m.tie_embeddings) == \
        (4, 2, 16, 32, 96, 1e-5, False)
    assert (e.expert_activation, e.latent_size, e.shared_expert_d_ff, e.shared_expert_gate) == ("relu2", 24, 48, False)
    assert (e.score_func, e.num_groups, e.topk_groups, e.routed_scaling_factor, e.norm_topk_prob) == \
        ("sigmoid", 2, 1, 2.5, True)
    assert np.abs(np.asarray(routing_state["bias"])).max() > 0  # the selection biases were read
    tokens, mask = padded_batch(V, B, T, PAD_FROM)
    want, want_chosen = hf_forward(model, tokens, mask)
    got, got_chosen = ours(cfg, params, routing_state, tokens, mask, monkeypatch)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    assert len(got_chosen) == len(want_chosen) == 2
    for layer, (g, w) in enumerate(zip(got_chosen, want_chosen)):
        assert np.array_equal(g[real.reshape(-1)], w[real.reshape(-1)]), f"MoE sublayer {layer}: other experts chosen"
    fused_cfg, fused = hf.load_hf(dirs["fused"])  # transformers' in-memory names (model.*, fused experts)
    assert fused_cfg.model == m and fused_cfg.moe == e
    equal_trees(params, fused)
    equal_trees(routing_state, hf.load_hf_routing(dirs["fused"], fused_cfg))


def test_export_reloads_in_transformers_and_round_trips_exactly(saved, tmp_path):
    """Both layouts: transformers loads the export with every weight bit-equal and no key missing or
    unexpected, and computes the original model's logits bit for bit; the per-expert export holds
    exactly the tensors transformers' save_pretrained writes; config.json speaks Nemotron-H's keys;
    load_hf of it is the imported model exactly."""
    model, dirs, cfg, params, routing_state = saved
    assert hf.hf_family(cfg) == "nemotron_h"
    tokens, mask = padded_batch(V, B, T, PAD_FROM)
    want, _ = hf_forward(model, tokens, mask)
    for layout in ("per_expert", "fused"):
        out = hf.save_hf(cfg, params, tmp_path / layout, routing_state=routing_state, layout=layout)
        written = json.loads((out / "config.json").read_text())
        assert written["layers_block_type"] == CONFIG["layers_block_type"]
        assert {k: written[k] for k in ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                                        "conv_kernel", "time_step_min", "moe_latent_size", "layer_norm_epsilon",
                                        "moe_shared_expert_intermediate_size", "n_routed_experts")} == \
            {k: CONFIG[k] for k in ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
                                    "time_step_min", "moe_latent_size", "layer_norm_epsilon",
                                    "moe_shared_expert_intermediate_size", "n_routed_experts")}
        assert (written["mlp_hidden_act"], written["num_nextn_predict_layers"]) == ("relu2", 0)
        assert not {"layer_types", "rope_theta", "rope_parameters", "hidden_act", "rms_norm_eps"} & written.keys()
        names = tensors(out)
        if layout == "per_expert":
            assert names.keys() == tensors(dirs["per_expert"]).keys()
            assert {"backbone.embeddings.weight", "backbone.layers.7.mixer.experts.7.up_proj.weight",
                    "backbone.layers.1.mixer.gate.e_score_correction_bias"} <= names.keys()
        else:
            assert {"backbone.layers.1.mixer.experts.up_proj", "backbone.layers.7.mixer.experts.down_proj"} <= \
                names.keys()
        reloaded = reload_bit_for_bit(model, out, "NemotronHForCausalLM")
        assert reloaded.config.layers_block_type == CONFIG["layers_block_type"]
        assert written.get("chunk_size") is None  # transformers' default 128: how its SSD scan blocks the
        for mixer in reloaded.modules():         # tokens, which moefast does not keep (numerics only)
            if type(mixer).__name__ == "NemotronHMamba2Mixer":
                mixer.chunk_size = CONFIG["chunk_size"]
        np.testing.assert_array_equal(hf_forward(reloaded.eval(), tokens, mask)[0], want)
        cfg2, params2 = hf.load_hf(out)
        assert cfg2.model == cfg.model and cfg2.moe == cfg.moe
        equal_trees(params, params2)
        equal_trees(routing_state, hf.load_hf_routing(out, cfg2))


def test_legacy_pattern_and_mtp_tensors(saved, tmp_path):
    """``hybrid_override_pattern`` (and the legacy kinds ``mamba`` / ``attention``) read as
    ``layers_block_type``; multi-token-prediction tensors (``num_nextn_predict_layers`` > 0, ``mtp.*``)
    are skipped with one note, as transformers skips them: the same model."""
    from safetensors.numpy import save_file

    _, dirs, cfg, params, _ = saved
    src = dirs["per_expert"]
    legacy = rewrite(src, tmp_path / "pattern", layers_block_type=None, hybrid_override_pattern=PATTERN)
    assert hf.config_from_hf(legacy).model == cfg.model
    old_names = [{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t)
                 for t in CONFIG["layers_block_type"]]
    assert hf.config_from_hf(rewrite(src, tmp_path / "old-names", layers_block_type=old_names)).model == cfg.model
    mtp = rewrite(src, tmp_path / "mtp", num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"])
    extra = {**tensors(mtp), "mtp.layers.0.norm.weight": np.ones(64, np.float32),
             "mtp.layers.0.mixer.q_proj.weight": np.zeros((64, 64), np.float32)}
    save_file(extra, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    mtp_cfg = hf.config_from_hf(mtp)
    assert mtp_cfg.model == cfg.model
    notes = []
    equal_trees(params, hf.load_hf_params(mtp, mtp_cfg, log=notes.append))
    assert len(notes) == 1 and "2 tensors not read" in notes[0] and "multi-token-prediction" in notes[0], notes


def test_bad_checkpoints_are_one_clear_error(saved, tmp_path):
    """A bad pattern character or layer kind, a missing Mamba-2 tensor, an activation or bias moefast
    does not compute: one error naming the key or the tensor; a model that is not a sublayer pattern
    (or ties its head) is not written as Nemotron-H, and nothing is written."""
    _, dirs, cfg, params, routing_state = saved
    src = dirs["per_expert"]
    with pytest.raises(hf.HFFormatError, match=r"hybrid_override_pattern='ME\*-M-\*X' \(nemotron_h\) is not "
                                               r"supported: 'X' \(layer 7\): one character per layer, each M"):
        hf.config_from_hf(rewrite(src, tmp_path / "char", layers_block_type=None, hybrid_override_pattern="ME*-M-*X"))
    with pytest.raises(hf.HFFormatError, match=r"layers_block_type=.* 'sliding_attention' \(layer 2\): one entry"):
        hf.config_from_hf(rewrite(src, tmp_path / "kind", layers_block_type=["mamba", "moe", "sliding_attention"]))
    a_log = "backbone.layers.4.mixer.A_log"
    with pytest.raises(hf.HFFormatError, match=rf"1 tensor that config.json implies is missing: \['{a_log}'\]"):
        hf.load_hf(rewrite(src, tmp_path / "no-a-log", drop=[a_log]))
    with pytest.raises(hf.HFFormatError, match=r"mlp_hidden_act='silu' \(nemotron_h\) is not supported: .*relu2"):
        hf.config_from_hf(rewrite(src, tmp_path / "silu", mlp_hidden_act="silu"))
    with pytest.raises(hf.HFFormatError, match=r"use_conv_bias=False \(nemotron_h\) is not supported"):
        hf.config_from_hf(rewrite(src, tmp_path / "no-conv-bias", use_conv_bias=False))
    plain = load_config(None, ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16",
                               "model.vocab_size=64", "moe.num_experts=4", "moe.top_k=2"])
    with pytest.raises(hf.HFFormatError, match=r"(?s)nemotron_h cannot represent this model: it has .*"
                                               r"model.layer_types without moe / mlp sublayers"):
        hf.hf_family(plain, "nemotron_h")
    tied = cfg.replace(model=cfg.model.__class__(**{**cfg.model.__dict__, "tie_embeddings": True}))
    with pytest.raises(hf.HFFormatError, match=r"nemotron_h cannot represent this model: it has "
                                               r"model.tie_embeddings=true"):
        hf.save_hf(tied, params, tmp_path / "out", routing_state=routing_state, family="nemotron_h")
    assert not (tmp_path / "out").exists()
