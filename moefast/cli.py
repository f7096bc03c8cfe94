"""Command line: ``moefast train | eval | generate | bench | import-hf | export-hf | prepare`` — a thin layer
over the Python API."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys


def _inference_config(cfg):
    """A run's config for eval/generate/export on the devices of this job: the checkpoint is
    restored onto the run's model-parallel axes (``fsdp``, ``expert``) when they fit the devices,
    else onto a plain data-parallel mesh (:func:`moefast.parallel.inference_mesh`, which says why),
    and a routing kernel these devices cannot run (``triton`` off a GPU) is replaced by ``auto``:
    every implementation computes the same routing."""
    import dataclasses

    import jax

    from moefast.parallel import inference_mesh

    mesh, note = inference_mesh(cfg, jax.device_count())
    if note and jax.process_index() == 0:
        print(note, file=sys.stderr)
    cfg = cfg.replace(mesh=mesh)
    if cfg.moe.routing_impl == "triton":
        from moefast.kernels.routing import triton as triton_kernel

        why = triton_kernel.available()
        if why:
            print(f"note: moe.routing_impl=triton cannot run here ({why.split(';')[0]}); using 'auto' "
                  "(the same routing)", file=sys.stderr)
            cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, routing_impl="auto"))
    return cfg


def _distributed_options(sub: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id``, ``--distributed-timeout``: every
    command that runs a model joins a multi-process job the same way."""
    sub.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="multi-process: address of process 0 (auto-detected under SLURM / Open MPI)")
    sub.add_argument("--num-processes", type=int, default=None, help="multi-process: number of processes")
    sub.add_argument("--process-id", type=int, default=None, help="multi-process: this process, 0-based")
    sub.add_argument("--distributed-timeout", type=int, default=300, metavar="S",
                     help="multi-process: seconds to wait for peers to join, and for a dead peer's "
                          "heartbeat before stopping with an error (default 300)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moefast", description="Train mixture-of-experts language models with JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    dev_help = ("number of virtual CPU devices (default: what the config's mesh fixes, else one, the fastest on a "
                "small CPU; ignored on GPU)")

    t = sub.add_parser("train", help="train (or resume) a run")
    t.add_argument("--config", default=None,
                   help="YAML config (default: the run dir's own config.yaml when it has one, as after moefast "
                        "import-hf or an earlier run, else configs/tiny.yaml)")
    t.add_argument("--run-dir", default=None, help="run directory (default: runs/<config name>)")
    t.add_argument("--cpu-devices", type=int, default=None, help=dev_help)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _distributed_options(t)
    t.add_argument("--profile", default=None, metavar="START:END",
                   help="write a jax.profiler trace of optimizer steps START to END (1-based, inclusive) into "
                        "RUN_DIR/profile (ui.perfetto.dev opens its *.trace.json.gz; TensorBoard needs "
                        "tensorboard-plugin-profile); those steps are left out of tokens/s")
    t.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.steps=200 moe.top_k=1; the keys are the fields of "
                        "the config sections in moefast/config.py, documented there (configs/tiny.yaml sets "
                        "some of them; a typo is rejected with the valid keys)")

    e = sub.add_parser("eval", help="validation loss and bits per byte of a run's latest checkpoint")
    e.add_argument("--run-dir", required=True, help="run directory written by moefast train")
    e.add_argument("--cpu-devices", type=int, default=None, help=dev_help)
    _distributed_options(e)

    g = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    g.add_argument("--run-dir", required=True, help="run directory written by moefast train")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample at most (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="softmax temperature, 0 = greedy (default 0.8)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument("--cpu-devices", type=int, default=None, help=dev_help)
    _distributed_options(g)
    i = sub.add_parser("import-hf", help="start a run from a Hugging Face checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE, "
                                         "OLMoE, GLM-4.5, DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash): its step-0 "
                                         "checkpoint holds the weights")
    i.add_argument("hf_dir", metavar="DIR", help="local Hugging Face model directory (config.json, *.safetensors, "
                                                 "tokenizer.json if any)")
    i.add_argument("--run-dir", required=True, help="new run directory; continue with moefast train --run-dir")
    i.add_argument("--cpu-devices", type=int, default=None, help=dev_help)
    _distributed_options(i)
    i.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="settings of the run that the checkpoint does not fix, e.g. data.source=my.jsonl "
                        "moe.capacity_factor=0 model.scan_layers=true (the data and moe sections can only be "
                        "chosen here, not changed later; train.* can change at any moefast train)")
    x = sub.add_parser("export-hf", help="write a run's latest checkpoint as a Hugging Face model directory")
    x.add_argument("out_dir", metavar="OUT_DIR", help="new directory for config.json, *.safetensors and the tokenizer")
    x.add_argument("--run-dir", required=True, help="run directory written by moefast train or import-hf")
    x.add_argument("--layout", choices=["per_expert", "fused"], default="per_expert",
                   help="expert tensors: one per expert (default; what save_pretrained writes) or fused "
                        "gate_up_proj/down_proj")
    x.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="saved tensors' dtype")
    x.add_argument("--family", default=None, metavar="MODEL_TYPE",
                   help="HF model_type to write, where several represent the model (a GLM-4.7-Flash fine-tune is "
                        "also a deepseek_v3 model); default: the family the run was imported from, else the first "
                        "that fits")
    x.add_argument("--cpu-devices", type=int, default=None, help=dev_help)
    _distributed_options(x)
    pl = sub.add_parser("plot", help="PNG plots of a run's metrics: loss and bits per byte, tokens/s and MFU, "
                                     "expert load per layer, dropped fraction and router entropy, alerts marked")
    pl.add_argument("--run-dir", required=True, help="run directory written by moefast train")
    pl.add_argument("--out", default=None, metavar="DIR", help="where to write the PNGs (default: RUN_DIR/plots)")
    pr = sub.add_parser("prepare", help="tokenize a corpus once into memory-mapped token shards; train from them "
                                        "with data.source=OUT_DIR")
    pr.add_argument("source", metavar="SOURCE", help="what data.source accepts (stdlib, a directory, a glob, .jsonl, "
                                                     ".parquet), or a Hugging Face datasets directory (save_to_disk)")
    pr.add_argument("out_dir", metavar="OUT_DIR", help="new or empty directory for manifest.json and shards/")
    pr.add_argument("--tokenizer", default="byte", help="as data.tokenizer: byte (default) or a Hugging Face "
                                                        "tokenizer directory / tokenizer.json")
    pr.add_argument("--val-fraction", type=float, default=0.02,
                    help="fraction of documents held out for validation, by hash of their id (default 0.02)")
    pr.add_argument("--text-field", default="text", help="field / column holding the text in records (default text)")
    pr.add_argument("--force", action="store_true", help="replace a prepared corpus in OUT_DIR (or prepare into a "
                                                         "directory holding other files)")
    pr.add_argument("--format", choices=["text", "sft"], default="text",
                    help="text (default): documents for pretraining; sft: .jsonl conversations rendered with the "
                         "tokenizer's chat template, stored with their loss masks (train with data.format=sft)")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    b = sub.add_parser("bench", help="benchmarks (JSON + markdown table)")
    b.add_argument("target", choices=["train", "memory", "routing", "cache", "malloc", "overlap", "gpu-compile", "data"],
                   help="train: tokens/s, step time, MFU, memory and compile time of the config's train step; "
                        "with --ablate the baseline (no levers), each lever alone and all levers (caching, overlap, "
                        "slot dispatch, fused routing on GPU), interleaved in rounds; "
                        "memory: per-device bytes of parameters, optimizer state, compiled arguments and "
                        "temporaries of the config's train step for each model.remat policy, scan_layers off/on "
                        "and train.grad_accum_steps 2 and 4 (keys given as overrides are not varied), from XLA's "
                        "memory_analysis without running a step, and compile time; "
                        "routing: routing + dispatch + combine, "
                        "forward+backward; cache: step time with "
                        "cached tables on vs off and time to first step with a cold vs warm compilation cache; "
                        "malloc: moefast train processes with moefast's host malloc settings vs glibc's "
                        "defaults (MOEFAST_HOST_MALLOC=keep vs system): page faults per step, tokens/s; "
                        "overlap: train-step time for "
                        "moe.overlap_chunks 1, 2, 4 on a mesh with an expert axis (default mesh.data=2 "
                        "mesh.expert=4 on 8 CPU devices), the compiled step's all-to-alls, and moefast train "
                        "tokens/s with device prefetch on vs off; gpu-compile: compiles (never runs) the config's "
                        "train step for --devices GPUs of kind --gpu on this machine, no GPU needed, and reports per "
                        "device: compile time, memory against the GPU's, host-synced conditionals and state copies, "
                        "collectives (dtype, bytes, async or not), kernels and XLA's scheduling estimate; exits 1 "
                        "when the step does not fit (needs the CUDA PJRT plugin: README, 'Compiling for GPUs without a GPU'); "
                        "data: moefast prepare against Hugging Face datasets map(num_proc=2) (MB/s, tokens/s), then time "
                        "to first batch, peak host memory and batches/s of training from prepared shards against the "
                        "in-memory path for corpora of --sizes GB of tokens, and the tiny config's train steps/s")
    b.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="train, memory, malloc, overlap, gpu-compile: overrides of the benchmarked experiment")
    b.add_argument("--config", default=None,
                   help="train, memory, malloc, overlap, gpu-compile: YAML config (default: configs/tiny.yaml)")
    b.add_argument("--gpu", default="h100", metavar="h100|h200|FILE",
                   help="gpu-compile: the GPU to compile for (default h100: H100 SXM 80 GB; h200: H200 141 GB), or a "
                        "target description file (scripts/gpu_check.py saves a real GPU's)")
    b.add_argument("--autotune", default=None, metavar="FILE",
                   help="gpu-compile: XLA autotuning results from a real GPU (scripts/gpu_check.py saves them)")
    b.add_argument("--devices", default="8", metavar="N|HOSTSxN",
                   help="gpu-compile: GPUs to compile for, N on one host or HOSTSxN (default 8)")
    b.add_argument("--device-gib", type=float, default=None, metavar="GIB",
                   help="memory: memory of one device in GiB; adds a column saying whether each variant fits "
                        "(default on a GPU: its own limit)")
    b.add_argument("--ablate", action="store_true",
                   help="train: the lever table (baseline, +caching, +overlap, +slot dispatch, +fused routing kernel on GPU, all "
                        "levers); gpu-compile: "
                        "the lever table estimated from XLA's schedule for the GPUs compiled for")
    b.add_argument("--quick", action="store_true",
                   help="routing: a subset (including 16k tokens x 64 experts), ~2 min on CPU")
    b.add_argument("--json", default=None, metavar="OUT", help="write records to OUT (and a table to OUT's .md)")
    b.add_argument("--repeats", type=int, default=5, help="routing: timed runs per point; the median is reported")
    b.add_argument("--steps", type=int, default=None,
                   help="train: timed steps per variant and round (default 10); memory: also time this many "
                        "steps of each variant, interleaved (default 0: compile only); cache: timed train steps per "
                        "variant (default 10); malloc: steps per train process (default 12); "
                        "overlap: timed steps per chunk count and per train process (default 10); data: batches timed "
                        "per loader (default 50)")
    b.add_argument("--sizes", default="0.2,2", metavar="GB,GB",
                   help="data: prepared corpora to train from, GB of uint16 token shards (default 0.2,2), generated "
                        "in --work-dir")
    b.add_argument("--prepare-mb", type=float, default=100.0, metavar="MB",
                   help="data: MB of synthetic text tokenized by each prepare path per round (default 100)")
    b.add_argument("--work-dir", default=None, metavar="DIR",
                   help="data: where the synthetic corpora are generated (default: a temporary directory), removed "
                        "after")
    b.add_argument("--pairs", type=int, default=2, help="cache: cold/warm process pairs (default 2)")
    b.add_argument("--rounds", type=int, default=3,
                   help="train: rounds over the variants (default 3); malloc: train processes per setting "
                        "(default 3); data: rounds of the prepare comparison (default 3); overlap: "
                        "train processes per prefetch setting, 0 = none (default 3)")
    b.add_argument("--profile", default=None, metavar="DIR",
                   help="train: after the rounds, 3 profiled steps per variant, traces in DIR/<variant>/ and the "
                        "share of step time by kind of work (matmul, routing, dispatch/combine, collectives, "
                        "optimizer, other) printed")
    b.add_argument("--cpu-devices", type=int, default=None, help=dev_help)
    p.bench_parser = b
    return p


