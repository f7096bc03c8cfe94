"""Hugging Face import/export of Kimi Linear (``kimi_linear``: KDA + NoPE MLA) against transformers'
``KimiLinearForCausalLM`` itself.

A tiny random model is built offline (fp32; 4 layers: KDA, KDA, KDA, MLA per
``linear_attn_config``'s 1-indexed lists; layer 0 dense by ``first_k_dense_replace``; 8 experts in
2 groups, one group kept, two shared experts, gates renormalised and scaled; every norm weight,
A_log, dt_bias and selection bias random so defaults hide nothing), saved with ``save_pretrained``
in both on-disk layouts (the hub's names: ``block_sparse_moe.*``, q/k/v short convolutions apart,
the dense MLP under ``block_sparse_moe.`` as transformers writes it; and transformers' in-memory
names: ``mlp.*``, one joined ``conv1d``, ``forget_gate.*``), read with :func:`moefast.interop.hf.load_hf`
and run by moefast: logits within 1e-4 of transformers' on the real tokens of 2 x 40 tokens with a
right-padded row, the same experts chosen for every real token in every MoE layer; decoding
through the cache (KDA states, MLA's compressed cache without RoPE) gives the full pass's logits.
Then ``save_hf`` -> ``AutoModelForCausalLM.from_pretrained`` gives transformers' weights bit for
bit, and ``load_hf(save_hf(x)) == x`` exactly. Bad configs and a missing KDA tensor: one clear error
each, and an export that cannot be exact writes nothing.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
if not hasattr(transformers, "KimiLinearConfig"):
    pytest.skip("this transformers has no kimi_linear", allow_module_level=True)

from moefast.interop import hf  # noqa: E402
from hf_oracle import (equal_trees, hf_forward, ours, padded_batch, reload_bit_for_bit, rewrite,  # noqa: E402
                       prefill_then_decode, saved_layouts, tensors)

V, B, T = 128, 2, 40
PAD_FROM = 27  # row 1 is padding from here on
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              n_shared_experts=2, routed_scaling_factor=2.5, max_position_embeddings=256, first_k_dense_replace=1,
              linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16, "num_heads": 4,
                                  "short_conv_kernel_size": 4},
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf_model(seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.KimiLinearConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # routing margins well above float rounding
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(HF model, its directory per on-disk layout, moefast's config, params and routing state)."""
    model = _hf_model()
    dirs = saved_layouts(model, "kimi_linear", tmp_path_factory)
    cfg, params = hf.load_hf(dirs["per_expert"])
    return model, dirs, cfg, params, hf.load_hf_routing(dirs["per_expert"], cfg)


def test_logits_and_chosen_experts_equal_transformers(saved, monkeypatch):
    model, dirs, cfg, params, routing_state = saved
    m, e = cfg.model, cfg.moe
    assert m.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (m.linear_attention_kind, m.position_encoding, m.attention, m.num_dense_layers) == ("kda", "none", "mla", 1)
    assert (m.linear_num_value_heads, m.linear_value_head_dim, m.linear_conv_kernel_dim) == (4, 16, 4)
    assert (e.score_func, e.num_groups, e.topk_groups, e.routed_scaling_factor, e.norm_topk_prob) == \
        ("sigmoid", 2, 1, 2.5, True)
    assert (e.shared_expert_d_ff, e.shared_expert_gate, m.tie_embeddings) == (64, False, False)
    assert np.abs(np.asarray(routing_state["bias"])).max() > 0  # the selection biases were read
    tokens, mask = padded_batch(V, B, T, PAD_FROM)
    want, want_chosen = hf_forward(model, tokens, mask)
    got, got_chosen = ours(cfg, params, routing_state, tokens, mask, monkeypatch)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    assert len(got_chosen) == len(want_chosen) == 3
    for layer, (g, w) in enumerate(zip(got_chosen, want_chosen)):
        assert np.array_equal(g[real.reshape(-1)], w[real.reshape(-1)]), f"MoE layer {layer}: other experts chosen"
    fused_cfg, fused = hf.load_hf(dirs["fused"])  # transformers' in-memory names: the very same model
    assert fused_cfg.model == m and fused_cfg.moe == e
    equal_trees(params, fused)
    equal_trees(routing_state, hf.load_hf_routing(dirs["fused"], fused_cfg))


def test_decoding_with_the_cache_equals_the_full_pass(saved):
    """Prefill, then one token at a time through the KDA states and MLA's compressed cache (its
    kv_b_proj absorbed; nothing rotated): the full pass's logits."""
    _, _, cfg, params, routing_state = saved
    ids = jnp.asarray(padded_batch(V, B, T, PAD_FROM)[0][:, :24], jnp.int32)
    full, decoded, _ = prefill_then_decode(cfg, params, routing_state, ids, prefill=20, cache_len=32)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=1e-4, rtol=1e-4)


