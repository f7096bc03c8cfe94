"""``moefast import-hf`` and ``moefast export-hf``: a run started from a Hugging Face checkpoint
(config, tokenizer files and weights into a new run dir, committed at once or not at all), and a
run's latest checkpoint written back as a Hugging Face model directory, by default in the family it
was imported from (:data:`IMPORTED_FROM`). The conversion itself is :mod:`moefast.interop`."""

from __future__ import annotations

import argparse
import dataclasses
import json

from moefast.cli.common import CPU_DEVICES_HELP, _distributed_options, _inference_config
from moefast.cli.interrupts import _ImportSignals


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The ``import-hf`` and ``export-hf`` subcommands."""
    i = sub.add_parser("import-hf", help="start a run from a Hugging Face checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE, "
                                         "OLMoE, GLM-4.5, DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, Qwen3-Next, "
                                         "Qwen3.5 MoE, gpt-oss, MiniMax-M2, Gemma 4): its step-0 checkpoint holds "
                                         "the weights")
    i.add_argument("hf_dir", metavar="DIR", help="local Hugging Face model directory (config.json, *.safetensors, "
                                                 "tokenizer.json if any)")
    i.add_argument("--run-dir", required=True, help="new run directory; continue with moefast train --run-dir")
    i.add_argument("--adapter", default=None, metavar="ADAPTER_DIR",
                   help="a PEFT LoRA adapter of this model (adapter_config.json, adapter_model.safetensors) to "
                        "continue training: the run's lora section takes its rank, alpha, expert rank and targets "
                        "(lora.rank, alpha, expert_rank given must agree; lora.targets may add kinds, whose "
                        "projections get fresh adapters; lora.base_dtype, train, init, routing are yours)")
    i.add_argument("--cpu-devices", type=int, default=None, help=CPU_DEVICES_HELP)
    _distributed_options(i)
    i.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="settings of the run that the checkpoint does not fix, e.g. data.source=my.jsonl "
                        "moe.capacity_factor=0 model.scan_layers=true (the data and moe sections can only be "
                        "chosen here, not changed later; train.* can change at any moefast train)")
    x = sub.add_parser("export-hf", help="write a run's latest checkpoint as a Hugging Face model directory "
                                         "and/or, for a LoRA run, its adapters as a PEFT adapter directory")
    x.add_argument("out_dir", metavar="OUT_DIR", nargs="?", default=None,
                   help="new directory for config.json, *.safetensors and the tokenizer; a LoRA run's model is "
                        "written with its adapters merged into the weights (W + alpha/r A B)")
    x.add_argument("--run-dir", required=True, help="run directory written by moefast train or import-hf")
    x.add_argument("--adapter", default=None, metavar="ADAPTER_DIR",
                   help="(a LoRA run) new directory for its adapters alone as a PEFT adapter (adapter_config.json, "
                        "adapter_model.safetensors) that PeftModel.from_pretrained puts on the base model (the "
                        "imported one, or the family's export without adapters); with or instead of OUT_DIR")
    x.add_argument("--layout", choices=["per_expert", "fused"], default="per_expert",
                   help="expert tensors: one per expert (default; what save_pretrained writes) or fused "
                        "gate_up_proj/down_proj")
    x.add_argument("--dtype", choices=["float32", "bfloat16", "fp8"], default="float32",
                   help="saved tensors' dtype; fp8: DeepSeek-V3's block-quantized layout (every matrix but the routers', "
                        "embeddings' and output heads' in e4m3 with a scale per 128 x 128 block, the rest bfloat16), "
                        "which import-hf reads")
    x.add_argument("--family", default=None, metavar="MODEL_TYPE",
                   help="HF model_type to write, where several represent the model (a GLM-4.7-Flash fine-tune is "
                        "also a deepseek_v3 model); default: the family the run was imported from, else the first "
                        "that fits")
    x.add_argument("--cpu-devices", type=int, default=None, help=CPU_DEVICES_HELP)
    _distributed_options(x)


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
    from moefast.train.run_dir import check_run_dir

    run_dir = Path(args.run_dir)
    # before anything of the checkpoint is read: a run dir that is another run, or not a run
    check_run_dir(run_dir)
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise CheckpointError(f"--run-dir {run_dir} already holds checkpoints; import into a new run directory")
    src = Path(args.hf_dir)
    if src.name == "config.json" and src.is_file():
        src = src.parent  # the directory was meant
    cfg, hf_cfg = _import_config(src, args.overrides, args.adapter)
    tok_files = _tokenizer_files(src, cfg, hf_cfg)
    trainer = Trainer(cfg, run_dir, progress=False)  # checks the config against the devices and tokenizer
    main = trainer.is_main  # with several processes (a shared run dir), process 0 writes the files and prints
    params = hf.load_hf_params(src, cfg, shardings=trainer.base_param_sharding,
                               log=lambda s: print(f"note: {s}") if main else None)
    n = sum(x.size for x in jax.tree.leaves(params))  # the imported model's (before adapters and their storage)
    if args.adapter:  # the imported base with the run's fresh adapters, those the adapter holds read from it
        from moefast.interop import hf_adapter

        params = hf_adapter.load_peft_adapter(cfg, args.adapter, trainer.with_adapters(params),
                                              family=hf_cfg["model_type"],
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
            _copy_tokenizer(tok_files, run_dir, fresh=run_dir / "tokenizer" in made, main=main)
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
    if main:
        print(f"imported {hf_cfg['model_type']} ({n / 1e6:,.2f}M parameters) from {src}"
              + (f" with the adapter {args.adapter}" if args.adapter else "") + f" into {where}; "
              f"continue with: moefast train --run-dir {run_dir} [train.steps=N ...]")


def _copy_tokenizer(files: list, run_dir, *, fresh: bool, main: bool) -> None:
    """The tokenizer files copied into ``run_dir/tokenizer`` (by process 0; the others wait for it).

    Raises:
      CheckpointError: ``run_dir/tokenizer`` existed before the import (``fresh`` False).
    """
    import shutil

    import jax

    from moefast.train import CheckpointError

    if main:
        if not fresh:
            raise CheckpointError(f"{run_dir / 'tokenizer'} already exists; import into a new run directory")
        (run_dir / "tokenizer").mkdir(parents=True)
        for f in files:
            shutil.copy2(f, run_dir / "tokenizer" / f.name)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("moefast import-hf: tokenizer copied")


def _tokenizer_files(src, cfg, hf_cfg: dict) -> list:
    """The tokenizer files of ``src`` the run keeps a copy of (none for the byte tokenizer, with a
    note saying what that means).

    Raises:
      HFFormatError: no tokenizer.json and a vocabulary smaller than the byte tokenizer's."""
    import jax

    from moefast.interop import hf

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
    return tok_files


