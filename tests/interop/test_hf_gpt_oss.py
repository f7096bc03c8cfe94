"""gpt-oss against transformers itself (offline: a tiny random GptOssForCausalLM built here): sliding
windows alternating with full attention, a sink logit per head, biases on the attention and the
experts, the router's bias and softmax over the top-k logits, the clamped SwiGLU with gate/up
interleaved on disk, YaRN without truncation. Logits within 1e-4 (float32), the same experts chosen,
and the export reloads in transformers bit for bit and round-trips exactly."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

from hf_oracle import edited_copy, hf_forward, ours, reload_bit_for_bit  # noqa: E402
from moefast.interop import hf  # noqa: E402

V, B, T = 128, 2, 64


def _model():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, num_experts_per_tok=2, tie_word_embeddings=False, num_hidden_layers=2,
        intermediate_size=32, num_local_experts=8, sliding_window=8,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # defaults (norms 1, biases 0) hide mappings: randomise; experts large enough to clamp
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "experts" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _model()
    d = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(d)
    return model, d


def test_logits_and_chosen_experts_equal_transformers(saved, monkeypatch):
    model, d = saved
    tokens = np.random.default_rng(0).integers(0, V, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, 40:] = 0
    want, want_chosen = hf_forward(model, tokens, mask)
    cfg, params = hf.load_hf(d)
    m, e = cfg.model, cfg.moe
    assert (m.layer_types, m.sliding_window, m.attention_sinks, m.rope_truncate) == (
        ("sliding_attention", "full_attention"), 8, True, False)
    assert (e.expert_activation, e.swiglu_limit, e.expert_bias, e.router_bias) == ("clamped_swiglu", 7.0, True, True)
    got, got_chosen = ours(cfg, params, hf.load_hf_routing(d, cfg), tokens, mask, monkeypatch)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    for g, w in zip(got_chosen, want_chosen):
        assert np.array_equal(g[real.reshape(-1)], w[real.reshape(-1)])


def test_export_reloads_in_transformers_and_round_trips_exactly(saved, tmp_path):
    model, d = saved
    cfg, params = hf.load_hf(d)
    assert hf.hf_family(cfg) == "gpt_oss"
    out = hf.save_hf(cfg, params, tmp_path / "export", routing_state=hf.load_hf_routing(d, cfg))
    reloaded = reload_bit_for_bit(model, out, "GptOssForCausalLM")
    for key in ("layer_types", "sliding_window", "swiglu_limit", "attention_bias", "num_local_experts",
                "intermediate_size", "head_dim"):
        assert getattr(reloaded.config, key) == getattr(model.config, key), key
    rope = reloaded.config.rope_parameters
    assert rope["truncate"] is False and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 64
    cfg2, params2 = hf.load_hf(out)
    assert cfg2.model == cfg.model and cfg2.moe == cfg.moe
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


@pytest.mark.parametrize("change, field", [
    (dict(swiglu_alpha=1.5), "swiglu_alpha"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (dict(sliding_window=None), "sliding_window"),
])
def test_unsupported_options_name_the_field(saved, tmp_path, change, field):
    _, d = saved
    edited_copy(d, tmp_path, change)
    with pytest.raises(hf.HFFormatError, match=f"config.json: {field}="):
        hf.load_hf(tmp_path)


def test_other_families_refuse_what_they_cannot_hold(saved):
    """A gpt-oss model exported as another family would lose its sinks, windows, biases and
    activation: each is named."""
    _, d = saved
    cfg, _ = hf.load_hf(d)
    with pytest.raises(hf.HFFormatError) as err:
        hf.hf_family(cfg, "qwen3_moe")
    for what in ("sliding_attention", "model.attention_sinks=true", "moe.expert_activation=clamped_swiglu",
                 "moe.expert_bias=true", "moe.router_bias=true"):
        assert what in str(err.value), what


def _mxfp4_checkpoint(saved, dst, *, bad_scales=False):
    """The tiny model's directory with its experts' weights stored as gpt-oss's hub checkpoints
    store them (MXFP4: ``X_blocks`` uint8 [E, O, I/32, 16], ``X_scales`` uint8 [E, O, I/32]),
    random codes and scales; returns them."""
    from safetensors.numpy import load_file, save_file

    _, d = saved
    tensors = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(3)
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, i, o = tensors.pop(name).shape  # HF's unquantized [E, I, O]
        blocks = rng.integers(0, 256, (e, o, i // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 132, (e, o, i // 32 + (1 if bad_scales else 0)), dtype=np.uint8)
        packed[name] = (blocks, scales)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    return packed


def test_mxfp4_experts_read_as_their_exact_dequantization(saved, tmp_path):
    """MXFP4 experts dequantized on read equal transformers' own dequantization
    (``integrations.mxfp4.convert_moe_packed_tensors``, float32) bit for bit, also for the slice of
    experts one device reads; scales that do not match their blocks are one clear error."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moefast.interop.hf_files import _Files

    packed = _mxfp4_checkpoint(saved, tmp_path / "mx")
    files = _Files(tmp_path / "mx")
    with pytest.warns(UserWarning, match="MXFP4 expert weights dequantized to float32 \\(4 tensors"):
        cfg, params = hf.load_hf(tmp_path / "mx")
    for name, (blocks, scales) in packed.items():
        want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                          dtype=torch.float32).numpy()  # [E, I, O]
        np.testing.assert_array_equal(files.get(name), want)
        np.testing.assert_array_equal(files.get(name, slice(2, 5)), want[2:5])  # a device's experts
        layer = int(name.split(".")[2])
        if name.endswith("gate_up_proj"):  # gate/up interleaved on disk, moefast's halves
            want = np.concatenate([want[..., 0::2], want[..., 1::2]], axis=-1)
        got = params["blocks"][layer]["ffn"]["w_in" if name.endswith("gate_up_proj") else "w_out"]
        np.testing.assert_array_equal(np.asarray(got), want)
    _mxfp4_checkpoint(saved, tmp_path / "bad", bad_scales=True)
    bad = r"MXFP4 \S+_proj_blocks \[8, \d+, 1, 16\] and \S+_scales \[8, \d+, 2\] do not match"
    with pytest.raises(hf.HFFormatError, match=bad):
        hf.load_hf(tmp_path / "bad")


def test_mxfp4_declared_without_mxfp4_tensors_or_for_another_family_is_refused(saved, tmp_path):
    """quant_method mxfp4 with no X_blocks / X_scales tensors, or in another family's config, is one
    clear error (and no run is written: load_hf writes nothing)."""
    _, d = saved
    edited_copy(d, tmp_path, {"quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(hf.HFFormatError, match="no tensor is stored as MXFP4"):
        hf.load_hf(tmp_path)
    from moefast.interop.hf_configs import _hf_sections

    mixtral = transformers.MixtralConfig(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=1, intermediate_size=32).to_dict()
    with pytest.raises(hf.HFFormatError, match="MXFP4 is read for gpt-oss's experts only, not Mixtral"):
        _hf_sections({**mixtral, "quantization_config": {"quant_method": "mxfp4"}})
