"""A Hugging Face family is one :class:`~moefast.interop.families.FamilySpec` (no torch needed).

A made-up family, built in the test from Mixtral's spec with other tensor names, another bias key and
no fused layout, is registered under a new ``model_type``: a tiny model round-trips through
``save_hf`` / ``load_hf`` exactly, with that family's names on disk, without touching the engine.
"""

import dataclasses
import json

import jax
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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4_moe", "hidden_size": 32}))
    with pytest.raises(hf.HFFormatError, match="model_type 'glm4_moe' is not supported") as e:
        hf.config_from_hf(tmp_path)
    assert all(t in str(e.value) for t in families.REGISTRY), str(e.value)
    with pytest.raises(hf.HFFormatError, match="not supported"):
        hf.load_hf_params(tmp_path, load_config(None, TINY))


def test_a_model_no_family_represents_names_each_familys_objection():
    cfg = load_config(None, TINY + ["moe.norm_topk_prob=false"])  # biases and raw gates: none of the four
    with pytest.raises(hf.HFFormatError, match="no Hugging Face family") as e:
        hf.hf_family(cfg)
    assert all(f"as {t} it has" in str(e.value) for t in families.REGISTRY), str(e.value)
    assert "Mixtral always renormalises" in str(e.value)


@pytest.mark.parametrize("extra", [["model.attention=mla"], ["model.partial_rotary_factor=0.5"],
                                   ["model.rope_type=yarn", "model.original_max_position_embeddings=32"]])
def test_attention_variants_without_a_family_are_refused(extra):
    """MLA, partial rotary and YaRN are not representable by the four families (their export comes
    with the DeepSeek/GLM families): refused by name rather than written as a model that differs."""
    with pytest.raises(hf.HFFormatError, match=f"{extra[0].split('=')[0]}=.*cannot be exported"):
        hf.hf_family(load_config(None, [t for t in TINY if "kv_heads" not in t and "bias" not in t] + extra))


def test_registry_specs_are_complete():
    for model_type, spec in families.REGISTRY.items():
        assert spec.model_type == model_type
        assert {("ffn", "router"), ("ffn", "w_in"), ("ffn", "w_out")} <= set(spec.moe_tensors["per_expert"])
    with pytest.raises(ValueError, match="hf_defaults lacks"):
        dataclasses.replace(families.REGISTRY["mixtral"], hf_defaults={"rope_theta": 1e4})
