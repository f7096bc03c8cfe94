"""The run directory: checks that it can be used, its ``config.yaml``, and errors of writes to it.

A run dir holds ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/`` and ``config.yaml`` (the
config the run continues with; :data:`moefast.config.INVOCATION_KEYS` such as ``train.stop_at``
belong to one invocation and are not kept in it).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from moefast.config import ConfigError, ExperimentConfig, without_invocation_keys
from moefast.train.checkpoint import STEP_ENTRY, CheckpointError, complete_steps

__all__ = ["absolute_data_paths", "check_run_dir", "check_writable", "load_run_config", "write_error",
           "write_run_config"]

_CONFIG = "config.yaml"
_PROBE = ".write-probe.tmp"


def check_run_dir(run_dir: Path) -> None:
    """Raises if ``run_dir`` cannot be a run directory at all: checked when a :class:`Trainer` is
    created, before anything is read, restored or compiled. Creates nothing. (A directory that
    exists but is read-only is fine here: ``moefast eval`` and ``generate`` only read it;
    :func:`check_writable` refuses it when a run is to write there.)

    The messages call it "run dir", which reads as ``run_dir`` (Python) and ``--run-dir`` (command line).

    Raises:
      CheckpointError: ``run_dir`` exists and is not a directory; or it holds files but no run (no
        ``metrics.jsonl``, no ``checkpoints/`` of moefast's numbered steps) and names that a run
        does not write: another directory given by mistake, whose files a run would mix with its
        own (and whose ``checkpoints/`` it would try to restore).
      ConfigError: ``run_dir`` does not exist and cannot be created: a path component is a regular
        file, or the nearest existing directory above it is not writable.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise CheckpointError(f"run dir {run_dir} exists and is not a directory; choose another path")
    if run_dir.exists():
        _refuse_foreign(run_dir)
        return
    parent = run_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"run dir {run_dir} cannot be created: {parent} is a file, not a directory; choose a "
                          "run dir under a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"run dir {run_dir} cannot be created: {parent} is not writable (ls -ld {parent}); "
                          "choose a run dir in a writable directory, or make it writable")


# What a run, import-hf, export-hf and plot write into a run dir (hidden entries are never counted).
_RUN_ENTRIES = frozenset({_CONFIG, "checkpoints", "metrics.jsonl", "tensorboard", "profile", "tokenizer", "plots",
                          "imported_from.json"})


def _foreign_entries(run_dir: Path) -> list[str]:
    """Names in an existing ``run_dir`` that no run writes, when it holds no run (sorted; those in
    a ``checkpoints/`` that is not a run's as ``checkpoints/NAME``); ``[]`` for a run (the user's
    notes may sit beside one), an empty directory, or one that cannot be listed (the write or the
    restore says why)."""
    try:
        if not run_dir.is_dir() or (run_dir / "metrics.jsonl").exists():
            return []
        checkpoints = run_dir / "checkpoints"
        inside = sorted(f"checkpoints/{e.name}" for e in checkpoints.iterdir()
                        if not e.name.startswith(".") and not STEP_ENTRY.fullmatch(e.name)) \
            if checkpoints.is_dir() else []
        if checkpoints.is_dir() and not inside:
            return []  # a run's checkpoints
        return sorted(e.name for e in run_dir.iterdir() if not e.name.startswith(".") and e.name not in _RUN_ENTRIES) \
            + inside
    except OSError:
        return []


def _refuse_foreign(run_dir: Path) -> None:
    """Raises :class:`CheckpointError` when ``run_dir`` holds files but no run (:func:`_foreign_entries`)."""
    foreign = _foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise CheckpointError(f"run dir {run_dir} holds files that are not a moefast run ({shown}): no metrics.jsonl, "
                              "no checkpoints/ of numbered steps; choose a new or empty directory for the run")


def check_writable(run_dir: Path) -> None:
    """Creates ``run_dir`` if needed and checks that files can be written in it (a probe file,
    removed at once): called at the start of a run, before anything is written.

    Raises:
      ConfigError: ``run_dir`` cannot be created.
      CheckpointError: it is not a directory or holds files but no run (:func:`check_run_dir`);
        files cannot be written in it (read-only directory or file system, no space): the
        message names ``config.yaml`` (the first file a run writes) and the last complete
        checkpoint, which is left as it is.
    """
    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run dir {run_dir} cannot be created ({e.strerror}); choose a run dir in a writable "
                          "directory") from None
    probe = run_dir / _PROBE
    try:
        with open(probe, "w") as f:
            f.write("x")
        probe.unlink()
    except OSError as e:
        checkpoints = (run_dir / "checkpoints").absolute()
        good = complete_steps(checkpoints)
        kept = (f"the last complete checkpoint, {checkpoints / str(good[-1])}, is intact" if good
                else "it holds no complete checkpoint")
        raise CheckpointError(
            f"cannot write {run_dir / _CONFIG}: {e.strerror}; nothing was trained or changed ({kept}). Make "
            f"{run_dir} writable or free space (ls -ld {run_dir}; df -h {run_dir}), or choose another run dir"
        ) from None


