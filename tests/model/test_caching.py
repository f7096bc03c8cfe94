"""The caching lever: constant positional tables, one mask per step, derived dropout keys, the table
cache, and the persistent compilation cache."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_MODEL
from moefast.config import load_config
from moefast.model import TableCache, apply_rope, rope_cos_sin, rope_table, sinusoidal_table
from moefast.model import block, positional
from moefast.train.step import BATCH_KEYS, ModelDef, eval_step, train_step

B, T = 8, 32


def lowered_train_step(*overrides) -> str:
    cfg = load_config(None, SMALL_MODEL + list(overrides))
    md = ModelDef(cfg, 259)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.float32 if k == "loss_weight" else np.int32) for k in BATCH_KEYS}
    key = jax.eval_shape(lambda: jax.random.key(0))
    fn = jax.jit(lambda s, b, k: train_step(md, s, b, k))
    return fn.trace(md.abstract_state(), batch, key).lower().as_text()


def count_position_trig(hlo: str) -> int:
    """sine/cosine ops on per-token tensors [B, T, ...] (the learning-rate schedule's scalar cosine
    is not about positions)."""
    return len(re.findall(rf"stablehlo\.(?:sine|cosine) .*: tensor<{B}x{T}x", hlo))


@pytest.mark.parametrize("encoding", ["rope", "sinusoidal"])
def test_train_step_has_no_position_trig_with_cached_tables(encoding):
    on = lowered_train_step(f"model.position_encoding={encoding}")
    off = lowered_train_step(f"model.position_encoding={encoding}", "cache.tables=false")
    assert count_position_trig(on) == 0, "positional sines/cosines are computed inside the step"
    # Without the cache every layer computes its own (2 layers x cos+sin for RoPE; once for the
    # sinusoidal table, which is added to the embeddings only).
    assert count_position_trig(off) == (4 if encoding == "rope" else 2)


def test_attention_mask_is_built_once_per_step():
    pattern = rf"stablehlo\.and .*: tensor<{B}x{T}x{T}xi1>"  # same_doc & causal
    assert len(re.findall(pattern, lowered_train_step())) == 1
    assert len(re.findall(pattern, lowered_train_step("cache.tables=false"))) == 2  # one per layer


@pytest.mark.parametrize("encoding", ["rope", "sinusoidal"])
def test_cached_and_uncached_models_agree(encoding):
    logits = {}
    for tables in (True, False):
        cfg = load_config(None, SMALL_MODEL + [f"model.position_encoding={encoding}", f"cache.tables={tables}"])
        md = ModelDef(cfg, 259)
        params = md.init_params(seed=0)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, T)), jnp.int32)
        seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 12], 2, axis=0), jnp.int32)
        pos = jnp.asarray(np.repeat([list(range(20)) + list(range(12))], 2, axis=0), jnp.int32)
        logits[tables] = np.asarray(jax.jit(lambda p: md.module(p)(tokens, pos, seg).logits)(params))
    np.testing.assert_allclose(logits[True], logits[False], rtol=2e-5, atol=2e-5)


def _rotate_f64(x, pos, base=10000.0):
    d = x.shape[-1]
    phase = pos[:, None].astype(np.float64) * base ** (-np.arange(0, d, 2) / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(phase) - x2 * np.sin(phase), x2 * np.cos(phase) + x1 * np.sin(phase)], -1)


def test_bf16_rope_stays_within_1e_2_of_float64_up_to_position_4095():
    pos = np.arange(4096)
    x = np.random.default_rng(0).uniform(-1, 1, (4096, 64))
    x_bf16 = jnp.asarray(x, jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.asarray(pos)[None], 4096, 64, 10000.0)
    got = np.asarray(apply_rope(x_bf16[None, :, None, :], cos, sin)[0, :, 0], np.float64)
    want = _rotate_f64(np.asarray(x_bf16, np.float64), pos)  # same (bf16-rounded) inputs
    assert np.max(np.abs(got - want)) <= 1e-2
    # The table itself is float32 with float64 phases.
    c, s = rope_table(4096, 64, 10000.0)
    phase = pos[:, None] * 10000.0 ** (-np.arange(0, 64, 2) / 64)
    assert np.max(np.abs(c - np.cos(phase))) < 1e-6 and np.max(np.abs(s - np.sin(phase))) < 1e-6
    # Control: a phase computed in bf16 is far off, so the bound above is a real check.
    phase_bf16 = np.asarray(jnp.asarray(pos[:, None], jnp.bfloat16) * jnp.asarray(
        10000.0 ** (-np.arange(0, 64, 2) / 64), jnp.bfloat16)[None, :], np.float64)
    assert np.max(np.abs(np.cos(phase_bf16) - np.cos(phase))) > 0.5


def test_bf16_sinusoidal_table_within_1e_2_of_float64():
    table = np.asarray(sinusoidal_table(4096, 256, jnp.bfloat16), np.float64)
    phase = np.arange(4096)[:, None] * 10000.0 ** (-np.arange(0, 256, 2) / 256)
    assert np.max(np.abs(table[:, 0::2] - np.sin(phase))) <= 1e-2
    assert np.max(np.abs(table[:, 1::2] - np.cos(phase))) <= 1e-2


def test_bf16_rope_keeps_the_relative_position_property():
    """<R(m) q, R(n) k> depends only on m - n: shifting both positions by up to 4000 changes the
    score of bf16 queries/keys by no more than bf16 rounding."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(64,)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(64,)), jnp.bfloat16)

    def score(m, n):
        cos, sin = rope_cos_sin(jnp.asarray([[m, n]]), 4096, 64, 10000.0)
        r = apply_rope(jnp.stack([q, k])[None, :, None, :], cos, sin)[0, :, 0].astype(jnp.float32)
        return float(r[0] @ r[1])

    scale = float(jnp.linalg.norm(q.astype(jnp.float32)) * jnp.linalg.norm(k.astype(jnp.float32)))
    for m, n in [(5, 0), (17, 3), (40, 40), (3, 90)]:
        base = score(m, n)
        for shift in (1, 250, 1000, 4000):
            if max(m, n) + shift < 4096:
                assert abs(score(m + shift, n + shift) - base) <= 1e-2 * scale, (m, n, shift)


