"""Flax NNX modules: positional tables, attention, MoE layer, transformer (remat policies, scanned
layers and their parameter layout in :mod:`moefast.model.layout`)."""

from moefast.model.moe import MoELayer, MoEStats
from moefast.model.positional import TABLES, TableCache, apply_rope, rope_cos_sin, rope_table, sinusoidal_table
from moefast.model.transformer import (MINIMAL_SAVED, REMAT_POLICIES, ModelOutput, Transformer, build_model, init_cache,
                                       init_routing_state)
from moefast.model.transformer import MTPModule

__all__ = ["MINIMAL_SAVED", "MoELayer", "MoEStats", "ModelOutput", "REMAT_POLICIES", "TABLES", "TableCache", "Transformer", "apply_rope",
           "build_model", "init_cache", "init_routing_state", "rope_cos_sin", "rope_table", "sinusoidal_table",
           "MTPModule"]
