"""Multi-head latent attention, YaRN, partial rotary and the RoPE de-interleaving permutation against
Hugging Face transformers (DeepSeek-V3/V2, GLM-4.5) with copied weights in float32; MLA decoding
with the compressed cache against the full forward; the cache's bytes per token."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moefast.config import load_config
from moefast.model import transformer
from moefast.model.attention import Attention
from moefast.model.positional import Yarn, apply_rope, rope_cos_sin, rope_deinterleave_permutation
from moefast.train import ModelDef
from moefast.train.step import make_optimizer

torch = pytest.importorskip("torch")

B, T, D, H = 2, 24, 32, 4
N, R, C, HV = 8, 4, 12, 6  # qk_nope, qk_rope, kv_lora_rank, v_head_dim (Hv != N + R)
ORIGINAL, MAX_LEN = 16, 64  # the YaRN test positions run past the original context
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.5)  # attention factor m(4, 1) / m(4, 0.5) != 1, softmax multiplier m(4, 0.5)^2
POSITIONS = np.stack([np.arange(T) + 40, np.arange(T) + 3])  # row 0 entirely past ORIGINAL


def _yarn():
    return Yarn(YARN["factor"], ORIGINAL, YARN["beta_fast"], YARN["beta_slow"], YARN["mscale"], YARN["mscale_all_dim"])


def _causal_mask():
    return jnp.asarray(np.tril(np.ones((T, T), bool)))[None, None]


def _hf_mask():
    return torch.triu(torch.full((T, T), float("-inf")), 1)[None, None]


def _t(x):
    return np.asarray(x.detach().numpy(), np.float32)


def _randomise(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if p.ndim == 1 else 0.0))


def _hf_deepseek(version, q_lora_rank, rope_interleave):
    kw = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=C,
              qk_nope_head_dim=N, qk_rope_head_dim=R, v_head_dim=HV, max_position_embeddings=MAX_LEN,
              rope_parameters={"rope_theta": 10000.0, **YARN})
    if version == "v3":
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as Attn
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding as Rope
        kw["rope_interleave"] = rope_interleave
    else:
        from transformers import DeepseekV2Config as Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention as Attn
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding as Rope
    cfg = Config(**kw)
    cfg._attn_implementation = "eager"
    attn = Attn(cfg, layer_idx=0).eval()
    _randomise(attn, seed=q_lora_rank or 1)
    return attn, Rope(cfg)


def _copy_into_mla(hf, q_lora_rank, interleaved, dtype=jnp.float32):
    """An MLAttention holding ``hf``'s weights: each a transpose, the RoPE output columns of the
    query and shared-key projections permuted once when the checkpoint is interleaved."""
    mla = transformer.MLAttention(D, H, q_lora_rank=q_lora_rank, kv_lora_rank=C, qk_nope_head_dim=N, qk_rope_head_dim=R,
                                  v_head_dim=HV, softmax_multiplier=_yarn().softmax_multiplier, dtype=dtype,
                                  init_std=0.02, out_std=0.02, rngs=nnx.Rngs(0))
    perm = rope_deinterleave_permutation(R) if interleaved else np.arange(R)
    q_cols = np.concatenate([h * (N + R) + np.concatenate([np.arange(N), N + perm]) for h in range(H)])
    kv_a_cols = np.concatenate([np.arange(C), C + perm])
    w = lambda lin: _t(lin.weight).T  # [in, out]
    if q_lora_rank:
        mla.q_a_proj[...] = jnp.asarray(w(hf.q_a_proj))
        mla.q_a_layernorm.scale[...] = jnp.asarray(_t(hf.q_a_layernorm.weight))
        mla.q_b_proj[...] = jnp.asarray(w(hf.q_b_proj)[:, q_cols])
    else:
        mla.q_proj[...] = jnp.asarray(w(hf.q_proj)[:, q_cols])
    mla.kv_a_proj_with_mqa[...] = jnp.asarray(w(hf.kv_a_proj_with_mqa)[:, kv_a_cols])
    mla.kv_a_layernorm.scale[...] = jnp.asarray(_t(hf.kv_a_layernorm.weight))
    mla.kv_b_proj[...] = jnp.asarray(w(hf.kv_b_proj))
    mla.o_proj[...] = jnp.asarray(w(hf.o_proj))
    return mla


@nnx.jit
def _mla_forward(mla, x, positions):
    rope = rope_cos_sin(positions, MAX_LEN, R, 10000.0, yarn=_yarn())
    return mla(x, rope, _causal_mask(), None, 0)[0]


@pytest.mark.parametrize("version,q_lora_rank,interleave", [("v3", 16, True), ("v3", None, False), ("v2", None, True)],
                         ids=["v3-q-lora-interleaved", "v3-direct-q", "v2-lite-complex-rope"])
def test_mla_equals_transformers_with_yarn_past_the_original_context(version, q_lora_rank, interleave):
    """fp32, YaRN factor 4 with an attention factor != 1 and DeepSeek's softmax multiplier, at
    positions up to 63 with an original context of 16. DeepSeek-V2's HF code always rotates
    interleaved pairs (complex multiplication, output interleaved); V3's de-interleaves when
    ``rope_interleave``: both reached by permuting the imported columns once."""
    hf, rope = _hf_deepseek(version, q_lora_rank, interleave)
    x = np.random.default_rng(0).normal(size=(B, T, D)).astype(np.float32)
    xt, pos = torch.tensor(x), torch.tensor(POSITIONS)
    with torch.no_grad():
        pe = rope(xt, pos)
        out = hf(xt, position_embeddings=pe, attention_mask=_hf_mask())[0] if version == "v3" else \
            hf(xt, attention_mask=_hf_mask(), position_embeddings=pe)[0]
    mla = _copy_into_mla(hf, q_lora_rank, interleave)
    ours = _mla_forward(mla, jnp.asarray(x), jnp.asarray(POSITIONS))
    np.testing.assert_allclose(np.asarray(ours), _t(out), rtol=1e-4, atol=1e-5)
    # control: without the YaRN softmax multiplier the outputs differ (the scale is seen)
    mla.scale = (N + R) ** -0.5
    assert not np.allclose(np.asarray(_mla_forward(mla, jnp.asarray(x), jnp.asarray(POSITIONS))), _t(out), atol=1e-3)
    if version == "v3" and q_lora_rank:  # bfloat16 compute (parameters float32): within bf16 rounding
        bf16 = _mla_forward(_copy_into_mla(hf, q_lora_rank, interleave, jnp.bfloat16), jnp.asarray(x),
                            jnp.asarray(POSITIONS))
        assert bf16.dtype == jnp.bfloat16
        err = np.abs(np.asarray(bf16, np.float32) - _t(out)).max()
        assert err < 0.03 * np.abs(_t(out)).max(), err


def test_yarn_frequencies_and_factors_equal_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for yarn in (YARN, {**YARN, "mscale": None, "mscale_all_dim": None, "beta_fast": 8.0, "factor": 3.0}):
        cfg = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=4096,
                               rope_parameters={"rope_theta": 10000.0, **yarn})
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
        ours = Yarn(yarn["factor"], ORIGINAL, yarn["beta_fast"], yarn["beta_slow"], yarn["mscale"], yarn["mscale_all_dim"])
        np.testing.assert_allclose(ours.inv_freq(64, 10000.0), inv_freq.numpy(), rtol=1e-6)
        assert ours.attention_factor == pytest.approx(factor, rel=1e-12)
        assert np.ptp(ours.inv_freq(64, 10000.0) / (10000.0 ** (-np.arange(0, 64, 2) / 64))) > 0.5  # really scaled


def test_yarn_tables_cached_and_computed_in_the_step_agree():
    """``cache.tables=false`` computes YaRN's phases in the step (float32) from the same
    frequencies; the cached table is one constant per scaling (its key holds the YaRN parameters)."""
    from moefast.model.positional import TABLES, rope_table

    pos = jnp.asarray(POSITIONS)
    yarn = _yarn()
    cached = rope_cos_sin(pos, MAX_LEN, 16, 10000.0, yarn=yarn)
    computed = jax.jit(lambda p: rope_cos_sin(p, MAX_LEN, 16, 10000.0, cached=False, yarn=yarn))(pos)
    for a, e in zip(cached, computed):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
    plain = rope_table(MAX_LEN, 16, 10000.0)
    assert not np.allclose(plain[0], rope_table(MAX_LEN, 16, 10000.0, yarn)[0])
    assert rope_table(MAX_LEN, 16, 10000.0, yarn)[0] is not plain[0]
    assert any(k[3][1:2] == ("yarn",) for k in TABLES.keys())


def test_rope_deinterleave_permutation_makes_rotate_half_equal_interleaved_rotation():
    """Permuted projection columns + moefast's rotate-half RoPE == transformers' interleaved rotation
    (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``) of the unpermuted projection, bit for bit in
    structure and to fp32 rounding in value."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    rng = np.random.default_rng(3)
    rd, t = 8, 10
    x = rng.normal(size=(1, t, D)).astype(np.float32)
    w = rng.normal(size=(D, rd)).astype(np.float32)  # the rope columns of a projection, interleaved
    pos = np.arange(t)[None] * 7
    cos, sin = rope_cos_sin(jnp.asarray(pos), 128, rd, 10000.0)
    perm = rope_deinterleave_permutation(rd)
    ours = apply_rope(jnp.asarray(x @ w[:, perm])[:, :, None], cos, sin)[:, :, 0]
    emb = lambda a: torch.tensor(np.concatenate([a, a], -1)[:, :, 0])  # HF's cat(freqs, freqs) cos/sin
    k = torch.tensor(x @ w)[:, None]  # [B, 1, T, R]
    _, want = apply_rotary_pos_emb_interleave(k, k, emb(np.asarray(cos)), emb(np.asarray(sin)))
    np.testing.assert_allclose(np.asarray(ours), _t(want[:, 0]), rtol=1e-5, atol=1e-5)
    assert list(perm) == [0, 2, 4, 6, 1, 3, 5, 7]
    with pytest.raises(ValueError):
        rope_deinterleave_permutation(5)


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default-rope", "yarn"])
def test_glm_partial_rotary_equals_transformers_glm4_moe(rope_scaling):
    """GLM-4.5 attention (q/k/v biases, half of each head rotated) against Glm4MoeAttention."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeAttention, Glm4MoeRotaryEmbedding

    g, hd = 2, 8
    cfg = Glm4MoeConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=g, head_dim=hd, attention_bias=True,
                        max_position_embeddings=MAX_LEN, partial_rotary_factor=0.5,
                        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, **(rope_scaling or {})})
    cfg._attn_implementation = "eager"
    hf = Glm4MoeAttention(cfg, layer_idx=0).eval()
    _randomise(hf, seed=4)
    x = np.random.default_rng(1).normal(size=(B, T, D)).astype(np.float32)
    xt, pos = torch.tensor(x), torch.tensor(POSITIONS)
    with torch.no_grad():
        out = hf(xt, position_embeddings=Glm4MoeRotaryEmbedding(cfg)(xt, pos), attention_mask=_hf_mask())[0]
    attn = Attention(D, H, g, hd, dtype=jnp.float32, init_std=0.02, out_std=0.02, bias="qkv",
                                 rngs=nnx.Rngs(0))
    attn.qkv[...] = jnp.asarray(np.concatenate([_t(p.weight).T for p in (hf.q_proj, hf.k_proj, hf.v_proj)], 1))
    attn.qkv_bias[...] = jnp.asarray(np.concatenate([_t(p.bias) for p in (hf.q_proj, hf.k_proj, hf.v_proj)]))
    attn.out[...] = jnp.asarray(_t(hf.o_proj.weight).T)
    yarn = None if rope_scaling is None else _yarn()

    @nnx.jit
    def forward(attn, x, positions):
        return attn(x, rope_cos_sin(positions, MAX_LEN, hd // 2, 10000.0, yarn=yarn), _causal_mask(), None, 0)[0]

    np.testing.assert_allclose(np.asarray(forward(attn, jnp.asarray(x), jnp.asarray(POSITIONS))), _t(out),
                               rtol=1e-4, atol=1e-5)


MLA_MODEL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.d_ff=48", "model.max_seq_len=64",
             "data.seq_len=32", "moe.num_experts=4", "moe.top_k=2", "model.attention=mla", "model.q_lora_rank=16",
             f"model.kv_lora_rank={C}", f"model.qk_nope_head_dim={N}", f"model.qk_rope_head_dim={R}",
             f"model.v_head_dim={HV}", "model.rope_type=yarn", "model.rope_factor=4",
             f"model.original_max_position_embeddings={ORIGINAL}", "model.mscale=1.0", "model.mscale_all_dim=0.5"]


def test_mla_decoding_with_the_compressed_cache_equals_the_full_forward():
    """Prefill + one-token steps through the [B, S, kv_lora_rank] / [B, S, qk_rope_head_dim] cache
    (kv_b_proj absorbed into query and output) give the full forward's logits, at positions past
    the original YaRN context; one compiled program, also with NaN in the unwritten slots.
    (Sampling through the cache: generate, in test_transformer.py.)"""
    cfg = load_config(None, MLA_MODEL + ["model.num_dense_layers=2"])  # dense blocks: the attention is under test
    md = ModelDef(cfg, 259)
    params = md.init_params(seed=5)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 21)), jnp.int32)
    prefill = 18

    @jax.jit
    def run(params, fill):
        model = md.module(params)
        full = model(ids, drop_tokens=False).logits
        cache = jax.tree.map(lambda c: jnp.full_like(c, fill), transformer.init_cache(model, 2, 32))
        out = model(ids[:, :prefill], cache=cache, cache_index=0, drop_tokens=False)
        steps, cache = [out.logits], out.cache
        for i in range(prefill, ids.shape[1]):
            out = model(ids[:, i: i + 1], cache=cache, cache_index=jnp.int32(i), drop_tokens=False)
            steps.append(out.logits)
            cache = out.cache
        return full, jnp.concatenate(steps, axis=1), cache

    full, decoded, cache = run(params, jnp.float32(0))
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), rtol=1e-4, atol=1e-4)
    # a reused buffer holding NaN in the slots not yet written: bitwise the zero-filled cache's logits
    np.testing.assert_array_equal(run(params, jnp.float32(np.nan))[1], decoded)
    assert [sorted((k, v.shape) for k, v in layer.items()) for layer in cache] == \
        [[("k_rope", (2, 32, R)), ("kv", (2, 32, C))]] * 2


def test_cache_bytes_per_token_for_gqa_and_mla():
    """The stated formula equals the bytes init_cache allocates, per token and layer; DeepSeek-V3's
    shapes in bfloat16 cache 1,152 bytes per token and layer with MLA."""
    gqa = load_config(None, MLA_MODEL[:7] + ["model.num_kv_heads=2", "model.head_dim=16", "model.num_layers=3"])
    mla = load_config(None, MLA_MODEL + ["model.num_layers=3"])
    assert transformer.cache_bytes_per_token(gqa.model) == 2 * 2 * 16 * 4
    assert transformer.cache_bytes_per_token(mla.model, jnp.bfloat16) == (C + R) * 2
    for cfg in (gqa, mla):
        model = nnx.eval_shape(lambda cfg=cfg: transformer.Transformer(cfg, 64, rngs=nnx.Rngs(0)))
        cache = jax.eval_shape(lambda: transformer.init_cache(model, 2, 8))
        assert sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache)) == \
            transformer.cache_bytes_per_token(cfg.model) * 2 * 8 * 3
    v3 = load_config(None, ["model.attention=mla", "model.num_heads=128", "model.q_lora_rank=1536",
                            "model.dtype=bfloat16"]).model  # the defaults are DeepSeek-V3's MLA widths
    assert transformer.cache_bytes_per_token(v3) == 1152


def _packed_batch(b=4, t=32):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (b, t)).astype(np.int32)
    seg = np.ones((b, t), np.int32)
    seg[1] = np.where(np.arange(t) < 13, 1, 2)  # two packed documents
    seg[:, t - 4:] = 0  # padding
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    pos[1, 13:] -= 13
    return {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": seg, "positions": pos,
            "loss_weight": (seg != 0).astype(np.float32)}


def _loss_and_grads(*overrides):
    from moefast.train.step import loss_and_grads

    md = ModelDef(load_config(None, [*MLA_MODEL, "data.batch_size=4", "model.dropout=0.1", "model.num_dense_layers=1",
                                     *overrides]), 259)
    state = md.init_state(0)
    fn = jax.jit(lambda p, r, b, k: loss_and_grads(md, p, r, b, k, jnp.int32(1)))
    loss, terms, g = fn(state["params"], state["routing"], jax.tree.map(jnp.asarray, _packed_batch()), jax.random.key(7))
    return md, (loss, terms[:3]), g


def test_mla_with_remat_and_scan_layers_equals_unrolled():
    """Packed documents with padding, dropout keys inside the remat, a dense then an MoE block:
    scan_layers with remat=minimal gives the unrolled, remat-free losses and gradients to fp32
    rounding (the policies are bitwise the plain step: test_remat_scan.py)."""
    from moefast.model.layout import to_layout

    md, ref, g_ref = _loss_and_grads()
    _, out, g = _loss_and_grads("model.scan_layers=true", "model.remat=minimal")
    g = to_layout(g, md.cfg.model, False)
    assert jax.tree.structure(g) == jax.tree.structure(g_ref)
    for a, e in zip(jax.tree.leaves((out, g)), jax.tree.leaves((ref, g_ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-6)


def test_mla_flash_path_equals_blocked_path():
    """The fused kernel (Pallas interpreter here; values padded to the query/key width) and the
    blocked einsums, packed documents with padding: same outputs and parameter gradients."""
    hf, _ = _hf_deepseek("v3", 16, False)
    mla = _copy_into_mla(hf, 16, False)
    graphdef, params = nnx.split(mla)
    batch = _packed_batch(b=2, t=T)
    seg, pos = jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"])
    same_doc = (seg[:, :, None] == seg[:, None, :]) & _causal_mask()[0]
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, T, D)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(5).normal(size=(2, T, D)), jnp.float32)

    def loss(params, mask):
        rope = rope_cos_sin(pos, MAX_LEN, R, 10000.0, yarn=_yarn())
        out = nnx.merge(graphdef, params)(x, rope, mask, None, 0)[0]
        return jnp.sum(jnp.where(seg[..., None] > 0, out * w, 0.0)), out

    (_, flash), g_flash = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, seg)
    (_, blocked), g_blocked = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, same_doc[:, None])
    np.testing.assert_allclose(np.asarray(flash), np.asarray(blocked), rtol=1e-5, atol=1e-5)
    for a, e in zip(jax.tree.leaves(g_flash), jax.tree.leaves(g_blocked)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_sparse_mla_indexer_gets_no_gradient_and_keeping_every_key_is_dense_mla(monkeypatch):
    """DeepSeek-V3.2's sparse MLA (model.index_topk): the lightning indexer's parameters get exactly
    zero gradient (stop_gradient, as transformers' no_grad) while the attention's do not; with
    index_topk >= the row every visible key is kept and the logits are dense MLA's for the same
    weights. (Parity with transformers, packed rows and decoding: tests/interop/test_hf_deepseek_v32.py.)"""
    sparse = ["model.num_dense_layers=2", "model.index_n_heads=3", "model.index_head_dim=8"]
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 20)), jnp.int32)
    md = ModelDef(load_config(None, MLA_MODEL + sparse + ["model.index_topk=4"]), 259)
    params = md.init_params(seed=1)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(md.module(p)(ids, drop_tokens=False).logits ** 2)))(params)
    for block in grads["blocks"].values():
        assert all(not np.asarray(g).any() for g in jax.tree.leaves(block["attn"]["indexer"]))
        assert np.asarray(block["attn"]["q_b_proj"]).any()
    # the optimizer leaves the indexer as it is (no weight decay without a gradient), the rest moves
    tx = make_optimizer(md.cfg)
    state, new = tx.init(params), params
    for _ in range(2):  # the warm-up's first step has a learning rate of 0
        updates, state = tx.update(grads, state, new)
        new = optax.apply_updates(new, updates)
    for old_block, new_block in zip(params["blocks"].values(), new["blocks"].values()):
        for a, b in zip(jax.tree.leaves(old_block["attn"]["indexer"]), jax.tree.leaves(new_block["attn"]["indexer"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(old_block["attn"]["q_b_proj"] != new_block["attn"]["q_b_proj"]).any()
    full = ModelDef(load_config(None, MLA_MODEL + sparse + ["model.index_topk=20"]), 259)
    dense = ModelDef(load_config(None, MLA_MODEL + ["model.num_dense_layers=2"]), 259)

    def drop(tree):  # the parameters without the indexers'
        return {k: drop(v) for k, v in tree.items() if k != "indexer"} if isinstance(tree, dict) else tree

    with jax.default_matmul_precision("highest"):
        want, got, sparse_logits = jax.jit(lambda p: [d.module(q)(ids, drop_tokens=False).logits for d, q in
                                                      ((dense, drop(p)), (full, p), (md, p))])(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(sparse_logits) - np.asarray(want)).max() > 1e-3  # k = 4 < 20 keys: not dense
    # the indexer scoring 4 queries at a time (lax.map over blocks) selects what the whole row does
    from moefast.model import mla

    monkeypatch.setattr(mla, "INDEXER_QUERY_BLOCK", 4)
    with jax.default_matmul_precision("highest"):
        blocked = jax.jit(lambda p: md.module(p)(ids, drop_tokens=False).logits)(params)
    np.testing.assert_array_equal(np.asarray(blocked), np.asarray(sparse_logits))
    # the fused path (attention_impl=flash): MLA's absorbed form over the selected latents
    # (moefast.kernels.sparse_attention: its gather reference on CPU, the Pallas kernels on GPUs),
    # with its gradients, equals the masked reference
    fused = ModelDef(load_config(None, MLA_MODEL + sparse + ["model.index_topk=4", "model.attention_impl=flash"]), 259)
    seg = jnp.ones(ids.shape, jnp.int32).at[1, 12:].set(2)  # row 1: two documents

    def loss(d, p):
        out = d.module(p)(ids, segment_ids_bt=seg, drop_tokens=False)
        return jnp.sum(out.logits ** 2), out.max_logits

    with jax.default_matmul_precision("highest"):
        ((l1, m1), g1), ((l2, m2), g2) = jax.jit(lambda p: [jax.value_and_grad(loss, argnums=1, has_aux=True)(d, p)
                                                            for d in (md, fused)])(params)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    np.testing.assert_allclose(m2, m1, rtol=1e-5)  # each head's largest logit (QK-clip) over the selected keys
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * float(np.abs(e).max()) + 1e-12,
                                   err_msg=jax.tree_util.keystr(path))
