"""Gemma 4's MoE language model against transformers itself (offline: a tiny random
Gemma4ForCausalLM built here): sliding layers beside full layers of their own head width and KV
heads, keys as values and proportional RoPE on the full layers, sandwich norms, a weightless value
norm and logits scaled 1, a dense GeGLU MLP beside GeGLU experts with their own norms, the router's
scaled norm and per-expert scales, the layer scalar, scaled embeddings and soft-capped logits.
Logits within 1e-4 (float32), the same experts chosen, the export reloads in transformers bit for
bit and round-trips exactly; the published multimodal layout (text_config, model.language_model.*,
towers skipped) reads the same model."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

from hf_oracle import edited_copy, hf_forward, ours, reload_bit_for_bit  # noqa: E402
from moefast.interop import hf  # noqa: E402

V, B, T = 128, 2, 48


def _model():
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24,
        hidden_size_per_layer_input=0, sliding_window=8, final_logit_softcapping=3.0, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # defaults (norms and scales 1) hide mappings: randomise them
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "scale")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _model()
    d = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(d)
    return model, d


def _parity(model, d, monkeypatch):
    tokens = np.random.default_rng(0).integers(0, V, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 30:] = 0
    want, want_chosen = hf_forward(model, tokens, mask)
    cfg, params = hf.load_hf(d)
    got, got_chosen = ours(cfg, params, hf.load_hf_routing(d, cfg), tokens, mask, monkeypatch)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    for g, w in zip(got_chosen, want_chosen, strict=True):
        assert np.array_equal(g[real.reshape(-1)], w[real.reshape(-1)])
    return cfg, params


def test_logits_and_chosen_experts_equal_transformers(saved, monkeypatch):
    model, d = saved
    cfg, _ = _parity(model, d, monkeypatch)
    m, e = cfg.model, cfg.moe
    assert (m.global_head_dim, m.num_global_kv_heads, m.attention_k_eq_v, m.global_rotary_fraction,
            m.global_rope_base, m.rope_base, m.attention_scale, m.final_logit_softcapping) == (
        32, 1, True, 0.25, 1e6, 1e4, 1.0, 3.0)
    assert (e.expert_activation, e.shared_expert_d_ff, e.shared_expert_gate, e.branch_norms, e.per_expert_scale,
            e.top_k) == ("gelu_tanh", 96, False, True, True, 2)


def test_export_reloads_in_transformers_and_round_trips_exactly(saved, tmp_path):
    model, d = saved
    cfg, params = hf.load_hf(d)
    assert hf.hf_family(cfg) == "gemma4_text"
    out = hf.save_hf(cfg, params, tmp_path / "export")
    reloaded = reload_bit_for_bit(model, out, "Gemma4ForCausalLM")
    want, got = model.config.to_dict(), reloaded.config.to_dict()
    for key in ("layer_types", "sliding_window", "rope_parameters", "final_logit_softcapping", "attention_k_eq_v",
                "top_k_experts", "per_layer_config", "hidden_activation", "intermediate_size", "moe_intermediate_size"):
        assert got[key] == want[key], key
    cfg2, params2 = hf.load_hf(out)
    assert cfg2.model == cfg.model and cfg2.moe == cfg.moe
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_multimodal_checkpoint_reads_its_language_model(saved, tmp_path, monkeypatch):
    """google/gemma-4-26B-A4B's layout: model_type gemma4 with text_config, the language model
    under model.language_model.*, vision and audio towers beside it (skipped with one note)."""
    from safetensors.numpy import load_file, save_file

    model, d = saved
    tensors = {n.replace("model.", "model.language_model.", 1): a for n, a in load_file(str(d / "model.safetensors")).items()}
    tensors["model.vision_tower.patch_embedder.weight"] = np.zeros((4, 4), np.float32)
    tensors["model.embed_vision.embedding_projection.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "tie_word_embeddings": True,
        "text_config": {**text, "model_type": "gemma4_text"}, "vision_config": {"model_type": "gemma4_vision"}}))
    with pytest.warns(UserWarning, match="vision tower"):
        cfg, _ = _parity(model, tmp_path, monkeypatch)
    assert hf.hf_family(cfg) == "gemma4_text"


@pytest.mark.parametrize("change, field", [
    (dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers"),
    (dict(enable_moe_block=False), "enable_moe_block"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"]), "layer_types"),
    (dict(per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 64}}), "per_layer_config"),
    (dict(top_k_experts=99), "top_k_experts"),
    (dict(top_k_experts=None), "top_k_experts"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
])
def test_unsupported_options_name_the_field(saved, tmp_path, change, field):
    _, d = saved
    edited_copy(d, tmp_path, change)
    with pytest.raises(hf.HFFormatError, match=f"config.json: {field}="):
        hf.load_hf(tmp_path)


def test_other_families_refuse_what_they_cannot_hold(saved):
    _, d = saved
    cfg, _ = hf.load_hf(d)
    with pytest.raises(hf.HFFormatError) as err:
        hf.hf_family(cfg, "qwen3_moe")
    for what in ("model.sandwich_norm=true", "moe.branch_norms=true", "model.attention_k_eq_v=true",
                 "model.global_head_dim=32", "moe.expert_activation=gelu_tanh"):
        assert what in str(err.value), what


def test_a_trained_step_exports_to_the_same_model(saved, tmp_path, monkeypatch):
    """One gradient step on the next-token loss moves every parameter (the layer scalars, the
    router's scales and the branch norms included); transformers, reloading the export, computes
    moefast's logits for the stepped parameters."""
    import jax.numpy as jnp
    import optax

    from hf_oracle import module

    _, d = saved
    cfg, params = hf.load_hf(d)
    tokens = np.random.default_rng(1).integers(0, V, (B, T))

    def loss(p):
        logits = module(cfg, p)(jnp.asarray(tokens[:, :-1]), drop_tokens=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(tokens[:, 1:])).mean()

    grads = jax.jit(jax.grad(loss))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    still = [jax.tree_util.keystr(k) for k, g in flat if not np.any(np.asarray(g))]
    assert not still, still
    stepped = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    out = hf.save_hf(cfg, stepped, tmp_path / "stepped")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mask = np.ones((B, T), np.int64)
    want, want_chosen = hf_forward(reloaded, tokens, mask)
    got, got_chosen = ours(cfg, stepped, None, tokens, mask, monkeypatch)
    for g, w in zip(got_chosen, want_chosen, strict=True):
        assert np.array_equal(g, w)
    before, _ = ours(cfg, params, None, tokens, mask, monkeypatch)
    assert np.abs(got - before).max() > 0.5  # the step changed the model (here by up to ~1.7 in a logit)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_absent_keys_read_as_transformers_defaults_them(saved, tmp_path):
    """No rope_parameters: transformers' proportional RoPE on the full layers (a quarter of the
    pairs, base 1e6) and plain RoPE at 1e4 on the sliding ones; no tie_word_embeddings: tied."""
    _, d = saved
    edited_copy(d, tmp_path, {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"], cfg["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = hf.load_hf(tmp_path)[0].model
    assert (m.global_rotary_fraction, m.global_rope_base, m.rope_base, m.tie_embeddings) == (0.25, 1e6, 1e4, True)