# The options of each benchmark; any other option given to it is an error, not silently ignored.
BENCH_OPTIONS = {
    "train": {"overrides", "config", "ablate", "json", "steps", "rounds", "profile", "cpu_devices"},
    "memory": {"overrides", "config", "json", "device_gib", "steps", "cpu_devices"},
    "routing": {"quick", "json", "repeats", "cpu_devices"},
    "cache": {"json", "steps", "pairs", "cpu_devices"},
    "malloc": {"overrides", "config", "json", "steps", "rounds"},
    "overlap": {"overrides", "config", "json", "steps", "rounds", "cpu_devices"},
    "gpu-compile": {"overrides", "config", "json", "gpu", "devices", "autotune", "ablate"},
    "data": {"json", "rounds", "steps", "sizes", "prepare_mb", "work_dir"},
}


def _unused_bench_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """An error naming the first option given to ``bench TARGET`` that TARGET does not use."""
    b = parser.bench_parser
    for action in b._actions:
        dest = action.dest
        if dest in ("help", "target") or dest in BENCH_OPTIONS[args.target]:
            continue
        if getattr(args, dest, None) != b.get_default(dest) and not (dest == "overrides" and not args.overrides):
            users = sorted(t for t, opts in BENCH_OPTIONS.items() if dest in opts)
            name = "section.key=value overrides" if dest == "overrides" else action.option_strings[0]
            verb = "apply" if dest == "overrides" else "applies"
            return f"{name} {verb} to bench {', '.join(users)} only, not to bench {args.target}"
    return None


