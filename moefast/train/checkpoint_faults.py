"""What a failed checkpoint read or write says (one line naming the step, the directory and the
cause, from orbax's nested exceptions), and the context that quiets orbax's repeated reports of the
same failure while a run holds it (:mod:`moefast.train.checkpoint`'s docstring: faults and what
happens)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator

_logger = logging.getLogger(__name__)
_held_until_exit: contextlib.ExitStack | None = None  # quiet_orbax_aftermath_until_exit's


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, could not be written, or does not fit the current config."""


_ORBAX_ITEMS = ("state", "meta", "data")
_JSON_FILES = ("state/_METADATA", "meta/metadata", "data/metadata")
# A tensorstore read error: code, the array (its tree path) and what went wrong.
_TS_READ = re.compile(r'([A-Z_]+): .*?Error reading "([^"/]+)[^"]*" in OCDBT database at local file "[^"]*": (.*)')
_TS_CODES = {"OUT_OF_RANGE": "a data file is shorter than its index says (truncated)",
             "DATA_LOSS": "a file is corrupt (its bytes do not decode)",
             "FAILED_PRECONDITION": "a data file is corrupt or missing (its compressed bytes do not decode)",
             "NOT_FOUND": "a data file is missing"}


def _reason(e: BaseException, limit: int = 300) -> str:
    """One line saying why ``e`` happened: the innermost exception of its chain (tensorstore's
    status, the JSON error, ...), whose message is the informative one."""
    inner, seen = e, set()
    while id(inner) not in seen:
        seen.add(id(inner))
        nxt = inner.__cause__ or inner.__context__
        if nxt is None:
            break
        inner = nxt
    text = str(inner).strip()
    line = text.splitlines()[0] if text else ""
    return _clip(f"{type(inner).__name__}: {line}" if line else type(inner).__name__, limit)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _file_problem(step_dir: Path) -> str | None:
    """What is visibly wrong with a step directory's files (a missing item or metadata file, an
    empty file, metadata that is not JSON), or ``None`` when they look complete."""
    for item in _ORBAX_ITEMS:
        if not (step_dir / item).is_dir():
            return f"{item}/ is missing"
    for rel in _JSON_FILES:
        path = step_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size == 0:
            return f"{rel} is empty (0 bytes)"
        try:
            json.loads(path.read_bytes())
        except ValueError as e:
            return f"{rel} is not valid JSON ({size} bytes, {e}): cut short or overwritten"
    if not (step_dir / "state" / "manifest.ocdbt").is_file():
        return "state/manifest.ocdbt (the array index) is missing"
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            if os.path.getsize(os.path.join(root, f)) == 0:
                return f"{os.path.relpath(os.path.join(root, f), step_dir)} is empty (0 bytes)"
    return None


def _describe(e: BaseException) -> str:
    """``_reason(e)``, with tensorstore's read errors said in terms of the files."""
    reason = _reason(e, limit=10_000)
    m = _TS_READ.search(reason)
    if m:
        code, array, detail = m.groups()
        what = _TS_CODES.get(code, "a data file cannot be read")
        reason = f"the data of {array} cannot be read: {what} ({code}: {detail})"
    return _clip(reason)


def _describe_write(e: BaseException) -> str:
    """Why a write failed, the operating system's reason first (tensorstore puts it at the end of
    a long message)."""
    reason = _reason(e, limit=10_000)
    m = re.search(r"os_error_code='?(\d+)", reason)
    inner = e
    while inner is not None and not isinstance(inner, OSError):
        inner = inner.__cause__ or inner.__context__
    if m:
        code = int(m.group(1))
        reason = f"{os.strerror(code)} [errno {code}]; {reason}"
    elif isinstance(inner, OSError) and inner.strerror:
        reason = f"{inner.strerror} [errno {inner.errno}]; {reason}"
    return _clip(reason)


