"""Hugging Face import/export of the hybrid families (Gated DeltaNet + gated attention) against
transformers itself: Qwen3-Next, Qwen3.5-MoE's text model and Qwen3.5-MoE as published (the
vision-language model, whose language model moefast reads).

Tiny random models are built offline (fp32; 4 layers: three Gated DeltaNet layers then one full
attention layer; 2 key heads serving 4 value heads, so the per-key-head grouping of Qwen3-Next's
projections shows; every norm weight, A_log and dt_bias re-randomised so defaults hide nothing),
saved with ``save_pretrained`` in both expert layouts, read with :func:`moefast.interop.hf.load_hf`
and run by moefast: logits within 1e-4 of transformers' on the real tokens of 2 x 40 tokens with a
right-padded row (moefast resets the DeltaNet state at segment boundaries and its padding is a
segment of its own; transformers zeroes padded hidden states: with right padding the real tokens
are unaffected), the same experts chosen for every real token in every MoE layer. Then ``save_hf``
-> ``AutoModelForCausalLM.from_pretrained`` gives transformers' weights bit for bit and its logits,
and ``load_hf(save_hf(x)) == x`` exactly.

The multi-token-prediction layer (``mtp_num_hidden_layers: 1``, ``mtp.*``), which transformers
ignores, is checked against vLLM's forward (``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``) assembled
in torch from transformers' own decoder layer and norms: its tensors are another tiny model's
full-attention layer, renamed ``mtp.layers.0.*``, and random ``mtp.fc`` and norms.

Until the Gated DeltaNet kernel package exists, run with a stub of it::

    PYTHONPATH=/tmp/stub python -m pytest -q -n 0 -p conftest_inject tests/interop/test_hf_hybrid.py
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

from moefast.interop import hf  # noqa: E402
from hf_oracle import (equal_trees, hf_forward, module, ours, padded_batch, rewrite, saved_layouts,  # noqa: E402
                       tensors)

V, B, T = 128, 2, 40
PAD_FROM = 27  # row 1 is padding from here on
TEXT = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, tie_word_embeddings=False,
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
# Qwen3.5's mrope over the rotated half of each head: text positions are equal on all three axes
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                "mrope_section": [4, 2, 2], "mrope_interleaved": True}
FAMILIES = {
    # a quarter of each head rotated (the default), a leading dense layer (mlp_only_layers) of its
    # own width, raw gates (norm_topk_prob false: transformers' default is true)
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**TEXT, intermediate_size=96, mlp_only_layers=[0],
                                                       norm_topk_prob=False),
    # half of each head rotated, mrope keys, every layer MoE, gates always renormalised
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**TEXT, rope_parameters=QWEN3_5_ROPE),
    # the same language model inside the vision-language model, with a one-block vision tower
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeConfig(
        text_config={**TEXT, "rope_parameters": QWEN3_5_ROPE},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)),
}
TEXT_PREFIX = {"qwen3_5_moe": "model.language_model."}  # where the language model's tensors are


def _hf_model(family: str, seed: int = 0, **changes):
    """The family's tiny transformers model, fp32, with every norm weight, A_log and dt_bias random
    (config attributes ``changes`` set first)."""
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    for k, v in changes.items():
        setattr(config, k, v)
    cls = (transformers.Qwen3_5MoeForConditionalGeneration if family == "qwen3_5_moe"
           else transformers.AutoModelForCausalLM)
    model = (cls(config) if family == "qwen3_5_moe" else cls.from_config(config)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm's plain scale (starts at 1)
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight") and ".visual." not in name:  # zero-centred: w, applied as 1 + w
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # routing margins well above float rounding
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _load_quietly(directory):
    """load_hf, with the vision-language checkpoint's one note collected rather than warned."""
    cfg = hf.config_from_hf(directory)
    notes = []
    return cfg, hf.load_hf_params(directory, cfg, log=notes.append), notes


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, HF model, its directory per expert layout)."""
    family = request.param
    model = _hf_model(family)
    return family, model, saved_layouts(model, family, tmp_path_factory)


def test_logits_and_chosen_experts_equal_transformers(saved, monkeypatch):
    family, model, dirs = saved
    tokens, mask = padded_batch(V, B, T, PAD_FROM)
    want, want_chosen = hf_forward(model, tokens, mask)
    cfg, params, notes = _load_quietly(dirs["per_expert"])
    m = cfg.model
    assert m.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim,
            m.linear_conv_kernel_dim) == (2, 4, 16, 16, 4)
    assert m.attention_output_gate and m.zero_centered_norm and m.qk_norm == "per_head"
    assert m.partial_rotary_factor == (0.25 if family == "qwen3_next" else 0.5)
    assert cfg.moe.norm_topk_prob == (family != "qwen3_next") and cfg.moe.shared_expert_gate
    if family == "qwen3_5_moe":  # the vision tower: one note, nothing else
        assert len(notes) == 1 and "the vision tower (model.visual.*)" in notes[0], notes
    else:
        assert notes == []
    routing_state = hf.load_hf_routing(dirs["per_expert"], cfg)
    got, got_chosen = ours(cfg, params, routing_state, tokens, mask, monkeypatch)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    assert len(got_chosen) == len(want_chosen) == moe_layers == (3 if family == "qwen3_next" else 4)
    for layer, (g, w) in enumerate(zip(got_chosen, want_chosen)):
        assert np.array_equal(g[real.reshape(-1)], w[real.reshape(-1)]), f"MoE layer {layer}: other experts chosen"
    _, fused, _ = _load_quietly(dirs["fused"])  # the fused on-disk layout: the very same parameters
    equal_trees(params, fused)


@pytest.mark.parametrize("saved", ["qwen3_next"], indirect=True)
def test_grouped_deltanet_projections_are_transformers_q_k_v_z_b_a(saved):
    """moefast's in_proj columns q | k | v | z | b | a (heads in order) are, exactly, what
    transformers' fix_query_key_value_ordering makes of in_proj_qkvz / in_proj_ba (per key head);
    reading into the scanned layout gives the unrolled read stacked."""
    _, model, dirs = saved
    cfg, params, _ = _load_quietly(dirs["per_expert"])
    layer = model.model.layers[0].linear_attn
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
    want = np.concatenate([t.reshape(1, 3, -1).numpy() for t in (q, k, v, z, b, a)], axis=-1)
    w = np.asarray(params["blocks"][0]["attn"]["in_proj"])
    np.testing.assert_allclose(x.numpy() @ w, want, atol=1e-6, rtol=0)
    assert w.shape == (64, 2 * 2 * 16 + 4 * 16 + 4 * 16 + 2 * 4)
    from moefast.model.layout import to_layout  # the scanned layout (dense prefix, then the period) reads the same

    _, scanned = hf.load_hf(dirs["per_expert"], ["model.scan_layers=true"])
    equal_trees(to_layout(params, cfg.model, scanned=True), scanned)


def test_export_reloads_in_transformers_and_round_trips_exactly(saved, tmp_path):
    """Both expert layouts: transformers loads the export (Qwen3.5-MoE's as its text model) with
    every weight bit-equal to the original's language model and the same logits; load_hf of the
    export is the imported model exactly. The first family that fits, Qwen3-Next, represents every
    one of them: a Qwen3.5 model exported as qwen3_next computes the same logits in transformers.
    The export's log line says which model_type it wrote, and why when not the family asked for."""
    family, model, dirs = saved
    cfg, params, _ = _load_quietly(dirs["per_expert"])
    routing_state = hf.load_hf_routing(dirs["per_expert"], cfg)
    assert hf.hf_family(cfg) == "qwen3_next"
    text_family = "qwen3_5_moe_text" if family == "qwen3_5_moe" else family
    assert hf.hf_family(cfg, family) == text_family
    prefix = TEXT_PREFIX.get(family, "model.")
    want_sd = {("model." + n[len(prefix):] if n.startswith(prefix) else n): w for n, w in model.state_dict().items()
               if not n.startswith("model.visual.")}
    tokens, mask = padded_batch(V, B, T, PAD_FROM)
    want, _ = hf_forward(model, tokens, mask)
    real = mask.astype(bool)
    for layout in ("per_expert", "fused"):
        lines = []
        out = hf.save_hf(cfg, params, tmp_path / layout, routing_state=routing_state, layout=layout, family=family,
                         log=lines.append)
        written = json.loads((out / "config.json").read_text())
        assert (written["model_type"], written["architectures"]) == (text_family, [hf.FAMILIES[text_family]])
        assert len(lines) == 1 and lines[0].startswith(f"wrote {text_family} ({layout} experts, float32)")
        assert ("not qwen3_5_moe: moefast holds the language model of Qwen3.5-MoE (vision-language) only, written "
                "as its text model (Qwen3_5MoeForCausalLM" in lines[0]) == (family == "qwen3_5_moe"), lines
        assert ", not " not in lines[0] or family == "qwen3_5_moe", lines
        assert written["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                            output_loading_info=True)
        assert type(reloaded).__name__ == hf.FAMILIES[text_family]
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        got_sd = reloaded.state_dict()
        assert sorted(got_sd) == sorted(want_sd)
        for name, w in want_sd.items():
            assert torch.equal(got_sd[name], w), name
        for key in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim", "num_key_value_heads",
                    "shared_expert_intermediate_size", "moe_intermediate_size", "num_experts"):
            assert getattr(reloaded.config, key) == getattr(model.config.get_text_config(), key), key
        assert reloaded.config.rope_parameters["partial_rotary_factor"] == cfg.model.partial_rotary_factor
        if layout == "per_expert":
            got, _ = hf_forward(reloaded.eval(), tokens, mask)
            np.testing.assert_allclose(got[real], want[real], atol=1e-6, rtol=0)
        cfg2, params2, notes = _load_quietly(out)
        assert notes == [] and cfg2.model == cfg.model and cfg2.moe == cfg.moe
        equal_trees(params, params2)
    if family == "qwen3_5_moe_text":  # the same model written as the other family
        out = hf.save_hf(cfg, params, tmp_path / "as-next", routing_state=routing_state)
        next_ = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(next_).__name__ == "Qwen3NextForCausalLM"
        got, _ = hf_forward(next_, tokens, mask)
        np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)
        equal_trees(params, _load_quietly(out)[1])
        assert tensors(out).keys() & {"model.layers.0.linear_attn.in_proj_qkvz.weight"}