def test_table_cache_serves_prefixes_and_never_duplicates():
    cache = TableCache(budget_bytes=10_000)
    calls = []

    def build(n):
        calls.append(n)
        return np.arange(n * 4, dtype=np.float32).reshape(n, 4)

    long = cache.get("k", 100, 4, np.float32, (1.0,), build)
    short = cache.get("k", 10, 4, np.float32, (1.0,), build)
    assert calls == [100] and len(cache) == 1 and np.shares_memory(long, short) and short.shape == (10, 4)
    assert not short.flags.writeable
    longer = cache.get("k", 200, 4, np.float32, (1.0,), build)  # replaces the shorter copy
    assert calls == [100, 200] and len(cache) == 1 and cache.nbytes == longer.nbytes == 3200
    cache.get("k", 200, 4, np.float32, (2.0,), build)  # other parameters: another entry
    cache.get("k", 200, 4, np.float32, (3.0,), build)
    assert len(cache) == 3 and cache.nbytes == 9600
    cache.get("k", 50, 4, np.float32, (1.0,), build)  # a hit refreshes (1.0,)
    cache.get("k", 200, 4, np.float32, (4.0,), build)  # over budget: evicts the LRU entry, (2.0,)
    assert [k[3] for k in cache.keys()] == [(3.0,), (1.0,), (4.0,)] and cache.nbytes <= 10_000
    big = cache.get("k", 1000, 4, np.float32, (5.0,), build)  # larger than the budget: not kept
    assert big.shape == (1000, 4) and len(cache) == 3


def test_model_tables_come_from_one_shared_cache_entry():
    positional.TABLES.clear()
    cfg = load_config(None, SMALL_MODEL + ["model.num_layers=3"])
    md = ModelDef(cfg, 259)
    params = md.init_params(seed=0)
    tokens = jnp.zeros((1, T), jnp.int32)
    md.module(params)(tokens)
    jax.jit(lambda p: md.module(p)(tokens).logits)(params)
    keys = positional.TABLES.keys()
    assert keys == [("rope", 16, "float32", (10000.0,))], keys  # one table for all layers and both calls
    assert positional.TABLES.misses == 1


# ---------------------------------------------------------------- dropout keys


@pytest.fixture
def record_dropout(monkeypatch):
    """Records, per call of the model's dropout, (site, keep mask) — computed eagerly."""
    calls = []
    original = block._dropout

    def recording(x, rate, key, site):
        if key is not None and rate > 0:
            calls.append((site, np.asarray(original(jnp.ones_like(x), rate, key, site)) != 0))
        return original(x, rate, key, site)

    monkeypatch.setattr(block, "_dropout", recording)
    return calls


def test_dropout_masks_differ_across_layers_and_steps_and_repeat_for_the_same_step(record_dropout):
    cfg = load_config(None, SMALL_MODEL + ["model.dropout=0.5"])
    md = ModelDef(cfg, 259)
    params = md.init_params(seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, T)), jnp.int32)
    base = jax.random.key(0)

    def masks(step):
        record_dropout.clear()
        md.module(params)(tokens, step_key=jax.random.fold_in(base, step))
        return dict(record_dropout)

    m0, m1, m0_again = masks(0), masks(1), masks(0)
    assert sorted(m0) == [0, 1, 3, 4]  # sites 3 * layer + (0: attention, 1: feed-forward)
    for site in m0:
        np.testing.assert_array_equal(m0[site], m0_again[site])  # reproducible
        assert not np.array_equal(m0[site], m1[site]), f"site {site}: same mask at steps 0 and 1"
        assert 0.4 < m0[site].mean() < 0.6
    assert not np.array_equal(m0[0], m0[3]), "layers 0 and 1 share a dropout mask"
    assert not np.array_equal(m0[0], m0[1]), "attention and feed-forward share a dropout mask"


def test_evaluation_uses_no_randomness(record_dropout, small_config):
    cfg = small_config("model.dropout=0.5")
    md = ModelDef(cfg, 259)
    params = md.init_params(seed=0)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(1, 200, (2, T)), jnp.int32) for k in BATCH_KEYS}
    batch["positions"] = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    batch["segment_ids"] = jnp.ones((2, T), jnp.int32)
    batch["loss_weight"] = jnp.ones((2, T), jnp.float32)
    routing = ModelDef(cfg, 259).init_state(0)["routing"]
    bpt = np.ones(259, np.int32)
    a = eval_step(md, params, routing, batch, bpt)
    no_dropout = ModelDef(small_config("model.dropout=0.0"), 259)
    b = eval_step(no_dropout, params, routing, batch, bpt)
    assert record_dropout == []
    assert float(a["ce_sum"]) == float(b["ce_sum"])
