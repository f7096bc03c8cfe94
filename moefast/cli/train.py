"""``moefast train``, ``moefast eval`` and ``moefast generate``: the verbs that train a run, or
restore its latest checkpoint to evaluate it or sample from it; their options and what each does
once :func:`moefast.cli.main` has set up the process (devices, multi-process job, config)."""

from __future__ import annotations

import argparse
import sys

from moefast.cli.common import CPU_DEVICES_HELP, _distributed_options, _inference_config


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The ``train``, ``eval`` and ``generate`` subcommands."""
    t = sub.add_parser("train", help="train (or resume) a run")
    t.add_argument("--config", default=None,
                   help="YAML config (default: the run dir's own config.yaml when it has one, as after moefast "
                        "import-hf or an earlier run, else configs/tiny.yaml)")
    t.add_argument("--run-dir", default=None, help="run directory (default: runs/<config name>)")
    t.add_argument("--cpu-devices", type=int, default=None, help=CPU_DEVICES_HELP)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _distributed_options(t)
    t.add_argument("--profile", default=None, metavar="START:END",
                   help="write a jax.profiler trace of optimizer steps START to END (1-based, inclusive) into "
                        "RUN_DIR/profile (ui.perfetto.dev opens its *.trace.json.gz; TensorBoard needs "
                        "tensorboard-plugin-profile); those steps are left out of tokens/s")
    t.add_argument("--reset-optimizer", action="store_true",
                   help="resume the run dir's checkpoint with a fresh optimizer state (weights, routing state, step, "
                        "data position and learning-rate schedule kept): needed to change train.optimizer")
    t.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.steps=200 moe.top_k=1; the keys are the fields of "
                        "the config sections in moefast/config/, documented there (configs/tiny.yaml sets "
                        "some of them; a typo is rejected with the valid keys)")

    e = sub.add_parser("eval", help="validation loss and bits per byte of a run's latest checkpoint")
    e.add_argument("--run-dir", required=True, help="run directory written by moefast train")
    e.add_argument("--cpu-devices", type=int, default=None, help=CPU_DEVICES_HELP)
    _distributed_options(e)

    g = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    g.add_argument("--run-dir", required=True, help="run directory written by moefast train")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample at most (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="softmax temperature, 0 = greedy (default 0.8)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument("--cpu-devices", type=int, default=None, help=CPU_DEVICES_HELP)
    _distributed_options(g)


def _train(args: argparse.Namespace, cfg, profile: tuple[int, int] | None, argv: list[str] | None) -> None:
    """``moefast train``: ``cfg`` is the loaded config, ``profile`` the steps of ``--profile``."""
    from moefast.train import Trainer

    trainer = Trainer(cfg, args.run_dir, progress=not args.no_progress, profile=profile,
                      reset_optimizer=args.reset_optimizer)
    summary = trainer.run()
    if trainer.is_main:
        print(f"done: {summary.format()}")
        if summary.stopped_by:
            import shlex

            print(f"stopped by {summary.stopped_by} after step {summary.steps}; resume with the same "
                  "command: " + shlex.join(["moefast", *(sys.argv[1:] if argv is None else argv)]))


def _eval(args: argparse.Namespace) -> None:
    """``moefast eval``: validation loss and bits per byte of the run's latest checkpoint."""
    from moefast.train import Trainer, load_run_config

    cfg = _inference_config(load_run_config(args.run_dir))
    trainer = Trainer(cfg, args.run_dir, progress=False)
    step, params, routing_state = trainer.restore_params(corpus=True)  # a corpus prepared again: refused
    m = trainer.evaluate(params, routing_state)
    if trainer.is_main:
        from moefast.train.evaluation import format_eval

        print(f"step {step} | {format_eval(m)}")


def _generate(args: argparse.Namespace) -> None:
    """``moefast generate``: the prompt and its continuation sampled from the run's latest checkpoint."""
    from moefast.config import ConfigError
    from moefast.train import Trainer, generate, load_run_config

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
