"""How one Hugging Face tensor becomes one moefast parameter and back: :class:`Transform` and its
kinds (transposes, concatenations, expert stacks, row selections, conv taps), and :class:`Tensor`,
a table row (the engine's vocabulary for :mod:`moefast.interop.families`; dimension letters as
there)."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

import numpy as np

from moefast.config import ModelConfig

SubPath = tuple[str, ...]  # a parameter's sub-path in moefast's (unrolled) tree, e.g. ("attn", "qkv")


# ------------------------------------------------------------------------------------- transforms
class Transform(abc.ABC):
    """How HF tensors make one unrolled moefast parameter, in both directions.

    ``names`` are the HF names of one layer (an expert transform's still hold ``{e}``); ``sizes``
    split the parameter's last axis between ``names`` (see :meth:`Tensor.sizes`). ``read`` and
    ``write`` are exact inverses; tensors travel as float32 numpy arrays.
    """

    expert_axis = False  # the parameter's first axis is E: a device's shard reads only its experts

    @abc.abstractmethod
    def hf_shapes(self, names: tuple[str, ...], shape: tuple[int, ...],
                  sizes: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> the shape it must have to make a parameter of ``shape``."""

    @abc.abstractmethod
    def read(self, get: Callable[..., np.ndarray], names: tuple[str, ...], experts: slice | None) -> np.ndarray:
        """The parameter (only ``experts`` of its first axis for an expert transform).

        ``get(name)`` returns a tensor; ``get(name, rows)`` only ``rows`` of its first axis."""

    @abc.abstractmethod
    def write(self, value: np.ndarray, names: tuple[str, ...],
              sizes: tuple[int, ...]) -> list[tuple[str, np.ndarray]]:
        """The HF tensors of parameter ``value``."""


class Identity(Transform):
    """One HF tensor as it is (norm scales, embeddings)."""

    def hf_shapes(self, names, shape, sizes):
        return {names[0]: shape}

    def read(self, get, names, experts):
        return get(names[0])

    def write(self, value, names, sizes):
        return [(names[0], value)]


class Transposed(Transform):
    """One HF linear weight [out, in] -> [in, out]."""

    def hf_shapes(self, names, shape, sizes):
        return {names[0]: shape[::-1]}

    def read(self, get, names, experts):
        return get(names[0]).T

    def write(self, value, names, sizes):
        return [(names[0], value.T)]


class ConcatTransposed(Transform):
    """HF linear weights [size_n, in] transposed and joined: [in, sum(sizes)] (q|k|v, gate|up)."""

    def hf_shapes(self, names, shape, sizes):
        return {n: (s, shape[0]) for n, s in zip(names, sizes)}

    def read(self, get, names, experts):
        return np.concatenate([get(n).T for n in names], axis=-1)

    def write(self, value, names, sizes):
        return [(n, x.T) for n, x in zip(names, np.split(value, np.cumsum(sizes)[:-1], axis=-1))]


class Concat(Transform):
    """1-D HF tensors [size_n] joined: [sum(sizes)] (q|k|v biases)."""

    def hf_shapes(self, names, shape, sizes):
        return {n: (s,) for n, s in zip(names, sizes)}

    def read(self, get, names, experts):
        return np.concatenate([get(n) for n in names], axis=-1)

    def write(self, value, names, sizes):
        return list(zip(names, np.split(value, np.cumsum(sizes)[:-1], axis=-1)))


class PerExpert(Transform):
    """One HF linear weight per expert and name (``{e}`` in the name), each transposed, joined along
    the last axis and stacked over experts: [E, in, sum(sizes)] (gate|up [E, D, 2F], down [E, F, D])."""

    expert_axis = True

    def hf_shapes(self, names, shape, sizes):
        return {n.format(e=k): (s, shape[1]) for k in range(shape[0]) for n, s in zip(names, sizes)}

    def read(self, get, names, experts):
        return np.stack([np.concatenate([get(n.format(e=k)).T for n in names], axis=-1)
                         for k in range(experts.start, experts.stop)])

    def write(self, value, names, sizes):
        return [(n.format(e=k), x.T) for k in range(value.shape[0])
                for n, x in zip(names, np.split(value[k], np.cumsum(sizes)[:-1], axis=-1))]


class FusedExperts(Transform):
    """One HF tensor [E, out, in] holding every expert -> [E, in, out] (transformers 5's
    ``experts.gate_up_proj`` [E, 2F, D] and ``experts.down_proj`` [E, D, F])."""

    expert_axis = True

    def hf_shapes(self, names, shape, sizes):
        return {names[0]: (shape[0], shape[2], shape[1])}

    def read(self, get, names, experts):
        return get(names[0], experts).transpose(0, 2, 1)

    def write(self, value, names, sizes):
        return [(names[0], value.transpose(0, 2, 1))]


class InterleavedGateUp(Transform):
    """One HF tensor holding every expert whose last axis interleaves gate and up columns (gpt-oss's
    ``experts.gate_up_proj`` [E, D, 2F] and ``gate_up_proj_bias`` [E, 2F]: gate at even columns,
    up at odd ones, applied as ``x @ w``, not transposed) -> moefast's gate|up halves, same shape."""

    expert_axis = True

    def hf_shapes(self, names, shape, sizes):
        return {names[0]: tuple(shape)}

    def read(self, get, names, experts):
        x = get(names[0], experts)
        return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)

    def write(self, value, names, sizes):
        f = value.shape[-1] // 2
        out = np.empty_like(value)
        out[..., 0::2], out[..., 1::2] = value[..., :f], value[..., f:]
        return [(names[0], out)]


