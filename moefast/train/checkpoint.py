"""Checkpoints with orbax ``CheckpointManager``: train state, data-iterator state, run metadata.

Layout: ``<run-dir>/checkpoints/<step>/{state,data,meta}``. ``state`` holds the parameters, optimizer
state and step (``StandardSave``); ``data`` the grain iterator state (``JsonSave``); ``meta`` the
config, seed and step (``JsonSave``). Saves are asynchronous by default.

Faults, and what happens:

* A process killed while a checkpoint is being written: orbax writes each step into
  ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` only once every file is written, so
  the unfinished write is never listed as a step; the next run restores the newest complete step,
  and its first :meth:`Checkpointer.save` removes such leftovers (saving that step again works).
* A truncated or corrupted step directory: :meth:`Checkpointer.restore` (latest step) falls back
  to the newest step that restores, warns naming each skipped step and what is wrong with its
  files, and moves the skipped directories aside to ``<step>.corrupt-<n>`` (never deleted; orbax
  no longer lists them, so those step numbers can be saved again). If no step restores,
  :class:`CheckpointError`. A step whose files look complete but that this machine cannot hold
  (out of memory, devices) is a :class:`CheckpointError` at once: nothing is skipped or moved.
* A failed background write (disk full, read-only directory, ...): :class:`CheckpointError` at the
  next :meth:`~Checkpointer.save`, :meth:`~Checkpointer.wait` or :meth:`~Checkpointer.close`,
  naming the step and the directory. Older checkpoints are only deleted (``keep``) after a newer
  one is complete, so the last good checkpoint survives a failed write.

A failed write or read leaves orbax tasks that report the same failure again and again (asyncio,
unraisable-exception and absl tracebacks); :func:`quiet_orbax_aftermath` drops exactly those
reports while a run holds it (:meth:`moefast.train.Trainer.run` does), so the one
:class:`CheckpointError` is what the user sees. Creating a :class:`Checkpointer` changes nothing
process-wide.

Warnings and notes go to the ``log`` callable given to :class:`Checkpointer` (the Trainer's
console), else to :func:`warnings.warn` / ``logging``. With several processes, every process must
see the same files; a step counts as unreadable when any process fails to read it, and process 0
moves it aside.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from moefast.config import PARAMETER_KEYS, ExperimentConfig
from moefast.model import layout
from moefast.train.checkpoint_faults import (CheckpointError, _describe, _describe_write, _file_problem, _reason,
                                              quiet_orbax_aftermath, quiet_orbax_aftermath_until_exit)

__all__ = ["CheckpointError", "CheckpointWarning", "Checkpointer", "Restored", "complete_steps",
           "quiet_orbax_aftermath", "quiet_orbax_aftermath_until_exit"]

_logger = logging.getLogger(__name__)

# Where orbax (0.12) writes a step before renaming it to <step> on completion.
_TMP_SUFFIX = ocp.utils.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"
_LEFTOVER = re.compile(r"^\d+" + re.escape(_TMP_SUFFIX))
# Every name a run's checkpoints/ holds: steps, orbax's unfinished writes, steps moved aside (<step>.corrupt-<n>).
STEP_ENTRY = re.compile(r"\d+(\.corrupt-\d+|" + re.escape(_TMP_SUFFIX) + r".*)?")
_barriers = itertools.count()  # orbax barrier names must be unique per process lifetime


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (unreadable) or a leftover cleaned up; emitted when no ``log`` is given."""


@dataclasses.dataclass
class Restored:
    step: int
    state: dict[str, Any]
    data_state: Any
    meta: dict[str, Any]


# Sections whose change makes a checkpoint unusable (shapes or data stream differ).
_FIXED_SECTIONS = ("model", "moe", "data", "lora")
# Keys of those sections that choose how the same model is computed, not what it is: a resume may
# change them (like the mesh), e.g. the exchange's chunks after moving to another expert axis.
# ``model.scan_layers`` changes where the parameters live, not what they are: a checkpoint of the
# other layout is converted on restore (:func:`moefast.model.layout.to_layout`).
# model.precision: the GEMMs' input format; the state holds the same float32 master weights either way
_FREE_KEYS = {"model": {"remat", "scan_layers", "attention_impl", "linear_attention_impl", "precision"},
              "moe": {"grouped_matmul", "routing_impl", "dispatch", "overlap_chunks", "overlap_chain",
                      "dispatch_dtype", "exchange", "gpus_per_host"},
              "data": {"prefetch"},
              "lora": {"routing", "init"}}  # init: A's initial values, nothing after step 0


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config with the keys added to moefast since it was written filled in with their
    defaults. A new config key's default always reproduces the behaviour from before the key
    existed, so checkpoints of older versions stay usable. A config that no longer parses (e.g.
    written by a newer version) is compared as it is."""
    try:
        return ExperimentConfig.from_dict(saved).to_dict()
    except Exception:  # noqa: BLE001 - the key-by-key comparison then names the differences
        return saved


class _Unreadable(Exception):
    """Internal: a step's files could not be read (as opposed to a config mismatch)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Failures of the machine (memory, devices), not of the files: no fallback to an older step, and
