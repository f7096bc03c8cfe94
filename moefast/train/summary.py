"""What a run returns (:class:`TrainSummary`) and the error that ends one (:class:`TrainingError`)."""

from __future__ import annotations

import dataclasses

__all__ = ["TrainSummary", "TrainingError"]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many consecutive non-finite steps); the message names the
    step and the last good checkpoint."""


@dataclasses.dataclass
class TrainSummary:
    steps: int  # optimizer steps completed in total
    steps_this_run: int
    final_loss: float | None  # training cross-entropy of the last step (nats/token)
    eval_loss: float | None  # validation cross-entropy (nats/token)
    eval_bits_per_byte: float | None
    eval_step: int | None  # the step the validation figures belong to
    tokens_per_s: float | None  # mean training throughput after the first (compiling) step, evaluation excluded
    first_step_s: float | None  # time to first step: from the start of run() to the first completed
    # step (state init or restore, tracing, compilation or a compilation-cache hit, the step itself)
    wall_s: float
    checkpoint: str | None
    memory: dict[str, int] | None = None  # bytes per device, see Trainer.memory_per_device
    skipped_steps: int = 0  # updates skipped for non-finite loss or gradients
    page_faults_per_step: float | None = None  # minor page faults of the process per timed step (as
    # tokens_per_s: after the first step, evaluation excluded); ~0 when host memory stays mapped
    stopped_by: str | None = None  # the signal that ended the run early (after a checkpoint)
    mfu: float | None = None  # model FLOPs utilisation at tokens_per_s (moefast.train.mfu), a fraction
    model_flops_per_token: float | None = None  # training FLOPs per token (moefast.model.flops)

    def format(self) -> str:
        f = lambda v, spec: "n/a" if v is None else format(v, spec)
        return (f"steps {self.steps} ({self.steps_this_run} this run) | train loss {f(self.final_loss, '.4f')} | "
                f"val loss {f(self.eval_loss, '.4f')} | val bits/byte {f(self.eval_bits_per_byte, '.4f')}"
                + (f" (at step {self.eval_step})" if self.eval_step not in (None, self.steps) else "") + " | "
                f"{f(self.tokens_per_s, ',.0f')} tokens/s"
                + (f" (MFU {100 * self.mfu:.1f}%)" if self.mfu is not None else "")
                + f" | time to first step {f(self.first_step_s, '.2f')} s | "
                f"wall {self.wall_s:.1f} s | checkpoint {self.checkpoint or 'none'}"
                + (f" | {self.skipped_steps} non-finite steps skipped" if self.skipped_steps else "")
                + (f" | stopped by {self.stopped_by}" if self.stopped_by else "")
                + ("" if not self.memory else f" | per device: params {self.memory['param_bytes'] / 2**20:.1f} MiB, "
                   f"optimizer {self.memory['optimizer_bytes'] / 2**20:.1f} MiB"))