@contextlib.contextmanager
def quiet_orbax_aftermath() -> Iterator[None]:
    """Drops orbax's repeated reports of a failure while the ``with`` block runs.

    When a write or a restore fails part-way, orbax's other tasks still finish in the background
    and report, at garbage collection, to an event loop already closed: "Task exception was never
    retrieved" (the asyncio logger), "Exception ignored in: <coroutine ...>" (unraisable
    exceptions), "coroutine ... was never awaited" warnings, "RuntimeError: Event loop is closed"
    tracebacks, and its threads log their failure with a traceback (absl) before it reaches the
    caller: dozens of reports, each repeating the failure that :class:`Checkpointer` raises as one
    :class:`CheckpointError`. Nothing else is filtered.

    These filters are process-wide (``sys.excepthook``, ``sys.unraisablehook``, two
    :mod:`warnings` filters, a filter on the "asyncio" and "absl" loggers), so only the owner of a
    run installs them, for its duration (:meth:`moefast.train.Trainer.run`): on exit (normal,
    exception or ``KeyboardInterrupt``) exactly what was added is removed again, and a hook that
    someone else replaced meanwhile is left as it is. When a checkpoint operation failed, the
    filters are first held until orbax's tasks have finished reporting (:func:`_drain`), so none
    of their reports comes after the one error. Creating a :class:`Checkpointer` changes nothing
    process-wide.
    """
    reports: list[float] = []  # time.monotonic() of each report dropped

    def closed_loop(exc: BaseException | None) -> bool:
        return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"

    def from_orbax(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "orbax" in text or "TensorStore" in text or "OCDBT" in text:
            return True
        tb = record.exc_info[2] if record.exc_info else None
        return tb is not None and any("orbax" in f.filename for f in traceback.extract_tb(tb))

    class _AsyncioFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not ("exception was never retrieved" in record.getMessage() and from_orbax(record)
                        and not reports.append(time.monotonic()))

    class _ThreadFailureFilter(logging.Filter):  # re-raised to the caller of save/wait/restore
        def filter(self, record: logging.LogRecord) -> bool:
            msg = record.getMessage()
            return not (record.levelno >= logging.ERROR and msg.startswith("[process=") and "fail" in msg.lower()
                        and not reports.append(time.monotonic()))

    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def quiet_unraisable(u) -> None:
        code = getattr(u.object, "cr_code", None)
        if closed_loop(u.exc_value) or (code is not None and "orbax" in code.co_filename):
            reports.append(time.monotonic())
            return
        unraisable(u)

    def quiet_excepthook(typ, value, tb) -> None:
        if closed_loop(value) and tb is not None and "asyncio" in traceback.extract_tb(tb)[-1].filename:
            reports.append(time.monotonic())
            return
        excepthook(typ, value, tb)

    loggers = ((logging.getLogger("asyncio"), _AsyncioFilter()), (logging.getLogger("absl"), _ThreadFailureFilter()))
    added_warnings = []
    for module in (r"orbax\.", r"sys$"):  # "sys": reported at interpreter exit, without a frame
        had = list(warnings.filters)
        warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning,
                                module=module)
        if warnings.filters[0] not in had:  # (an equal filter already there, e.g. an outer block's, stays)
            added_warnings.append(warnings.filters[0])
    for logger, f in loggers:
        logger.addFilter(f)
    sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_excepthook
    try:
        yield
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt) and (reports or isinstance(e, CheckpointError)):
            _drain(reports, e)  # (not after Ctrl-C: that quits at once)
        raise
    finally:
        if sys.unraisablehook is quiet_unraisable:
            sys.unraisablehook = unraisable
        if sys.excepthook is quiet_excepthook:
            sys.excepthook = excepthook
        for logger, f in loggers:
            logger.removeFilter(f)
        for entry in added_warnings:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        warnings._filters_mutated()  # noqa: SLF001 - what filterwarnings calls after changing the list


def quiet_orbax_aftermath_until_exit() -> None:
    """For a process that exists to run one command (the ``moefast`` command line, which calls this
    at its start): :func:`quiet_orbax_aftermath` held until the interpreter exits, so that also the
    reports orbax's failed tasks make after the error was printed, down to interpreter shutdown,
    are dropped and the user sees one error line. Calling it again does nothing. A library caller
    does not need it: :meth:`moefast.train.Trainer.run` holds the filters while it runs."""
    global _held_until_exit
    if _held_until_exit is None:
        _held_until_exit = contextlib.ExitStack()
        _held_until_exit.enter_context(quiet_orbax_aftermath())  # never exited


def _drain(reports: list[float], error: BaseException, quiet_s: float = 0.25, limit_s: float = 3.0) -> None:
    """Lets orbax's tasks of a failed operation report now, into the filters, rather than after
    ``error`` has reached the user: waits until none has reported (``reports``: the times of those
    dropped) for ``quiet_s`` seconds, at most ``limit_s`` (a failed read leaves tensorstore reads in
    flight that complete into an event loop already closed, within about 0.1 s here); then frees
    the frames of orbax's failure that ``error`` chains to (``__cause__`` / ``__context__``: their
    locals hold orbax's failed tasks and futures; ``error``'s own frames are kept) and collects
    garbage, so that their "exception was never retrieved" reports come now."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s and time.monotonic() - max([t0, *reports[-1:]]) < quiet_s:
        time.sleep(0.05)
    seen, inner = {id(error)}, error.__cause__ or error.__context__
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        traceback.clear_frames(inner.__traceback__)
        inner = inner.__cause__ or inner.__context__
    gc.collect()
