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


_ASSEMBLE = """
import re, sys
from moefast.kernels.routing import triton as tr
ptxas = tr.cuda_ptxas([sys.argv[1]])
ptx, cubin = tr.compile_for(90, ptxas=ptxas)
print(re.search(r"\\.version (\\S+)", ptx).group(1), len(cubin), tr.ptxas_version(ptxas))
"""


@pytest.mark.parametrize("user_ptxas", [False, True], ids=["clean-env", "env-names-another-ptxas"])
def test_triton_routing_kernel_assembles_with_the_cuda12_ptxas(user_ptxas, tmp_path):
    """The Triton routing kernel compiled for sm_90 with the PTX version of the ptxas JAX's CUDA 12
    wheels assemble with (nvidia-cuda-nvcc-cu12, installed next to the compile plugin): Triton's own
    choice (PTX 9.4, from its bundled CUDA 13 ptxas) is what that ptxas rejects. Runs in a
    subprocess without the session's TRITON_* variables: TRITON_INTERPRET=1 replaces the compiler by
    the interpreter. The ptxas passed to compile_for wins over TRITON_PTXAS_BLACKWELL_PATH naming
    Triton's own (CUDA 13.4)."""
    import os
    import subprocess
    import sys

    from moefast.bench import gpu_compile

    root = gpu_compile.plugin_path()
    assert root, "the GPU compile tools are not installed next to this environment (README's test command)"
    # a clean Triton environment: a test that ran routing_blocks in this process set
    # TRITON_PTXAS_BLACKWELL_PATH (Triton's knobs write through to os.environ)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    if user_ptxas:
        import triton

        env["TRITON_PTXAS_BLACKWELL_PATH"] = type(triton.knobs.nvidia).__dict__["ptxas_blackwell"].default_path
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _ASSEMBLE, root], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, cubin_bytes, cuda = proc.stdout.split(maxsplit=2)
    assert cuda.strip() == "(12, 9)" and version == "8.8" and int(cubin_bytes) > 10_000


def test_mla_flash_attention_lowers_for_cuda(small_config, monkeypatch):
    """MLA on the fused path as a GPU step runs it (kernel compiled, not interpreted): values of
    ``v_head_dim`` (6) narrower than the 12 query/key features, each in its own block, forward and
    gradients."""
    from flax import nnx

    from moefast.model import attention, build_model

    monkeypatch.setattr(attention, "target_platform", lambda: "gpu")
    cfg = small_config("model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=12",
                       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6",
                       "model.attention_impl=flash", "model.num_layers=1", "model.num_dense_layers=1",
                       "model.dtype=bfloat16")
    graphdef, params = nnx.split(build_model(cfg, 259, seed=0))
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)

    def loss(params, tokens):
        return nnx.merge(graphdef, params)(tokens, None, jnp.ones_like(tokens)).logits.sum()

    text = _lower_for_cuda(jax.grad(loss), params, tokens)
    assert text.count(TRITON_CALL) == 3  # the forward kernel, the backward's dK/dV and dQ kernels
