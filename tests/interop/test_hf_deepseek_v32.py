"""Hugging Face import/export of DeepSeek-V3.2 (``deepseek_v32``: MLA with DeepSeek Sparse Attention's
lightning indexer) against transformers' ``DeepseekV32ForCausalLM`` itself.

A tiny random model is built offline (fp32, eager attention; 3 layers, layer 0 dense by
``first_k_dense_replace``; 8 experts in 2 groups, one kept; MLA with a low-rank query and
interleaved RoPE; an indexer of 16 heads of 16 features keeping ``index_topk`` = 8 keys per query,
so every query past the 8th attends to a strict subset of its keys), saved with ``save_pretrained``
in both on-disk expert layouts, read with :func:`moefast.interop.hf.load_hf` and run by moefast on
2 x 40 tokens, once with a right-padded row and once with a row of two packed documents
(transformers: ``position_ids`` restarting, no attention mask, no cache): logits within 1e-4 of
transformers' on the real tokens, the same experts per token, the same selected keys per query
(the indexer's top-k sets, restricted to the keys each query may see). Decoding through the cache
(the indexer's keys cached beside MLA's compressed cache) gives the full pass's logits. Then
``save_hf`` -> ``AutoModelForCausalLM.from_pretrained`` gives transformers' weights bit for bit, and
``load_hf(save_hf(x)) == x`` exactly. A missing indexer tensor and config.json keys moefast cannot
represent: one clear error each.

Ties are kept out, not compared: the config has no ``pad_token_id``, because transformers zeroes that
token's embedding row, and such a token's queries score every key 0 (a k-way tie that torch's and
XLA's top-k break differently).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
if not hasattr(transformers, "DeepseekV32Config"):
    pytest.skip("this transformers has no deepseek_v32", allow_module_level=True)

from moefast.interop import hf  # noqa: E402
from hf_oracle import (dsa_packed_parity, dsa_padded_parity, equal_trees, module, padded_batch,  # noqa: E402
                       prefill_then_decode, random_dsa_model, reload_bit_for_bit, rewrite, saved_and_loaded, tensors)

V, B, T = 128, 2, 40
PAD_FROM = 27  # row 1 is padding from here on
DOC_A = 22  # the packed row: documents of 22 and 18 tokens
TOPK = 8
CONFIG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256, first_k_dense_replace=1,
              index_topk=TOPK, index_n_heads=16, index_head_dim=16,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              pad_token_id=None, bos_token_id=1, eos_token_id=2)  # no zero embedding row: no all-zero index scores


def _hf_model(seed: int = 0):
    return random_dsa_model(transformers.DeepseekV32Config, CONFIG, seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(HF model, its directory per on-disk layout, moefast's config, params and routing state)."""
    return saved_and_loaded(_hf_model(), "deepseek_v32", tmp_path_factory)


def test_logits_experts_and_selected_keys_equal_transformers_with_padding(saved, monkeypatch):
    m, e = saved[2].model, saved[2].moe
    assert (m.attention, m.index_topk, m.index_n_heads, m.index_head_dim, m.num_dense_layers) == \
        ("mla", TOPK, 16, 16, 1)
    assert (e.score_func, e.num_groups, e.topk_groups, e.routed_scaling_factor) == ("sigmoid", 2, 1, 2.5)
    dsa_padded_parity(saved, monkeypatch, vocab=V, batch=B, tokens=T, pad_from=PAD_FROM, topk=TOPK)


def test_packed_documents_equal_transformers(saved, monkeypatch):
    """A row of two documents (transformers: restarting position_ids, no mask, no cache): each
    document's queries select and attend only inside it. With ``model.attention_impl=flash`` (the
    GPU default) the layers get segment ids, which the sparse path turns into the same bool mask
    (the fused kernel is not used): the same logits."""
    _, _, cfg, params, routing_state = saved
    got, tokens, seg = dsa_packed_parity(saved, monkeypatch, vocab=V, batch=B, tokens=T, doc_a=DOC_A, topk=TOPK)
    flash = cfg.replace(model=cfg.model.__class__(**{**cfg.model.__dict__, "attention_impl": "flash"}))
    with jax.default_matmul_precision("highest"):
        out = module(flash, params)(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(seg, jnp.int32),
                                    drop_tokens=False, routing_state=routing_state)
    np.testing.assert_allclose(np.asarray(out.logits), got, atol=1e-6, rtol=0)


