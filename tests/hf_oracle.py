"""Shared by the Hugging Face parity tests (tests/interop/): transformers' logits and chosen experts,
and moefast's for the same parameters, recording every routing call."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moefast import routing
from moefast.model import build_model


def is_router(module) -> bool:
    return type(module).__name__.lower().endswith("router")


def hf_forward(model, tokens, mask):
    """transformers' logits [B, T, V] and, per MoE layer, the chosen experts [B*T, K] (sorted): the
    indices each router module (every family's ``...Router.forward``) returns last."""
    import torch

    chosen = []
    hooks = [m.register_forward_hook(lambda m, args, out: chosen.append(np.sort(out[-1].numpy(), axis=-1)))
             for m in model.modules() if is_router(m)]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
    finally:
        for h in hooks:
            h.remove()
    assert len(chosen) == sum(1 for m in model.modules() if is_router(m))
    return out.logits.numpy(), chosen


def module(cfg, params):
    """The moefast model of ``cfg`` holding ``params`` (a pure dict)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, cfg.model.vocab_size)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def ours(cfg, params, routing_state, tokens, mask, monkeypatch, *, unbiased=False):
    """moefast's logits and the experts each routing call chose (sorted), eagerly, the padding its
    own segment; with ``unbiased`` also the experts each call chooses again without the selection
    bias. Returns ``(logits, chosen)`` or ``(logits, chosen, unbiased)``."""
    calls, without_bias = [], []
    real_route = routing.route

    def recording(*a, **kw):
        r = real_route(*a, **kw)
        calls.append(np.sort(np.asarray(r.expert_index), axis=-1))
        if unbiased:
            without_bias.append(np.sort(np.asarray(real_route(*a, **{**kw, "bias": None}).expert_index), axis=-1))
        return r

    monkeypatch.setattr(routing, "route", recording)
    with jax.default_matmul_precision("highest"):
        out = module(cfg, params)(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(mask, jnp.int32),
                                  drop_tokens=False, routing_state=routing_state)
    monkeypatch.setattr(routing, "route", real_route)
    return (np.asarray(out.logits), calls, without_bias) if unbiased else (np.asarray(out.logits), calls)


def saved_layouts(model, family, tmp_path_factory):
    """``model`` saved in both on-disk expert layouts: ``{"per_expert": dir, "fused": dir}``."""
    dirs = {}
    for layout, original in (("per_expert", True), ("fused", False)):
        d = tmp_path_factory.mktemp(f"{family}-{layout}")
        model.save_pretrained(d, save_original_format=original)
        dirs[layout] = d
    return dirs


def saved_and_loaded(model, family, tmp_path_factory):
    """``(model, dirs, cfg, params, routing_state)``: ``model`` saved in both layouts
    (:func:`saved_layouts`) and moefast's config, parameters and routing state read from the
    per-expert one."""
    from moefast.interop import hf

    dirs = saved_layouts(model, family, tmp_path_factory)
    cfg, params = hf.load_hf(dirs["per_expert"])
    return model, dirs, cfg, params, hf.load_hf_routing(dirs["per_expert"], cfg)


def edited_copy(src, dst, change: dict):
    """``dst``: the model directory ``src`` with ``change`` merged into its config.json."""
    import json

    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    return dst


def reload_bit_for_bit(model, out, architecture: str):
    """transformers' model loaded from moefast's export ``out``: of ``architecture``, no missing,
    unexpected or mismatched tensor, and every tensor equal to ``model``'s bit for bit."""
    import torch
    import transformers

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert type(reloaded).__name__ == architecture
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want_sd, got_sd = model.state_dict(), reloaded.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name, w in want_sd.items():
        assert torch.equal(got_sd[name], w), name
    return reloaded


def tensors(directory) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``directory``, by name, as NumPy arrays."""
    from safetensors import safe_open

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def rewrite(src, dst, drop=(), top=False, **config_changes):
    """A copy of HF directory ``src`` at ``dst`` without tensors ``drop`` and with config.json's
    keys changed (for a vision-language config, its text_config's unless ``top``); a key changed
    to None is removed."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    keys = cfg if top else cfg.get("text_config", cfg)
    keys.update(config_changes)
    for k, v in config_changes.items():
        if v is None:
            keys.pop(k)
    (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        from safetensors.numpy import save_file

        kept = tensors(dst)
        assert all(n in kept for n in drop)
        save_file({k: v for k, v in kept.items() if k not in drop}, str(dst / "model.safetensors"),
                  metadata={"format": "pt"})
    return dst


def padded_batch(vocab: int, batch: int, tokens: int, pad_from: int):
    """Random token ids [batch, tokens] (seed 0) and an attention mask with row 1 padded from
    ``pad_from`` on."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, tokens))
    mask = np.ones((batch, tokens), np.int64)
    mask[1, pad_from:] = 0
    return ids, mask


def equal_trees(a, b):
    """Two pytrees of one structure, every leaf equal bit for bit."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# ------------------------------------------------- DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa)
def random_dsa_model(config_class, config: dict, seed: int = 0):
    """transformers' DSA model of ``config_class(**config)``, fp32, eager, with random weights whose
    routing margins and index scores are well spread (no near-ties at the k-th key or expert): norm
    weights 1 + 0.2 N, the indexer's key-norm bias and projections 0.2 N, router weights 0.1 N,
    selection biases 0.05 N."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**config), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("k_norm.bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("indexer.wq_b.weight", "indexer.wk.weight", "indexer.weights_proj.weight")):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


def hf_selected_keys(model, run):
    """``(run(), selected)``: transformers' selected keys per indexer call (every module whose class
    name ends in ``Indexer``), bool [B, T, S] each, while ``run()`` runs."""
    chosen = []

    def hook(m, args, out):
        b, t, s = out.shape[0], out.shape[1], args[3].shape[-1]
        sel = np.zeros((b, t, s), bool)
        np.put_along_axis(sel, out.long().numpy(), True, axis=-1)
        chosen.append(sel)

    hooks = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("Indexer")]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    return result, chosen


def our_selected_keys(monkeypatch):
    """A list that fills with moefast's selected keys per indexer call, bool [B, T, S]."""
    from moefast.model import mla

    calls = []
    real = mla.LightningIndexer.select

    def recording(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(np.asarray(out))
        return out

    monkeypatch.setattr(mla.LightningIndexer, "select", recording)
    return calls


def compare_selected_keys(got, want, visible_bts, real_bt, topk: int, layers: int):
    """Per indexer call (``layers`` of them): the same keys among those each real query may see,
    min(topk, visible) of them, and some query keeps fewer keys than it sees."""
    assert len(got) == len(want) == layers
    for layer, (g, w) in enumerate(zip(got, want)):
        w = w & visible_bts
        assert g.shape == w.shape and not (g & ~visible_bts)[real_bt].any()
        assert np.array_equal(g[real_bt], w[real_bt]), f"layer {layer}: other keys selected"
        assert (g.sum(-1)[real_bt] == np.minimum(topk, visible_bts.sum(-1)[real_bt])).all()
        assert (g.sum(-1) < visible_bts.sum(-1))[real_bt].any()


def packed_rows(vocab: int, batch: int, tokens: int, doc_a: int):
    """``(ids, segment ids, positions)`` [batch, tokens]: random ids (seed 1), row 1 two packed
    documents of ``doc_a`` and ``tokens - doc_a`` tokens, positions restarting with the second."""
    ids = np.random.default_rng(1).integers(0, vocab, (batch, tokens))
    seg = np.ones((batch, tokens), np.int64)
    seg[1, doc_a:] = 2
    positions = np.stack([np.arange(tokens)] * (batch - 1) + [np.r_[np.arange(doc_a), np.arange(tokens - doc_a)]])
    return ids, seg, positions


def hf_packed_logits(model, ids, positions):
    """transformers' logits [B, T, V] for packed rows: restarting ``position_ids``, no mask, no cache."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), position_ids=torch.tensor(positions), use_cache=False).logits.numpy()


def dsa_padded_parity(saved, monkeypatch, *, vocab: int, batch: int, tokens: int, pad_from: int, topk: int):
    """A DSA model (``saved``: :func:`saved_and_loaded`'s tuple) on random rows, row 1 padded from
    ``pad_from``: moefast's logits within 1e-4 of transformers' on the real tokens, the same experts
    per MoE layer and the same selected keys per indexer call (:func:`compare_selected_keys`); the
    fused layout's directory (transformers' in-memory names) reads to the very same model."""
    from moefast.interop import hf

    model, dirs, cfg, params, routing_state = saved
    fused_cfg, fused = hf.load_hf(dirs["fused"])
    assert fused_cfg.model == cfg.model and fused_cfg.moe == cfg.moe
    equal_trees(params, fused)
    ids, mask = padded_batch(vocab, batch, tokens, pad_from)
    (want, want_chosen), want_sel = hf_selected_keys(model, lambda: hf_forward(model, ids, mask))
    got_sel = our_selected_keys(monkeypatch)
    got, got_chosen = ours(cfg, params, routing_state, ids, mask, monkeypatch)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    assert len(got_chosen) == len(want_chosen) == sum(map(cfg.model.is_moe_layer, range(cfg.model.num_layers)))
    for layer, (g, w) in enumerate(zip(got_chosen, want_chosen)):
        assert np.array_equal(g[real.reshape(-1)], w[real.reshape(-1)]), f"MoE layer {layer}: other experts chosen"
    visible = np.tril(np.ones((tokens, tokens), bool))[None] & real[:, None, :]
    compare_selected_keys(got_sel, want_sel, visible, real, topk, cfg.model.num_layers)


def dsa_packed_parity(saved, monkeypatch, *, vocab: int, batch: int, tokens: int, doc_a: int, topk: int):
    """A DSA model on rows whose last packs two documents (:func:`packed_rows`; transformers:
    restarting position_ids, no mask, no cache): the same logits (1e-4) and selected keys, each
    document's queries selecting only inside it. Returns ``(moefast's logits, ids, segment ids)``."""
    model, _, cfg, params, routing_state = saved
    ids, seg, positions = packed_rows(vocab, batch, tokens, doc_a)
    want, want_sel = hf_selected_keys(model, lambda: hf_packed_logits(model, ids, positions))
    got_sel = our_selected_keys(monkeypatch)
    got, _ = ours(cfg, params, routing_state, ids, seg, monkeypatch)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    visible = np.tril(np.ones((tokens, tokens), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    compare_selected_keys(got_sel, want_sel, visible, np.ones((batch, tokens), bool), topk, cfg.model.num_layers)
    return got, ids, seg


def prefill_then_decode(cfg, params, routing_state, ids, prefill: int, cache_len: int):
    """``(full-pass logits, the logits of a prefill of ``prefill`` tokens then one token at a
    time through the generation cache, the final cache)`` for token ids [B, T], float32 at the
    highest matmul precision."""
    from moefast.model import transformer

    @jax.jit
    def run(params):
        model = module(cfg, params)
        full = model(ids, drop_tokens=False, routing_state=routing_state).logits
        out = model(ids[:, :prefill], cache=transformer.init_cache(model, ids.shape[0], cache_len), cache_index=0,
                    drop_tokens=False, routing_state=routing_state)
        steps, cache = [out.logits], out.cache
        for i in range(prefill, ids.shape[1]):
            out = model(ids[:, i:i + 1], cache=cache, cache_index=jnp.int32(i), drop_tokens=False,
                        routing_state=routing_state)
            steps.append(out.logits)
            cache = out.cache
        return full, jnp.concatenate(steps, axis=1), cache

    with jax.default_matmul_precision("highest"):
        return run(params)
