"""Experiment configuration: frozen dataclasses, YAML files and ``section.key=value`` overrides.

One :class:`ExperimentConfig` holds a section per part of the system (``model``, ``moe``, ``data``,
``train``, ``mesh``, ``checkpoint``, ``cache``, ``monitor``). Every section validates its own invariants in
``__post_init__``; :class:`ExperimentConfig` validates the ones that span sections. Errors are
:class:`ConfigError` (a ``ValueError``) with a message that names the key and what to change.

Example::

    cfg = load_config("configs/tiny.yaml", ["train.steps=200", "moe.top_k=1"])
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, steps=10))
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "CacheConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "MeshConfig",
    "MoEConfig",
    "ModelConfig",
    "MonitorConfig",
    "OverlapConfig",
    "TrainConfig",
    "DEFAULT_CONFIG",
    "INVOCATION_KEYS",
    "PARAMETER_KEYS",
    "load_config",
    "parse_overrides",
]

DEFAULT_CAPACITY_FACTOR = 1.25
# The model / moe keys that decide the parameters' structure and shapes (everything else in those
# sections chooses how the same parameters are used).
PARAMETER_KEYS = {"model": ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff", "dense_d_ff",
                            "vocab_size", "tie_embeddings", "num_dense_layers", "moe_every", "attention_bias",
                            "qk_norm", "position_encoding", "attention", "q_lora_rank", "kv_lora_rank",
                            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "layer_types",
                            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                            "linear_value_head_dim", "linear_conv_kernel_dim", "attention_output_gate",
                            "zero_centered_norm"),
                  "moe": ("num_experts", "shared_expert_d_ff", "shared_expert_gate")}
# Keys that belong to one invocation of a run, never to the run: the run dir's config.yaml does
# not keep them, and they are ignored in one that an older moefast wrote with them
# (:func:`without_invocation_keys`).
INVOCATION_KEYS = {"train": ("stop_at",)}
MAX_OVERLAP_CHUNKS = 16
CONFIG_DIR = Path(str(importlib.resources.files("moefast.configs")))  # the repo's configs/, installed as moefast.configs
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_choices(obj: Any, section: str) -> None:
    """Every ``Literal`` field of a section holds one of its choices (also when the dataclass is
    built in code, not only through :func:`load_config`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if typing.get_origin(hints[f.name]) is Literal:
            _coerce(f"{section}.{f.name}", getattr(obj, f.name), hints[f.name])


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape.

    Attributes:
      d_model: residual stream width D.
      num_layers: number of transformer blocks.
      num_heads: query heads H.
      num_kv_heads: key/value heads (grouped-query attention); ``None`` means ``num_heads``.
      head_dim: per-head width.
      d_ff: hidden width F of each SwiGLU expert (and of dense feed-forward layers unless
        ``dense_d_ff`` is set; Hugging Face's ``moe_intermediate_size``).
      dense_d_ff: hidden width of the dense feed-forward layers (Hugging Face's
        ``intermediate_size`` in Qwen-MoE configs); ``None`` means ``d_ff``.
      attention_bias: learned biases of the attention projections: ``"none"``, ``"qkv"`` (query,
        key and value: Qwen2-MoE) or ``"all"`` (also the output projection: ``attention_bias`` in
        Qwen3-MoE / OLMoE configs).
      qk_norm: RMSNorm of queries and keys before RoPE (Dehghani et al. 2023, ViT-22B sec. 3.1):
        ``"none"``, ``"per_head"`` (over each head's Hd features: Qwen3-MoE) or ``"full"`` (over
        the whole query and key projections, before the split into heads: OLMoE). Each has its own
        learned scale.
      attention_impl: how training and evaluation compute causal attention
        (:mod:`moefast.model.transformer`): ``"blocked"`` (XLA einsums over the causal key blocks
        of 128-row query blocks, with a [B, 1, T, T] mask: the CPU path), ``"flash"`` (the fused
        Pallas kernel of :mod:`moefast.kernels.attention`, isolating packed documents by segment
        id, memory linear in T; compiled on GPU, interpreted on CPU) or ``"auto"`` (``"flash"``
        when the step is compiled for GPUs and the batch divides over the token shards, else
        ``"blocked"``). Generation with a KV cache always uses the blocked path.
      vocab_size: V; ``None`` means the tokenizer's vocabulary size.
      max_seq_len: length of the positional tables, in tokens; positions must be below it.
      position_encoding: ``"rope"`` (rotary, applied to queries and keys; Su et al. 2021, RoFormer
        sec. 3.4) or ``"sinusoidal"`` (absolute encodings added to the token embeddings; Vaswani et
        al. 2017, sec. 3.5).
      rope_base: RoPE wavelength base (Su et al. 2021, RoFormer eq. 15).
      tie_embeddings: LM head reuses the token embedding matrix.
      num_dense_layers: leading blocks with a dense feed-forward instead of MoE.
      moe_every: after the leading dense layers, every ``moe_every``-th block is MoE, others dense.
      dtype: compute dtype of activations and matmuls (parameters stay float32; the router is
        always float32).
      dropout: dropout rate on attention and feed-forward outputs (training only).
      norm_eps: RMSNorm epsilon.
      init_std: standard deviation of the normal initialiser of weight matrices.
      remat: activation rematerialisation of each block in the backward pass (``jax.checkpoint``
        with a policy from ``jax.checkpoint_policies``; :data:`moefast.model.REMAT_POLICIES`):
        ``"none"`` keeps every activation; ``"full"`` keeps only each block's input and recomputes
        the block, the routing and (expert axis > 1) both expert all-to-alls included, so the
        forward exchange runs twice; ``"save_dots"`` keeps every matmul output (``dots_saveable``)
        and ``"save_dots_no_batch"`` those without batch dimensions
        (``dots_with_no_batch_dims_saveable``: not the experts' batched matmuls), both recompute the
        exchange; ``"minimal"`` keeps the routing decisions and the expert buffers on either side of
        the exchange (:data:`moefast.model.MINIMAL_SAVED`) and recomputes the rest, never the
        routing or the all-to-alls. Results are bitwise those of ``"none"`` on CPU.
      scan_layers: run identical blocks with ``jax.lax.scan`` over parameters stacked on a leading
        ``layers`` axis (:mod:`moefast.model.layout`): the leading dense blocks form one stack and
        the MoE/dense pattern of ``moe_every`` one stack per position in the pattern; compile time
        no longer grows with depth. A checkpoint written with either layout restores into the other.
      attention: the attention block: ``"gqa"`` (grouped-query attention over ``num_heads``,
        ``num_kv_heads`` and ``head_dim``) or ``"mla"``: multi-head latent attention (DeepSeek-V2,
        DeepSeek-AI 2024, sec. 2.1, eqs. 9-19; DeepSeek-V3 and GLM-4.7-Flash use it unchanged):
        keys and values are expanded per head from one normalised compressed vector of
        ``kv_lora_rank`` features per token, and a RoPE key of ``qk_rope_head_dim`` features shared
        by every head; decoding caches only those two (:func:`moefast.model.transformer.cache_bytes_per_token`).
        With ``"mla"``, ``head_dim`` and ``num_kv_heads`` are not used and ``attention_bias`` /
        ``qk_norm`` must be ``"none"``.
      q_lora_rank: MLA: rank of the low-rank query projection (eq. 12: ``q_a_proj`` -> RMSNorm ->
        ``q_b_proj``); ``None`` or 0: one direct query projection ``q_proj`` (DeepSeek-V2-Lite).
        Hugging Face's ``q_lora_rank``, as are the next four names.
      kv_lora_rank: MLA: width of the compressed key/value vector (eq. 9, d_c).
      qk_nope_head_dim: MLA: per-head query/key features without RoPE (eqs. 10, 13).
      qk_rope_head_dim: MLA: per-head query features with RoPE, and the width of the shared RoPE key
        (eqs. 14-15, d_h^R); even.
      v_head_dim: MLA: per-head value width (eq. 11). The softmax scale is
        ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` (times the YaRN multiplier below).
      partial_rotary_factor: fraction of each head's ``head_dim`` features that RoPE rotates: the
        first ``int(head_dim * partial_rotary_factor)`` (rotate-half within them, the rest pass
        unchanged; GLM-4.5: 0.5), Hugging Face's name. The rotated width must be even. 1.0 with
        ``"mla"`` (its RoPE width is ``qk_rope_head_dim``).
      rope_type: ``"default"`` (RoFormer frequencies) or ``"yarn"``: YaRN scaling of the RoPE
        frequencies (Peng et al. 2023, "YaRN", sec. 3.2-3.4; Hugging Face ``rope_type: yarn``): each
        frequency is interpolated by ``rope_factor`` or kept, with a linear ramp between the
        dimensions whose wavelength makes ``beta_fast`` and ``beta_slow`` rotations over
        ``original_max_position_embeddings`` (floor/ceil of the bounds, HF's default
        ``truncate``), and cos/sin are multiplied by the attention factor
        ``m(rope_factor, mscale) / m(rope_factor, mscale_all_dim)`` when both are set, else
        ``m(rope_factor, 1)``, with ``m(s, a) = 0.1 * a * ln(s) + 1`` for s > 1, else 1 (YaRN sec. 3.4).
        With ``"mla"`` the softmax scale is also multiplied by ``m(rope_factor, mscale_all_dim) ** 2``
        when ``mscale_all_dim`` is set (DeepSeek-V2/V3's checkpoints).
      rope_factor: YaRN: context extension factor s (HF ``rope_parameters.factor``), > 1.
      original_max_position_embeddings: YaRN: the pretraining context length, in tokens (HF's name).
      beta_fast, beta_slow: YaRN: ramp bounds, in rotations over the original context (alpha and beta
        of the paper, sec. 3.2; HF's names, defaults 32 and 1).
      mscale, mscale_all_dim: YaRN: DeepSeek's attention-factor coefficients (HF's names; ``None``
        or 0: not set).
      mtp_depth: D, multi-token prediction modules (DeepSeek-V3, arXiv 2412.19437, sec. 2.2,
        eqs. 21-25); 0 (the default) = none, the model and its loss exactly as without the field.
        Module k (1..D) projects ``[RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]`` (the checkpoint
        order of ``eh_proj``) from 2D to D, runs one transformer block of its own (MoE when the
        model has MoE layers, dense otherwise) and predicts token ``t_{i+k+1}`` through the shared
        embedding and output head after its own RMSNorm (:class:`moefast.model.MTPModule`). Its
        loss is weighted by ``train.mtp_loss_coef``; generation never runs the modules. Must be
        below ``data.seq_len``.
      layer_types: each block's token mixer, one entry per layer (Hugging Face's ``layer_types``):
        ``"full_attention"`` (the ``attention`` block above) or ``"linear_attention"``: Gated
        DeltaNet (Yang et al. 2024, arXiv:2412.06464; Qwen3-Next, Qwen3.5 / Qwen3.6 MoE;
        :mod:`moefast.model.gated_deltanet`), whose state resets at every packed document's start.
        ``None``: every layer ``"full_attention"``. With ``scan_layers`` the repeating period of
        (token mixer, MoE or dense) is scanned (:mod:`moefast.model.layout`). Multi-token
        prediction blocks use full attention.
      linear_num_key_heads, linear_num_value_heads: Gated DeltaNet query/key heads Hk and value
        heads Hv (a multiple of Hk: each key head serves Hv / Hk value heads); HF's names, as are
        the next three.
      linear_key_head_dim, linear_value_head_dim: Gated DeltaNet per-head key and value widths.
      linear_conv_kernel_dim: width of Gated DeltaNet's depthwise causal convolution, in tokens.
      linear_attention_impl: how Gated DeltaNet's recurrence is computed
        (:func:`moefast.kernels.gated_delta_rule.gated_delta_rule`): ``"reference"`` (token by token),
        ``"chunked"`` (64-token chunks, the WY/UT form), ``"pallas"`` (the fused kernel; compiled on
        GPU, interpreted on CPU) or ``"auto"`` (``"pallas"`` when compiling for GPUs, else
        ``"chunked"``). Decoding one token at a time uses the recurrence.
      attention_output_gate: full-attention layers gate their output per feature with
        ``sigmoid(x W_gate)`` before the output projection (Qwen3-Next / Qwen3.5's ``q_proj``,
        twice as wide, holds the gate).
      zero_centered_norm: every RMSNorm scale is stored as ``w`` and applied as ``1 + w``, starting
        at 0 (Qwen3-Next / Qwen3.5); Gated DeltaNet's output norm keeps a plain scale.
"""

    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int = 64
    d_ff: int = 512
    dense_d_ff: int | None = None
    attention_bias: Literal["none", "qkv", "all"] = "none"
    qk_norm: Literal["none", "per_head", "full"] = "none"
    attention_impl: Literal["auto", "blocked", "flash"] = "auto"
    vocab_size: int | None = None
    max_seq_len: int = 1024
    position_encoding: Literal["rope", "sinusoidal"] = "rope"
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    num_dense_layers: int = 0
    moe_every: int = 1
    dtype: Literal["float32", "bfloat16"] = "float32"
    dropout: float = 0.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    remat: Literal["none", "full", "save_dots", "save_dots_no_batch", "minimal"] = "none"
    scan_layers: bool = False
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    partial_rotary_factor: float = 1.0
    rope_type: Literal["default", "yarn"] = "default"
    rope_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    mtp_depth: int = 0
    layer_types: tuple[Literal["full_attention", "linear_attention"], ...] | None = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_attention_impl: Literal["auto", "reference", "chunked", "pallas"] = "auto"
    attention_output_gate: bool = False
    zero_centered_norm: bool = False

    def __post_init__(self):
        _check_choices(self, "model")
        for k in ("d_model", "num_layers", "num_heads", "head_dim", "d_ff", "max_seq_len", "moe_every"):
            _require(getattr(self, k) >= 1, f"model.{k}", f"must be >= 1, got {getattr(self, k)}")
        _require(self.dense_d_ff is None or self.dense_d_ff >= 1, "model.dense_d_ff",
                 f"must be >= 1 or null (= model.d_ff), got {self.dense_d_ff}")
        kv = self.kv_heads
        _require(kv >= 1 and self.num_heads % kv == 0, "model.num_kv_heads",
                 f"must divide model.num_heads={self.num_heads}, got {kv}")
        _require(self.head_dim % 2 == 0, "model.head_dim", f"must be even for RoPE, got {self.head_dim}")
        _require(self.vocab_size is None or self.vocab_size >= 2, "model.vocab_size",
                 f"must be >= 2 or null (= tokenizer's size), got {self.vocab_size}")
        _require(0 <= self.num_dense_layers <= self.num_layers, "model.num_dense_layers",
                 f"must be in [0, model.num_layers={self.num_layers}], got {self.num_dense_layers}")
        _require(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        _require(self.rope_base > 1.0, "model.rope_base", f"must be > 1, got {self.rope_base}")
        _require(self.position_encoding != "sinusoidal" or self.d_model % 2 == 0, "model.d_model",
                 f"must be even for sinusoidal position encodings, got {self.d_model}")
        _require(self.mtp_depth >= 0, "model.mtp_depth",
                 f"must be >= 0 (0 = no multi-token prediction), got {self.mtp_depth}")
        self._check_attention()
        self._check_rope()
        self._check_layer_types()

    def _check_layer_types(self):
        if self.layer_types is None:
            return
        if isinstance(self.layer_types, list):  # built in code with a list: keep the config hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        kinds = ("full_attention", "linear_attention")
        bad = [f"{i}: {k!r}" for i, k in enumerate(self.layer_types) if k not in kinds]
        _require(not bad, "model.layer_types", f"entries must be one of {list(kinds)}; got {', '.join(bad)}")
        _require(len(self.layer_types) == self.num_layers, "model.layer_types",
                 f"needs one entry per layer: {len(self.layer_types)} entries for model.num_layers={self.num_layers}")
        if "linear_attention" not in self.layer_types:
            return
        for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim"):
            _require(getattr(self, k) >= 1, f"model.{k}", f"must be >= 1, got {getattr(self, k)}")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0, "model.linear_num_value_heads",
                 f"must be a multiple of model.linear_num_key_heads={self.linear_num_key_heads} (each key head "
                 f"serves the same number of value heads), got {self.linear_num_value_heads}")

    def layer_type(self, layer: int) -> str:
        """Block ``layer``'s token mixer: ``"full_attention"`` or ``"linear_attention"`` (blocks past
        ``num_layers``, the multi-token prediction blocks, use full attention)."""
        if self.layer_types is None or layer >= self.num_layers:
            return "full_attention"
        return self.layer_types[layer]

    def _check_attention(self):
        if self.attention != "mla":
            _require(0.0 < self.partial_rotary_factor <= 1.0 and self.rotary_dim >= 2 and self.rotary_dim % 2 == 0,
                     "model.partial_rotary_factor", f"must be in (0, 1] and rotate an even number >= 2 of the "
                     f"head_dim={self.head_dim} features, got {self.partial_rotary_factor} ({self.rotary_dim} features)")
            return
        _require(self.q_lora_rank is None or self.q_lora_rank >= 0, "model.q_lora_rank",
                 f"must be >= 1, or 0 / null for a direct query projection; got {self.q_lora_rank}")
        for k in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _require(getattr(self, k) >= 1, f"model.{k}", f"must be >= 1 with model.attention=mla, got {getattr(self, k)}")
        _require(self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
                 f"must be even and >= 2 with model.attention=mla, got {self.qk_rope_head_dim}")
        _require(self.position_encoding == "rope", "model.position_encoding",
                 "model.attention=mla rotates its qk_rope_head_dim features: use rope")
        _require(self.num_kv_heads is None or self.num_kv_heads == self.num_heads, "model.num_kv_heads",
                 f"model.attention=mla expands keys and values for every head: leave it null (got {self.num_kv_heads})")
        _require(self.attention_bias == "none", "model.attention_bias",
                 f"model.attention=mla has no projection biases here: use none (got {self.attention_bias})")
        _require(self.qk_norm == "none", "model.qk_norm",
                 f"model.attention=mla normalises its compressed vectors instead: use none (got {self.qk_norm})")
        _require(self.partial_rotary_factor == 1.0, "model.partial_rotary_factor",
                 "model.attention=mla rotates exactly qk_rope_head_dim features: use 1.0 and set qk_rope_head_dim")

    def _check_rope(self):
        if self.rope_type != "yarn":
            return
        _require(self.position_encoding == "rope", "model.rope_type", "yarn scales RoPE: needs model.position_encoding=rope")
        _require(self.rope_factor > 1.0 and math.isfinite(self.rope_factor), "model.rope_factor",
                 f"must be a finite number > 1 with model.rope_type=yarn (the context-extension factor; 1 scales "
                 f"nothing: use model.rope_type=default), got {self.rope_factor}")
        _require(self.original_max_position_embeddings is not None and self.original_max_position_embeddings >= 1,
                 "model.original_max_position_embeddings",
                 f"model.rope_type=yarn needs the pretraining context length (>= 1), got "
                 f"{self.original_max_position_embeddings}")
        _require(self.beta_fast > 0 and self.beta_slow > 0, "model.beta_fast",
                 f"beta_fast and beta_slow must be > 0, got {self.beta_fast} and {self.beta_slow}")

    @property
    def dense_ff(self) -> int:
        """Hidden width of the dense feed-forward layers (``dense_d_ff``, else ``d_ff``)."""
        return self.d_ff if self.dense_d_ff is None else self.dense_d_ff

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """Features of each query/key head that RoPE rotates: ``qk_rope_head_dim`` with MLA, else
        ``int(head_dim * partial_rotary_factor)`` (Hugging Face's rounding)."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has an MoE feed-forward."""
        if layer < self.num_dense_layers:
            return False
        return (layer - self.num_dense_layers) % self.moe_every == 0

    def moe_layer_names(self) -> list[str]:
        """What each row of the per-layer MoE statistics (``tokens_per_expert``, ``dropped_fraction``,
        ...) and of the routing state belongs to: ``"MoE layer i"`` for the main model's L_moe MoE
        layers (i = 0 .. L_moe - 1, the row index), then ``"MTP module k"`` (k = 1 .. D) for the
        ``mtp_depth`` multi-token prediction blocks, MoE layers whenever the main model has one."""
        n = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        return [f"MoE layer {i}" for i in range(n)] + [f"MTP module {k}" for k in range(1, self.mtp_depth + 1) if n]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts routing.

    Attributes:
      num_experts: E, experts per MoE layer.
      top_k: K, experts chosen per token.
      capacity_factor: dimensionless multiplier; capacity per expert is
        ``ceil(capacity_factor * tokens * top_k / num_experts)`` clamped to ``[min_capacity, tokens]``
        (GShard, Lepikhin et al. 2020, sec. 2.2), where ``tokens`` counts the tokens of one routing
        group (the tokens on one device). ``None`` means the default, 1.25. **0 means dropless**:
        every assignment is computed (a sort-free permutation by expert plus grouped matmuls, see
        ``grouped_matmul``; with an expert axis > 1 only the routed rows travel:
        ``ragged_all_to_all`` on GPU, a dense all-to-all of tokens × top_k rows per peer on CPU).
      grouped_matmul: the experts' grouped matmul of the dropless path,
        ``moefast.kernels.grouped_matmul``: ``"pallas"`` (a Pallas Triton grouped GEMM over
        (row tile, expert) pairs: the real rows plus less than 64 rows per expert boundary; for
        GPU, interpreted on CPU), ``"ragged_dot"`` (``jax.lax.ragged_dot``: a grouped kernel on
        TPU, but dense one-hot work on XLA:GPU and XLA:CPU, ≈ E× the FLOPs), ``"tiled"`` (the real
        rows plus less than 128 rows per expert, in 512-row tiles with a run-time trip count; for
        CPU) or ``"auto"`` (``pallas`` when compiling for GPUs, ``tiled`` on CPU, ``ragged_dot`` on
        TPU).
      dispatch: how tokens move into the experts' [E, C, D] buffers and back (see
        :mod:`moefast.routing.dispatch`): ``"slot"`` (gathers by the routing's slots, linear in the
        tokens) or ``"onehot"`` (GShard's [T, E, C] dispatch and combine einsums, quadratic in the
        tokens per device: the baseline of ``moefast bench train --ablate``, the way most JAX MoE
        code does it). Same routing and results to float rounding. ``"onehot"`` needs a capacity
        (``capacity_factor > 0``); evaluation and generation, which route without capacity
        (C = tokens), always dispatch by slot.
      overlap_chunks: n, chunks of the expert-parallel exchange (expert axis > 1; ignored without
        one): each device's [E, C, D] buffer is split along capacity into n independent dispatch
        ``all_to_all`` → experts → return ``all_to_all`` chains, so communication can overlap the
        experts' compute. The capacity is rounded up to a multiple of n. At the same capacity,
        routing and losses are bitwise those of n = 1, outputs and gradients equal to float
        rounding (``moefast.parallel.expert.exchange_experts``).
      overlap_chain: tie chunk i's dispatch to chunk i-2's expert output
        (``jax.lax.optimization_barrier``), so at most two chunks' buffers are in flight.
      min_capacity: lower bound of the capacity, in slots.
      routing_policy: which assignments keep their slots when an expert is over capacity:
        ``"position"`` (GShard order: earlier choices and earlier tokens first) or ``"priority"``
        (largest router probability first; batch-prioritised routing, V-MoE sec. 3.3).
      routing_impl: implementation of the routing kernel (``moefast.kernels.routing``):
        ``"reference"`` (jnp), ``"pallas"`` (the fused kernel; interpreted on CPU, so slow there, and
        not usable under a multi-device mesh on CPU), ``"triton"`` (the same kernel in Triton through
        jax-triton, the ``[gpu]`` extra; GPU only), or ``"auto"`` (``"pallas"`` when the step is
        compiled for GPUs, the reference elsewhere).
      capacity_mode: ``"static"``, or ``"dynamic"``: the buffer is sized by ``capacity_factor_max``
        and each expert's slots are limited to ``capacity_factor * tokens * top_k * ema_e`` clamped
        to the capacities of ``capacity_factor_min`` and ``capacity_factor_max``, where ``ema_e`` is
        an exponential moving average (decay ``load_ema_decay``) of expert e's share of the routed
        assignments, kept in the train state and checkpointed.
      capacity_factor_min, capacity_factor_max: bounds of the dynamic capacity (capacity factors).
      load_ema_decay: decay per step of the load average (dynamic capacity).
      aux_free_bias_rate: aux-loss-free balancing (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2): a
        per-expert float32 bias added, for selection only, to the scores experts are chosen on
        (the router logits with ``score_func: softmax``, the sigmoid affinities with ``sigmoid``:
        HF's ``e_score_correction_bias``; never part of a gate), updated after every step by
        ``bias += rate * sign(mean_load - load)`` outside the optimizer; 0 disables it.
      aux_loss_coef: weight of the load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4).
      z_loss_coef: weight of the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5).
      warmup_steps: expert warm-up: for the first ``warmup_steps`` optimizer steps routing is
        randomised (``warmup_routing``) so every expert sees data; 0 disables it. Evaluation and
        generation are never randomised.
      warmup_routing: ``"noise"``: Gaussian noise of std ``warmup_noise`` added to the router
        logits (noisy top-k gating, Shazeer et al. 2017, eq. 3-5, without the learned noise
        scale); ``"uniform"``: experts chosen uniformly at random per token with equal gates (the
        router logits are replaced by ``1e-3 * Gumbel`` noise, so the router gets no gradient
        during warm-up).
      warmup_noise: noise std, in logit units (``"noise"`` warm-up).
      aux_loss_coef_start: if set, the load-balancing coefficient starts at this value and decays
        linearly to ``aux_loss_coef`` at ``warmup_steps`` (needs ``warmup_steps > 0``).
      norm_topk_prob: the K gates are the chosen scores renormalised to sum to 1 (True: Mixtral,
        Qwen3-MoE, DeepSeek-V3, GLM-4.5 checkpoints; sigmoid scores are divided by their sum
        ``+ 1e-20`` as in HF's DeepSeek-V3) or the scores as they are (False: Switch, OLMoE,
        Qwen2-MoE, DeepSeek-V2, whose HF code never renormalises); Hugging Face's name. Choices
        and capacity do not depend on it.
      score_func: the router's scores (``moefast.kernels.routing.reference``): ``"softmax"`` over
        the experts (Mixtral, Qwen, OLMoE, DeepSeek-V2) or ``"sigmoid"`` per expert (DeepSeek-V3,
        Kimi K2, GLM-4.5; HF's remote-code ``scoring_func``). It also fixes the group score below.
      num_groups: G, the experts form G groups of ``num_experts / G`` consecutive experts for the
        group-limited top-k (HF ``n_group``); 1: no group limit (what a one-group checkpoint such as
        GLM-4.5 or Kimi K2 means). A token first keeps its ``topk_groups`` best groups, by the sum
        of each group's two best biased sigmoid scores (``sigmoid``: DeepSeek-V3 "noaux_tc") or by
        its best softmax probability (``softmax``: DeepSeek-V2 "group_limited_greedy"), then
        chooses its top_k experts among the kept groups only (the others' scores set to -inf, as
        DeepSeek-V3 and Hugging Face do), whatever the sign of the (finite) biased scores; a
        selection bias of -inf ties such an expert with the dropped ones (lower index first).
      topk_groups: groups kept per token, in [1, num_groups] (HF ``topk_group``).
      routed_scaling_factor: dimensionless multiplier of the routed experts' gates, applied once
        after ``norm_topk_prob``'s renormalisation and never to a shared expert (HF
        ``routed_scaling_factor``: 2.5 in DeepSeek-V3, 16 in DeepSeek-V2, 1.0 in V2-Lite); 1.0
        leaves the gates as they are.
      shared_expert_d_ff: hidden width of a shared SwiGLU expert that every token passes through
        besides its routed experts (Qwen2-MoE ``shared_expert``; DeepSeekMoE, Dai et al. 2024,
        sec. 3.2); 0: none.
      shared_expert_gate: the shared expert's output is scaled per token by
        ``sigmoid(x @ w_gate)`` (Qwen2-MoE ``shared_expert_gate``, a [D, 1] weight); False: added
        as it is.
    """

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None
    min_capacity: int = 4
    grouped_matmul: Literal["auto", "pallas", "ragged_dot", "tiled"] = "auto"
    dispatch: Literal["slot", "onehot"] = "slot"
    overlap_chunks: int = 1
    overlap_chain: bool = False
    routing_policy: Literal["position", "priority"] = "position"
    routing_impl: Literal["auto", "reference", "pallas", "triton"] = "auto"
    capacity_mode: Literal["static", "dynamic"] = "static"
    capacity_factor_min: float = 0.5
    capacity_factor_max: float = 2.0
    load_ema_decay: float = 0.99
    aux_free_bias_rate: float = 0.0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    warmup_steps: int = 0
    warmup_routing: Literal["noise", "uniform"] = "noise"
    warmup_noise: float = 1.0
    aux_loss_coef_start: float | None = None
    norm_topk_prob: bool = True
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_d_ff: int = 0
    shared_expert_gate: bool = True

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == 0

    def __post_init__(self):
        _check_choices(self, "moe")
        _require(self.num_experts >= 1, "moe.num_experts", f"must be >= 1, got {self.num_experts}")
        _require(1 <= self.top_k <= self.num_experts, "moe.top_k",
                 f"must be in [1, moe.num_experts={self.num_experts}], got {self.top_k}")
        if self.capacity_factor is None:
            object.__setattr__(self, "capacity_factor", DEFAULT_CAPACITY_FACTOR)
        _require(self.capacity_factor >= 0 and math.isfinite(self.capacity_factor), "moe.capacity_factor",
                 f"must be a finite number > 0, or 0 for dropless routing; got {self.capacity_factor}")
        _require(self.dispatch == "slot" or not self.dropless, "moe.dispatch",
                 "'onehot' needs a capacity (its tensors are [tokens, experts, capacity]); dropless routing "
                 "(moe.capacity_factor=0) dispatches by slot: use moe.dispatch=slot or a capacity_factor > 0")
        if self.capacity_mode == "dynamic":
            _require(not self.dropless, "moe.capacity_mode",
                     "dynamic capacity needs a capacity (moe.capacity_factor > 0); dropless has none")
            _require(0 < self.capacity_factor_min <= self.capacity_factor <= self.capacity_factor_max,
                     "moe.capacity_factor_min/max",
                     f"need 0 < capacity_factor_min ({self.capacity_factor_min}) <= capacity_factor "
                     f"({self.capacity_factor}) <= capacity_factor_max ({self.capacity_factor_max})")
        _require(0.0 <= self.load_ema_decay < 1.0, "moe.load_ema_decay",
                 f"must be in [0, 1), got {self.load_ema_decay}")
        _require(self.aux_free_bias_rate >= 0, "moe.aux_free_bias_rate",
                 f"must be >= 0, got {self.aux_free_bias_rate}")
        _require(self.shared_expert_d_ff >= 0, "moe.shared_expert_d_ff",
                 f"must be >= 0 (0 = no shared expert), got {self.shared_expert_d_ff}")
        _require(self.min_capacity >= 1, "moe.min_capacity", f"must be >= 1, got {self.min_capacity}")
        _require(1 <= self.overlap_chunks <= MAX_OVERLAP_CHUNKS, "moe.overlap_chunks",
                 f"must be in [1, {MAX_OVERLAP_CHUNKS}] (1 = one exchange, no chunking; every chunk adds "
                 f"collectives and a compiled copy of the experts), got {self.overlap_chunks}")
        _require(self.aux_loss_coef >= 0, "moe.aux_loss_coef", f"must be >= 0, got {self.aux_loss_coef}")
        _require(self.z_loss_coef >= 0, "moe.z_loss_coef", f"must be >= 0, got {self.z_loss_coef}")
        _require(self.warmup_steps >= 0, "moe.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(self.warmup_noise >= 0, "moe.warmup_noise", f"must be >= 0, got {self.warmup_noise}")
        _require(self.aux_loss_coef_start is None or (self.aux_loss_coef_start >= 0 and self.warmup_steps > 0),
                 "moe.aux_loss_coef_start", "needs moe.warmup_steps > 0 (the decay length) and a value >= 0; "
                 f"got {self.aux_loss_coef_start} with warmup_steps={self.warmup_steps}")
        self._check_groups()

    def _check_groups(self):
        e, g = self.num_experts, self.num_groups
        _require(g >= 1 and e % g == 0, "moe.num_groups",
                 f"must be >= 1 and divide moe.num_experts={e} (groups of equal size), got {g}")
        _require(1 <= self.topk_groups <= g, "moe.topk_groups",
                 f"must be in [1, moe.num_groups={g}], got {self.topk_groups}")
        limited = g > 1 and self.topk_groups < g
        _require(not limited or self.score_func == "softmax" or e // g >= 2, "moe.num_groups",
                 f"{g} groups of {e // g} expert: a sigmoid group's score is the sum of its two best experts "
                 "(DeepSeek-V3), so each group needs >= 2 experts")
        _require(not limited or self.top_k <= self.topk_groups * (e // g), "moe.topk_groups",
                 f"keeps {self.topk_groups} groups of {e // g} experts, fewer than moe.top_k={self.top_k}")
        _require(self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor),
                 "moe.routed_scaling_factor", f"must be a finite number > 0, got {self.routed_scaling_factor}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline.

    Attributes:
      source: ``"stdlib"`` (the running interpreter's standard-library ``.py`` files), a directory, a
        glob of text files, a ``.jsonl`` file (or glob), a ``.parquet`` file (or glob), a Hugging Face
        ``datasets`` directory (``save_to_disk``), or a corpus written by ``moefast prepare`` (a
        directory holding ``manifest.json``: token shards read lazily; its split and tokenizer were
        fixed when it was prepared, so ``text_field`` and ``val_fraction`` are not used and
        ``tokenizer`` must be the same).
      text_field: field holding the text in ``.jsonl`` / ``.parquet`` records.
      tokenizer: ``"byte"`` (256 byte ids + BOS/EOS/PAD) or a path to a Hugging Face tokenizer directory / tokenizer.json.
        A relative path is looked up in the run directory first (``moefast import-hf`` stores the
        run's own copy as ``tokenizer``, so the run dir can move), then in the working directory.
      seq_len: tokens per packed row (T).
      batch_size: global batch, in rows (B), summed over all processes and devices.
      val_fraction: fraction of documents (by hash of their path/id) held out for validation; when
        the hash holds out none, those of smallest hash, or each document's tail for a corpus too
        small for whole ones (``moefast.data.sources.split_documents``).
      prefetch: training batches read, converted and put on the devices ahead of use, on a
        background thread per process (the overlap lever: the step never waits for the host
        pipeline in steady state); 0 reads each batch when the step needs it. ``"auto"`` (default):
        1 on GPU/TPU, 0 on CPU, where host and devices share the cores and the thread only competes
        with XLA's (docs/perf.md, "Overlap lever"). A checkpoint saves the pipeline position of the
        last batch trained on, so resume is exact either way.
      format: ``"text"`` (pretraining: every token of every document is a target) or ``"sft"``:
        ``source`` is a ``.jsonl`` file (or glob, or directory) of conversations
        ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the chat template
        beside ``tokenizer``'s tokenizer.json and trained on the assistant's tokens only, each
        conversation whole in one row (:mod:`moefast.data.sft`).
      sft_overlong: with ``format: sft``, a conversation longer than a row (more than ``seq_len`` + 1
        tokens): ``"truncate"`` keeps its first ``seq_len`` tokens (so the next example starts on the
        next row), ``"drop"`` leaves it out; the corpus summary counts either.
    """

    source: str = "stdlib"
    text_field: str = "text"
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 8
    val_fraction: float = 0.02
    prefetch: int | Literal["auto"] = "auto"
    format: Literal["text", "sft"] = "text"
    sft_overlong: Literal["truncate", "drop"] = "truncate"

    def __post_init__(self):
        _check_choices(self, "data")
        _require(self.seq_len >= 2, "data.seq_len", f"must be >= 2, got {self.seq_len}")
        _require(self.batch_size >= 1, "data.batch_size", f"must be >= 1, got {self.batch_size}")
        _require(0.0 < self.val_fraction < 1.0, "data.val_fraction",
                 f"must be in (0, 1), got {self.val_fraction}")
        _require(bool(self.source), "data.source", "must not be empty")
        _require(self.prefetch == "auto" or self.prefetch >= 0, "data.prefetch",
                 f"must be 'auto' or >= 0 (0 = no prefetch), got {self.prefetch}")

    def prefetch_batches(self, platform: str) -> int:
        """Batches in flight on ``platform`` (the mesh's, :func:`moefast.parallel.platform`): ``prefetch`` resolved."""
        if self.prefetch == "auto":
            return 0 if platform == "cpu" else 1
        return self.prefetch


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the training loop.

    Attributes:
      steps: total optimizer steps; the learning-rate schedule spans them.
      stop_at: end the run at this step with a checkpoint (as a preemption would); ``None`` = steps.
      seed: seed of parameter initialisation, data order and dropout keys.
      learning_rate: peak AdamW learning rate.
      warmup_steps: linear warm-up length, in steps.
      min_lr_ratio: final learning rate of the cosine decay, as a fraction of the peak.
      weight_decay: AdamW decoupled weight decay (matrices only).
      b1, b2: AdamW moment decay rates.
      grad_clip: global-norm clipping threshold; 0 disables clipping.
      log_every: steps between training log records.
      eval_every: steps between evaluations (0 = only at the end).
      eval_batches: validation batches per evaluation.
      checkpoint_every: steps between checkpoints (0 = only at the end).
      max_consecutive_nonfinite: a step whose loss or gradients are not finite is skipped
        (parameters, optimizer and routing state unchanged) and logged; after this many skipped
        steps in a row the run stops with an error naming the last good checkpoint.
      grad_accum_steps: M, micro-batches per optimizer step: the global batch
        (``data.batch_size`` rows) is split into M micro-batches of ``batch_size / M`` rows (micro-batch
        m holds rows m, m + M, m + 2M, ... so each device keeps its own rows) run one after another
        inside the jitted step (``jax.lax.scan``), their gradients summed before one update. The
        cross-entropy is normalised by the loss weight of the whole global batch and the z-loss by
        its non-padding tokens, so both equal M = 1's; the load-balancing loss is the mean of the
        micro-batches' values (it is not linear in the batch; never scaled by M or the data-parallel
        size). Capacity counts the tokens of one micro-batch on one device. Memory of activations
        falls about M-fold; tokens per step, the data stream and resume are unchanged.
      peak_tflops: peak TFLOP/s of one device, the denominator of MFU (on CPU: of the whole
        processor); ``None`` = from the table of known accelerators, or on CPU a matmul probe
        measured at start (:mod:`moefast.train.mfu`).
      mtp_loss_coef: lambda, the weight of the multi-token prediction loss (DeepSeek-V3, arXiv
        2412.19437, eq. 25): ``L_MTP = lambda / D * sum_k L_MTP^k`` is added to the training loss,
        each ``L_MTP^k`` the mean cross-entropy of module k's valid targets. DeepSeek-V3 used 0.3,
        then 0.1. Ignored when ``model.mtp_depth`` is 0 (any value >= 0 is accepted then); 0 with
        modules trains them not at all but still logs their losses.
    """

    steps: int = 600
    stop_at: int | None = None
    seed: int = 0
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    log_every: int = 25
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 200
    max_consecutive_nonfinite: int = 5
    peak_tflops: float | None = None
    grad_accum_steps: int = 1
    mtp_loss_coef: float = 0.3

    def __post_init__(self):
        _check_choices(self, "train")
        _require(self.steps >= 1, "train.steps", f"must be >= 1, got {self.steps}")
        _require(self.stop_at is None or 1 <= self.stop_at <= self.steps, "train.stop_at",
                 f"must be null or in [1, train.steps={self.steps}], got {self.stop_at}")
        _require(0 <= self.seed < 2**32, "train.seed", f"must be in [0, 2**32), got {self.seed}")
        _require(self.learning_rate > 0, "train.learning_rate", f"must be > 0, got {self.learning_rate}")
        _require(self.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio",
                 f"must be in [0, 1], got {self.min_lr_ratio}")
        _require(self.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "train.b1/train.b2", "must be in [0, 1)")
        _require(self.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {self.grad_clip}")
        _require(self.log_every >= 1, "train.log_every", f"must be >= 1, got {self.log_every}")
        _require(self.eval_every >= 0, "train.eval_every", f"must be >= 0, got {self.eval_every}")
        _require(self.eval_batches >= 1, "train.eval_batches", f"must be >= 1, got {self.eval_batches}")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every",
                 f"must be >= 0, got {self.checkpoint_every}")
        _require(self.peak_tflops is None or self.peak_tflops > 0, "train.peak_tflops",
                 f"must be null (known accelerator or CPU probe) or > 0 TFLOP/s per device, got {self.peak_tflops}")
        _require(self.grad_accum_steps >= 1, "train.grad_accum_steps",
                 f"must be >= 1 (1 = no accumulation), got {self.grad_accum_steps}")
        _require(self.max_consecutive_nonfinite >= 1, "train.max_consecutive_nonfinite",
                 f"must be >= 1, got {self.max_consecutive_nonfinite}")
        _require(math.isfinite(self.mtp_loss_coef) and self.mtp_loss_coef >= 0, "train.mtp_loss_coef",
                 f"must be a finite number >= 0, got {self.mtp_loss_coef}")

    @property
    def last_step(self) -> int:
        return self.steps if self.stop_at is None else self.stop_at


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh (see :mod:`moefast.parallel.mesh`). The product of the axes must equal the
    number of devices; one axis may be ``-1``, meaning "the rest".

    Attributes:
      data: data-parallel axis (batch split, parameters replicated).
      fsdp: fully-sharded data-parallel axis (batch split, parameters and optimizer state split).
      expert: expert-parallel axis (batch split, experts split; must divide ``moe.num_experts``).
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1

    def __post_init__(self):
        _check_choices(self, "mesh")
        for k in ("data", "fsdp", "expert"):
            v = getattr(self, k)
            _require(v == -1 or v >= 1, f"mesh.{k}", f"must be -1 (the rest) or >= 1, got {v}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing (orbax).

    Attributes:
      keep: number of most recent checkpoints kept on disk.
      async_save: write checkpoints in a background thread while training continues.
    """

    keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        _check_choices(self, "checkpoint")
        _require(self.keep >= 1, "checkpoint.keep", f"must be >= 1, got {self.keep}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The caching lever: work that does not change between steps is done once.

    Attributes:
      tables: True: positional tables (RoPE cos/sin, sinusoidal encodings) are computed once per
        (length, width, base, dtype) with NumPy in float64 and folded into the compiled step as
        constants, gathered by position once per step for all layers, and the attention mask is
        built once per step for all layers. False: every layer computes its phases, sines and
        cosines (float32) and its own mask inside the step — the baseline that
        ``moefast bench cache`` measures against. Numerics agree to float32 rounding.
      compile_dir: XLA's persistent compilation cache: a restart with the same program skips
        XLA compilation. ``"auto"`` = ``$XDG_CACHE_HOME/moefast/xla`` (``~/.cache/moefast/xla``);
        a directory (a relative one is relative to the working directory of each command); or
        ``null`` / ``false`` / ``off`` to turn it off. The cache is per user, not per run: any
        earlier run of the same program fills it. Small programs are cached too (the minimum
        compile time for caching is lowered to 0 s).
    """

    tables: bool = True
    compile_dir: str | bool | None = "auto"

    def __post_init__(self):
        _check_choices(self, "cache")
        if self.compile_dir is False:  # YAML reads false / off / no as False
            object.__setattr__(self, "compile_dir", None)
        _require(self.compile_dir is not True, "cache.compile_dir",
                 "true is not a directory; use 'auto' (the default), a directory, or null / false (off)")
        _require(self.compile_dir is None or bool(str(self.compile_dir).strip()), "cache.compile_dir",
                 "must be 'auto', a directory, or null / false (off); got an empty string")
        _require(not (isinstance(self.compile_dir, str) and self.compile_dir.lower() == "none"), "cache.compile_dir",
                 f"{self.compile_dir!r} would be a directory named {self.compile_dir}; write null or false "
                 "(unquoted) to turn the cache off, or ./None for that directory")


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """The overlap lever's process-wide settings (the expert exchange's chunks are
    ``moe.overlap_chunks``; device prefetch is ``data.prefetch``).

    Attributes:
      xla_flags: on a GPU backend, add XLA's flags for the latency-hiding scheduler, pipelined
        collectives and collective combining (:data:`moefast.parallel.xla_flags.GPU_FLAGS`) to
        ``XLA_FLAGS`` before JAX starts, never replacing a flag already set there; printed at start.
        No effect on CPU/TPU, or once JAX's backend has started (a note says so).
    """

    xla_flags: bool = True


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Expert-load monitoring (every ``train.log_every`` steps, per MoE layer, on that step's batch).

    Attributes:
      max_load_ratio: alert when an MoE layer's busiest expert gets more than this multiple of the
        mean assignments per expert (max/mean load; at most ``num_experts / top_k``) ...
      patience: ... for this many consecutive log intervals; also alert when an expert gets no
        tokens for that many intervals. An alert is a warning line in the console and an
        ``alert`` record in ``metrics.jsonl``, once per episode: the same condition alerts again
        only after it has cleared.
    """

    max_load_ratio: float = 3.0
    patience: int = 3

    def __post_init__(self):
        _check_choices(self, "monitor")
        _require(self.max_load_ratio > 1.0, "monitor.max_load_ratio",
                 f"must be > 1 (1 = perfectly balanced), got {self.max_load_ratio}")
        _require(self.patience >= 1, "monitor.patience", f"must be >= 1, got {self.patience}")


_SECTIONS = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "cache": CacheConfig,
    "overlap": OverlapConfig,
    "monitor": MonitorConfig,
}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one section per part of the system, plus a name (used for the run dir)."""

    name: str = "tiny"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    overlap: OverlapConfig = dataclasses.field(default_factory=OverlapConfig)
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)

    def __post_init__(self):
        _require(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
                 f"{self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                 "lower data.seq_len or raise model.max_seq_len")
        m = self.train.grad_accum_steps
        _require(self.data.batch_size % m == 0, "train.grad_accum_steps",
                 f"must divide data.batch_size={self.data.batch_size} (micro-batches of whole rows), got {m}")
        _require(self.model.mtp_depth < self.data.seq_len, "model.mtp_depth",
                 f"{self.model.mtp_depth} leaves no target inside a row of data.seq_len={self.data.seq_len} "
                 "tokens; lower model.mtp_depth")

    def replace(self, **sections: Any) -> "ExperimentConfig":
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, Any]:
        """Nested dicts of plain YAML/JSON values (tuples become lists)."""
        plain = lambda v: [plain(x) for x in v] if isinstance(v, (list, tuple)) else (  # noqa: E731
            {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v)
        return plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "config") -> "ExperimentConfig":
        """Builds a config from nested dicts, rejecting unknown keys and wrong types."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a mapping of sections, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_SECTIONS) - {"name"})
        if unknown:
            raise ConfigError(f"{where}: unknown section '{unknown[0]}'{_suggest(unknown[0], _SECTIONS)}; "
                              f"valid sections: {sorted(_SECTIONS)} and 'name'")
        kwargs: dict[str, Any] = {}
        if "name" in d:
            kwargs["name"] = _coerce("name", d["name"], str)
        for sec, typ in _SECTIONS.items():
            body = d.get(sec) or {}
            if not isinstance(body, dict):
                raise ConfigError(f"{sec}: expected a mapping, got {body!r}")
            kwargs[sec] = _build_section(sec, typ, body)
        return cls(**kwargs)


def _build_section(sec: str, typ: type, body: dict[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(typ)}
    hints = typing.get_type_hints(typ)
    for k in body:
        if k not in fields:
            raise ConfigError(f"{sec}.{k}: unknown key{_suggest(k, fields)}; valid keys of '{sec}': {sorted(fields)}")
    vals = {k: _coerce(f"{sec}.{k}", v, hints[k]) for k, v in body.items()}
    return typ(**vals)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Checks ``value`` against a type annotation, converting int -> float where allowed."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}"
                              f"{_suggest(str(value), [str(c) for c in choices])}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # X or null: X's own message (it names a bad list entry)
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}: {value!r} does not fit {_type_name(typ)}")
    if origin is tuple:  # tuple[X, ...]: a YAML list
        (item, _) = typing.get_args(typ)
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    elif typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - guards new field types
        raise ConfigError(f"{key}: unsupported field type {typ!r}")
    raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r} ({type(value).__name__})")


def _type_name(typ: Any) -> str:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(typ))
    if typing.get_origin(typ) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(typ))
    if typing.get_origin(typ) is tuple:
        return f"a list of ({_type_name(typing.get_args(typ)[0])})"
    return getattr(typ, "__name__", str(typ))


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """Parses ``section.key=value`` strings into nested dicts; values are read as YAML scalars.

    Raises:
      ConfigError: an override is not of the form ``section.key=value``.
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value (e.g. train.steps=200)")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        if parts == ["name"]:
            out["name"] = value
            continue
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override {item!r}: expected section.key=value (e.g. train.steps=200); "
                              f"sections: {sorted(_SECTIONS)}")
        if parts[0] not in _SECTIONS:
            raise ConfigError(f"override {item!r}: unknown section '{parts[0]}'{_suggest(parts[0], _SECTIONS)}; "
                              f"valid sections: {sorted(_SECTIONS)}")
        out.setdefault(parts[0], {})[parts[1]] = value
    return out


def without_invocation_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A config (nested dicts, as in a YAML file) without :data:`INVOCATION_KEYS`: what a run dir's
    ``config.yaml`` holds. Returns a copy; other keys and malformed sections are kept as they are."""
    out = dict(raw)
    for sec, keys in INVOCATION_KEYS.items():
        if isinstance(out.get(sec), dict):
            out[sec] = {k: v for k, v in out[sec].items() if k not in keys}
    return out


def _is_run_config(path: Path) -> bool:
    """``path`` is a run dir's own ``config.yaml`` (``moefast train`` writes it next to ``checkpoints/``)."""
    return path.name == "config.yaml" and (path.parent / "checkpoints").is_dir()


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k].update(v)
        else:
            merged[k] = v
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Loads a YAML config and applies ``section.key=value`` overrides.

    Args:
      path: YAML file; ``None`` loads ``configs/tiny.yaml``. A bare file name, or ``configs/NAME``,
        that does not exist here but is a shipped config (``h200_1b.yaml``) loads the shipped one
        (so ``configs/tiny.yaml`` works outside the checkout, e.g. from its notebooks/). The config's
        ``name`` defaults to the file's stem.
      overrides: e.g. ``["train.steps=200", "moe.top_k=1"]``.

    Raises:
      ConfigError: missing/unparsable file, unknown key, wrong type or impossible value, or
        ``overrides`` not a list of strings.
    """
    if isinstance(overrides, (str, bytes)) or not (
            overrides is None or (isinstance(overrides, (list, tuple)) and all(isinstance(o, str) for o in overrides))):
        hint = f" (a single override: [{overrides!r}])" if isinstance(overrides, str) else ""
        raise ConfigError(f"overrides: expected a list of 'section.key=value' strings{hint}, got "
                          f"{type(overrides).__name__} {overrides!r}"[:300])
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file() and path.parent in (Path("."), Path("configs")) and (CONFIG_DIR / path.name).is_file():
        path = CONFIG_DIR / path.name  # a shipped config by name (or as the checkout names it), from any directory
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; shipped configs: "
                          f"{sorted(p.name for p in CONFIG_DIR.glob('*.yaml'))}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    raw.setdefault("name", path.stem)
    if _is_run_config(path):  # an older moefast kept train.stop_at there: it was that invocation's
        raw = without_invocation_keys(raw)
    raw = _merge(raw, parse_overrides(list(overrides or [])))
    return ExperimentConfig.from_dict(raw, where=str(path))
