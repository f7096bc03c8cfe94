"""The platform code is being compiled for: the devices of the mesh in context, not the host's.

A program traced under ``jax.set_mesh(mesh)`` is compiled for ``mesh``'s devices, which may differ
from JAX's default backend: compiling for compile-only H100s (``jax.experimental.topologies``) on a
CPU machine, or a CPU mesh on a GPU machine. Backend choices (interpret a Pallas kernel or compile
it, which grouped matmul to use) read :func:`target_platform` so that the same step takes its GPU
paths whenever it is compiled for GPUs.
"""

from __future__ import annotations

import jax

__all__ = ["target_platform"]


def target_platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform of the mesh set with ``jax.set_mesh`` (read
    from its abstract mesh, so it works while tracing, inside ``jax.jit`` and ``jax.shard_map``);
    JAX's default backend when no mesh is set (the code then runs where JAX puts it)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        return device.platform
    return jax.default_backend()
