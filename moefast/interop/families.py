"""The Hugging Face model families moefast reads and writes, one :class:`FamilySpec` each.

Everything that differs between families lives here: the ``model_type`` and architecture class,
the ``config.json`` keys that vary (and the values transformers assumes when they are absent), which
layers are MoE, and the table of HF tensor names with the transform that turns each into a moefast
parameter. :mod:`moefast.interop.hf` is the generic engine (reading safetensors into shardings,
shape checks, writing) and never names a family.

To add a family:

1. Write one ``FamilySpec(...)`` below and add it to :data:`REGISTRY` under its ``model_type``.
   Start from the closest existing entry: reuse the tensor tables (``_ATTENTION`` or ``_MLA``,
   ``_DENSE_MLP``, ``_moe_tables(...)``, ``_GLOBAL``) and change only the names or keys that differ.
   Routing keys (``scoring_func``, ``topk_method``, ``n_group``, ``routed_scaling_factor``, the
   selection bias) are one :class:`Router`; shared experts one :class:`SharedExpert`; a family that
   is another's architecture under its own ``model_type`` is a ``dataclasses.replace`` of it
   (Kimi K2, GLM-4.7-Flash). Hybrid families (Gated DeltaNet and full attention per
   ``layer_types``: Qwen3-Next, Qwen3.5-MoE) add a :class:`LayerTypes` and a ``linear_tensors`` table
   for their linear-attention layers; a vision-language checkpoint whose language model moefast reads
   names its ``text_config_key``, the prefix of its tensors (``_prefixed``) and the parts it skips.
2. Only if one of its tensors is not a transpose, a concatenation or an expert stack of HF tensors,
   write a new :class:`Transform` subclass (``hf_shapes``, ``read``, ``write``, exact inverses; a
   row that needs the model's head layout gives a function of the config that builds it, and
   :class:`RowsTransposed` already reorders or picks rows, writing a tensor that several parameters
   share as :class:`Part` s);
   only if its config.json places MoE layers another way, a layer-pattern class like
   :class:`MlpOnlyLayers` or :class:`FirstKDense` (``moe_layers``, ``to_hf``, ``problem``).
3. Add the family to ``tests/interop/test_hf.py``'s tiny transformers models: logits, chosen experts
   and the exact round trip are then checked like the others'.

When several families represent a model, :func:`moefast.interop.hf.hf_family` picks the first in
:data:`REGISTRY` order.

Dimension letters: D d_model, H query heads, G key/value heads, Hd head_dim, F d_ff (of the routed
experts), E experts; MLA: Q q_lora_rank, C kv_lora_rank, N qk_nope_head_dim, R qk_rope_head_dim,
Hv v_head_dim. Gated DeltaNet (as :mod:`moefast.model.gated_deltanet`): Hk key heads, Hv value
heads (r = Hv / Hk per key head), K and V their widths, W the conv width, C = 2·Hk·K + Hv·V conv
channels. moefast's linear weights are [in, out]; HF's are [out, in].
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from moefast.config import ExperimentConfig, ModelConfig

__all__ = ["LINEAR_KEYS", "REGISTRY", "AllMoE", "BiasKey", "FamilySpec", "FirstKDense", "LayerTypes", "MlpLayerTypes",
           "MlpOnlyLayers", "Part", "Router", "RowsTransposed", "SharedExpert", "Tensor", "Transform"]

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
    """A depthwise ``nn.Conv1d`` weight [C, 1, W] -> [W, C] (Gated DeltaNet's ``conv1d.weight``)."""

    def hf_shapes(self, names, shape, sizes):
        return {names[0]: (shape[1], 1, shape[0])}

    def read(self, get, names, experts):
        return get(names[0])[:, 0, :].T

    def write(self, value, names, sizes):
        return [(names[0], value.T[:, None, :])]


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


# ------------------------------------------------------------------------------------ config keys
@dataclasses.dataclass(frozen=True)
class AllMoE:
    """Every layer is MoE (Mixtral, OLMoE); nothing to write in config.json."""

    allows_dense = False
    keys: tuple[str, ...] = ()

    def moe_layers(self, hf: Mapping[str, Any], num_layers: int) -> list[bool]:
        return [True] * num_layers

    def to_hf(self, dense: list[int], num_layers: int) -> dict[str, Any]:
        return {}

    def problem(self, m: ModelConfig, name: str) -> str | None:
        """Why the family cannot place ``m``'s MoE layers (None: it can)."""
        if not all(m.is_moe_layer(i) for i in range(m.num_layers)):
            return f"dense layers ({name} is MoE in every layer)"
        return None


@dataclasses.dataclass(frozen=True)
class MlpOnlyLayers:
    """Layers listed in ``mlp_only_layers`` are dense, the others MoE where ``(i + 1) %
    decoder_sparse_step == 0`` (Qwen-MoE)."""

    allows_dense = True
    keys: tuple[str, ...] = ("mlp_only_layers", "decoder_sparse_step")

    def moe_layers(self, hf: Mapping[str, Any], num_layers: int) -> list[bool]:
        only = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step") or 1
        return [i not in only and (i + 1) % step == 0 for i in range(num_layers)]

    def to_hf(self, dense: list[int], num_layers: int) -> dict[str, Any]:
        return {"decoder_sparse_step": 1, "mlp_only_layers": dense}

    def problem(self, m: ModelConfig, name: str) -> str | None:
        return None  # any set of dense layers can be listed


@dataclasses.dataclass(frozen=True)
class FirstKDense:
    """The first ``first_k_dense_replace`` layers are dense (of width ``intermediate_size``), every
    later one MoE (DeepSeek-V2/V3, GLM-4.5; moefast ``model.num_dense_layers`` with ``moe_every``
    1). ``default``: transformers' value when the key is absent or null."""

    default: int = 0
    key: str = "first_k_dense_replace"
    allows_dense = True

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def moe_layers(self, hf: Mapping[str, Any], num_layers: int) -> list[bool]:
        k = hf.get(self.key)
        k = self.default if k is None else k
        return [i >= k for i in range(num_layers)]

    def to_hf(self, dense: list[int], num_layers: int) -> dict[str, Any]:
        return {self.key: len(dense)}

    def problem(self, m: ModelConfig, name: str) -> str | None:
        if any(not m.is_moe_layer(i) for i in range(m.num_dense_layers, m.num_layers)):
            return (f"dense layers after the first MoE layer (model.moe_every={m.moe_every}; {name}'s dense layers "
                    f"are the first {self.key} ones)")
        return None


@dataclasses.dataclass(frozen=True)
class BiasKey:
    """The config.json key that switches attention biases on: ``covers`` is moefast's
    ``model.attention_bias`` when it is true (``"qkv"`` or ``"all"``), ``default`` its value when absent."""

    key: str
    covers: Literal["qkv", "all"]
    default: bool = False


@dataclasses.dataclass(frozen=True)
class SharedExpert:
    """A family's shared expert (moefast ``moe.shared_expert_d_ff``, ``moe.shared_expert_gate``).

    Attributes:
      ff_key: config.json key of its width (Qwen2-MoE's ``shared_expert_intermediate_size``) or,
        with ``count_key``, of one shared expert's width.
      gated: scaled by a sigmoid gate (moefast ``moe.shared_expert_gate``).
      count_key: config.json key of the number of shared experts, which act as one expert of
        ``count * ff_key`` width (DeepSeek/GLM ``n_shared_experts`` × ``moe_intermediate_size``:
        their gate|up|down rows are concatenated in HF's one ``shared_experts`` MLP); None: one.
    """

    ff_key: str
    gated: bool = True
    count_key: str | None = None


@dataclasses.dataclass(frozen=True)
class Router:
    """How a family's router scores and chooses experts, and which config.json keys say so.

    The default is the softmax top-k of Mixtral, Qwen and OLMoE, with no keys of its own.

    Attributes:
      score_func: the scores the family's HF code computes (moefast ``moe.score_func``); a
        config.json ``scoring_func`` (DeepSeek's remote-code key) must name it.
      topk_methods: the ``topk_method`` values the family accepts -> whether ``n_group`` /
        ``topk_group`` limit the choice (moefast ``moe.num_groups`` / ``moe.topk_groups``):
        ``noaux_tc`` and ``group_limited_greedy`` do, ``greedy`` does not; empty: the family has
        no group keys.
      default_method: ``topk_method`` when config.json has none (what the family's HF code does).
      write_method: export writes ``scoring_func`` and ``topk_method`` (the families whose HF
        config has them).
      scaling_key: config.json key of moefast ``moe.routed_scaling_factor``; None: never scaled.
      selection_bias: HF name (``{i}``: the layer) of each MoE layer's selection-bias buffer [E]
        float32 (``e_score_correction_bias``, DeepSeek-V3 sec. 2.1.2), added to the scores for
        choosing experts only; moefast keeps it in the routing state (``routing["bias"]`` row j
        for the j-th MoE layer), never in the parameters. None: the family has none.
    """

    score_func: Literal["softmax", "sigmoid"] = "softmax"
    topk_methods: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    default_method: str | None = None
    write_method: bool = False
    scaling_key: str | None = None
    selection_bias: str | None = None

    def method(self, limited: bool) -> str | None:
        """The ``topk_method`` that computes moefast's routing: one with group limits if
        ``limited``, else the default."""
        if limited and not self.topk_methods.get(self.default_method, False):
            return next(m for m, groups in self.topk_methods.items() if groups)
        return self.default_method


@dataclasses.dataclass(frozen=True)
class MlpLayerTypes:
    """``mlp_layer_types`` lists ``"dense"`` or ``"sparse"`` per layer (GLM-4.7-Flash); absent: the
    first layer dense, the others MoE, as transformers assumes."""

    key: str = "mlp_layer_types"
    allows_dense = True

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def moe_layers(self, hf: Mapping[str, Any], num_layers: int) -> list[bool]:
        """Raises ValueError: the list's length is not ``num_layers`` or an entry is neither
        ``"dense"`` nor ``"sparse"``."""
        types = hf.get(self.key) or ["dense"] + ["sparse"] * (num_layers - 1)
        other = sorted({repr(t) for t in types if t not in ("dense", "sparse")})
        if len(types) != num_layers or other:
            raise ValueError(f"{len(types)} entries for num_hidden_layers={num_layers}"
                             + (f", with {', '.join(other)}" if other else "")
                             + ": one per layer, each 'dense' or 'sparse'")
        return [t == "sparse" for t in types]

    def to_hf(self, dense: list[int], num_layers: int) -> dict[str, Any]:
        return {self.key: ["dense" if i in dense else "sparse" for i in range(num_layers)]}

    def problem(self, m: ModelConfig, name: str) -> str | None:
        return None  # any set of dense layers can be listed


LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")
"""config.json keys of Gated DeltaNet's shape, read into moefast's ``model.*`` keys of the same names."""


@dataclasses.dataclass(frozen=True)
class LayerTypes:
    """``layer_types`` lists each layer's token mixer, ``"full_attention"`` or ``"linear_attention"``
    (Gated DeltaNet; moefast ``model.layer_types``, HF's name). Absent or null: layer i is full
    attention where ``(i + 1) % full_attention_interval == 0`` (default 4) and linear otherwise, as
    transformers' Qwen3-Next and Qwen3.5 configs assume."""

    key: str = "layer_types"
    interval_key: str = "full_attention_interval"
    interval_default: int = 4

    def types(self, hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
        """Each layer's mixer.

        Raises:
          ValueError: the list's length is not ``num_layers``, or an entry is neither kind.
        """
        kinds = ("full_attention", "linear_attention")
        types = hf.get(self.key)
        if types is None:
            every = hf.get(self.interval_key) or self.interval_default
            return tuple("linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers))
        if not isinstance(types, (list, tuple)):
            raise ValueError(f"one entry per layer ({num_layers}), each {kinds[0]!r} or {kinds[1]!r}")
        other = sorted({repr(t) for t in types if t not in kinds})
        if len(types) != num_layers or other:
            raise ValueError(f"{len(types)} entries for num_hidden_layers={num_layers}"
                             + (f", with {', '.join(other)}" if other else "")
                             + f": one per layer, each {kinds[0]!r} or {kinds[1]!r}")
        return tuple(types)

    def to_hf(self, types: tuple[str, ...]) -> dict[str, Any]:
        return {self.key: list(types)}


# ----------------------------------------------------------------------------------------- family
@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """Everything family-specific about one HF MoE family.

    Attributes:
      model_type: config.json's ``model_type`` (the :data:`REGISTRY` key).
      architecture: the transformers class written to ``architectures``.
      name: the family's name in messages.
      hf_defaults: config.json key -> the value transformers assumes when it is absent or null
        (must hold ``rope_theta``, ``rms_norm_eps``, ``num_experts_per_tok``, and the router's
        ``scaling_key`` and the shared expert's ``count_key`` where the family has them).
      num_experts_keys: keys holding E, the first present wins (the first is written).
      expert_ff_key: key of F (moefast ``model.d_ff``).
      dense_ff_key: key of the dense layers' width (moefast ``model.dense_d_ff``); None: the family
        has no dense layers of their own width.
      moe_layers: which layers are MoE (:class:`AllMoE`, :class:`MlpOnlyLayers` or
        :class:`FirstKDense` or :class:`MlpLayerTypes`).
      attention_bias: the key switching attention biases on; None: the family has none.
      qk_norm: moefast's ``model.qk_norm`` for the family (``"none"``, ``"per_head"``, ``"full"``).
      qk_norm_key: config.json key switching the q/k norms on (GLM-4.5's ``use_qk_norm``; absent:
        off); None: the family always has ``qk_norm``.
      partial_rotary: the family's HF code rotates only ``partial_rotary_factor`` of each head
        (``rope_parameters.partial_rotary_factor``, or the top-level key; default from
        ``hf_defaults``, else 1.0): moefast ``model.partial_rotary_factor``. False: a value other
        than 1 is refused.
      router: the family's routing and its keys (:class:`Router`).
      mla: the family's attention is multi-head latent attention (moefast ``model.attention=mla``;
        ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
        ``v_head_dim`` from config.json under the same names).
      yarn: config.json's ``rope_parameters`` may hold YaRN scaling (``rope_type: yarn``,
        ``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
        ``mscale``, ``mscale_all_dim``: moefast ``model.rope_type=yarn`` etc.).
      rope_interleave: parameters whose columns hold RoPE features stored as interleaved pairs when
        config.json's ``rope_interleave`` is true (default from ``hf_defaults``): moefast sub-path ->
        the column permutation ``moefast = hf[..., perm]`` for a model config (applied once at import,
        inverted at export, which always writes ``rope_interleave: true``).
      export_as: the family a model read through this one is written as, for a ``model_type`` that
        transformers does not know (Kimi K2's ``kimi_k2``: ``"deepseek_v3"``); None: itself.
      mtp_key: config.json key of the number of multi-token-prediction layers the checkpoint keeps
        (DeepSeek's ``num_nextn_predict_layers``, after its ``num_hidden_layers``; Qwen3-Next's
        ``mtp_num_hidden_layers``): MTP module k (moefast ``params["mtp"][k - 1]``,
        :class:`moefast.model.MTPModule`) is layer ``num_hidden_layers + k - 1`` (see
        ``mtp_layer_prefix``), a decoder layer (``layer_tensors`` and the MoE table, or the dense
        one in a model without MoE layers) plus ``mtp_tensors``. None: the family has none.
      mtp_tensors: the MTP layer's own tensors besides its decoder layer (``{i}``: the layer; names
        without it are shared by all the MTP layers): moefast sub-path of ``params["mtp"][k - 1]``
        -> :class:`Tensor`.
      mtp_copies: HF names (``{i}``: the layer) of the MTP layer's copies of main-model tensors ->
        the main tensors they copy, the first one written wins (DeepSeek-V3's ``embed_tokens`` and
        ``shared_head.head``, which moefast shares with the main model): checked equal on import,
        written as copies on export.
      mtp_layer_prefix: for a family that keeps its MTP layers apart from the main stack
        (Qwen3-Next, Qwen3.5: ``mtp.layers.{i}.``), the HF name prefix of MTP layer j's decoder
        layer (``{i}``: j, from 0): MTP module k is MTP layer ``k - 1``, its table the main
        layers' (``layer_tensors`` and the MoE or dense table) with each name's layer prefix
        (``model.layers.{i}.`` or the family's own) replaced by this one, and ``mtp_tensors``
        name its own tensors. Such a layer j has layer j's kind of MLP (vLLM builds it as layer j:
        MoE unless ``mlp_only_layers`` lists j), while moefast's MTP block is MoE in a model with
        MoE layers: a model whose layer j is dense cannot carry MTP layer j. None: MTP module k is
        layer ``num_hidden_layers + k - 1`` of the main stack (DeepSeek-V3, GLM-4.5).
      mtp_max_depth: the most MTP modules the family holds exactly; None: any number. Qwen3-Next's
        and Qwen3.5's MTP layers share one ``fc``, its two norms and the final norm (vLLM's
        multi-token predictor runs layer ``step % mtp_num_hidden_layers`` with them), which every
        moefast MTP module keeps for itself: 1.
      mtp_unsupported: config.json keys that must be absent or false for the MTP layers to be read
        -> what they would switch on; export writes them false.
      norm_topk_prob_key: key of moefast ``moe.norm_topk_prob`` (absent: ``hf_defaults``' value,
        else false); None: the family's HF code always (``fixed_norm_topk_prob`` true) or never
        (false: DeepSeek-V2, whose config's ``norm_topk_prob`` is not used) renormalises the top-k gates.
      shared_expert: the family's shared expert; None: it has none.
      unsupported: keys that must be absent or null -> what they would switch on.
      export_constants: further keys written to config.json: a value, or a function of the
        :class:`~moefast.config.ExperimentConfig`.
      model_checks: ``(predicate, message)``: the model cannot be exported as this family when
        ``predicate(cfg)`` is true.
      layer_tensors: per-layer table of every layer (attention and norms): moefast sub-path of
        ``params["blocks"][i]`` -> :class:`Tensor`.
      dense_tensors: per-layer table of dense layers' MLPs.
      moe_tensors: per-layer tables of MoE layers' MLPs by on-disk expert layout (``"per_expert"``
        and, where it exists, ``"fused"``); reading picks the layout whose tensors the files hold.
      global_tensors: table of the parameters outside the layers (embedding, final norm, head).
      layer_types: the family mixes tokens per layer by full attention or Gated DeltaNet, listed in
        config.json (:class:`LayerTypes`; moefast ``model.layer_types``, the :data:`LINEAR_KEYS` under
        the same names, defaults from ``hf_defaults``); None: full attention only (a
        ``layer_types`` with another entry is refused).
      linear_tensors: per-layer table of the linear-attention layers (their norms and Gated
        DeltaNet), used for those layers instead of ``layer_tensors``.
      attention_output_gate: the family's full-attention layers gate their output (moefast
        ``model.attention_output_gate``; Qwen3-Next's ``q_proj`` holds the gate).
      zero_centered_norm: the family's RMSNorms apply ``1 + w`` (moefast ``model.zero_centered_norm``,
        which stores HF's ``w`` as the norm's ``scale``).
      text_config_key: config.json keeps the language model's keys in this sub-dict (a
        vision-language checkpoint's ``text_config``); ``model_type``, ``tie_word_embeddings`` and
        ``quantization_config`` are read from the top level, as transformers' composite model
        reads them. None: every key at the top level.
      skipped_tensors: tensor name prefix -> what those tensors are: parts of the checkpoint moefast
        does not read (a vision tower), left out with one note at import.

    A table may list parameters a model lacks (biases, q/k norms): only the model's own parameters
    are looked up, and one with no row cannot be read or written in this family.

    Raises:
      ValueError: at construction, a spec missing a required default (the :data:`LINEAR_KEYS` with
        ``layer_types``), a per-expert table, or a ``linear_tensors`` table with ``layer_types``.
    """

    model_type: str
    architecture: str
    name: str
    hf_defaults: Mapping[str, Any]
    num_experts_keys: tuple[str, ...]
    expert_ff_key: str
    layer_tensors: Mapping[SubPath, Tensor]
    dense_tensors: Mapping[SubPath, Tensor]
    moe_tensors: Mapping[str, Mapping[SubPath, Tensor]]
    global_tensors: Mapping[SubPath, Tensor]
    dense_ff_key: str | None = None
    moe_layers: AllMoE | MlpOnlyLayers | FirstKDense | MlpLayerTypes = AllMoE()
    attention_bias: BiasKey | None = None
    qk_norm: Literal["none", "per_head", "full"] = "none"
    qk_norm_key: str | None = None
    partial_rotary: bool = False
    router: Router = Router()
    mla: bool = False
    yarn: bool = False
    rope_interleave: Mapping[SubPath, Callable[[ModelConfig], np.ndarray]] = dataclasses.field(default_factory=dict)
    export_as: str | None = None
    mtp_key: str | None = None
    mtp_tensors: Mapping[SubPath, Tensor] = dataclasses.field(default_factory=dict)
    mtp_copies: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    mtp_layer_prefix: str | None = None
    mtp_max_depth: int | None = None
    mtp_unsupported: Mapping[str, str] = dataclasses.field(default_factory=dict)
    norm_topk_prob_key: str | None = "norm_topk_prob"
    fixed_norm_topk_prob: bool = True
    shared_expert: SharedExpert | None = None
    unsupported: Mapping[str, str] = dataclasses.field(default_factory=dict)
    export_constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_checks: tuple[tuple[Callable[[ExperimentConfig], bool], str], ...] = ()
    layer_types: LayerTypes | None = None
    linear_tensors: Mapping[SubPath, Tensor] = dataclasses.field(default_factory=dict)
    attention_output_gate: bool = False
    zero_centered_norm: bool = False
    text_config_key: str | None = None
    skipped_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        required = {"rope_theta", "rms_norm_eps", "num_experts_per_tok", self.router.scaling_key,
                    self.shared_expert and self.shared_expert.count_key} - {None}
        if self.layer_types is not None:
            required |= set(LINEAR_KEYS)
            if not self.linear_tensors:
                raise ValueError(f"FamilySpec {self.model_type}: layer_types needs a linear_tensors table")
        missing = required - set(self.hf_defaults)
        if missing:
            raise ValueError(f"FamilySpec {self.model_type}: hf_defaults lacks {sorted(missing)}")
        if "per_expert" not in self.moe_tensors:
            raise ValueError(f"FamilySpec {self.model_type}: moe_tensors needs a 'per_expert' table")
        if not self.num_experts_keys:
            raise ValueError(f"FamilySpec {self.model_type}: num_experts_keys is empty")
        if self.mtp_layer_prefix is not None:
            tables = [self.layer_tensors, self.dense_tensors, *self.moe_tensors.values()]
            if "{i}" not in self.mtp_layer_prefix or any("{i}." not in n for t in tables for row in t.values()
                                                         for n in row.names):
                raise ValueError(f"FamilySpec {self.model_type}: mtp_layer_prefix and every layer table's name "
                                 "need the layer '{i}'")

    def mtp_layer(self, num_layers: int, k: int) -> int:
        """The layer index (``{i}``) in the names of MTP module ``k + 1`` (k from 0) of a model of
        ``num_layers`` layers: ``k`` with ``mtp_layer_prefix``, else ``num_layers + k``."""
        return k if self.mtp_layer_prefix is not None else num_layers + k

    def mtp_name(self, name: str) -> str:
        """A main layer's HF name template (``{i}``: the layer) as an MTP layer's (its prefix
        replaced by ``mtp_layer_prefix``; the same name without one)."""
        return name if self.mtp_layer_prefix is None else self.mtp_layer_prefix + name.split("{i}.", 1)[1]

    def mtp_block_tensors(self, layout: str, moe: bool) -> dict[SubPath, Tensor]:
        """The table of an MTP layer's decoder layer (moefast ``params["mtp"][k]["block"]``):
        ``layer_tensors`` and the ``layout`` MoE table (``moe``) or the dense one, named as
        :meth:`mtp_name` makes them."""
        table = {**self.layer_tensors, **(self.moe_tensors[layout] if moe else self.dense_tensors)}
        return {sub: dataclasses.replace(row, names=tuple(map(self.mtp_name, row.names))) for sub, row in table.items()}


# ---------------------------------------------------------------------------------- tensor tables
_L = "model.layers.{i}."
_A = _L + "self_attn."
_ATTENTION = MappingProxyType({
    ("attn_norm", "scale"): _t(IDENTITY, _L + "input_layernorm.weight"),
    ("ffn_norm", "scale"): _t(IDENTITY, _L + "post_attention_layernorm.weight"),
    ("attn", "qkv"): _t(CONCAT_T, *(_A + f"{x}_proj.weight" for x in "qkv"), split=qkv_sizes),
    ("attn", "out"): _t(TRANSPOSED, _A + "o_proj.weight"),
    ("attn", "qkv_bias"): _t(CONCAT, *(_A + f"{x}_proj.bias" for x in "qkv"), split=qkv_sizes),
    ("attn", "out_bias"): _t(IDENTITY, _A + "o_proj.bias"),
    ("attn", "q_norm", "scale"): _t(IDENTITY, _A + "q_norm.weight"),
    ("attn", "k_norm", "scale"): _t(IDENTITY, _A + "k_norm.weight"),
})
_MLA = MappingProxyType({
    ("attn_norm", "scale"): _ATTENTION[("attn_norm", "scale")],
    ("ffn_norm", "scale"): _ATTENTION[("ffn_norm", "scale")],
    **{("attn", x): _t(TRANSPOSED, _A + f"{x}.weight")
       for x in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")},
    **{("attn", x, "scale"): _t(IDENTITY, _A + f"{x}.weight") for x in ("q_a_layernorm", "kv_a_layernorm")},
})
"""MLA attention (:class:`moefast.model.transformer.MLAttention`, whose parameters carry HF
DeepSeek-V3's names): q_a_proj [D, Q], q_a_layernorm [Q], q_b_proj [Q, H·(N+R)] or q_proj
[D, H·(N+R)], kv_a_proj_with_mqa [D, C+R], kv_a_layernorm [C], kv_b_proj [C, H·(N+Hv)], o_proj
[H·Hv, D], each HF weight transposed."""


def _rope_columns(heads: int, block: int, offset: int, rope: int) -> np.ndarray:
    """Column permutation of a [..., heads·block] weight whose columns ``offset : offset + rope``
    of each head's block are RoPE features stored as interleaved pairs: moefast's split-half order
    (:func:`moefast.model.positional.rope_deinterleave_permutation`), the other columns in place."""
    from moefast.model.positional import rope_deinterleave_permutation

    perm = np.arange(heads * block)
    for h in range(heads):
        at = h * block + offset
        perm[at:at + rope] = at + rope_deinterleave_permutation(rope)
    return perm


def _mla_query_rope(m: ModelConfig) -> np.ndarray:
    return _rope_columns(m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim)


def _mla_key_rope(m: ModelConfig) -> np.ndarray:
    return _rope_columns(1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank, m.qk_rope_head_dim)


_MTP = MappingProxyType({
    ("enorm", "scale"): _t(IDENTITY, _L + "enorm.weight"),
    ("hnorm", "scale"): _t(IDENTITY, _L + "hnorm.weight"),
    ("eh_proj",): _t(TRANSPOSED, _L + "eh_proj.weight"),
    ("head_norm", "scale"): _t(IDENTITY, _L + "shared_head.norm.weight"),
})
"""A multi-token-prediction layer's own tensors (DeepSeek-V3 and GLM-4.5 checkpoints, vLLM's and
transformers' ``MtpLayer`` names): enorm [D], hnorm [D], eh_proj [2D, D] (HF [D, 2D]: embedding
columns first), shared_head.norm [D] (moefast ``head_norm``)."""
_MTP_COPIES = MappingProxyType({_L + "embed_tokens.weight": ("model.embed_tokens.weight",),
                                _L + "shared_head.head.weight": ("lm_head.weight", "model.embed_tokens.weight")})

_MLA_ROPE = MappingProxyType({("attn", "q_b_proj"): _mla_query_rope, ("attn", "q_proj"): _mla_query_rope,
                              ("attn", "kv_a_proj_with_mqa"): _mla_key_rope})

_DENSE_MLP = MappingProxyType({
    ("ffn", "w_in"): _t(CONCAT_T, _L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    ("ffn", "w_out"): _t(TRANSPOSED, _L + "mlp.down_proj.weight"),
})
_GLOBAL = MappingProxyType({
    ("embed",): _t(IDENTITY, "model.embed_tokens.weight"),
    ("final_norm", "scale"): _t(IDENTITY, "model.norm.weight"),
    ("lm_head",): _t(TRANSPOSED, "lm_head.weight"),
})


def _moe_tables(moe: str = "mlp.", gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
                shared: str | None = None, shared_gate: str | None = None) -> Mapping[str, Mapping[SubPath, Tensor]]:
    """MoE-layer tables: per-expert tensors under ``model.layers.{i}.{moe}`` named ``experts.{e}.
    {gate,up,down}.weight``, or transformers 5's fused ``mlp.experts.gate_up_proj/down_proj``;
    ``shared``: the shared expert's MLP under ``model.layers.{i}.{shared}`` (Qwen2-MoE's
    ``mlp.shared_expert.``, DeepSeek/GLM's ``mlp.shared_experts.``), ``shared_gate`` its gate's
    weight name (Qwen2-MoE's ``mlp.shared_expert_gate.weight``; None: ungated)."""
    x = _L + moe + "experts.{e}."
    per_expert = {("ffn", "router"): _t(TRANSPOSED, _L + moe + "gate.weight"),
                  ("ffn", "w_in"): _t(PER_EXPERT, x + gate + ".weight", x + up + ".weight"),
                  ("ffn", "w_out"): _t(PER_EXPERT, x + down + ".weight")}
    fused = {("ffn", "router"): _t(TRANSPOSED, _L + "mlp.gate.weight"),
             ("ffn", "w_in"): _t(FUSED_EXPERTS, _L + "mlp.experts.gate_up_proj"),
             ("ffn", "w_out"): _t(FUSED_EXPERTS, _L + "mlp.experts.down_proj")}
    if shared:
        s = _L + shared
        extra = {("ffn", "shared_w_in"): _t(CONCAT_T, s + "gate_proj.weight", s + "up_proj.weight"),
                 ("ffn", "shared_w_out"): _t(TRANSPOSED, s + "down_proj.weight")}
        if shared_gate:
            extra[("ffn", "shared_gate")] = _t(TRANSPOSED, _L + shared_gate)
        per_expert, fused = {**per_expert, **extra}, {**fused, **extra}
    return MappingProxyType({"per_expert": MappingProxyType(per_expert), "fused": MappingProxyType(fused)})


def _qwen(model_type: str, architecture: str, name: str, **kw) -> FamilySpec:
    return FamilySpec(
        model_type=model_type, architecture=architecture, name=name, num_experts_keys=("num_experts",
                                                                                       "num_local_experts"),
        expert_ff_key="moe_intermediate_size", dense_ff_key="intermediate_size", moe_layers=MlpOnlyLayers(),
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        export_constants=MappingProxyType({"use_sliding_window": False, "sliding_window": None,
                                           "max_window_layers": lambda cfg: cfg.model.num_layers}), **kw)


# ------------------------------------------------------------------ hybrid layers (Qwen3-Next, Qwen3.5)
def _gated_query_rows(m: ModelConfig) -> np.ndarray:
    """Rows of a gated ``q_proj`` [H·2·Hd, D] that hold the query: head h's block of 2·Hd rows is its
    query (Hd) then its output gate (Hd), as transformers' ``view(..., H, 2·Hd)`` + ``chunk(2)``
    splits it (``Qwen3NextAttention.forward``)."""
    hd = m.head_dim
    return (np.arange(m.num_heads)[:, None] * 2 * hd + np.arange(hd)[None]).ravel()


def _gated_qkv(m: ModelConfig) -> RowsTransposed:
    """moefast ``qkv`` [D, (H + 2G)·Hd] from q_proj's query rows, k_proj and v_proj."""
    q, kv = m.num_heads * m.head_dim, m.kv_heads * m.head_dim
    return RowsTransposed(np.concatenate([_gated_query_rows(m), 2 * q + np.arange(2 * kv)]), (2 * q, kv, kv))


def _gated_gate(m: ModelConfig) -> RowsTransposed:
    """moefast ``gate`` [D, H·Hd] from q_proj's gate rows."""
    return RowsTransposed(_gated_query_rows(m) + m.head_dim, (2 * m.num_heads * m.head_dim,))


def _grouped_in_proj(m: ModelConfig) -> RowsTransposed:
    """moefast Gated DeltaNet ``in_proj`` [D, C + Hv·V + 2·Hv] (columns q | k | v | z | b | a, heads
    in order) from Qwen3-Next's ``in_proj_qkvz`` [Hk·(2K + 2rV), D] and ``in_proj_ba`` [2·Hv, D]
    (r = Hv / Hk), whose rows are grouped per key head h: q (K), k (K), v (r·V: value heads h·r ..
    h·r + r - 1), z (r·V), and b (r), a (r) (``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``)."""
    hk, hv, k, v = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    r = hv // hk
    block = 2 * k + 2 * r * v  # one key head's rows of in_proj_qkvz
    heads = np.arange(hk)[:, None]
    q = (heads * block + np.arange(k)).ravel()
    values = (heads * block + 2 * k + np.arange(r * v)).ravel()  # value head h·r + j, feature d: j·V + d
    b = hk * block + (heads * 2 * r + np.arange(r)).ravel()  # in_proj_ba follows in the stack
    return RowsTransposed(np.concatenate([q, q + k, values, values + r * v, b, b + r]), (hk * block, 2 * hv))


def _in_proj_sizes(m: ModelConfig, width: int) -> tuple[int, ...]:
    """Widths of Qwen3.5's in_proj_qkv | in_proj_z | in_proj_b | in_proj_a in moefast's ``in_proj``."""
    hv, value = m.linear_num_value_heads, m.linear_num_value_heads * m.linear_value_head_dim
    return (width - value - 2 * hv, value, hv, hv)


_LA = _L + "linear_attn."
_GATED_ATTENTION = MappingProxyType({
    ("attn_norm", "scale"): _ATTENTION[("attn_norm", "scale")],
    ("ffn_norm", "scale"): _ATTENTION[("ffn_norm", "scale")],
    ("attn", "qkv"): _t(_gated_qkv, *(_A + f"{x}_proj.weight" for x in "qkv")),
    ("attn", "gate"): _t(_gated_gate, _A + "q_proj.weight"),
    ("attn", "out"): _ATTENTION[("attn", "out")],
    ("attn", "q_norm", "scale"): _ATTENTION[("attn", "q_norm", "scale")],
    ("attn", "k_norm", "scale"): _ATTENTION[("attn", "k_norm", "scale")],
})
"""Gated full attention (Qwen3-Next, Qwen3.5): ``q_proj`` [H·2·Hd, D] holds each head's query and
output gate (moefast ``qkv``'s query columns and ``gate`` [D, H·Hd]); per-head q/k norms; with the
family's zero-centred norms every ``scale`` is HF's ``w`` itself (applied as ``1 + w``)."""
_GATED_DELTANET = MappingProxyType({
    ("attn_norm", "scale"): _ATTENTION[("attn_norm", "scale")],
    ("ffn_norm", "scale"): _ATTENTION[("ffn_norm", "scale")],
    ("attn", "conv"): _t(CONV1D, _LA + "conv1d.weight"),
    ("attn", "A_log"): _t(IDENTITY, _LA + "A_log"),
    ("attn", "dt_bias"): _t(IDENTITY, _LA + "dt_bias"),
    ("attn", "norm"): _t(IDENTITY, _LA + "norm.weight"),
    ("attn", "out"): _t(TRANSPOSED, _LA + "out_proj.weight"),
})
"""A Gated DeltaNet layer's tensors but its input projection (:class:`moefast.model.GatedDeltaNet`):
conv [W, C] (HF [C, 1, W]), A_log and dt_bias [Hv], norm [V] (a plain scale), out [Hv·V, D]."""
_QWEN3_NEXT_LINEAR = MappingProxyType({
    **_GATED_DELTANET,
    ("attn", "in_proj"): _t(_grouped_in_proj, _LA + "in_proj_qkvz.weight", _LA + "in_proj_ba.weight"),
})
_QWEN3_5_LINEAR = MappingProxyType({
    **_GATED_DELTANET,
    ("attn", "in_proj"): _t(CONCAT_T, *(_LA + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                            split=_in_proj_sizes),
})
_HYBRID_DEFAULTS = {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25, "head_dim": 256,
                    "num_key_value_heads": 2, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_QWEN_MTP = MappingProxyType({
    ("enorm", "scale"): _t(IDENTITY, "mtp.pre_fc_norm_embedding.weight"),
    ("hnorm", "scale"): _t(IDENTITY, "mtp.pre_fc_norm_hidden.weight"),
    ("eh_proj",): _t(TRANSPOSED, "mtp.fc.weight"),
    ("head_norm", "scale"): _t(IDENTITY, "mtp.norm.weight"),
})
"""The multi-token-prediction tensors of Qwen3-Next and Qwen3.5 besides the decoder layers
``mtp.layers.{j}.*`` (vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``), shared by those layers:
pre_fc_norm_embedding [D] (moefast ``enorm``), pre_fc_norm_hidden [D] (``hnorm``), fc [2D, D] (HF
[D, 2D] applied to [normed embedding; normed hidden state]: ``eh_proj``), norm [D] (``head_norm``);
zero-centred norms like the model's. The embedding and output head are the main model's (the
hub's ``mtp_use_dedicated_embeddings: false``)."""
_LEFTOVER_MTP = MappingProxyType({"mtp.": "multi-token-prediction tensors (mtp.*) beyond config.json's "
                                          "mtp_num_hidden_layers"})


def _hybrid(model_type: str, architecture: str, name: str, linear_tensors, **kw) -> FamilySpec:
    """Qwen3-Next / Qwen3.5-MoE: Gated DeltaNet and gated full attention per ``layer_types``,
    zero-centred RMSNorms, per-head q/k norms, partial RoPE, softmax top-k routing and a shared
    expert behind a sigmoid gate (Qwen2-MoE's names); at most one multi-token-prediction layer
    (``mtp_num_hidden_layers``: ``mtp.*``, a gated full-attention layer with the family's MLP)."""
    return FamilySpec(
        model_type=model_type, architecture=architecture, name=name, num_experts_keys=("num_experts",),
        expert_ff_key="moe_intermediate_size", qk_norm="per_head", partial_rotary=True,
        shared_expert=SharedExpert("shared_expert_intermediate_size", gated=True), layer_types=LayerTypes(),
        attention_output_gate=True, zero_centered_norm=True, layer_tensors=_GATED_ATTENTION,
        linear_tensors=linear_tensors, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate.weight"),
        unsupported=MappingProxyType({"attention_bias": "biases on the attention projections (moefast's "
                                                        "attention output gate has none)"}),
        mtp_key="mtp_num_hidden_layers", mtp_tensors=_QWEN_MTP, mtp_layer_prefix="mtp.layers.{i}.", mtp_max_depth=1,
        mtp_unsupported=MappingProxyType({"mtp_use_dedicated_embeddings": "an embedding of the MTP layer's own; "
                                                                         "moefast's MTP modules share the model's"}),
        skipped_tensors=_LEFTOVER_MTP, export_constants=MappingProxyType({"attention_bias": False}), **kw)


def _prefixed(table: Mapping, prefix: str) -> MappingProxyType:
    """``table`` with the names under ``model.`` moved under ``prefix`` (``lm_head`` stays)."""
    def move(t: Tensor) -> Tensor:
        return dataclasses.replace(t, names=tuple(prefix + n[len("model."):] if n.startswith("model.") else n
                                                  for n in t.names))
    return MappingProxyType({k: (_prefixed(v, prefix) if isinstance(v, Mapping) else move(v))
                             for k, v in table.items()})


# --------------------------------------------------------------------------------------- registry
REGISTRY: dict[str, FamilySpec] = {
    "mixtral": FamilySpec(
        model_type="mixtral", architecture="MixtralForCausalLM", name="Mixtral",
        hf_defaults=MappingProxyType({"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_experts_per_tok": 2}),
        num_experts_keys=("num_local_experts",), expert_ff_key="intermediate_size", norm_topk_prob_key=None,
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables("block_sparse_moe.", "w1", "w3", "w2"),
        unsupported=MappingProxyType({"sliding_window": "sliding-window attention; set it to null for full "
                                                        "attention"}),
        export_constants=MappingProxyType({"sliding_window": None, "router_jitter_noise": 0.0})),
    "qwen2_moe": _qwen(
        "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 4}),
        attention_bias=BiasKey("qkv_bias", "qkv", default=True),
        shared_expert=SharedExpert("shared_expert_intermediate_size", gated=True),
        moe_tensors=_moe_tables(shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate.weight")),
    "qwen3_moe": _qwen(
        "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8}),
        attention_bias=BiasKey("attention_bias", "all"), qk_norm="per_head", moe_tensors=_moe_tables()),
    "olmoe": FamilySpec(
        model_type="olmoe", architecture="OlmoeForCausalLM", name="OLMoE",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8}),
        num_experts_keys=("num_experts", "num_local_experts"), expert_ff_key="intermediate_size",
        attention_bias=BiasKey("attention_bias", "all"), qk_norm="full",
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL, moe_tensors=_moe_tables(),
        unsupported=MappingProxyType({"clip_qkv": "clipping of q/k/v activations"}),
        export_constants=MappingProxyType({"clip_qkv": None}),
        model_checks=((lambda cfg: cfg.model.num_heads * cfg.model.head_dim != cfg.model.d_model,
                       "model.head_dim * num_heads != d_model (OLMoE's q/k norms assume it)"),)),
    # GLM-4.5/4.6/4.7 (zai-org/GLM-4.5 etc.): GQA with q/k/v biases and optional per-head q/k norms,
    # half of each head rotated, DeepSeek-V3's sigmoid router (noaux_tc) with its selection bias,
    # ungated shared experts, the first layers dense. Its MTP layers (num_nextn_predict_layers, named
    # as DeepSeek-V3's) are read into model.mtp_depth modules and written back.
    "glm4_moe": FamilySpec(
        model_type="glm4_moe", architecture="Glm4MoeForCausalLM", name="GLM-4.5",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8,
                                      "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                                      "partial_rotary_factor": 0.5}),
        num_experts_keys=("n_routed_experts", "num_local_experts"), expert_ff_key="moe_intermediate_size",
        dense_ff_key="intermediate_size", moe_layers=FirstKDense(default=1),
        attention_bias=BiasKey("attention_bias", "qkv"), qk_norm="per_head", qk_norm_key="use_qk_norm",
        partial_rotary=True, shared_expert=SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=Router(score_func="sigmoid", topk_methods=MappingProxyType({"noaux_tc": True}), default_method="noaux_tc",
                      scaling_key="routed_scaling_factor", selection_bias=_L + "mlp.gate.e_score_correction_bias"),
        layer_tensors=_ATTENTION, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_experts."),
        mtp_key="num_nextn_predict_layers", mtp_tensors=_MTP, mtp_copies=_MTP_COPIES),
    # DeepSeek-V3/R1 (and Moonlight, whose config.json says deepseek_v3): MLA with interleaved RoPE
    # columns and YaRN, the same router as GLM-4.5 (here with real group limits), ungated shared
    # experts, the first layers dense; MTP layers (after num_hidden_layers) read and written.
    "deepseek_v3": FamilySpec(
        model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", name="DeepSeek-V3",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 8,
                                      "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                                      "rope_interleave": True, "n_group": 8, "topk_group": 4}),
        num_experts_keys=("n_routed_experts", "num_local_experts"), expert_ff_key="moe_intermediate_size",
        dense_ff_key="intermediate_size", moe_layers=FirstKDense(default=3), mla=True, yarn=True,
        rope_interleave=_MLA_ROPE,
        shared_expert=SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=Router(score_func="sigmoid", topk_methods=MappingProxyType({"noaux_tc": True}), default_method="noaux_tc",
                      # the hub's config.json says so, and vLLM/SGLang create the selection bias only for noaux_tc
                      write_method=True, scaling_key="routed_scaling_factor",
                      selection_bias=_L + "mlp.gate.e_score_correction_bias"),
        layer_tensors=_MLA, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_experts."),
        unsupported=MappingProxyType({"attention_bias": "biases on MLA's q_a/kv_a/o projections"}),
        mtp_key="num_nextn_predict_layers", mtp_tensors=_MTP, mtp_copies=_MTP_COPIES,
        export_constants=MappingProxyType({"attention_bias": False})),
    # DeepSeek-V2 / V2-Lite: MLA (V2-Lite: a direct q_proj) with RoPE features always interleaved
    # (transformers rotates them as complex pairs) and YaRN, softmax routing (greedy or
    # group_limited_greedy by the best probability of each group), gates never renormalised and
    # scaled, ungated shared experts, the first layers dense; no selection bias.
    "deepseek_v2": FamilySpec(
        model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM", name="DeepSeek-V2",
        hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-6, "num_experts_per_tok": 6,
                                      "n_shared_experts": 2, "routed_scaling_factor": 1.0, "rope_interleave": True}),
        num_experts_keys=("n_routed_experts", "num_experts"), expert_ff_key="moe_intermediate_size",
        dense_ff_key="intermediate_size", moe_layers=FirstKDense(default=0), mla=True, yarn=True,
        rope_interleave=_MLA_ROPE, norm_topk_prob_key=None, fixed_norm_topk_prob=False,
        shared_expert=SharedExpert("moe_intermediate_size", gated=False, count_key="n_shared_experts"),
        router=Router(score_func="softmax", topk_methods=MappingProxyType({"greedy": False, "group_limited_greedy": True}),
                      default_method="greedy", write_method=True, scaling_key="routed_scaling_factor"),
        layer_tensors=_MLA, dense_tensors=_DENSE_MLP, global_tensors=_GLOBAL,
        moe_tensors=_moe_tables(shared="mlp.shared_experts."),
        unsupported=MappingProxyType({"attention_bias": "biases on MLA's q_a/kv_a/o projections",
                                      "mlp_bias": "biases in the feed-forward layers"}),
        export_constants=MappingProxyType({"attention_bias": False, "mlp_bias": False, "norm_topk_prob": False})),
    # Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-*): Gated DeltaNet layers (in_proj_qkvz / in_proj_ba grouped
    # per key head) and gated full attention per layer_types, zero-centred norms, a quarter of each
    # head rotated; Qwen2-MoE's experts, router and gated shared expert, dense layers in
    # mlp_only_layers. The checkpoints' MTP layer (mtp_num_hidden_layers: 1, mtp.*: fc, its norms,
    # a gated full-attention layer, a final norm) is read into model.mtp_depth=1 and written back.
    "qwen3_next": _hybrid(
        "qwen3_next", "Qwen3NextForCausalLM", "Qwen3-Next", _QWEN3_NEXT_LINEAR,
        hf_defaults=MappingProxyType({**_HYBRID_DEFAULTS, "num_experts_per_tok": 10, "norm_topk_prob": True}),
        dense_ff_key="intermediate_size", moe_layers=MlpOnlyLayers()),
    # Qwen3.5-MoE's language model (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3-Next's
    # layers with separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (heads in order), every
    # layer MoE, gates always renormalised. Its RoPE is mrope (rope_parameters.mrope_section), which
    # for text (the three position axes equal) is plain partial RoPE: the mrope keys are not used.
    "qwen3_5_moe_text": _hybrid(
        "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3.5-MoE", _QWEN3_5_LINEAR,
        hf_defaults=MappingProxyType({**_HYBRID_DEFAULTS, "num_experts_per_tok": 8}),
        norm_topk_prob_key=None, fixed_norm_topk_prob=True),
}
"""HF ``model_type`` -> :class:`FamilySpec`: the families moefast reads and writes, in the order
:func:`moefast.interop.hf.hf_family` tries them."""

# GLM-4.7-Flash: DeepSeek-V3's layers (MLA, interleaved RoPE, the sigmoid router with its selection
# bias, ungated shared experts) with GLM's defaults, dense layers listed in mlp_layer_types. A run
# imported from it is exported as it (moefast export-hf: the family the run was imported from);
# otherwise deepseek_v3, first in the registry, represents the same model.
REGISTRY["glm4_moe_lite"] = dataclasses.replace(
    REGISTRY["deepseek_v3"], model_type="glm4_moe_lite", architecture="Glm4MoeLiteForCausalLM", name="GLM-4.7-Flash",
    hf_defaults=MappingProxyType({"rope_theta": 1e4, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
                                  "norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
                                  "rope_interleave": True, "n_group": 1, "topk_group": 1}),
    moe_layers=MlpLayerTypes(), export_constants=MappingProxyType({"attention_bias": False}))

# Kimi K2 (moonshotai/Kimi-K2-*) is DeepSeek-V3's architecture under its own model_type (remote code):
# read through the V3 spec; a model is always exported as deepseek_v3, which transformers loads.
REGISTRY["kimi_k2"] = dataclasses.replace(REGISTRY["deepseek_v3"], model_type="kimi_k2", name="Kimi K2",
                                          export_as="deepseek_v3")

# Qwen3.5-MoE as published (Qwen/Qwen3.5-*-A*B: Qwen3_5MoeForConditionalGeneration, model_type
# qwen3_5_moe): config.json nests the language model's keys under text_config, its tensors are
# under model.language_model.* (lm_head.weight at the top; the MTP layer's stay at the top, mtp.*,
# as vLLM's Qwen3_5MoeMTP loads them), and a vision tower (model.visual.*) that moefast does not
# read: it is skipped with one note. A model read from it is exported as the
# text model (qwen3_5_moe_text, Qwen3_5MoeForCausalLM), which transformers loads with
# AutoModelForCausalLM; the vision tower is not written.
REGISTRY["qwen3_5_moe"] = dataclasses.replace(
    REGISTRY["qwen3_5_moe_text"], model_type="qwen3_5_moe", architecture="Qwen3_5MoeForConditionalGeneration",
    name="Qwen3.5-MoE (vision-language)", export_as="qwen3_5_moe_text", text_config_key="text_config",
    layer_tensors=_prefixed(_GATED_ATTENTION, "model.language_model."),
    linear_tensors=_prefixed(_QWEN3_5_LINEAR, "model.language_model."),
    dense_tensors=_prefixed(_DENSE_MLP, "model.language_model."),
    moe_tensors=_prefixed(REGISTRY["qwen3_5_moe_text"].moe_tensors, "model.language_model."),
    global_tensors=_prefixed(_GLOBAL, "model.language_model."),
    skipped_tensors=MappingProxyType({"model.visual.": "the vision tower (model.visual.*)", **_LEFTOVER_MTP}))
