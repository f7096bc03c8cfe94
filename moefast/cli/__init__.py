"""Command line: ``moefast train | eval | generate | bench | import-hf | export-hf | prepare | plot``,
a thin layer over the Python API.

:func:`main` (the ``moefast`` console script, ``python -m moefast``) parses the command line and
sets up the process before JAX starts (host malloc settings, CPU devices for the mesh, XLA flags,
the multi-process job), then runs the verb. Each verb's options and body live in its own module:

- :mod:`moefast.cli.train`: ``train``, ``eval``, ``generate``;
- :mod:`moefast.cli.hf`: ``import-hf``, ``export-hf``;
- :mod:`moefast.cli.prepare`: ``prepare``;
- :mod:`moefast.cli.bench`: ``bench TARGET``;
- :mod:`moefast.cli.plot`: ``plot``;
- :mod:`moefast.cli.common`: what several verbs share (``--cpu-devices``, the multi-process
  options, the config a checkpoint is restored with);
- :mod:`moefast.cli.interrupts`: Ctrl-C and SIGTERM (one line, exit 130 or 143; ``import-hf``
  aborted or committed whole).

Only ``moefast/__main__.py`` imports this package (``tests/test_dependencies.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from moefast.cli import bench, hf, plot, prepare, train
from moefast.cli.bench import BENCH_OPTIONS, PEERS_MOVED
from moefast.cli.common import _inference_config  # noqa: F401 - re-exported: tests call cli._inference_config
from moefast.cli.hf import IMPORTED_FROM, _imported_family  # noqa: F401 - re-exported: tests use them from here
from moefast.cli.interrupts import _ImportSignals, _interrupt_behind, _interrupted

__all__ = ["BENCH_OPTIONS", "IMPORTED_FROM", "PEERS_MOVED", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moefast", description="Train mixture-of-experts language models with JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    train.add_parsers(sub)  # train, eval, generate
    hf.add_parsers(sub)  # import-hf, export-hf
    plot.add_parser(sub)
    prepare.add_parser(sub)
    p.bench_parser = bench.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``moefast`` command; ``argv`` None: ``sys.argv`` (this process exists to run it).

    Ctrl-C while a command starts (importing JAX, reading the config) is one line ``interrupted``
    and exit 130, not a traceback; each command says what an interrupt leaves once it runs."""
    signals = _ImportSignals()
    try:
        return _main(argv, signals)
    except KeyboardInterrupt as e:
        signals.settle()
        return _interrupted(e, signals.left, own_process=argv is None)
    except Exception as e:  # noqa: BLE001 - numpy/jaxlib turn a Ctrl-C during their import into ImportError
        interrupt = _interrupt_behind(e, signals)
        if interrupt is None:
            raise
        signals.settle()
        return _interrupted(interrupt, signals.left, own_process=argv is None)
    finally:
        if argv is None and not signals.raising:  # import-hf has committed (or failed) in its own process
            signals.ignore_until_exit()
        else:
            signals.uninstall()