def _import_config(src, overrides: list[str], adapter):
    """The run's config from ``src``'s config.json and ``overrides`` (with an ``adapter``, its lora
    section from the adapter, the ``lora.*`` overrides on top: :func:`_adapter_lora`), and the
    config.json itself."""
    from moefast.interop import hf

    given = [o for o in overrides if o.startswith("lora.")] if adapter else []
    cfg = hf.config_from_hf(src, [o for o in overrides if o not in given])
    hf_cfg = hf.hf_config(src)
    if adapter:
        from moefast.interop import hf_adapter

        held = hf_adapter.adapter_lora_config(cfg, adapter, family=hf_cfg["model_type"])
        cfg = cfg.replace(lora=_adapter_lora(held, given))
    return cfg, hf_cfg


def _adapter_lora(held, overrides: list[str]):
    """The run's lora section: ``held`` (what the adapter holds: rank, alpha, expert rank, targets)
    with the ``lora.*`` ``overrides`` on it; those four must agree with the adapter (more targets
    than it adapts: the others start fresh), the rest (base dtype, train, init, routing) are free.

    Raises:
      ConfigError: an override that disagrees with the adapter, naming both values."""
    import dataclasses

    from moefast.config import ConfigError, LoRAConfig, _build_section, parse_overrides

    lora = _build_section("lora", LoRAConfig, {**dataclasses.asdict(held), **parse_overrides(overrides).get("lora", {})})
    wrong = []
    if lora.rank != held.rank:
        wrong.append(f"lora.rank={lora.rank} (the adapter's: {held.rank})")
    elif lora.rank_of("experts") != held.rank_of("experts"):
        wrong.append(f"lora.expert_rank={lora.expert_rank} (the adapter's experts have rank {held.rank_of('experts')})")
    elif any(lora.scale(t) != held.scale(t) for t in ("attention", "experts")):
        wrong.append(f"lora.alpha={lora.alpha} (the adapter's: {held.alpha if held.alpha is not None else held.rank})")
    lacks = [t for t in held.target_kinds if t not in lora.target_kinds]
    if lacks:
        wrong.append(f"lora.targets={list(lora.target_kinds)} lacks the adapter's {', '.join(map(repr, lacks))}")
    if wrong:
        raise ConfigError(f"--adapter: {'; '.join(wrong)}; leave these out to take them from the adapter")
    return lora


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


