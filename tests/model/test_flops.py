"""Model FLOPs per token and parameter counts: cross-checked against XLA's cost analysis of the
compiled train step and against the built model; the peak table and MFU."""

import types

import jax
import numpy as np
import pytest

from moefast.config import CONFIG_DIR, load_config
from moefast.model.flops import model_flops_per_token, param_counts
from moefast.train import ModelDef, Trainer
from moefast.train.mfu import Peak, mfu, peak_flops

BYTE_VOCAB = 259


MLA = ["model.attention=mla", "model.q_lora_rank=64", "model.kv_lora_rank=32", "model.qk_nope_head_dim=32",
       "model.qk_rope_head_dim=16", "model.v_head_dim=32"]


@pytest.mark.parametrize("extra", [[], [*MLA, "model.mtp_depth=1"]], ids=["gqa", "mla-mtp"])
def test_flops_per_token_match_xla_cost_analysis(text_dir, tmp_path, extra):
    """XLA counts every FLOP of the compiled step (the matmuls plus elementwise work, softmaxes and
    AdamW); the model count must be just below it. The case makes XLA's work equal the model's:
    capacity factor 1.0 with tokens * top_k divisible by the experts (capacity = the exact mean load,
    so the experts compute exactly top_k assignments per token), and one attention block (T = 128),
    so the full score matrix that the PaLM term counts is computed. Forgetting the attention term
    or the LM head moves the ratio out of [1, 1.025]. The tiny config with an untied head, a dense
    first layer and grouped-query attention (each a term of the count), or MLA with a low-rank query
    and values narrower than the queries/keys and a multi-token prediction module (its projection,
    MoE block, head pass and attention layer); one compile each (CI time)."""
    cfg = load_config(None, ["data.seq_len=128", "data.batch_size=16", "moe.capacity_factor=1.0",
                             f"data.source={text_dir}", "cache.compile_dir=null", "model.vocab_size=512",
                             "model.tie_embeddings=false", "model.num_dense_layers=1",
                             *(extra or ["model.num_kv_heads=2"])])
    trainer = Trainer(cfg, tmp_path, log=None, progress=False, devices=jax.devices()[:1])
    cost = trainer.compiled_train_step().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_per_token = cost["flops"] / (cfg.data.batch_size * cfg.data.seq_len)
    ours = model_flops_per_token(cfg, trainer.corpus.tokenizer.vocab_size)
    ratio = xla_per_token / ours
    assert ratio >= 1.0 and ratio <= 1.025, (xla_per_token, ours)


def test_param_counts_equal_the_built_model():
    cfg = load_config(None, ["model.vocab_size=300", "model.tie_embeddings=false", "model.num_dense_layers=1",
                             "model.moe_every=2", "model.num_layers=5", "model.num_kv_heads=2"])
    built = sum(x.size for x in jax.tree.leaves(ModelDef(cfg, BYTE_VOCAB).abstract_params))
    assert param_counts(cfg).total == built