def _main(argv: list[str] | None, signals: _ImportSignals) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:2] == ["bench", "peers"]:  # a development benchmark, not part of the command any more
        print(f"error: {PEERS_MOVED}", file=sys.stderr)
        return 2
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may sit anywhere among the options: argparse leaves the ones after an option here.
    with_overrides = ("train", "bench", "import-hf")
    strays = [a for a in extra if args.command not in with_overrides or a.startswith("-") or "=" not in a]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    if args.command in with_overrides:
        args.overrides = [*args.overrides, *extra]
    if args.command == "plot":  # reads metrics.jsonl only: no JAX
        return plot._plot(args)
    if args.command == "prepare":  # tokenizes on the host: no JAX
        return prepare._prepare(args)
    if args.command == "import-hf":  # from here until it has committed, a Ctrl-C or SIGTERM aborts it
        signals.left = f"nothing was imported into {args.run_dir}"
        signals.install()
    if args.cpu_devices is not None and args.cpu_devices < 1:
        print(f"error: --cpu-devices must be >= 1, got {args.cpu_devices}", file=sys.stderr)
        return 2
    profile = None
    if args.command == "train" and args.profile is not None:
        try:
            a, b = (int(x) for x in args.profile.split(":"))
        except ValueError:
            a = b = 0
        if 1 <= a <= b:
            profile = (a, b)
        else:
            print(f"error: --profile {args.profile}: expected START:END, optimizer steps with 1 <= START <= END "
                  "(e.g. --profile 10:12)", file=sys.stderr)
            return 2
    if args.command == "generate" and args.temperature < 0:
        print(f"error: --temperature must be >= 0 (0 = greedy), got {args.temperature}", file=sys.stderr)
        return 2
    from moefast import host_memory
    from moefast.config import ConfigError, load_config

    try:
        # Before JAX starts its CPU threads: keep the step's freed host memory mapped (importing moefast
        # changes nothing process-wide; the command sets what a run needs). See moefast.host_memory.
        host_memory.configure()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if argv is None and args.command in ("train", "eval", "generate", "import-hf", "export-hf"):
        # This process exists to run this one command (main() called with sys.argv, not in-process
        # from a program): orbax's reports of a failed checkpoint task, some printed only at
        # interpreter exit, are dropped until then, so that the error is one line.
        from moefast.train.checkpoint import quiet_orbax_aftermath_until_exit

        quiet_orbax_aftermath_until_exit()

    if args.command == "bench" and args.target in ("gpu-compile", "linear-attention", "sparse-attention"):
        from moefast.bench import gpu_compile

        try:
            # before JAX starts: JAX_PLATFORMS=cpu, the CUDA plugin's path and the cluster model
            gpu_compile.prepare_process(args.network if args.target == "gpu-compile" else None)
        except (RuntimeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cfg = None
    if args.command == "train" and args.run_dir:
        from moefast.train import CheckpointError
        from moefast.train.run_dir import check_run_dir

        try:  # before its config.yaml is taken for the run's: a directory that is not a run is refused
            check_run_dir(Path(args.run_dir))
        except (ConfigError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command == "train" or (args.command == "bench" and args.target in ("train", "memory")):
        config = args.config
        if config is None and args.command == "train" and args.run_dir:
            own = os.path.join(args.run_dir, "config.yaml")
            config = own if os.path.isfile(own) else None  # continue a run (or an imported one) with its own config
        try:
            cfg = load_config(config, args.overrides)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    mesh_devices = 8 if args.command == "bench" and args.target == "overlap" else 1  # its default mesh: 2 x 4
    if args.command == "import-hf":  # its config is read later; the mesh it asks for is in the overrides
        from moefast.config import parse_overrides

        try:
            mesh = parse_overrides(list(args.overrides)).get("mesh", {})
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for size in mesh.values():
            mesh_devices *= size if isinstance(size, int) and size > 1 else 1
    if cfg is not None:
        from moefast.parallel import xla_flags

        xla_flags.configure(cfg.overlap.xla_flags)  # before JAX starts: XLA reads XLA_FLAGS once
        for size in (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.context):
            mesh_devices *= max(size, 1)
    elif args.command in ("eval", "generate", "export-hf"):  # the run's model-parallel axes: CPU devices for them
        from moefast.train.run_dir import load_run_config as _run_config

        try:
            run_mesh = _run_config(args.run_dir).mesh
            mesh_devices = max(run_mesh.fsdp, 1) * max(run_mesh.expert, 1)
        except (RuntimeError, OSError, ValueError):  # not a run dir, a bad config: the command reports it below
            pass
    from moefast.parallel.cpu_devices import set_cpu_devices

    set_cpu_devices(args.cpu_devices, mesh_devices)
    if args.command in ("train", "eval", "generate", "import-hf", "export-hf"):
        from moefast.parallel.distributed import initialize

        try:
            initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.distributed_timeout)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    if args.command == "train":
        import jax

        from moefast.parallel.distributed import cpu_jax_on_gpu_machine

        hint = cpu_jax_on_gpu_machine(jax.default_backend())
        if hint:
            print(hint, file=sys.stderr)

    from moefast.data import DataError
    from moefast.train import CheckpointError, TrainingError

    try:
        if args.command == "train":
            train._train(args, cfg, profile, argv)
        elif args.command == "eval":
            train._eval(args)
        elif args.command == "bench":
            return bench._bench(args, parser)
        elif args.command == "import-hf":
            hf._import_hf(args, signals)  # an interrupt: it removes what it made, main says so
        elif args.command == "export-hf":
            hf._export_hf(args)
        elif args.command == "generate":
            train._generate(args)
    except (ConfigError, DataError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
