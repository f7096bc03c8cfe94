"""Pure array functions for MoE routing: capacity, top-k gates, slots, losses, dispatch/combine."""

from moefast.routing.core import (
    RoutingResult,
    compute_capacity,
    load_balancing_loss,
    route,
    router_z_loss,
)
from moefast.routing.dispatch import combine, combine_rows, dispatch

__all__ = [
    "RoutingResult",
    "combine",
    "combine_rows",
    "compute_capacity",
    "dispatch",
    "load_balancing_loss",
    "route",
    "router_z_loss",
]
