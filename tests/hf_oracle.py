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