PEERS_MOVED = ("moefast bench peers moved out of the installed package: run python benchmarks/peers.py from a "
               "checkout of the repository (same options; needs pip install -c constraints.txt -e '.[peers]')")


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
        from moefast.plot import plot_run

        try:
            paths = plot_run(args.run_dir, args.out)
        except (OSError, ValueError) as e:  # read errors name metrics.jsonl, write errors the directory
            print(f"error: {e}", file=sys.stderr)
            return 2
        for name, path in paths.items():
            print(f"{name}: {path}")
        return 0
    if args.command == "prepare":  # tokenizes on the host: no JAX
        return _prepare(args)
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

    if args.command == "bench" and args.target == "gpu-compile":
        from moefast.bench import gpu_compile

        try:
            gpu_compile.prepare_process()  # before JAX starts: JAX_PLATFORMS=cpu and the CUDA plugin's path
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cfg = None
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
        for size in (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert):
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
    from moefast.train import CheckpointError, Trainer, TrainingError, generate, load_run_config

    try:
        if args.command == "train":
            trainer = Trainer(cfg, args.run_dir, progress=not args.no_progress, profile=profile)
            summary = trainer.run()
            if trainer.is_main:
                print(f"done: {summary.format()}")
                if summary.stopped_by:
                    import shlex

                    print(f"stopped by {summary.stopped_by} after step {summary.steps}; resume with the same "
                          "command: " + shlex.join(["moefast", *(sys.argv[1:] if argv is None else argv)]))
        elif args.command == "eval":
            cfg = _inference_config(load_run_config(args.run_dir))
            trainer = Trainer(cfg, args.run_dir, progress=False)
            step, params, routing_state = trainer.restore_params()
            m = trainer.evaluate(params, routing_state)
            if trainer.is_main:
                from moefast.train.evaluation import format_eval

                print(f"step {step} | {format_eval(m)}")
        elif args.command == "bench":
            out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else None
            if out_dir is not None and not os.path.isdir(out_dir):
                raise ConfigError(f"--json {args.json}: the directory {out_dir} does not exist; create it or "
                                  "choose another path")
            if args.json and (os.path.isdir(args.json) or args.json.endswith(".md")):
                raise ConfigError(f"--json {args.json}: give a file name for the JSON records (e.g. out.json); the "
                                  "markdown table is written next to it with the suffix .md")
            unused = _unused_bench_options(parser, args)
            if unused:
                raise ConfigError(unused)
            if args.json == "" or args.profile == "":
                raise ConfigError("--json and --profile need a path (got an empty string)")
            if args.target == "train":
                from moefast.bench import train as train_bench

                steps = 10 if args.steps is None else args.steps
                if steps < 1 or args.rounds < 1:
                    raise ConfigError(f"--steps and --rounds must be >= 1, got {steps} and {args.rounds}")
                if args.profile is not None:
                    try:  # before the benchmark runs: a bad path fails now, not after minutes
                        os.makedirs(args.profile, exist_ok=True)
                    except OSError as e:
                        raise ConfigError(f"--profile {args.profile}: cannot create the directory ({e.strerror}); "
                                          "choose another path") from None
                return train_bench.run_cli(json_out=args.json, steps=steps, rounds=args.rounds, ablate=args.ablate,
                                           config=args.config, overrides=args.overrides, profile_dir=args.profile)
            if args.target == "memory":
                from moefast.bench import memory

                if args.device_gib is not None and not args.device_gib > 0:
                    raise ConfigError(f"--device-gib must be > 0 (GiB of one device), got {args.device_gib}")
                steps = 0 if args.steps is None else args.steps
                if steps < 0:
                    raise ConfigError(f"--steps must be >= 0 (0: compile only), got {steps}")
                return memory.run_cli(json_out=args.json, config=args.config, overrides=args.overrides,
                                      device_gib=args.device_gib, steps=steps)
            if args.target == "overlap":
                import jax

                from moefast.bench import overlap

                steps = 10 if args.steps is None else args.steps
                if steps < 1 or args.rounds < 0:
                    raise ConfigError(f"--steps must be >= 1 and --rounds >= 0 (0: no prefetch comparison), got "
                                      f"{steps} and {args.rounds}")
                return overlap.run_cli(json_out=args.json, steps=steps, rounds=args.rounds, config=args.config,
                                       overrides=args.overrides, cpu_devices=jax.device_count())
            if args.target == "malloc":
                from moefast.bench import malloc

                steps = 12 if args.steps is None else args.steps
                if steps < 3 or args.rounds < 1:
                    raise ConfigError(f"--steps must be >= 3 (three log windows) and --rounds >= 1, got {steps} "
                                      f"and {args.rounds}")
                return malloc.run_cli(json_out=args.json, rounds=args.rounds, steps=steps, config=args.config,
                                      overrides=args.overrides)
            if args.target == "gpu-compile":
                from moefast.bench import gpu_compile

                try:
                    return gpu_compile.run_cli(json_out=args.json, config=args.config, overrides=args.overrides,
                                               gpu=args.gpu, devices=args.devices, autotune=args.autotune,
                                               ablation=args.ablate)
                except (ValueError, RuntimeError) as e:  # bad --devices; the CUDA plugin missing
                    if isinstance(e, ConfigError):
                        raise
                    print(f"error: {e}", file=sys.stderr)
                    return 2
            if args.target == "data":
                from moefast.bench import data as data_bench

                steps = 50 if args.steps is None else args.steps
                try:
                    sizes = tuple(float(x) for x in args.sizes.split(","))
                except ValueError:
                    sizes = ()
                if not sizes or min(sizes) <= 0 or not args.prepare_mb > 0 or steps < 1 or args.rounds < 1:
                    raise ConfigError(f"--sizes must be positive GB separated by commas (got {args.sizes!r}), "
                                      f"--prepare-mb > 0, --steps and --rounds >= 1")
                if args.work_dir is not None and not os.path.isdir(args.work_dir):
                    raise ConfigError(f"--work-dir {args.work_dir}: not a directory")
                return data_bench.run_cli(json_out=args.json, sizes_gb=sizes, prepare_mb=args.prepare_mb,
                                          rounds=args.rounds, batches=steps, work_dir=args.work_dir)
            if args.target == "cache":
                from moefast.bench import cache

                steps = 10 if args.steps is None else args.steps
                if steps < 1 or args.pairs < 1:
                    raise ConfigError(f"--steps and --pairs must be >= 1, got {steps} and {args.pairs}")
                return cache.run_cli(json_out=args.json, steps=steps, pairs=args.pairs)
            from moefast.bench import routing

            return routing.run_cli(quick=args.quick, json_out=args.json, repeats=args.repeats)
        elif args.command == "import-hf":
            _import_hf(args, signals)  # an interrupt: it removes what it made, main says so
        elif args.command == "export-hf":
            from moefast.interop import hf

            cfg = _inference_config(load_run_config(args.run_dir))
            trainer = Trainer(cfg, args.run_dir, progress=False)
            family = args.family or _imported_family(args.run_dir, cfg)
            step, params, routing = trainer.restore_params()
            hf.save_hf(cfg.replace(data=trainer.data_cfg), params, args.out_dir, routing_state=routing,
                       layout=args.layout, dtype=args.dtype, family=family,
                       log=lambda s: print(f"step {step}: {s}"))  # logged by process 0, which writes
            if cfg.data.tokenizer == "byte" and trainer.is_main:
                print("note: the run uses the byte tokenizer, which has no tokenizer.json: ids 0-255 are the UTF-8 "
                      "bytes, 256/257/258 PAD/BOS/EOS (in config.json)")
        elif args.command == "generate":
            if args.max_new_tokens < 1:
                raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
            cfg = _inference_config(load_run_config(args.run_dir))
            trainer = Trainer(cfg, args.run_dir, progress=False)
            _, params, routing_state = trainer.restore_params()
            text = generate(trainer.model_def, params, trainer.tokenizer, args.prompt,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                            routing_state=routing_state, mesh=trainer.mesh)
            if trainer.is_main:
                print(args.prompt + text)
    except (ConfigError, DataError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _prepare(args) -> int:
    import signal
    from pathlib import Path

    from moefast.data import DataError, get_tokenizer
    from moefast.data.prepared import IN_PROGRESS, MANIFEST
    from moefast.data.prepared_sft import prepare_sft
    from moefast.data.prepared import prepare

    def on_sigterm(signum, frame):  # as a Ctrl-C: prepare removes what it wrote
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if args.format == "sft":
            m = prepare_sft(args.source, args.out_dir, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                            force=args.force, progress=not args.no_progress)
        else:
            m = prepare(args.source, args.out_dir, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                        text_field=args.text_field, force=args.force, progress=not args.no_progress)
    except (DataError, OSError) as e:
        print(f"error: {_in_prepare_terms(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # prepare has removed its partial output: say what is left
        out = Path(os.path.expanduser(args.out_dir))
        if not out.exists():
            left = f"removed {out}"
        elif (out / IN_PROGRESS).exists():
            left = f"left {out / IN_PROGRESS} (training there says to prepare again)"
        elif (out / MANIFEST).is_file():
            left = f"removed what it wrote; the dataset already in {out} is kept"
        else:
            left = f"removed what it wrote in {out}"
        return _interrupted(e, left, own_process=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    src, train, val = m["sources"], m["splits"]["train"], m["splits"]["val"]
    if args.format == "sft":
        what = "conversations"
        counts = (f": train {_count(train['documents'], 'conversation')} / {train['tokens']} tokens of which "
                  f"{train['weighted_tokens']} are targets (assistant), validation {val['documents']} / {val['tokens']} "
                  f"/ {val['weighted_tokens']}")
    else:
        what = "documents"
        counts = (f": train {_count(train['documents'], 'document')} / {train['tokens']} tokens, validation "
                  f"{_count(val['documents'], 'document')} / {val['tokens']} tokens")
    print(f"{src['documents']} {what} ({src['bytes'] / 1e6:.2f} MB) from {args.source!r} in {m['seconds']:.1f} s"
          f"{counts} ({m['dtype']}, tokenizer {m['tokenizer']['name']})")
    if "split" in m:
        print(f"split: {m['split']['note']}")
    unused_bos = getattr(get_tokenizer(args.tokenizer), "unused_bos_token", None)
    if unused_bos is not None:
        print(f"note: the tokenizer's config names bos_token {unused_bos!r}, but neither its post-processor nor "
              f"\"add_bos_token\": true adds it, so documents get no BOS (as transformers encodes them); set "
              f"\"add_bos_token\": true in its tokenizer_config.json and prepare again to start each with it")
    if src["skipped_files"]:
        print(f"note: {len(src['skipped_files'])} unreadable files skipped (first: {src['skipped_files'][0][0]})")
    print(f"train with data.source={args.out_dir} data.tokenizer={args.tokenizer}"
          + (" data.format=sft" if args.format == "sft" else ""))
    return 0


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if n == 1 else 's'}"


# The data readers name the run config's keys; `moefast prepare` takes the same values as arguments.
_PREPARE_TERMS = {"data.format=": "--format ", "data.source": "SOURCE", "data.text_field": "--text-field",
                  "data.tokenizer": "--tokenizer",
                  "data.val_fraction": "--val-fraction"}


def _in_prepare_terms(message: str) -> str:
    """An error of the data readers, with the config keys it names replaced by prepare's arguments."""
    return re.sub("|".join(re.escape(k) for k in _PREPARE_TERMS), lambda m: _PREPARE_TERMS[m.group(0)], message)


def _import_hf(args, signals: _ImportSignals) -> None:
    """``moefast import-hf``: config from config.json, the tokenizer files copied into the run dir,
    the weights streamed into the run's shardings, step 0 written. It commits once step 0 and
    ``imported_from.json`` are written: a signal taken before (``signals``) aborts it, removing what
    it made; one after changes nothing."""
    import shutil
    from pathlib import Path

    import jax

    from moefast.interop import hf
    from moefast.train import CheckpointError, Trainer

    run_dir = Path(args.run_dir)
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise CheckpointError(f"--run-dir {run_dir} already holds checkpoints; import into a new run directory")
    src = Path(args.hf_dir)
    if src.name == "config.json" and src.is_file():
        src = src.parent  # the directory was meant
    cfg = hf.config_from_hf(src, args.overrides)
    hf_cfg = hf.hf_config(src)
    tok_files = []
    if (src / "tokenizer.json").is_file() and cfg.data.tokenizer == str(src.resolve()):
        tok_files = [src / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                       "chat_template.jinja", "config.json", "generation_config.json")
                     if (src / n).is_file()]
    elif cfg.data.tokenizer == "byte":
        from moefast.data import ByteTokenizer

        byte_ids = ByteTokenizer().vocab_size
        if cfg.model.vocab_size < byte_ids:
            raise hf.HFFormatError(f"{src} has no tokenizer.json and its vocabulary ({cfg.model.vocab_size} ids) is "
                                   f"smaller than the byte tokenizer's {byte_ids}: put the model's tokenizer.json in "
                                   f"{src} or pass data.tokenizer=PATH")
        tok = ByteTokenizer()
        ours = all(hf_cfg.get(k) == v for k, v in (("pad_token_id", tok.pad_id), ("bos_token_id", tok.bos_id),
                                                     ("eos_token_id", tok.eos_id)))
        if jax.process_index() == 0 and ours:  # moefast's export of a byte-tokenizer run: its special ids
            print(f"note: {src} has no tokenizer.json and its config.json gives the byte tokenizer's PAD/BOS/EOS ids "
                  f"({tok.pad_id}/{tok.bos_id}/{tok.eos_id}, as moefast export-hf writes them): the run uses the byte "
                  "tokenizer")
        elif jax.process_index() == 0:
            print(f"note: {src} has no tokenizer.json; the run uses the byte tokenizer (ids 0-{byte_ids - 1}), which is "
                  "not the tokenizer the model was trained with")
    trainer = Trainer(cfg, run_dir, progress=False)  # checks the config against the devices and tokenizer
    main = trainer.is_main  # with several processes (a shared run dir), process 0 writes the files and prints
    params = hf.load_hf_params(src, cfg, shardings=trainer.state_sharding["params"],
                               log=lambda s: print(f"note: {s}") if main else None)
    routing = hf.load_hf_routing(src, cfg, shardings=trainer.state_sharding["routing"])
    # the routing state is replicated: this process's copy, no collective (other processes skip this)
    if main and routing and routing["bias"].addressable_data(0).any():
        rate = cfg.moe.aux_free_bias_rate
        print(f"note: the checkpoint's selection bias (e_score_correction_bias) is the run's routing state; "
              f"moe.aux_free_bias_rate={rate}: " + ("it stays as imported while training" if rate == 0 else
                                                    "training keeps balancing the experts with it"))
    for key, want in _changed_from_hf(src, cfg) if main else ():
        print(f"note: {key}={want!r} differs from {src / 'config.json'}: the imported model computes something "
              "else than the original")
    # nothing this import creates is left behind unless it all succeeds (and nothing else is removed)
    made = [p for p in (run_dir, run_dir / "tokenizer", run_dir / "checkpoints") if not p.exists()]
    try:
        if tok_files:  # the run keeps its own copy (the HF directory may move or go), found relative to it
            if main:
                if run_dir / "tokenizer" not in made:
                    raise CheckpointError(f"{run_dir / 'tokenizer'} already exists; import into a new run directory")
                (run_dir / "tokenizer").mkdir(parents=True)
                for f in tok_files:
                    shutil.copy2(f, run_dir / "tokenizer" / f.name)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("moefast import-hf: tokenizer copied")
            cfg = cfg.replace(data=dataclasses.replace(cfg.data, tokenizer="tokenizer"))
            trainer = Trainer(cfg, run_dir, progress=False)
        # A signal during the step-0 write is taken once it is complete: orbax's threads would go
        # on writing into the directory being removed (a large model makes Ctrl-C wait for it)
        signals.raising = False
        where = trainer.initialize(params, routing)
        signals.raising = True
        signals.check()
        if main:  # export-hf writes the same family back by default
            (run_dir / IMPORTED_FROM).write_text(json.dumps(
                {"model_type": hf_cfg["model_type"], "path": str(src.resolve())}, indent=1) + "\n")
        signals.settle()  # the commit point: a signal from here on is only recorded ...
        signals.check()  # ... and one taken before it (even if swallowed in a gc callback) aborts
    except BaseException:
        signals.settle()  # a second Ctrl-C does not stop the cleanup
        for p in made if main else ():
            shutil.rmtree(p, ignore_errors=True)
        raise
    n = sum(x.size for x in jax.tree.leaves(params))
    if main:
        print(f"imported {hf_cfg['model_type']} ({n / 1e6:,.2f}M parameters) from {src} into {where}; "
              f"continue with: moefast train --run-dir {run_dir} [train.steps=N ...]")


IMPORTED_FROM = "imported_from.json"
"""File in a run dir written by ``moefast import-hf``: the HF ``model_type`` and the directory read."""


def _imported_family(run_dir, cfg) -> str | None:
    """The HF family ``run_dir`` was imported from when it still represents ``cfg``'s model, else
    None (the first family that fits)."""
    from pathlib import Path

    from moefast.interop import hf

    try:
        family = json.loads((Path(run_dir) / IMPORTED_FROM).read_text())["model_type"]
        hf.hf_family(cfg, family)
    except (OSError, ValueError, KeyError, TypeError, hf.HFFormatError):
        return None
    return family


def _changed_from_hf(src, cfg) -> list[tuple[str, object]]:
    """``(key, value)`` of the model/moe keys derived from config.json that overrides changed."""
    from moefast.interop import hf

    model, moe = hf._hf_sections(hf.hf_config(src))
    model = {k: v for k, v in model.items() if k not in ("max_seq_len", "dropout", "init_std")}  # training choices
    out = [(f"model.{k}", getattr(cfg.model, k)) for k, v in model.items() if getattr(cfg.model, k) != v]
    return out + [(f"moe.{k}", getattr(cfg.moe, k)) for k, v in moe.items()
                  if k != "aux_loss_coef" and getattr(cfg.moe, k) != v]


if __name__ == "__main__":
    sys.exit(main())
