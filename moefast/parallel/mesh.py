"""Device mesh and logical-axis sharding rules.

Mesh axes (all ``AxisType.Auto``):
  * ``data``   — data parallelism: batch split; parameters and optimizer state split over it
    on a free dimension (ZeRO, :func:`optimizer_spec`), gathered in the compute dtype for use.
  * ``fsdp``   — fully-sharded data parallelism (ZeRO-3): batch split *and* parameters/optimizer
    state split along their ``embed`` dimension; gathered for use by the partitioner.
  * ``expert`` — expert parallelism: batch split, experts' weights split along ``expert``; tokens
    travel to their experts with ``all_to_all`` (see :mod:`moefast.parallel.expert`).
  * ``context`` — context parallelism: every row's tokens split along it (T, not B), in a
    load-balanced order; attention gathers the row's keys and values along it
    (:mod:`moefast.parallel.context`).

Rows are split over ``data``, ``fsdp`` and ``expert`` (:data:`BATCH_AXES`), each row's tokens over
``context``. Parameters carry logical axis names (``nnx.Param(...,
logical_axes=(...))``) which :data:`LOGICAL_RULES` maps to mesh axes; a name without a rule fails at
start. The train state (float32 parameters and optimizer moments alike) is additionally split over
``data``, ``context`` and, for parameters not split over experts, ``expert`` where a dimension allows (ZeRO;
:func:`optimizer_spec`); :mod:`moefast.parallel.precision` gathers weights in the compute dtype
where they are used and reduce-scatters their float32 gradients.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from moefast.config import ConfigError, ExperimentConfig, MeshConfig

__all__ = [
    "BATCH_AXES",
    "LOGICAL_RULES",
    "MESH_AXES",
    "batch_spec",
    "check_mesh_axes",
    "inference_mesh",
    "logical_to_spec",
    "make_mesh",
    "mesh_shape",
    "on_own_rows",
    "optimizer_spec",
    "param_specs",
    "platform",
    "reshard_for_shard_map",
    "shardings",
    "state_spec",
    "token_shards",
]

MESH_AXES = ("data", "fsdp", "expert", "context")
BATCH_AXES = ("data", "fsdp", "expert")  # rows are split over these; each row's tokens over "context"

# Logical axis name -> mesh axis (or None: replicated). One table for the whole model.
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": None,
    "embed": "fsdp",
    "heads": None,  # fused q/k/v (or attention output) features
    "lora": None,  # MLA's compressed query / key-value features (q_lora_rank, kv_lora_rank + rope)
    "mlp": None,
    "expert": "expert",
    "router": None,  # the router's expert dimension: every device routes over all experts
    "norm": None,
    "conv": None,  # the taps of Gated DeltaNet's short causal convolution
    "layers": None,  # the stacked axis of scanned blocks (model.scan_layers): never split
}


def mesh_shape(cfg: ExperimentConfig, num_devices: int) -> dict[str, int]:
    """Sizes of (data, fsdp, expert, context) from ``mesh.*`` with ``-1`` meaning "the rest"
    (never ``context``); without context parallelism (``mesh.context=1``) the three others only,
    and :func:`make_mesh` builds no ``context`` axis."

    Raises:
      ConfigError: more than one ``-1``, a product that differs from the device count, an expert
        axis that does not divide ``moe.num_experts``, or a global batch (or micro-batch,
        ``train.grad_accum_steps``) that the token axes do not divide.
    """
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    rest = [a for a, s in sizes.items() if s == -1]
    if len(rest) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1 (\"the rest\"), got {rest}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if rest:
        if num_devices % known:
            shown = {a: v for a, v in sizes.items() if a != "context" or v != 1}
            raise ConfigError(f"mesh: {shown} cannot fill {num_devices} devices ({num_devices} is not divisible by "
                              f"{known}); use sizes whose product divides the device count, or more devices "
                              "(on a CPU: --cpu-devices N)")
        sizes[rest[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        shown = [a for a in MESH_AXES if a != "context" or sizes[a] != 1]
        raise ConfigError(f"mesh: {'×'.join(shown)} = {'×'.join(str(sizes[a]) for a in shown)} = "
                          f"{math.prod(sizes.values())} must equal the {num_devices} devices; set one axis "
                          "to -1 to take the rest")
    if cfg.moe.num_experts % sizes["expert"]:
        raise ConfigError(f"mesh.expert: {sizes['expert']} does not divide moe.num_experts="
                          f"{cfg.moe.num_experts}; use a divisor of {cfg.moe.num_experts}")
    shards = math.prod(sizes[a] for a in BATCH_AXES)
    if cfg.data.batch_size % shards:
        raise ConfigError(f"data.batch_size: {cfg.data.batch_size} is not divisible by the "
                          f"{shards} batch shards (data×fsdp×expert); use a multiple of {shards}")
    m = cfg.train.grad_accum_steps
    if (cfg.data.batch_size // m) % shards:
        rows = cfg.data.batch_size // m
        raise ConfigError(f"train.grad_accum_steps: micro-batches of {cfg.data.batch_size}/{m} = "
                          f"{rows} row{'s' if rows != 1 else ''} cannot be split over the {shards} batch shards; "
                          f"use data.batch_size a multiple of {m * shards} or fewer micro-batches")
    if sizes["context"] == 1:
        del sizes["context"]
    return sizes


def inference_mesh(cfg: ExperimentConfig, num_devices: int) -> tuple[MeshConfig, str | None]:
    """The mesh on which evaluation, generation and export restore a run's parameters.

    The run's model-parallel axes (``fsdp``, ``expert``) are kept, so each device holds only its
    share of the parameters as in training and a model larger than one device can be evaluated,
    sampled and exported; ``data`` takes the rest of ``num_devices``. When those axes cannot be
    laid over ``num_devices`` (e.g. a run trained with ``mesh.expert=8`` evaluated on one device),
    the parameters are replicated on every device (data parallelism) and a note says so.

    Args:
      cfg: the run's config (its ``mesh``, ``moe.num_experts`` and ``data.batch_size``).
      num_devices: devices of this job (all processes).

    Returns:
      ``(mesh, note)``: the :class:`~moefast.config.MeshConfig` to use and ``None``, or the
      data-parallel mesh and a one-line note saying why the run's mesh was not used.
    """
    m = cfg.mesh  # context parallelism is for training's long rows: not kept (data takes its devices)
    keep = MeshConfig(data=1 if -1 in (m.fsdp, m.expert) else -1, fsdp=m.fsdp, expert=m.expert)
    try:
        mesh_shape(cfg.replace(mesh=keep), num_devices)
        return keep, None
    except ConfigError as e:
        return MeshConfig(), (f"note: the run's mesh (fsdp={m.fsdp}, expert={m.expert}) does not fit the {num_devices} "
                              f"device(s) here ({e}); every device holds the whole model (data parallelism)")


def check_mesh_axes(mesh, where: str) -> None:
    """Raises unless every axis of ``mesh`` longer than 1 is one of :data:`MESH_AXES`.

    moefast splits rows over ``data``, ``fsdp`` and ``expert``, their tokens over ``context`` and
    experts over ``expert``, and finds them by name: an axis of another name (``"dp"``, ``"ep"``) would be silently left
    unused (no expert parallelism). Axes of length 1 change nothing and are allowed.

    Args:
      mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh`` (e.g. ``jax.sharding.get_abstract_mesh()``).
      where: what is checking (the message names it).

    Raises:
      ValueError: an axis longer than 1 with another name.
    """
    if mesh.empty:
        return
    unknown = [f"{a!r} ({mesh.shape[a]})" for a in mesh.axis_names if a not in MESH_AXES and mesh.shape[a] > 1]
    if unknown:
        raise ValueError(
            f"{where}: mesh axes {', '.join(unknown)} are not among moefast's {MESH_AXES}: tokens are split over "
            "'data', 'fsdp' and 'expert' (each row's over 'context') and experts over 'expert', found by name. Name your axes so, e.g. "
            "jax.make_mesh((2, 4), ('data', 'expert')), or build the mesh with moefast.parallel.make_mesh")


def reshard_for_shard_map(args: tuple, in_specs: tuple) -> tuple:
    """``args`` as ``jax.shard_map`` over the current mesh takes them with ``in_specs``.

    Under a mesh with ``Explicit`` axes (``jax.make_mesh``'s default) an array's type carries its
    sharding and shard_map refuses an input whose sharding differs from its spec: such inputs are
    resharded (``jax.sharding.reshard``). Under ``Auto`` axes the partitioner does it: unchanged.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Explicit not in tuple(mesh.axis_types):
        return args
    return tuple(jax.tree.map(jax.sharding.reshard, a, s) for a, s in zip(args, in_specs))


def token_shards(where: str = "kernel") -> tuple[tuple[str, ...], int]:
    """The axes of the mesh set with ``jax.set_mesh`` that split the batch (those of
    :data:`BATCH_AXES` of size > 1) and their product; ``((), 1)`` without a mesh.

    Raises:
      ValueError: the mesh has another axis longer than 1 (:func:`check_mesh_axes`, naming ``where``).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    check_mesh_axes(mesh, where)
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    return axes, math.prod(mesh.shape[a] for a in axes)


def on_own_rows(fn, *arrays_b: jax.Array, where: str = "kernel"):
    """``fn(*arrays_b)`` with each device on its own rows: every array [B, ...] and every output
    split over the token axes (:func:`token_shards`) inside ``jax.shard_map``, for a per-row kernel
    (a Pallas call has no partitioning rule: left to the partitioner, every device would gather the
    whole batch around it). Without token shards: ``fn(*arrays_b)`` as it is.

    Every operand and result is split over the same axes (nothing replicated for AD to sum), and
    Pallas kernels declare their outputs without varying-axes types: ``check_vma`` stays off.

    Raises:
      ValueError: B not divisible by the token shards; see :func:`token_shards`.
    """
    axes, shards = token_shards(where)
    if shards == 1:
        return fn(*arrays_b)
    if arrays_b[0].shape[0] % shards:
        raise ValueError(f"{where}: batch {arrays_b[0].shape[0]} is not divisible by the {shards} token shards")
    specs = (P(axes),) * len(arrays_b)
    return jax.shard_map(fn, in_specs=specs, out_specs=P(axes), check_vma=False)(
        *reshard_for_shard_map(arrays_b, specs))


def make_mesh(cfg: ExperimentConfig, devices: list | None = None) -> jax.sharding.Mesh:
    """The (data, fsdp, expert) mesh over ``devices`` (default: all devices, every process), with a
    ``context`` axis after them when ``mesh.context`` > 1 (varying fastest, so a row's devices are
    neighbours: one host's NVLink)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(cfg, len(devices))
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sizes), devices=devices)


