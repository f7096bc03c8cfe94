"""Where a run starts: a fresh train state, or the run dir's latest checkpoint (exact resume).

The policy: a run dir with a checkpoint is resumed from its newest step that restores (train
state, data-iterator position and the loop's host state, so the steps after it are bit-identical
to an uninterrupted run); a change of mesh or of train settings since the checkpoint is allowed
and said in a note; an incompatible checkpoint fails before anything is written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from moefast.config import INVOCATION_KEYS, ExperimentConfig
from moefast.train.checkpoint import Checkpointer

__all__ = ["OptimizerReset", "RunStart", "start_or_resume"]


@dataclasses.dataclass
class RunStart:
    state: dict[str, Any]  # the train state (params, opt_state, routing, step) in its shardings
    step: int  # optimizer steps already done
    loop_state: dict[str, Any]  # host state of the loop saved with the checkpoint (e.g. {"monitor": ...})


@dataclasses.dataclass
class OptimizerReset:
    """How a resume replaces the optimizer state (``moefast train --reset-optimizer``)."""
    abstract: Callable[[ExperimentConfig], Any]  # a config's abstract optimizer state, with shardings
    fresh: Callable[[dict, Any], Any]  # (params, schedule count) -> this run's new optimizer state

    @classmethod
    def of(cls, trainer) -> "OptimizerReset":
        """A :class:`~moefast.train.Trainer`'s: any config's optimizer state on its mesh (the
        checkpoint's, to read it), and a fresh state of its own optimizer in its shardings."""
        import jax

        from moefast import parallel
        from moefast.train.step import make_optimizer, split_trainable, with_schedule_count

        md, mesh = trainer.model_def, trainer.mesh
        trainable = lambda p: md.split(p)[0]

        def abstract(cfg):  # what that config trains (train.indexer_stage may differ from this run's)
            state = jax.eval_shape(make_optimizer(cfg).init, split_trainable(cfg, md.abstract_params)[0])
            shard = parallel.shardings(mesh, trainer._opt_spec(cfg, state))
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shard)

        def fresh(params, count):
            init = lambda p, c: with_schedule_count(make_optimizer(trainer.cfg).init(trainable(p)), c)
            with jax.set_mesh(mesh):
                return jax.jit(init, out_shardings=trainer.state_sharding["opt_state"])(params, count)

        return cls(abstract, fresh)


def start_or_resume(cfg: ExperimentConfig, ckpt: Checkpointer, data_iter, *, init_state: Callable[[], dict],
                    abstract_state: Callable[[], dict], log: Callable[[str], None],
                    identity: dict[str, Any] | None = None, reset_optimizer: OptimizerReset | None = None) -> RunStart:
    """The state a run starts from: the latest checkpoint in ``ckpt`` (its data position is set on
    ``data_iter``), or ``init_state()`` when there is none.

    Args:
      cfg: this run's config.
      ckpt: the run dir's checkpoints.
      data_iter: the training data iterator (grain, with ``set_state``), positioned at the start.
      init_state: makes a fresh train state in its shardings.
      abstract_state: the train state's ``jax.ShapeDtypeStruct`` tree with shardings (the restore target).
      log: console printer for the resume line and notes.
      identity: what this run trains with, as :meth:`Checkpointer.save` records it
        (``"tokenizer"``, ``"corpus"``).
      reset_optimizer: restore the checkpoint's optimizer state as its own config has it (any
        ``train.optimizer``), then start a fresh one of this run's, its learning-rate schedule at
        the checkpoint's count; weights, routing state, step and data position kept.

    Raises:
      CheckpointError: no checkpoint restores, or one was written with another model/moe/data
        config or tokenizer (:meth:`Checkpointer.restore`); its data position refers to a
        prepared corpus that was prepared again since (``data.source`` now holds another corpus);
        one of another ``train.optimizer`` without ``reset_optimizer``; nothing is written before this.
    """
    if ckpt.latest_step() is None:
        if reset_optimizer is not None:
            log("note: --reset-optimizer: no checkpoint in this run dir, so the run starts from scratch")
        return RunStart(init_state(), 0, {})
    identity = identity or {}
    # before anything is written; the tokenizer and the corpus are checked before any array is read
    restored = ckpt.restore(abstract_state(), cfg, tokenizer=identity.get("tokenizer"), corpus=identity.get("corpus"),
                            opt_state_of=reset_optimizer and reset_optimizer.abstract)
    start = restored.step
    if restored.data_state is not None:  # None: an imported step 0 (Trainer.initialize), data not yet read
        data_iter.set_state(restored.data_state)
    log(f"resuming from step {start} ({ckpt.directory / str(start)})")
    saved = restored.meta.get("config", {})
    now = cfg.to_dict()
    if saved.get("mesh") is not None and saved["mesh"] != now["mesh"]:
        log(f"note: mesh changed from {saved['mesh']} to {now['mesh']}: the state was restored into the new "
            "shardings; routing groups (tokens per device) differ, so losses will not match the old mesh bit for bit")
    saved_train = saved.get("train", {}) if start else {}  # step 0 (an imported run): no schedule to keep
    saved_steps = saved_train.get("steps")
    if saved_steps is not None and saved_steps != cfg.train.steps:
        log(f"note: train.steps changed from {saved_steps} to {cfg.train.steps}: the learning-rate schedule now "
            f"spans {cfg.train.steps} steps, so this run is not a resume of the original schedule")
    ignored = ("steps", *INVOCATION_KEYS["train"])
    changed = [f"{k} {saved_train[k]!r} -> {v!r}" for k, v in now["train"].items()
               if k not in ignored and k in saved_train and saved_train[k] != v]
    if changed:
        log(f"note: train settings changed since the checkpoint: {', '.join(changed)}")
    state = restored.state
    if reset_optimizer is not None:
        from moefast.train.step import schedule_count

        count = schedule_count(state["opt_state"])
        state = {**state, "opt_state": reset_optimizer.fresh(state["params"], count)}
        log(f"note: --reset-optimizer: a fresh {cfg.train.optimizer} state (was "
            f"{saved.get('train', {}).get('optimizer', 'adamw')}); weights, routing state, step and data position "
            f"kept, the learning-rate schedule continues at update {int(count)}"
            + ("; a fresh AdamW's first updates are about the learning rate in every coordinate: expect the loss "
               "to rise for a few steps (docs/optimizer.md)" if cfg.train.optimizer == "adamw" else ""))
    return RunStart(state, start, restored.meta.get("loop") or {})
