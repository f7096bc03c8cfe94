"""What several verbs share: the ``--cpu-devices`` help, the multi-process options of every verb
that runs a model, and the config a run's checkpoint is restored with for ``eval``, ``generate``
and ``export-hf`` (:func:`_inference_config`)."""

from __future__ import annotations

import argparse
import sys

CPU_DEVICES_HELP = ("number of virtual CPU devices (default: what the config's mesh fixes, else one, the fastest on "
                    "a small CPU; ignored on GPU)")


def _inference_config(cfg):
    """A run's config for eval/generate/export on the devices of this job: the checkpoint is
    restored onto the run's model-parallel axes (``fsdp``, ``expert``) when they fit the devices,
    else onto a plain data-parallel mesh (:func:`moefast.parallel.inference_mesh`, which says why),
    and a routing kernel these devices cannot run (``triton`` off a GPU) is replaced by ``auto``:
    every implementation computes the same routing."""
    import dataclasses

    import jax

    from moefast.parallel import inference_mesh

    mesh, note = inference_mesh(cfg, jax.device_count())
    if note and jax.process_index() == 0:
        print(note, file=sys.stderr)
    cfg = cfg.replace(mesh=mesh)
    if cfg.moe.routing_impl == "triton":
        from moefast.kernels.routing import triton as triton_kernel

        why = triton_kernel.available()
        if why:
            print(f"note: moe.routing_impl=triton cannot run here ({why.split(';')[0]}); using 'auto' "
                  "(the same routing)", file=sys.stderr)
            cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, routing_impl="auto"))
    return cfg


def _distributed_options(sub: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id``, ``--distributed-timeout``: every
    command that runs a model joins a multi-process job the same way."""
    sub.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="multi-process: address of process 0 (auto-detected under SLURM / Open MPI)")
    sub.add_argument("--num-processes", type=int, default=None, help="multi-process: number of processes")
    sub.add_argument("--process-id", type=int, default=None, help="multi-process: this process, 0-based")
    sub.add_argument("--distributed-timeout", type=int, default=300, metavar="S",
                     help="multi-process: seconds to wait for peers to join, and for a dead peer's "
                          "heartbeat before stopping with an error (default 300)")
