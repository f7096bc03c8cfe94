"""Every GPU path lowers for CUDA on this CPU-only machine (``lowering_platforms=("cuda",)``).

Lowering runs the Pallas -> Triton IR translation (supported primitives, power-of-two block
shapes) and XLA's GPU lowering of the rest of the program; compiling to PTX and running needs a GPU
(``scripts/gpu_check.py``). A failure here is a GPU failure found without a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from moefast.kernels.routing import ops
from moefast.kernels.routing.ops import route_pallas

TRITON_CALL = "xla.gpu.triton"


def _lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("block_tokens", [16, 32, 64, 128])  # what scripts/gpu_check.py sweeps
@pytest.mark.parametrize("rank_method", ["cumsum", "matmul"])
def test_routing_kernel_lowers_for_every_block_size(block_tokens, rank_method):
    f = functools.partial(route_pallas, top_k=4, capacity=64, interpret=False, block_tokens=block_tokens,
                          rank_method=rank_method)

    def loss(lg):
        r = f(lg)
        return jnp.sum(r.gates) + jnp.sum(r.prob_sum) + r.z_sum

    x = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)
    for fn in (f, jax.grad(loss)):
        assert _lower_for_cuda(fn, x).count(TRITON_CALL) == 1


@pytest.mark.parametrize("extra", [["moe.routing_impl=pallas"], ["moe.capacity_factor=0", "moe.grouped_matmul=ragged_dot"],
                                   ["moe.capacity_factor=0", "moe.grouped_matmul=tiled"]],
                         ids=["pallas-routing", "dropless-ragged-dot", "dropless-tiled"])
def test_train_step_lowers_for_cuda(extra, small_config, monkeypatch, tmp_path):
    """The whole train step (forward, backward, AdamW) with the compiled routing kernel, and the
    dropless path as it runs on GPU (``ragged_dot``)."""
    from moefast.train import Trainer

    monkeypatch.setattr(ops, "default_interpret", lambda: False)  # compiled kernel, as on a GPU
    cfg = small_config("mesh.data=1", *extra)
    trainer = Trainer(cfg, tmp_path / "run", log=None, progress=False, devices=jax.devices()[:1])
    b, t = cfg.data.batch_size, cfg.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k == "loss_weight" else jnp.int32,
                                     sharding=trainer.batch_sharding)
             for k in ("tokens", "targets", "segment_ids", "positions", "loss_weight")}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=trainer.replicated)
    with jax.set_mesh(trainer.mesh):
        text = _lower_for_cuda(trainer._train_step, trainer.abstract_state(), batch, key)
    # the layers' kernels have one shape, so the lowering emits the launch once, in a shared function
    assert (TRITON_CALL in text) == ("moe.routing_impl=pallas" in extra)
    if "moe.grouped_matmul=ragged_dot" in extra:
        assert "ragged" in text  # the dropless grouped matmul
