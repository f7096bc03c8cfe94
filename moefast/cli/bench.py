"""``moefast bench TARGET``: the options of every benchmark (:data:`BENCH_OPTIONS` says which
apply to which target; any other is an error), their checks, and the call into
:mod:`moefast.bench` that runs it."""

from __future__ import annotations

import argparse
import copy
import os
import sys

from moefast.cli.common import CPU_DEVICES_HELP


# What each benchmark measures: its own --help's description, and the bench help's list of targets.
BENCH_TARGETS = {
    "train": "tokens/s, step time, MFU, memory and compile time of the config's train step; with --ablate the "
             "baseline (no levers), each lever alone and all levers (caching, overlap, slot dispatch, fused routing "
             "on GPU), interleaved in rounds",
    "memory": "per-device bytes of parameters, optimizer state, compiled arguments and temporaries of the config's "
              "train step for each model.remat policy, scan_layers off/on and train.grad_accum_steps 2 and 4 (keys "
              "given as overrides are not varied), from XLA's memory_analysis without running a step, and compile "
              "time",
    "routing": "routing + dispatch + combine, forward+backward",
    "cache": "step time with cached tables on vs off and time to first step with a cold vs warm compilation cache",
    "malloc": "moefast train processes with moefast's host malloc settings vs glibc's defaults "
              "(MOEFAST_HOST_MALLOC=keep vs system): page faults per step, tokens/s",
    "overlap": "train-step time for moe.overlap_chunks 1, 2, 4 on a mesh with an expert axis (default mesh.data=2 "
               "mesh.expert=4 on 8 CPU devices), the compiled step's all-to-alls, and moefast train tokens/s with "
               "device prefetch on vs off",
    "gpu-compile": "compiles (never runs) the config's train step for --devices GPUs of kind --gpu on this machine, "
                   "no GPU needed, and reports per device: compile time, memory against the GPU's, host-synced "
                   "conditionals and state copies, collectives (dtype, bytes, async or not), kernels and XLA's "
                   "scheduling estimate; exits 1 when the step does not fit (needs the CUDA PJRT plugin: README, "
                   "'Compiling for GPUs without a GPU')",
    "linear-attention": "the gated delta rule's forward + backward (Gated DeltaNet's decay per head, KDA's per key "
                        "channel) compiled for one --gpu without a GPU, the Pallas kernels against the chunked form in "
                        "XLA ops at 4k, 16k and 64k tokens (--quick: 4k, about 5 minutes on 2 cores): temporaries, XLA's FLOP count against the "
                        "analytical one, the kernels and while loops in the program (needs the CUDA PJRT plugin)",
    "sparse-attention": "DeepSeek Sparse Attention's top-k kernel (2,048 keys a query, MLA's absorbed form) against "
                        "dense causal flash attention, forward + backward compiled for one --gpu without a GPU at 4k, "
                        "16k, 64k and 128k tokens a row (--quick: 4k): temporaries, analytical FLOPs, the kernels (needs "
                        "the CUDA PJRT plugin)",
    "data": "moefast prepare against Hugging Face datasets map(num_proc=2) (MB/s, tokens/s), then time to first "
            "batch, peak host memory and batches/s of training from prepared shards against the in-memory path for "
            "corpora of --sizes GB of tokens, and the tiny config's train steps/s",
    "precision": "the config trained --steps steps (default 300) with a baseline and a candidate value of --vary "
                 "(default model.precision=bf16,fp8; e.g. lora.base_dtype=bfloat16,nf4) for --seeds seeds, same data, "
                 "and their mean final losses compared (exits 1 when the candidate is not within 2 %)",
    "optimizer": "AdamW against Muon (train.optimizer) on the config, same data and seeds: each learning rate of "
                 "--lr-grid with the first seed, then --seeds seeds at each optimizer's best (lowest final validation "
                 "loss); their mean validation-loss curves (every --eval-every steps), the steps Muon takes to reach "
                 "AdamW's final validation loss over AdamW's, step time and optimizer memory per device (exits 1 "
                 "when Muon needs more than 0.8 x AdamW's steps)",
}


