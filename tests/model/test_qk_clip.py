"""QK-clip (MuonClip; Kimi K2, arXiv 2507.20534, sec. 2.1): each head's largest pre-softmax logit as
the forward records it (blocked einsums, the flash kernel, MLA) against the explicit logits, and
:func:`moefast.train.qk_clip.qk_clip` bringing a head over tau back to tau while other heads' weights
stay bitwise, in both parameter layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.config import ConfigError, load_config
from moefast.kernels.attention import attention_reference, flash_attention
from moefast.model import mla as mla_module
from moefast.model.attention import causal_attention
from moefast.model.layout import attention_layer_names, softmax_attention_layers, to_layout
from moefast.model.positional import document_positions
from moefast.train.qk_clip import qk_clip
from moefast.train.step import ModelDef

SMALL = ["model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8", "model.d_ff=32",
         "model.max_seq_len=32", "moe.num_experts=4", "moe.top_k=2", "moe.capacity_factor=8", "data.seq_len=24"]
MLA = ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=8", "model.qk_nope_head_dim=8",
       "model.qk_rope_head_dim=4", "model.v_head_dim=8", "model.num_kv_heads=null"]


def _packed(b=2, t=24, seed=0):
    """Token ids and segment ids of packed rows: two documents a row, the last row ending in padding."""
    rng = np.random.default_rng(seed)
    seg = np.where(np.arange(t)[None] < rng.integers(3, t - 3, (b, 1)), 1, 2)
    seg[-1, t - 4:] = 0
    return jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32), jnp.asarray(seg, jnp.int32)


def _brute_max(q_bthd, k_bsgd, mask_bts, scale):
    """Each head's largest q·k·scale over the (b, t, s) the mask allows: NumPy, float64, [H]."""
    q, k = np.asarray(q_bthd, np.float64), np.asarray(k_bsgd, np.float64)
    rep = q.shape[2] // k.shape[2]
    s = np.einsum("bthd,bshd->bhts", q, np.repeat(k, rep, axis=2)) * scale
    return np.where(np.asarray(mask_bts)[:, None], s, -np.inf).max(axis=(0, 2, 3))


def test_blocked_and_flash_maxima_are_the_explicit_logits():
    """Grouped heads (H = 6 on G = 2: head h = g·3 + r), packed documents with padding, a sink per
    head (not a logit of the maximum), three 16-row query blocks (blocked) and a padded kernel
    block; a query row whose document has no key gives −inf in the kernel. The maxima are not
    differentiated: the gradients are those without them, bitwise."""
    rng = np.random.default_rng(1)
    b, t, h, g, hd = 2, 40, 6, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=s) * 2, jnp.float32) for s in ((b, t, h, hd), (b, t, g, hd), (b, t, g, hd)))
    _, seg = _packed(b, t, seed=2)
    sinks = jnp.asarray(rng.normal(size=h) + 20.0, jnp.float32)  # above every logit: must not be the maximum
    causal = np.tril(np.ones((t, t), bool))[None] & (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :])
    qs = seg[:, -8:].at[0, :3].set(7)  # the last 8 queries; 3 of a document (id 7) that no key has
    loss = lambda q, **kw: jnp.sum(jax.tree.leaves(flash_attention(q, k, v, seg, block=16, **kw))[0] ** 2)

    @jax.jit  # one program (the kernel in the Pallas interpreter): CI time
    def maxima(q, k, v):
        blocked = causal_attention(q, k, v, jnp.asarray(causal)[:, None], causal=True, block=16, scale=0.3,
                                   sinks_h=sinks, return_max=True)[1]
        rows = flash_attention(q, k, v, seg, sinks_h=sinks, sm_scale=0.3, block=16, return_max=True)[1]
        ref = attention_reference(q, k, v, seg, sinks_h=sinks, sm_scale=0.3, return_max=True)[1]
        unseen = flash_attention(q[:, -8:], k, v, qs, kv_segment_ids_bs=seg, q_offset=32, return_lse=True,
                                 return_max=True)[2]
        grads = jax.grad(lambda q: loss(q, return_max=True))(q), jax.grad(loss)(q)
        return blocked, rows, ref, unseen, grads

    blocked, rows, ref, unseen, (g_max, g) = maxima(q, k, v)
    want = _brute_max(q, k, causal, 0.3)
    np.testing.assert_allclose(blocked, want, rtol=1e-6)
    np.testing.assert_allclose(rows.max(axis=(0, 2)), want, rtol=1e-6)
    # per row, near-zero maxima too: float32 dot products summed in another order (absolute 1e-6)
    np.testing.assert_allclose(rows, ref, rtol=1e-6, atol=1e-6)
    assert np.isneginf(np.asarray(unseen[0, :, :3])).all() and np.isfinite(np.asarray(unseen[0, :, 3:])).all()
    np.testing.assert_array_equal(g_max, g)


