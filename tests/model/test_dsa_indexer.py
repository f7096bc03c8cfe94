"""Training DeepSeek Sparse Attention's lightning indexer (``train.indexer_stage``; DeepSeek-V3.2-Exp
tech report, sec. 2.1.1): its KL loss against a NumPy computation from the layer's weights, the
dense warm-up that moves the indexers only, the sparse stage whose KL reaches the indexers only,
and a run that switches stage on resume. (The indexer's forward against transformers:
tests/interop/test_hf_deepseek_v32.py.)"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast.config import ConfigError, load_config
from moefast.model.mla import MLAttention, segment_mask
from moefast.model.positional import rope_cos_sin
from moefast.train import ModelDef
from moefast.train.step import loss_and_grads, train_step

B, T, D, H, Q = 2, 16, 24, 3, 12
N, R, C, HV = 8, 4, 10, 6  # qk_nope, qk_rope, kv_lora_rank, v_head_dim
HI, DI, TOPK = 2, 8, 5  # the indexer's heads, head width, keys kept

DSA_MODEL = ["model.d_model=32", "model.num_layers=2", "model.num_dense_layers=1", "model.num_heads=4",
             "model.d_ff=48", "model.max_seq_len=64", "data.seq_len=32", "data.batch_size=4", "moe.num_experts=4",
             "moe.top_k=2", "model.attention=mla", "model.q_lora_rank=16", f"model.kv_lora_rank={C}",
             f"model.qk_nope_head_dim={N}", f"model.qk_rope_head_dim={R}", f"model.v_head_dim={HV}",
             "model.index_topk=6", f"model.index_n_heads={HI}", f"model.index_head_dim={DI}",
             "train.warmup_steps=0", "train.learning_rate=0.01"]


def _layer(stage):
    mla = MLAttention(D, H, q_lora_rank=Q, kv_lora_rank=C, qk_nope_head_dim=N, qk_rope_head_dim=R, v_head_dim=HV,
                      dtype=jnp.float32, init_std=0.3, out_std=0.3, index_topk=TOPK, index_n_heads=HI,
                      index_head_dim=DI, indexer_stage=stage, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)  # norms away from 1 and 0, so a mix-up of scale and bias shows
    for path, v in nnx.to_flat_state(nnx.state(mla)):
        if path[-1] in ("scale", "bias"):
            v.set_value(jnp.asarray(rng.uniform(0.5, 1.5, v.shape) * (1 if path[-1] == "scale" else 0.2), jnp.float32))
    return mla


def _inputs():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    seg = np.ones((B, T), np.int32)
    seg[1, 9:] = 2  # row 1: two packed documents
    seg[0, T - 3:] = 0  # row 0: padded
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    pos[1, 9:] -= 9
    return x, seg, pos


def _numpy_kl(p, x, seg, cos, sin, scale, sparse):
    """The indexer's KL summed over the real queries, from the layer's weights ``p`` (NumPy,
    float64): MLA's per-head logits in the plain (not absorbed) form, the indexer's scores, its own
    top-k, and KL(mean over heads of the attention's softmax || softmax of the scores) over the
    visible keys (dense warm-up) or the selected ones (sparse stage)."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x, cos, sin = f64(x), f64(cos), f64(sin)

    def rope(a):  # rotate-half on the first R features; a [B, T, heads, width]
        a1, a2, rest = a[..., : R // 2], a[..., R // 2: R], a[..., R:]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin, rest], axis=-1)

    def rms(a, w):
        return a / np.sqrt(np.mean(a ** 2, -1, keepdims=True) + 1e-6) * f64(w)

    q_lat = rms(x @ f64(p["q_a_proj"]), p["q_a_layernorm"]["scale"])
    q = (q_lat @ f64(p["q_b_proj"])).reshape(B, T, H, N + R)
    kv_a = x @ f64(p["kv_a_proj_with_mqa"])
    c_kv = rms(kv_a[..., :C], p["kv_a_layernorm"]["scale"])
    k_rope = rope(kv_a[:, :, None, C:])[:, :, 0]
    k_nope = (c_kv @ f64(p["kv_b_proj"])).reshape(B, T, H, N + HV)[..., :N]
    logits = (np.einsum("bthn,bshn->bhts", q[..., :N], k_nope) +
              np.einsum("bthr,bsr->bhts", rope(q[..., N:]), k_rope)) * scale  # [B, H, T, S]
    ix = p["indexer"]
    qi = rope((q_lat @ f64(ix["wq_b"])).reshape(B, T, HI, DI))
    k = x @ f64(ix["wk"])
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    ki = rope((k * f64(ix["k_norm"]["scale"]) + f64(ix["k_norm"]["bias"]))[:, :, None])[:, :, 0]
    w = x @ f64(ix["weights_proj"]) * HI ** -0.5
    scores = np.einsum("bth,bths->bts", w, np.maximum(np.einsum("bthd,bsd->bths", qi, ki) * DI ** -0.5, 0))
    visible = (seg[:, :, None] == seg[:, None, :]) & (np.arange(T)[:, None] >= np.arange(T)[None, :])
    total = 0.0
    for b in range(B):
        for t in range(T):
            keys = np.flatnonzero(visible[b, t])
            if sparse:
                keys = keys[np.argsort(-scores[b, t, keys], kind="stable")[:TOPK]]
            a = logits[b, :, t, keys]  # [K, H]
            attn = np.exp(a - a.max(0)) / np.exp(a - a.max(0)).sum(0)
            target = attn.mean(1)
            s = scores[b, t, keys]
            log_q = s - s.max() - np.log(np.exp(s - s.max()).sum())
            if seg[b, t]:
                total += np.sum(target * (np.log(target) - log_q))
    return total


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_kl_equals_numpy_and_reaches_the_indexer_only(stage):
    """Packed documents and a padded row: the KL the layer records equals the NumPy computation
    (whose attention logits are MLA's plain per-head form, not the absorbed one the layer uses);
    with the blocked einsums and with the fused path's segment ids alike; its gradient is zero for
    every attention parameter and not for the indexer's."""
    mla = _layer(stage)
    x, seg, pos = _inputs()
    cos, sin = rope_cos_sin(jnp.asarray(pos), 64, R, 10000.0)
    graphdef, params = nnx.split(mla)
    mask = segment_mask(jnp.asarray(seg))

    def kl(params, mask):
        out = nnx.merge(graphdef, params)(jnp.asarray(x), (cos, sin), mask, None, 0, record_max=True,
                                          token_mask=jnp.asarray(seg != 0))
        return out[3]

    with jax.default_matmul_precision("highest"):
        (blocked, g), fused = jax.jit(lambda p: (jax.value_and_grad(kl)(p, mask), kl(p, jnp.asarray(seg))))(params)
    want = _numpy_kl(nnx.to_pure_dict(params), x, seg, cos, sin, mla.scale, stage == "sparse")
    assert want > 0.05  # the indexer's distribution is not the attention's yet
    np.testing.assert_allclose(float(blocked), want, rtol=2e-5)
    np.testing.assert_allclose(float(fused), want, rtol=2e-5)
    g = nnx.to_pure_dict(g)
    assert all(np.asarray(v).any() for v in jax.tree.leaves(g["indexer"]))
    assert not any(np.asarray(v).any() for k, v in g.items() if k != "indexer" for v in jax.tree.leaves(v))


def test_dense_warmup_moves_only_the_indexers_and_lowers_their_kl():
    """``train.indexer_stage=dense_warmup``: the optimizer holds the indexers' state only; after
    steps on a fixed batch every other parameter is bitwise what it was, the indexers moved and
    their KL (``indexer_loss``) fell. In the sparse stage the KL's gradient reaches the indexers
    only: every other gradient is the stage "none" gradient, bit for bit."""
    from tests.model.test_mla import _packed_batch

    batch = jax.tree.map(jnp.asarray, _packed_batch())
    md = ModelDef(load_config(None, [*DSA_MODEL, "train.indexer_stage=dense_warmup", "moe.aux_free_bias_rate=0.01"]),
                  259)
    state = md.init_state(0)
    routing = state["routing"]
    moments = jax.tree_util.tree_leaves_with_path(state["opt_state"][1][0].mu)
    assert moments and all("indexer" in jax.tree_util.keystr(path) for path, _ in moments)
    step = jax.jit(lambda s: train_step(md, s, batch, jax.random.key(0)))
    before, losses = state["params"], []
    for _ in range(8):
        state, metrics = step(state)
        losses.append(float(metrics["indexer_loss"]))
    assert metrics["indexer_loss_per_layer"].shape == (2,)
    for a, b in zip(jax.tree.leaves(state["routing"]), jax.tree.leaves(routing)):  # the selection bias too
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert losses[-1] < 0.8 * losses[0], losses
    flat = lambda p: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(p)}  # noqa: E731
    for name, old in flat(before).items():
        new = flat(state["params"])[name]
        if "indexer" in name:
            assert np.asarray(old != new).any(), name
        else:
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old), err_msg=name)

    def grads(stage):
        md = ModelDef(load_config(None, [*DSA_MODEL, f"train.indexer_stage={stage}"]), 259)
        _, terms, g = jax.jit(lambda p: loss_and_grads(md, p, {}, batch, None, jnp.int32(0)))(before)
        return terms[-1], flat(g)

    (none_kl, none), (sparse_kl, sparse) = grads("none"), grads("sparse")
    assert none_kl is None and sparse_kl.shape == (2,) and np.all(np.asarray(sparse_kl) > 0)
    for name, g in none.items():
        if "indexer" in name:
            assert not np.asarray(g).any() and np.asarray(sparse[name]).any(), name
        else:
            np.testing.assert_array_equal(np.asarray(sparse[name]), np.asarray(g), err_msg=name)


