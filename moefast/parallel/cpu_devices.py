"""How many virtual CPU devices a process runs with (``--cpu-devices``).

JAX reads the number of CPU devices once, when it starts its first backend: :func:`set_cpu_devices`
must run before any JAX computation. The ``moefast`` command calls it right after reading the
config; a benchmark that runs a train step in a child process calls it the same way, so the step
runs on the devices ``moefast train`` would use.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_CPU_DEVICES", "set_cpu_devices"]

DEFAULT_CPU_DEVICES = 1  # the fastest on a small CPU: virtual devices are not free (docs/perf.md)


def set_cpu_devices(n: int | None, mesh_devices: int = 1) -> None:
    """Sets the number of virtual CPU devices; must run before JAX initialises its backends.

    Args:
      n: devices to create (``--cpu-devices``), or ``None``: the product of the mesh axes the
        config fixes, ``mesh_devices``, but at least :data:`DEFAULT_CPU_DEVICES`; and nothing at all
        when ``XLA_FLAGS`` already holds ``--xla_force_host_platform_device_count`` (the
        environment chose).
      mesh_devices: devices the config's mesh needs (``-1`` axes counted as 1), so
        ``moefast train mesh.expert=4`` gets 4 devices.

    Ignored by JAX on a GPU or TPU backend.
    """
    if n is None:
        if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
            return  # the environment already chose
        n = max(DEFAULT_CPU_DEVICES, mesh_devices)
    import jax

    jax.config.update("jax_num_cpu_devices", n)
