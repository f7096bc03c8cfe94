"""``--profile START:END``: a ``jax.profiler`` trace of optimizer steps START to END of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax

from moefast.train.timing import StepBook

__all__ = ["ProfileWindow"]


class ProfileWindow:
    """Starts the trace before step ``start`` runs and stops it once step ``end`` is done (or the run
    ends). The devices finish the earlier steps first, and the traced steps have no rate in the
    log (:meth:`StepBook.start_untimed`).

    Args:
      profile: ``(start, end)``, 1-based inclusive optimizer steps, or ``None`` (no trace).
      first, last: the first step this run will run (1-based) and its last step.
      out: the trace's directory (``<run_dir>/profile``).
      book, say: the run's step book and its console printer (``say``: under the progress bar).
      log: console printer for the note that the window is outside the run.
    """

    def __init__(self, profile: tuple[int, int] | None, *, first: int, last: int, out: Path, book: StepBook,
                 say: Callable[[str], None], log: Callable[[str], None]):
        self.out, self.book, self.say, self.tracing = out, book, say, False
        self.start = self.end = None
        if profile is not None:
            start, end = max(profile[0], first), min(profile[1], last)
            if start > end and last >= first:
                log(f"note: the steps to profile, {profile[0]} to {profile[1]}, are outside the steps of this run "
                    f"({first} to {last}); no trace is written")
            if start <= end:
                self.start, self.end = start, end

    def before(self, step: int, state: Any) -> None:
        """Called before optimizer step ``step`` (1-based) is dispatched."""
        if step == self.start:  # the trace holds these steps only: earlier ones finish first
            self.book.start_untimed("profiled")
            jax.block_until_ready(state)
            jax.profiler.start_trace(str(self.out))
            self.tracing = True

    def after(self, done: int, state: Any) -> None:
        """Called once step ``done`` is dispatched."""
        if self.tracing and done == self.end:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.tracing = False
            self.book.end_untimed()  # reads the traced steps back (their log lines)
            self.say(f"profile of steps {self.start} to {self.end} written to {self.out} "
                     f"(ui.perfetto.dev opens its *.trace.json.gz; TensorBoard needs the "
                     f"tensorboard-plugin-profile package); these steps are not in tokens/s")

    def close(self) -> None:
        """Stops a trace still running (the run ended inside the traced steps)."""
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
