"""Checkpoints with orbax ``CheckpointManager``: train state, data-iterator state, run metadata.

Layout: ``<run-dir>/checkpoints/<step>/{state,data,meta}``. ``state`` holds the parameters, optimizer
state and step (``StandardSave``); ``data`` the grain iterator state (``JsonSave``); ``meta`` the
config, seed and step (``JsonSave``). Saves are asynchronous by default; orbax writes each step to
a temporary directory and renames it when complete, so a crash never leaves a half-written step
that looks finished.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from moefast.config import ExperimentConfig

__all__ = ["CheckpointError", "Checkpointer", "Restored"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not fit the current config."""


@dataclasses.dataclass
class Restored:
    step: int
    state: dict[str, Any]
    data_state: Any
    meta: dict[str, Any]


# Sections whose change makes a checkpoint unusable (shapes or data stream differ).
_FIXED_SECTIONS = ("model", "moe", "data")


class Checkpointer:
    """Saves and restores a run's checkpoints.

    Args:
      directory: ``<run-dir>/checkpoints`` (created if missing).
      keep: most recent checkpoints kept.
      async_save: save in a background thread.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any], data_state: Any, cfg: ExperimentConfig,
             *, force: bool = False) -> bool:
        """Starts saving ``step`` (returns at once when asynchronous)."""
        meta = {"step": int(step), "config": cfg.to_dict()}
        return self.manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta)), force=force)

    def restore(self, abstract_state: dict[str, Any], cfg: ExperimentConfig,
                step: int | None = None) -> Restored:
        """Restores ``step`` (default: latest) into the structure/shardings of ``abstract_state``.

        Raises:
          CheckpointError: no checkpoint, or one written with a different model/moe/data config.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}; train first (moefast train "
                                  f"--run-dir {self.directory.parent})")
        meta = self.read_meta(step)
        saved = meta.get("config", {})
        for sec in _FIXED_SECTIONS:
            now = cfg.to_dict()[sec]
            if saved.get(sec) != now:
                diff = sorted(k for k in now if saved.get(sec, {}).get(k) != now[k])
                raise CheckpointError(
                    f"checkpoint {self.directory / str(step)} was written with a different '{sec}' "
                    f"config (keys {diff}); use the same config or a new --run-dir")
        r = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return Restored(step=step, state=r.state, data_state=r.data, meta=r.meta)

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
