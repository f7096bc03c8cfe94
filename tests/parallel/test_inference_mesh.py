"""Evaluation, generation and export restore a run onto its model-parallel axes (expert, fsdp) when
the devices allow, so a model larger than one device can be used after training."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moefast.config import load_config
from moefast.data import ByteTokenizer
from moefast.parallel import inference_mesh, make_mesh
from moefast.train import generate
from moefast.train.step import ModelDef

SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=8",
         "model.d_ff=48", "model.max_seq_len=64", "data.seq_len=32", "data.batch_size=8", "moe.num_experts=4",
         "moe.top_k=2"]


@pytest.mark.parametrize("mesh, devices, kept", [
    (["mesh.expert=4"], 8, {"data": -1, "fsdp": 1, "expert": 4}),  # data takes the rest
    (["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"], 4, {"data": -1, "fsdp": 2, "expert": 2}),
    (["mesh.data=1", "mesh.expert=-1"], 2, {"data": 1, "fsdp": 1, "expert": -1}),  # expert takes the rest
    (["mesh.expert=4"], 1, None),  # four expert shards cannot sit on one device
    (["mesh.expert=4"], 6, None),
    (["mesh.context=2", "mesh.expert=2"], 8, {"data": -1, "fsdp": 1, "expert": 2}),  # whole rows: no context
])
def test_the_runs_model_parallel_axes_are_kept_when_the_devices_allow(mesh, devices, kept):
    cfg = load_config(None, SMALL + mesh)
    got, note = inference_mesh(cfg, devices)
    if kept is None:
        assert (got.data, got.fsdp, got.expert) == (-1, 1, 1)
        assert note.startswith("note: the run's mesh (fsdp=1, expert=4) does not fit the") and "data parallelism" in note
    else:
        assert {"data": got.data, "fsdp": got.fsdp, "expert": got.expert} == kept and note is None
        assert got.context == 1


def test_generation_on_an_expert_mesh_equals_one_device(devices):
    """Greedy sampling with the parameters split over 2 data x 4 expert devices (each expert's
    weights on one device, the sequence repeated on the 8 token shards) gives the logits and text
    of the same parameters on one device."""
    cfg = load_config(None, SMALL + ["mesh.expert=4"])
    md, tok = ModelDef(cfg, 259), ByteTokenizer()
    params = md.init_params(seed=5)
    mesh = make_mesh(cfg, devices)
    # as the train state holds them (what eval/generate/export restore): each device one expert's share
    split = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), md.param_state_specs(mesh),
                                                is_leaf=lambda x: isinstance(x, P)))
    w_in = split["blocks"][0]["ffn"]["w_in"]
    assert w_in.addressable_shards[0].data.shape[0] == 1 and w_in.addressable_shards[0].data.size * 8 == w_in.size
    one_text, one = generate(md, jax.device_put(params, devices[0]), tok, "def f(x):", max_new_tokens=8,
                             temperature=0.0, return_logits=True)
    text, logits = generate(md, split, tok, "def f(x):", max_new_tokens=8, temperature=0.0, return_logits=True,
                            mesh=mesh)
    assert text == one_text
    np.testing.assert_allclose(logits, one, rtol=1e-5, atol=1e-5)
