"""The prepared-corpus format, shared by the writer and the reader: directory and file names,
the manifest's format and version, the token dtype, the identities a corpus records (its
tokenizer's, its own), which entries of ``OUT_DIR`` a prepare owns (what an interrupted one leaves),
and the ``moefast prepare`` command that writes a corpus again, which every error names.

The format itself and the design behind it: :mod:`moefast.data.prepared`. Writing:
:mod:`moefast.data.prepared_write`; reading: :mod:`moefast.data.prepared_read`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path

import numpy as np

from moefast.data.errors import DataError
from moefast.data.hf_tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, HFTokenizer
from moefast.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "IN_PROGRESS",
    "MANIFEST",
    "PARTIAL_PREFIX",
    "SHARD_DIR",
    "SPLITS",
    "corpus_identity",
    "prepare_command",
    "tokenizer_identity",
]

FORMAT = "moefast-prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
PARTIAL_PREFIX = ".partial-"
SPLITS = ("train", "val")

# Written into OUT_DIR (atomically) before anything else and removed once the manifest is written:
# the command that was run, so that training on an unfinished dataset can say how to finish it.
IN_PROGRESS = ".prepare-in-progress.json"
_DEFAULT_VAL_FRACTION = 0.02


def prepare_command(out_dir: str | os.PathLike, args: dict) -> str:
    """The ``moefast prepare`` command line that writes ``out_dir`` again from ``args``
    (:func:`~moefast.data.prepared_write._prepare_args`'s keys), shell-quoted, with ``--force``."""
    argv = ["moefast", "prepare", str(args["source"]), os.fspath(out_dir)]
    if args.get("format", "text") != "text":
        argv += ["--format", str(args["format"])]
    if args.get("tokenizer", "byte") != "byte":
        argv += ["--tokenizer", str(args["tokenizer"])]
    if args.get("val_fraction", _DEFAULT_VAL_FRACTION) != _DEFAULT_VAL_FRACTION:
        argv += ["--val-fraction", f"{args['val_fraction']:g}"]
    if args.get("format", "text") == "text" and args.get("text_field", "text") != "text":
        argv += ["--text-field", str(args["text_field"])]
    return shlex.join([*argv, "--force"])


def _read_json_quietly(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _args_of(record: dict | None) -> dict | None:
    """The prepare arguments a manifest or in-progress marker records (older manifests: rebuilt
    from their ``sources`` and ``tokenizer`` entries), or None."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prepare_args"), dict) and "source" in record["prepare_args"]:
        return record["prepare_args"]
    try:
        src, tok = record["sources"], record["tokenizer"]
        return {"source": src["source"], "tokenizer": tok["name"], "format": record.get("data_format", "text"),
                "val_fraction": record.get("val_fraction", _DEFAULT_VAL_FRACTION),
                "text_field": src.get("text_field", "text")}
    except (KeyError, TypeError):
        return None


def _again(root: Path, manifest: dict | None = None) -> str:
    """``"prepare it again: moefast prepare ..."``: the command that wrote ``root``, as its manifest
    (or in-progress marker) records it, into ``root`` as it is named now."""
    records = (manifest,) if manifest is not None else (_read_json_quietly(root / MANIFEST),
                                                         _read_json_quietly(root / IN_PROGRESS))
    for record in records:
        args = _args_of(record)
        if args is not None:
            return "prepare it again: " + prepare_command(root, args)
    return f"prepare it again: moefast prepare SOURCE {shlex.quote(str(root))} --force (SOURCE: the corpus it was " \
           "prepared from)"


def _unfinished(source: str, path: Path) -> DataError:
    return DataError(f"data.source={source!r}: the `moefast prepare` into {path} did not finish (interrupted or "
                     f"failed: no {MANIFEST}); {_again(path)}")


def tokenizer_identity(tokenizer: Tokenizer) -> str:
    """What a prepared corpus records of its tokenizer, compared when training starts.

    Returns:
      ``"byte"`` for :class:`~moefast.data.tokenizer.ByteTokenizer`; for a Hugging Face tokenizer
      ``"sha256:<hex>"`` over ``tokenizer.json`` and, when present next to it,
      ``tokenizer_config.json`` and ``special_tokens_map.json`` (names and contents), which fix its
      ids and its BOS/EOS/PAD.

    Raises:
      DataError: another kind of tokenizer, whose files this module does not know.
    """
    if isinstance(tokenizer, ByteTokenizer):
        return "byte"
    if isinstance(tokenizer, HFTokenizer):
        h = hashlib.sha256()
        directory = os.path.dirname(tokenizer.path)
        for path in (tokenizer.path, os.path.join(directory, TOKENIZER_CONFIG),
                     os.path.join(directory, SPECIAL_TOKENS_MAP)):
            if os.path.isfile(path):
                data = Path(path).read_bytes()
                h.update(f"{os.path.basename(path)}\0{len(data)}\0".encode())
                h.update(data)
        return "sha256:" + h.hexdigest()
    raise DataError(f"cannot identify the tokenizer {tokenizer!r} for a prepared corpus: only 'byte' and Hugging "
                    "Face tokenizers can be prepared")


def corpus_identity(manifest: dict) -> str:
    """``"sha256:<hex>"`` of what a prepared corpus is: its tokenizer's identity, format, dtype,
    split (rule, shards with their document and token counts and the digest of their contents:
    tokens, offsets and SFT masks). A run records it with its checkpoints: a data position refers
    to one corpus, so a resume on a corpus prepared again into other shards is refused. Preparing
    the same texts again gives the same identity, whatever the files' paths, mtimes or the spelling
    of the command. (A manifest written before shards carried digests is identified by its source
    files' paths, sizes and mtimes instead.)
    """
    src = manifest.get("sources") or {}
    what = {"tokenizer": (manifest.get("tokenizer") or {}).get("identity"),
            "split_rule": (manifest.get("split") or {}).get("rule"),
            **{k: manifest.get(k) for k in ("format_version", "data_format", "dtype", "val_fraction", "splits", "sft")}}
    shards = [e for split in (manifest.get("splits") or {}).values() for e in (split or {}).get("shards", [])]
    if not shards or not all("content" in e for e in shards):
        what["sources"] = {k: src.get(k) for k in ("documents", "bytes", "files")}
    return "sha256:" + hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# What a prepare writes into shards/: <split>-NNNNN.<array>.npy (tokens, offsets, ...)
_SHARD_FILE = re.compile(r"(?:train|val)-\d{5}\.[a-z_]+\.npy")


def _foreign_in_shards(shards: Path) -> list[str]:
    """Entries of a ``shards`` directory that a prepare does not write (all of it if not a directory)."""
    if shards.is_symlink() or not shards.is_dir():
        return [shards.name]
    return sorted(e.name for e in shards.iterdir() if not (_SHARD_FILE.fullmatch(e.name) and e.is_file()
                                                           and not e.is_symlink()))


def _ours(e: Path) -> bool:
    """Whether ``e`` (an entry of OUT_DIR) is something a prepare writes or leaves when interrupted."""
    if (e.name.startswith(PARTIAL_PREFIX) or e.name.startswith(f".{MANIFEST}.") or e.name == IN_PROGRESS
            or e.name.startswith(f".{IN_PROGRESS}.")):
        return True
    return e.name == SHARD_DIR and not _foreign_in_shards(e)


def _only_leftovers(path: Path) -> bool:
    """Whether every entry of ``path`` is what an interrupted prepare leaves (``.partial-*``, its
    in-progress marker, a ``shards`` directory holding only shard files)."""
    return all(_ours(e) for e in path.iterdir())
