"""The sections that say how a model is trained, not what it is: ``data``, ``train``, ``mesh``,
``checkpoint``, ``cache``, ``overlap`` and ``monitor``."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .fields import _check_choices, _require

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
      optimizer: ``"adamw"`` or ``"muon"``: Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is
        Scalable for LLM Training", arXiv 2502.16982) on the hidden weight matrices, each
        orthogonalised on its own (attention's q, k, v and o, each expert's gate, up and down),
        AdamW (``b1``, ``b2``) on the rest; which parameter gets which is one table,
        :data:`moefast.train.optimizer.PARAM_KINDS` (docs/optimizer.md). Both take
        ``learning_rate``, its schedule, ``weight_decay`` and ``grad_clip``. Changing it on resume
        needs ``moefast train --reset-optimizer`` (the weights kept, the optimizer state new).
      muon_scale: Muon's update scale: ``"moonlight"`` multiplies each orthogonalised matrix of
        [m, n] by ``0.2 * sqrt(max(m, n))``, which gives it AdamW's update RMS so AdamW's learning
        rate and weight decay carry over (arXiv 2502.16982, sec. 2.2, eq. 4); ``"none"`` keeps
        Keller Jordan's ``sqrt(max(1, n / m))`` (n outputs, m inputs), which needs a learning rate
        of its own (about 0.02).
      qk_clip: MuonClip's tau (Kimi K2, arXiv 2507.20534, sec. 2.1): after each update, every
        attention head whose largest pre-softmax logit of the step exceeded tau has its query and
        key weights scaled down so it would be tau (:mod:`moefast.train.qk_clip`); ``None`` = off.
        Any optimizer; Kimi K2 used 100. The per-layer largest logit is logged either way.
      indexer_stage: how DeepSeek Sparse Attention's lightning indexers train (``model.index_topk``;
        DeepSeek-V3.2-Exp tech report, sec. 2.1.1): ``"none"``: not at all (they stay as imported,
        as transformers runs them); ``"dense_warmup"``: attention stays dense, every parameter but
        the indexers' is frozen (no optimizer state, bitwise unchanged), and each indexer learns
        the KL divergence from its layer's attention distribution (summed over heads,
        L1-normalised) to the softmax of its scores over the keys each query may see (eq. 3);
        ``"sparse"``: attention over the indexers' selection, everything trains, each indexer by
        the same KL over its selected keys only (eq. 4), its input detached, so the language-model
        loss never reaches it and its KL reaches nothing else. The KL per token (mean over the
        layers) is added to the loss and logged as ``indexer_loss``. The warm-up also holds the MoE
        routing state (selection bias, load average) as it is. Changing it on resume needs
        ``moefast train --reset-optimizer`` (a fresh optimizer state: the stages train other
        parameters); not with ``lora``.
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
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_scale: Literal["moonlight", "none"] = "moonlight"
    qk_clip: float | None = None
    indexer_stage: Literal["none", "dense_warmup", "sparse"] = "none"

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
        _require(self.qk_clip is None or (math.isfinite(self.qk_clip) and self.qk_clip > 0), "train.qk_clip",
                 f"must be null (off) or a logit threshold tau > 0 (Kimi K2 used 100), got {self.qk_clip}")

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
      context: context-parallel axis (``moefast.parallel.context``): every row's tokens split over
        it, in 2 x context chunks of which each device holds a mirrored pair (chunks j and
        2 x context - 1 - j: the same causal attention work on every device, as Megatron-LM and
        MaxText order them); attention communicates along it (each device gathers the row's keys
        and values; for multi-head latent attention the compressed latent and the RoPE key),
        linear attention (Gated DeltaNet, KDA) passes its recurrent states and the convolution's
        last inputs (``moefast.parallel.linear_context``), and the expert exchange takes it as
        one more token axis. For rows too long for one device's activations. ``data.seq_len``
        must be a multiple of 2 x context (with linear-attention layers, of pieces of at least
        ``model.linear_conv_kernel_dim`` - 1 tokens); not with ``model.sequence_slices`` nor sparse
        MLA (``model.index_topk``: its indexer scores keys on other devices, not built yet) nor Mamba-2
        layers (``model.linear_attention_kind=mamba2``: their state does not pass along the axis yet);
        dropout masks differ from an unsplit run's (drawn over the
        reordered tokens). 1 (default): rows whole on each device. Never -1.
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    context: int = 1

    def __post_init__(self):
        _check_choices(self, "mesh")
        for k in ("data", "fsdp", "expert"):
            v = getattr(self, k)
            _require(v == -1 or v >= 1, f"mesh.{k}", f"must be -1 (the rest) or >= 1, got {v}")
        _require(self.context >= 1, "mesh.context", f"must be >= 1 (devices each row is split over), got {self.context}")


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
      collectives_in_flight: how many asynchronous collectives (1 to 16) XLA's latency-hiding
        scheduler may keep in flight at once on GPU (``xla_gpu_experimental_parallel_collective_overlap_limit``,
        a per-compilation option; XLA's default 1 runs the expert exchange and the ZeRO
        all-gathers one after another). Peers training with ragged all-to-alls (dropless with an
        expert axis) report gradients not repeatable run to run above 1; moefast has not run it
        on GPUs.
    """

    xla_flags: bool = True
    collectives_in_flight: int = 1

    def __post_init__(self):
        _require(1 <= self.collectives_in_flight <= 16, "overlap.collectives_in_flight",
                 f"must be in [1, 16] (1: XLA's default, one at a time), got {self.collectives_in_flight}")


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
