"""``moefast prepare``: a corpus tokenized once into token shards (:mod:`moefast.data.prepared`,
:mod:`moefast.data.prepared_sft` for ``--format sft``), what an interrupt leaves said, and the
data readers' errors told in prepare's own terms (its arguments, not the config keys)."""

from __future__ import annotations

import argparse
import os
import re
import sys

from moefast.cli.interrupts import _interrupted, _Terminated


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``prepare`` subcommand."""
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
