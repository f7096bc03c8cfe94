"""The ``lora`` section: low-rank adapters on a frozen base (:class:`LoRAConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from .fields import _check_choices, _require

LORA_TARGETS = ("attention", "mlp", "shared_experts", "experts")
"""What ``lora.targets`` may name: every projection of the token mixers (GQA's ``qkv``/``qk``,
``gate`` and ``out``; MLA's ``q_a``/``q_b``/``q``/``kv_a``/``kv_b``/``o``; Gated DeltaNet's
``in_proj`` and ``out``), the dense MLPs, the shared experts, the routed experts (each its own A
and B)."""

LORA_TRAIN = ("router", "norms", "embeddings", "head", "biases")
"""Frozen-by-default parameters ``lora.train`` may make trainable (in full, next to the adapters)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Fine-tuning with low-rank adapters on a frozen base (LoRA and QLoRA).

    Each targeted projection ``W`` [in, out] computes ``x W + (alpha / r) (x A) B`` with trainable
    ``A`` [in, r] and ``B`` [r, out] (LoRA: Hu et al. 2021, arXiv 2106.09685, eq. 3); the base
    weights are frozen (no gradients, no optimizer state). ``moefast import-hf ... lora.rank=16``
    starts such a run from a downloaded model; docs/finetuning.md.

    Attributes:
      rank: r, the adapters' rank; 0 (default) = no adapters (every parameter trains).
      alpha: the scale's numerator, ``alpha / r`` (PEFT's ``lora_alpha``); ``None``: ``rank``
        (scale 1). The routed experts use ``alpha / expert_rank``.
      targets: which projections get adapters (:data:`LORA_TARGETS`); ``None`` (default): every
        kind the model has. Named explicitly, each must adapt something (the config refuses
        ``experts`` for a model without MoE layers). Every routed expert gets its own ``A`` [in, r]
        and ``B`` [r, out], stored as [E, in, r] and [E, r, out] and sharded like the experts' weights.
      expert_rank: the routed experts' rank; ``None``: ``rank``.
      init: ``A``'s initialiser, ``B`` always starting at 0 so the adapted model at step 0 is the
        base model bitwise: ``"kaiming_uniform"`` (PEFT's default: uniform in +-1/sqrt(in)) or
        ``"gaussian"`` (normal with std 1/r, PEFT's ``init_lora_weights="gaussian"``).
      base_dtype: how the frozen base is stored: ``"bfloat16"`` (default), ``"float32"``, or
        ``"nf4"`` (QLoRA, Dettmers et al. 2023, arXiv 2305.14314: the adapted projections as
        4-bit NormalFloat codes with a float32 absmax per 64 values, dequantized where each is
        used; the other frozen parameters bfloat16).
      train: frozen-by-default parameters to train in full as well (:data:`LORA_TRAIN`):
        ``router`` (router weights and biases), ``norms``, ``embeddings``, ``head``, ``biases``
        (of attention and experts).
      routing: ``"update"`` (default): the routing state (aux-loss-free selection biases, the load
        average) keeps updating as in pretraining; ``"frozen"``: kept as imported.
    """

    rank: int = 0
    alpha: float | None = None
    targets: tuple[str, ...] | None = None
    expert_rank: int | None = None
    init: Literal["kaiming_uniform", "gaussian"] = "kaiming_uniform"
    base_dtype: Literal["bfloat16", "float32", "nf4"] = "bfloat16"
    train: tuple[str, ...] = ()
    routing: Literal["update", "frozen"] = "update"

    def __post_init__(self):
        _check_choices(self, "lora")
        _require(self.rank >= 0, "lora.rank", f"must be >= 0 (0 = no adapters), got {self.rank}")
        _require(self.alpha is None or self.alpha > 0, "lora.alpha", f"must be null (= rank) or > 0, got {self.alpha}")
        _require(self.expert_rank is None or self.expert_rank >= 1, "lora.expert_rank",
                 f"must be null (= lora.rank) or >= 1, got {self.expert_rank}")
        for t in self.targets or ():
            _require(t in LORA_TARGETS, "lora.targets", f"{t!r} is not one of {list(LORA_TARGETS)}")
        for t in self.train:
            _require(t in LORA_TRAIN, "lora.train", f"{t!r} is not one of {list(LORA_TRAIN)}")
        _require(self.targets is None or bool(self.targets), "lora.targets",
                 f"is empty: name at least one of {list(LORA_TARGETS)}, or null for every kind the model has")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def set_without_rank(self) -> list[str]:
        """The keys set to other than their defaults while ``rank`` is 0 (where they do nothing)."""
        if self.rank:
            return []
        return [f.name for f in dataclasses.fields(self) if f.name != "rank" and getattr(self, f.name) != f.default]

    @property
    def target_kinds(self) -> tuple[str, ...]:
        """``targets``, ``None`` read as every kind (:data:`LORA_TARGETS`)."""
        return LORA_TARGETS if self.targets is None else self.targets

    def rank_of(self, target: str) -> int:
        """The rank of ``target``'s adapters (``expert_rank`` for ``"experts"``)."""
        return (self.expert_rank or self.rank) if target == "experts" else self.rank

    def scale(self, target: str) -> float:
        """``alpha / r`` of ``target``'s adapters (dimensionless)."""
        r = self.rank_of(target)
        return (self.rank if self.alpha is None else self.alpha) / r