def test_flash_maxima_lower_for_cuda():
    """The kernel with its maxima output, compiled (not interpreted) as on a GPU: the forward and
    both backward kernels lower for CUDA (the Pallas -> Triton translation of the extra store)."""
    q = jax.ShapeDtypeStruct((2, 40, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 40, 2, 16), jnp.bfloat16)
    seg = jnp.ones((2, 40), jnp.int32)

    def loss(q, k, v):
        o, rows = flash_attention(q, k, v, seg, return_max=True, interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(rows)

    text = jax.jit(jax.grad(loss)).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3


@pytest.mark.parametrize("impl", ["blocked", "flash"])
def test_mla_maxima_are_the_explicit_logits(impl, monkeypatch):
    """The MLA module's recorded maxima equal the maxima of the logits of the very queries and keys
    it attends with ([q^C, q^R]·[k^C, k^R] · scale), taken from its call to ``attend``."""
    seen = {}
    real = mla_module.attend

    def spy(q, k, v, mask, **kw):
        seen.update(q=q, k=k, scale=kw["scale"])
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(mla_module, "attend", spy)
    cfg = load_config(None, [*SMALL, *MLA, "model.num_layers=1", "model.num_dense_layers=1",
                             f"model.attention_impl={impl}"])
    model = ModelDef(cfg, 259)
    tokens, seg = _packed()

    @jax.jit
    def forward(params):  # the spy's q and k are values of this same trace: returned with the output
        out = model.module(params)(tokens, None, seg)
        return out.max_logits, seen["q"], seen["k"]

    max_logits, q, k = forward(model.init_params(0))
    mask = np.tril(np.ones((24, 24), bool))[None] & (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :])
    want = _brute_max(q, k, mask, seen["scale"])
    assert max_logits.shape == (1, 4) and max_logits.dtype == jnp.float32
    np.testing.assert_allclose(max_logits[0], want, rtol=1e-5)


def _boost(params, path, cols, factor, zero_centered=False):
    """``params`` with columns ``cols`` of the leaf at ``path`` (keys) multiplied by ``factor`` (a
    zero-centred norm scale w, applied as 1 + w: 1 + w multiplied)."""
    leaf = params
    for key in path[:-1]:
        leaf = leaf[key]
    w = leaf[path[-1]]
    leaf[path[-1]] = w.at[..., cols].set((1 + w[..., cols]) * factor - 1 if zero_centered else w[..., cols] * factor)
    return params