def test_export_reloads_in_transformers_and_round_trips_exactly(saved, tmp_path):
    """Both layouts: transformers loads the export with every weight bit-equal and no key missing or
    unexpected; the per-expert export holds the hub's names (q/k/v convolutions apart, the dense MLP
    under mlp.) and Kimi Linear's own config keys; load_hf of it is the imported model exactly."""
    model, _, cfg, params, routing_state = saved
    assert hf.hf_family(cfg) == "kimi_linear"
    for layout in ("per_expert", "fused"):
        out = hf.save_hf(cfg, params, tmp_path / layout, routing_state=routing_state, layout=layout)
        written = json.loads((out / "config.json").read_text())
        assert written["linear_attn_config"] == {**CONFIG["linear_attn_config"]}
        assert (written["num_experts"], written["num_experts_per_token"], written["num_expert_group"],
                written["num_shared_experts"], written["first_k_dense_replace"], written["mla_use_nope"]) == \
            (8, 2, 2, 2, 1, True)
        assert "rope_parameters" not in written and "num_experts_per_tok" not in written
        names = tensors(out)
        if layout == "per_expert":
            assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.q_conv1d.weight",
                    "model.layers.1.block_sparse_moe.experts.7.w2.weight"} <= names.keys()
        reloaded = reload_bit_for_bit(model, out, "KimiLinearForCausalLM")
        assert reloaded.config.layer_types == model.config.layer_types
        assert reloaded.config.mlp_layer_types == model.config.mlp_layer_types
        cfg2, params2 = hf.load_hf(out)
        assert cfg2.model == cfg.model and cfg2.moe == cfg.moe
        equal_trees(params, params2)
        equal_trees(routing_state, hf.load_hf_routing(out, cfg2))


def test_bad_checkpoints_are_one_clear_error(saved, tmp_path):
    """A missing KDA tensor, layer lists that miss a layer, disagree with layer_types or carry a key
    Kimi Linear has not, RoPE on the MLA layers: one error naming the tensor or the key. Without
    layer_types the 1-indexed lists give the kinds (the hub's config.json has only them)."""
    _, dirs, cfg, params, routing_state = saved
    src = dirs["per_expert"]
    conv = "model.layers.2.self_attn.k_conv1d.weight"
    with pytest.raises(hf.HFFormatError, match=rf"1 tensor that config.json implies is missing: \['{conv}'\]"):
        hf.load_hf(rewrite(src, tmp_path / "no-conv", drop=[conv]))
    hub = rewrite(src, tmp_path / "hub", layer_types=None, mlp_layer_types=None)  # the hub's keys only
    assert hf.config_from_hf(hub).model == cfg.model
    linear = CONFIG["linear_attn_config"]
    with pytest.raises(hf.HFFormatError, match=r"linear_attn_config.kda_layers=\[1, 2\] .*layer 3 is in neither"):
        hf.config_from_hf(rewrite(hub, tmp_path / "gap", linear_attn_config={**linear, "kda_layers": [1, 2]}))
    with pytest.raises(hf.HFFormatError, match=r"layer_types=.* disagrees with linear_attn_config's kda_layers"):
        hf.config_from_hf(rewrite(src, tmp_path / "disagree", layer_types=["linear_attention"] * 4))
    with pytest.raises(hf.HFFormatError, match=r"layer_types=.* 3 entries for num_hidden_layers=4"):
        hf.config_from_hf(rewrite(src, tmp_path / "short", layer_types=["linear_attention"] * 2 + ["full_attention"],
                                   linear_attn_config={k: v for k, v in linear.items() if not k.endswith("layers")}))
    with pytest.raises(hf.HFFormatError, match=r"linear_attn_config.gate_lower_bound=-5.0 \(kimi_linear\) is not "
                                               r"supported: not a Kimi Linear key"):
        hf.config_from_hf(rewrite(src, tmp_path / "k3", linear_attn_config={**linear, "gate_lower_bound": -5.0}))
    with pytest.raises(hf.HFFormatError, match=r"mla_use_nope=False .*never rotates"):
        hf.config_from_hf(rewrite(src, tmp_path / "rope", mla_use_nope=False))
    tied = cfg.replace(model=cfg.model.__class__(**{**cfg.model.__dict__, "tie_embeddings": True}))
    with pytest.raises(hf.HFFormatError, match=r"kimi_linear cannot represent this model: it has "
                                               r"model.tie_embeddings=true"):
        hf.save_hf(tied, params, tmp_path / "out", routing_state=routing_state, family="kimi_linear")
    assert not (tmp_path / "out").exists()
