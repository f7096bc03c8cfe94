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

Where things are:

- :mod:`moefast.data.prepared_format`: what the writer and the reader share: file and directory
  names, the manifest's format and version, the token dtype, the tokenizer's and the corpus's
  identities, the ``moefast prepare`` command that writes a corpus again;
- :mod:`moefast.data.prepared_write`: :func:`prepare`: the split, tokenization, the shard writer,
  and ``OUT_DIR`` claimed, published or put back;
- :mod:`moefast.data.prepared_read`: :func:`is_prepared`, :func:`open_prepared` (every check of the
  files), :class:`PreparedRows` (rows packed on the fly) and :class:`ShardArray`.

This module re-exports their public names: ``moefast.data.prepared`` is the name to import.
"""

from __future__ import annotations

from moefast.data.prepared_format import (FORMAT, FORMAT_VERSION, IN_PROGRESS, MANIFEST, PARTIAL_PREFIX, SHARD_DIR,
                                          SPLITS, corpus_identity, prepare_command, tokenizer_identity)
from moefast.data.prepared_read import (PreparedCorpus, PreparedRows, ShardArray, is_prepared, open_prepared,
                                        read_manifest)
from moefast.data.prepared_write import DEFAULT_SHARD_TOKENS, prepare

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "FORMAT",
    "FORMAT_VERSION",
    "IN_PROGRESS",
    "MANIFEST",
    "PARTIAL_PREFIX",
    "PreparedCorpus",
    "PreparedRows",
    "SHARD_DIR",
    "SPLITS",
    "ShardArray",
    "corpus_identity",
    "is_prepared",
    "open_prepared",
    "prepare",
    "prepare_command",
    "read_manifest",
    "tokenizer_identity",
]
