"""Hugging Face import/export of GLM-5 / 5.1 (``glm_moe_dsa``: DeepSeek-V3.2's sparse MLA with GLM's
defaults and an indexer whose RoPE features are interleaved pairs) against transformers'
``GlmMoeDsaForCausalLM`` itself.

A tiny random model is built offline (fp32, eager attention; 3 layers, layer 0 dense by
``first_k_dense_replace``; 8 experts in GLM's single group; MLA with a low-rank query; an indexer of
16 heads of 16 features keeping ``index_topk`` = 8 keys per query, its first 8 features rotated as
interleaved pairs, which moefast permutes once at import to its rotate-half order), saved in both
on-disk expert layouts and run by moefast on 2 x 40 tokens, once with a right-padded row and once
with a row of two packed documents: logits within 1e-4 of transformers' on the real tokens, the same
experts per token, the same selected keys per query. ``save_hf`` -> ``from_pretrained`` gives
transformers' weights bit for bit and ``load_hf(save_hf(x)) == x``. A missing indexer tensor and
layers that reuse the previous layer's selection (``indexer_types`` "shared", which moefast does not
implement): one clear error each. The sparse model itself (and its decoding cache) is tested with
DeepSeek-V3.2 (``test_hf_deepseek_v32.py``); only the family's differences are checked here.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
if not hasattr(transformers, "GlmMoeDsaConfig"):
    pytest.skip("this transformers has no glm_moe_dsa", allow_module_level=True)

from moefast.interop import families, hf  # noqa: E402
from hf_oracle import (dsa_packed_parity, dsa_padded_parity, equal_trees, hf_forward, hf_selected_keys,  # noqa: E402
                       our_selected_keys, ours, padded_batch, random_dsa_model, reload_bit_for_bit, rewrite,
                       saved_and_loaded, tensors)

V, B, T = 128, 2, 40
PAD_FROM = 27  # row 1 is padding from here on
DOC_A = 22  # the packed row: documents of 22 and 18 tokens
TOPK, LAYERS = 8, 3
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              max_position_embeddings=256, first_k_dense_replace=1, index_topk=TOPK, index_n_heads=16,
              index_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              pad_token_id=None, bos_token_id=1, eos_token_id=2)  # no zero embedding row: no all-zero index scores


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(HF model, its directory per on-disk layout, moefast's config, params and routing state)."""
    model = random_dsa_model(transformers.GlmMoeDsaConfig, CONFIG)
    assert model.config.indexer_types == ["full"] * LAYERS  # transformers' default: an indexer every layer
    return saved_and_loaded(model, "glm_moe_dsa", tmp_path_factory)


def test_logits_experts_and_selected_keys_equal_transformers_with_padding(saved, monkeypatch):
    m, e = saved[2].model, saved[2].moe
    assert (m.attention, m.index_topk, m.index_n_heads, m.index_head_dim, m.num_dense_layers, m.norm_eps) == \
        ("mla", TOPK, 16, 16, 1, 1e-5)
    assert (e.score_func, e.num_groups, e.topk_groups, e.routed_scaling_factor) == ("sigmoid", 1, 1, 2.5)
    dsa_padded_parity(saved, monkeypatch, vocab=V, batch=B, tokens=T, pad_from=PAD_FROM, topk=TOPK)


def test_the_indexer_rope_permutation_is_what_makes_the_selection_agree(saved, monkeypatch):
    """Read without the indexer's column permutation (as DeepSeek-V3.2's rotate-half indexer is), the
    same checkpoint selects other keys: the interleaved layout is checked, not assumed."""
    model, dirs, _, _, _ = saved
    plain = families.REGISTRY["glm_moe_dsa"]
    monkeypatch.setitem(families.REGISTRY, "glm_moe_dsa", families.dataclasses.replace(
        plain, rope_interleave={k: v for k, v in plain.rope_interleave.items() if "indexer" not in k}))
    cfg, params = hf.load_hf(dirs["per_expert"])
    tokens, mask = padded_batch(V, B, T, PAD_FROM)
    _, want_sel = hf_selected_keys(model, lambda: hf_forward(model, tokens, mask))
    got_sel = our_selected_keys(monkeypatch)
    ours(cfg, params, hf.load_hf_routing(dirs["per_expert"], cfg), tokens, mask, monkeypatch)
    real = mask.astype(bool)
    assert not np.array_equal(got_sel[0][real], want_sel[0][real])


def test_packed_documents_equal_transformers(saved, monkeypatch):
    """A row of two documents (transformers: restarting position_ids, no mask, no cache): each
    document's queries select and attend only inside it."""
    dsa_packed_parity(saved, monkeypatch, vocab=V, batch=B, tokens=T, doc_a=DOC_A, topk=TOPK)


def test_export_reloads_in_transformers_and_round_trips_exactly(saved, tmp_path):
    """Both layouts: transformers loads the export with every weight bit-equal (the indexer's
    columns permuted back to interleaved pairs) and no key missing or unexpected; load_hf of it is
    the imported model exactly."""
    model, _, cfg, params, routing_state = saved
    for layout in ("per_expert", "fused"):
        out = hf.save_hf(cfg, params, tmp_path / layout, routing_state=routing_state, layout=layout,
                         family="glm_moe_dsa")
        written = json.loads((out / "config.json").read_text())
        assert (written["model_type"], written["index_topk"], written["index_n_heads"], written["n_group"]) == \
            ("glm_moe_dsa", TOPK, 16, 1)
        assert written["indexer_types"] == ["full"] * LAYERS
        assert written["layer_types"] == ["indexed_attention"] * LAYERS
        assert "model.layers.2.self_attn.indexer.wk.weight" in tensors(out)
        reload_bit_for_bit(model, out, "GlmMoeDsaForCausalLM")
        cfg2, params2 = hf.load_hf(out)
        assert cfg2.model == cfg.model and cfg2.moe == cfg.moe
        equal_trees(params, params2)
        equal_trees(routing_state, hf.load_hf_routing(out, cfg2))


def test_bad_checkpoints_are_one_clear_error(saved, tmp_path):
    """A missing indexer tensor; layers that reuse the previous layer's selection, listed in
    indexer_types or derived by transformers from index_topk_freq: one error each."""
    _, dirs, cfg, _, _ = saved
    src = dirs["per_expert"]
    wq = "model.layers.2.self_attn.indexer.wq_b.weight"
    with pytest.raises(hf.HFFormatError, match=rf"1 tensor that config.json implies is missing: \['{wq}'\]"):
        hf.load_hf(rewrite(src, tmp_path / "no-wq", drop=[wq]))
    shared = ["full", "shared", "full"]
    with pytest.raises(hf.HFFormatError, match=r"indexer_types=\['full', 'shared', 'full'\] \(glm_moe_dsa\) "
                                               r".*reuse the previous layer's selection"):
        hf.config_from_hf(rewrite(src, tmp_path / "shared", indexer_types=shared))
    with pytest.raises(hf.HFFormatError, match=r"indexer_types=\['full', 'full', 'shared'\]"):
        hf.config_from_hf(rewrite(src, tmp_path / "freq", indexer_types=None, index_topk_freq=2))
    hub = rewrite(src, tmp_path / "hub", indexer_types=None, layer_types=None, mlp_layer_types=None)
    assert hf.config_from_hf(hub).model == cfg.model  # transformers' defaults: every layer full
