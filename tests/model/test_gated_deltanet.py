"""Hybrid models (model.layer_types): Gated DeltaNet (or KDA) layers beside gated full attention. Packed
documents stay isolated (the conv and recurrent states reset at each document start), decoding
through the carried states equals the full forward pass, the scanned layout (period of 4) equals
the unrolled one, and bad layer types are one clear error. (The recurrence itself against its
reference: tests/kernels/test_gated_delta_rule.py; against transformers: tests/interop.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast.config import ConfigError, load_config
from moefast.model import build_model, init_cache
from moefast.model.gated_deltanet import causal_conv
from moefast.model.layout import layer_layout

HYBRID = ["model.d_model=32", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
          "model.layer_types=[linear_attention,linear_attention,linear_attention,full_attention]",
          "model.attention_output_gate=true", "model.qk_norm=per_head", "model.partial_rotary_factor=0.25",
          "model.zero_centered_norm=true", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4",
          "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "model.d_ff=48", "model.max_seq_len=64",
          "model.linear_attention_impl=chunked", "moe.num_experts=4", "moe.top_k=2", "moe.capacity_factor=8",
          "moe.shared_expert_d_ff=32", "moe.shared_expert_gate=true", "data.seq_len=32"]


def _randomise(model, seed):
    """Every parameter random (zero-centred norms start at 0, gates and norms at 1: defaults hide
    nothing), decays of a useful size."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [a + 0.3 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


# Kimi Delta Attention in the same places (a decay per key channel; as many key as value heads)
KDA = ["model.linear_attention_kind=kda", "model.linear_num_key_heads=4"]


@pytest.fixture(scope="module", params=["gated_deltanet", "kda"])
def hybrid(request):
    return _randomise(build_model(load_config(None, HYBRID + (KDA if request.param == "kda" else [])), 259, seed=3), 1)


def _is_kda(model):
    return type(model.blocks[0].attn).__name__ == "KimiDeltaAttention"


forward = nnx.jit(lambda m, tokens, segment_ids=None: m(tokens, None, segment_ids, drop_tokens=False).logits)


def test_packed_documents_do_not_interact(hybrid):
    """Two documents packed in one row give each the logits it gives alone: no recurrent or conv
    state, no attention, crosses the boundary (which falls inside a 16-token chunk)."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 11), rng.integers(0, 256, 13)
    row = jnp.asarray(np.concatenate([a, b])[None])
    seg = jnp.asarray([[1] * 11 + [2] * 13])
    packed = forward(hybrid, row, seg)
    alone_a = forward(hybrid, jnp.asarray(a[None]))
    alone_b = forward(hybrid, jnp.asarray(b[None]))
    # KDA: a decay per channel, summed in other chunk positions when packed (float32 rounding: 3e-5 seen)
    tol = 1e-4 if _is_kda(hybrid) else 2e-5
    np.testing.assert_allclose(packed[0, :11], alone_a[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(packed[0, 11:], alone_b[0], rtol=tol, atol=tol)
    joined = forward(hybrid, row)  # one document: b sees a, so its logits change
    assert not np.allclose(joined[0, 11:], alone_b[0], atol=1e-3)


def test_decoding_through_the_states_equals_the_full_forward(hybrid):
    """Prefill 9 tokens, then decode 6 one at a time: the Gated DeltaNet layers carry their conv
    and recurrent states, the attention layer its KV cache; every step's logits equal the full pass."""
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 15)), jnp.int32)
    graphdef, state = nnx.split(hybrid)

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        full = m(ids, drop_tokens=False).logits
        out = m(ids[:, :9], cache=init_cache(m, 2, 16), cache_index=0, drop_tokens=False)
        steps, cache = [out.logits], out.cache
        for i in range(9, 15):
            out = m(ids[:, i: i + 1], cache=cache, cache_index=jnp.int32(i), drop_tokens=False)
            steps.append(out.logits)
            cache = out.cache
        return full, jnp.concatenate(steps, axis=1), cache

    full, decoded, cache = run(state)
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-4)
    assert [sorted(c) for c in cache] == [["conv", "state"]] * 3 + [["k", "v"]]
    hk = 4 if _is_kda(hybrid) else 2  # KDA: as many key heads as value heads
    assert cache[0]["state"].shape == (2, 4, 8, 8) and cache[0]["conv"].shape == (2, 3, 2 * hk * 8 + 4 * 8)