def _export_hf(args: argparse.Namespace) -> None:
    """``moefast export-hf``: the run's latest checkpoint as a Hugging Face model directory (a LoRA
    run's with its adapters merged), and/or a LoRA run's adapters as a PEFT adapter directory."""
    from pathlib import Path

    from moefast.interop import hf
    from moefast.train import Trainer, load_run_config

    if args.out_dir is None and args.adapter is None:
        raise ValueError("export-hf: give OUT_DIR (the model), --adapter ADAPTER_DIR (a LoRA run's adapters), "
                         "or both")
    dirs = [Path(d).resolve() for d in (args.out_dir, args.adapter) if d is not None]
    if len(dirs) == 2 and (dirs[0] == dirs[1] or dirs[0] in dirs[1].parents or dirs[1] in dirs[0].parents):
        raise ValueError(f"export-hf: OUT_DIR {args.out_dir} and --adapter {args.adapter} must be two separate "
                         "directories, neither inside the other")
    for d in dirs:  # before anything is written (each is written whole, then renamed into place)
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise hf.HFFormatError(f"{d} exists and is not an empty directory; choose a new one (nothing is "
                                   "overwritten)")
    cfg = _inference_config(load_run_config(args.run_dir))
    if args.adapter and args.out_dir is None and args.dtype != "float32":
        raise ValueError(f"--dtype {args.dtype} applies to the model's export (OUT_DIR); a PEFT adapter is written "
                         "in float32: drop --dtype, or give OUT_DIR too")
    if args.adapter and not cfg.lora.enabled:
        raise ValueError(f"--adapter: {args.run_dir} has no LoRA adapters (lora.rank=0); export its model with "
                         "OUT_DIR")
    trainer = Trainer(cfg, args.run_dir, progress=False)
    family = args.family or _imported_family(args.run_dir, cfg)
    step, params, routing = trainer.restore_params()
    log = lambda s: print(f"step {step}: {s}")  # noqa: E731 - logged by process 0, which writes
    if args.adapter:
        from moefast.interop import hf_adapter

        base = None
        try:
            base = json.loads((Path(args.run_dir) / IMPORTED_FROM).read_text())["path"]
        except (OSError, ValueError, KeyError):
            pass
        hf_adapter.save_peft_adapter(cfg, params, args.adapter, family=family, base_model=base, log=log)
    if args.out_dir is not None:
        hf.save_hf(cfg.replace(data=trainer.data_cfg), params, args.out_dir, routing_state=routing,
                   layout=args.layout, dtype=args.dtype, family=family, log=log)
    if args.out_dir is not None and cfg.data.tokenizer == "byte" and trainer.is_main:
        print("note: the run uses the byte tokenizer, which has no tokenizer.json: ids 0-255 are the UTF-8 "
              "bytes, 256/257/258 PAD/BOS/EOS (in config.json)")
