"""The KDA token mixer (``moefast.model.kda``) against transformers' ``KimiLinearDeltaAttention`` (a tiny
random layer, float32, the torch fallbacks of its kernels), and over packed documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast.model.kda import KimiDeltaAttention

torch = pytest.importorskip("torch")
kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _pair(seed=0, d=32, h=3, kd=8, w=4):
    """A random transformers layer and the moefast layer holding its weights."""
    from transformers import KimiLinearConfig

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(hidden_size=d, num_hidden_layers=2, rms_norm_eps=1e-5,
                           linear_attn_config={"head_dim": kd, "num_heads": h, "short_conv_kernel_size": w})
    ref = kimi.KimiLinearDeltaAttention(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        ref.forget_gate.A_log.copy_(torch.log(torch.rand_like(ref.forget_gate.A_log) * 4 + 0.5))
    ours = KimiDeltaAttention(d, num_heads=h, head_dim=kd, conv_width=w, dtype=jnp.float32, init_std=0.02,
                              out_std=0.02, norm_eps=1e-5, impl="chunked", rngs=nnx.Rngs(0))
    t = lambda x: jnp.asarray(x.detach().numpy().T)  # nn.Linear [out, in] -> [in, out]
    ours.qkv[...] = jnp.concatenate([t(ref.q_proj.weight), t(ref.k_proj.weight), t(ref.v_proj.weight)], axis=1)
    ours.conv[...] = jnp.asarray(ref.conv1d.weight.detach().numpy()[:, 0].T)  # [C, 1, W] -> [W, C]
    fg = ref.forget_gate
    ours.f_a[...], ours.f_b[...] = t(fg.f_a_proj.weight), t(fg.f_b_proj.weight)
    ours.dt_bias[...] = jnp.asarray(fg.dt_bias.detach().numpy())
    ours.A_log[...] = jnp.asarray(fg.A_log.detach().numpy().reshape(-1))
    ours.b[...], ours.g_a[...], ours.g_b[...] = t(ref.b_proj.weight), t(ref.g_a_proj.weight), t(ref.g_b_proj.weight)
    ours.norm[...] = jnp.asarray(ref.o_norm.weight.detach().numpy())
    ours.out[...] = t(ref.o_proj.weight)
    return ref, ours


def test_kda_layer_equals_transformers():
    ref, ours = _pair()
    x = np.random.default_rng(1).normal(size=(2, 21, 32)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(x))
    want = (want[0] if isinstance(want, tuple) else want).numpy()
    got, _ = nnx.jit(lambda m, x: m(x, None, None))(ours, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_packed_documents_equal_each_document_alone():
    """Two documents in a row (a start at token 9): each gives what it gives alone; the
    convolution and the state do not cross the boundary."""
    _, ours = _pair(seed=2)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 20, 32)), jnp.float32)
    seg = jnp.asarray(np.where(np.arange(20) < 9, 1, 2)[None], jnp.int32)
    run = nnx.jit(lambda m, x, s: m(x, s, None)[0])
    packed = run(ours, x, seg)
    first = run(ours, x[:, :9], jnp.ones((1, 9), jnp.int32))
    second = run(ours, x[:, 9:], jnp.ones((1, 11), jnp.int32))
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], axis=1), rtol=1e-5, atol=1e-6)