CASES = {  # name -> (overrides, leaf to boost in block 0's attention, its columns: query head 1 (or its features))
    "gqa-bias": (["model.attention_bias=qkv"], ("qkv",), slice(8, 16)),
    "gqa-full-norm": (["model.qk_norm=full"], ("q_norm", "scale"), slice(8, 16)),
    "gqa-per-head-norm-zero-centered": (["model.qk_norm=per_head", "model.zero_centered_norm=true"],
                                        ("q_norm", "scale"), slice(0, 8)),
    "mla": (MLA, ("q_b_proj",), slice(12, 24)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clip_brings_a_head_back_to_tau(case):
    """Block 0's query head 1 pushed far above the rest; tau half its largest logit. After qk_clip
    the forward's largest logit of that head is tau (block 0's inputs are the embeddings: the same
    before and after), its key group's other head keeps its logits, and every weight that makes no
    clipped head's logits is bitwise what it was (block 1, the values, MLA's shared RoPE key). A
    per-head QK-norm shares one scale over the heads: the layer's largest logit is tau."""
    overrides, leaf, cols = CASES[case]
    cfg = load_config(None, [*SMALL, "model.num_layers=2", *overrides])
    md = ModelDef(cfg, 259)
    params = md.init_params(0)
    zero_centered = leaf[-1] == "scale" and cfg.model.zero_centered_norm
    params = _boost(params, ("blocks", 0, "attn", *leaf), cols, 40.0, zero_centered)
    tokens, seg = _packed()

    @jax.jit
    def clip_and_rerun(p):
        before = md.module(p)(tokens, None, seg).max_logits
        tau = 0.5 * jnp.max(before[0])
        clipped = qk_clip(cfg, p, before, tau)
        return before, tau, clipped, md.module(clipped)(tokens, None, seg).max_logits

    before, tau, clipped, after = clip_and_rerun(params)
    assert float(before[0, 1]) > 10 * float(jnp.max(before[1])) and float(jnp.max(before[1])) < float(tau)
    if "per-head" in case:  # one shared scale: the whole layer by its smallest factor
        np.testing.assert_allclose(float(jnp.max(after[0])), float(tau), rtol=1e-4)
        np.testing.assert_allclose(after[0], before[0] * tau / jnp.max(before[0]), rtol=1e-4)
    else:
        np.testing.assert_allclose(float(after[0, 1]), float(tau), rtol=1e-4)
        np.testing.assert_allclose(np.delete(np.asarray(after[0]), 1), np.delete(np.asarray(before[0]), 1), rtol=1e-5)
    assert not np.array_equal(np.asarray(after[0]), np.asarray(before[0]))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(clipped), jax.tree.leaves(params)):
        name = jax.tree_util.keystr(path)
        clippable = ("qkv", "q_norm", "k_norm", "q_b_proj", "kv_b_proj")
        if "[0]['attn']" not in name or not any(k in name for k in clippable):
            np.testing.assert_array_equal(a, b, err_msg=name)
    attn0, orig0 = clipped["blocks"][0]["attn"], params["blocks"][0]["attn"]
    if case == "mla":  # head 1's q^C, q^R (12 columns a head) and k^C (16 a head: N = 8, then Hv = 8) only
        untouched_q, untouched_kv = np.r_[0:12, 24:48], np.r_[0:16, 24:64]
        np.testing.assert_array_equal(attn0["q_b_proj"][:, untouched_q], orig0["q_b_proj"][:, untouched_q])
        np.testing.assert_array_equal(attn0["kv_b_proj"][:, untouched_kv], orig0["kv_b_proj"][:, untouched_kv])
    elif case == "gqa-bias":  # group 1 (query heads 2, 3; key head 1) and every value column untouched
        untouched = np.r_[16:32, 40:48, 48:64]
        np.testing.assert_array_equal(attn0["qkv"][:, untouched], orig0["qkv"][:, untouched])
        np.testing.assert_array_equal(attn0["qkv_bias"][untouched], orig0["qkv_bias"][untouched])


def test_scanned_and_unrolled_layouts_agree():
    """A Gated DeltaNet prefix, a scanned group of (attention, Gated DeltaNet), an attention tail and
    one MTP module: the rows are the softmax-attention layers 1, 3 and the module, equal in both
    layouts, and qk_clip on either layout gives the same parameters (to_layout) bit for bit."""
    ov = [*SMALL, "model.num_layers=4", "model.num_dense_layers=1", "model.mtp_depth=1",
          "model.layer_types=[linear_attention,full_attention,linear_attention,full_attention]",
          "model.linear_num_key_heads=2", "model.linear_num_value_heads=2", "model.linear_key_head_dim=8",
          "model.linear_value_head_dim=8"]
    unrolled = ModelDef(load_config(None, ov), 259)
    scanned = ModelDef(load_config(None, [*ov, "model.scan_layers=true"]), 259)
    assert softmax_attention_layers(unrolled.cfg.model) == (1, 3, 4)
    assert attention_layer_names(unrolled.cfg.model) == ["attention layer 1", "attention layer 3", "MTP module 1"]
    p = unrolled.init_params(0)
    p = _boost(p, ("blocks", 3, "attn", "qkv"), slice(24, 32), 60.0)  # layer 3's query head 3
    tokens, seg = _packed()

    def run(md, params):
        ml = md.module(params)(tokens, None, seg).max_logits
        return ml, qk_clip(md.cfg, params, ml, 0.5 * jnp.max(ml))

    ml_u, clipped_u = jax.jit(lambda q: run(unrolled, q))(p)
    ml_s, clipped_s = jax.jit(lambda q: run(scanned, q))(to_layout(p, scanned.cfg.model, True))
    assert ml_u.shape == (3, 4)
    np.testing.assert_allclose(ml_s, ml_u, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(to_layout(clipped_s, unrolled.cfg.model, False)), jax.tree.leaves(clipped_u)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(clipped_u["blocks"][3]["attn"]["qkv"], p["blocks"][3]["attn"]["qkv"])
    np.testing.assert_array_equal(clipped_u["blocks"][1]["attn"]["qkv"], p["blocks"][1]["attn"]["qkv"])
    with pytest.raises(ValueError, match=r"must be \[L_attn, H\] = \[3, 4\]"):
        qk_clip(unrolled.cfg, p, ml_u[:2], 1.0)


def test_no_softmax_attention_is_one_clear_error(small_config, devices):
    """train.qk_clip on a model of Gated DeltaNet layers only: refused before anything compiles."""
    from moefast.parallel import make_mesh
    from moefast.train.checks import check_run

    cfg = small_config("model.layer_types=[linear_attention,linear_attention]", "train.qk_clip=100")
    with pytest.raises(ConfigError, match="train.qk_clip=100.0: the model has no softmax attention layer"):
        check_run(cfg, make_mesh(cfg, devices[:1]))
    assert check_run(small_config("train.qk_clip=100"), make_mesh(cfg, devices[:1])) is not None


def test_max_logit_is_logged_per_attention_layer(small_config, tmp_path):
    """The step's max_logit_per_layer in metrics.jsonl with its rows' names, the largest in the log
    line and the record, and one TensorBoard scalar a row named after the layer."""
    import json
    import time

    import struct

    from tensorboardX.proto.event_pb2 import Event

    from moefast.train.metrics import MetricsWriter
    from moefast.train.mfu import Peak
    from moefast.train.timing import StepBook

    cfg = small_config("model.mtp_depth=1", "train.log_every=1")
    writer, lines = MetricsWriter(tmp_path), []
    book = StepBook(cfg, t_start=time.perf_counter(), last=1, writer=writer, say=lines.append, bar=None, ckpt=None,
                    flops_per_token=1.0, peak=Peak(None, None, 1, "test"))
    scalars = {k: np.float32(1.0) for k in ("loss", "total_loss", "aux_loss", "z_loss", "grad_norm", "learning_rate")}
    per_layer = np.array([3.5, 12.25, 7.0], np.float32)
    book.record(1, {**scalars, "nonfinite": np.int32(0), "max_logit_per_layer": per_layer})
    book.flush()
    writer.close()
    (rec,) = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert rec["max_logit_per_layer"] == [3.5, 12.25, 7.0] and rec["max_logit"] == 12.25
    assert rec["attention_layer_names"] == ["attention layer 0", "attention layer 1", "MTP module 1"]
    assert "| attn logit 12.2 |" in lines[0] or "| attn logit 12.3 |" in lines[0], lines[0]
    tags = []
    for f in sorted((tmp_path / "tensorboard").iterdir()):  # TFRecord framing: length, its CRC, the Event, its CRC
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            tags += [v.tag for v in Event.FromString(data[pos + 12:pos + 12 + n]).summary.value]
            pos += 12 + n + 4
    assert sorted(t for t in tags if "max_logit_per_layer" in t) == [
        "train/max_logit_per_layer/attention_layer_0", "train/max_logit_per_layer/attention_layer_1",
        "train/max_logit_per_layer/mtp_module_1"]


@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_a_train_step_clips_the_heads_over_tau(arch, small_config):
    """train_step with train.qk_clip = tau below the step's largest logit (a raised learning rate,
    Muon): the parameters are the unclipped step's QK-clipped with the logits the step's forward
    recorded, the heads at or under tau (and everything but the attention's q and k) bitwise the
    unclipped step's; the metric holds each layer's largest logit. QK-clip with adapters: refused."""
    from moefast.parallel import make_mesh
    from moefast.train.checks import check_run
    from moefast.train.step import loss_fn, train_step

    common = [*(MLA if arch == "mla" else ["model.num_kv_heads=1"]), "train.learning_rate=0.05",
              "train.warmup_steps=0", "train.optimizer=muon"]
    free = ModelDef(small_config(*common), 259)
    state = free.init_state(0)
    tokens, seg = _packed()
    batch = dict(tokens=tokens, targets=jnp.roll(tokens, -1, 1), segment_ids=seg,
                 positions=document_positions(seg), loss_weight=(seg > 0).astype(jnp.float32))
    max_lh = loss_fn(free, state["params"], batch, None, state["routing"])[1][5]
    tau = float(np.quantile(np.asarray(max_lh), 0.5))  # half the heads over it
    clipped = ModelDef(small_config(*common, f"train.qk_clip={tau}"), 259)
    key = jax.random.key(0)
    after_free, metrics = jax.jit(lambda s: train_step(free, s, batch, key))(state)
    after, _ = jax.jit(lambda s: train_step(clipped, s, batch, key))(state)
    np.testing.assert_allclose(metrics["max_logit_per_layer"], np.max(max_lh, axis=-1), rtol=1e-6)
    want = qk_clip(clipped.cfg, after_free["params"], max_lh, tau)
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(after["params"]), jax.tree.leaves(want),
                               jax.tree.leaves(after_free["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
        if not any(getattr(k, "key", None) in ("qkv", "q_b_proj", "kv_b_proj") for k in path):
            np.testing.assert_array_equal(a, c, err_msg=jax.tree_util.keystr(path))
    assert not all(np.array_equal(a, c) for a, c in zip(jax.tree.leaves(after["params"]),
                                                         jax.tree.leaves(after_free["params"])))
    with pytest.raises(ConfigError, match="train.qk_clip.*lora"):
        cfg = small_config("train.qk_clip=100", "lora.rank=4")
        check_run(cfg, make_mesh(cfg, jax.devices()[:1]))
