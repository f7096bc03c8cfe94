"""Pure array functions for MoE routing: capacity, top-k gates, slots, losses, dispatch/combine."""

from moefast.routing.core import (
    RoutingResult,
    compute_capacity,
    load_balancing_loss,
    route,
    router_z_loss,
)
from moefast.routing.dispatch import combine, combine_onehot, combine_rows, dispatch, dispatch_onehot, onehot_masks

__all__ = [
    "RoutingResult",
    "combine",
    "combine_onehot",
    "combine_rows",
    "compute_capacity",
    "dispatch",
    "dispatch_onehot",
    "load_balancing_loss",
    "onehot_masks",
    "route",
    "router_z_loss",
]
