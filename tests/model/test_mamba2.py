"""The Mamba-2 token mixer (``moefast.model.mamba2``) against transformers' ``NemotronHMamba2Mixer`` (a
tiny random layer, float32, the PyTorch fallbacks of its kernels), over packed documents, and
decoding token by token against the full pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast.config import load_config
from moefast.model.mamba2 import Mamba2

torch = pytest.importorskip("torch")
nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

D, H, P, G, N, W = 32, 4, 8, 2, 16, 4


def _pair(seed=0, impl="chunked"):
    """A random transformers mixer and the moefast layer holding its weights."""
    from transformers import NemotronHConfig

    torch.manual_seed(seed)
    cfg = NemotronHConfig(hidden_size=D, mamba_num_heads=H, mamba_head_dim=P, n_groups=G, ssm_state_size=N,
                          conv_kernel=W, chunk_size=8, layer_norm_epsilon=1e-5, time_step_min=0.01,
                          layers_block_type=["linear_attention"])
    ref = nemotron.NemotronHMamba2Mixer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name not in ("A_log", "dt_bias"):
                p.copy_(torch.randn_like(p) * 0.3)
        ref.A_log.copy_(torch.log(torch.rand_like(ref.A_log) * 4 + 0.5))
        ref.dt_bias.copy_(torch.randn_like(ref.dt_bias) - 1.0)  # some steps below time_step_min: the clamp acts
    ours = Mamba2(D, num_heads=H, head_dim=P, num_groups=G, state_size=N, conv_width=W, time_step_min=0.01,
                  dtype=jnp.float32, init_std=0.02, out_std=0.02, norm_eps=1e-5, impl=impl, rngs=nnx.Rngs(0))
    t = lambda x: jnp.asarray(x.detach().numpy().T)  # nn.Linear [out, in] -> [in, out]
    ours.in_proj[...], ours.out[...] = t(ref.in_proj.weight), t(ref.out_proj.weight)
    ours.conv[...] = jnp.asarray(ref.conv1d.weight.detach().numpy()[:, 0].T)  # [C, 1, W] -> [W, C]
    for name in ("conv_bias", "A_log", "D", "dt_bias", "norm"):
        src = {"conv_bias": ref.conv1d.bias, "norm": ref.norm.weight}.get(name, getattr(ref, name, None))
        getattr(ours, name)[...] = jnp.asarray(src.detach().numpy())
    return ref, ours


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_mamba2_layer_equals_transformers(impl):
    """T = 21, not a multiple of the chunk; ``pallas`` in the interpreter."""
    ref, ours = _pair(impl=impl)
    x = np.random.default_rng(1).normal(size=(2, 21, D)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(x)).numpy()
    got, _ = nnx.jit(lambda m, x: m(x, None, None))(ours, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_packed_documents_and_decoding():
    """Two documents in a row (a start at token 9) each give what they give alone (conv and state
    reset); decoding the first one a token at a time through the cache gives the full pass."""
    from moefast.model.gated_deltanet import init_state
    from moefast.config import load_config

    _, ours = _pair(seed=2)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 20, D)), jnp.float32)
    seg = jnp.asarray(np.where(np.arange(20) < 9, 1, 2)[None], jnp.int32)
    run = nnx.jit(lambda m, x, s: m(x, s, None)[0])
    packed = run(ours, x, seg)
    first, second = run(ours, x[:, :9], seg[:, :9]), run(ours, x[:, 9:], seg[:, 9:])
    np.testing.assert_allclose(np.asarray(packed), np.concatenate([first, second], axis=1), rtol=1e-5, atol=1e-6)
    m = load_config(None, ["model.layer_types=[linear_attention]", "model.num_layers=1",
                           "model.linear_attention_kind=mamba2", f"model.linear_num_value_heads={H}",
                           f"model.linear_value_head_dim={P}", f"model.linear_num_key_heads={G}",
                           f"model.linear_key_head_dim={N}", f"model.linear_conv_kernel_dim={W}"]).model
    cache = init_state(m, 1, jnp.float32)
    step = nnx.jit(lambda m, x, c: m(x, None, c))
    out = []
    for i in range(9):
        o, cache = step(ours, x[:, i: i + 1], cache)
        out.append(o)
    np.testing.assert_allclose(np.concatenate(out, axis=1), np.asarray(first), rtol=1e-4, atol=1e-5)


NEMOTRON = ["model.d_model=32", "model.num_layers=8", "model.num_dense_layers=0", "model.num_heads=4",
            "model.num_kv_heads=2", "model.head_dim=8", "model.position_encoding=none", "model.max_seq_len=64",
            "model.layer_types=[linear_attention,moe,full_attention,mlp,linear_attention,moe,full_attention,mlp]",
            "model.linear_attention_kind=mamba2", f"model.linear_num_value_heads={H}",
            f"model.linear_value_head_dim={P}", f"model.linear_num_key_heads={G}", f"model.linear_key_head_dim={N}",
            "model.linear_attention_impl=chunked", "model.d_ff=24", "model.dense_d_ff=40",
            "model.dense_activation=relu2", "moe.expert_activation=relu2", "moe.num_experts=4", "moe.top_k=2",
            "moe.capacity_factor=8", "moe.latent_size=16", "moe.shared_expert_d_ff=20", "moe.shared_expert_gate=false",
            "data.seq_len=32"]


def test_nemotron_h_sublayers_scan_decode_and_train():
    """A Nemotron-H pattern (one pre-norm residual sublayer per entry: Mamba-2, MoE, NoPE attention,
    relu² MLP, twice): its blocks are sublayers (a mixer or a feed-forward alone); scanned by its
    period of 4 it equals the unrolled model; decoding through the Mamba-2 states and the attention
    cache equals the full pass; a train step moves every parameter."""
    from moefast.model import build_model, init_cache
    from moefast.model.layout import layer_layout, to_layout
    from moefast.train import ModelDef
    from moefast.train.step import train_step

    cfg = load_config(None, NEMOTRON)
    model = build_model(cfg, 259, seed=0)
    kinds = [(hasattr(b, "attn"), hasattr(b, "ffn")) for b in model.blocks]
    assert kinds == [(True, False), (False, True)] * 4
    assert type(model.blocks[0].attn).__name__ == "Mamba2" and model.blocks[1].is_moe and not model.blocks[3].is_moe
    scanned_cfg = load_config(None, NEMOTRON + ["model.scan_layers=true", "model.remat=full"])
    assert layer_layout(scanned_cfg.model).groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    params = nnx.to_pure_dict(nnx.state(model))
    scanned = build_model(scanned_cfg, 259, seed=0)
    graphdef, state = nnx.split(scanned)
    nnx.replace_by_pure_dict(state, to_layout(params, scanned_cfg.model, scanned=True))
    scanned = nnx.merge(graphdef, state)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 15)), jnp.int32)
    run = nnx.jit(lambda m: m(ids, drop_tokens=False).logits)
    full = run(model)
    np.testing.assert_allclose(run(scanned), full, rtol=1e-5, atol=1e-5)

    graphdef, state = nnx.split(model)

    @jax.jit
    def decode(state):
        m = nnx.merge(graphdef, state)
        out = m(ids[:, :9], cache=init_cache(m, 2, 16), cache_index=0, drop_tokens=False)
        steps, cache = [out.logits], out.cache
        for i in range(9, 15):
            out = m(ids[:, i: i + 1], cache=cache, cache_index=jnp.int32(i), drop_tokens=False)
            steps.append(out.logits)
            cache = out.cache
        return jnp.concatenate(steps, axis=1), cache

    decoded, cache = decode(state)
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-4)
    assert [sorted(c) for c in cache] == [["conv", "state"], [], ["k", "v"], []] * 2

    md = ModelDef(load_config(None, NEMOTRON + ["data.batch_size=2", "train.warmup_steps=0"]), 259)
    state = md.init_state(0)
    batch = {"tokens": ids[:, :14], "targets": ids[:, 1:], "segment_ids": jnp.ones((2, 14), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(14, dtype=jnp.int32), (2, 14)),
             "loss_weight": jnp.ones((2, 14), jnp.float32)}
    new, metrics = jax.jit(lambda s: train_step(md, s, batch, jax.random.key(0)))(state)
    assert np.isfinite(float(metrics["loss"])) and metrics["tokens_per_expert"].shape == (2, 4)
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), state["params"], new["params"])
    assert all(jax.tree.leaves(moved)), [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(moved)
                                         if not v]


def test_generate_through_the_nemotron_h_states():
    """``moefast generate``'s sampling loop on the Nemotron-H pattern (prefill, then a token at a
    time through the Mamba-2 states and the attention cache): every step's logits equal the full
    forward pass over the prompt and the tokens so far."""
    from moefast.data import ByteTokenizer
    from moefast.train import ModelDef, generate

    md = ModelDef(load_config(None, NEMOTRON), 259)
    params = md.init_params(seed=5)
    tok = ByteTokenizer()
    _, logits = generate(md, params, tok, "def f(x):", max_new_tokens=4, temperature=0.0, return_logits=True)
    prompt = [tok.bos_id, *tok.encode("def f(x):")]
    picked = [int(np.argmax(lg[:256])) for lg in logits[:-1]]  # greedy over the bytes (a random model's
    # bytes need not decode to text, so the ids are taken from the logits, not re-encoded from the text)
    ids = np.asarray([prompt + picked], np.int32)
    full = jax.jit(lambda p, ids: md.module(p)(ids, drop_tokens=False).logits)(params, jnp.asarray(ids))[0]
    n = len(prompt)
    assert len(logits) >= 2
    for i in range(len(logits)):
        np.testing.assert_allclose(logits[i], np.asarray(full[n - 1 + i]), rtol=1e-4, atol=1e-4)