def test_decoding_with_the_cache_equals_the_full_pass(saved):
    """Prefill 20 tokens, then one at a time through MLA's compressed cache and the indexer's key
    cache (k = 8 < the keys each query sees): the full pass's logits."""
    _, _, cfg, params, routing_state = saved
    ids = jnp.asarray(padded_batch(V, B, T, PAD_FROM)[0][:, :24], jnp.int32)
    full, decoded, cache = prefill_then_decode(cfg, params, routing_state, ids, prefill=20, cache_len=32)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=1e-4, rtol=1e-4)
    assert sorted(cache[0]) == ["index_k", "k_rope", "kv"] and cache[0]["index_k"].shape == (B, 32, 16)


def test_export_reloads_in_transformers_and_round_trips_exactly(saved, tmp_path):
    """Both layouts: transformers loads the export with every weight bit-equal and no key missing or
    unexpected; load_hf of it is the imported model exactly; the indexer's keys are written."""
    model, _, cfg, params, routing_state = saved
    assert hf.hf_family(cfg) == "deepseek_v32"
    for layout in ("per_expert", "fused"):
        out = hf.save_hf(cfg, params, tmp_path / layout, routing_state=routing_state, layout=layout)
        written = json.loads((out / "config.json").read_text())
        assert (written["model_type"], written["index_topk"], written["index_n_heads"], written["index_head_dim"]) == \
            ("deepseek_v32", TOPK, 16, 16)
        assert written["layer_types"] == ["indexed_attention"] * 3
        assert {"model.layers.2.self_attn.indexer.k_norm.bias", "model.layers.0.self_attn.indexer.wq_b.weight",
                "model.layers.1.self_attn.indexer.weights_proj.weight"} <= tensors(out).keys()
        reloaded = reload_bit_for_bit(model, out, "DeepseekV32ForCausalLM")
        assert reloaded.config.mlp_layer_types == model.config.mlp_layer_types
        cfg2, params2 = hf.load_hf(out)
        assert cfg2.model == cfg.model and cfg2.moe == cfg.moe
        equal_trees(params, params2)
        equal_trees(routing_state, hf.load_hf_routing(out, cfg2))


def test_bad_checkpoints_and_exports_are_one_clear_error(saved, tmp_path):
    """A missing indexer tensor, keys transformers' DeepSeek-V3.2 reads otherwise (rope_interleave
    false, a layer kind other than indexed_attention, dense layers listed against
    first_k_dense_replace), and a sparse model exported as dense DeepSeek-V3: one error each."""
    _, dirs, cfg, params, routing_state = saved
    src = dirs["per_expert"]
    wk = "model.layers.1.self_attn.indexer.wk.weight"
    with pytest.raises(hf.HFFormatError, match=rf"1 tensor that config.json implies is missing: \['{wk}'\]"):
        hf.load_hf(rewrite(src, tmp_path / "no-wk", drop=[wk]))
    with pytest.raises(hf.HFFormatError, match=r"rope_interleave=False \(deepseek_v32\) .*interleaved pairs"):
        hf.config_from_hf(rewrite(src, tmp_path / "split", rope_interleave=False))
    with pytest.raises(hf.HFFormatError, match=r"layer_types=.* only indexed_attention layers"):
        hf.config_from_hf(rewrite(src, tmp_path / "dense", layer_types=["full_attention"] * 3))
    with pytest.raises(hf.HFFormatError, match=r"mlp_layer_types disagrees with first_k_dense_replace=1"):
        hf.config_from_hf(rewrite(src, tmp_path / "mlp", mlp_layer_types=["dense", "dense", "sparse"]))
    hub = rewrite(src, tmp_path / "hub", layer_types=None, mlp_layer_types=None)  # the hub's keys only
    assert hf.config_from_hf(hub).model == cfg.model
    with pytest.raises(hf.HFFormatError, match=r"model.index_topk=8 \(DeepSeek-V3's attention is dense"):
        hf.save_hf(cfg, params, tmp_path / "out", routing_state=routing_state, family="deepseek_v3")
    assert not (tmp_path / "out").exists()
