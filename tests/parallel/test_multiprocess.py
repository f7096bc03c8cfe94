"""Multi-process training on localhost (2 processes × 4 CPU devices, gloo collectives) and
restoring checkpoints onto other meshes and device counts."""

import json
import socket
import subprocess
import sys
import time

import jax
import numpy as np

from conftest import subprocess_env
from moefast.train import Checkpointer, Trainer

# train.peak_tflops given: no CPU matmul probe at each start (MFU is not checked here)
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16", "model.d_ff=32",
         "model.max_seq_len=64", "moe.num_experts=8", "data.seq_len=32", "data.batch_size=8",
         "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
         "train.eval_batches=1", "train.peak_tflops=1.0"]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different free ports (their sockets are bound together, so never the same one twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(run_dir, *extra, cpu_devices=8, process=None, port=None, timeout_s=30):
    args = [sys.executable, "-m", "moefast", "train", "--run-dir", str(run_dir), "--no-progress",
            "--cpu-devices", str(cpu_devices), *SMALL, *extra]
    if process is not None:
        args += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process),
                 "--distributed-timeout", str(timeout_s)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())


def losses(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "train"]


def test_two_processes_match_one_process(tmp_path, text_dir):
    # The one-process run and the two-process one are independent: they run side by side (the
    # processes' start-up and collective waits overlap).
    common = [f"data.source={text_dir}", "train.steps=3", "mesh.expert=2"]
    single = launch(tmp_path / "single", *common)
    port = free_port()
    procs = [launch(tmp_path / "multi", *common, cpu_devices=4, process=i, port=port) for i in range(2)]
    out, err = single.communicate(timeout=240)
    assert single.returncode == 0, err
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    assert "done:" in results[0][0] and "done:" not in results[1][0]  # process 0 logs
    assert "mesh {'data': 4, 'fsdp': 1, 'expert': 2} on 8 cpu device(s)" in results[0][0]
    np.testing.assert_allclose(losses(tmp_path / "multi"), losses(tmp_path / "single"), rtol=1e-5)
    assert (tmp_path / "multi" / "checkpoints" / "3").is_dir()

    # generate and export-hf join the job too, on the run's expert axis: the same text and tensors
    # as one process with all 8 devices
    def run(cmd, *extra, cpu_devices=8, process=None, port=None):
        args = [sys.executable, "-m", "moefast", *cmd, "--run-dir", str(tmp_path / "multi"),
                "--cpu-devices", str(cpu_devices), *extra]
        if process is not None:
            args += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process)]
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())

    # All six processes side by side (each only reads the run; the exports write their own folders):
    # generate and export-hf in one process each, and as two two-process jobs on their own ports.
    gen = ["generate", "--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0"]
    ones = [run(cmd) for cmd in (gen, ["export-hf", str(tmp_path / "hf-one")])]
    pairs = [[run(cmd, cpu_devices=4, process=i, port=port) for i in range(2)]
             for cmd, port in zip((gen, ["export-hf", str(tmp_path / "hf-two")]), free_ports(2))]
    try:
        for p in ones:
            out, err = p.communicate(timeout=240)
            assert err == "" or "error" not in err, err
            if p is ones[0]:
                one_text = out
        for cmd, procs in zip(("generate", "export-hf"), pairs):
            results = [p.communicate(timeout=240) for p in procs]
            for p, (out, err) in zip(procs, results):
                assert p.returncode == 0, err
            # process 0 prints, last (gloo reports its connections on stdout first, from its own threads)
            if cmd == "generate":
                assert one_text.startswith("def ") and results[0][0].endswith(one_text) and "def " not in results[1][0]
            else:
                assert "wrote" in results[0][0] and "wrote" not in results[1][0]
    finally:  # none left behind when a check fails
        for p in [*ones, *pairs[0], *pairs[1]]:
            if p.poll() is None:
                p.kill()
    from safetensors.numpy import load_file

    one, two = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf-one", "hf-two"))
    assert one.keys() == two.keys() and all(np.array_equal(one[k], two[k]) for k in one)


