"""The train step compiled for 8 compile-only H100s on this CPU machine (``moefast bench gpu-compile``).

Each compile runs the CLI in a subprocess: the CUDA PJRT plugin must be found before JAX starts,
and it lives outside site-packages (README, "Compiling for GPUs"; ``.ci/run`` installs it), so the
test process's own JAX never loads it. The figures read are those of XLA's GPU compiler: the
optimised, scheduled HLO of the step, its buffer assignment and the latency-hiding scheduler.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from moefast.bench import gpu_compile
from moefast.config import load_config
from moefast.parallel import mesh_shape, platform, xla_flags
from moefast.parallel.linear_context import state_bytes

# vocab_size 320 (the byte tokenizer's 259 rounded up to a multiple of 8, as real vocabularies are):
# the embedding's rows split over the devices
TINY = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.head_dim=32", "model.d_ff=128",
        "model.max_seq_len=128", "moe.num_experts=8", "data.seq_len=128", "data.batch_size=16",
        "model.dtype=bfloat16", "model.vocab_size=320"]


def _gpu_compile(tmp_path, name, *args, expect_rc=0):
    assert gpu_compile.plugin_path(), (
        "the CUDA PJRT plugin is not installed next to this environment; install it as README's test command "
        "does: pip install -c constraints.txt --no-deps --target .venv/gpu-compile jax-cuda12-pjrt jax-cuda12-plugin nvidia-cuda-nvcc-cu12 jax-triton")
    out = tmp_path / f"{name}.json"
    # no TRITON_INTERPRET (the session's, for the kernel tests): the compile builds jax-triton's kernels
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("TRITON_")}
    # one compilation per case (the program as compiled), except where the costing twin is tested
    args = [a for a in args if a != "--twin"] if "--twin" in args else [*args, "--no-twin"]
    proc = subprocess.run([sys.executable, "-m", "moefast", "bench", "gpu-compile", "--json", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == expect_rc, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), (tmp_path / f"{name}.md").read_text()


# name -> the compile's overrides and options (each compiled once per session, on first use)
CASES = {
    # data 2 x expert 4 with the fused routing kernel (compiled, not interpreted: the mesh is on
    # GPUs), the expert exchange in 2 chunks (moe.overlap_chunks), the GEMMs in FP8 (the Triton
    # kernels through jax-triton)
    "ep-chunks2": [*TINY, "mesh.data=2", "mesh.expert=4", "moe.routing_impl=pallas", "moe.overlap_chunks=2",
                   "model.precision=fp8"],
    # scanned, with each row's tokens split over a context axis (expert 4 x context 2): the fused
    # kernel with traced query offsets, the rows' order restored by collective permutes; a Gated
    # DeltaNet layer before the attention layer, its state passed between the pieces
    "ep-chunks2-scan-context": [*TINY, "mesh.data=1", "mesh.expert=4", "mesh.context=2", "moe.overlap_chunks=2",
                                "model.scan_layers=true", "model.layer_types=[linear_attention,full_attention]",
                                "model.linear_num_key_heads=1", "model.linear_num_value_heads=2",
                                "model.linear_key_head_dim=32", "model.linear_value_head_dim=32"],
    # data 4 x fsdp 2 on H200s: parameters and optimizer state split over both (ZeRO + FSDP), in
    # Gemma 4's architecture: a sliding layer and a full layer of 512-wide heads (the flash kernel's
    # 32-row blocks: 64 rows overflow shared memory) with keys as values and proportional RoPE, its
    # norms, a dense GeGLU MLP beside GeGLU experts with branch norms and per-expert scales
    "zero": [*TINY, "mesh.data=4", "mesh.fsdp=2", "--gpu", "h200", "model.layer_types=[sliding_attention,full_attention]",
             "model.sliding_window=64", "model.global_head_dim=512", "model.num_global_kv_heads=1",
             "model.attention_k_eq_v=true", "model.global_rope_base=1000000", "model.global_rotary_fraction=0.25",
             "model.value_norm=true", "model.attention_scale=1.0", "model.qk_norm=per_head", "model.sandwich_norm=true",
             "model.layer_scalar=true", "model.embed_scale=true", "model.final_logit_softcapping=30",
             "moe.shared_expert_d_ff=64", "moe.shared_expert_gate=false", "moe.branch_norms=true",
             "moe.per_expert_scale=true", "moe.expert_activation=gelu_tanh"],
    # dropless on 2 GPUs (2,048 routed rows each) split into 2 expert shards (the routed rows travel
    # by ragged all-to-all): the grouped GEMM kernel, in the DeepSeek-V3 architecture: MLA with
    # 192-wide query/key heads (the flash kernel's 64-row blocks: 128 rows overflow shared memory),
    # sigmoid routing limited to 2 of 4 groups, a shared expert, a dense first layer and a
    # multi-token prediction module
    "dropless-v3": [*TINY, "mesh.expert=2", "moe.capacity_factor=0", "--devices", "2", "model.attention=mla",
                    "model.q_lora_rank=32", "model.kv_lora_rank=64", "model.qk_nope_head_dim=128",
                    "model.qk_rope_head_dim=64", "model.v_head_dim=64", "moe.score_func=sigmoid", "moe.num_groups=4",
                    "moe.topk_groups=2", "moe.routed_scaling_factor=2.5", "moe.shared_expert_d_ff=64",
                    "moe.shared_expert_gate=false", "model.num_layers=3", "model.num_dense_layers=1",
                    "model.mtp_depth=1"],
    # DeepSeek-V3.2's sparse MLA (configs/tiny_deepseek_v32.yaml) on 2 GPUs: the lightning
    # indexer's top-k and the sparse attention kernels over the selected latents; its GEMMs in FP8
    # (MLA's projections, the dense MLP, routed and shared experts, MTP's eh_proj)
    "dsa": ["--config", "configs/tiny_deepseek_v32.yaml", "--devices", "2", "model.dtype=bfloat16",
            "model.precision=fp8"],
    # the shipped DeepSeek-V3 671B config at its widths with 4 layers (3 dense, 1 MoE) and its MTP
    # module, on 32 hosts x 8 H100s: the expert axis (64) spans 8 hosts; rows whole (the sequence
    # slices double the compiled layers: covered by scan-2-hosts)
    "v3-671b-4-layers": ["--config", "configs/deepseek_v3_671b.yaml", "--devices", "32x8", "model.num_layers=4",
                         "--network", "dgx-h100", "--twin", "model.sequence_slices=1"],
    # 6 scanned layers on 2 hosts x 8 GPUs in 2 sequence slices: the expert axis inside a host, the data axis between
    # hosts; XLA's while-loop double buffering runs the scan as 2 trips of 2 layers plus 2 peeled;
    # no model.vocab_size (the tokenizer's, 259, for the model FLOPs)
    "scan-2-hosts": [*[o for o in TINY if not o.startswith("model.vocab_size")], "model.num_layers=6",
                     "model.scan_layers=true", "mesh.data=2", "mesh.expert=8", "--devices", "2x8", "--network",
                     "dgx-h100", "model.sequence_slices=2"],
}
_compiled: dict[str, tuple[dict, str]] = {}


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    def get(name):
        if name not in _compiled:
            _compiled[name] = _gpu_compile(tmp_path_factory.mktemp("gpu"), name, *CASES[name])
        return _compiled[name]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_sync_and_no_state_copy(case, compiled):
    r, md = compiled(case)
    assert r["conditionals"] == 0, "the step has a conditional: XLA:GPU syncs the host for its predicate every step"
    assert r["state_copies"] == 0 and r["state_copy_bytes"] == 0
    assert "| conditionals (host-synced control flow) | 0 |" in md


def test_memory_figures_are_xla_buffer_assignment(compiled):
    for r, gib, kind in ((compiled("ep-chunks2")[0], 79.14, "NVIDIA H100 80GB HBM3"),
                         (compiled("zero")[0], 140.40, "NVIDIA H200")):
        assert r["device_kind"] == kind
        assert abs(r["device_memory_bytes"] / 2**30 - gib) < 0.01
        assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
        assert r["alias_bytes"] > 0.9 * (r["param_bytes"] + r["optimizer_bytes"])  # the state is donated
        assert r["fits"] and r["limit_bytes"] == int(0.75 * r["device_memory_bytes"])
        assert r["flops"] > 0 and r["schedule"]["total_cycles"] > 0


def _bytes(r, kind, dtype):
    return sum(c["bytes"] for c in r["collectives"] if c["kind"] == kind and c["dtype"] == dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_are_reduced_in_float32(case, compiled):
    """No reduction of bfloat16 values anywhere in the step (the compute dtype is bfloat16): the
    weight gradients' GEMMs return float32 and expert weights are summed in float32 whatever the
    chunking (moefast.parallel.precision)."""
    r, _ = compiled(case)
    reductions = [c for c in r["collectives"] if c["kind"] in ("all-reduce", "reduce-scatter")]
    assert reductions and {c["dtype"] for c in reductions} <= {"f32", "s32"}, reductions


def test_sharded_state_is_reduce_scattered_and_gathered_in_bfloat16(compiled):
    """Parameters and moments split over data and fsdp: the gradients come back to the shards by a
    float32 reduce-scatter and the weights travel as bfloat16 (float32 all-gathers only for the norm
    scales and the router, which compute in float32). The one float32 all-reduce of a gradient is
    the embedding lookup's scatter-add (320 x 64), summed whole before it joins the tied head's."""
    r, _ = compiled("zero")
    assert _bytes(r, "reduce-scatter", "f32") > 0.9 * r["param_bytes"]  # every weight gradient, as a shard
    assert _bytes(r, "all-reduce", "f32") < 320 * 64 * 4 + 4096  # that, losses and statistics
    assert _bytes(r, "all-gather", "bf16") > 10 * _bytes(r, "all-gather", "f32")


def test_backend_choices_follow_the_mesh_not_the_host(compiled):
    """The host's default backend is the CPU; the step is compiled for GPUs, so the routing kernel is
    the compiled Triton kernel (a CPU choice would interpret it, which the Trainer refuses on a mesh),
    and the overlap flags are passed to the GPU compile."""
    r, _ = compiled("ep-chunks2")
    assert r["custom_calls"].get("__gpu$xla.gpu.triton", 0) >= 1
    assert r["compiler_options"]["xla_gpu_enable_latency_hiding_scheduler"] == "True"
    kinds = {c["kind"] for c in r["collectives"]}
    assert "all-to-all" in kinds and any(c["asynchronous"] for c in r["collectives"])


def test_gpu_kernels_are_in_the_step(compiled):
    """Compiled for GPUs with every option at its default: the fused attention (forward, backward),
    the routing kernel and, dropless, the grouped GEMM whose launches do at most 10 % more than the
    real rows' work (XLA:GPU's ragged_dot would do num_experts = 8 times)."""
    for case in ("zero", "dropless-v3"):
        calls = compiled(case)[0]["custom_calls"]
        assert "kernel moe_routing" in calls and all(any(c.startswith(f"kernel moefast_flash_{k}_") for c in calls)
                                                    for k in ("forward", "dkdv", "dq")), calls
    zero = compiled("zero")[0]["custom_calls"]  # Gemma 4's layers: the sliding window, the 512-wide full heads
    assert "kernel moefast_flash_forward_q32_k32_o0_w0" in zero and "kernel moefast_flash_forward_q128_k128_o0_w64" in zero
    r = compiled("dropless-v3")[0]
    assert any(k.startswith("kernel grouped_matmul_m") for k in r["custom_calls"])
    assert any(k.startswith("kernel grouped_matmul_dw_") for k in r["custom_calls"])
    assert 1.0 <= r["grouped_flops"]["bound"] / r["grouped_flops"]["exact"] <= 1.1


def test_sparse_mla_runs_the_top_k_kernels(compiled):
    """model.index_topk compiled for GPUs: every MLA layer's attention is the top-k sparse kernel,
    forward and backward (no dense flash kernel left in the step)."""
    calls = compiled("dsa")[0]["custom_calls"]
    assert calls.get("kernel moefast_sparse_attention_fwd", 0) >= 1, calls
    assert calls.get("kernel moefast_sparse_attention_bwd", 0) >= 1, calls
    assert not any(c.startswith("kernel moefast_flash_") for c in calls), calls


def test_fp8_gemms_are_e4m3_kernels_in_the_step(compiled):
    """model.precision=fp8 on 8 H100s: every GEMM of the attention projections and the experts is a
    launch of the FP8 kernels on e4m3 operands — forward, dgrad and wgrad, 2 layers x (2 attention
    projections + 2 expert GEMMs in each of the 2 exchange chunks) = 12 each — and each GEMM's
    activation and cotangent quantized once by the one-pass quantizer (24 launches) and each weight
    once (8), costed in the replay by the rule both precisions share; the dense layers' weight
    gradients still reach the shards as float32 reduce-scatters
    (test_gradients_are_reduced_in_float32). The kernels' instructions (Hopper's e4m3 MMA):
    tests/kernels/test_fp8_matmul.py."""
    r, md = compiled("ep-chunks2")
    for kind in ("forward", "dgrad", "wgrad"):
        assert r["custom_calls"].get(f"kernel moefast_fp8_gemm_{kind} (jax-triton, f8e4m3fn x f8e4m3fn)") == 12, (
            kind, r["custom_calls"])
    assert r["custom_calls"]["kernel moefast_fp8_gemm_quantize (jax-triton, bf16 -> f8e4m3fn)"] == 24
    # each weight quantized once (2 layers x 4 weights), not once per exchange chunk
    assert r["custom_calls"]["kernel moefast_fp8_gemm_quantize_weights (jax-triton, bf16 -> f8e4m3fn)"] == 8
    assert r["custom_calls"]["triton_kernel_call"] == 68
    assert r["estimate"]["recosted"]["kernels"] >= 68
    assert "GEMM kernels at 50% of their dtype's peak" in md and "quantizer's bytes at 70% of the memory" in md
    assert any(c["kind"] == "reduce-scatter" and c["dtype"] == "f32" for c in r["collectives"])
    # DeepSeek-V3.2's architecture (4 layers and an MTP block): 5 MLA blocks x 4 projections (q_a,
    # q_b, kv_a, o; kv_b absorbed into the query and output), the dense layer's 2, 4 MoE blocks x
    # (2 routed + 2 shared) and MTP's eh_proj = 39 GEMMs, each forward, dgrad and wgrad
    calls = compiled("dsa")[0]["custom_calls"]
    for kind in ("forward", "dgrad", "wgrad"):
        assert calls.get(f"kernel moefast_fp8_gemm_{kind} (jax-triton, f8e4m3fn x f8e4m3fn)") == 39, (kind, calls)


def test_dropless_exchange_is_ragged_and_the_estimate_says_its_units(compiled):
    """Dropless with an expert axis: only the routed rows travel (ragged all-to-alls, one per
    exchange: dispatch and return, forward and backward, 3 MoE blocks: 2 layers and the MTP
    module's). XLA's speed-of-light estimator takes no module with a ragged-all-to-all and XLA
    falls back to fixed per-operation costs, so the report says its units are not comparable."""
    r, md = compiled("dropless-v3")
    ragged = [c for c in r["collectives"] if c["kind"] == "ragged-all-to-all"]
    assert ragged and sum(c["count"] for c in ragged) == 12, r["collectives"]
    assert r["estimator"] == "fixed costs" and "not comparable" in md
    assert compiled("ep-chunks2")[0]["estimator"] == "speed-of-light"


def test_expert_dispatches_overlap_compute(compiled):
    """In 2 chunks, every dispatch after a layer's first runs while the previous chunk's experts
    compute (asynchronous, compute scheduled inside), unrolled (2 layers) and scanned (the loop body
    holds two layers: XLA's while-loop double buffering); the first has nothing independent of it
    to overlap."""
    for case, forward in (("ep-chunks2", 4), ("ep-chunks2-scan-context", 4)):
        d = compiled(case)[0]["dispatches"]
        assert d["forward"] == forward and d["overlapped"] >= forward // 2, (case, d)


def test_deepseek_v3_671b_config_compiles_across_hosts(compiled):
    """The 4-layer DeepSeek-V3 on 32 x 8 H100s under the dgx-h100 network, with the config's
    hierarchical exchange, FP8 dispatch and 4 collectives in flight (rows whole): the expert axis
    (64) spans 8 hosts; the exchange's second hop stays inside a host, everything else crosses hosts; the
    dispatch moves packed e4m3 rows (uint8); XLA's speed-of-light estimate is in microseconds, on
    the costing twin, whose GEMMs XLA costs from its measured table (hundreds of TFLOP/s) where the
    program as compiled has bf16 -> f32 GEMMs costed near 12 TFLOP/s."""
    r, md = compiled("v3-671b-4-layers")
    assert (r["hosts"], r["gpus_per_host"], r["mesh"]) == (32, 8, {"data": 4, "fsdp": 1, "expert": 64})
    assert r["tokens_per_step"] == 256 * 4096 and r["custom_calls"].get("kernel moe_routing")
    e = r["estimate"]
    assert e["unit"] == "µs" and e["twin"] and r["network"] == "dgx-h100"
    assert 0 < e["exposed"] < e["step"] and e["exposed_by_tier"]["between hosts"] > 0
    assert e["bytes_by_tier"]["between hosts"] > 2**30 and e["bytes_by_tier"]["inside a host"] > 2**28
    assert any(c["kind"] == "all-to-all" and c["dtype"] == "u8" for c in r["collectives"])
    assert r["compiler_options"]["xla_gpu_experimental_parallel_collective_overlap_limit"] == "4"
    assert xla_flags.COLLECTIVE_CSE not in r["compiler_options"]  # one slice: nothing to merge
    twin = {g["kind"]: g for g in e["gemms"]}
    compiled_gemms = {g["kind"]: g for g in r["estimate_as_compiled"]["gemms"]}
    assert twin["bf16 x bf16 -> bf16"]["median_tflops"] > 500 and "bf16 x bf16 -> f32" not in twin
    assert compiled_gemms["bf16 x bf16 -> f32"]["median_tflops"] < 50
    assert r["estimate_as_compiled"]["step"] > 2 * e["step"]
    # the data axis's all-gathers (64 groups of 4, one GPU per host): XLA cannot cost them; the
    # replay re-costs every collective between hosts
    assert e["fallback"]["count"] > 0 and e["recosted"]["step"] > 0 and e["recosted"]["exposed"] > 0
    assert "replayed with the collectives between hosts re-costed" in md
    # the NIC's floor: positive, and no computation's re-costed floor-bounded length below it
    nf = e["network_floor"]
    assert 0 < nf["step"] <= nf["bounded"] and nf["bounded"] >= e["recosted"]["step"] and nf["gbps"] == 50
    assert "the NIC's floor" in md
    # the twin scheduled a second time with the replay's costs as XLA's profile (PGLE): XLA's own
    # estimate then agrees with the replay's, and the attention kernels were re-costed
    assert e["profiled"] and e["unprofiled"]["step"] > 0 and e["recosted"]["kernels"] > 0
    assert e["step"] == pytest.approx(e["recosted"]["step"], rel=0.02)
    assert "profile (PGLE)" in md
    assert "step time (estimate)" in md and "TFLOP/s per GPU (estimate" in md and "MFU (estimate" in md


def test_estimate_weights_loop_bodies_by_trip_count_and_splits_tiers(compiled):
    """6 scanned layers on 2 hosts x 8: the scan body (2 layers, double-buffered) runs 2 trips and
    counts twice in the step; the expert exchange stays inside a host, the data-parallel gradient
    reduction crosses hosts; the step is the trip-weighted sum of the scheduled computations."""
    r, md = compiled("scan-2-hosts")
    e = r["estimate"]
    # two sequence slices (model.sequence_slices) compile across hosts, their identical weight gathers
    # merged by XLA's collective CSE
    assert r["compiler_options"][xla_flags.COLLECTIVE_CSE] == str(xla_flags.COLLECTIVE_CSE_DISTANCE)
    trips = sorted(c["trips"] for c in e["computations"])
    assert max(trips) == 2 and not e["unknown_trips"], e["computations"]
    assert abs(e["step"] - sum(c["length"] * c["trips"] for c in e["computations"])) < 1e-6 * e["step"]
    assert e["bytes_by_tier"]["inside a host"] > 0 and e["bytes_by_tier"]["between hosts"] > 0
    assert not e["twin"] and "the program as compiled" in md
    assert r["estimate"]["exposed"] == pytest.approx(sum(e["exposed_by_kind"].values()))
    assert r["model_flops_per_step"] > 0


def test_replica_group_forms():
    from moefast.bench.gpu_schedule import _groups

    assert _groups("replica_groups={{0,1},{2,3}}, dimensions={0}", 4) == [[0, 1], [2, 3]]
    assert _groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups("channel_id=1", 8) is None


def test_network_option_errors(tmp_path):
    from moefast.bench.gpu_schedule import network_flag, network_options

    assert network_options("dgx-h100")["nic_speed_gbps"] == "50"
    assert network_flag("dgx-h100").startswith("--xla_gpu_analytical_latency_estimator_options=gpus_per_node=8,")
    with pytest.raises(ValueError, match="known networks"):
        network_options("infiniband")
    bad = tmp_path / "net"
    bad.write_text("nic_speed_gbps = fast\n")
    with pytest.raises(ValueError, match="line 1"):
        network_options(str(bad))


def test_cpu_mesh_stays_on_cpu_paths(devices):
    cfg = load_config(None, [])
    assert platform(jax.make_mesh((1,), ("data",), devices=devices[:1])) == "cpu"
    assert xla_flags.compile_options(True, "cpu") == {}
    opts = xla_flags.compile_options(True, "gpu")
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True and isinstance(
        opts["xla_gpu_all_gather_combine_threshold_bytes"], int)
    assert xla_flags.compile_options(False, "gpu") == {} and cfg.overlap.xla_flags
    # sequence slices: the slices' identical weight gathers merged by XLA's collective CSE
    assert xla_flags.compile_options(False, "gpu", dedupe_collectives=True) == {
        xla_flags.COLLECTIVE_CSE: xla_flags.COLLECTIVE_CSE_DISTANCE}


def test_shipped_gpu_configs_start_on_their_gpu_counts():
    assert mesh_shape(load_config("configs/h200_1b.yaml"), 1) == {"data": 1, "fsdp": 1, "expert": 1}
    assert mesh_shape(load_config("configs/h200_1b.yaml"), 8) == {"data": 8, "fsdp": 1, "expert": 1}
    assert mesh_shape(load_config("configs/mixtral_8x7b.yaml"), 8) == {"data": 1, "fsdp": 1, "expert": 8}


@pytest.mark.parametrize("devices, want", [("8", (1, 8)), ("2x8", (2, 8)), (" 4 x 8 ", (4, 8))])
def test_parse_devices(devices, want):
    assert gpu_compile.parse_devices(devices) == want


@pytest.mark.parametrize("bad", ["0", "x8", "2x0", "eight"])
def test_parse_devices_refuses(bad):
    with pytest.raises(ValueError, match="--devices"):
        gpu_compile.parse_devices(bad)


def test_missing_plugin_is_one_clear_line(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           gpu_compile.PLUGIN_ENV: str(tmp_path / "nothing-here")}
    proc = subprocess.run([sys.executable, "-m", "moefast", "bench", "gpu-compile"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA PJRT plugin" in lines[0] and "--target" in lines[0], proc.stderr


def test_a_target_file_and_a_step_that_does_not_fit(tmp_path):
    """--gpu FILE (a target description, as scripts/gpu_check.py saves one): here an H100 with
    1 MiB of memory, so the step does not fit: exit 1 with one error line naming the sizes. A file
    that is not a target description is one clear error before anything compiles."""
    small = gpu_compile.target_config("h100").replace("device_memory_size: 84978434048",
                                                      f"device_memory_size: {2**20}")
    (tmp_path / "tiny_gpu.txtpb").write_text(small)
    # no TRITON_INTERPRET (the session's, for the kernel tests): the compile builds jax-triton's kernels
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("TRITON_")}
    cmd = [sys.executable, "-m", "moefast", "bench", "gpu-compile", *TINY, "mesh.data=1", "--devices", "1"]
    proc = subprocess.run([*cmd, "--gpu", str(tmp_path / "tiny_gpu.txtpb")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 1 and "| fits / headroom | **no** /" in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the step needs") and "0.00 GiB JAX allocates" in lines[0]
    (tmp_path / "bad.txtpb").write_text("not a target\n")
    proc = subprocess.run([*cmd, "--gpu", str(tmp_path / "bad.txtpb")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --gpu {tmp_path / 'bad.txtpb'}: not a GPU target description (no gpu_device_info with a "
        "device_memory_size; see moefast/bench/gpu_targets/h100_sxm.txtpb)"]


def test_between_hosts_cost_and_replay():
    """XLA's speed-of-light formulas on a group's real shape: an all-to-all of 8 MiB per device over
    64 GPUs, 8 per host, at 50 GB/s: 56 remote peers each sent 8 MiB / 63 (transfer x 1.025, one 4 MiB
    chunk prepared, one round trip), plus the launch; a ring all-gather over 4 hosts, one GPU each.
    The replay: a done waits for its start plus the collective's latency; compute runs in order, a
    re-costed kernel for its new time. The fused attention kernels' FLOPs from the queries' shape."""
    from moefast.bench.gpu_schedule import _replay, between_hosts_us, network_options, nic_bytes
    from moefast.bench.kernel_costs import attention_kernel_flops

    net = network_options("dgx-h100")
    per_peer = 8 * 2**20 / 63
    want = 56 * (per_peer / 50e3 * 1.025 + 6 + 31) + 45
    assert between_hosts_us("all-to-all", 8 * 2**20, 64, 8, net) == pytest.approx(want)
    ring = 3 * (2**20 / 50e3 * 1.025 + 6 + 31) + 45  # 4 MiB gathered: 1 MiB per member, 3 steps
    assert between_hosts_us("all-gather", 4 * 2**20, 4, 1, net) == pytest.approx(ring)
    assert between_hosts_us("all-reduce", 4 * 2**20, 4, 1, net) == pytest.approx(2 * (ring - 45) + 45)
    # what one NIC sends: an all-to-all's rows for the 56 remote peers of 64; a ring's (n - 1) / n
    # of the data over each link, the host-crossing links spread over the 8 GPUs' NICs
    assert nic_bytes("all-to-all", 64.0, 64, 8) == 56.0
    assert nic_bytes("all-gather", 64.0, 4, 1) == 48.0 and nic_bytes("all-reduce", 64.0, 4, 1) == 96.0
    assert nic_bytes("reduce-scatter", 64.0, 64, 8) == pytest.approx(64 * 63 / 64 / 8)
    # start (1) | compute a (10) | done: ready at 1 + 25 -> waits 15 | compute b (5)
    order = [("s", 0, 1), ("a", 1, 11), ("d", 11, 12), ("b", 12, 17)]
    length, waits = _replay(order, {"s": "d"}, {"s": 25.0})
    assert (length, dict(waits)) == (1 + 10 + 15 + 1 + 5, {"s": 15.0})
    assert _replay(order, {"s": "d"}, {"s": 5.0}) == (17.0, {})
    # a kernel re-costed (a: 30 instead of 10) hides the collective: no wait, 1 + 30 + 1 + 5
    assert _replay(order, {"s": "d"}, {"s": 25.0}, {"a": 30.0}) == (37.0, {})
    # the fused causal attention: 2 B H T^2 D forward (two matmuls over the causal half), 2.5x backward
    # the flash kernels (moefast.kernels.attention): 2 B H x the (query, key) pairs their loops visit
    # (whole 64-row blocks: the second half of a row's queries sees the first half's 2,048 keys and
    # its own causal blocks, diagonal ones whole) x each matmul's width (192 runs as 256); forward
    # QK^T and PV, dK/dV 2 + 2, dQ 2 + 1
    q, k, v = "bf16[1,2048,128,192]{3,2,1,0}", "bf16[1,4096,128,192]{3,2,1,0}", "bf16[1,4096,128,128]{3,2,1,0}"
    ops = f"{q} %q, {k} %k, {v} %v, s32[1,2048]{{1,0}} %seg"
    pairs = 2.0 * 128 * 64 * 64 * sum(32 + i + 1 for i in range(32))  # query block i: 32 + i + 1 key blocks
    fwd = "jit(step)/checkpoint/moefast_flash_forward_q64_k64_o2048_w0/pallas_call"
    assert attention_kernel_flops(fwd, ops) == pairs * (256 + 128)
    assert attention_kernel_flops(fwd.replace("forward", "dq"), ops) == pairs * 640
    assert attention_kernel_flops(fwd.replace("forward", "dkdv"), ops) == pairs * 768  # the transpose: same blocks
    # a 128-key window: each 64-row query block visits 3 key blocks at most (no block wholly inside none)
    assert attention_kernel_flops(fwd.replace("w0", "w128"), ops) == 2.0 * 128 * 64 * 64 * 3 * 32 * (256 + 128)
    assert attention_kernel_flops("jit(step)/moe_routing/pallas_call", ops) == 0.0


def test_gemm_kernels_of_both_precisions_are_costed_by_one_rule():
    """The replay's rule for moefast's kernels, from their HLO lines: a GEMM kernel's 2 M K N FLOPs
    at one share of its inputs' dtype's peak (the FP8 kernels' peak twice bf16's, the bf16 grouped
    GEMM's bf16's), the quantizer's bytes read and written; other instructions 0."""
    from moefast.bench.kernel_costs import FP8_OVER_BF16, fp8_kernel_flops, gemm_kernel_peak, quantize_kernel_bytes

    fwd = ("%t = bf16[4096,1408]{1,0} custom-call(%a, %b), custom_call_target=\"triton_kernel_call\", "
           "operand_layout_constraints={s32[4,40]{1,0}, f8e4m3fn[4096,2048]{1,0}, f32[4096,16]{1,0}, "
           "f8e4m3fn[8,2048,1408]{2,1,0}, f32[8,16,11]{2,1,0}}")
    op = "jit(step)/shard_map/moefast_fp8_gemm_forward/triton_kernel_call"
    assert fp8_kernel_flops(op, fwd) == 2.0 * 4096 * 2048 * 1408 and gemm_kernel_peak(op, fwd) == FP8_OVER_BF16 == 2.0
    wgrad = ("%w = f32[8,2048,1408]{2,1,0} custom-call(%a), operand_layout_constraints={s32[16]{0}, "
             "f8e4m3fn[2048,4096]{1,0}, f32[2048,32]{1,0}, f8e4m3fn[1408,4096]{1,0}, f32[1408,32]{1,0}}")
    assert fp8_kernel_flops(op.replace("forward", "wgrad"), wgrad) == 2.0 * 2048 * 4096 * 1408
    bf16 = ("%g = bf16[4096,1408]{1,0} custom-call(%t, %x, %w), custom_call_target=\"__gpu$xla.gpu.triton\", "
            "operand_layout_constraints={s32[4,40]{1,0}, bf16[4096,2048]{1,0}, bf16[8,2048,1408]{2,1,0}}, "
            "backend_config={name = \"grouped_matmul_m128_n128_k2048\"}")
    assert fp8_kernel_flops("jit(step)/pallas_call", bf16) == 2.0 * 4096 * 2048 * 1408
    assert gemm_kernel_peak("jit(step)/pallas_call", bf16) == 1.0
    quant = ("%q = (f8e4m3fn[4096,2048]{1,0}, f32[4096,16]{1,0}, f8e4m3fn[2048,4096]{1,0}, f32[2048,32]{1,0}) "
             "custom-call(%x), operand_layout_constraints={bf16[4096,2048]{1,0}}")
    qop = "jit(step)/moefast_fp8_gemm_quantize/triton_kernel_call"
    assert quantize_kernel_bytes(qop, quant) == 4096 * 2048 * (2 + 1 + 1) + 4 * (4096 * 16 + 2048 * 32)
    assert quantize_kernel_bytes(op, quant) == 0.0 and fp8_kernel_flops(qop, quant) == 0.0


def test_network_must_be_the_one_the_process_was_prepared_with():
    """XLA reads the cluster model from XLA_FLAGS once per process: asking another one of
    gpu_compile is refused before anything is compiled."""
    with pytest.raises(ValueError, match="prepared for None"):
        gpu_compile.gpu_compile(None, [], network="dgx-h100")
    gpu_compile._NETWORK[0] = "dgx-h100"
    try:  # its GPUs per node must be the devices' per host
        with pytest.raises(ValueError, match="8 GPUs in a node, --devices 2x4 4 on a host"):
            gpu_compile.gpu_compile(None, [], network="dgx-h100", devices="2x4")
    finally:
        gpu_compile._NETWORK[0] = None


def test_context_axis_compiles_with_traced_query_offsets(compiled):
    """Rows split over a context axis of 2: the fused kernels run once per chunk with a traced
    query offset (named by its mean over the devices: 16 and 80 of 128), the rows' order is
    restored by bfloat16 collective permutes (nothing reduced in bfloat16: the float32 test above),
    and the estimate splits its exposed time by the mesh axes the collectives span."""
    r, md = compiled("ep-chunks2-scan-context")
    assert r["mesh"]["context"] == 2
    assert {f"kernel moefast_flash_{k}_o{o}_w0" for k in ("forward_q32_k128", "dq_q32_k32", "dkdv_q32_k32")
            for o in (16, 80)} <= set(r["custom_calls"]), r["custom_calls"]
    assert any(c["kind"] == "collective-permute" and c["dtype"] == "bf16" for c in r["collectives"])
    assert "by the mesh axes a collective spans" in md and r["estimate"]["exposed_by_axis"]
    # the linear layer: the Pallas kernels, forward and backward, and state-sized exchanges (each
    # device's 16 / 4 rows, value heads 2 of 32 x 32: 256 KiB whatever the row length)
    assert {"kernel gated_delta_rule", "kernel gated_delta_rule_bwd"} <= set(r["custom_calls"]), r["custom_calls"]
    x = r["context_exchange"]
    assert x["states"] == state_bytes(batch=4, heads=2, key_dim=32, value_dim=32, context=2) == 262_272, x
    taps = 2 * 4 * 2 * 3 * (2 * 32 + 2 * 32)  # 3 taps of 128 channels, a row's 2 pieces, 2 devices
    assert x["halo"] in (taps * 2 + taps // 128 * 4, taps * 4 + taps // 128 * 4), x  # bf16 or float32, int32 ids
    assert "linear attention on the context axis" in md
