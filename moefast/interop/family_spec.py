"""What a Hugging Face family is to moefast: :class:`FamilySpec` and the pieces of it that read
``config.json`` keys (which layers are MoE, the router, shared experts, attention biases, per-layer
types). The families themselves are in :mod:`moefast.interop.families`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from moefast.config import ExperimentConfig, ModelConfig
from moefast.interop.transforms import SubPath, Tensor

if TYPE_CHECKING:  # one family's own config.json keys (the FamilySpec fields below)
    from moefast.interop.family_keys import Gemma4Keys, KimiLinearKeys, NemotronHKeys, NemotronHSpelling

# ------------------------------------------------------------------------------------ config keys
@dataclasses.dataclass(frozen=True)
class AllMoE:
    """Every layer is MoE (Mixtral, OLMoE); nothing to write in config.json."""

    allows_dense = False
    sublayers = False
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
    sublayers = False
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
    sublayers = False

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
        for the j-th MoE layer), never in the parameters; or on-disk expert layout -> that name,
        where the two layouts keep it apart (MiniMax-M2: ``block_sparse_moe.`` in its own
        checkpoints, ``mlp.`` in transformers' fused layout). None: the family has none.
    """

    score_func: Literal["softmax", "sigmoid"] = "softmax"
    topk_methods: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    default_method: str | None = None
    write_method: bool = False
    scaling_key: str | None = None
    selection_bias: str | Mapping[str, str] | None = None

    def bias_name(self, layout: str) -> str | None:
        """:attr:`selection_bias` for the on-disk expert ``layout``."""
        b = self.selection_bias
        return b.get(layout) if isinstance(b, Mapping) else b

    def method(self, limited: bool) -> str | None:
        """The ``topk_method`` that computes moefast's routing: one with group limits if
        ``limited``, else the default."""
        if limited and not self.topk_methods.get(self.default_method, False):
            return next(m for m, groups in self.topk_methods.items() if groups)
        return self.default_method


@dataclasses.dataclass(frozen=True)
class MlpLayerTypes:
    """``mlp_layer_types`` lists ``"dense"`` or ``"sparse"`` per layer (GLM-4.7-Flash); absent: the
    first layer dense, the others MoE, as transformers assumes. With a ``leading`` :class:`FirstKDense`
    (DeepSeek-V3.2): absent, its first ``first_k_dense_replace`` layers dense (transformers' default
    list); both present, they must agree (transformers reads the list, DeepSeek's own code the
    count); written both, the count where the dense layers are the leading ones."""

    key: str = "mlp_layer_types"
    allows_dense = True
    sublayers = False
    leading: FirstKDense | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,) if self.leading is None else (self.key, self.leading.key)

    def moe_layers(self, hf: Mapping[str, Any], num_layers: int) -> list[bool]:
        """Raises ValueError: the list's length is not ``num_layers``, an entry is neither
        ``"dense"`` nor ``"sparse"``, or it disagrees with ``leading``'s count."""
        first = None if self.leading is None else self.leading.moe_layers(hf, num_layers)
        given = hf.get(self.key)
        if given and first is not None and hf.get(self.leading.key) is not None \
                and [t == "sparse" for t in given] != first:
            raise ValueError(f"{self.key} disagrees with {self.leading.key}={hf[self.leading.key]} (transformers reads "
                             "the list, the checkpoint's own code the count): keep one or make them agree")
        default = ["dense"] + ["sparse"] * (num_layers - 1) if first is None else \
            ["sparse" if moe else "dense" for moe in first]
        types = given or default
        other = sorted({repr(t) for t in types if t not in ("dense", "sparse")})
        if len(types) != num_layers or other:
            raise ValueError(f"{len(types)} entries for num_hidden_layers={num_layers}"
                             + (f", with {', '.join(other)}" if other else "")
                             + ": one per layer, each 'dense' or 'sparse'")
        return [t == "sparse" for t in types]

    def to_hf(self, dense: list[int], num_layers: int) -> dict[str, Any]:
        out = {self.key: ["dense" if i in dense else "sparse" for i in range(num_layers)]}
        if self.leading is not None and dense == list(range(len(dense))):
            out.update(self.leading.to_hf(dense, num_layers))
        return out

    def problem(self, m: ModelConfig, name: str) -> str | None:
        return None  # any set of dense layers can be listed


