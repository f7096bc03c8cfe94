"""Where each block's parameters live with ``model.scan_layers``, and conversion between layouts.

Dimension letters: L layers, P the period of the repeating pattern, G its whole groups.

Unrolled (``scan_layers: false``), the parameters hold one entry per block,
``params["blocks"][i]`` for block i. Scanned (``scan_layers: true``), identical blocks are stacked
on a new leading axis (logical axis ``layers``, never sharded) so ``jax.lax.scan`` can run them:

* ``params["prefix"]``: the ``num_dense_layers`` leading dense blocks, stacked [num_dense_layers, ...];
* ``params["groups"][j]``: after them the blocks repeat a pattern of P kinds, a kind being the
  block's (token mixer of ``model.layer_types``, MoE or dense feed-forward): P is the shortest
  period of the kinds, e.g. ``moe_every`` (an MoE block followed by ``moe_every - 1`` dense ones)
  or 4 for Qwen3.5's three Gated DeltaNet layers and one attention layer. The
  G = (L - num_dense_layers) // P whole groups are scanned, position j of the pattern stacked
  [G, ...];
* ``params["tail"][i]``: the blocks of a last, partial group (fewer than P), unrolled.

Every other parameter (embedding, final norm, head) is the same in both layouts. Stacking only
moves numbers, so :func:`to_layout` converts a whole train state (parameters and the optimizer's
moments, abstract or concrete) either way and back exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["LayerLayout", "STACKED_KEYS", "attention_layer_names", "is_param_dict", "is_stacked_path", "layer_kinds",
           "layer_layout", "softmax_attention_layers", "to_layout"]

STACKED_KEYS = ("prefix", "groups")  # top-level parameter entries whose leaves carry a leading layers axis


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """Which blocks form each stack of the scanned layout (0-based layer indices).

    Attributes:
      prefix: the leading dense blocks (one stack; empty without them).
      groups: ``groups[j]`` = the layers at position j of the repeating pattern, one per whole group
        (each a stack of G layers; empty when no whole group fits).
      tail: the blocks of the last, partial group, unrolled.
    """

    prefix: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups[0]) if self.groups else 0


def layer_kinds(model_cfg) -> tuple[tuple[str, bool], ...]:
    """Each block's kind, (token mixer, MoE feed-forward), of a :class:`~moefast.config.ModelConfig`."""
    return tuple((model_cfg.layer_type(i), model_cfg.is_moe_layer(i)) for i in range(model_cfg.num_layers))


def softmax_attention_layers(model_cfg) -> tuple[int, ...]:
    """The block of each row of the per-layer largest attention logits
    (:attr:`~moefast.model.ModelOutput.max_logits`, the step's ``max_logit_per_layer``): the main
    stack's softmax-attention blocks in layer order (every token mixer but ``linear_attention``,
    which has no softmax; no feed-forward sublayer), then the ``mtp_depth`` multi-token prediction blocks, numbered L .. L + D - 1
    (full attention, :meth:`~moefast.config.ModelConfig.layer_type`)."""
    n = model_cfg.num_layers
    main = tuple(i for i in range(n) if model_cfg.layer_type(i) != "linear_attention"
                 and not model_cfg.is_ffn_sublayer(i))
    return main + tuple(range(n, n + model_cfg.mtp_depth))


def attention_layer_names(model_cfg) -> list[str]:
    """What each row of :func:`softmax_attention_layers` is, as logs and TensorBoard name it:
    ``"attention layer i"`` (i the block index), then ``"MTP module k"`` (k = 1 .. D)."""
    n = model_cfg.num_layers
    return [f"attention layer {i}" if i < n else f"MTP module {i - n + 1}" for i in softmax_attention_layers(model_cfg)]


def layer_layout(model_cfg) -> LayerLayout:
    """The :class:`LayerLayout` of a :class:`~moefast.config.ModelConfig`.

    Raises:
      ValueError: the leading dense blocks are not all of one token mixer (they form one stack).
    """
    nd, n = model_cfg.num_dense_layers, model_cfg.num_layers
    kinds = layer_kinds(model_cfg)
    if len(set(kinds[:nd])) > 1:
        raise ValueError(f"model.scan_layers: the model.num_dense_layers={nd} leading blocks mix token mixers "
                         f"({[k for k, _ in kinds[:nd]]}) and cannot form one stack; use model.scan_layers=false")
    rest = kinds[nd:]
    period = next((p for p in range(1, len(rest) + 1) if all(rest[i] == rest[i % p] for i in range(len(rest)))),
                  1)
    g = len(rest) // period
    groups = tuple(tuple(nd + k * period + j for k in range(g)) for j in range(period)) if g else ()
    return LayerLayout(prefix=tuple(range(nd)), groups=groups, tail=tuple(range(nd + g * period, n)))


