"""Context parallelism (``mesh.context``): each row's tokens split over devices in the load-balanced
order, attention gathering the row's keys and values; the same training loss and gradients as
whole rows on one device."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moefast.config import ConfigError
from moefast.kernels.attention import flash_attention
from moefast.kernels.attention.reference import attention_reference
from moefast.model.positional import document_positions
from moefast.parallel import make_mesh, mesh_shape
from moefast.parallel.context import balanced_order, natural_order, row_index
from moefast.train import Trainer
from moefast.train.step import ModelDef, loss_fn

MLA = ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=12", "model.qk_nope_head_dim=8",
       "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.scan_layers=true", "model.remat=full",
       "model.num_layers=3", "model.num_dense_layers=1", "model.mtp_depth=1"]
# grouped-query heads, a sliding-window layer (6 keys) beside a full one, attention sinks; 8 experts,
# whose dimension data 4 x context 2 splits over both axes (ZeRO: the gathers' order matters)
GQA = ["model.num_kv_heads=1", "model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=6",
       "model.attention_sinks=true", "moe.num_experts=8"]
# Qwen3-Next's hybrid (configs/tiny_qwen3_next.yaml's layer kinds, shrunk): Gated DeltaNet layers
# (grouped value heads) before a gated full-attention layer; with KDA in their place (a decay per
# key channel). Context 4 cuts the 32-token rows into 4-token pieces: the convolution's 3 earlier
# taps and the documents cross most piece boundaries.
HYBRID = ["model.num_layers=3", "model.layer_types=[linear_attention,linear_attention,full_attention]",
          "model.attention_output_gate=true", "model.qk_norm=per_head", "model.partial_rotary_factor=0.25",
          "model.zero_centered_norm=true", "model.linear_num_key_heads=1", "model.linear_num_value_heads=2",
          "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "moe.shared_expert_d_ff=32",
          "moe.shared_expert_gate=true"]
KDA = [*HYBRID, "model.linear_attention_kind=kda", "model.linear_num_key_heads=2"]
CASES = {  # name -> (architecture, attention path, mesh)
    "gqa-window-sinks-blocked-context2-data4": (GQA, "blocked", ["mesh.context=2"]),
    "gqa-window-sinks-flash-context4-expert2": (GQA, "flash", ["mesh.context=4", "mesh.expert=2"]),
    # DeepSeek-V3's blocks: MLA (the latent gathered), scanned layers under full remat, a dense
    # first layer and a multi-token prediction module (its loss in the total)
    "mla-mtp-blocked-context2-fsdp2-expert2": (MLA, "blocked", ["mesh.context=2", "mesh.fsdp=2", "mesh.expert=2"]),
    # with adapters on every projection (B drawn at random): the kernel up-projects the gathered
    # latent with kv_b's adapted weight; the gradients compared are the adapters'
    "mla-mtp-lora-flash-context4-data2": ([*MLA, "lora.rank=4", "lora.alpha=8", "lora.base_dtype=float32"], "flash",
                                          ["mesh.context=4"]),
    # linear attention: the state and the convolution's halo passed between the pieces
    "gated-deltanet-hybrid-blocked-context2-data4": (HYBRID, "blocked", ["mesh.context=2"]),
    "kda-hybrid-flash-context4-data2": (KDA, "flash", ["mesh.context=4"]),
}
_reference: dict[str, tuple] = {}


def _loss_and_grads(cfg, devices=None):
    """The train loss and its parameter gradients on a batch of packed rows: two documents a row at
    random cuts (crossing the chunks' boundaries) and 3 padding tokens at its end."""
    md = ModelDef(cfg, 259)
    params = md.init_params(0)
    if cfg.lora.enabled:  # every adapter's B drawn (at 0, A would get no gradient)
        keys = iter(jax.random.split(jax.random.key(1), 1000))
        params = jax.tree_util.tree_map_with_path(
            lambda p, v: 0.1 * jax.random.normal(next(keys), v.shape) if str(p[-1].key).endswith("_lora_b") else v,
            params)
    # linear attention's decays slow (A = 0.02: a state remembers ~40 tokens, more than a row), so
    # the state passed between the pieces counts (at the default A up to 16 it is gone in a token
    # or two, and the decays' gradients are float32 noise on any device count)
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: jnp.full_like(v, np.log(0.02)) if str(p[-1].key) == "A_log" else v, params)
    rng = np.random.default_rng(0)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    tokens = jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32)
    seg = jnp.asarray(np.where(np.arange(t)[None] < rng.integers(1, t, (b, 1)), 1, 2), jnp.int32).at[:, t - 3:].set(0)
    batch = dict(tokens=tokens, targets=jnp.roll(tokens, -1, 1), segment_ids=seg, positions=document_positions(seg),
                 loss_weight=(seg > 0).astype(jnp.float32))
    f = jax.jit(jax.grad(lambda p: loss_fn(md, p, batch, None, None), has_aux=True))
    if devices is None:
        return f(params)
    with jax.set_mesh(make_mesh(cfg, devices)):
        return f(params)


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_step_equals_whole_rows(case, small_config, devices):
    """Loss (cross-entropy; with MTP its loss in the total) and every parameter gradient with the
    rows split over 2 or 4 context devices (alone and beside data, fsdp and expert axes) equal those
    of whole rows on one device, capacity factor 8 (nothing drops): 1e-5 relative for the loss,
    gradients to 2e-6 of each parameter's largest."""
    arch, impl, mesh = CASES[case]
    common = ["moe.capacity_factor=8", *arch]
    key = tuple(arch)
    if key not in _reference:  # whole rows on one device, the blocked einsums
        _reference[key] = _loss_and_grads(small_config(*common, "model.attention_impl=blocked"))
    g1, (l1, *_, mtp1, max1, _) = _reference[key]
    g2, (l2, *_, mtp2, max2, _) = _loss_and_grads(small_config(*common, f"model.attention_impl={impl}", *mesh), devices)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    np.testing.assert_allclose(max2, max1, rtol=1e-5)  # each head's largest logit (QK-clip), the kernel's too
    if mtp1 is not None:
        np.testing.assert_allclose(mtp2, mtp1, rtol=1e-5)
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=2e-6 * float(np.abs(e).max()) + 1e-9,
                                   err_msg=jax.tree_util.keystr(path))


