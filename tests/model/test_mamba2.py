"""The Mamba-2 token mixer (``moefast.model.mamba2``) against transformers' ``NemotronHMamba2Mixer`` (a
tiny random layer, float32, the PyTorch fallbacks of its kernels), over packed documents, and
decoding token by token against the full pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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