def test_dead_peer_stops_the_other_process(tmp_path, text_dir):
    port = free_port()
    common = [f"data.source={text_dir}", "train.steps=100000"]
    procs = [launch(tmp_path / "run", *common, cpu_devices=4, process=i, port=port, timeout_s=5) for i in range(2)]
    try:
        deadline = time.time() + 120
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both are training
            assert time.time() < deadline, "training did not start"
            assert procs[0].poll() is None, procs[0].communicate()[1]
            time.sleep(0.1)
        procs[1].kill()
        t0 = time.time()
        _, err = procs[0].communicate(timeout=120)
        # What matters: the survivor stops on its own (no hang), with a failure exit and one of the two
        # documented reasons (docs/multihost.md, "When a process dies"): a collective in flight
        # fails at once on the closed connection (CPU: gloo aborts), or else JAX's coordination
        # service stops it once the heartbeat timeout (5 s) passes. Which comes first depends on
        # where the survivor was when the peer died, so on how busy the machine is.
        assert procs[0].returncode not in (0, None)
        assert time.time() - t0 < 60
        reasons = ("distributed service detected fatal errors", "heartbeat", "gloo::EnforceNotMet")
        assert any(r in err for r in reasons), err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_restore_onto_other_meshes_and_device_counts(tmp_path, small_config, devices):
    common = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
              "moe.num_experts=8"]
    first = Trainer(small_config(*common, "train.stop_at=2", "mesh.data=2", "mesh.expert=4"), tmp_path,
                    log=None, progress=False)
    assert first.run().steps == 2
    saved = Checkpointer(tmp_path / "checkpoints").restore(first.abstract_state(), first.cfg)
    for overrides, devs in [(["mesh.data=1", "mesh.expert=8"], devices), (["mesh.fsdp=2", "mesh.expert=2"], devices[:4])]:
        target = Trainer(small_config(*common, *overrides), tmp_path, log=None, progress=False, devices=devs)
        restored = Checkpointer(tmp_path / "checkpoints").restore(target.abstract_state(), target.cfg)
        for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(saved.state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        w_in = restored.state["params"]["blocks"][0]["ffn"]["w_in"]
        assert w_in.sharding == target.state_sharding["params"]["blocks"][0]["ffn"]["w_in"]
        assert len(w_in.sharding.device_set) == len(devs)
    # ... and training continues on 4 devices.
    last = Trainer(small_config(*common, "mesh.fsdp=2", "mesh.expert=2"), tmp_path, log=None, progress=False,
                   devices=devices[:4])
    summary = last.run()
    assert summary.steps == 4 and summary.steps_this_run == 2 and np.isfinite(summary.final_loss)


def test_optimizer_bytes_fall_as_fsdp_grows(small_config, devices):
    def shard_bytes(tree):
        return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(tree))

    sizes = {}
    for fsdp in (1, 2, 4, 8):  # from the shardings: no compile needed
        t = Trainer(small_config("mesh.data=1", f"mesh.fsdp={fsdp}"), None, log=None, progress=False,
                    devices=devices[:fsdp])
        state = t.abstract_state()
        sizes[fsdp] = (shard_bytes(state["params"]), shard_bytes(state["opt_state"]))
    par, opt = ([sizes[f][i] for f in (1, 2, 4, 8)] for i in (0, 1))
    assert opt[0] > opt[1] > opt[2] > opt[3], opt
    assert par[0] > par[1] > par[2] > par[3], par
    mem = t.memory_per_device()  # fsdp=8, compiled: the same bytes and the compiled step's arguments
    assert (mem["param_bytes"], mem["optimizer_bytes"]) == sizes[8]
    assert mem["compiled_argument_bytes"] >= mem["param_bytes"] + mem["optimizer_bytes"]


def test_processes_with_different_configs_fail_at_start(tmp_path, text_dir):
    port = free_port()
    procs = [launch(tmp_path / "run", f"data.source={text_dir}", f"train.steps={3 + i}", cpu_devices=4,
                    process=i, port=port, timeout_s=30) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 2, err[-2000:]
        assert "started with different configs or overrides" in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_sigterm_to_one_process_stops_both_at_the_same_step_with_a_checkpoint(tmp_path, text_dir):
    """JAX's preemption service (started by jax.distributed.initialize) takes SIGTERM; every process
    reaches the same sync point, saves the checkpoint cooperatively and exits 0."""
    port = free_port()
    common = [f"data.source={text_dir}", "train.steps=100000"]
    procs = [launch(tmp_path / "run", *common, cpu_devices=4, process=i, port=port) for i in range(2)]
    try:
        deadline = time.time() + 120
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.time() < deadline, "training did not start"
            assert procs[0].poll() is None, procs[0].communicate()[1]
            time.sleep(0.1)
        procs[1].terminate()  # SIGTERM to the process that does not log
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM (preemption notice) after step" in results[0][0]
    summary = [json.loads(line) for line in metrics.read_text().splitlines() if '"summary"' in line][-1]
    assert (tmp_path / "run" / "checkpoints" / str(summary["step"])).is_dir()
