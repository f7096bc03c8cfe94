"""Flax NNX modules: positional tables, attention, MoE layer, transformer."""

from moefast.model.moe import MoELayer, MoEStats
from moefast.model.positional import TABLES, TableCache, apply_rope, rope_cos_sin, rope_table, sinusoidal_table
from moefast.model.transformer import ModelOutput, Transformer, build_model, init_cache, init_routing_state

__all__ = ["MoELayer", "MoEStats", "ModelOutput", "TABLES", "TableCache", "Transformer", "apply_rope",
           "build_model", "init_cache", "init_routing_state", "rope_cos_sin", "rope_table", "sinusoidal_table"]
