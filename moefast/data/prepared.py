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
val_fraction``, and its cut-every-document fallback when one side would be empty), so a prepared
corpus and the in-memory pipeline split, tokenize and pack the same documents into the same rows;
with the same seed ``train_dataset`` yields the same batches from both.

An interrupted prepare never leaves a dataset that looks complete: shards are written into
``OUT_DIR/.partial-*``, moved to ``OUT_DIR/shards`` in one rename, and ``manifest.json`` is
written (atomically) last; a re-run removes the leftovers of an interrupted one and starts again.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
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

__all__ = [
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

_PREPARE_HELP = "prepare it again: moefast prepare SOURCE {dir} --force"


def is_prepared(source: str) -> bool:
    """Whether ``data.source`` names a prepared corpus: a directory holding ``manifest.json``.

    Raises:
      DataError: the directory holds only the leftovers of an interrupted ``moefast prepare``.
    """
    if not isinstance(source, str) or source == "stdlib":
        return False
    path = Path(os.path.expanduser(source))
    if not path.is_dir():
        return False
    if (path / MANIFEST).is_file():
        return True
    if _only_leftovers(path) and any(path.iterdir()):
        raise DataError(f"data.source={source!r}: {path} holds an interrupted `moefast prepare` (no {MANIFEST}); "
                        f"run the prepare again into it")
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
        ``manifest.json`` and ``shards/`` are removed first; other files are left alone).
      shard_tokens: tokens per shard before the next one starts (tokens).
      progress: show a tqdm bar with tokens/s on stderr.

    Returns:
      The manifest written to ``out_dir/manifest.json``.

    Raises:
      DataError: any error of the source or tokenizer; ``out_dir`` is not empty and ``force`` is
        not set; or the validation or training split is empty.
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
    _claim_out_dir(out, force, [p for p, _ in listed[0]])

    partial = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=out))
    t0 = time.perf_counter()
    bar = _progress_bar(progress)
    def write(cut: bool) -> tuple[dict, SourceStats]:
        stats = SourceStats(source=source)
        docs = sources.iter_documents(source, text_field, stats, files=listed)
        return _write_splits(partial / SHARD_DIR, docs, tok, dtype, val_fraction, int(shard_tokens), bar,
                             cut=cut), stats

    try:
        splits, stats = write(cut=False)
        held_out = bool(splits["train"]["documents"] and splits["val"]["documents"])
        if not held_out:  # split_documents' fallback: too few documents to hold whole ones out; cut each
            shutil.rmtree(partial / SHARD_DIR)
            splits, stats = write(cut=True)
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
            "held_out_documents": held_out,
            "splits": splits,
            "sources": {"source": source, "text_field": text_field, "documents": stats.documents,
                        "bytes": stats.bytes, "empty_documents": stats.empty_documents,
                        "non_utf8_documents": stats.non_utf8_documents,
                        "skipped_files": [list(s) for s in stats.skipped_files], "files": files},
            "seconds": round(time.perf_counter() - t0, 3),
        }
        os.replace(partial / SHARD_DIR, out / SHARD_DIR)
        _write_json_atomic(out / MANIFEST, manifest)
    finally:
        bar.close()
        shutil.rmtree(partial, ignore_errors=True)
    return manifest


def _progress_bar(enabled: bool):
    from tqdm import tqdm

    return tqdm(desc="prepare", unit="tok", unit_scale=True, disable=not enabled, mininterval=0.5, smoothing=0.1)


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
    if e.name.startswith(PARTIAL_PREFIX) or e.name.startswith(f".{MANIFEST}."):
        return True
    return e.name == SHARD_DIR and not _foreign_in_shards(e)


def _only_leftovers(path: Path) -> bool:
    """Whether every entry of ``path`` is what an interrupted prepare leaves (``.partial-*``, a
    ``shards`` directory holding only shard files)."""
    return all(_ours(e) for e in path.iterdir())