class ExpertStack(Transform):
    """One HF tensor holding every expert, used as it is ([E, ...]: gpt-oss's ``experts.down_proj``
    [E, F, D] applied as ``x @ w`` and ``down_proj_bias`` [E, D])."""

    expert_axis = True

    def hf_shapes(self, names, shape, sizes):
        return {names[0]: tuple(shape)}

    def read(self, get, names, experts):
        return get(names[0], experts)

    def write(self, value, names, sizes):
        return [(names[0], value)]


@dataclasses.dataclass(frozen=True)
class Part:
    """Some rows of an HF tensor that several parameters share, as a :class:`Transform` writes them:
    ``value`` [len(index), ...] is rows ``index`` (int [len(index)]) of a tensor of ``rows`` rows.
    The engine joins the parts of one name and writes the tensor once each row is set exactly once
    (Qwen3-Next's ``q_proj``: the query and the output gate, interleaved per head)."""

    index: np.ndarray
    value: np.ndarray
    rows: int


class RowsTransposed(Transform):
    """HF linear weights [rows_n, in] stacked by rows in ``names`` order, rows ``index`` of the stack
    taken in that order and transposed: [in, len(index)].

    ``index`` reorders rows (Qwen3-Next's Gated DeltaNet projections, grouped per key head) and may
    leave out rows of a weight that another parameter reads (Qwen3-Next's gated ``q_proj``); such a
    weight is written as :class:`Part` s. Built per model (``rows``: each name's row count).
    """

    def __init__(self, index: np.ndarray, rows: tuple[int, ...]):
        self.index, self.rows = np.asarray(index, np.int64), tuple(rows)
        self.starts = np.concatenate([[0], np.cumsum(self.rows)])

    def hf_shapes(self, names, shape, sizes):
        return {n: (r, shape[0]) for n, r in zip(names, self.rows)}

    def read(self, get, names, experts):
        return np.concatenate([get(n) for n in names], axis=0)[self.index].T

    def write(self, value, names, sizes):
        x = value.T
        out = []
        for n, r, lo in zip(names, self.rows, self.starts):
            sel = (self.index >= lo) & (self.index < lo + r)
            rows = self.index[sel] - lo
            if len(rows) == r:  # every row of this weight is here (index is a permutation of its rows)
                full = np.empty((r,) + x.shape[1:], x.dtype)
                full[rows] = x[sel]
                out.append((n, full))
            else:
                out.append((n, Part(rows, x[sel], r)))
        return out


class Conv1dTaps(Transform):
    """Depthwise ``nn.Conv1d`` weights [C_n, 1, W] -> [W, sum(C_n)], channels joined in ``names``
    order (Gated DeltaNet's one ``conv1d.weight``; Kimi Linear's ``q_conv1d | k_conv1d | v_conv1d``)."""

    def hf_shapes(self, names, shape, sizes):
        return {n: (s, 1, shape[0]) for n, s in zip(names, sizes)}

    def read(self, get, names, experts):
        return np.concatenate([get(n)[:, 0, :].T for n in names], axis=-1)

    def write(self, value, names, sizes):
        return [(n, x.T[:, None, :]) for n, x in zip(names, np.split(value, np.cumsum(sizes)[:-1], axis=-1))]


@dataclasses.dataclass(frozen=True)
class UnitAxes(Transform):
    """One HF tensor with ``lead`` leading and ``trail`` trailing axes of size 1 around moefast's
    shape (Kimi Linear's ``A_log`` [1, 1, H, 1] -> [H])."""

    lead: int = 0
    trail: int = 0

    def hf_shapes(self, names, shape, sizes):
        return {names[0]: (1,) * self.lead + tuple(shape) + (1,) * self.trail}

    def read(self, get, names, experts):
        x = get(names[0])
        return x.reshape(x.shape[self.lead:x.ndim - self.trail])

    def write(self, value, names, sizes):
        return [(names[0], value.reshape((1,) * self.lead + value.shape + (1,) * self.trail))]


IDENTITY, TRANSPOSED, CONCAT_T, CONCAT = Identity(), Transposed(), ConcatTransposed(), Concat()
PER_EXPERT, FUSED_EXPERTS, CONV1D = PerExpert(), FusedExperts(), Conv1dTaps()


def qkv_sizes(m: ModelConfig, width: int) -> tuple[int, ...]:
    """Widths of q | k | v in moefast's fused projection: (H·Hd, G·Hd, G·Hd)."""
    return (m.num_heads * m.head_dim, m.kv_heads * m.head_dim, m.kv_heads * m.head_dim)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One row of a tensor table: a moefast parameter made of HF tensors ``names`` by ``transform``.

    ``names`` are templates: ``{i}`` the layer, ``{e}`` the expert. ``split`` gives the widths of
    the parameter's last axis that each name holds (default: equal parts). ``transform`` is a
    :class:`Transform`, or a function of the model config that makes one (a transform that needs
    the heads' layout, e.g. :class:`RowsTransposed` for interleaved rows).
    """

    transform: Transform | Callable[[ModelConfig], Transform]
    names: tuple[str, ...]
    split: Callable[[ModelConfig, int], tuple[int, ...]] | None = None

    def sizes(self, m: ModelConfig, width: int) -> tuple[int, ...]:
        """Per-name widths of a parameter whose last axis is ``width`` wide."""
        return self.split(m, width) if self.split else (width // len(self.names),) * len(self.names)

    def transform_for(self, m: ModelConfig) -> Transform:
        """The row's transform for a model of config ``m``."""
        return self.transform if isinstance(self.transform, Transform) else self.transform(m)


def _t(transform: Transform, *names: str, split=None) -> Tensor:
    return Tensor(transform, names, split)
