"""Reading a prepared corpus for training: :func:`is_prepared` (is ``data.source`` one?),
:func:`read_manifest` and :func:`open_prepared`, which checks the manifest and every shard's
header, size and offsets before a row is read, and :class:`PreparedRows`, the packed rows of a
split built on the fly from the shards: the same rows as the in-memory
:func:`~moefast.data.packing.pack_documents`. Tokens are read with ``os.pread``
(:class:`ShardArray`), the offsets memory-mapped. The format and the design:
:mod:`moefast.data.prepared`.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from moefast.data.errors import DataError
from moefast.data.packing import PackedRows, row_index
from moefast.data.prepared_format import (FORMAT, FORMAT_VERSION, IN_PROGRESS, MANIFEST, SPLITS, _again,
                                          _only_leftovers, _token_dtype, _unfinished, tokenizer_identity)
from moefast.data.sources import SourceStats
from moefast.data.tokenizer import Tokenizer
from moefast.data.tokenizer_registry import get_tokenizer

__all__ = ["PreparedCorpus", "PreparedRows", "ShardArray", "is_prepared", "open_prepared", "read_manifest"]


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