def test_bad_checkpoints_are_one_clear_error(saved, tmp_path):
    """A layer lacking one of its Gated DeltaNet tensors, layer_types of the wrong length or with an
    unknown kind, attention biases (which the output gate would need too): one error naming the
    tensor or the key. Without layer_types the layers are transformers' default (every 4th full
    attention)."""
    family, _, dirs = saved
    src = dirs["per_expert"]
    prefix = TEXT_PREFIX.get(family, "model.")
    missing = prefix + ("layers.1.linear_attn.in_proj_ba.weight" if family == "qwen3_next"
                        else "layers.1.linear_attn.in_proj_a.weight")
    with pytest.raises(hf.HFFormatError, match=rf"1 tensor that config.json implies is missing: \['{missing}'\]"):
        hf.load_hf(rewrite(src, tmp_path / "no-a", drop=[missing]))
    layer = [n for n in tensors(src) if n.startswith(prefix + "layers.1.linear_attn.")]
    with pytest.raises(hf.HFFormatError, match=rf"{len(layer)} tensors that config.json implies are missing, "
                                               rf"e.g. \['{prefix}layers.1.linear_attn.[^']*', '"):
        hf.load_hf(rewrite(src, tmp_path / "no-layer", drop=layer))
    conv = prefix + "layers.2.linear_attn.conv1d.weight"
    with pytest.raises(hf.HFFormatError, match=rf"\['{conv}'\]"):
        hf.load_hf(rewrite(src, tmp_path / "no-conv", drop=[conv]))
    with pytest.raises(hf.HFFormatError, match=r"layer_types=\[.*\] .* 3 entries for num_hidden_layers=4: one per layer"):
        hf.config_from_hf(rewrite(src, tmp_path / "short", layer_types=["linear_attention"] * 2 + ["full_attention"]))
    with pytest.raises(hf.HFFormatError, match=r"4 entries for num_hidden_layers=4, with 'mamba': one per layer, each "
                                               r"'full_attention' or 'linear_attention'"):
        hf.config_from_hf(rewrite(src, tmp_path / "kind", layer_types=["mamba"] + ["linear_attention"] * 3))
    m = hf.config_from_hf(rewrite(src, tmp_path / "default", layer_types=None)).model
    assert m.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # transformers' default interval 4
    with pytest.raises(hf.HFFormatError, match="attention_bias"):
        hf.config_from_hf(rewrite(src, tmp_path / "bias", attention_bias=True))
    if family == "qwen3_5_moe":
        with pytest.raises(hf.HFFormatError, match="keeps its language model's config in 'text_config'"):
            hf.config_from_hf(rewrite(src, tmp_path / "no-text", top=True, text_config=None))


