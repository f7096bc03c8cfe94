"""Multi-process launch through JAX's own distributed runtime (``jax.distributed``)."""

from __future__ import annotations

import os

__all__ = ["cluster_detected", "initialize"]

# Environment variables that JAX's cluster auto-detection reads, with the size variable that says
# whether the job has more than one process.
_CLUSTERS = {"SLURM": "SLURM_NTASKS", "Open MPI": "OMPI_COMM_WORLD_SIZE"}


def cluster_detected() -> str | None:
    """Name of the multi-process launcher found in the environment (SLURM, Open MPI, or an explicit
    ``JAX_COORDINATOR_ADDRESS``), or ``None`` for a single process."""
    for name, var in _CLUSTERS.items():
        try:
            if int(os.environ.get(var, "1")) > 1:
                return name
        except ValueError:
            continue
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: int = 300) -> bool:
    """Joins a multi-process job when launched as one of several processes.

    With ``coordinator``/``num_processes``/``process_id`` given, uses them; otherwise lets JAX
    auto-detect the cluster (SLURM, Open MPI, Kubernetes via ``JAX_COORDINATOR_ADDRESS``) when
    :func:`cluster_detected` finds one. Must run before any JAX computation.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes: processes in the job.
      process_id: this process, in ``[0, num_processes)``.
      timeout_s: seconds to wait for all processes to join, and heartbeat timeout after which a
        process whose peer died stops with an error instead of hanging.

    Returns:
      True when a multi-process job was joined.

    Raises:
      ValueError: only some of the explicit arguments are given, or they are out of range.
    """
    import jax

    explicit = (coordinator, num_processes, process_id)
    if any(a is not None for a in explicit):
        if any(a is None for a in explicit):
            raise ValueError("--coordinator, --num-processes and --process-id must be given together")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} must be in [0, --num-processes={num_processes})")
        if num_processes == 1:
            return False
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=timeout_s)
        return True
    if cluster_detected() is None:
        return False
    jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s)
    return True
