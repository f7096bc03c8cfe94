"""``moefast plot``: PNG plots of a run's ``metrics.jsonl`` (:mod:`moefast.plot`); no JAX."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``plot`` subcommand."""
    pl = sub.add_parser("plot", help="PNG plots of a run's metrics: loss and bits per byte, tokens/s and MFU, "
                                     "expert load per layer, dropped fraction and router entropy, alerts marked")
    pl.add_argument("--run-dir", required=True, help="run directory written by moefast train")
    pl.add_argument("--out", default=None, metavar="DIR", help="where to write the PNGs (default: RUN_DIR/plots)")


def _plot(args: argparse.Namespace) -> int:
    """``moefast plot``: writes the PNGs and prints their paths; 2 on an error reading or writing."""
    from moefast.plot import plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except (OSError, ValueError) as e:  # read errors name metrics.jsonl, write errors the directory
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