def test_generate_carries_the_states_and_matches_the_full_forward():
    """``moefast generate``'s sampling loop (prefill, then one token at a time) on the hybrid model:
    every step's logits equal the full forward pass over the prompt and the tokens so far."""
    from moefast.data import ByteTokenizer
    from moefast.train import ModelDef, generate

    md = ModelDef(load_config(None, HYBRID), 259)
    params = md.init_params(seed=5)
    tok = ByteTokenizer()
    text, logits = generate(md, params, tok, "def f(x):", max_new_tokens=6, temperature=0.0, return_logits=True)
    ids = np.concatenate([[tok.bos_id], tok.encode("def f(x):"), tok.encode(text)])[None]
    full = jax.jit(lambda p, ids: md.module(p)(ids, drop_tokens=False).logits)(params, jnp.asarray(ids))[0]
    n = ids.shape[1] - len(tok.encode(text))
    assert len(logits) >= 2
    for i in range(len(logits)):
        np.testing.assert_allclose(logits[i], np.asarray(full[n - 1 + i]), rtol=1e-4, atol=1e-4)


def test_scanned_layout_scans_the_period_and_equals_unrolled():
    """With scan_layers the 8 blocks form a pattern of 4 (3 Gated DeltaNet + 1 attention, all MoE)
    scanned twice; logits and MoE statistics equal the unrolled model's with the same parameters."""
    over = HYBRID + ["model.num_layers=8", "model.layer_types=" + str(["linear_attention"] * 3 + ["full_attention"]
                                                                      + ["linear_attention"] * 3 + ["full_attention"])]
    cfg = load_config(None, over)
    scanned_cfg = load_config(None, over + ["model.scan_layers=true"])
    layout = layer_layout(scanned_cfg.model)
    assert layout.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and not layout.prefix and not layout.tail
    unrolled = _randomise(build_model(cfg, 259, seed=0), 2)
    from moefast.model.layout import to_layout

    params = nnx.to_pure_dict(nnx.state(unrolled))
    scanned = build_model(scanned_cfg, 259, seed=0)
    graphdef, state = nnx.split(scanned)
    nnx.replace_by_pure_dict(state, to_layout(params, scanned_cfg.model, scanned=True))
    scanned = nnx.merge(graphdef, state)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 20)), jnp.int32)
    routing = {"bias": 0.1 * jax.random.normal(jax.random.key(0), (8, 4)), "load_ema": jnp.full((8, 4), 0.25)}
    run = nnx.jit(lambda m: m(tokens, drop_tokens=False, routing_state=routing))
    a, b = run(unrolled), run(scanned)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a.moe.tokens_per_expert, b.moe.tokens_per_expert)


def test_causal_conv_never_reaches_across_documents_or_the_future():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 7, 3)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2]])
    out, last = causal_conv(x, w, None, seg)
    xs = np.asarray(x[0])
    want = np.zeros((7, 3))
    for t in range(7):
        for i in range(4):
            s = t - 3 + i
            if s >= 0 and (s >= 3) == (t >= 3):
                want[t] += np.asarray(w)[i] * xs[s]
    np.testing.assert_allclose(out[0], want / (1 + np.exp(-want)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(last[0], xs[4:])


@pytest.mark.parametrize("override,field", [
    ("model.layer_types=[linear_attention,full_attention]", "model.layer_types: needs one entry per layer"),
    ("model.layer_types=[linear_attention,linear,full_attention,full_attention]", r"model.layer_types\[1\]: 'linear'"),
    ("model.linear_num_value_heads=3", "model.linear_num_value_heads: must be a multiple"),
    ("model.linear_attention_kind=kda", "model.linear_attention_kind: kda layers have as many key as value heads"),
])
def test_bad_layer_types_name_the_key(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, HYBRID + override.split())