# no advice that the files may be damaged.
_MACHINE = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|Cannot allocate memory|[Ss]harding|devices?\b")


def complete_steps(directory: Path) -> list[int]:
    """Steps whose directories are complete on disk in ``directory`` (orbax renames a step's
    directory to ``<step>`` only once all of it is written), oldest first; ``[]`` when the
    directory is missing or unreadable."""
    try:
        return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def _all_processes_ok(ok: bool) -> bool:
    """``ok`` on every process (one process restoring a step that another could not read would
    leave them on different steps). Single-process: ``ok`` itself."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


class Checkpointer:
    """Saves and restores a run's checkpoints.

    Args:
      directory: ``<run-dir>/checkpoints`` (created if missing).
      keep: most recent checkpoints kept.
      async_save: save in a background thread.
      log: ``print``-like callable for warnings (a skipped unreadable checkpoint) and notes (cleaned
        leftovers); ``None``: warnings go to :func:`warnings.warn` (:class:`CheckpointWarning`),
        notes to the ``logging`` module.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 log: Callable[[str], None] | None = None):
        self.directory = Path(directory).absolute()
        self._log = log
        self._is_primary = jax.process_index() == 0
        self._pending: int | None = None  # step of the save that may still run in the background
        self._leftovers_checked = False
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))

    # ------------------------------------------------------------------ messages
    def _warn(self, msg: str) -> None:
        if self._log is not None:
            self._log(f"warning: {msg}")
        else:
            warnings.warn(msg, CheckpointWarning, stacklevel=4)

    def _note(self, msg: str) -> None:
        if self._log is not None:
            self._log(msg)
        else:
            _logger.info(msg)

    def _sync(self, name: str) -> None:
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"moefast_checkpointer_{name}_{next(_barriers)}")

    # ------------------------------------------------------------------ listing
    def latest_step(self) -> int | None:
        """Newest step listed by orbax (complete on disk, or being saved by this object)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps listed by orbax, oldest first."""
        return sorted(self.manager.all_steps())

    def complete_steps(self) -> list[int]:
        """Steps whose directories are complete on disk now (orbax renames a step's directory to
        ``<step>`` only once all of it is written), oldest first; also while a save runs."""
        return complete_steps(self.directory)

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: dict[str, Any], data_state: Any, cfg: ExperimentConfig,
             *, force: bool = False, loop_state: dict[str, Any] | None = None,
             identity: dict[str, Any] | None = None) -> bool:
        """Starts saving ``step`` (returns at once when asynchronous).

        ``loop_state``: JSON-serialisable host state of the training loop at ``step`` (e.g. the
        expert-load monitor's counters), stored in ``meta`` as ``"loop"``.

        ``identity``: what the state and data position were made with, stored in ``meta`` as
        ``"identity"``: ``"tokenizer"`` (``{"name", "vocab_size", "identity"}``, checked by
        :meth:`restore` before any array is read) and ``"corpus"`` (a prepared corpus's
        :func:`~moefast.data.prepared.corpus_identity`, checked on resume).

        The first save of this object (and the first after a failed write) removes unfinished
        writes (``<step>.orbax-checkpoint-tmp``) that a killed run or a failed write left behind.

        Raises:
          CheckpointError: the previous asynchronous save failed in the background, this one could
            not be started (the message names the step, the directory and what to check), or
            ``step`` already exists.
        """
        self._wait_pending()
        if not self._leftovers_checked:
            self._remove_leftovers()
            self._leftovers_checked = True
        if int(step) in self.all_steps():
            raise CheckpointError(f"checkpoint step {step} already exists in {self.directory}; it is not "
                                  "overwritten")
        # "fresh": no data position (an imported step 0, Trainer.initialize): nothing was trained on yet
        meta = {"step": int(step), "config": cfg.to_dict(), "fresh": data_state is None, "loop": loop_state or {},
                "identity": identity or {}}
        try:
            started = self.manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta)), force=force)
        except Exception as e:  # noqa: BLE001 - every failure becomes a CheckpointError naming the step
            raise self._write_failed(int(step), e) from e
        if started:
            self._pending = int(step)
        return started

    def _wait_pending(self) -> None:
        """Waits for the background save; its failure becomes a :class:`CheckpointError`."""
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_failed(step, e) from e

    def _write_failed(self, step: int | None, e: BaseException) -> CheckpointError:
        """Cleans up after a failed write of ``step`` and builds the error to raise."""
        where = self._step_dir(step) if step is not None else self.directory
        # Its unfinished directory is removed by the next save (not now: orbax may still be
        # finishing the write's other files).
        self._leftovers_checked = False
        try:  # orbax forgets the steps it meant to delete once this save finished: list them again
            self.manager.reload()
            good = self.manager.latest_step()
        except Exception:  # noqa: BLE001 - the directory itself may be unreadable now
            good = None
        kept = (f"the last complete checkpoint, {self._step_dir(good)}, was kept" if good is not None
                else "there is no complete checkpoint in it")
        return CheckpointError(
            f"checkpoint step {step if step is not None else '?'} could not be written to {where} "
            f"({_describe_write(e)}); {kept}. Check free disk space and write permissions of {self.directory} "
            "(e.g. df -h, ls -ld), then rerun to resume from the last complete checkpoint")

    def _remove_leftovers(self) -> None:
        """Deletes ``<step>.orbax-checkpoint-tmp`` directories: writes a killed process never
        finished (orbax ignores them when listing steps; they only take space)."""
        if not self._is_primary or not self.directory.is_dir():
            return
        removed = []
        for p in sorted(self.directory.iterdir()):
            if _LEFTOVER.match(p.name) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        if removed:
            self._note(f"removed unfinished checkpoint write(s) left by an interrupted run in "
                       f"{self.directory}: {', '.join(removed)}")

    # ------------------------------------------------------------------ restoring
    def restore(self, abstract_state: dict[str, Any], cfg: ExperimentConfig,
                step: int | None = None, *, tokenizer: dict[str, Any] | None = None,
                corpus: str | None = None, opt_state_of: Callable[[ExperimentConfig], Any] | None = None) -> Restored:
        """Restores ``step`` (default: latest) into the structure/shardings of ``abstract_state``.

        With ``step=None``, steps are tried newest first: a step whose files cannot be read
        (truncated, deleted or corrupted files) is skipped with a warning naming its directory and
        the reason, and once an older step restores, the skipped directories are moved aside to
        ``<step>.corrupt-<n>`` (kept, no longer listed). When no step restores nothing is moved
        (the cause may be the code, not the files).

        Args:
          abstract_state: the train state's structure with shapes, dtypes and shardings
            (``jax.ShapeDtypeStruct`` leaves), e.g. :meth:`moefast.train.Trainer.abstract_state`;
            the restored arrays get exactly this tree structure and these shardings.
          cfg: the run's config; its model/moe/data sections must match the checkpoint's.
          step: the step to restore (default: the newest that restores).
          tokenizer: the run's tokenizer now (``{"name", "vocab_size", "identity"}``); checked
            against the one the checkpoint records (older checkpoints: the rows of its
            ``params.embed``) before any array is read.
          corpus: the prepared corpus ``data.source`` holds now
            (:func:`~moefast.data.prepared.corpus_identity`), or ``None`` (not checked); checked
            against the one the checkpoint was trained on before any array is read (a step with no
            data position, an imported step 0, was trained on none).
          opt_state_of: for a run that resets its optimizer (``moefast train --reset-optimizer``):
            the abstract optimizer state (with shardings) of the checkpoint's own config, read in
            place of ``abstract_state["opt_state"]``, which lets a checkpoint of another
            ``train.optimizer`` restore. Without it such a checkpoint is refused.

        Raises:
          TypeError: ``abstract_state`` is ``None`` (orbax would then guess the structure from the
            files: lists for tuples, string keys for integers, no empty states).
          CheckpointError: no checkpoint; one written with a different model/moe/data config (at
            once, no fallback); one that this machine cannot hold (out of memory, devices: at
            once, nothing skipped or moved); one written with another tokenizer (at once: the
            message names both); one trained on another prepared corpus than ``corpus`` (at
            once: ``data.source`` was prepared again since); no step could be restored (names the
            directory and, for each step tried, what is wrong with its files); or the given
            ``step`` could not be restored; one written with another ``train.optimizer`` and no
            ``opt_state_of`` (at once: the message names both and ``--reset-optimizer``).
        """
        if abstract_state is None:
            raise TypeError("Checkpointer.restore needs the target structure: pass the train state's abstract "
                            "tree, e.g. Trainer(cfg, run_dir).abstract_state() (Trainer.restore_params() restores "
                            "a run's parameters and routing state)")
        self._wait_pending()
        if step is not None:
            try:
                return self._restore_step(abstract_state, cfg, int(step), tokenizer, corpus, opt_state_of)
            except _Unreadable as e:
                raise CheckpointError(f"checkpoint {self._step_dir(step)} could not be restored: {e.reason}") from e
        steps = self.all_steps()[::-1]
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}; train the run in {self.directory.parent} "
                                  "first")
        skipped: list[tuple[int, str]] = []
        for s in steps:
            try:
                restored = self._restore_step(abstract_state, cfg, s, tokenizer, corpus, opt_state_of)
            except _Unreadable as e:
                skipped.append((s, e.reason))
                continue
            self._set_aside(skipped, restored.step)
            return restored
        tried = "; ".join(f"{self._step_dir(s)}: {r}" for s, r in skipped)
        raise CheckpointError(
            f"no checkpoint in {self.directory} could be restored (tried newest first: {tried}). If these "
            f"files are damaged, move the step directories out of {self.directory} to start from scratch, "
            "or use a new run dir")

    def _restore_step(self, abstract_state: dict[str, Any], cfg: ExperimentConfig, step: int,
                      tokenizer: dict[str, Any] | None = None, corpus: str | None = None,
                      opt_state_of: Callable[[ExperimentConfig], Any] | None = None) -> Restored:
        """Restores one step. Raises :class:`_Unreadable` when its files cannot be read (on any
        process), :class:`CheckpointError` when its config, tokenizer or corpus does not fit."""
        meta, error = None, None
        try:
            meta = self._read_meta(step)
        except Exception as e:  # noqa: BLE001
            error = e
        if not _all_processes_ok(error is None):
            raise self._failed(step, error, "metadata unreadable: ")
        saved = meta.get("config", {}) if isinstance(meta, dict) else {}
        saved = _with_defaults(saved)
        fresh = isinstance(meta, dict) and meta.get("fresh", False)
        for sec in _FIXED_SECTIONS:
            free = _FREE_KEYS.get(sec, set())
            if fresh:  # nothing trained yet: only what decides the parameters' shapes is fixed
                free = {k for k in cfg.to_dict()[sec] if k not in PARAMETER_KEYS.get(sec, ())}
            now = {k: v for k, v in cfg.to_dict()[sec].items() if k not in free}
            was = {k: v for k, v in (saved.get(sec) or {}).items() if k not in free}
            if sec == "data":
                # Older runs stored paths as typed: the same path made absolute (from the directory the
                # run was started in, unknown here: any absolute path ending in it) is the same.
                was.update({k: now[k] for k in ("source", "tokenizer") if isinstance(was.get(k), str)
                            and isinstance(now.get(k), str) and not os.path.isabs(was[k])
                            and _ends_with(now[k], was[k])})
                recorded = (meta.get("identity") or {}).get("tokenizer") if isinstance(meta, dict) else None
                if recorded and tokenizer is not None and "tokenizer" in now:
                    # the tokenizer is checked by what it is (_check_tokenizer), not where its files are:
                    # a copy of the same files elsewhere is the same tokenizer
                    was["tokenizer"] = now["tokenizer"]
            if was != now:
                diff = sorted(k for k in now if was.get(k) != now[k])
                raise CheckpointError(
                    f"checkpoint {self._step_dir(step)} was written with a different '{sec}' "
                    f"config (keys {diff}); use the same config or a new run dir")
        if tokenizer is not None:
            self._check_tokenizer(step, meta if isinstance(meta, dict) else {}, tokenizer, abstract_state)
        then = (meta.get("identity") or {}).get("corpus") if isinstance(meta, dict) else None
        if corpus is not None and then and not fresh and then != corpus:
            raise CheckpointError(
                f"data.source {cfg.data.source} is not the prepared corpus checkpoint {self._step_dir(step)} was "
                "trained on (its manifest.json differs: prepared again since, from changed files or with other "
                "arguments), so a resume would continue the saved data position on another corpus and an "
                "evaluation would use another validation split (perhaps holding documents the run trained on); "
                "prepare it again from the files and with the arguments it was prepared from, or train on this "
                "corpus in a new run dir")
        wanted = target = self._optimizer_target(abstract_state, cfg, step, saved, opt_state_of)
        scanned_now = cfg.model.scan_layers
        scanned_then = bool((saved.get("model") or {}).get("scan_layers", False))
        if scanned_then != scanned_now:  # read in the checkpoint's layout, then convert
            target = layout.to_layout(target, cfg.model, scanned_then)
        r, error = None, None
        try:
            r = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            error = e
        if not _all_processes_ok(error is None):
            raise self._failed(step, error)
        state = r.state
        if scanned_then != scanned_now:
            out_shardings = jax.tree.map(lambda a: a.sharding, wanted)
            # not donated: the stacked and unstacked buffers differ in shape, so none could be reused
            state = jax.jit(lambda t: layout.to_layout(t, cfg.model, scanned_now), out_shardings=out_shardings)(state)
            self._note(f"checkpoint {self._step_dir(step)} was written with model.scan_layers={scanned_then}; "
                       f"its layers were converted to scan_layers={scanned_now}")
        return Restored(step=step, state=state, data_state=r.data, meta=r.meta)

    def _optimizer_target(self, abstract_state: dict[str, Any], cfg: ExperimentConfig, step: int,
                          saved: dict[str, Any], opt_state_of) -> dict[str, Any]:
        """The restore target: ``abstract_state``, or with ``opt_state_of`` its optimizer state as
        the checkpoint's config holds it. Refuses a change of ``train.optimizer`` or of
        ``train.indexer_stage`` without it."""
        was = (saved.get("train") or {}).get("optimizer", "adamw")
        if opt_state_of is None:
            stage = (saved.get("train") or {}).get("indexer_stage", "none")
            if stage != cfg.train.indexer_stage:  # other parameters train, or the indexers' moments would go on moving them
                raise CheckpointError(
                    f"checkpoint {self._step_dir(step)} was trained with train.indexer_stage={stage}, this run asks "
                    f"for {cfg.train.indexer_stage}: the stages train other parameters, so the optimizer state does not "
                    "carry over. Run again with --reset-optimizer (Trainer(..., reset_optimizer=True)): the weights "
                    f"kept, a fresh optimizer state; or keep train.indexer_stage={stage}")
            if was != cfg.train.optimizer:
                raise CheckpointError(
                    f"checkpoint {self._step_dir(step)} was trained with train.optimizer={was}, this run asks for "
                    f"{cfg.train.optimizer}: the optimizer state does not carry over. To switch and keep the weights, "
                    f"run again with --reset-optimizer (Trainer(..., reset_optimizer=True)): a fresh "
                    f"{cfg.train.optimizer} state, the learning-rate schedule where it was; or keep "
                    f"train.optimizer={was}")
            return abstract_state
        then = dataclasses.replace(cfg, train=ExperimentConfig.from_dict(saved).train)  # this layout, its optimizer
        return {**abstract_state, "opt_state": opt_state_of(then)}

    def _check_tokenizer(self, step: int, meta: dict[str, Any], tokenizer: dict[str, Any],
                         abstract_state: dict[str, Any]) -> None:
        """Refuses a checkpoint trained with another tokenizer, before any array is read (whose
        shape error would otherwise blame the files)."""
        where, name = self._step_dir(step), tokenizer.get("name")
        fix = (f"the checkpoint is fine: point data.tokenizer in {self.directory.parent / 'config.yaml'} at the "
               "tokenizer it was trained with, or restore that tokenizer's files")
        then = (meta.get("identity") or {}).get("tokenizer")
        if then:
            if then.get("vocab_size") != tokenizer.get("vocab_size"):
                raise CheckpointError(
                    f"checkpoint {where} was trained with a tokenizer of {then.get('vocab_size')} ids "
                    f"({then.get('name')!r}), but data.tokenizer {name!r} now has {tokenizer.get('vocab_size')} ids "
                    f"(its files changed since?); {fix}")
            if then.get("identity") and tokenizer.get("identity") and then["identity"] != tokenizer["identity"]:
                raise CheckpointError(
                    f"checkpoint {where} was trained with another tokenizer than data.tokenizer {name!r} now is "
                    f"(same {tokenizer.get('vocab_size')} ids, but its files hash to {tokenizer['identity'][:19]}..., "
                    f"not {then['identity'][:19]}... as in training: they changed since); {fix}")
            return
        embed = (abstract_state.get("params") or {}).get("embed") if isinstance(abstract_state, dict) else None
        if embed is None or not hasattr(embed, "shape"):
            return
        try:  # an older checkpoint records no tokenizer: the rows of its embedding
            saved = json.loads((where / "state" / "_METADATA").read_text())["tree_metadata"]
            rows = saved["('params', 'embed')"]["value_metadata"]["write_shape"][0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return  # unreadable: the restore says what is wrong with the files
        if rows != embed.shape[0]:
            raise CheckpointError(
                f"checkpoint {where} has an embedding of {rows} token ids, but this run's model has {embed.shape[0]} "
                f"(data.tokenizer {name!r}: {tokenizer.get('vocab_size')} ids; its files changed since training?); "
                f"{fix}")

    def _failed(self, step: int, error: BaseException | None, prefix: str = "") -> Exception:
        """The exception for a step that did not restore: :class:`_Unreadable` (skip it, try an
        older one) saying what is wrong with its files, or a :class:`CheckpointError` when the files
        look complete and the machine is at fault (memory, devices)."""
        if error is None:
            return _Unreadable(prefix + "failed on another process")
        problem = _file_problem(self._step_dir(step))
        if problem is not None:
            return _Unreadable(f"{prefix}{problem}")
        if isinstance(error, MemoryError) or _MACHINE.search(_reason(error, limit=10_000)):
            return CheckpointError(
                f"checkpoint {self._step_dir(step)} could not be restored on this machine ({_describe(error)}). Its "
                "files look complete, so nothing was skipped or moved aside: if it was written on a machine with "
                "more memory or devices, restore it on such a machine, or on a mesh that splits the state further "
                "(mesh.fsdp, mesh.expert)")
        return _Unreadable(prefix + _describe(error))

    def _set_aside(self, skipped: list[tuple[int, str]], restored_step: int) -> None:
        """Moves unreadable steps newer than the restored one to ``<step>.corrupt-<n>`` and warns."""
        if not skipped:
            return
        moved: dict[int, str] = {}
        if self._is_primary:
            for s, _ in skipped:
                src = self._step_dir(s)
                if not src.exists():  # e.g. deleted meanwhile by a run that is still writing
                    moved[s] = "it no longer exists"
                    continue
                n = 1
                while (self.directory / f"{s}.corrupt-{n}").exists():
                    n += 1
                dst = self.directory / f"{s}.corrupt-{n}"
                try:
                    src.rename(dst)
                    moved[s] = f"moved it to {dst}"
                except OSError as e:
                    moved[s] = f"could not move it aside ({_reason(e)}); it will be tried again next time"
        self._sync("set_aside")
        self.manager.reload()
        for s, reason in skipped:
            self._warn(f"checkpoint {self._step_dir(s)} could not be restored ({reason}); "
                       f"{moved.get(s, 'process 0 moves it aside')}; restored step {restored_step} "
                       f"({self._step_dir(restored_step)}) instead")

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` item (step and config) of ``step`` (default: latest).

        Raises:
          CheckpointError: no checkpoint, or its metadata cannot be read.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        try:
            return self._read_meta(step)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"metadata of checkpoint {self._step_dir(step)} could not be read: "
                                  f"{_reason(e)}") from e

    def _read_meta(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    # ------------------------------------------------------------------ lifetime
    def wait(self) -> None:
        """Blocks until the background save is written.

        Raises:
          CheckpointError: it failed (the message names the step, the directory and what to check).
        """
        self._wait_pending()

    def close(self) -> None:
        """Waits for the background save, then releases orbax's threads (also when the save failed).

        Raises:
          CheckpointError: the background save failed.
        """
        try:
            self._wait_pending()
        finally:
            self.manager.close()


def _ends_with(path: str, rel: str) -> bool:
    """``path`` (absolute) is ``rel`` (relative) made absolute from some directory: its last
    components are ``rel``'s (``..``/``.`` in ``rel`` resolved as far as they go)."""
    parts = [p for p in os.path.normpath(rel).split(os.sep) if p not in ("", ".")]
    if not parts or ".." in parts:
        return os.path.abspath(rel) == path
    return os.path.normpath(path).split(os.sep)[-len(parts):] == parts
