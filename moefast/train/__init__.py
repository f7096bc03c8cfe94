"""Train state, steps, loop, checkpoints, metrics and sampling.

The loop (:mod:`~moefast.train.loop`, :class:`Trainer`) over its parts: :mod:`~moefast.train.resume`
(fresh or restored state), :mod:`~moefast.train.timing` (metrics and step times),
:mod:`~moefast.train.evaluation`, :mod:`~moefast.train.signals`, :mod:`~moefast.train.profiling`,
:mod:`~moefast.train.run_dir` and :mod:`~moefast.train.checkpoint`.
"""

from moefast.train.checkpoint import CheckpointError, Checkpointer
from moefast.train.generate import generate
from moefast.train.loop import Trainer, config_warnings
from moefast.train.run_dir import load_run_config
from moefast.train.step import ModelDef, eval_step, learning_rate_schedule, make_optimizer, train_step
from moefast.train.summary import TrainingError, TrainSummary

__all__ = ["CheckpointError", "Checkpointer", "ModelDef", "TrainSummary", "Trainer", "TrainingError", "config_warnings",
           "eval_step", "generate", "learning_rate_schedule", "load_run_config", "make_optimizer",
           "train_step"]