def _claim_out_dir(out: Path, force: bool, source_files: list[Path]) -> None:
    """Makes ``out`` ready for a prepare: created, or empty but for an interrupted prepare's leftovers
    (removed), or ``force`` (a previous dataset's manifest and shard files removed, the manifest
    first). Only what a prepare writes is ever removed: a source file inside ``out``, or files of
    other names in ``out/shards``, are refused, ``force`` or not."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory; choose another OUT_DIR")
    resolved = out.resolve()
    inside = [p for p in source_files if resolved == p.resolve() or resolved in p.resolve().parents]
    if inside:
        raise DataError(f"{out}: the source's files lie inside OUT_DIR (first: {inside[0]}); choose an OUT_DIR "
                        "outside the source")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{out}: cannot create OUT_DIR ({e.strerror}); choose another OUT_DIR") from None
    shards = out / SHARD_DIR
    foreign = _foreign_in_shards(shards) if shards.exists() or shards.is_symlink() else []
    if foreign:
        raise DataError(f"{shards}: holds files a prepare did not write ({', '.join(foreign[:5])}); move them or "
                        "choose another OUT_DIR (--force only replaces a prepared corpus)")
    if not _only_leftovers(out):
        if not force:
            raise DataError(f"{out}: not empty (holds {', '.join(sorted(e.name for e in out.iterdir())[:5])}); "
                            "choose an empty or new OUT_DIR, or pass --force to replace a prepared corpus there")
        (out / MANIFEST).unlink(missing_ok=True)  # first: from here on it no longer looks complete
    for e in out.iterdir():
        if _ours(e):
            shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()


def _file_entry(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "bytes": st.st_size, "mtime": st.st_mtime}


def _write_json_atomic(path: Path, obj: dict) -> None:
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
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        name = f"{self.split}-{len(self.shards):05d}"
        lengths = np.fromiter((len(c) for c in self._chunks), np.int64, len(self._chunks))
        offsets = np.zeros((len(lengths) + 1,), np.int64)
        np.cumsum(lengths, out=offsets[1:])
        entry = {"tokens": f"{SHARD_DIR}/{name}.tokens.npy", "offsets": f"{SHARD_DIR}/{name}.offsets.npy",
                 "documents": len(lengths), "num_tokens": int(self._tokens)}
        tokens_path = self.directory / f"{name}.tokens.npy"
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


def _split_pieces(docs: Iterable[Document], val_fraction: float, cut: bool) -> Iterator[tuple[str, bytes]]:
    """``(split, bytes)`` per document, as :func:`~moefast.data.sources.split_documents` assigns them."""
    for d in docs:
        if not cut:
            yield ("val" if sources.id_fraction(d.id) < val_fraction else "train"), d.data
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
                  shard_tokens: int, bar, *, cut: bool) -> dict:
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
            for batch in _batches(_split_pieces(docs, val_fraction, cut)):
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
                            + _PREPARE_HELP.format(dir=path.parent))
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
        raise DataError(f"{path}: missing; {path.parent} is not a prepared corpus (moefast prepare SOURCE "
                        f"{path.parent})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON ({e}); " + _PREPARE_HELP.format(dir=path.parent)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{path}: format {got!r}, expected {FORMAT!r}: not a corpus written by moefast prepare")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DataError(f"{path}: format version {version!r}, this moefast reads version {FORMAT_VERSION}; "
                        + _PREPARE_HELP.format(dir=path.parent))
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
                            f"{tokenizer!r} has {value}; " + _PREPARE_HELP.format(dir=root))
    dtype_name = _field(manifest, mpath, "dtype")
    if dtype_name != _token_dtype(tok.vocab_size).name:
        raise DataError(f"{mpath}: dtype {dtype_name!r} does not hold vocab_size {tok.vocab_size} as prepare writes "
                        f"it ({_token_dtype(tok.vocab_size).name}); " + _PREPARE_HELP.format(dir=root))
    dtype = np.dtype(dtype_name)
    specials = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    rows = {}
    for name in SPLITS:
        split = _field(manifest, mpath, "splits", name)
        shards = []
        for entry in _field(manifest, mpath, "splits", name, "shards"):
            n_docs, n_tok, tokens_file, offsets_file = (
                _field(entry, mpath, key) for key in ("documents", "num_tokens", "tokens", "offsets"))
            tokens = _open_array(root / tokens_file, dtype, (n_tok,), entry.get("tokens_bytes"), mpath, pread=True)
            offsets = _open_array(root / offsets_file, np.dtype(np.int64), (n_docs + 1,),
                                  entry.get("offsets_bytes"), mpath)
            _check_offsets(root / offsets_file, n_tok, mpath)
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


def _open_array(path: Path, dtype: np.dtype, shape: tuple[int, ...], size: int | None, mpath: Path, *,
                pread: bool = False) -> np.ndarray | ShardArray:
    """A shard array, its dtype, shape and file size checked: memory-mapped read-only, or with
    ``pread`` a :class:`ShardArray` (read per slice; what the token and mask shards use)."""
    if not path.is_file():
        raise DataError(f"{path}: missing (listed in {mpath}); " + _PREPARE_HELP.format(dir=mpath.parent))
    actual_size = path.stat().st_size
    try:
        if shape[0] == 0:  # an empty file cannot be memory-mapped
            arr = np.load(path, allow_pickle=False)
        else:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e}): truncated or overwritten; "
                        + _PREPARE_HELP.format(dir=mpath.parent)) from None
    if arr.dtype != dtype:
        raise DataError(f"{path}: dtype {arr.dtype}, but {mpath} says {dtype}; "
                        + _PREPARE_HELP.format(dir=mpath.parent))
    if arr.shape != shape:
        raise DataError(f"{path}: shape {arr.shape}, but {mpath} says {shape}; "
                        + _PREPARE_HELP.format(dir=mpath.parent))
    if size is not None and actual_size != size:
        raise DataError(f"{path}: {actual_size} bytes, but {mpath} says {size} (truncated or appended to); "
                        + _PREPARE_HELP.format(dir=mpath.parent))
    if pread and isinstance(arr, np.memmap):
        return ShardArray(path, dtype, shape[0], arr.offset)
    return arr


def _check_offsets(path: Path, n_tokens: int, mpath: Path, block: int = 1 << 20) -> None:
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
        raise DataError(f"{path}: corrupt document offsets ({bad}); " + _PREPARE_HELP.format(dir=mpath.parent))
