"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437, sec. 2.2): the loss against a
re-computation from eqs. 21-25, gradients, packed-document targets, depth 0 unchanged. (On an
expert-parallel mesh with micro-batches: tests/train/test_grad_accum.py; resume with scanned
layers and remat: tests/train/test_train.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.config import load_config
from moefast.model import init_cache
from moefast.model.positional import rope_cos_sin
from moefast.train.step import ModelDef, aux_loss_coef, loss_fn, mtp_loss_weights

# capacity = tokens: routing drops nothing, so rows past the end cannot change the valid rows' routing
BASE = ["model.d_model=32", "model.num_heads=2", "model.head_dim=16", "model.d_ff=32", "model.max_seq_len=64",
        "model.num_layers=2", "model.vocab_size=300", "data.seq_len=24", "data.batch_size=4", "moe.num_experts=4",
        "moe.top_k=2", "moe.capacity_factor=4.0", "moe.z_loss_coef=0.1", "train.mtp_loss_coef=0.7"]
STEP = jnp.asarray(3, jnp.int32)


def packed_batch(b=4, t=24, vocab=300, seed=0):
    """Rows of packed documents cut from one token stream per row (``tokens`` = stream[:, :T],
    ``targets`` = stream[:, 1:]), with padding, a zero-weight span (SFT-like) and a fractional weight."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    seg = np.ones((b, t), np.int32)
    seg[0, 7:] = 2
    seg[0, 15:] = 3
    seg[1, 20:] = 0  # padding
    seg[2, 3:] = 2   # a three-token document
    seg[3, 12:] = 2
    seg[3, 22:] = 0
    pos = np.zeros((b, t), np.int32)
    for r in range(b):
        for i in range(1, t):
            pos[r, i] = pos[r, i - 1] + 1 if seg[r, i] == seg[r, i - 1] else 0
    weight = (seg != 0).astype(np.float32)
    for r in range(b):  # a document's last token has no target inside it
        for i in range(t - 1):
            if seg[r, i + 1] != seg[r, i]:
                weight[r, i] = 0.0
    weight[:, t - 1] = 0.0  # the stream's last token is not part of the row's document boundaries
    weight[3, 2:6] = 0.0  # tokens that count nowhere (a prompt)
    weight[2, 10] = 0.5
    return {"tokens": jnp.asarray(stream[:, :t]), "targets": jnp.asarray(stream[:, 1:]),
            "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos), "loss_weight": jnp.asarray(weight)}, stream


def _rms(x, scale, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale[None, None]


def reference_mtp_losses(md, params, batch, stream):
    """L_MTP^k, k = 1..D, from the equations, with the model's blocks as TRM (their own tests
    cover them) and everything else written out: eq. 21 (norms, concatenation, M_k), eq. 22 (the
    block), eq. 23 (the shared head after the module's norm), eq. 24 (cross-entropy of t_{i+k+1}
    over the rows whose target is in the row's document and has weight), mean over those rows."""
    m = md.cfg.model
    model = md.module(params)
    tokens, seg, pos = batch["tokens"], np.asarray(batch["segment_ids"]), batch["positions"]
    b, t = tokens.shape
    causal = np.tril(np.ones((t, t), bool))
    mask = jnp.asarray((seg[:, :, None] == seg[:, None, :]) & causal[None])[:, None]
    rope = rope_cos_sin(pos, m.max_seq_len, m.head_dim, m.rope_base, cached=False)
    token_mask = jnp.asarray(seg != 0)
    embed = params["embed"]
    head = embed.T if m.tie_embeddings else params["lm_head"]

    x = embed[tokens]
    for i, block in enumerate(model.layer_modules()):
        x = block(x, i, rope, mask, token_mask)[0]
    h = _rms(x, params["final_norm"]["scale"], m.norm_eps)  # h^0: the main model's normed output
    logits = []
    for k in range(1, m.mtp_depth + 1):
        p = params["mtp"][k - 1]
        ids = np.full((b, t), 7, np.int32)  # rows past the end: any id (never a target, never seen)
        ids[:, : t - k] = np.asarray(tokens)[:, k:]
        emb = embed[jnp.asarray(ids)]  # Emb(t_{i+k})
        x = jnp.concatenate([_rms(emb, p["enorm"]["scale"], m.norm_eps), _rms(h, p["hnorm"]["scale"], m.norm_eps)],
                            axis=-1) @ p["eh_proj"]
        x = model.mtp[k - 1].block(x, m.num_layers + k - 1, rope, mask, token_mask)[0]
        h = _rms(x, p["head_norm"]["scale"], m.norm_eps)
        logits.append(h @ head)
    return logits


def numpy_losses(logits, batch, stream):
    """Eq. 24 by loops: per depth k, the weighted mean cross-entropy of the valid rows."""
    seg, w = np.asarray(batch["segment_ids"]), np.asarray(batch["loss_weight"])
    b, t = seg.shape
    out = []
    for k, lg in enumerate(logits, start=1):
        lg = np.asarray(lg, np.float64)
        num = den = 0.0
        for r in range(b):
            for i in range(t - k):
                j = i + k  # t_{i+k+1} = stream[r, j + 1], predicted by the main model at j with weight w[r, j]
                if seg[r, i] == 0 or seg[r, j] != seg[r, i] or w[r, j] == 0:
                    continue
                row = lg[r, i]
                ce = np.log(np.sum(np.exp(row - row.max()))) + row.max() - row[stream[r, j + 1]]
                num += w[r, j] * ce
                den += w[r, j]
        out.append(num / den)
    return np.asarray(out)


def test_mtp_loss_equals_the_equations():
    """Eqs. 21-25 re-computed at depth 2 (L_MTP^1 is what a depth-1 model computes; the second
    module chains on the first's output): each L_MTP^k, and the loss = main terms + coef / D *
    sum_k L_MTP^k (the MTP blocks are MoE layers: their aux and z losses are in the layer means).
    Untied head, a dense first layer and scanned layers (the modules run unrolled after the stack);
    one compile (CI time)."""
    depth = 2
    cfg = load_config(None, [*BASE, "model.tie_embeddings=false", "model.num_dense_layers=1", "model.num_layers=3",
                             "model.scan_layers=true", f"model.mtp_depth={depth}"])
    md = ModelDef(cfg, 259)
    params = md.init_params(0)
    batch, stream = packed_batch()

    @jax.jit
    def both(p):  # the batch is a constant: the reference builds its masks with NumPy
        loss, terms = loss_fn(md, p, batch, None, None, STEP)
        return loss, terms, reference_mtp_losses(md, p, batch, stream)

    loss, (ce, aux, z, moe, mtp, _, _), ref_logits = both(params)
    want = numpy_losses(ref_logits, batch, stream)
    np.testing.assert_allclose(np.asarray(mtp), want, rtol=2e-5)
    n_moe = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    assert moe.aux_loss.shape == (n_moe + depth,)
    np.testing.assert_allclose(float(aux), float(np.mean(moe.aux_loss)), rtol=1e-6)
    main = float(ce) + float(aux_loss_coef(cfg, STEP)) * float(aux) + 0.1 * float(z)
    np.testing.assert_allclose(float(loss), main + 0.7 / depth * want.sum(), rtol=2e-5)


def test_mtp_gradients_reach_the_shared_head_embedding_and_trunk():
    """The MTP loss alone moves the shared output head, the embedding (its input and the tied
    nothing: the head is untied here), the main trunk and the final norm, and its own module; the
    main loss never touches the module's parameters. With a KV cache (generation) no module runs."""
    cfg = load_config(None, [*BASE, "model.tie_embeddings=false", "model.mtp_depth=1"])
    md = ModelDef(cfg, 259)
    params = md.init_params(0)
    batch, _ = packed_batch()

    @jax.jit
    def grads(p):  # one forward, the two losses' backward passes
        terms = lambda q: loss_fn(md, q, batch, None)[1]
        _, vjp = jax.vjp(lambda q: (lambda t: (jnp.mean(t[4]), t[0]))(terms(q)), p)
        (g_mtp,), (g_main,) = vjp((jnp.ones(()), jnp.zeros(()))), vjp((jnp.zeros(()), jnp.ones(())))
        out = md.module(p)(batch["tokens"][:1, :4], cache=init_cache(md.module(p), 1, 8), drop_tokens=False)
        return g_mtp, g_main, out.mtp_logits is None

    g_mtp, g_main, no_mtp_in_generation = grads(params)
    norm = lambda tree: float(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))
    for name in ("lm_head", "embed", "final_norm"):
        assert norm(g_mtp[name]) > 0, name
    assert norm(g_mtp["blocks"][0]["attn"]) > 0 and norm(g_mtp["blocks"][1]["ffn"]) > 0
    assert norm(g_mtp["mtp"][0]["eh_proj"]) > 0 and norm(g_mtp["mtp"][0]["block"]["ffn"]) > 0
    assert norm(g_main["mtp"]) == 0.0
    assert no_mtp_in_generation