class _Help(argparse.Action):
    """``-h``/``--help`` of ``bench``: after a target (``bench gpu-compile --help``), that benchmark's
    description and options only (:func:`_target_parser`); before one, the whole ``bench`` help."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        target = getattr(namespace, "target", None)
        (_target_parser(parser, target) if target else parser).print_help()
        parser.exit()


def _target_parser(b: argparse.ArgumentParser, target: str) -> argparse.ArgumentParser:
    """A parser that only prints help: ``bench TARGET``'s description and its options
    (:data:`BENCH_OPTIONS`), each option's help cut to what it says of TARGET."""
    p = argparse.ArgumentParser(prog=f"{b.prog} {target}", description=BENCH_TARGETS[target], add_help=False)
    for action in b._actions:
        if action.dest in BENCH_OPTIONS[target] or isinstance(action, _Help):
            own = copy.copy(action)
            own.help = "show this help message and exit" if isinstance(action, _Help) else _help_of(action.help, target)
            p._add_action(own)
    return p


def _help_of(text: str | None, target: str) -> str | None:
    """What an option's help says of ``target``: helps are ``"a, b: ...; c: ..."`` (the targets each
    part is about), or have no such prefix (all targets)."""
    parts: dict[str, list[str]] = {}
    owners = None
    for part in (text or "").split("; "):
        head, sep, rest = part.partition(": ")
        names = head.split(", ")
        if sep and all(n in BENCH_TARGETS for n in names):
            owners = names
            part = rest
        if owners is None:
            return text
        for n in owners:
            parts.setdefault(n, []).append(part)
    return "; ".join(parts[target]) if target in parts else text


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``bench`` subcommand; returns its parser (:func:`_unused_bench_options` reads its defaults)."""
    b = sub.add_parser("bench", help="benchmarks (JSON + markdown table)", add_help=False)
    b.add_argument("-h", "--help", action=_Help,
                   help="show this help message and exit (after TARGET: that benchmark's options only, e.g. "
                        "moefast bench gpu-compile --help)")
    b.add_argument("target", choices=list(BENCH_TARGETS),
                   help="; ".join(f"{t}: {text}" for t, text in BENCH_TARGETS.items()).replace("%", "%%"))
    b.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="train, memory, malloc, overlap, gpu-compile, precision, optimizer: overrides of the benchmarked "
                        "experiment")
    b.add_argument("--config", default=None,
                   help="train, memory, malloc, overlap, gpu-compile, precision, optimizer: YAML config (default: "
                        "configs/tiny.yaml)")
    b.add_argument("--gpu", default="h100", metavar="h100|h200|FILE",
                   help="gpu-compile, linear-attention, sparse-attention: the GPU to compile for (default h100: H100 SXM 80 GB; h200: H200 141 GB), or a "
                        "target description file (scripts/gpu_check.py saves a real GPU's)")
    b.add_argument("--autotune", default=None, metavar="FILE",
                   help="gpu-compile: XLA autotuning results from a real GPU (scripts/gpu_check.py saves them)")
    b.add_argument("--gemm-utilization", type=float, default=None, metavar="U",
                   help="gpu-compile: the share of their dtype's peak at which the replay costs moefast's GEMM kernels "
                        "(bf16 and FP8 alike; default the assumed moefast.bench.kernel_costs.GEMM_KERNEL_UTILIZATION, "
                        "0.5): e.g. what scripts/gpu_check.py --only fp8_gemm measured")
    b.add_argument("--devices", default="8", metavar="N|HOSTSxN",
                   help="gpu-compile: GPUs to compile for, N on one host or HOSTSxN (default 8)")
    b.add_argument("--network", default=None, metavar="dgx-h100|dgx-h200|FILE",
                   help="gpu-compile: the cluster XLA's cost model assumes between hosts (default: XLA's own, 25 GB/s per "
                        "GPU); dgx-h100 / dgx-h200: 8 GPUs per host on NVLink, 400 Gb/s InfiniBand per GPU "
                        "(moefast/bench/gpu_targets/*.network), or a file of such key=value lines")
    b.add_argument("--no-twin", dest="twin", action="store_false",
                   help="gpu-compile: take XLA's estimate on the program as compiled (one compilation) instead of its "
                        "costing twin, whose weight-gradient GEMMs return bf16 (XLA's table costs bf16 -> f32 GEMMs "
                        "about 60x too slow: moefast/bench/gpu_schedule.py)")
    b.add_argument("--device-gib", type=float, default=None, metavar="GIB",
                   help="memory: memory of one device in GiB; adds a column saying whether each variant fits "
                        "(default on a GPU: its own limit)")
    b.add_argument("--ablate", action="store_true",
                   help="train: the lever table (baseline, +caching, +overlap, +slot dispatch, +fused routing kernel on GPU, all "
                        "levers); gpu-compile: the lever table estimated from XLA's schedule for the GPUs compiled for")
    b.add_argument("--ablate-exchange", action="store_true",
                   help="gpu-compile: the expert exchange's levers across hosts (hierarchical exchange, FP8 dispatch, "
                        "collectives in flight, the exchange in 2 chunks, 2 sequence slices through the layers), each added to the config as given, and all together")
    b.add_argument("--ablate-precision", action="store_true",
                   help="gpu-compile: the config with model.precision=bf16, then fp8 (the FP8 GEMM kernels costed from "
                        "their FLOPs in the re-costed columns)")
    b.add_argument("--quick", action="store_true",
                   help="routing: a subset (including 16k tokens x 64 experts), ~2 min on CPU; linear-attention, sparse-attention: "
                        "4k tokens only")
    b.add_argument("--json", default=None, metavar="OUT", help="write records to OUT (and a table to OUT's .md)")
    b.add_argument("--repeats", type=int, default=5, help="routing: timed runs per point; the median is reported")
    b.add_argument("--steps", type=int, default=None,
                   help="train: timed steps per variant and round (default 10); memory: also time this many "
                        "steps of each variant, interleaved (default 0: compile only); cache: timed train steps per "
                        "variant (default 10); malloc: steps per train process (default 12); "
                        "overlap: timed steps per chunk count and per train process (default 10); data: batches timed "
                        "per loader (default 50); precision, optimizer: steps of each run (default 300)")
    b.add_argument("--sizes", default="0.2,2", metavar="GB,GB",
                   help="data: prepared corpora to train from, GB of uint16 token shards (default 0.2,2), generated "
                        "in --work-dir")
    b.add_argument("--prepare-mb", type=float, default=100.0, metavar="MB",
                   help="data: MB of synthetic text tokenized by each prepare path per round (default 100)")
    b.add_argument("--work-dir", default=None, metavar="DIR",
                   help="data: where the synthetic corpora are generated (default: a temporary directory), removed "
                        "after")
    b.add_argument("--pairs", type=int, default=2, help="cache: cold/warm process pairs (default 2)")
    b.add_argument("--vary", default="model.precision=bf16,fp8", metavar="KEY=BASELINE,CANDIDATE",
                   help="precision: the key and its two values compared (default model.precision=bf16,fp8)")
    b.add_argument("--seeds", type=int, default=2,
                   help="precision: runs per value of --vary, train.seed the config's, +1, ...; the verdict is on the means "
                        "(default 2); optimizer: runs per optimizer at its picked learning rate, train.seed the "
                        "config's (the grid's), +1, ...; the figures are their means (default 2)")
    _add_optimizer_options(b)
    b.add_argument("--rounds", type=int, default=3,
                   help="train: rounds over the variants (default 3); malloc: train processes per setting "
                        "(default 3); data: rounds of the prepare comparison (default 3); overlap: "
                        "train processes per prefetch setting, 0 = none (default 3)")
    b.add_argument("--profile", default=None, metavar="DIR",
                   help="train: after the rounds, 3 profiled steps per variant, traces in DIR/<variant>/ and the "
                        "share of step time by kind of work (matmul, routing, dispatch/combine, collectives, "
                        "optimizer, other) printed")
    b.add_argument("--cpu-devices", type=int, default=None, help=CPU_DEVICES_HELP)
    return b


def _add_optimizer_options(b: argparse.ArgumentParser) -> None:
    """The options of ``bench optimizer`` alone."""
    b.add_argument("--lr-grid", default="1e-3,3e-3,1e-2", metavar="LR,LR,...",
                   help="optimizer: the learning rates (train.learning_rate, > 0) tried with the first seed, the "
                        "same for both optimizers (default 1e-3,3e-3,1e-2)")
    b.add_argument("--eval-every", type=int, default=25, metavar="N",
                   help="optimizer: steps between validation evaluations (train.eval_every; default 25), the "
                        "resolution of the steps to AdamW's final validation loss")


# The options of each benchmark; any other option given to it is an error, not silently ignored.
BENCH_OPTIONS = {
    "train": {"overrides", "config", "ablate", "json", "steps", "rounds", "profile", "cpu_devices"},
    "memory": {"overrides", "config", "json", "device_gib", "steps", "cpu_devices"},
    "routing": {"quick", "json", "repeats", "cpu_devices"},
    "cache": {"json", "steps", "pairs", "cpu_devices"},
    "malloc": {"overrides", "config", "json", "steps", "rounds"},
    "overlap": {"overrides", "config", "json", "steps", "rounds", "cpu_devices"},
    "gpu-compile": {"overrides", "config", "json", "gpu", "devices", "autotune", "ablate", "ablate_exchange",
                    "ablate_precision", "network", "twin", "gemm_utilization"},
    "linear-attention": {"json", "gpu", "quick"},
    "sparse-attention": {"json", "gpu", "quick"},
    "data": {"json", "rounds", "steps", "sizes", "prepare_mb", "work_dir"},
    "precision": {"overrides", "config", "json", "steps", "seeds", "vary"},
    "optimizer": {"overrides", "config", "json", "steps", "seeds", "lr_grid", "eval_every"},
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


def _gpu_compile(args) -> int:
    """``moefast bench gpu-compile`` (or one of its ablation tables)."""
    from moefast.config import ConfigError
    from moefast.bench import gpu_ablate, gpu_compile

    try:
        if args.gemm_utilization is not None:  # before any compile
            from moefast.bench.kernel_costs import check_gemm_utilization

            check_gemm_utilization(args.gemm_utilization)
        if args.ablate + args.ablate_exchange + args.ablate_precision > 1:
            raise ConfigError("--ablate, --ablate-exchange and --ablate-precision are three tables: give one")
        if args.ablate or args.ablate_exchange or args.ablate_precision:
            table = "exchange" if args.ablate_exchange else "precision" if args.ablate_precision else "levers"
            return gpu_ablate.run_ablation(table, json_out=args.json,
                                           config=args.config, overrides=args.overrides, gpu=args.gpu,
                                           devices=args.devices, network=args.network, twin=args.twin,
                                           autotune=args.autotune, gemm_utilization=args.gemm_utilization)
        return gpu_compile.run_cli(json_out=args.json, config=args.config, overrides=args.overrides,
                                   gpu=args.gpu, devices=args.devices, autotune=args.autotune,
                                   network=args.network, twin=args.twin, gemm_utilization=args.gemm_utilization)
    except (ValueError, RuntimeError) as e:  # bad --devices; the CUDA plugin missing
        if isinstance(e, ConfigError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def _kernel_bench(args) -> int:
    """``moefast bench linear-attention`` / ``sparse-attention``: one kernel family compiled for
    ``--gpu``."""
    from moefast.bench import linear_attention, sparse_attention

    bench = linear_attention if args.target == "linear-attention" else sparse_attention
    try:
        return bench.run_cli(gpu=args.gpu, quick=args.quick, json_out=args.json)
    except (ValueError, RuntimeError) as e:  # an unknown --gpu; the CUDA plugin missing
        print(f"error: {e}", file=sys.stderr)
        return 2


def _data(args) -> int:
    """``moefast bench data``."""
    from moefast.config import ConfigError
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


def _precision(args) -> int:
    """``moefast bench precision``."""
    from moefast.config import ConfigError
    from moefast.bench import precision

    if args.steps is not None and args.steps < 50:
        raise ConfigError(f"--steps must be >= 50 (the final loss averages 5 records logged every 10 steps), "
                          f"got {args.steps}")
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    key, _, values = args.vary.partition("=")
    if not key or values.count(",") != 1 or not all(values.split(",")):
        raise ConfigError(f"--vary {args.vary!r}: expected KEY=BASELINE,CANDIDATE (e.g. lora.base_dtype=bfloat16,nf4)")
    return precision.run_cli(json_out=args.json, config=args.config, overrides=args.overrides, steps=args.steps,
                             seeds=args.seeds, vary=(key, *values.split(",")))


def _lr_grid(text: str) -> tuple[float, ...]:
    """``--lr-grid``: learning rates separated by commas, each finite and > 0, none twice.

    Raises:
      ConfigError: one that does not parse, is <= 0 or repeats, or none.
    """
    import math

    from moefast.config import ConfigError

    try:
        grid = tuple(float(x) for x in text.split(","))
    except ValueError:
        grid = ()
    if not grid or not all(math.isfinite(lr) and lr > 0 for lr in grid) or len(set(grid)) != len(grid):
        raise ConfigError(f"--lr-grid {text!r}: expected distinct learning rates > 0 separated by commas "
                          "(e.g. 1e-3,3e-3,1e-2)")
    return grid


def _optimizer(args) -> int:
    """``moefast bench optimizer``."""
    from moefast.config import ConfigError
    from moefast.bench import optimizer

    steps = 300 if args.steps is None else args.steps
    if args.eval_every < 1:
        raise ConfigError(f"--eval-every must be >= 1 (steps between evaluations), got {args.eval_every}")
    if steps < args.eval_every:
        raise ConfigError(f"--steps ({steps}) must be >= --eval-every ({args.eval_every}): the validation curves "
                          "are evaluated every --eval-every steps up to --steps")
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    return optimizer.run_cli(json_out=args.json, config=args.config, overrides=args.overrides, steps=steps,
                             seeds=args.seeds, lr_grid=_lr_grid(args.lr_grid), eval_every=args.eval_every)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``moefast bench TARGET``: the options checked, then the benchmark run; its exit status.

    Raises:
      ConfigError: an option that TARGET does not use, or a bad value of one.
    """
    from moefast.config import ConfigError

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
    if args.target in ("gpu-compile", "linear-attention", "sparse-attention", "data", "precision", "optimizer"):
        return {"gpu-compile": _gpu_compile, "linear-attention": _kernel_bench, "sparse-attention": _kernel_bench,
                "data": _data, "precision": _precision, "optimizer": _optimizer}[args.target](args)
    if args.target == "cache":
        from moefast.bench import cache

        steps = 10 if args.steps is None else args.steps
        if steps < 1 or args.pairs < 1:
            raise ConfigError(f"--steps and --pairs must be >= 1, got {steps} and {args.pairs}")
        return cache.run_cli(json_out=args.json, steps=steps, pairs=args.pairs)
    from moefast.bench import routing

    return routing.run_cli(quick=args.quick, json_out=args.json, repeats=args.repeats)