@dataclasses.dataclass(frozen=True)
class SublayerPattern:
    """Every layer is one pre-norm residual sublayer, a token mixer or a feed-forward alone, as
    the (engine's) ``layer_types`` lists them: ``"moe"`` layers are MoE, ``"mlp"`` ones dense, the
    others have no feed-forward (Nemotron-H's ``layers_block_type``; moefast ``model.layer_types``
    with :attr:`~moefast.config.ModelConfig.sublayers`, ``num_dense_layers`` 0 and ``moe_every``
    1). The pattern is written with the layer types, so nothing here."""

    allows_dense = True
    sublayers = True
    keys: tuple[str, ...] = ("layer_types",)

    def moe_layers(self, hf: Mapping[str, Any], num_layers: int) -> list[bool]:
        types = list(hf.get("layer_types") or [])
        if len(types) != num_layers:
            raise ValueError(f"{len(types)} entries for num_hidden_layers={num_layers}: one per layer")
        return [t == "moe" for t in types]

    def to_hf(self, dense: list[int], num_layers: int) -> dict[str, Any]:
        return {}

    def problem(self, m: ModelConfig, name: str) -> str | None:
        if not m.sublayers:
            return (f"model.layer_types without moe / mlp sublayers ({name}'s layers are single sublayers, a token "
                    "mixer or a feed-forward each)")
        return None


LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")
"""config.json keys of Gated DeltaNet's shape, read into moefast's ``model.*`` keys of the same names."""