@pytest.mark.parametrize("extra", [
    ["model.attention_bias=qkv", "model.qk_norm=per_head", "moe.shared_expert_d_ff=48", "model.dense_d_ff=96"],
    ["model.attention_bias=all", "model.qk_norm=full", "moe.shared_expert_d_ff=48", "moe.shared_expert_gate=false"],
    [*MLA, "model.num_kv_heads=4"], [*MLA, "model.num_kv_heads=4", "model.q_lora_rank=0"],
    [*MLA, "model.num_kv_heads=4", "model.index_topk=8", "model.index_n_heads=3", "model.index_head_dim=20",
     "model.mtp_depth=1"],  # DeepSeek-V3.2: the lightning indexer in every MLA block
    ["model.mtp_depth=2", "moe.shared_expert_d_ff=48"],
    ["model.mtp_depth=1", "model.num_dense_layers=3"],  # no MoE layer: a dense MTP block
    ["model.layer_types=[linear_attention,linear_attention,full_attention]", "model.attention_output_gate=true",
     "model.zero_centered_norm=true", "model.qk_norm=per_head", "model.linear_num_key_heads=2",
     "model.linear_num_value_heads=4", "model.linear_key_head_dim=8", "model.linear_value_head_dim=12",
     "moe.shared_expert_d_ff=48"],  # Qwen3-Next / Qwen3.5: Gated DeltaNet blocks beside gated attention
    ["model.layer_types=[linear_attention,full_attention,linear_attention]", "model.linear_attention_kind=kda",
     "model.linear_num_key_heads=3", "model.linear_num_value_heads=3", "model.linear_key_head_dim=8",
     "model.linear_value_head_dim=8"],  # Kimi Linear: KDA blocks
    ["model.layer_types=[linear_attention,full_attention,linear_attention]", "model.linear_attention_kind=mamba2",
     "model.linear_num_key_heads=2", "model.linear_num_value_heads=4", "model.linear_key_head_dim=16",
     "model.linear_value_head_dim=8", "moe.expert_activation=relu2", "moe.shared_expert_d_ff=48",
     "moe.expert_bias=true", "moe.latent_size=24"],  # Nemotron-H: Mamba-2 blocks, relu² experts, a latent MoE
    ["model.num_layers=6", "model.num_dense_layers=0",
     "model.layer_types=[linear_attention,moe,full_attention,mlp,linear_attention,moe]",
     "model.linear_attention_kind=mamba2", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4",
     "model.linear_key_head_dim=16", "model.linear_value_head_dim=8", "model.dense_activation=relu2",
     "moe.expert_activation=relu2", "model.position_encoding=none"],  # Nemotron-H: one sublayer per entry
    ["model.layer_types=[sliding_attention,full_attention,sliding_attention]", "model.sliding_window=8",
     "model.attention_sinks=true", "model.attention_bias=all", "moe.router_bias=true", "moe.expert_bias=true",
     "moe.expert_activation=clamped_swiglu", "model.mtp_depth=1"],  # gpt-oss: sinks, router and expert biases
    ["model.layer_types=[sliding_attention,full_attention,full_attention]", "model.sliding_window=8",
     "model.global_head_dim=32", "model.num_global_kv_heads=1", "model.attention_k_eq_v=true",
     "model.qk_norm=per_head", "model.sandwich_norm=true", "model.layer_scalar=true", "moe.shared_expert_d_ff=48",
     "moe.shared_expert_gate=false", "moe.branch_norms=true", "moe.per_expert_scale=true",
     "model.mtp_depth=1"],  # Gemma 4: full layers of their own shape, keys as values, its norms and scales
], ids=["qkv-bias-per-head-norm", "all-bias-full-norm", "mla-q-lora", "mla-direct-q", "mla-dsa", "mtp2-shared",
        "mtp1-dense", "hybrid-deltanet", "hybrid-kda", "hybrid-mamba2", "nemotron-h-sublayers", "gpt-oss",
        "gemma4"])
def test_param_counts_cover_the_hf_family_options(extra):
    cfg = load_config(None, ["model.vocab_size=300", "model.num_dense_layers=1", "model.num_layers=3",
                             "model.num_kv_heads=2", *extra])
    built = sum(x.size for x in jax.tree.leaves(ModelDef(cfg, BYTE_VOCAB).abstract_params))
    assert param_counts(cfg).total == built


def test_mixtral_8x7b_config_has_mixtrals_parameter_counts():
    """46.7B total, 12.9B active (Mixtral of Experts, Jiang et al. 2024), from the model built
    abstractly (no arrays) and from the analytic count."""
    cfg = load_config(CONFIG_DIR / "mixtral_8x7b.yaml")
    built = sum(x.size for x in jax.tree.leaves(ModelDef(cfg, BYTE_VOCAB).abstract_params))
    counts = param_counts(cfg)
    assert counts.total == built
    assert abs(built / 46.7e9 - 1) < 0.01, built
    assert abs(counts.active_with_embedding / 12.9e9 - 1) < 0.01, counts


def test_gpt_oss_and_gemma4_configs_have_the_model_cards_parameter_counts():
    """gpt-oss-20b: 20.9B total, 3.6B active; gpt-oss-120b: 116.8B and 5.1B (OpenAI 2025, model
    card, table 1; active counting the embedding's rows once, as the card does); Gemma 4 26B-A4B:
    25.2B and 3.8B (Google's model card for google/gemma-4-26B-A4B; the tied embedding once)."""
    for name, total, active, within in (("gpt_oss_20b", 20.9e9, 3.61e9, 0.005), ("gpt_oss_120b", 116.8e9, 5.13e9, 0.005),
                                        ("gemma4_26b_a4b", 25.2e9, 3.8e9, 0.01)):  # the card's "3.8B": 2 digits
        counts = param_counts(load_config(CONFIG_DIR / f"{name}.yaml"))
        assert abs(counts.total / total - 1) < within and abs(counts.active / active - 1) < within, (name, counts)


