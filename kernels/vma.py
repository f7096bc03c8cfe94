"""Pallas calls inside ``jax.shard_map(check_vma=True)``: the mesh axes a value varies over.

Inside ``shard_map`` every value carries the manual mesh axes it varies over, and a ``pallas_call``
must declare those of its outputs. The kernels make their inputs agree (the union) and give their
outputs that type.
"""

from __future__ import annotations

import jax

__all__ = ["out_struct", "vary_together", "varying_axes"]


def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` varies inside ``jax.shard_map`` (empty outside)."""
    return frozenset(getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ()))


def vary_together(*arrays):
    """``arrays`` each cast to vary over the union of their varying axes (``jax.lax.pcast``), and
    that union."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays))

    def cast(a):
        missing = tuple(sorted(axes - varying_axes(a), key=str))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return tuple(cast(a) for a in arrays), axes


def out_struct(like, shape, dtype) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output of ``shape`` and ``dtype`` varying as ``like`` does."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is not None:
        try:
            return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
        except TypeError:  # a jax without the keyword: no varying axes to declare
            pass
    return jax.ShapeDtypeStruct(shape, dtype)
