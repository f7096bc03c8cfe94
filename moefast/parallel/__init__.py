"""Meshes, logical-axis sharding rules, expert parallelism and multi-process launch."""

from moefast.parallel.expert import MoEStats, expert_ffn, moe_ffn
from moefast.parallel.mesh import (
    BATCH_AXES,
    LOGICAL_RULES,
    MESH_AXES,
    batch_spec,
    inference_mesh,
    logical_to_spec,
    make_mesh,
    mesh_shape,
    optimizer_spec,
    param_specs,
    platform,
    shardings,
    state_spec,
)

__all__ = ["BATCH_AXES", "LOGICAL_RULES", "MESH_AXES", "MoEStats", "batch_spec", "expert_ffn", "inference_mesh",
           "logical_to_spec", "make_mesh", "mesh_shape", "moe_ffn", "optimizer_spec", "param_specs",
           "platform", "shardings", "state_spec"]
