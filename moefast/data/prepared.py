"""Prepared token shards: tokenize a corpus once, then train from memory-mapped shards.

``moefast prepare SOURCE OUT_DIR`` (:func:`prepare`) reads every source ``data.source`` accepts
(text files, directories, globs, ``.jsonl``, ``.parquet``, and a Hugging Face ``datasets``
directory written by ``save_to_disk``) file by file, splits documents into train and validation by
the same hash rule as :func:`~moefast.data.sources.split_documents`, tokenizes them in batches on
worker threads (a Hugging Face tokenizer's ``encode_batch`` releases the GIL and runs on every
core), and writes::

    OUT_DIR/
      manifest.json                      written last: a directory without it is not a dataset
      shards/train-00000.tokens.npy      uint16 [N] (uint32 when the vocabulary needs it): token ids,
                                         documents back to back, no BOS/EOS/PAD
      shards/train-00000.offsets.npy     int64 [D + 1]: document d is tokens[offsets[d]:offsets[d+1]]
      shards/train-00001.* ... shards/val-00000.* ...

A ``data.source`` that is such a directory (:func:`is_prepared`) trains from the shards
(:func:`open_prepared`): nothing is tokenized at start; every shard's header is checked when it is
opened, the offsets are memory-mapped and the tokens read with ``os.pread`` only where a row needs
them (:class:`ShardArray`).

Design choices:

- **Format: ``.npy`` token arrays + ``.npy`` offsets** (Megatron's indexed dataset and levanter's
  cache are the models), rather than ArrayRecord. A packed row crosses documents, so what training
  needs is a contiguous slice of the token stream: one ``pread`` of a few hundred bytes, without a
  decompression, from the OS page cache that every process of a host shares. (A memory map of the
  tokens made the process's resident memory grow with the corpus: see :class:`ShardArray`.)
  ``.npy`` headers carry dtype and shape, so a shard of another dtype or a truncated one is caught
  when it is opened. Measured on a 2-core CPU with the stdlib corpus byte-tokenized (731
  documents, 12.1 M tokens): writing took 0.17 s for ``.npy`` (24 MB) and 0.17 s for ArrayRecord
  (one record per document, default zstd, 4.3 MB; 0.04 s and 24 MB uncompressed); 20,000
  random windows of 257 tokens took 0.07 s from a memory map against 5.9 s from ArrayRecord
  (2.2 s uncompressed): a window needs whole records (documents), each looked up, copied and
  decompressed, and the offsets index is needed anyway to find them. A full row (the window plus
  segment ids, positions and loss weights) costs ~120 µs at T=256, against ~46 µs for an
  in-memory :class:`~moefast.data.packing.PackedRows` row.
- **Packing on the fly, not at prepare time.** The packed stream is defined by the offsets alone:
  document d of a split occupies ``offsets[d] + d·(1 + has_bos)`` onwards in the stream of
  ``[BOS] + tokens + [EOS]`` pieces that :func:`~moefast.data.packing.pack_documents` builds, so
  row r (``stream[r·T : r·T + T + 1]``) is located with two binary searches over the
  memory-mapped offsets and filled from one slice of the token shard; its segment ids, positions
  and loss weights then come from :class:`~moefast.data.packing.PackedRows` itself, applied to
  that window (:func:`~moefast.data.packing.pack_documents` itself would build the whole split's
  stream in memory, which is what this avoids). Rows are thus bit-identical to the in-memory
  packing for every ``data.seq_len``, one prepared corpus serves every sequence length, and host
  memory does not grow with the corpus (no per-row or per-document array is materialised: O(shards)
  memory, plus the page cache).
  Packing at prepare time would fix ``seq_len`` into the files and save only a binary search
  per row.

The train/validation split uses ``sources.split_documents``' rule (``blake2b(id) / 2**64 <
val_fraction``, and its fallbacks when one side would be empty: the documents of smallest hash held
out whole, or every document cut when there are too few), so a prepared corpus and the in-memory
pipeline split, tokenize and pack the same documents into the same rows; with the same seed
``train_dataset`` yields the same batches from both. A fallback costs another pass over the source
(its ids, for the smallest hashes) and a second tokenization; it happens only to small corpora. The
manifest's ``split`` says which rule was used and why, and ``moefast prepare`` prints it.

An interrupted prepare never leaves a dataset that looks complete: ``OUT_DIR/.prepare-in-progress.json``
(the command being run) is written first, shards are written into ``OUT_DIR/.partial-*``, moved to
``OUT_DIR/shards`` in one rename, ``manifest.json`` is written (atomically) last, and the marker
removed. A prepare that fails (bad input, Ctrl-C, a write error) removes what it wrote, and OUT_DIR
itself if it created it; a ``--force`` prepare keeps the dataset it was to replace until its own is
written. Training on a directory holding the marker or leftovers without a manifest is one error
naming the command to run again; a re-run removes the leftovers and starts again.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import heapq
import json
import os
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from moefast.data import sources
from moefast.data.errors import DataError
from moefast.data.hf_tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, HFTokenizer
from moefast.data.packing import PackedRows, row_index
from moefast.data.sources import Document, SourceStats
from moefast.data.tokenizer import ByteTokenizer, Tokenizer
from moefast.data.tokenizer_registry import get_tokenizer

__all__ = ["corpus_identity", 
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "PreparedCorpus",
    "PreparedRows",
    "is_prepared",
    "open_prepared",
    "prepare",
    "tokenizer_identity",
]

FORMAT = "moefast-prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
PARTIAL_PREFIX = ".partial-"
SPLITS = ("train", "val")
# Tokens per shard before a new one starts (64 MiB of uint16): the writer buffers one shard, so
# this bounds prepare's memory (a 157 M-token corpus peaked at +290 MiB over the interpreter with
# 64 M-token shards, +34 MiB with 4 M-token ones); 3,000 files per 100 B tokens.
DEFAULT_SHARD_TOKENS = 1 << 25
# Documents handed to the tokenizer at once, and batches in flight on the worker threads.
_BATCH_DOCS = 512
_BATCH_BYTES = 8 << 20
_IN_FLIGHT = 4

# Written into OUT_DIR (atomically) before anything else and removed once the manifest is written:
# the command that was run, so that training on an unfinished dataset can say how to finish it.
IN_PROGRESS = ".prepare-in-progress.json"
_DEFAULT_VAL_FRACTION = 0.02


def _prepare_args(source: str, tokenizer: str, data_format: str, val_fraction: float, text_field: str) -> dict:
    """What a prepare was asked, with paths made absolute (the source as given is kept in the manifest)."""
    def absolute(p: str) -> str:
        expanded = os.path.expanduser(p)
        return os.path.abspath(expanded) if os.path.exists(expanded) or sources._GLOB_CHARS & set(expanded) else p

    return {"source": source if source == "stdlib" else absolute(source), "tokenizer": absolute(str(tokenizer)),
            "format": data_format, "val_fraction": val_fraction, "text_field": text_field}


def prepare_command(out_dir: str | os.PathLike, args: dict) -> str:
    """The ``moefast prepare`` command line that writes ``out_dir`` again from ``args``
    (:func:`_prepare_args`'s keys), shell-quoted, with ``--force``."""
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


def is_prepared(source: str) -> bool:
    """Whether ``data.source`` names a prepared corpus: a directory holding ``manifest.json``.

    Raises:
      DataError: the directory holds an unfinished ``moefast prepare`` (its in-progress marker, or
        only the leftovers of one), naming the command to run again.
    """
    if not isinstance(source, str) or source == "stdlib":
        return False
    path = Path(os.path.expanduser(source))
    if not path.is_dir():
        return False
    if (path / MANIFEST).is_file():
        return True
    if (path / IN_PROGRESS).exists() or (_only_leftovers(path) and any(path.iterdir())):
        raise _unfinished(source, path)
    return False


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


# --------------------------------------------------------------------------------------------- #
# prepare                                                                                         #
# --------------------------------------------------------------------------------------------- #

def prepare(source: str, out_dir: str | os.PathLike, *, tokenizer: str = "byte", val_fraction: float = 0.02,
            text_field: str = "text", force: bool = False, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            progress: bool = True) -> dict:
    """Tokenizes ``source`` once into shards under ``out_dir`` (see the module docstring).

    Args:
      source: what ``data.source`` accepts (``"stdlib"``, a directory, a glob, a file,
        ``.jsonl``/``.parquet``), or a Hugging Face ``datasets`` directory (``save_to_disk``).
      out_dir: the dataset directory; created if missing.
      tokenizer: as ``data.tokenizer``: ``"byte"`` or a Hugging Face tokenizer path.
      val_fraction: fraction of documents held out for validation, in (0, 1) (dimensionless).
      text_field: field / column holding the text in records.
      force: prepare into a directory that already holds files (a previous dataset's
        ``manifest.json`` and ``shards/`` are replaced once the new shards are written, and kept if
        this prepare fails; other files are left alone).
      shard_tokens: tokens per shard before the next one starts (tokens).
      progress: show a tqdm bar with tokens/s on stderr.

    Returns:
      The manifest written to ``out_dir/manifest.json``.

    Raises:
      DataError: any error of the source or tokenizer; ``out_dir`` is not empty and ``force`` is
        not set; the validation or training split is empty; or ``out_dir`` cannot be written
        (permissions, a full disk). A failed prepare removes what it wrote, and ``out_dir`` itself
        if it created it; one that existed keeps an in-progress marker, so that training on it
        names the command to run again.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction: must be in (0, 1), got {val_fraction}")
    if int(shard_tokens) < 1:
        raise DataError(f"shard_tokens: must be >= 1, got {shard_tokens}")
    tok = get_tokenizer(tokenizer)
    identity = tokenizer_identity(tok)
    dtype = _token_dtype(tok.vocab_size)
    listed = sources.list_files(source)
    files = [_file_entry(p) for p, _ in listed[0]]
    out = Path(os.path.expanduser(os.fspath(out_dir)))
    args = _prepare_args(source, tokenizer, "text", val_fraction, text_field)
    t0 = time.perf_counter()
    with _preparing(out, force, [p for p, _ in listed[0]], args) as partial, _Progress(progress) as bar:
        def write(rule: str, held: set[str] | None = None) -> tuple[dict, SourceStats]:
            stats = SourceStats(source=source)
            docs = sources.iter_documents(source, text_field, stats, files=listed)
            return _write_splits(partial / SHARD_DIR, docs, tok, dtype, val_fraction, int(shard_tokens), bar,
                                 rule=rule, held=held), stats

        splits, stats = write("hash")
        n, rule = stats.documents, "hash"
        if not (splits["train"]["documents"] and splits["val"]["documents"]):  # split_documents' fallback
            shutil.rmtree(partial / SHARD_DIR)
            k = sources.fallback_held_out(n, val_fraction)
            if k:
                rule = "smallest_hash"
                scored = ((sources.id_fraction(d.id), d.id) for d in sources.iter_documents(source, text_field,
                                                                                            files=listed))
                splits, stats = write(rule, {doc_id for _, doc_id in heapq.nsmallest(k, scored)})
            else:
                rule = "cut"
                splits, stats = write(rule)
        for name in SPLITS:
            if not splits[name]["documents"]:
                raise DataError(f"{source!r}: the {'validation' if name == 'val' else 'training'} split is empty "
                                f"({stats.documents} documents, {stats.bytes} bytes, --val-fraction={val_fraction}): "
                                "use a larger corpus or change --val-fraction")
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tokenizer": {"name": str(tokenizer), "identity": identity, "vocab_size": tok.vocab_size,
                          "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id},
            "dtype": dtype.name,
            "val_fraction": val_fraction,
            "held_out_documents": rule != "cut",
            "split": {"rule": rule, "note": _split_note(rule, n, splits["val"]["documents"], val_fraction)},
            "splits": splits,
            "sources": {"source": source, "text_field": text_field, "documents": stats.documents,
                        "bytes": stats.bytes, "empty_documents": stats.empty_documents,
                        "non_utf8_documents": stats.non_utf8_documents,
                        "skipped_files": [list(s) for s in stats.skipped_files], "files": files},
            "prepare_args": args,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        _publish(out, partial, manifest)
    return manifest


def _split_note(rule: str, n: int, held: int, val_fraction: float, unit: str = "document") -> str:
    """One line for ``moefast prepare``'s output: which train/validation split was made, and why
    (``unit``: what is split, "document" or "conversation")."""
    def count(k: int) -> str:
        return f"{k} {unit}{'' if k == 1 else 's'}"

    if rule == "hash":
        return (f"split by hash of each {unit}'s id (blake2b < {val_fraction:g}): {held} of {count(n)} held out "
                "for validation")
    if rule == "smallest_hash":
        which = f"{unit} of smallest hash is" if held == 1 else f"{count(held)} of smallest hash are"
        return (f"the hash rule (blake2b(id) < {val_fraction:g}) held out {'every' if held == n else 'no'} {unit} "
                f"of {n}, so the {which} held out instead, whole")
    k = min(max(n - 1, 1), max(1, round(n * val_fraction)))
    return (f"{count(n)} {'are' if n != 1 else 'is'} too few to hold whole ones out at --val-fraction "
            f"{val_fraction:g} (the fewest, {k} of {n}, would be {k / n:.0%}): validation is the last "
            f"{val_fraction:.0%} of each {unit}, whose start is trained on; add {unit}s for a held-out "
            "validation set")


class _Progress:
    """The tqdm bar of a prepare: created at the first tokens and shown after half a second (an error
    before then prints no bar), cleared, not left on the screen, when the prepare fails."""

    def __init__(self, enabled: bool):
        self._enabled, self._bar = enabled, None

    def update(self, n: int) -> None:
        if not self._enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            # delay: nothing is shown for a prepare that ends (or fails) within half a second
            self._bar = tqdm(desc="prepare", unit="tok", unit_scale=True, mininterval=0.5, smoothing=0.1, delay=0.5)
        self._bar.update(n)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            if exc_type is not None:
                self._bar.leave = False  # the error is what the user needs to see
            self._bar.close()


@contextlib.contextmanager
def _writing(where: Path):
    """Turns an ``OSError`` of writing OUT_DIR (permissions, a full disk) into one DataError."""
    try:
        yield
    except OSError as e:
        raise DataError(f"{e.filename or where}: cannot write the prepared corpus ({e.strerror or e}); make OUT_DIR "
                        "writable, with room for the shards, or choose another OUT_DIR") from None


@contextlib.contextmanager
def _preparing(out: Path, force: bool, source_files: list[Path], args: dict):
    """Claims ``out`` (:func:`_claim_out_dir`), marks it in progress and yields a fresh partial directory
    inside it. On success (the body called :func:`_publish`) the marker is removed. On any failure,
    Ctrl-C included, what this prepare wrote is removed, and so is ``out`` itself (with the parents
    it made) if this prepare created it; a directory that existed keeps its marker, so that training
    on it says the prepare did not finish and how to run it again. Nothing else is ever removed."""
    created = _claim_out_dir(out, force, source_files)
    ok = False
    try:
        with _writing(out):
            _write_json_atomic(out / IN_PROGRESS, {"prepare_args": args, "started": time.time()})
            partial = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=out))
        try:
            yield partial
            ok = True
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    finally:
        if ok:
            (out / IN_PROGRESS).unlink(missing_ok=True)
        else:
            _abandon(out, created)


def _publish(out: Path, partial: Path, manifest: dict) -> None:
    """Writes the new manifest beside the old one, then replaces a previous dataset (``--force``: its
    manifest first, so that from then on it no longer looks complete, then its shards), moves the
    new shards into place and renames the new manifest in: from here on ``out`` is the new dataset.
    Only renames and removals follow the last write, so a full disk or a read-only directory fails
    before the previous dataset is touched."""
    with _writing(out):
        new_manifest = _write_json_beside(out / MANIFEST, manifest)  # what may fail (room, permissions) first
        try:
            (out / MANIFEST).unlink(missing_ok=True)
            if (out / SHARD_DIR).is_dir() and not (out / SHARD_DIR).is_symlink():
                shutil.rmtree(out / SHARD_DIR)  # _claim_out_dir checked it holds shard files only
            os.replace(partial / SHARD_DIR, out / SHARD_DIR)
            os.replace(new_manifest, out / MANIFEST)
        finally:
            new_manifest.unlink(missing_ok=True)


def _abandon(out: Path, created: list[Path]) -> None:
    """After a failed prepare: removes what it wrote (a previous dataset that is still complete is
    kept; the in-progress marker is kept in a directory that existed and holds no complete dataset,
    so that training there says the prepare did not finish), then the directories it created,
    deepest first, while they are empty."""
    keep_marker = not created and not (out / MANIFEST).is_file()  # an intact previous dataset needs none
    try:
        for e in list(out.iterdir()):
            if _ours(e) and not (keep_marker and e.name == IN_PROGRESS) and not (
                    e.name == SHARD_DIR and (out / MANIFEST).is_file()):
                shutil.rmtree(e, ignore_errors=True) if e.is_dir() and not e.is_symlink() else e.unlink(missing_ok=True)
        for d in created:
            d.rmdir()
    except OSError:  # not empty (something else was put there), or not ours to remove: left as it is
        pass


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


def _claim_out_dir(out: Path, force: bool, source_files: list[Path]) -> list[Path]:
    """Makes ``out`` ready for a prepare: created, or empty but for an interrupted prepare's leftovers
    (removed), or ``force``. A previous dataset there (its manifest and shards) is left whole until
    :func:`_publish` replaces it, so a ``--force`` prepare that fails keeps it (at the cost of disk
    room for both while the new one is written). Only what a prepare writes is ever removed: a
    source file inside ``out``, or files of other names in ``out/shards``, are refused, ``force`` or
    not.

    Returns:
      The directories this call created (``out`` and missing parents), deepest first.
    """
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory; choose another OUT_DIR")
    resolved = out.resolve()
    inside = [p for p in source_files if resolved == p.resolve() or resolved in p.resolve().parents]
    if inside:
        raise DataError(f"{out}: the source's files lie inside OUT_DIR (first: {inside[0]}); choose an OUT_DIR "
                        "outside the source")
    created = []
    missing = out
    while not missing.exists() and not missing.is_symlink() and missing != missing.parent:
        created.append(missing)
        missing = missing.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{out}: cannot create OUT_DIR ({e.strerror}); choose another OUT_DIR") from None
    shards = out / SHARD_DIR
    foreign = _foreign_in_shards(shards) if shards.exists() or shards.is_symlink() else []
    if foreign:
        raise DataError(f"{shards}: holds files a prepare did not write ({', '.join(foreign[:5])}); move them or "
                        "choose another OUT_DIR (--force only replaces a prepared corpus)")
    if not _only_leftovers(out) and not force:
        raise DataError(f"{out}: not empty (holds {', '.join(sorted(e.name for e in out.iterdir())[:5])}); "
                        "choose an empty or new OUT_DIR, or pass --force to replace a prepared corpus there")
    complete = (out / MANIFEST).is_file()
    with _writing(out):
        for e in out.iterdir():
            if _ours(e) and not (complete and e.name == SHARD_DIR):  # a complete dataset's shards stay
                shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
    return created


def _file_entry(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "bytes": st.st_size, "mtime": st.st_mtime}


def _write_json_atomic(path: Path, obj: dict) -> None:
    """Writes ``obj`` to ``path`` atomically: readers see the old file or the whole new one."""
    os.replace(_write_json_beside(path, obj), path)


def _write_json_beside(path: Path, obj: dict) -> Path:
    """Writes ``obj`` into a new hidden file beside ``path`` (``.<name>.XXXX``, synced to disk, with the
    umask's mode) and returns it, to be renamed over ``path``; nothing is left behind on failure."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would keep other users from reading the corpus
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


class _ShardWriter:
    """Appends documents of one split; writes ``<split>-NNNNN.{tokens,offsets}.npy`` every
    ``shard_tokens`` tokens (the buffer holds at most one shard)."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._chunks: list[np.ndarray] = []
        self._tokens = 0
        self.documents = 0
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        self._chunks.append(ids.astype(self.dtype, copy=False))
        self._tokens += len(ids)
        if self._tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._chunks:
            return
        with _writing(self.directory):
            self._flush()

    def _flush(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        lengths = np.fromiter((len(c) for c in self._chunks), np.int64, len(self._chunks))
        offsets = np.zeros((len(lengths) + 1,), np.int64)
        np.cumsum(lengths, out=offsets[1:])
        entry = {"tokens": f"{SHARD_DIR}/{name}.tokens.npy", "offsets": f"{SHARD_DIR}/{name}.offsets.npy",
                 "documents": len(lengths), "num_tokens": int(self._tokens)}
        tokens_path = self.directory / f"{name}.tokens.npy"
        digest = hashlib.blake2b(digest_size=16)  # of what the shard holds (corpus_identity), as it is written
        for chunk in self._chunks:
            digest.update(np.ascontiguousarray(chunk).tobytes())
        digest.update(offsets.tobytes())
        entry["content"] = "blake2b:" + digest.hexdigest()
        if self._tokens:  # chunk by chunk into the file: no second copy of the shard in memory
            tokens = np.lib.format.open_memmap(tokens_path, mode="w+", dtype=self.dtype, shape=(self._tokens,))
            for chunk, lo, hi in zip(self._chunks, offsets[:-1], offsets[1:]):
                tokens[lo:hi] = chunk
            tokens.flush()
            del tokens
        else:  # an empty file cannot be memory-mapped
            np.save(tokens_path, np.zeros((0,), self.dtype), allow_pickle=False)
        np.save(self.directory / f"{name}.offsets.npy", offsets, allow_pickle=False)
        for key in ("tokens", "offsets"):
            entry[f"{key}_bytes"] = (self.directory / f"{name}.{key}.npy").stat().st_size
        self.shards.append(entry)
        self.documents += len(lengths)
        self.tokens += int(self._tokens)
        self._chunks, self._tokens = [], 0

    def summary(self) -> dict:
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}


def _split_pieces(docs: Iterable[Document], val_fraction: float, rule: str,
                  held: set[str] | None = None) -> Iterator[tuple[str, bytes]]:
    """``(split, bytes)`` per document, as :func:`~moefast.data.sources.split_documents` assigns them:
    ``rule`` ``"hash"`` (its rule), ``"smallest_hash"`` (the ids in ``held`` to validation) or
    ``"cut"`` (every document cut in two)."""
    for d in docs:
        if rule == "hash":
            yield ("val" if sources.id_fraction(d.id) < val_fraction else "train"), d.data
            continue
        if rule == "smallest_hash":
            yield ("val" if d.id in held else "train"), d.data
            continue
        for name, piece in zip(SPLITS, sources.cut_document(d, val_fraction)):
            if piece is not None:
                yield name, piece.data


def _batches(pieces: Iterator[tuple[str, bytes]]) -> Iterator[list[tuple[str, bytes]]]:
    batch, size = [], 0
    for p in pieces:
        batch.append(p)
        size += len(p[1])
        if len(batch) >= _BATCH_DOCS or size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_splits(directory: Path, docs: Iterator[Document], tok: Tokenizer, dtype: np.dtype, val_fraction: float,
                  shard_tokens: int, bar, *, rule: str, held: set[str] | None = None) -> dict:
    with _writing(directory.parent):
        directory.mkdir()
    writers = {name: _ShardWriter(directory, name, dtype, shard_tokens) for name in SPLITS}
    pending: collections.deque = collections.deque()

    def drain_one():
        names, future = pending.popleft()
        ids = future.result()
        for name, t in zip(names, ids):
            writers[name].add(t)
        bar.update(sum(len(t) for t in ids))

    with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="moefast-prepare") as pool:
        try:
            for batch in _batches(_split_pieces(docs, val_fraction, rule, held)):
                pending.append(([n for n, _ in batch], pool.submit(tok.encode_batch, [b for _, b in batch])))
                while len(pending) >= _IN_FLIGHT:
                    drain_one()
            while pending:
                drain_one()
        finally:
            for _, future in pending:
                future.cancel()
    for w in writers.values():
        w.flush()
    return {name: w.summary() for name, w in writers.items()}


# --------------------------------------------------------------------------------------------- #
# reading                                                                                         #
# --------------------------------------------------------------------------------------------- #

class _StreamStarts:
    """Sequence view ``i -> offsets[i] + i·extra`` over memory-mapped offsets, for :mod:`bisect`:
    where document i starts in a shard's stream of ``[BOS] + tokens + [EOS]`` pieces."""

    __slots__ = ("offsets", "_extra")

    def __init__(self, offsets: np.ndarray, extra: int):
        self.offsets, self._extra = offsets, extra

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> int:
        return int(self.offsets[i]) + i * self._extra


class PreparedRows:
    """Packed rows of one split of a prepared corpus, read from its memory-mapped shards.

    Same interface and the same rows as the :class:`~moefast.data.packing.PackedRows` that
    :func:`~moefast.data.packing.pack_documents` builds from the split's documents
    (``len``, ``rows[i]`` -> dict of [T] arrays, ``seq_len``, ``pad_id``, ``num_tokens``,
    ``num_documents``, ``padding_row()``); a row is built when it is read.

    Args:
      shards: ``(tokens, offsets)`` per shard: tokens [N_k] uint16/uint32 (a :class:`ShardArray` or an
        ndarray), offsets int64 [D_k + 1] (memory-mapped), each shard with at least one document.
      seq_len: T, tokens per row.
      bos_id: id put before every document, or None.
      eos_id: id put after every document.
      pad_id: id filling the tail of the last row.
    """

    def __init__(self, shards: list[tuple[np.ndarray, np.ndarray]], seq_len: int, *, bos_id: int | None,
                 eos_id: int, pad_id: int):
        if int(seq_len) < 1:
            raise DataError(f"data.seq_len: must be >= 1, got {seq_len}")
        self.seq_len, self.pad_id = int(seq_len), int(pad_id)
        self._bos, self._eos = bos_id, int(eos_id)
        self._has_bos = bos_id is not None
        extra = 1 + self._has_bos
        # plain ndarray views of the maps: indexing a np.memmap scalar costs microseconds, a view's ~0.1
        self._shards = [(tokens, _StreamStarts(np.asarray(offsets), extra)) for tokens, offsets in shards]
        lengths = [len(tokens) + (len(offsets) - 1) * extra for tokens, offsets in shards]
        self._bases = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
        self._documents = sum(len(offsets) - 1 for _, offsets in shards)
        L = self._bases[-1]
        self._len = max(0, -(-(L - 1) // self.seq_len)) if L else 0

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        """L: length of the packed stream, BOS (if any) and EOS included (tokens)."""
        return self._bases[-1]

    @property
    def num_documents(self) -> int:
        return self._documents

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The packed stream ``[start, stop)`` and where documents start in it.

        Returns:
          ``(stream, starts)``: int32 [stop - start] ids, and int64 ascending offsets into it of
          each document's first id, preceded by 0 when ``start`` falls inside a document.
        """
        stream = np.empty((stop - start,), np.int32)
        starts = []
        pos = start
        while pos < stop:
            k = bisect.bisect_right(self._bases, pos) - 1
            hi = min(stop, self._bases[k + 1])
            base = self._bases[k]
            starts.append(self._fill(k, pos - base, hi - base, stream[pos - start: hi - start]) + (pos - start))
            pos = hi
        doc_starts = np.concatenate(starts) if starts else np.zeros((0,), np.int64)
        if not len(doc_starts) or doc_starts[0] != 0:
            doc_starts = np.concatenate([[0], doc_starts]).astype(np.int64)
        return stream, doc_starts

    def _fill(self, k: int, a: int, b: int, out: np.ndarray) -> np.ndarray:
        """Writes stream positions [a, b) of shard k into ``out``; returns the offsets (from a) of the
        document starts among them."""
        tokens, starts = self._shards[k]
        i0 = bisect.bisect_right(starts, a) - 1               # document holding position a
        i1 = bisect.bisect_right(starts, b - 1) - 1           # document holding position b - 1
        hb = int(self._has_bos)
        offsets = np.asarray(starts.offsets[i0:i1 + 2])       # their token offsets, and the next one's
        ss = offsets + np.arange(i0, i1 + 2, dtype=np.int64) * (1 + hb)   # == starts[i0:i1 + 2]
        p = np.arange(a, b, dtype=np.int64)
        d = np.searchsorted(ss, p, side="right") - 1          # document of each position (from i0)
        q = p - ss[d]                                          # offset inside its [BOS] + tokens + [EOS]
        n_tok = offsets[d + 1] - offsets[d]
        body = (q >= hb) & (q < hb + n_tok)
        out[:] = self._eos
        if hb:
            out[q == 0] = self._bos
        if body.any():
            tok_index = (offsets[d] + q - hb)[body]
            lo, hi = int(tok_index[0]), int(tok_index[-1]) + 1   # ascending: one contiguous read
            out[body] = tokens[lo:hi][tok_index - lo]
        return np.flatnonzero(q == 0)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = row_index(index, self._len)
        start = index * self.seq_len
        stream, doc_starts = self.window(start, min(start + self.seq_len + 1, self.num_tokens))
        return PackedRows(stream, doc_starts, self.seq_len, self.pad_id)[0]

    def padding_row(self) -> dict[str, np.ndarray]:
        """An all-padding row (PAD tokens/targets, segment 0, position 0, loss_weight 0)."""
        return PackedRows(np.zeros((0,), np.int32), np.zeros((0,), np.int64), self.seq_len, self.pad_id).padding_row()

    def __repr__(self) -> str:
        return (f"PreparedRows(rows={self._len}, seq_len={self.seq_len}, documents={self._documents}, "
                f"tokens={self.num_tokens}, shards={len(self._shards)})")


@dataclasses.dataclass
class PreparedCorpus:
    """What :func:`open_prepared` returns; ``pipeline.load_corpus`` wraps it in a ``Corpus``.

    Attributes:
      tokenizer: the run's tokenizer (checked against the manifest's).
      train: training rows.
      val: validation rows.
      stats: documents and bytes of the source, as read at prepare time; ``source`` is the
        prepared directory.
      held_out_documents: False when the corpus had too few documents and each was cut in two.
      manifest: the parsed ``manifest.json``.
    """

    tokenizer: Tokenizer
    train: PreparedRows
    val: PreparedRows
    stats: SourceStats
    held_out_documents: bool
    manifest: dict


def _field(manifest: dict, path: Path, *keys):
    """``manifest[keys[0]][keys[1]]...``, or a DataError naming the manifest and the missing key."""
    value = manifest
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise DataError(f"{path}: no {'.'.join(keys)!r}: not a manifest this version of moefast wrote; "
                            + _again(path.parent))
        value = value[key]
    return value


def read_manifest(directory: str | os.PathLike) -> dict:
    """The parsed ``manifest.json`` of a prepared corpus, its format and version checked.

    Raises:
      DataError: no manifest, not JSON, another format, or another format version.
    """
    path = Path(os.path.expanduser(os.fspath(directory))) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        if (path.parent / IN_PROGRESS).exists():
            raise _unfinished(str(directory), path.parent) from None
        raise DataError(f"{path}: missing; {path.parent} is not a prepared corpus (moefast prepare SOURCE "
                        f"{path.parent})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON ({e}); " + _again(path.parent)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{path}: format {got!r}, expected {FORMAT!r}: not a corpus written by moefast prepare")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DataError(f"{path}: format version {version!r}, this moefast reads version {FORMAT_VERSION}; "
                        + _again(path.parent, manifest))
    return manifest


def open_prepared(directory: str | os.PathLike, *, tokenizer: str, seq_len: int,
                  data_format: str = "text") -> PreparedCorpus:
    """Opens a prepared corpus for training: manifest and every shard checked, nothing read.

    Args:
      directory: the ``OUT_DIR`` of :func:`prepare` (``data.source``).
      tokenizer: the run's ``data.tokenizer``; must be the one the corpus was prepared with.
      seq_len: T, tokens per packed row.
      data_format: the run's ``data.format``; must be the one the corpus was prepared for (its rows
        here are pretraining rows either way: ``moefast.data.prepared_sft`` builds SFT rows).

    Returns:
      :class:`PreparedCorpus` with lazily read train and validation rows.

    Raises:
      DataError: naming the file: the manifest is missing, unreadable, of another format or
        version, or from another tokenizer; a shard is missing, truncated, of another dtype or
        shape, or its offsets disagree with the manifest; a split has no document.
    """
    root = Path(os.path.expanduser(os.fspath(directory)))
    manifest = read_manifest(root)
    mpath = root / MANIFEST
    prepared_as = manifest.get("data_format", "text")
    if prepared_as != data_format:
        if data_format == "sft":
            raise DataError(f"{mpath}: prepared as pretraining text, without loss masks, but data.format=sft trains "
                            "on the assistant's tokens only: prepare the conversations with moefast prepare "
                            f"SOURCE.jsonl {root} --format sft --tokenizer {tokenizer} --force")
        raise DataError(f"{mpath}: prepared with --format {prepared_as} (conversations with loss masks); set "
                        f"data.format={prepared_as} to train on it")
    tok = get_tokenizer(tokenizer)
    recorded = _field(manifest, mpath, "tokenizer", "identity")
    identity = tokenizer_identity(tok)
    if identity != recorded:
        name = _field(manifest, mpath, "tokenizer", "name")
        raise DataError(f"{mpath}: prepared with tokenizer {name!r} ({recorded}), but data.tokenizer={tokenizer!r} "
                        f"is {identity}: set data.tokenizer to the tokenizer it was prepared with, or prepare the "
                        f"corpus again with --tokenizer {tokenizer}")
    for key, value in (("vocab_size", tok.vocab_size), ("bos_id", tok.bos_id), ("eos_id", tok.eos_id),
                       ("pad_id", tok.pad_id)):
        if _field(manifest, mpath, "tokenizer", key) != value:
            raise DataError(f"{mpath}: tokenizer.{key} is {manifest['tokenizer'][key]}, but data.tokenizer="
                            f"{tokenizer!r} has {value}; " + _again(root, manifest))
    dtype_name = _field(manifest, mpath, "dtype")
    if dtype_name != _token_dtype(tok.vocab_size).name:
        raise DataError(f"{mpath}: dtype {dtype_name!r} does not hold vocab_size {tok.vocab_size} as prepare writes "
                        f"it ({_token_dtype(tok.vocab_size).name}); " + _again(root, manifest))
    dtype = np.dtype(dtype_name)
    specials = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    rows = {}
    for name in SPLITS:
        split = _field(manifest, mpath, "splits", name)
        shards = []
        for entry in _field(manifest, mpath, "splits", name, "shards"):
            n_docs, n_tok, tokens_file, offsets_file = (
                _field(entry, mpath, key) for key in ("documents", "num_tokens", "tokens", "offsets"))
            tokens = _open_array(root / tokens_file, dtype, (n_tok,), entry.get("tokens_bytes"), mpath, pread=True,
                                 manifest=manifest)
            offsets = _open_array(root / offsets_file, np.dtype(np.int64), (n_docs + 1,),
                                  entry.get("offsets_bytes"), mpath, manifest=manifest)
            _check_offsets(root / offsets_file, n_tok, mpath, manifest=manifest)
            if n_docs:
                shards.append((tokens, offsets))
        rows[name] = PreparedRows(shards, seq_len, **specials)
        if rows[name].num_documents != split.get("documents") or not rows[name].num_documents:
            what = "validation" if name == "val" else "training"
            raise DataError(f"{mpath}: the {what} split has {rows[name].num_documents} documents in its shards "
                            f"(manifest: {split.get('documents')}); a prepared corpus needs both splits non-empty: "
                            "prepare it with another --val-fraction or a larger corpus")
    src = _field(manifest, mpath, "sources")
    stats = SourceStats(documents=src.get("documents", 0), bytes=src.get("bytes", 0),
                        skipped_files=[tuple(s) for s in src.get("skipped_files", [])],
                        non_utf8_documents=src.get("non_utf8_documents", 0),
                        empty_documents=src.get("empty_documents", 0), source=str(directory))
    return PreparedCorpus(tokenizer=tok, train=rows["train"], val=rows["val"], stats=stats,
                          held_out_documents=bool(manifest.get("held_out_documents", True)), manifest=manifest)


class ShardArray:
    """A 1-D ``.npy`` array on disk, read slice by slice with ``os.pread``: no memory map.

    Rows are read at random places. Through a memory map every read maps whole page-cache folios
    into the process (up to 2 MB each on ext4 with large folios, Linux >= 6.16), so the resident
    memory grew with the corpus (a one-off check on 2026-12-03, kernel 6.18: 50 batches from 1 G
    tokens mapped 320 MB of shard pages, from 0.1 G tokens 112 MB; ``madvise(MADV_RANDOM)`` changed
    nothing). A ``pread`` copies only the bytes asked for. The file is opened per read, so no
    descriptor is held whatever the number of shards, and the object pickles to worker processes.

    Args:
      path: the ``.npy`` file.
      dtype: its element type.
      length: N, its number of elements.
      offset: where the data starts in the file (bytes after the ``.npy`` header).
    """

    __slots__ = ("path", "dtype", "_n", "_offset")

    def __init__(self, path: str | os.PathLike, dtype: np.dtype, length: int, offset: int):
        self.path, self.dtype, self._n, self._offset = os.fspath(path), np.dtype(dtype), int(length), int(offset)

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self) -> tuple[int]:
        return (self._n,)

    def __getitem__(self, key: int | slice):
        """``array[i]`` (a NumPy scalar) or ``array[lo:hi]`` (step 1; a new read-only ndarray [hi - lo]).

        Raises:
          TypeError: ``key`` is neither an int nor a slice of step 1.
          IndexError: an int outside ``[-N, N)``.
          DataError: the file holds fewer bytes than it did when it was opened.
        """
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self._n if key < 0 else 0)
            if not 0 <= i < self._n:
                raise IndexError(f"index {int(key)} is out of bounds for a ShardArray of {self._n} elements")
            return self[i:i + 1][0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"ShardArray supports array[i] and array[lo:hi] only, got {key!r}")
        lo, hi, _ = key.indices(self._n)
        n = max(0, hi - lo)
        size = self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, n * size, self._offset + lo * size)
        finally:
            os.close(fd)
        if len(data) != n * size:
            raise DataError(f"{self.path}: {len(data)} bytes where {n * size} were expected: the shard was truncated "
                            "after it was opened; prepare the corpus again")
        return np.frombuffer(data, self.dtype)

    def __repr__(self) -> str:
        return f"ShardArray({self.path!r}, {self.dtype}, {self._n})"


def _open_array(path: Path, dtype: np.dtype, shape: tuple[int], size: int | None, mpath: Path, *,
                pread: bool = False, manifest: dict | None = None) -> np.ndarray | ShardArray:
    """A 1-D shard array, its size, dtype and shape checked against the manifest and its own ``.npy``
    header before anything is mapped: memory-mapped read-only, or with ``pread`` a
    :class:`ShardArray` (read per slice; what the token and mask shards use).

    Raises:
      DataError: naming the file and the command that prepares the corpus again: the file is
        missing; its size differs from the manifest's record, or from what its header implies
        (truncated: both sizes given); its header is unreadable; its dtype or shape differ.
    """
    again = _again(mpath.parent, manifest)
    if not path.is_file():
        raise DataError(f"{path}: missing (listed in {mpath}); {again}")
    actual = path.stat().st_size
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            header_shape, _, header_dtype = read_header(f)
            offset = f.tell()
    except (ValueError, OSError, EOFError) as e:
        if size is not None and actual < size:
            raise DataError(f"{path}: truncated: {actual} bytes, expected {size} (recorded in {mpath}); "
                            f"{again}") from None
        raise DataError(f"{path}: not a readable .npy array ({e}): truncated or overwritten; {again}") from None
    if header_dtype != dtype:
        raise DataError(f"{path}: dtype {header_dtype}, but {mpath} says {dtype}; {again}")
    if tuple(header_shape) != tuple(shape):
        raise DataError(f"{path}: shape {tuple(header_shape)}, but {mpath} says {tuple(shape)}; {again}")
    if size is not None and actual != size:
        what = "truncated" if actual < size else "longer than prepare wrote it (appended to or overwritten)"
        raise DataError(f"{path}: {what}: {actual} bytes, expected {size} (recorded in {mpath}); {again}")
    expected = offset + int(np.prod(shape)) * dtype.itemsize
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its header says"
        raise DataError(f"{path}: {what}: {actual} bytes, expected {expected} ({shape[0]} {dtype} values after a "
                        f"{offset}-byte header); {again}")
    if pread:
        return ShardArray(path, dtype, shape[0], offset)
    if shape[0] == 0:  # an empty file cannot be memory-mapped
        return np.zeros(shape, dtype)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _check_offsets(path: Path, n_tokens: int, mpath: Path, block: int = 1 << 20, *,
                   manifest: dict | None = None) -> None:
    """Offsets start at 0, end at the shard's token count and never decrease (read in blocks with
    ``pread``, so the check maps none of the file into the process)."""
    header = np.load(path, mmap_mode="r", allow_pickle=False)
    offsets = ShardArray(path, header.dtype, len(header), header.offset)
    del header
    bad = None
    if int(offsets[0]) != 0 or int(offsets[-1]) != n_tokens:
        bad = f"they run from {int(offsets[0])} to {int(offsets[-1])}, expected 0 to {n_tokens}"
    else:
        for lo in range(0, len(offsets) - 1, block):
            if (np.diff(np.asarray(offsets[lo: lo + block + 1])) < 0).any():
                bad = f"they decrease in entries [{lo}, {lo + block}]"
                break
    if bad:
        raise DataError(f"{path}: corrupt document offsets ({bad}); " + _again(mpath.parent, manifest))