@pytest.mark.parametrize("saved", ["qwen3_5_moe_text"], indirect=True)
def test_other_families_do_not_claim_hybrid_models(saved):
    """A hybrid model is not written as a family without Gated DeltaNet, gates or zero-centred norms;
    a plain model is not written as a hybrid family."""
    _, _, dirs = saved
    cfg = hf.config_from_hf(dirs["per_expert"])
    with pytest.raises(hf.HFFormatError, match=r"qwen3_moe cannot represent this model: it has .*model.layer_types "
                                               r"with linear_attention layers.*attention_output_gate=true.*"
                                               r"zero_centered_norm=true"):
        hf.hf_family(cfg, "qwen3_moe")
    plain = cfg.replace(model=cfg.model.__class__(**{**cfg.model.__dict__, "layer_types": None,
                                                     "attention_output_gate": False, "zero_centered_norm": False}))
    with pytest.raises(hf.HFFormatError, match=r"qwen3_next cannot represent this model: it has "
                                               r"model.attention_output_gate=false .*model.zero_centered_norm=false"):
        hf.hf_family(plain, "qwen3_next")


# ------------------------------------------------------------------------- multi-token prediction
MTP_OWN = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight", "mtp.norm.weight")
DONOR_LAYER = 3  # the donor's full-attention (MoE) layer, whose tensors become mtp.layers.0.*


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def with_mtp(request, tmp_path_factory):
    """(family, HF model, donor, directory, {name: tensor} of its mtp.*): the family's tiny model
    (Qwen3-Next's with every layer MoE: vLLM builds the MTP layer as layer 0, so its MLP is layer 0's
    kind) saved per expert, with mtp_num_hidden_layers 1 and, in a file of their own, the layer
    DONOR_LAYER tensors of another seed's text model (the donor) as mtp.layers.0.* (transformers'
    own per-expert names) and random zero-centred norms and fc [D, 2D]."""
    from safetensors.numpy import save_file

    family = request.param
    changes = {"mlp_only_layers": []} if family == "qwen3_next" else {}
    model = _hf_model(family, **changes)
    donor = _hf_model("qwen3_5_moe_text" if family == "qwen3_5_moe" else family, seed=1, **changes)
    assert donor.config.layer_types[DONOR_LAYER] == "full_attention"
    main_dir, donor_dir = tmp_path_factory.mktemp(f"{family}-mtp"), tmp_path_factory.mktemp(f"{family}-donor")
    model.save_pretrained(main_dir, save_original_format=True)
    donor.save_pretrained(donor_dir, save_original_format=True)
    config = json.loads((main_dir / "config.json").read_text())
    config.get("text_config", config).update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (main_dir / "config.json").write_text(json.dumps(config))
    layer = f"model.layers.{DONOR_LAYER}."
    mtp = {"mtp.layers.0." + k[len(layer):]: x for k, x in tensors(donor_dir).items() if k.startswith(layer)}
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in mtp  # the hub's per-expert layout
    rng, d = np.random.default_rng(5), TEXT["hidden_size"]
    for name in MTP_OWN:
        shape = (d, 2 * d) if name == "mtp.fc.weight" else (d,)
        mtp[name] = ((0.1 if name == "mtp.fc.weight" else 0.2) * rng.standard_normal(shape)).astype(np.float32)
    save_file(mtp, str(main_dir / "mtp.safetensors"), metadata={"format": "pt"})
    return family, model, donor, main_dir, mtp