def test_indexer_stage_config_errors_and_warnings():
    from moefast.train.checks import config_warnings

    assert any("every query keeps every key" in w for w in
               config_warnings(load_config(None, [*DSA_MODEL, "model.index_topk=32"])))
    assert not any("index_topk" in w for w in config_warnings(load_config(None, DSA_MODEL)))
    with pytest.raises(ConfigError, match="train.indexer_stage.*model.index_topk is null"):
        load_config(None, ["train.indexer_stage=sparse"])
    with pytest.raises(ConfigError, match="train.indexer_stage.*with lora"):
        load_config(None, [*DSA_MODEL, "train.indexer_stage=sparse", "lora.rank=4"])


def test_a_warmup_then_sparse_run_needs_reset_and_logs_the_indexer_loss(small_config, tmp_path):
    """The report's two stages as two runs of one run dir: the dense warm-up, then the sparse
    stage, refused without ``reset_optimizer`` (other trainable parameters), nothing written; with
    it the run goes on from the warm-up's weights. ``indexer_loss`` is in the metrics and the plot."""
    from moefast.data import load_corpus
    from moefast.plot import run_figures
    from moefast.train import CheckpointError, Trainer

    common = [*DSA_MODEL, "data.batch_size=8", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0"]
    cfg = small_config(*common, "train.indexer_stage=dense_warmup", "train.steps=2")
    corpus = load_corpus(cfg.data)
    Trainer(cfg, tmp_path, log=None, progress=False, corpus=corpus).run()
    sparse = small_config(*common, "train.indexer_stage=sparse", "train.steps=4")
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="indexer_stage=dense_warmup.*--reset-optimizer"):
        Trainer(sparse, tmp_path, log=None, progress=False, corpus=corpus).run()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    Trainer(sparse, tmp_path, log=None, progress=False, corpus=corpus, reset_optimizer=True).run()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(np.isfinite(r["indexer_loss"]) and r["indexer_loss"] > 0 for r in train)
    labels = run_figures(tmp_path)["loss"].axes[0].get_legend_handles_labels()[1]
    assert "training indexer loss (KL)" in labels