def test_h200_config_is_about_1b_parameters():
    counts = param_counts(load_config(CONFIG_DIR / "h200_1b.yaml"), BYTE_VOCAB)
    assert 0.9e9 < counts.total < 1.2e9 and counts.active < counts.total / 3


def test_peak_table_override_and_unknown_devices():
    gpu = lambda kind: types.SimpleNamespace(platform="gpu", device_kind=kind)
    p = peak_flops([gpu("NVIDIA H100 80GB HBM3")] * 8)
    assert p.per_device_tflops == 989.4 and p.devices == 8 and p.flops_per_s == pytest.approx(8 * 989.4e12)
    assert peak_flops([gpu("NVIDIA H100 PCIe")]).per_device_tflops == 756.0
    assert peak_flops([gpu("NVIDIA A100-SXM4-80GB")]).per_device_tflops == 312.0
    assert peak_flops([types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")]).per_device_tflops == 197.0
    unknown = peak_flops([gpu("Some Future GPU")])
    assert unknown.flops_per_s is None and "train.peak_tflops" in unknown.source
    assert mfu(1000.0, 1e9, unknown) is None
    assert peak_flops([gpu("Some Future GPU")] * 2, override_tflops=100.0).flops_per_s == 200e12
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    assert peak_flops([cpu] * 8, override_tflops=0.5).flops_per_s == 0.5e12  # virtual devices share one CPU
    assert mfu(2000.0, 1e9, Peak(4e12, 4.0, 1, "x")) == pytest.approx(0.5)


def test_cpu_peak_is_a_measured_estimate():
    p = peak_flops(jax.devices()[:8])
    assert p.devices == 1 and "estimate" in p.source
    assert 1e9 < p.flops_per_s < 1e14 and np.isfinite(p.flops_per_s)


def test_sparse_attention_counts_the_selected_keys_and_the_indexer():
    """DSA (model.index_topk = k): MLA's attention term over min(T, k) keys a query, plus the
    indexer's forward scores of all T keys; at T <= k the attention term is dense MLA's."""
    dsa = [*MLA, "model.index_topk=64", "model.index_n_heads=4", "model.index_head_dim=16", "model.num_layers=2"]
    for t in (32, 256):
        sparse = load_config(None, [*dsa, f"data.seq_len={t}"])
        dense = load_config(None, [*dsa[:-4], "model.num_layers=2", f"data.seq_len={t}"])
        # the indexer's own weights are in 6 * N_active: take that out before comparing attention terms
        n_index = param_counts(sparse, BYTE_VOCAB).active - param_counts(dense, BYTE_VOCAB).active
        per_layer = 6 * 4 * (32 + 16 + 32)  # 6 H (Hd_qk + Hv), heads 4 (the default num_heads)
        got = model_flops_per_token(sparse, BYTE_VOCAB) - 6 * n_index
        want = model_flops_per_token(dense, BYTE_VOCAB) + 2 * per_layer * (min(t, 64) - t) + 2 * 2 * 4 * 16 * t
        assert got == pytest.approx(want), (t, got, want)
    # the stages' KL: target logits 2 H Hd_qk and the indexer's scores forward + backward, per covered key
    t, kl = 256, 2 * 4 * 48 + 3 * 2 * 4 * 16
    base = model_flops_per_token(load_config(None, [*dsa, f"data.seq_len={t}"]), BYTE_VOCAB)
    sparse = model_flops_per_token(load_config(None, [*dsa, f"data.seq_len={t}", "train.indexer_stage=sparse"]),
                                   BYTE_VOCAB)
    assert sparse - base == pytest.approx(2 * kl * 64)
    warm = load_config(None, [*dsa, f"data.seq_len={t}", "train.indexer_stage=dense_warmup"])
    n = param_counts(warm, BYTE_VOCAB).active
    assert model_flops_per_token(warm, BYTE_VOCAB) == pytest.approx(2 * n + 2 * (2 * 4 * 80 * t + kl * t))
