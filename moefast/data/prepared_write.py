"""Writing a prepared corpus: :func:`prepare` (``moefast prepare SOURCE OUT_DIR``) tokenizes a
corpus once into ``.npy`` token and offset shards and a manifest.

Here: the train/validation split of the documents (the rule of
:func:`~moefast.data.sources.split_documents`, with its fallbacks), tokenization in batches on
worker threads, :class:`_ShardWriter` (one shard buffered at a time), and the life of ``OUT_DIR``:
claimed, marked in progress, written into a partial directory, published by renames with the
manifest last, or, on any failure, put back as it was. :mod:`moefast.data.prepared_sft` builds on
these for conversations with loss masks. The format and the design: :mod:`moefast.data.prepared`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import heapq
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from moefast.data import sources
from moefast.data.errors import DataError
from moefast.data.prepared_format import (FORMAT, FORMAT_VERSION, IN_PROGRESS, MANIFEST, PARTIAL_PREFIX, SHARD_DIR,
                                          SPLITS, _foreign_in_shards, _only_leftovers, _ours, _token_dtype,
                                          tokenizer_identity)
from moefast.data.sources import Document, SourceStats
from moefast.data.tokenizer import Tokenizer
from moefast.data.tokenizer_registry import get_tokenizer

__all__ = ["DEFAULT_SHARD_TOKENS", "prepare"]

# Tokens per shard before a new one starts (64 MiB of uint16): the writer buffers one shard, so
# this bounds prepare's memory (a 157 M-token corpus peaked at +290 MiB over the interpreter with
# 64 M-token shards, +34 MiB with 4 M-token ones); 3,000 files per 100 B tokens.
DEFAULT_SHARD_TOKENS = 1 << 25
# Documents handed to the tokenizer at once, and batches in flight on the worker threads.
_BATCH_DOCS = 512
_BATCH_BYTES = 8 << 20
_IN_FLIGHT = 4


def _prepare_args(source: str, tokenizer: str, data_format: str, val_fraction: float, text_field: str) -> dict:
    """What a prepare was asked, with paths made absolute (the source as given is kept in the manifest)."""
    def absolute(p: str) -> str:
        expanded = os.path.expanduser(p)
        return os.path.abspath(expanded) if os.path.exists(expanded) or sources._GLOB_CHARS & set(expanded) else p

    return {"source": source if source == "stdlib" else absolute(source), "tokenizer": absolute(str(tokenizer)),
            "format": data_format, "val_fraction": val_fraction, "text_field": text_field}


def prepare(source: str, out_dir: str | os.PathLike, *, tokenizer: str = "byte", val_fraction: float = 0.02,
            text_field: str = "text", force: bool = False, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            progress: bool = True) -> dict:
    """Tokenizes ``source`` once into shards under ``out_dir`` (see :mod:`moefast.data.prepared`).

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