def platform(mesh: jax.sharding.Mesh) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: what ``mesh``'s devices are, so what a step over it is
    compiled for (compile-only GPU devices from ``jax.experimental.topologies`` count as ``"gpu"``,
    whatever the host's default backend). Backend choices follow this, never ``jax.default_backend()``;
    inside a trace the kernels read the same from the abstract mesh
    (:func:`moefast.kernels.platform.target_platform`)."""
    return mesh.devices.flat[0].platform


def batch_spec(mesh: jax.sharding.Mesh) -> P:
    """Leading (batch) dimension split over every token axis of ``mesh``."""
    return P(tuple(a for a in BATCH_AXES if a in mesh.axis_names))


def logical_to_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: jax.sharding.Mesh,
                    *, where: str = "parameter") -> P:
    """Maps logical axis names to a ``PartitionSpec`` through :data:`LOGICAL_RULES`.

    Raises:
      ValueError: a name has no rule, the names do not match the rank, or a dimension is not
        divisible by the mesh axis it is split over.
    """
    if len(names) != len(shape):
        raise ValueError(f"{where}: logical axes {names} do not match shape {shape}")
    spec = []
    for name, dim in zip(names, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in LOGICAL_RULES:
            raise ValueError(f"{where}: logical axis {name!r} has no mesh rule; known: {sorted(LOGICAL_RULES)} "
                             "(add it to moefast.parallel.mesh.LOGICAL_RULES)")
        axis = LOGICAL_RULES[name]
        if axis is not None and axis in mesh.axis_names and mesh.shape[axis] > 1:
            if dim % mesh.shape[axis]:
                raise ValueError(f"{where}: dimension {name!r} of size {dim} is not divisible by mesh axis "
                                 f"{axis!r} of size {mesh.shape[axis]}; change the model size or mesh.{axis}")
            spec.append(axis)
        else:
            spec.append(None)
    return P(*spec)


def param_specs(abstract_model_state: nnx.State, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Pure dict (same structure as the parameters) of ``PartitionSpec``s from ``logical_axes``.

    Raises:
      ValueError: a parameter without ``logical_axes`` metadata, or any error of
        :func:`logical_to_spec`.
    """
    def spec(path, v):
        where = "/".join(str(getattr(k, "key", k)) for k in path)
        names = v.get_metadata().get("logical_axes")
        if names is None:
            raise ValueError(f"parameter {where} has no logical_axes annotation")
        return logical_to_spec(tuple(names), v.shape, mesh, where=where)

    specs = jax.tree_util.tree_map_with_path(spec, abstract_model_state,
                                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs)


def optimizer_spec(spec: P, shape: tuple[int, ...], mesh: jax.sharding.Mesh, *, layers: bool = False) -> P:
    """A parameter's spec plus each token axis it is not split on yet (``data``, ``expert``, then ``context``)
    (ZeRO: every device keeps only its share of the master weights and optimizer moments). The axis
    joins the first dimension already split whose size allows it (in mesh order; after ``expert``
    on an experts' dimension, so each device's experts stay together), else the first free dimension
    divisible by its size; with ``layers`` (a stacked parameter of scanned blocks) never the leading
    ``layers`` axis, so each scanned layer's slice is split like the unrolled layer's. ``mesh`` may
    be abstract.

    Scalars and leaves with no such dimension keep the parameter's spec.
    """
    parts = [() if p is None else (p if isinstance(p, tuple) else (p,)) for p in spec]
    parts += [()] * (len(shape) - len(parts))
    experts = [i for i, p in enumerate(parts) if "expert" in p]  # dimensions split over experts
    used = {a for p in parts for a in p}
    ways = lambda axes: math.prod(mesh.shape[a] for a in axes)
    for axis in ("data", "expert", "context"):
        n = mesh.shape.get(axis, 1)
        if n == 1 or axis in used:
            continue
        # Join a dimension already split (one dimension split n ways reduce-scatters in one
        # collective; two split dimensions make XLA all-reduce and slice), else the first free one.
        split = [i for i, p in enumerate(parts) if p and shape[i] % (ways(p) * n) == 0]
        free = [i for i, p in enumerate(parts) if not p and shape[i] % n == 0 and not (i == 0 and layers)]
        if split or free:
            i = (split or free)[0]
            # In mesh order, so the devices of a split run in the mesh's order and XLA turns the
            # gradient's all-reduce + slice into one reduce-scatter; an experts' dimension keeps
            # "expert" first, so each device's experts stay one block.
            joined = (*parts[i], axis)
            parts[i] = joined if i in experts else tuple(a for a in MESH_AXES if a in joined)
    return P(*(None if not p else p[0] if len(p) == 1 else p for p in parts))


def state_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh, *, layers: bool = False) -> P:
    """How the train state holds a parameter with logical axes ``names``: :func:`logical_to_spec`
    plus the ZeRO split over ``data``, ``expert`` and ``context`` (:func:`optimizer_spec`). ``mesh`` may be abstract
    (``jax.sharding.get_abstract_mesh()`` inside a trace), so the model can name the sharding its
    weights arrive in; a scanned stack's per-layer slice gets its stack's spec without ``layers``."""
    return optimizer_spec(logical_to_spec(tuple(names), tuple(shape), mesh), tuple(shape), mesh, layers=layers)


def shardings(mesh: jax.sharding.Mesh, specs: Any) -> Any:
    """``NamedSharding`` tree for a tree of ``PartitionSpec``s."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
