"""The platform code is being compiled for: the devices of the mesh in context, not the host's.

A program traced under ``jax.set_mesh(mesh)`` is compiled for ``mesh``'s devices, which may differ
from JAX's default backend: compiling for compile-only H100s (``jax.experimental.topologies``) on a
CPU machine, or a CPU mesh on a GPU machine. Backend choices (interpret a Pallas kernel or compile
it, which grouped matmul to use) read :func:`target_platform` so that the same step takes its GPU
paths whenever it is compiled for GPUs.
"""

from __future__ import annotations

import jax

__all__ = ["resolve_impl", "target_compute_capability", "target_platform"]


def target_platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform of the mesh set with ``jax.set_mesh`` (read
    from its abstract mesh, so it works while tracing, inside ``jax.jit`` and ``jax.shard_map``);
    JAX's default backend when no mesh is set (the code then runs where JAX puts it)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        return device.platform
    return jax.default_backend()


def target_compute_capability() -> int | None:
    """The compute capability x 10 (90: H100/H200) of the GPUs in the mesh set with
    ``jax.set_mesh``, read from its devices (compile-only GPUs have one too); ``None`` when no
    mesh of GPUs is set (or JAX's private accessor moved). What a Triton kernel is compiled for
    when no GPU is present (jax-triton otherwise asks the local GPU)."""
    try:  # inside jax.jit only JAX's private accessor has the concrete mesh (jax 0.10.2; None if it moves)
        from jax._src.mesh import get_concrete_mesh

        mesh = get_concrete_mesh()
    except Exception:
        return None
    devices = getattr(mesh, "devices", None)
    if devices is None or not devices.size:
        return None
    cc = getattr(devices.flat[0], "compute_capability", None)
    return None if cc is None else round(float(cc) * 10)


def resolve_impl(impl: str, impls: tuple[str, ...], elsewhere: str, what: str, platform: str | None = None) -> str:
    """The implementation ``impl`` (one of ``impls``) stands for on ``platform`` (default:
    :func:`target_platform`): ``"auto"`` is ``"pallas"`` on GPU and ``elsewhere`` on other
    platforms; any other name is itself.

    Raises:
      ValueError: ``impl`` not in ``impls``, naming ``what`` (the kernel family).
    """
    if impl not in impls:
        raise ValueError(f"{what} impl={impl!r} is not one of {impls}")
    if impl == "auto":
        return "pallas" if (platform or target_platform()) == "gpu" else elsewhere
    return impl
