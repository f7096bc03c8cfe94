"""Transformer: packed documents, causality, positional-table bounds, KV-cache generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast.config import load_config
from moefast.data import ByteTokenizer
from moefast.model import build_model, init_cache, rope_table
from moefast.model.positional import document_positions
from moefast.train import ModelDef, generate

SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=8", "model.d_ff=48", "model.max_seq_len=64", "data.seq_len=32",
         "moe.num_experts=4", "moe.top_k=2"]


@pytest.fixture(scope="module")
def model():
    # capacity_factor 8: nothing drops, so a token's output cannot depend on other documents.
    return build_model(load_config(None, SMALL + ["moe.capacity_factor=8"]), 259, seed=3)


# The model compiled as one program (nnx.jit): the same forward pass as calling it op by op, seconds
# faster. The tests of the eager position checks call the model directly.
forward = nnx.jit(lambda m, tokens, positions=None, segment_ids=None: m(tokens, positions, segment_ids))


@pytest.mark.parametrize("encoding", ["rope", "sinusoidal"])
def test_packed_documents_do_not_interact(model, encoding):
    """A packed row's second document gives the logits it gives alone, with the positions given or
    left to the model (derived from the segment ids: with sinusoidal encodings, row positions
    would shift it), and changing the first document changes nothing of it."""
    if encoding == "sinusoidal":
        model = build_model(load_config(None, SMALL + ["moe.capacity_factor=8", "model.position_encoding=sinusoidal"]),
                            259, seed=3)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 9), rng.integers(0, 256, 7)
    tokens = np.concatenate([a, b])[None]
    seg = jnp.asarray(np.array([[1] * 9 + [2] * 7]))
    pos = np.array([list(range(9)) + list(range(7))])
    out = forward(model, jnp.asarray(tokens), None, seg).logits
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(pos), seg).logits),
                               np.asarray(out), rtol=1e-6, atol=1e-6)
    tokens2 = tokens.copy()
    tokens2[0, :9] = rng.integers(0, 256, 9)  # change document A only
    out2 = forward(model, jnp.asarray(tokens2), None, seg).logits
    alone = forward(model, jnp.asarray(b[None]), None, jnp.ones((1, 7), jnp.int32)).logits
    np.testing.assert_allclose(np.asarray(out[0, 9:]), np.asarray(out2[0, 9:]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[0, 9:]), np.asarray(alone[0]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(out[0, :9]), np.asarray(out2[0, :9]))


def test_document_positions_restart_at_each_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(document_positions(seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])


def test_causality(model):
    tokens = np.random.default_rng(1).integers(0, 256, (2, 20))
    out = forward(model, jnp.asarray(tokens)).logits
    changed = tokens.copy()
    changed[:, 12:] = (changed[:, 12:] + 1) % 256
    out2 = forward(model, jnp.asarray(changed)).logits
    np.testing.assert_allclose(np.asarray(out[:, :12]), np.asarray(out2[:, :12]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(out[:, 12:]), np.asarray(out2[:, 12:]))


def test_sequence_longer_than_table_raises(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 65), jnp.int32))


def test_positions_beyond_table_raise(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 4), jnp.int32), jnp.array([[0, 1, 2, 64]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 4), jnp.int32), jnp.array([[-1, 0, 1, 2]]))


def test_positions_beyond_table_under_jit_give_nan_not_clamped_values(model):

    graphdef, state = nnx.split(model)
    f = jax.jit(lambda st, pos: nnx.merge(graphdef, st)(jnp.zeros((1, 4), jnp.int32), pos).logits)
    ok = f(state, jnp.array([[0, 1, 2, 63]]))
    bad = f(state, jnp.array([[0, 1, 2, 64]]))
    assert bool(jnp.all(jnp.isfinite(ok)))
    assert bool(jnp.all(jnp.isnan(bad[0, 3])))


def test_rope_table_matches_float64_reference():
    cos, sin = rope_table(4096, 64, 10000.0)
    p = np.arange(4096)[:, None]
    phase = p * 10000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(cos, np.cos(phase), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(phase), atol=1e-6)
    assert np.shares_memory(rope_table(4096, 64, 10000.0)[0], cos)  # computed once, served from the cache


@pytest.mark.parametrize("extra", [[], ["model.layer_types=[sliding_attention,full_attention]",
                                         "model.sliding_window=4", "model.attention_sinks=true"]],
                         ids=["full", "sliding-window-sinks"])
def test_generate_with_kv_cache_matches_full_forward(extra):
    """Greedy generation through the KV cache gives the logits of one forward pass over the whole
    text; also with a sliding-window layer (4 keys: the cache's band follows the cache index) and
    attention sinks."""
    cfg = load_config(None, SMALL + extra)
    md = ModelDef(cfg, 259)
    params = md.init_params(seed=5)
    tok = ByteTokenizer()
    text, logits = generate(md, params, tok, "def f(x):", max_new_tokens=12, temperature=0.0,
                            return_logits=True)
    prompt_ids = np.concatenate([[tok.bos_id], tok.encode("def f(x):")])
    gen_ids = tok.encode(text)
    assert len(logits) >= 1
    full_ids = np.concatenate([prompt_ids, gen_ids])[None]
    full = jax.jit(lambda p, ids: md.module(p)(ids, drop_tokens=False).logits)(params, jnp.asarray(full_ids))[0]
    n = len(prompt_ids)
    for i in range(len(logits)):
        np.testing.assert_allclose(logits[i], np.asarray(full[n - 1 + i]), rtol=1e-4, atol=1e-4)


def test_kv_cache_slots_holding_nan_or_inf_change_nothing(model):
    """A cache buffer reused with NaN or inf in the slots not yet written gives, for a prefill and
    the decoding steps after it, bitwise the logits of a zero-filled cache (masked slots are
    selected away, not multiplied by a zero weight). (MLA's cache: test_mla.py.)"""
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 9)), jnp.int32)

    @jax.jit
    def decode(state, fill):
        m = nnx.merge(graphdef, state)
        cache = jax.tree.map(lambda c: jnp.full_like(c, fill), init_cache(m, 2, 16))
        out = m(ids[:, :6], cache=cache, cache_index=0, drop_tokens=False)
        logits, cache = [out.logits], out.cache
        for i in range(6, 9):
            out = m(ids[:, i: i + 1], cache=cache, cache_index=jnp.int32(i), drop_tokens=False)
            logits.append(out.logits)
            cache = out.cache
        return jnp.concatenate(logits, axis=1)

    zero = decode(state, jnp.float32(0))
    assert bool(jnp.all(jnp.isfinite(zero)))
    for fill in (np.nan, np.inf, -np.inf):
        np.testing.assert_array_equal(decode(state, jnp.float32(fill)), zero, err_msg=str(fill))