_NAMED = {"source": ("stdlib",), "tokenizer": ("byte",)}  # data.* values that are names, not paths


def absolute_data_paths(cfg: ExperimentConfig, run_dir: Path) -> ExperimentConfig:
    """``cfg`` with its relative ``data.source`` and ``data.tokenizer`` paths made absolute, so that
    the run (its ``config.yaml`` and checkpoints) works from any working directory: a path (or a
    glob that matches) relative to the working directory becomes absolute; a tokenizer relative to
    the run dir (``moefast import-hf`` copies one there) is kept as it is.

    Raises:
      ConfigError: a relative path that exists neither from the working directory nor (a tokenizer)
        in the run dir, in a run that already has a ``config.yaml`` (one started by an older
        moefast, which stored paths as typed, from another directory): the message names the key,
        the path and how to fix it. In a new run such a path is left to the data readers' errors.
    """
    import dataclasses
    import glob

    changes = {}
    for key, names in _NAMED.items():
        value = getattr(cfg.data, key)
        if not value or value in names or os.path.isabs(value) or value.startswith("~"):
            continue
        if key == "tokenizer" and (run_dir / value).exists():
            continue  # run-dir-relative (import-hf): resolved against the run dir when it is used
        if os.path.exists(value) or (glob.has_magic(value) and glob.glob(value)):
            changes[key] = os.path.abspath(value)
        elif (run_dir / _CONFIG).is_file():
            raise ConfigError(
                f"data.{key}: {value!r} is a relative path, and {os.path.abspath(value)!r} does not exist (the "
                f"working directory is {os.getcwd()}); {run_dir / _CONFIG} stores it as typed (a run started by an "
                f"older moefast): set data.{key} there to its absolute path, or run from the directory the run was "
                "started in")
    return cfg.replace(data=dataclasses.replace(cfg.data, **changes)) if changes else cfg


def write_run_config(run_dir: Path, cfg: ExperimentConfig) -> None:
    """Replaces ``<run_dir>/config.yaml`` by ``cfg`` without its invocation keys, so that a crash
    leaves the old or the new file, never a cut one.

    Raises:
      OSError: the file cannot be written (the message names it).
    """
    path = run_dir / _CONFIG
    text = yaml.safe_dump(without_invocation_keys(cfg.to_dict()), sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None


def load_run_config(run_dir: str | Path) -> ExperimentConfig:
    """The config a run was started with (``<run-dir>/config.yaml``; an invocation key that an older
    moefast kept there, e.g. ``train.stop_at``, is ignored).

    Raises:
      CheckpointError: the run directory or its config is missing or unreadable; the directory
        holds files but no run (:func:`check_run_dir`: its ``config.yaml`` is not read).
      ConfigError: the config has unknown keys or impossible values.
    """
    _refuse_foreign(Path(run_dir))
    path = Path(run_dir) / _CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path} not found: {run_dir} is not a moefast run directory (start one with "
                              "moefast train --run-dir DIR, or Trainer(cfg, run_dir=DIR).run() in Python)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); a run writes it at every "
                              "start: restore it, or start the run again the way it was first started") from None
    if not isinstance(raw, dict) or not raw:
        raise CheckpointError(f"{path} holds no config; a run writes it at every start: start the run again the "
                              "same way to rewrite it")
    return ExperimentConfig.from_dict(without_invocation_keys(raw), where=str(path))


def write_error(e: OSError, run_dir: Path, checkpoints: Path, done: int) -> CheckpointError:
    """A failed write to the run dir (metrics, TensorBoard events, config.yaml) after ``done``
    optimizer steps, as one error naming the directory, the step and the last complete checkpoint
    in ``checkpoints``."""
    good = complete_steps(checkpoints)
    where = (f"the last complete checkpoint, {checkpoints / str(good[-1])}, is intact: a rerun of the same "
             f"command resumes from it and trains and logs the steps after it again" if good else
             "there is no complete checkpoint yet: a rerun starts the run again")
    return CheckpointError(f"{e}; training stopped after step {done}: {where}. Free disk space or make "
                           f"{run_dir} writable first (df -h {run_dir}; ls -ld {run_dir})")