@dataclasses.dataclass(frozen=True)
class LayerTypes:
    """``layer_types`` lists each layer's token mixer, ``"full_attention"`` or ``"linear_attention"``
    (Gated DeltaNet; moefast ``model.layer_types``, HF's name). Absent or null: layer i is full
    attention where ``(i + 1) % full_attention_interval == 0`` (default 4) and linear otherwise, as
    transformers' Qwen3-Next and Qwen3.5 configs assume. ``kinds``: the entries the family has
    (Nemotron-H's sublayers: also ``"moe"`` and ``"mlp"``)."""

    key: str = "layer_types"
    interval_key: str = "full_attention_interval"
    interval_default: int = 4
    kinds: tuple[str, ...] = ("full_attention", "linear_attention")

    def types(self, hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
        """Each layer's kind, one of :attr:`kinds` (Nemotron-H's also ``"moe"`` and ``"mlp"``:
        :class:`SublayerPattern`).

        Raises:
          ValueError: the list's length is not ``num_layers``, or an entry is none of the kinds.
        """
        kinds = self.kinds
        each = ", ".join(map(repr, kinds[:-1])) + f" or {kinds[-1]!r}"
        types = hf.get(self.key)
        if types is None:
            every = hf.get(self.interval_key) or self.interval_default
            return tuple("linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers))
        if not isinstance(types, (list, tuple)):
            raise ValueError(f"one entry per layer ({num_layers}), each {each}")
        other = sorted({repr(t) for t in types if t not in kinds})
        if len(types) != num_layers or other:
            raise ValueError(f"{len(types)} entries for num_hidden_layers={num_layers}"
                             + (f", with {', '.join(other)}" if other else "")
                             + f": one per layer, each {each}")
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
        :class:`FirstKDense` or :class:`MlpLayerTypes`), or every layer a single sublayer
        (:class:`SublayerPattern`: Nemotron-H).
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
      dsa: the family's MLA is DeepSeek Sparse Attention (DeepSeek-V3.2): config.json's ``index_topk``,
        ``index_n_heads``, ``index_head_dim`` (defaults from ``hf_defaults``) are moefast's keys of
        the same names, every layer is ``"indexed_attention"`` in ``layer_types``, and each layer's
        ``self_attn.indexer.*`` tensors are in ``layer_tensors``; the other families refuse a model
        with ``model.index_topk`` set.
      indexer_types: with ``dsa``, config.json's ``indexer_types`` (GLM-MoE-DSA) says per layer
        ``"full"`` (its own indexer) or ``"shared"`` (none: the previous layer's selection reused);
        absent, transformers derives it from ``index_topk_pattern`` or ``index_topk_freq`` /
        ``index_skip_topk_offset`` (every layer full by default). moefast runs an indexer on every
        layer, so a ``"shared"`` layer is refused; exports write every layer ``"full"``.
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
      layer_types: the family mixes tokens per layer by full attention or a linear-attention kind
        (Gated DeltaNet, KDA, Mamba-2: the spec's ``fixed`` ``model.linear_attention_kind``), listed
        in config.json (:class:`LayerTypes`; moefast ``model.layer_types``, the :data:`LINEAR_KEYS`
        under the same names, defaults from ``hf_defaults``); None: full attention only (a
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
      sliding_window: the family's layers are ``"sliding_attention"`` or ``"full_attention"``, as
        config.json's ``layer_types`` lists them (absent: alternating, sliding first, as
        transformers' gpt-oss config assumes), the window in ``sliding_window`` (moefast
        ``model.layer_types``, ``model.sliding_window``).
      attention_sinks: the attention layers learn a sink logit per head (``self_attn.sinks``;
        moefast ``model.attention_sinks``).
      expert_activation: the routed experts' gated unit (moefast ``moe.expert_activation``;
        ``"clamped_swiglu"``: gpt-oss, its limit from config.json's ``swiglu_limit``), whatever
        ``hidden_act`` says.
      expert_bias, router_bias: the experts' projections / the router have biases (moefast
        ``moe.expert_bias`` / ``moe.router_bias``).
      mxfp4_experts: the family's hub checkpoints may store the experts in MXFP4
        (``quant_method: mxfp4``, gpt-oss); any other family refuses that quantization.
      sliding_pattern: with ``sliding_window``, where config.json has no ``layer_types``, layer i
        is full attention when ``(i + 1) % sliding_pattern == 0`` (gpt-oss: 2, Gemma 4: 6).
      fixed: moefast config keys (``"model.sandwich_norm"``) the family always has at these values:
        set on import, and a model with another value cannot be written as this family; a key that
        some family fixes must hold its default in the others.
      family_keys: config.json keys only this family has, read into moefast's keys and written
        back (:class:`Gemma4Keys`, :class:`NemotronHKeys`: ``read``, ``write``, ``problems``, the
        moefast keys it ``owns``, which must hold their defaults in other families).
      config_keys: the family spells config.json otherwise: its keys turned into the engine's before
        anything is read, and the export's turned back (:class:`KimiLinearKeys`,
        :class:`NemotronHSpelling`: ``read``, ``write``).
      read_renames: ``(regex, replacement)`` applied to the checkpoint's tensor names before they are
        matched with the tables: names another writer gives some tensors (transformers' Kimi Linear
        ``save_pretrained`` puts the dense layers' MLP under ``block_sparse_moe.``, the hub's
        checkpoint under ``mlp.``, which moefast writes).

    ``linear_tensors`` may also be keyed by on-disk expert layout, like ``moe_tensors``, where the
    family names its linear-attention tensors otherwise in each (Kimi Linear: the hub's
    ``q_conv1d | k_conv1d | v_conv1d`` per expert, transformers' joined ``conv1d`` fused).

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
    moe_layers: AllMoE | MlpOnlyLayers | FirstKDense | MlpLayerTypes | SublayerPattern = AllMoE()
    attention_bias: BiasKey | None = None
    qk_norm: Literal["none", "per_head", "full"] = "none"
    qk_norm_key: str | None = None
    partial_rotary: bool = False
    router: Router = Router()
    mla: bool = False
    yarn: bool = False
    dsa: bool = False
    indexer_types: bool = False
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
    sliding_window: bool = False
    attention_sinks: bool = False
    expert_activation: str = "silu"
    expert_bias: bool = False
    router_bias: bool = False
    mxfp4_experts: bool = False
    sliding_pattern: int = 2
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    family_keys: Gemma4Keys | NemotronHKeys | None = None
    config_keys: KimiLinearKeys | NemotronHSpelling | None = None
    read_renames: tuple[tuple[str, str], ...] = ()

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

    def linear_table(self, layout: str) -> Mapping[SubPath, Tensor]:
        """The linear-attention layers' table in on-disk expert ``layout``."""
        t = self.linear_tensors
        return t[layout] if layout in t else t

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
