"""Launch environments: the GPUs each SLURM task gets (simulated SLURM environments; nothing is
launched), and a GPU machine whose jax is CPU-only."""

import jax
import pytest
from jax._src import clusters  # JAX's own resolution of the launcher's environment

from moefast.parallel import distributed

TWO_NODES = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}


def _resolved(local_device_ids):
    """(processes, this process, local_device_ids) as jax.distributed.initialize resolves them."""
    _, n, pid, ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, local_device_ids,
                                                                              None, 10)
    return n, pid, ids


@pytest.fixture
def slurm(monkeypatch):
    def set_env(tasks: int, **extra):
        for k in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE"):
            monkeypatch.delenv(k, raising=False)
        env = {**TWO_NODES, "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks), **extra}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        calls = []
        monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
        return calls
    return set_env


def test_one_task_per_node_gets_every_local_gpu(slurm):
    calls = slurm(2, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert distributed.cluster_detected() == "SLURM"
    assert _resolved(None) == (2, 1, [0])  # JAX alone: one GPU per node, the bug this guards against
    assert distributed.initialize() is True
    assert _resolved(calls[0]["local_device_ids"]) == (2, 1, list(range(8)))


def test_gpu_count_from_slurm_when_cuda_visible_devices_is_unset(slurm):
    calls = slurm(2, SLURM_GPUS_ON_NODE="4")
    distributed.initialize()
    assert calls[0]["local_device_ids"] == [0, 1, 2, 3]


def test_one_task_per_gpu_keeps_jax_default(slurm):
    calls = slurm(16, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", SLURM_LOCALID="5")
    distributed.initialize()
    assert "local_device_ids" not in calls[0]
    assert _resolved(None)[2] == [5]  # the task's own GPU


def test_no_gpus_leaves_devices_to_jax(slurm, monkeypatch):
    calls = slurm(2, CUDA_VISIBLE_DEVICES="")
    distributed.initialize()
    assert "local_device_ids" not in calls[0]


def test_cpu_jax_on_a_gpu_machine_says_how_to_install(monkeypatch):
    monkeypatch.setattr(distributed, "nvidia_gpus", lambda: 8)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    line = distributed.cpu_jax_on_gpu_machine("cpu")
    assert "8 NVIDIA GPUs" in line and "pip install -c constraints.txt -e '.[gpu]'" in line and "\n" not in line
    assert distributed.cpu_jax_on_gpu_machine("gpu") is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # asked for the CPU: nothing to say
    assert distributed.cpu_jax_on_gpu_machine("cpu") is None
    monkeypatch.setattr(distributed, "nvidia_gpus", lambda: 0)
    monkeypatch.delenv("JAX_PLATFORMS")
    assert distributed.cpu_jax_on_gpu_machine("cpu") is None