def test_balanced_order():
    """Chunks 0, 7, 1, 6, 2, 5, 3, 4 of 8 for 4 devices (each device's pair the same causal work);
    natural_order undoes it; row_index is the order's positions."""
    t, c = 16, 4
    row = jnp.arange(t)[None]
    got = np.asarray(balanced_order(row, c))[0]
    np.testing.assert_array_equal(got, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    np.testing.assert_array_equal(row_index(t, c), got)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, t, 3)))
    np.testing.assert_array_equal(natural_order(balanced_order(x, c), c), x)
    # every device's two chunks hold the same number of causal (query, key) pairs
    pairs = [(got[j * 4:(j + 1) * 4] + 1).sum() for j in range(c)]
    assert len(set(pairs)) == 1
    with pytest.raises(ValueError, match="multiple of 8"):
        balanced_order(jnp.zeros((1, 12)), 4)


def test_flash_kernel_takes_a_traced_query_offset():
    """The fused kernel's query offset as a traced value (each context device its own chunk's):
    output and gradients equal the reference with that offset as a static one, sliding window too."""
    rng = np.random.default_rng(1)
    b, t, s, h, g, d = 1, 16, 48, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, t, h, d), (b, s, g, d), (b, s, g, d)))
    seg, kseg = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32).at[:, :5].set(2)
    for offset, window in ((21, None), (32, 10)):
        def ref(q, k, v):
            return attention_reference(q, k, v, seg, kv_segment_ids_bs=kseg, q_offset=offset, window=window)

        def fused(q, k, v, o):
            return flash_attention(q, k, v, seg, kv_segment_ids_bs=kseg, dynamic_q_offset=o, window=window, block=16)

        np.testing.assert_allclose(jax.jit(fused)(q, k, v, jnp.int32(offset)), ref(q, k, v), atol=2e-6)
        ge = jax.grad(lambda *a: (ref(*a) ** 2).sum(), (0, 1, 2))(q, k, v)
        gf = jax.jit(jax.grad(lambda q, k, v, o: (fused(q, k, v, o) ** 2).sum(), (0, 1, 2)))(q, k, v, jnp.int32(offset))
        for a, e in zip(gf, ge):
            np.testing.assert_allclose(a, e, atol=2e-5)
    with pytest.raises(ValueError, match="int \\[\\] array"):
        flash_attention(q, k, v, seg, kv_segment_ids_bs=kseg, dynamic_q_offset=jnp.zeros((2,), jnp.int32))


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def test_resume_across_context_sizes(small_config, tmp_path):
    """A run checkpointed with rows split over 2 context devices resumes over 4, and its losses are
    those of an uninterrupted run of whole rows (float rounding: the sums run in another order)."""
    common = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=2",
              "moe.capacity_factor=8"]
    full, split = tmp_path / "full", tmp_path / "split"
    Trainer(small_config(*common), full, log=None, progress=False).run()
    Trainer(small_config(*common, "mesh.context=2", "train.stop_at=2"), split, log=None, progress=False).run()
    second = Trainer(small_config(*common, "mesh.context=4"), split, log=None, progress=False)
    assert dict(second.mesh.shape)["context"] == 4
    summary = second.run()
    assert summary.steps == 4 and summary.steps_this_run == 2
    np.testing.assert_allclose(_losses(split), _losses(full), rtol=2e-5)
    assert len(_losses(full)) == 4


def test_context_bad_config(small_config):
    with pytest.raises(ConfigError, match="data.seq_len=32 must be a multiple of 12"):
        small_config("mesh.context=6")
    with pytest.raises(ConfigError, match=r"pieces of data.seq_len / 16 = 2 tokens, fewer than the linear-attention "
                                          r"convolution's 3 earlier taps"):
        small_config("mesh.context=8", "model.layer_types=[linear_attention,full_attention]")
    with pytest.raises(ConfigError, match=r"mesh.context: 2 with sparse MLA \(model.index_topk=4\): the lightning "):
        small_config("mesh.context=2", *MLA, "model.index_topk=4")
    with pytest.raises(ConfigError, match="model.sequence_slices=2: use one or the other"):
        small_config("mesh.context=2", "model.sequence_slices=2")
    with pytest.raises(ConfigError, match="mesh.context: must be >= 1"):
        small_config("mesh.context=0")
    with pytest.raises(ConfigError, match="cannot fill 8 devices"):  # no room for it on this mesh
        mesh_shape(small_config("mesh.context=16"), 8)