def test_generate_rejects_too_long_prompt():
    cfg = load_config(None, SMALL)
    md = ModelDef(cfg, 259)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(md, md.init_params(0), ByteTokenizer(), "x" * 60, max_new_tokens=10)


def _packed_mask(seg):
    t = seg.shape[1]
    causal = np.arange(t)[:, None] >= np.arange(t)[None, :]
    return jnp.asarray((seg[:, :, None] == seg[:, None, :]) & causal[None])[:, None]


@pytest.mark.parametrize("t,block", [(1, 4), (8, 4), (9, 4), (37, 128)])
def test_block_causal_attention_equals_full_masked_attention(t, block):
    """Forward and gradients of the block-causal path against jax.nn.dot_product_attention over
    the whole masked score matrix: grouped-query heads, packed documents with padding (segment 0),
    one query, a whole number of blocks, a partial last block, and one block shorter than ``block``."""
    from moefast.model.transformer import causal_attention

    rng = np.random.default_rng(t)
    b, h, g, hd = 2, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, hd)), jnp.float32) for n in (h, g, g))
    cut = rng.integers(0, t + 1, size=2)
    seg = np.stack([np.where(np.arange(t) < c, 1, 2) for c in cut])
    seg[1, t - t // 4:] = 0  # trailing padding attends only to padding
    mask = _packed_mask(seg)
    w = jnp.asarray(rng.normal(size=(b, t, h, hd)), jnp.float32)

    def loss(fn, q, k, v):
        return (fn(q, k, v) * w).sum()

    ours = lambda q, k, v: causal_attention(q, k, v, mask, causal=True, block=block)
    full = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_allclose(jax.jit(ours)(q, k, v), jax.jit(full)(q, k, v), rtol=1e-5, atol=1e-5)
    g_ours = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(q, k, v)
    g_full = jax.jit(jax.grad(lambda *a: loss(full, *a), argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(g_ours, g_full):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def test_block_causal_attention_bf16_and_errors():
    from moefast.model.transformer import causal_attention

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 20, 2, 8)), jnp.bfloat16) for _ in range(3))
    mask = _packed_mask(np.ones((1, 20), int))
    out = causal_attention(q, k, v, mask, causal=True, block=8)
    assert out.dtype == jnp.bfloat16
    ref = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)), mask=mask)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2)
    with pytest.raises(ValueError, match="as many queries as keys"):
        causal_attention(q[:, :5], k, v, mask[:, :, :5], causal=True)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        causal_attention(q, k[:, :, :1].repeat(3, 2)[:, :, :3], v[:, :, :1].repeat(3, 2)[:, :, :3], mask, causal=True)


def test_a_vocabulary_smaller_than_the_tokenizers_is_one_clear_error():
    """A newcomer's finding: an imported run whose tokenizer files were replaced by a larger one said
    only that the sizes differ, not what to do."""
    with pytest.raises(ValueError, match=r"model.vocab_size=259 is smaller than the tokenizer's 300 ids: .*its "
                                         r"files may have changed since"):
        build_model(load_config(None, SMALL + ["model.vocab_size=259"]), 300)
