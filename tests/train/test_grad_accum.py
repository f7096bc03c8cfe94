"""Gradient accumulation: M micro-batches give M = 1's cross-entropy, z-loss and their gradients;
the load-balancing loss is the mean of the micro-batches' own values."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast import parallel
from moefast.config import ConfigError, load_config
from moefast.train.step import ModelDef, loss_and_grads, loss_fn, micro_batches

# capacity = tokens per device: routing drops nothing, so the micro-batches route as the whole batch
BASE = ["model.d_model=64", "model.num_heads=4", "model.head_dim=16", "model.d_ff=64", "model.max_seq_len=64",
        "model.num_layers=2", "data.seq_len=32", "data.batch_size=32", "moe.num_experts=8", "moe.top_k=2",
        "moe.capacity_factor=4.0", "moe.z_loss_coef=0.1"]
STEP = jnp.asarray(3, jnp.int32)


def batch(b=32, t=32, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, t)).astype(np.int32)
    seg = np.ones((b, t), np.int32)
    pad = rng.integers(0, t // 2, b)  # rows with different amounts of padding
    seg[np.arange(t)[None, :] >= (t - pad)[:, None]] = 0
    seg[2] = np.where(np.arange(t) < t // 2, 1, 2)
    weight = (seg != 0).astype(np.float32)
    weight[5, :10] = 0.0  # tokens that count nowhere in the loss
    return {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(np.roll(tokens, -1, 1)),
            "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(np.tile(np.arange(t, dtype=np.int32), (b, 1))),
            "loss_weight": jnp.asarray(weight)}


@functools.cache  # each (M, overrides, mesh) compiled and run once for the module: the tests share them
def run(m, *overrides, mesh_overrides=()):
    cfg = load_config(None, [*BASE, *mesh_overrides, f"train.grad_accum_steps={m}", *overrides])
    md = ModelDef(cfg, 259)
    state = md.init_state(0)
    mesh = parallel.make_mesh(cfg) if mesh_overrides else None
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return jax.jit(lambda p, r, b: loss_and_grads(md, p, r, b, None, STEP))(state["params"], state["routing"], batch())


@pytest.mark.parametrize("mesh_overrides,mtp", [((), 0), (("mesh.data=2", "mesh.expert=4"), 1)],
                         ids=["1-device", "data2-expert4-mtp"])
def test_micro_batches_give_the_global_batch_loss_and_gradients(mesh_overrides, mtp):
    """On the mesh with a multi-token prediction module: its loss is normalised by the whole
    batch's MTP targets too (DeepSeek-V3 eq. 24), so it and its gradients equal M = 1's."""
    # aux_loss_coef 0: the gradients are those of cross-entropy + z-loss (+ MTP), linear in the batch
    results = {m: run(m, "moe.aux_loss_coef=0", f"model.mtp_depth={mtp}", mesh_overrides=mesh_overrides)
               for m in (1, 2, 4)}
    _, (ce1, _, z1, moe1, mtp1, max1, _), g1 = results[1]
    for m in (2, 4):
        loss, (ce, aux, z, moe, mtp_m, max_m, _), g = results[m]
        np.testing.assert_allclose(float(ce), float(ce1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(z), float(z1), rtol=1e-5, atol=1e-5)
        mtp_term = 0.0 if mtp1 is None else 0.3 * float(np.mean(mtp1))  # train.mtp_loss_coef's default
        if mtp1 is not None:
            np.testing.assert_allclose(np.asarray(mtp_m), np.asarray(mtp1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(loss), float(ce1) + 0.1 * float(z1) + mtp_term, rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        # the global batch's routing statistics: assignments summed, token-weighted means
        np.testing.assert_array_equal(np.asarray(moe.tokens_per_expert), np.asarray(moe1.tokens_per_expert))
        np.testing.assert_allclose(np.asarray(moe.z_loss), np.asarray(moe1.z_loss), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(moe.router_entropy), np.asarray(moe1.router_entropy), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(moe.dropped_fraction), 0.0)
        # the largest attention logits: the maximum over the micro-batches, the whole batch's
        np.testing.assert_allclose(np.asarray(max_m), np.asarray(max1), rtol=1e-5)


@functools.cache
def micro_batch_references(m, mtp):
    """(aux(micro-batch i) for each i, the whole batch's aux), each as a batch of its own on one
    device with the default aux coefficient (and ``mtp`` prediction modules, whose MoE block counts
    in aux): the same for every mesh, computed once."""
    extra = [f"model.mtp_depth={mtp}"]
    single = ModelDef(load_config(None, [*BASE, f"data.batch_size={32 // m}", *extra]), 259)
    params = single.init_params(0)  # the same initialisation (same seed and shapes)
    micro = micro_batches(batch(), m)
    one = jax.jit(lambda mb: loss_fn(single, params, mb, None, None, STEP)[1])
    per_micro = [one({k: v[i] for k, v in micro.items()}) for i in range(m)]
    whole_def = ModelDef(load_config(None, [*BASE, *extra]), 259)
    whole = jax.jit(lambda b: loss_fn(whole_def, params, b, None, None, STEP)[1][1])(batch())
    return per_micro, whole


@pytest.mark.parametrize("mesh_overrides,mtp", [((), 0), (("mesh.data=2", "mesh.expert=4"), 1)],
                         ids=["1-device", "data2-expert4-mtp"])
def test_load_balancing_loss_is_the_mean_over_micro_batches(mesh_overrides, mtp):
    """aux = (1/M) sum_m aux(micro-batch m), each aux(m) the Switch loss of micro-batch m as a batch
    of its own (computed here with M = 1 on one device): not scaled by M or by the data-parallel size.
    The M = 4 run is the one the test above made (aux_loss_coef 0): the step returns the
    load-balancing loss before its coefficient, and the references use the default coefficient."""
    m = 4
    _, (_, aux, _, moe, _, _, _), _ = run(m, "moe.aux_loss_coef=0", f"model.mtp_depth={mtp}", mesh_overrides=mesh_overrides)
    per_micro, whole = micro_batch_references(m, mtp)
    expected_layers = np.mean([np.asarray(t[3].aux_loss) for t in per_micro], axis=0)
    np.testing.assert_allclose(np.asarray(moe.aux_loss), expected_layers, rtol=1e-5)
    np.testing.assert_allclose(float(aux), float(np.mean([float(t[1]) for t in per_micro])), rtol=1e-5)
    assert abs(float(aux) - float(whole)) > 1e-6  # not the whole batch's value: it is not linear


def test_micro_batch_rows_stay_on_their_device():
    """Micro-batch i holds rows i, i + M, ...: each device's contiguous block of rows splits into
    its own micro-batch rows."""
    b = {"tokens": jnp.arange(16)[:, None] * jnp.ones((1, 3), jnp.int32)}
    micro = micro_batches(b, 4)["tokens"]
    assert micro.shape == (4, 4, 3)
    np.testing.assert_array_equal(np.asarray(micro[1, :, 0]), [1, 5, 9, 13])


def test_accumulation_settings_that_do_not_fit_fail_clearly():
    with pytest.raises(ConfigError, match="train.grad_accum_steps.*divide data.batch_size=32"):
        load_config(None, [*BASE, "train.grad_accum_steps=3"])
    with pytest.raises(ConfigError, match="train.grad_accum_steps: must be >= 1"):
        load_config(None, [*BASE, "train.grad_accum_steps=0"])
    cfg = load_config(None, [*BASE, "train.grad_accum_steps=8"])  # 4-row micro-batches over 8 devices
    with pytest.raises(ConfigError, match="micro-batches of 32/8 = 4 rows cannot be split over the 8 batch shards"):
        parallel.mesh_shape(cfg, 8)