def test_mtp_depth_zero_is_the_model_without_it():
    """Depth 0: no ``mtp`` parameters, no MTP term, routing state of the main MoE layers only; the
    main model's parameters of a depth-2 model are the depth-0 ones (initialised first) and its
    main cross-entropy is the same bit for bit."""
    md0 = ModelDef(load_config(None, BASE), 259)
    md2 = ModelDef(load_config(None, [*BASE, "model.mtp_depth=2"]), 259)
    p0, p2 = md0.init_params(0), md2.init_params(0)
    assert "mtp" not in p0 and sorted(p2["mtp"]) == [0, 1]
    main2 = {k: v for k, v in p2.items() if k != "mtp"}
    assert jax.tree.structure(main2) == jax.tree.structure(p0)
    for a, b in zip(jax.tree.leaves(main2), jax.tree.leaves(p0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert md0.init_state(0)["routing"]["bias"].shape == (2, 4)
    assert md2.abstract_state()["routing"]["bias"].shape == (4, 4)
    batch, _ = packed_batch()
    both = jax.jit(lambda p0, p2: (loss_fn(md0, p0, batch, None, None, STEP), loss_fn(md2, p2, batch, None, None, STEP)))
    (loss0, (ce0, aux0, z0, _, mtp0, _, _)), (_, (ce2, _, _, _, mtp2, _, _)) = both(p0, p2)
    assert mtp0 is None and mtp2.shape == (2,)
    assert float(ce0) == float(ce2)
    assert float(loss0) == float(ce0 + aux_loss_coef(md0.cfg, STEP) * aux0 + 0.1 * z0)


def test_mtp_targets_stay_inside_their_document():
    """Module k's row i counts only when t_{i+k+1} is in row i's document and has loss weight:
    compared with a loop over random packings, at every depth up to T - 1."""
    rng = np.random.default_rng(1)
    b, t = 6, 17
    seg = np.cumsum(rng.random((b, t)) < 0.25, axis=1).astype(np.int32) + 1
    seg[rng.random((b, t)) < 0.1] = 0
    seg[0] = 1  # one document filling the row
    w = rng.choice([0.0, 0.5, 1.0], (b, t)).astype(np.float32)
    batch = {"segment_ids": jnp.asarray(seg), "loss_weight": jnp.asarray(w)}
    weights = jax.jit(lambda b: [mtp_loss_weights(b, k) for k in range(1, t)])(batch)
    for k in range(1, t):
        got = np.asarray(weights[k - 1])
        want = np.zeros((b, t), np.float32)
        for r in range(b):
            for i in range(t - k):
                if seg[r, i] != 0 and all(seg[r, j] == seg[r, i] for j in range(i, i + k + 1)):
                    want[r, i] = w[r, i + k]
        np.testing.assert_array_equal(got, want, err_msg=f"depth {k}")
    assert np.asarray(weights[2])[0, : t - 3].tolist() == w[0, 3:].tolist()


def test_hf_export_refuses_mtp_modules_where_no_family_has_them_naming_the_field():
    """A softmax model with MTP modules: only DeepSeek-V3/GLM-4.5 keep MTP layers, and they route by
    sigmoid scores, so every family objects; Mixtral names the MTP modules (exported MTP layers:
    tests/interop/test_hf.py)."""
    from moefast.interop.hf import HFFormatError, hf_family

    with pytest.raises(HFFormatError, match=r"as mixtral it has model\.mtp_depth=1 \(Mixtral has no multi-token"):
        hf_family(load_config(None, ["model.mtp_depth=1"]))
