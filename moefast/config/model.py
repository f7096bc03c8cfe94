"""The ``model`` section: the decoder-only transformer's shape (:class:`ModelConfig`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .fields import _check_choices, _require


MAX_SEQUENCE_SLICES = 8
"""The most ``model.sequence_slices``: each slice's layers compile as code of their own."""


FFN_SUBLAYERS = ("moe", "mlp")
"""``model.layer_types`` entries that are a feed-forward sublayer alone (Nemotron-H's patterns)."""


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
        sec. 3.4), ``"sinusoidal"`` (absolute encodings added to the token embeddings; Vaswani et
        al. 2017, sec. 3.5) or ``"none"`` (NoPE: no position information at all; attention sees
        order only through the causal mask and any linear-attention layers. With ``"mla"`` the
        ``qk_rope_head_dim`` features of queries and the shared key stay, unrotated: Kimi Linear's
        MLA layers, Kimi Team 2025, arXiv 2510.26692 sec. 4; transformers' ``KimiLinearAttention``).
        ``"none"`` goes with ``rope_type=default`` and ``partial_rotary_factor`` 1 (nothing rotates).
      rope_base: RoPE wavelength base (Su et al. 2021, RoFormer eq. 15).
      tie_embeddings: LM head reuses the token embedding matrix.
      num_dense_layers: leading blocks with a dense feed-forward instead of MoE.
      moe_every: after the leading dense layers, every ``moe_every``-th block is MoE, others dense.
      dtype: compute dtype of activations and matmuls (parameters stay float32; the router is
        always float32).
      precision: the input format of the GEMMs of the routed and shared experts, the attention
        projections (MLA's included) and the dense MLPs: ``"bf16"`` (in ``dtype``) or ``"fp8"``
        (DeepSeek-V3's recipe, Liu et al. 2024 sec. 3.3: e4m3 inputs, activations and gradients
        in 1 x 128 tiles, weights in 128 x 128 blocks, float32 sums; forward and both backward
        GEMMs; :mod:`moefast.parallel.fp8_gemm`), also the linear-attention mixers' input and
        output projections (Gated DeltaNet, KDA, Mamba-2) and MTP's ``eh_proj``. Master weights,
        optimizer state, norms, router, attention scores, KDA's low-rank gates, embeddings, the
        LM head and the losses keep ``dtype``/float32.
        On GPUs (compute capability 8.9 or later, with jax-triton) the GEMMs run in Triton FP8
        kernels (:mod:`moefast.kernels.fp8_matmul`); elsewhere the same numbers are emulated from
        the e4m3 values and their scales with float32 GEMMs (no speed-up); an older GPU is
        refused. Checkpoints hold the same float32 master weights either way: a run may resume
        with the other precision.
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
        unchanged; GLM-4.5 and MiniMax-M2: 0.5), Hugging Face's name. The rotated width must be
        even. 1.0 with ``"mla"`` (its RoPE width is ``qk_rope_head_dim``).
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
      rope_truncate: YaRN: the ramp's bounds rounded to whole rotary pairs (HF's
        ``rope_parameters.truncate``, true by default; gpt-oss: false).
      mscale, mscale_all_dim: YaRN: DeepSeek's attention-factor coefficients (HF's names; ``None``
        or 0: not set).
      index_topk: MLA: DeepSeek Sparse Attention (DSA; DeepSeek-V3.2-Exp tech report, sec. 2.1;
        transformers' ``models/deepseek_v32/modeling_deepseek_v32.py``, ``DeepseekV32Indexer``):
        each query attends only to the ``index_topk`` keys its lightning indexer scores highest
        among those it may see (all of them while it sees fewer). ``None`` (the default): dense MLA.
        Hugging Face's name, as are the next two. On the blocked path the selection narrows a
        dense mask; with ``attention_impl=flash`` MLA's absorbed form runs over the selected keys
        (the top-k kernel, :mod:`moefast.kernels.sparse_attention`). No gradient of the model's
        loss reaches the indexer; ``train.indexer_stage`` trains it by its own KL loss
        (:class:`moefast.model.mla.LightningIndexer`).
      index_n_heads: DSA: the indexer's query heads H^I (DeepSeek-V3.2: 64).
      index_head_dim: DSA: the indexer's query/key width d^I (DeepSeek-V3.2: 128); its first
        ``qk_rope_head_dim`` features are rotated, so it must be at least that.
      mtp_depth: D, multi-token prediction modules (DeepSeek-V3, arXiv 2412.19437, sec. 2.2,
        eqs. 21-25); 0 (the default) = none, the model and its loss exactly as without the field.
        Module k (1..D) projects ``[RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]`` (the checkpoint
        order of ``eh_proj``) from 2D to D, runs one transformer block of its own (MoE when the
        model has MoE layers, dense otherwise) and predicts token ``t_{i+k+1}`` through the shared
        embedding and output head after its own RMSNorm (:class:`moefast.model.MTPModule`). Its
        loss is weighted by ``train.mtp_loss_coef``; generation never runs the modules. Must be
        below ``data.seq_len``.
      sequence_slices: n, slices of each row carried separately through the layers (the overlap
        lever of the expert exchange across layers; DeepSeek's DualPipe idea without pipeline
        stages, as MaxText's batch-split schedule, but split along the sequence, since a device
        may hold a single row). Slice i attends to its own keys and those of the slices before
        it (the fused kernel's query offset, :func:`moefast.kernels.attention.flash_attention`),
        and its MoE layer routes its own tokens, so one slice's expert exchange can run under
        another's attention and experts, also across layers. The same function as n = 1 when no
        token is dropped (capacity is per slice, as for ``moe.overlap_chunks``), up to float
        rounding (attention sums in another order); dropout and expert warm-up noise draw from
        the step key folded with the slice. 1 (the default): one slice. Each slice's layers are
        traced and compiled as code of their own, so compile time and compiled-program memory grow
        about linearly in n (tiny config: 21 s at 1, 42 s at 2, 86 s at 4): 2 is the useful value,
        at most 8. Must divide ``data.seq_len``; not with Gated DeltaNet layers (``layer_types``:
        their state would have to pass between slices). Generation (a KV cache) runs whole rows
        whatever n is.
      layer_types: each block's token mixer, one entry per layer (Hugging Face's ``layer_types``):
        ``"full_attention"`` (the ``attention`` block above), ``"sliding_attention"`` (the same
        block over the ``sliding_window`` latest keys only; gpt-oss) or
        ``"linear_attention"``: Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464; Qwen3-Next,
        Qwen3.5 / Qwen3.6 MoE; :mod:`moefast.model.gated_deltanet`), whose state resets at every
        packed document's start.
        ``None``: every layer ``"full_attention"``. With ``scan_layers`` the repeating period of
        (token mixer, MoE or dense) is scanned (:mod:`moefast.model.layout`). Multi-token
        prediction blocks use full attention. A pattern holding ``"moe"`` or ``"mlp"`` entries is
        Nemotron-H's (HF ``layers_block_type``; :attr:`sublayers`): every entry is then one
        pre-norm residual sublayer, a token mixer alone (the three kinds above) or a feed-forward
        alone (``"moe"``: the MoE layer; ``"mlp"``: the dense MLP of ``dense_d_ff``), so
        ``num_layers`` counts sublayers; ``num_dense_layers`` and ``moe_every`` do not apply
        (0 and 1), nor multi-token prediction yet.
      dense_activation: the dense MLP's unit: ``"silu"`` (SwiGLU, a fused gate | up) or ``"relu2"``
        (``relu(h)²`` of one up projection; Nemotron-H's ``mlp_hidden_act``).
      sliding_window: W, the keys a ``"sliding_attention"`` layer's query sees: its W latest
        positions, itself included (Hugging Face's ``sliding_window``: key s when ``t - s < W``).
        Required by such layers, below ``max_seq_len`` (a window that covers the context is full
        attention); the fused kernel skips key blocks outside it. ``None``: no sliding layers (a
        window without a sliding layer is an error: it would change nothing).
      attention_sinks: each attention head learns a sink logit that joins every softmax's
        denominator, unscaled, with no value (gpt-oss; Xiao et al. 2023, arXiv 2309.17453), the
        ``sinks`` parameter [H] (HF ``self_attn.sinks``), in the fused kernel and the einsum path.
        GQA attention only.
      linear_num_key_heads, linear_num_value_heads: Gated DeltaNet query/key heads Hk and value
        heads Hv (a multiple of Hk: each key head serves Hv / Hk value heads); HF's names, as are
        the next three.
      linear_key_head_dim, linear_value_head_dim: Gated DeltaNet per-head key and value widths.
      linear_conv_kernel_dim: width of Gated DeltaNet's depthwise causal convolution, in tokens.
      linear_attention_impl: how Gated DeltaNet's recurrence is computed
        (:func:`moefast.kernels.gated_delta_rule.gated_delta_rule`): ``"reference"`` (token by token),
        ``"chunked"`` (the WY/UT form in 16-token chunks; the kernel's are 64), ``"pallas"`` (the
        fused kernel; compiled on GPU, interpreted on CPU) or ``"auto"`` (``"pallas"`` when
        compiling for GPUs, else ``"chunked"``). Decoding one token at a time uses the recurrence.
        All give the same model: a run may change it when it resumes.
      linear_attention_kind: the ``"linear_attention"`` layers' mixer: ``"gated_deltanet"`` (a
        decay per head; Qwen3-Next, Qwen3.5) or ``"kda"``, Kimi Delta Attention (a decay per key
        channel from a rank-K projection, separate q/k/v convolutions, a sigmoid-gated output norm;
        Kimi Linear, arXiv 2510.26692; :mod:`moefast.model.kda`), whose heads are
        ``linear_num_value_heads`` of ``linear_value_head_dim`` (keys and values alike: the key
        heads and width must equal them). KDA runs through the same ``linear_attention_impl``
        (its Pallas kernels take the per-channel decay). Or ``"mamba2"``: Mamba-2's state-space
        mixer (Nemotron-H / Nemotron 3; arXiv 2405.21060; :mod:`moefast.model.mamba2`), its heads
        ``linear_num_value_heads`` of ``linear_value_head_dim`` (HF ``mamba_num_heads``,
        ``mamba_head_dim``), its B and C shared by ``linear_num_key_heads`` groups (``n_groups``)
        of ``linear_key_head_dim`` state channels (``ssm_state_size``), its conv
        ``linear_conv_kernel_dim`` wide with a bias; ``linear_attention_impl`` picks its SSD scan
        (:mod:`moefast.kernels.mamba2`: ``"chunked"`` is the block decomposition in 128-token
        chunks, ``"pallas"`` the kernels in 64-token chunks). Not on a ``mesh.context`` axis.
      time_step_min: Mamba-2's floor on its time steps: ``dt = max(softplus(dt + dt_bias),
        time_step_min)`` (HF ``time_step_min``: transformers' Nemotron-H clamps at it). Only
        ``linear_attention_kind=mamba2`` reads it.
      attention_output_gate: full-attention layers gate their output per feature with
        ``sigmoid(x W_gate)`` before the output projection (Qwen3-Next / Qwen3.5's ``q_proj``,
        twice as wide, holds the gate).
      zero_centered_norm: every RMSNorm scale is stored as ``w`` and applied as ``1 + w``, starting
        at 0 (Qwen3-Next / Qwen3.5); Gated DeltaNet's output norm keeps a plain scale.
      global_head_dim: the head width of the ``"full_attention"`` layers (and multi-token prediction
        blocks) in a model with sliding layers, where it differs from the sliding layers' ``head_dim``
        (Gemma 4: 512 against 256; HF's ``global_head_dim``); even, >= 2. ``None``: ``head_dim``.
      num_global_kv_heads: the key/value heads of the full-attention layers (Gemma 4: 2 against 8;
        HF's ``num_global_key_value_heads``); divides ``num_heads``. ``None``: ``num_kv_heads``.
      global_rope_base: the full-attention layers' own RoPE base (Gemma 4's
        ``rope_parameters.full_attention.rope_theta``: 1e6), > 1; ``None``: ``rope_base``. With it
        or the next key, the full layers' RoPE is their own; needs sliding layers
        (``layer_types``) and plain RoPE (``position_encoding=rope``, ``rope_type=default``,
        ``partial_rotary_factor`` 1).
      global_rotary_fraction: the fraction of the full-attention layers' frequency pairs that
        rotate, HF's "proportional" RoPE (``partial_rotary_factor`` of ``rope_type: proportional``;
        Gemma 4: 0.25), in (0, 1]: pair i < ``int(fraction * Hd / 2)`` turns features i and
        i + Hd/2 at the whole head's frequency ``base ** (-2i / Hd)``, the other features pass
        unchanged. ``None``: every pair (plain RoPE).
      attention_k_eq_v: the full-attention layers have no value projection: their values are the
        keys' projection before the key norm and RoPE (Gemma 4's ``attention_k_eq_v``; their
        ``qk`` [D, (H + G)·Hd] replaces ``qkv``).
      value_norm: every attention layer RMS-normalises each head's values, without a learned
        scale (Gemma 4's ``v_norm``).
      attention_scale: the softmax's logit multiplier; ``None``: ``head_dim ** -0.5`` (Vaswani et
        al. 2017, eq. 1). Gemma 4: 1.0 (its q/k norms set the logits' size).
      sandwich_norm: each block also RMS-normalises its attention output and its feed-forward output
        before adding them to the residual stream (``post_attn_norm``, ``post_ffn_norm`` [D]; Gemma
        2-4's ``post_attention_layernorm`` and ``post_feedforward_layernorm``; the pre-norms keep
        their names ``attn_norm`` / ``ffn_norm``).
      embed_scale: token embeddings are multiplied by ``sqrt(d_model)`` in the compute dtype
        (Gemma); the tied output head uses the embedding matrix unscaled.
      final_logit_softcapping: C, logits become ``C * tanh(logits / C)`` (Gemma 2, Gemma Team 2024,
        sec. 2; HF's name); ``None``: none.
      layer_scalar: each block's output (the whole residual stream) is multiplied by a learned
        scalar ``layer_scalar`` [1], starting at 1 (Gemma 4; transformers keeps it as a buffer that
        fine-tuning does not change, moefast trains it like the norm scales, without weight decay).
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
    position_encoding: Literal["rope", "sinusoidal", "none"] = "rope"
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    num_dense_layers: int = 0
    moe_every: int = 1
    dtype: Literal["float32", "bfloat16"] = "float32"
    precision: Literal["bf16", "fp8"] = "bf16"
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
    rope_truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    index_topk: int | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    mtp_depth: int = 0
    sequence_slices: int = 1
    layer_types: tuple[Literal["full_attention", "sliding_attention", "linear_attention", "moe", "mlp"], ...] | None = None
    dense_activation: Literal["silu", "relu2"] = "silu"
    sliding_window: int | None = None
    attention_sinks: bool = False
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_attention_impl: Literal["auto", "reference", "chunked", "pallas"] = "auto"
    linear_attention_kind: Literal["gated_deltanet", "kda", "mamba2"] = "gated_deltanet"
    time_step_min: float = 0.001
    attention_output_gate: bool = False
    zero_centered_norm: bool = False
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    global_rope_base: float | None = None
    global_rotary_fraction: float | None = None
    attention_k_eq_v: bool = False
    value_norm: bool = False
    attention_scale: float | None = None
    sandwich_norm: bool = False
    embed_scale: bool = False
    final_logit_softcapping: float | None = None
    layer_scalar: bool = False

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
        _require(1 <= self.sequence_slices <= MAX_SEQUENCE_SLICES, "model.sequence_slices",
                 f"must be in [1, {MAX_SEQUENCE_SLICES}] (1: each row through the layers whole; every slice is "
                 f"traced and compiled as code of its own), got {self.sequence_slices}")
        _require(self.position_encoding != "none" or self.partial_rotary_factor == 1.0, "model.partial_rotary_factor",
                 f"{self.partial_rotary_factor} with model.position_encoding=none: nothing rotates without RoPE; use 1.0 "
                 "(or position_encoding=rope)")
        _require(self.sliding_window is None or "sliding_attention" in (self.layer_types or ()),
                 "model.sliding_window", f"{self.sliding_window} with no sliding_attention layer would change "
                 "nothing: list the sliding layers in model.layer_types (e.g. [sliding_attention, full_attention, "
                 "...]) or leave model.sliding_window null")
        _require(not self.attention_sinks or self.attention == "gqa", "model.attention_sinks",
                 "sinks are per head of GQA attention (model.attention=gqa), not MLA")
        self._check_attention()
        self._check_rope()
        self._check_layer_types()
        self._check_global()
        _require(self.sequence_slices == 1 or "linear_attention" not in (self.layer_types or ()),
                 "model.sequence_slices", f"{self.sequence_slices} slices with linear-attention layers "
                 f"({self.linear_attention_kind}, model.layer_types): their recurrent state does not pass between "
                 "slices; use 1")

    def _check_layer_types(self):
        if self.layer_types is None:
            return
        if isinstance(self.layer_types, list):  # built in code with a list: keep the config hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        kinds = ("full_attention", "sliding_attention", "linear_attention", "moe", "mlp")
        bad = [f"{i}: {k!r}" for i, k in enumerate(self.layer_types) if k not in kinds]
        _require(not bad, "model.layer_types", f"entries must be one of {list(kinds)}; got {', '.join(bad)}")
        _require(len(self.layer_types) == self.num_layers, "model.layer_types",
                 f"needs one entry per layer: {len(self.layer_types)} entries for model.num_layers={self.num_layers}")
        if self.sublayers:  # Nemotron-H: one sublayer per entry
            _require(self.num_dense_layers == 0 and self.moe_every == 1, "model.layer_types",
                     "holds moe / mlp sublayers, which say where the feed-forwards are: set model.num_dense_layers=0 "
                     f"and model.moe_every=1 (got num_dense_layers={self.num_dense_layers}, moe_every={self.moe_every})")
            _require(self.mtp_depth == 0, "model.mtp_depth", f"{self.mtp_depth} with a sublayer pattern "
                     "(moe / mlp entries in model.layer_types): multi-token prediction modules of sublayers are not "
                     "built yet; use 0")
            _require(any(k not in FFN_SUBLAYERS for k in self.layer_types), "model.layer_types",
                     "holds feed-forward sublayers only: add a token mixer (full_attention, linear_attention)")
        if "sliding_attention" in self.layer_types:
            w = self.sliding_window
            _require(w is not None and 1 <= w < self.max_seq_len, "model.sliding_window",
                     f"sliding_attention layers need a window of 1 to model.max_seq_len - 1 = {self.max_seq_len - 1} "
                     f"keys (a window covering the context is full attention: use full_attention), got {w}")
            _require(self.attention == "gqa", "model.layer_types",
                     "sliding_attention layers are GQA attention (model.attention=gqa), not MLA")
        if "linear_attention" not in self.layer_types:
            return
        for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim"):
            _require(getattr(self, k) >= 1, f"model.{k}", f"must be >= 1, got {getattr(self, k)}")
        if self.linear_attention_kind == "kda":
            _require(self.linear_num_key_heads == self.linear_num_value_heads
                     and self.linear_key_head_dim == self.linear_value_head_dim, "model.linear_attention_kind",
                     f"kda layers have as many key as value heads, of one width (keys, queries and values alike); "
                     f"set model.linear_num_key_heads={self.linear_num_value_heads} and "
                     f"model.linear_key_head_dim={self.linear_value_head_dim} (or change the value side)")
        _require(self.time_step_min >= 0, "model.time_step_min", f"must be >= 0, got {self.time_step_min}")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0, "model.linear_num_value_heads",
                 f"must be a multiple of model.linear_num_key_heads={self.linear_num_key_heads} (each key head "
                 f"serves the same number of value heads), got {self.linear_num_value_heads}")

    def _check_global(self):
        own = [k for k in ("global_head_dim", "num_global_kv_heads", "global_rope_base", "global_rotary_fraction")
               if getattr(self, k) is not None]
        _require(not own or "sliding_attention" in (self.layer_types or ()), f"model.{own[0] if own else ''}",
                 "the full-attention layers' own shape and RoPE need sliding layers beside them (model.layer_types "
                 "with sliding_attention entries); without them set head_dim, num_kv_heads and the RoPE fields "
                 "themselves")
        _require(self.global_head_dim is None or (self.global_head_dim >= 2 and self.global_head_dim % 2 == 0),
                 "model.global_head_dim", f"must be even and >= 2 (RoPE turns pairs), got {self.global_head_dim}")
        g = self.num_global_kv_heads
        _require(g is None or (g >= 1 and self.num_heads % g == 0), "model.num_global_kv_heads",
                 f"must divide model.num_heads={self.num_heads}, got {g}")
        _require(self.global_rope_base is None or self.global_rope_base > 1.0, "model.global_rope_base",
                 f"must be > 1, got {self.global_rope_base}")
        f = self.global_rotary_fraction
        _require(f is None or (0.0 < f <= 1.0 and int(f * self.full_head_dim // 2) >= 1),
                 "model.global_rotary_fraction", f"must be in (0, 1] and rotate at least one pair of the "
                 f"{self.full_head_dim} features, got {f}")
        if self.global_rope_base is not None or f is not None:
            key = "model.global_rope_base" if self.global_rope_base is not None else "model.global_rotary_fraction"
            _require(self.rope_type == "default" and self.partial_rotary_factor == 1.0 and self.attention == "gqa"
                     and self.position_encoding == "rope", key, "the full layers' own RoPE goes with plain RoPE on "
                     "the sliding layers (model.position_encoding=rope, rope_type=default, partial_rotary_factor=1.0, "
                     "attention=gqa)")
        for k in ("attention_k_eq_v", "value_norm"):
            _require(not getattr(self, k) or self.attention == "gqa", f"model.{k}",
                     "keys as values and the value norm are GQA attention's (model.attention=gqa), not MLA's")
        _require(not self.attention_k_eq_v or self.attention_bias == "none", "model.attention_bias",
                 f"{self.attention_bias} with model.attention_k_eq_v: keys as values have no value projection to "
                 "bias; use none")
        _require(self.attention_scale is None or (self.attention_scale > 0 and math.isfinite(self.attention_scale)),
                 "model.attention_scale", f"must be a finite number > 0 or null (head_dim ** -0.5), got "
                 f"{self.attention_scale}")
        c = self.final_logit_softcapping
        _require(c is None or (c > 0 and math.isfinite(c)), "model.final_logit_softcapping",
                 f"must be a finite number > 0 or null (no capping), got {c}")

    @property
    def full_head_dim(self) -> int:
        """Head width of the ``"full_attention"`` layers (``global_head_dim``, else ``head_dim``)."""
        return self.head_dim if self.global_head_dim is None else self.global_head_dim

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """``(key/value heads, head width)`` of block ``layer``'s attention: the full-attention
        layers' own (``num_global_kv_heads``, ``global_head_dim``) where set, else ``num_kv_heads``
        and ``head_dim``."""
        if self.layer_type(layer) == "full_attention":
            g = self.kv_heads if self.num_global_kv_heads is None else self.num_global_kv_heads
            return g, self.full_head_dim
        return self.kv_heads, self.head_dim

    def at_layer(self, layer: int) -> "ModelConfig":
        """This config as block ``layer`` sees it: ``num_kv_heads`` and ``head_dim`` are that
        layer's (:meth:`attention_shape`), so code that reads one attention shape from a config
        (the HF tables' splits) reads the layer's."""
        g, hd = self.attention_shape(layer)
        if (g, hd) == (self.kv_heads, self.head_dim):
            return self
        return dataclasses.replace(self, num_kv_heads=g, head_dim=hd, global_head_dim=None, num_global_kv_heads=None,
                                   global_rope_base=None, global_rotary_fraction=None)

    @property
    def full_layer_rope(self) -> bool:
        """The full-attention layers have RoPE of their own (``global_rope_base`` or
        ``global_rotary_fraction`` set)."""
        return self.global_rope_base is not None or self.global_rotary_fraction is not None

    @property
    def sublayers(self) -> bool:
        """Whether ``layer_types`` is a Nemotron-H pattern: each entry one sublayer (``"moe"`` and
        ``"mlp"`` entries present)."""
        return self.layer_types is not None and any(k in FFN_SUBLAYERS for k in self.layer_types)

    def is_ffn_sublayer(self, layer: int) -> bool:
        """Whether block ``layer`` is a feed-forward alone (a ``"moe"`` or ``"mlp"`` entry of a
        sublayer pattern, :attr:`sublayers`): no token mixer."""
        return self.layer_type(layer) in FFN_SUBLAYERS

    def layer_type(self, layer: int) -> str:
        """Block ``layer``'s token mixer: ``"full_attention"``, ``"sliding_attention"`` or
        ``"linear_attention"`` (blocks past ``num_layers``, the multi-token prediction blocks, use
        full attention)."""
        if self.layer_types is None or layer >= self.num_layers:
            return "full_attention"
        return self.layer_types[layer]

    def _check_attention(self):
        if self.index_topk is not None:
            _require(self.attention == "mla", "model.index_topk", "DeepSeek Sparse Attention's indexer selects keys "
                     f"for MLA: needs model.attention=mla (got {self.attention}), or leave index_topk null")
            for k in ("index_topk", "index_n_heads", "index_head_dim"):
                v = getattr(self, k)
                _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"model.{k}",
                         f"must be a positive int (or model.index_topk null: dense MLA), got {v!r}"
                         if k == "index_topk" else f"must be a positive int with model.index_topk set, got {v!r}")
            _require(self.index_head_dim >= self.qk_rope_head_dim, "model.index_head_dim",
                     f"the indexer rotates its first qk_rope_head_dim={self.qk_rope_head_dim} features: must be at "
                     f"least that, got {self.index_head_dim}")
            _require(bool(self.q_lora_rank), "model.q_lora_rank", "the DSA indexer reads MLA's query latent: "
                     f"needs q_lora_rank >= 1 with model.index_topk set, got {self.q_lora_rank}")
            _require(self.sequence_slices == 1, "model.sequence_slices",
                     "model.index_topk (sparse MLA, the reference path) runs on whole rows: use 1")
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
        _require(self.position_encoding != "sinusoidal", "model.position_encoding",
                 "model.attention=mla rotates its qk_rope_head_dim features (rope) or leaves them unrotated (none, "
                 "Kimi Linear's NoPE MLA); sinusoidal encodings are not added to MLA models: use rope or none")
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
        if self.sublayers:
            return layer < self.num_layers and self.layer_types[layer] == "moe"
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