def test_mtp_layer_is_read_and_written_back_exactly(with_mtp, tmp_path):
    """mtp_num_hidden_layers 1 reads into model.mtp_depth 1: fc (transposed), the pre-fc norms and
    the final norm are the module's eh_proj, enorm, hnorm and head_norm, its block a gated
    full-attention block; the export (both expert layouts; Qwen3.5's as its text model) writes the
    same mtp.* tensors bit for bit and mtp_num_hidden_layers 1, transformers loads it (ignoring
    mtp.*), and it reads back exactly (also into the scanned layout). model.mtp_depth=0 reads the
    same main model and says what it skips."""
    family, _, _, src, mtp = with_mtp
    cfg, params, notes = _load_quietly(src)
    assert cfg.model.mtp_depth == 1
    assert len(notes) == (1 if family == "qwen3_5_moe" else 0), notes  # the vision tower only
    got = params["mtp"][0]
    for path, name in ((("enorm", "scale"), "mtp.pre_fc_norm_embedding.weight"),
                       (("hnorm", "scale"), "mtp.pre_fc_norm_hidden.weight"),
                       (("head_norm", "scale"), "mtp.norm.weight"),
                       (("block", "attn_norm", "scale"), "mtp.layers.0.input_layernorm.weight")):
        leaf = got
        for key in path:
            leaf = leaf[key]
        np.testing.assert_array_equal(np.asarray(leaf), mtp[name])
    np.testing.assert_array_equal(np.asarray(got["eh_proj"]), mtp["mtp.fc.weight"].T)
    assert {"qkv", "gate", "q_norm", "k_norm"} <= set(got["block"]["attn"]) and "in_proj" not in got["block"]["attn"]
    scanned = hf.load_hf_params(src, hf.config_from_hf(src, ["model.scan_layers=true"]), log=notes.append)
    equal_trees(params["mtp"], scanned["mtp"])  # MTP modules stay unrolled in both layouts
    routing_state = hf.load_hf_routing(src, cfg)
    for layout in ("per_expert", "fused"):
        out = hf.save_hf(cfg, params, tmp_path / layout, routing_state=routing_state, layout=layout, family=family)
        written = json.loads((out / "config.json").read_text())
        assert written["mtp_num_hidden_layers"] == 1 and written["mtp_use_dedicated_embeddings"] is False
        cfg2, params2, notes = _load_quietly(out)
        assert notes == [] and cfg2.model == cfg.model
        equal_trees(params, params2)
        if layout == "per_expert":
            written_mtp = {k: x for k, x in tensors(out).items() if k.startswith("mtp.")}
            assert sorted(written_mtp) == sorted(mtp)
            for name, x in mtp.items():
                np.testing.assert_array_equal(written_mtp[name], x, err_msg=name)
            _, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                        output_loading_info=True)
            assert not any(info[k] for k in ("missing_keys", "mismatched_keys")), info
    cfg0 = hf.config_from_hf(src, ["model.mtp_depth=0"])
    notes = []
    params0 = hf.load_hf_params(src, cfg0, log=notes.append)
    assert any(f"{len(mtp)} tensors of the checkpoint's multi-token-prediction layers" in n for n in notes), notes
    equal_trees({k: v for k, v in params.items() if k != "mtp"}, params0)


