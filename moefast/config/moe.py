"""The ``moe`` section: routing, capacity, dispatch and the expert layer (:class:`MoEConfig`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .fields import _check_choices, _require

DEFAULT_CAPACITY_FACTOR = 1.25
MAX_OVERLAP_CHUNKS = 16


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
        rounding (``moefast.parallel.expert.exchange_experts``). With ``exchange: hierarchical``
        the device's tokens are split instead, in n slices in position order (their number must
        divide the tokens per device), each sent on its own two hops with capacities for its
        tokens (``moefast.parallel.hierarchical.hierarchical_exchange``): one slice's exchange runs
        under another's experts (DeepSeek-V3's two overlapped micro-batches, sec. 3.2.1, inside a
        layer). When no hop drops anything, outputs equal n = 1 to float rounding; with drops
        each slice's capacities drop differently from one slice's.
      dispatch_dtype: what the expert exchange's dispatch moves (expert axis > 1, with a capacity):
        ``"compute"`` (the model's compute dtype) or ``"float8_e4m3fn"`` (FP8 dispatch, DeepSeek-V3
        sec. 3.3: e4m3 with a float32 scale per 128 channels of each row, about half the bytes of
        bfloat16; the experts get the dequantized rows, so their input is rounded to e4m3's 3
        mantissa bits relative to each tile's max-abs; the return and the backward exchanges stay in
        the compute dtype). Needs ``model.d_model`` divisible by 128 and, on GPUs, FP8 hardware
        (compute capability 8.9 or later: Ada, Hopper, Blackwell).
      exchange: how the expert exchange crosses hosts (expert axis > 1, with a capacity): ``"flat"``
        (one ``all_to_all`` over the whole expert axis each way, a capacity buffer per expert) or
        ``"hierarchical"`` (node-limited routing's two hops, DeepSeek-V3 sec. 2.1.2 and 3.2.2: each
        token once to every host it routes to, then over NVLink to its experts' GPUs; the combine
        summed inside the host before going back; :mod:`moefast.parallel.hierarchical`). Needs an
        expert axis of several whole hosts of ``gpus_per_host``, and with group-limited routing
        groups aligned with hosts (``num_groups`` a multiple of the hosts), so a token reaches at most
        ``topk_groups`` hosts. Each hop has its own capacity from ``capacity_factor``: with nothing
        dropped the output equals the flat exchange's up to float rounding.
      gpus_per_host: G, GPUs per host along the expert axis (consecutive expert ranks h·G .. h·G+G-1
        share host h), for ``exchange: hierarchical``; on GPUs it must match the devices' hosts.
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
      expert_activation: the experts' gated unit on the fused gate|up projection, the shared
        expert's included: ``"silu"``, SwiGLU ``silu(gate) * up`` (Shazeer 2020); ``"gelu_tanh"``,
        GeGLU ``gelu(gate) * up`` with the tanh approximation of GELU (Shazeer 2020; Hendrycks and
        Gimpel 2016, sec. 2; Gemma 4's ``gelu_pytorch_tanh``); ``"clamped_swiglu"``, gpt-oss's
        ``(clip(up, -L, L) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, L)``, L =
        ``swiglu_limit`` (Hugging Face ``GptOssExperts``); or ``"relu2"``, not gated: ``relu(h)²``
        of one up projection (Nemotron-H's ``relu2``; So et al. 2021, "Primer", sec. 3), so
        ``w_in`` is [E, D, F] (and the shared expert's [D, F]). Dense layers stay SwiGLU.
      swiglu_limit: L of ``"clamped_swiglu"`` (HF ``swiglu_limit``; gpt-oss: 7).
      expert_bias: the routed experts' projections have biases, ``b_in`` [E, 2F] and ``b_out``
        [E, D] (gpt-oss's ``gate_up_proj_bias``, ``down_proj_bias``).
      router_bias: the router's logits have a bias [E] (gpt-oss's ``router.bias``): it changes
        the scores, unlike the aux-loss-free selection bias (``aux_free_bias_rate``), which only
        changes the choice.
      branch_norms: Gemma 4's MoE block: the shared expert (a dense MLP of ``shared_expert_d_ff``
        beside the experts, ungated) reads the block's normalised input, the routed experts
        their own RMSNorm of the residual stream (``routed_in_norm`` [D]), and each branch's
        output is RMS-normalised (``shared_out_norm``, ``routed_out_norm`` [D]) before the two are
        added; the router reads ``RMSNorm(x) * router_scale * D ** -0.5`` of the residual stream
        (an RMSNorm without a weight, then a learned ``router_scale`` [D]; HF
        ``Gemma4TextRouter``). Needs ``shared_expert_d_ff`` > 0 without ``shared_expert_gate``.
      per_expert_scale: each routed expert's gates are multiplied by a learned scale of its own
        (``expert_scale`` [E], starting at 1), after ``norm_topk_prob`` (HF Gemma 4's
        ``router.per_expert_scale``); the choice does not change.
      latent_size: the routed experts work in a latent width L < D (Nemotron 3 Super's latent MoE,
        HF ``moe_latent_size``): ``fc1_latent_proj`` [D, L] projects each token down before the
        exchange and ``fc2_latent_proj`` [L, D] their gated sum back up; the router and the shared
        expert read the full width. The exchange moves L features a token instead of D. ``None``:
        the experts work in D.
    """

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None
    min_capacity: int = 4
    grouped_matmul: Literal["auto", "pallas", "ragged_dot", "tiled"] = "auto"
    dispatch: Literal["slot", "onehot"] = "slot"
    overlap_chunks: int = 1
    overlap_chain: bool = False
    dispatch_dtype: Literal["compute", "float8_e4m3fn"] = "compute"
    exchange: Literal["flat", "hierarchical"] = "flat"
    gpus_per_host: int = 8
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
    expert_activation: Literal["silu", "gelu_tanh", "clamped_swiglu", "relu2"] = "silu"
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    router_bias: bool = False
    branch_norms: bool = False
    per_expert_scale: bool = False
    latent_size: int | None = None

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == 0

    @property
    def gated(self) -> bool:
        """Whether the experts' input projection is a fused gate | up pair (2F wide), not a single
        up projection (``expert_activation="relu2"``)."""
        return self.expert_activation != "relu2"

    def __post_init__(self):
        _check_choices(self, "moe")
        _require(self.latent_size is None or (isinstance(self.latent_size, int) and self.latent_size >= 1),
                 "moe.latent_size", f"must be null (the experts work in d_model) or a positive int, got {self.latent_size!r}")
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
        _require(self.dispatch_dtype == "compute" or not self.dropless, "moe.dispatch_dtype",
                 "FP8 dispatch quantizes the capacity buffers of the expert exchange; dropless routing "
                 "(moe.capacity_factor=0) moves ragged rows: use moe.dispatch_dtype=compute or a capacity_factor > 0")
        _require(self.gpus_per_host >= 1, "moe.gpus_per_host", f"must be >= 1, got {self.gpus_per_host}")
        if self.exchange == "hierarchical":
            _require(not self.dropless and self.dispatch == "slot" and self.capacity_mode == "static", "moe.exchange",
                     "hierarchical has its own two capacities: it needs a capacity_factor > 0 with moe.dispatch=slot "
                     "and moe.capacity_mode=static; change those or use moe.exchange=flat")
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
        _require(not self.branch_norms or (self.shared_expert_d_ff > 0 and not self.shared_expert_gate),
                 "moe.branch_norms", "Gemma 4's block runs a dense MLP beside the experts: set "
                 "moe.shared_expert_d_ff to its width (> 0) and moe.shared_expert_gate=false, or leave branch_norms "
                 f"false (got shared_expert_d_ff={self.shared_expert_d_ff}, shared_expert_gate="
                 f"{str(self.shared_expert_gate).lower()})")
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
        _require(self.swiglu_limit > 0 and math.isfinite(self.swiglu_limit), "moe.swiglu_limit",
                 f"must be a finite number > 0, got {self.swiglu_limit}")