_LAYER_KEYS = ("blocks", "prefix", "groups", "tail")


def is_param_dict(x: Any) -> bool:
    """Whether ``x`` is a model's parameter tree (pure dict) in either layout, e.g. the parameters
    themselves or an Adam moment inside the optimizer state: a whole one, or the part of one that
    trains (``lora``: the adapters' tree, holding some layers' leaves only)."""
    return isinstance(x, dict) and (("embed" in x and "final_norm" in x) or any(k in x for k in _LAYER_KEYS))


def is_stacked_path(path) -> bool:
    """Whether a key path into a parameter tree (a ``jax.tree_util`` path) is under a stack, i.e.
    its leaf has a leading ``layers`` axis."""
    return bool(path) and getattr(path[0], "key", None) in STACKED_KEYS


def _stack(leaves: list[Any]) -> Any:
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    return jnp.stack(leaves)


def _take(leaf: Any, i: int) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[i]


def _stack_blocks(blocks: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: _stack(list(xs)), *blocks)


def _take_block(stack: Any, i: int) -> Any:
    return jax.tree.map(lambda a: _take(a, i), stack)


def _scan_params(layout: LayerLayout, p: dict) -> dict:
    blocks = p.get("blocks", {})  # a trainable part (lora) may lack layers whose leaves are all frozen
    out = {k: v for k, v in p.items() if k != "blocks"}
    if layout.prefix and all(i in blocks for i in layout.prefix):
        out["prefix"] = _stack_blocks([blocks[i] for i in layout.prefix])
    groups = {j: _stack_blocks([blocks[i] for i in ids]) for j, ids in enumerate(layout.groups)
              if all(i in blocks for i in ids)}
    if groups:
        out["groups"] = groups
    tail = {j: blocks[i] for j, i in enumerate(layout.tail) if i in blocks}
    if tail:
        out["tail"] = tail
    return out


def _unroll_params(layout: LayerLayout, p: dict) -> dict:
    out = {k: v for k, v in p.items() if k not in ("prefix", "groups", "tail")}
    blocks = {}
    for k, i in enumerate(layout.prefix if "prefix" in p else ()):
        blocks[i] = _take_block(p["prefix"], k)
    for j, ids in enumerate(layout.groups):
        for k, i in enumerate(ids if j in p.get("groups", {}) else ()):
            blocks[i] = _take_block(p["groups"][j], k)
    for j, i in enumerate(layout.tail):
        if j in p.get("tail", {}):
            blocks[i] = p["tail"][j]
    if blocks:
        out["blocks"] = {i: blocks[i] for i in sorted(blocks)}
    return out


def to_layout(tree: Any, model_cfg, scanned: bool) -> Any:
    """Converts every model parameter tree inside ``tree`` (a train state, its ``params``, an
    optimizer state; arrays or ``jax.ShapeDtypeStruct`` with shardings) to the scanned
    (``scanned=True``) or unrolled layout of ``model_cfg``; trees already in it are returned as they
    are. Exact: values are only moved (stacking adds an unsharded leading axis to a sharding,
    unstacking removes it).

    Raises:
      ValueError: an unrolled parameter tree does not have ``model_cfg.num_layers`` blocks.
    """
    layout = layer_layout(model_cfg)

    def convert(x):
        if not is_param_dict(x) or not any(k in x for k in _LAYER_KEYS) or ("blocks" not in x) == scanned:
            return x
        if not scanned:
            return _unroll_params(layout, x)
        if "embed" in x and sorted(x["blocks"]) != list(range(model_cfg.num_layers)):
            raise ValueError(f"parameters hold blocks {sorted(x['blocks'])}, the model has "
                             f"model.num_layers={model_cfg.num_layers}")
        return _scan_params(layout, x)

    return jax.tree.map(convert, tree, is_leaf=is_param_dict)