def test_mtp_logits_equal_vllm_forward_over_transformers_decoder_layer(with_mtp):
    """moefast's MTP logits (module 1 through the shared head) equal, to 1e-4, vLLM's MTP forward
    (qwen3_next_mtp.py / qwen3_5_mtp.py: Qwen3NextMultiTokenPredictor.forward, compute_logits)
    assembled in torch: h_i = transformers' main model output after its final norm (vLLM's target
    hidden states), x = fc([pre_fc_norm_embedding(Emb(t_{i+1})); pre_fc_norm_hidden(h_i)]), the
    donor's own transformers decoder layer (full attention, MoE; the checkpoint's mtp.layers.0.*)
    at the positions of the main tokens, causal, then mtp.norm and the main lm_head; transformers'
    RMSNorm class (zero-centred) for the norms."""
    import jax.numpy as jnp

    family, model, donor, src, mtp = with_mtp
    cfg, params, _ = _load_quietly(src)
    tokens = np.random.default_rng(1).integers(0, V, (B, T))
    with jax.default_matmul_precision("highest"):
        y = module(cfg, params)(jnp.asarray(tokens), drop_tokens=False, routing_state=hf.load_hf_routing(src, cfg))
    got = np.asarray(y.mtp_logits[0])[:, :-1]  # row i predicts t_{i+2} from h_i and t_{i+1}: the last row has none
    lm = model.model.language_model if family == "qwen3_5_moe" else model.model
    eps = model.config.get_text_config().rms_norm_eps

    def norm(name):
        n = type(lm.norm)(TEXT["hidden_size"], eps=eps)
        n.weight.data = torch.tensor(mtp[name])
        return n

    n = T - 1
    with torch.no_grad():
        ids = torch.tensor(tokens)
        h = lm(input_ids=ids).last_hidden_state[:, :n]
        e = lm.embed_tokens(ids[:, 1:])
        x = torch.cat([norm("mtp.pre_fc_norm_embedding.weight")(e), norm("mtp.pre_fc_norm_hidden.weight")(h)], dim=-1)
        x = x @ torch.tensor(mtp["mtp.fc.weight"]).T
        pos = torch.arange(n)[None].expand(B, n)
        rope = lm.rotary_emb(x, pos if family == "qwen3_next" else pos[None].expand(3, B, n))  # Qwen3.5: mrope axes
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None].expand(B, 1, n, n)
        layer = donor.model.layers[DONOR_LAYER]
        x = layer(x, position_embeddings=rope, attention_mask=causal, position_ids=pos)
        want = model.lm_head(norm("mtp.norm.weight")(x)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(want).max() > 0.1  # logits of some size: the comparison can fail


def test_mtp_layers_moefast_cannot_hold_exactly_are_one_clear_error(with_mtp, tmp_path):
    """mtp_num_hidden_layers 2 (the layers share fc and norms, which moefast's modules keep each
    their own) is one error naming the key at import, the depth that reads exactly
    (model.mtp_depth=1, which then notes the second layer's tensors as not read) and at export
    nothing written; so are mtp_use_dedicated_embeddings and, for Qwen3-Next, a dense layer 0
    (its MTP layer's MLP would be dense). mtp.* tensors without the key are skipped with a note."""
    from safetensors.numpy import save_file

    family, _, _, src, mtp = with_mtp
    two = rewrite(src, tmp_path / "two", mtp_num_hidden_layers=2)
    second = {"mtp.layers.1." + k[len("mtp.layers.0."):]: x for k, x in mtp.items() if k.startswith("mtp.layers.0.")}
    save_file(second, str(two / "mtp-1.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hf.HFFormatError, match=r"mtp_num_hidden_layers=2 .*share one fc, its norms and the final "
                                               r"norm.*at most 1\); import with model.mtp_depth=1 \(reads the first 1"):
        hf.config_from_hf(two)
    cfg = hf.config_from_hf(two, ["model.mtp_depth=1"])
    notes = []
    params = hf.load_hf_params(two, cfg, log=notes.append)
    assert any(f"{len(second)} tensors of the checkpoint's multi-token-prediction layers" in n for n in notes), notes
    deep = cfg.replace(model=cfg.model.__class__(**{**cfg.model.__dict__, "mtp_depth": 2}))
    with pytest.raises(hf.HFFormatError, match=r"mtp_num_hidden_layers=2 .*import with model.mtp_depth=1"):
        hf.load_hf_params(two, deep)
    with pytest.raises(hf.HFFormatError, match=r"cannot represent this model: it has model.mtp_depth=2 .*at most 1"):
        hf.save_hf(deep, params, tmp_path / "out", family=family)
    assert not (tmp_path / "out").exists()
    with pytest.raises(hf.HFFormatError, match=r"mtp_use_dedicated_embeddings=True .*model.mtp_depth=0 \(the next"):
        hf.config_from_hf(rewrite(src, tmp_path / "own-embed", mtp_use_dedicated_embeddings=True))
    if family == "qwen3_next":
        with pytest.raises(hf.HFFormatError, match=r"mtp_num_hidden_layers=1 .*model.mtp_depth=1 with layer 0 dense"):
            hf.config_from_hf(rewrite(src, tmp_path / "dense-0", mlp_only_layers=[0]))
    cfg0 = hf.config_from_hf(rewrite(src, tmp_path / "no-key", mtp_num_hidden_layers=None))
    assert cfg0.model.mtp_depth == 0
    notes = []
    hf.load_hf_params(tmp_path / "no-key", cfg0, log=notes.append)
    assert f"multi-token-prediction tensors (mtp.*) beyond config.json's mtp_num_hidden_layers: {len(mtp)}" in notes[-1]
