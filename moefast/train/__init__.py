"""Train state, steps, loop, checkpoints, metrics and sampling."""

from moefast.train.checkpoint import CheckpointError, Checkpointer
from moefast.train.generate import generate
from moefast.train.loop import Trainer, TrainingError, TrainSummary, config_warnings, load_run_config
from moefast.train.step import ModelDef, eval_step, learning_rate_schedule, make_optimizer, train_step

__all__ = ["CheckpointError", "Checkpointer", "ModelDef", "TrainSummary", "Trainer", "TrainingError", "config_warnings",
           "eval_step", "generate", "learning_rate_schedule", "load_run_config", "make_optimizer",
           "train_step"]
