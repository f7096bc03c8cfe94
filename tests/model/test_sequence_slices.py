"""model.sequence_slices: the rows carried through the layers as sequence slices (slice i attending
to the keys of slices 0..i through the fused kernel's query offset, or the bool mask's rows) are the
same function as whole rows when nothing drops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moefast.config import ConfigError
from moefast.model import build_model
from moefast.parallel import MESH_AXES

MLA = ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=12", "model.qk_nope_head_dim=8",
       "model.qk_rope_head_dim=4", "model.v_head_dim=6"]
CASES = {
    # the fused kernel (Pallas interpreter) inside shard_map, on data 2 x expert 4 split into 2 hosts
    # of 2 GPUs: node-limited routing (one group per host) and the two-hop exchange, each slice's own
    "gqa-flash-hierarchical-mesh": ["model.attention_impl=flash", "model.num_kv_heads=1", "moe.num_experts=8",
                                    "moe.exchange=hierarchical", "moe.gpus_per_host=2", "moe.num_groups=2",
                                    "moe.topk_groups=1", "mesh.data=2", "mesh.expert=4"],
    # DeepSeek-V3's blocks: MLA on the blocked einsums (the bool mask's rows), scanned layers under
    # full remat, a dense first layer and a multi-token prediction module (on whole rows)
    "mla-blocked-scan-remat-mtp": [*MLA, "model.attention_impl=blocked", "model.scan_layers=true",
                                   "model.remat=full", "model.num_layers=3", "model.num_dense_layers=1",
                                   "model.mtp_depth=1"],
}


def _loss_and_grads(cfg, devices):
    graphdef, params = nnx.split(build_model(cfg, 259, seed=0))
    rng = np.random.default_rng(0)
    b, t = 8, cfg.data.seq_len
    tokens = jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32)
    # two packed documents a row, the second row's first one crossing the slices' boundary, and padding
    seg = jnp.asarray(np.where(np.arange(t)[None] < rng.integers(1, t, (b, 1)), 1, 2), jnp.int32).at[:, t - 4:].set(0)

    @jax.jit
    def f(params):
        def loss(p):
            out = nnx.merge(graphdef, p)(tokens, None, seg, step_key=None)
            mtp = sum(jnp.tanh(m).sum() for m in out.mtp_logits or ())
            value = jnp.sum(jnp.where(seg[..., None] > 0, jnp.tanh(out.logits), 0.0)) + mtp + out.moe.aux_loss.sum()
            return value, (out.logits, out.moe)
        return jax.grad(loss, has_aux=True)(params)

    if cfg.mesh.expert == 1:
        return f(params)
    shape = tuple(getattr(cfg.mesh, a) for a in MESH_AXES)
    mesh = jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    with jax.set_mesh(mesh):
        return f(params)


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_slices_equal_whole_rows(case, small_config, devices):
    """Two slices against one, capacity factor 8 (nothing drops): routing statistics bitwise, logits
    and parameter gradients to float rounding (attention's sums in another order; gradients to
    1e-6 of each parameter's largest)."""
    cfgs = [small_config("moe.capacity_factor=8", *CASES[case], f"model.sequence_slices={n}") for n in (1, 2)]
    (g1, (l1, s1)), (g2, (l2, s2)) = (_loss_and_grads(c, devices) for c in cfgs)
    assert float(s1.dropped_fraction.max()) == 0.0
    np.testing.assert_array_equal(s1.tokens_per_expert, s2.tokens_per_expert)
    np.testing.assert_allclose(l2, l1, rtol=1e-5, atol=1e-5)
    for a, e in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):  # float32 rounding of each leaf's scale
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 + 1e-6 * float(np.abs(e).max()))


def test_sequence_slices_bad_config(small_config):
    with pytest.raises(ConfigError, match="must divide data.seq_len=32"):
        small_config("model.sequence_slices=3")
    with pytest.raises(ConfigError, match="recurrent state does not pass between slices"):
        small_config("model.sequence_slices=2", "model.layer_types=[linear_attention,full_attention]")
    with pytest.raises(ConfigError, match=r"model.sequence_slices: must be in \[1, 8\]"):
        small_config("model.sequence_slices=0")
    with pytest.raises(ConfigError, match="compiled as code of its own"):
        small_config("model.sequence_slices=16")
    with pytest.raises(ConfigError, match="model.sliding_window: 8 with no sliding_attention layer"):
        small_config("model.sliding_window=8")
