"""SIGTERM / SIGINT during a run: finish the current step, checkpoint, return normally."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

import jax

__all__ = ["StopRequest"]


class StopRequest:
    """SIGTERM / SIGINT: finish the current step, checkpoint, return normally.

    Single process: Python handlers for both signals set a flag; a second signal acts as usual
    (Ctrl-C twice interrupts at once: the run does not wait for the checkpoint being written and
    resumes from the last complete one). Python runs a handler only between bytecodes, so two
    signals that both arrive during one native call (a compilation, a long device step) count as
    one: the loop says when it has taken the first (``stopping after step N``). Several processes:
    SIGTERM is taken by JAX's preemption service (installed by ``jax.distributed.initialize``) and
    every process stops at the same step through ``reached_preemption_sync_point``; SIGINT keeps
    its default behaviour.

    Handlers are installed only from the main thread (Python allows no other) and only while
    :meth:`installed` is entered; the previous handlers are put back on exit.
    """

    def __init__(self):
        self.signal: str | None = None  # the name of the first signal taken ("SIGTERM", "SIGINT")
        self._previous: dict[int, Any] = {}
        self._multi = jax.process_count() > 1

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Takes SIGTERM and SIGINT inside the ``with`` block; restores the previous handlers on any exit."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._multi:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def requested(self, step: int) -> str | None:
        """The signal that asks to stop after ``step`` (optimizer steps done), or ``None``. With
        several processes this is a collective: every process calls it at every step."""
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                return "SIGTERM (preemption notice)"
        return self.signal

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
