"""Ctrl-C and SIGTERM in the command: SIGTERM taken as a Ctrl-C (:class:`_Terminated`), the
signal handling of ``moefast import-hf`` up to its commit point (:class:`_ImportSignals`), the one
line and exit status an interrupt ends with (:func:`_interrupted`), and the interrupt behind an
``ImportError`` that numpy or jaxlib made of one (:func:`_interrupt_behind`)."""

from __future__ import annotations

import os
import sys


class _Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, Slurm, docker stop) as a Ctrl-C."""


class _ImportSignals:
    """SIGINT / SIGTERM during ``moefast import-hf``: either the import is aborted (what it made is
    removed, exit 130, 143 for SIGTERM) or, once committed, nothing changes (exit 0).

    The handlers record the first signal and raise ``KeyboardInterrupt`` (:class:`_Terminated` for
    SIGTERM) while :attr:`raising`. Python drops an exception raised in a gc callback or a
    ``__del__`` (JAX's ``_xla_gc_callback`` runs often), so the flag is checked again at the commit
    point (:meth:`check`): a signal taken there, or swallowed before, still aborts; the report of
    such a swallowed ``KeyboardInterrupt`` is dropped while installed. While :attr:`raising` is
    False (the step-0 write; after :meth:`settle`: the commit, or the cleanup of an abort) a signal
    is only recorded. Installed from the main thread only; :meth:`uninstall` puts back the previous
    handlers and ``sys.unraisablehook``.
    """

    def __init__(self):
        self.signal: str | None = None  # the first signal taken: "SIGINT" or "SIGTERM"
        self.raising = True
        self.left = ""  # what an abort leaves, said after "interrupted: "
        self._previous: dict = {}
        self._hook = None

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable

    def _handle(self, signum, frame) -> None:
        import signal

        self.signal = self.signal or signal.Signals(signum).name
        if self.raising:
            self.check()

    def _unraisable(self, unraisable) -> None:
        if not (self.signal and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self._hook(unraisable)  # a swallowed Ctrl-C is taken at the commit point: no report

    def settle(self) -> None:
        """From here a signal is only recorded: the import has committed, or is cleaning up."""
        self.raising = False

    def check(self) -> None:
        """Raises the interrupt of a signal taken so far (perhaps swallowed where it was raised)."""
        if self.signal:
            raise _Terminated if self.signal == "SIGTERM" else KeyboardInterrupt

    def ignore_until_exit(self) -> None:
        """SIG_IGN for both signals (where installed): a process that has settled only exits. Python
        puts back the default handlers while it shuts down (JAX's teardown takes a while), and a
        signal then would kill it with 130 (143) after the import said it succeeded; SIG_IGN stays."""
        import signal

        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()
        if self._hook is not None:
            sys.unraisablehook, self._hook = self._hook, None

    def uninstall(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, handler)
        self._previous.clear()
        if self._hook is not None:
            sys.unraisablehook, self._hook = self._hook, None


def _interrupted(e: KeyboardInterrupt, left: str, own_process: bool) -> int:
    """One line for an interrupt, and its exit status (130, 143 for SIGTERM). A process that exists
    for this command leaves at once and quietly: a normal exit would wait for orbax's threads (a
    checkpoint being written: an interrupted write is never listed as a step, the next run removes
    it) and, with several processes, in jax.distributed's shutdown barrier for peers that are still
    training (they are stopped by the coordination service's heartbeat timeout). A caller
    in-process gets the status."""
    term = isinstance(e, _Terminated)
    print(f"interrupted{' (SIGTERM)' if term else ''}{': ' + left if left else ''}", file=sys.stderr)
    code = 143 if term else 130
    if own_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _interrupt_behind(e: BaseException, signals: _ImportSignals) -> KeyboardInterrupt | None:
    """The interrupt an exception stands for: a ``KeyboardInterrupt`` in its chain (``__cause__`` /
    ``__context__``; an extension module's import turns one into ``ImportError``), or the signal
    ``signals`` recorded; None: a real error."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if signals.signal:
        return _Terminated() if signals.signal == "SIGTERM" else KeyboardInterrupt()
    return None
