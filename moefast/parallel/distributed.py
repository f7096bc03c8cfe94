"""Multi-process launch through JAX's own distributed runtime (``jax.distributed``)."""

from __future__ import annotations

import hashlib
import json
import os

__all__ = ["assert_same_config", "cluster_detected", "cpu_jax_on_gpu_machine", "initialize", "nvidia_gpus",
           "slurm_local_device_ids"]


def cluster_detected() -> str | None:
    """Name of the multi-process launcher found in the environment, or ``None``.

    SLURM counts only inside an ``srun`` step of more than one task (``SLURM_STEP_NODELIST`` set,
    ``SLURM_STEP_NUM_TASKS`` > 1); Open MPI when ``OMPI_COMM_WORLD_SIZE`` > 1. JAX reads the rest of
    the job's layout from these launchers' environments.
    """
    def count(var: str) -> int:
        try:
            return int(os.environ.get(var, "1"))
        except ValueError:
            return 1

    if os.environ.get("SLURM_STEP_NODELIST") and count("SLURM_STEP_NUM_TASKS") > 1:
        return "SLURM"
    if count("OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    return None


def nvidia_gpus() -> int:
    """NVIDIA GPUs the driver exposes on this machine (``/dev/nvidiaN`` device files; 0 where there
    are none, or no ``/dev``)."""
    try:
        return len([f for f in os.listdir("/dev") if f.startswith("nvidia") and f[len("nvidia"):].isdigit()])
    except OSError:
        return 0


def cpu_jax_on_gpu_machine(backend: str) -> str | None:
    """One line saying so when this machine has NVIDIA GPUs but JAX runs on the CPU (``backend``,
    JAX's default backend) without being asked to (``JAX_PLATFORMS``), with the install command;
    ``None`` otherwise."""
    n = nvidia_gpus()
    if backend != "cpu" or not n or os.environ.get("JAX_PLATFORMS", "").strip():
        return None
    return (f"note: this machine has {n} NVIDIA GPU{'s' if n > 1 else ''} but the installed jax runs on the CPU "
            "only; to train on them: pip install -c constraints.txt -e '.[gpu]' (JAX_PLATFORMS=cpu silences this)")


def _local_gpu_count(env) -> int:
    """GPUs this process may use, without starting JAX: ``CUDA_VISIBLE_DEVICES`` (SLURM sets it for
    a step with GPUs), else ``SLURM_GPUS_ON_NODE``, else the ``/dev/nvidiaN`` device files; 0 if
    none of them says."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit():
        return int(gpus)
    return nvidia_gpus()


def slurm_local_device_ids(env=None) -> list[int] | None:
    """The GPUs a SLURM task should use when the step runs one task per node: all of the node's.

    JAX's SLURM detection sets ``local_device_ids=[SLURM_LOCALID]``, one GPU per task, which is
    right for one task per GPU but leaves a one-task-per-node job with a single GPU per node.
    Returns ``list(range(GPUs on the node))`` when ``SLURM_STEP_NUM_TASKS`` equals
    ``SLURM_STEP_NUM_NODES`` and the node has GPUs, else ``None`` (JAX's default stands).
    """
    env = os.environ if env is None else env
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS", ""), env.get("SLURM_STEP_NUM_NODES", "")
    if not (tasks.isdigit() and nodes.isdigit()) or int(tasks) != int(nodes):
        return None
    n = _local_gpu_count(env)
    return list(range(n)) if n > 0 else None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: int = 300) -> bool:
    """Joins a multi-process job when launched as one of several processes.

    With ``coordinator``/``num_processes``/``process_id`` given, uses them; otherwise lets JAX
    auto-detect the job when :func:`cluster_detected` finds a launcher (SLURM ``srun``, Open MPI
    ``mpirun``); under SLURM with one task per node, each task gets all of its node's GPUs
    (:func:`slurm_local_device_ids`), with one task per GPU the task's own. Must run before any JAX
    computation.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes: processes in the job (>= 1).
      process_id: this process, in ``[0, num_processes)``.
      timeout_s: seconds (>= 1) to wait for all processes to join, and the heartbeat timeout after
        which JAX's coordination service stops a process whose peer died (it aborts the process
        with exit code 134 and a log naming the missing task) instead of letting it hang.

    Returns:
      True when a multi-process job was joined.

    Raises:
      ValueError: only some of the explicit arguments are given, or they are out of range.
    """
    import jax

    if timeout_s < 1:
        raise ValueError(f"--distributed-timeout must be >= 1 second, got {timeout_s}")
    explicit = (coordinator, num_processes, process_id)
    if any(a is not None for a in explicit):
        if any(a is None for a in explicit):
            raise ValueError("--coordinator, --num-processes and --process-id must be given together")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--coordinator must be HOST:PORT (e.g. node-a:12355), got {coordinator!r}")
        if num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} must be in [0, --num-processes={num_processes})")
        if num_processes == 1:
            return False
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=timeout_s)
        return True
    cluster = cluster_detected()
    if cluster is None:
        return False
    local = slurm_local_device_ids() if cluster == "SLURM" else None
    jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s,
                               **({"local_device_ids": local} if local is not None else {}))
    return True


def assert_same_config(config: dict) -> None:
    """Checks that every process of a multi-process job runs the same config (a mismatch would
    deadlock the collectives later, e.g. processes stopping at different steps).

    Raises:
      ValueError: the processes' configs differ (on every process).
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).digest()[:8]
    mine = np.frombuffer(digest, np.int32)
    try:
        multihost_utils.assert_equal(mine, "config differs")
    except AssertionError:
        raise ValueError(f"process {jax.process_index()}: the {jax.process_count()} processes were started with "
                         "different configs or overrides; start every process with the same config file and "
                         "section.key=value overrides") from None
