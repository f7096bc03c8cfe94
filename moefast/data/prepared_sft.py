"""Prepared SFT corpora: conversations tokenized once, with their loss masks, into memory-mapped shards.

``moefast prepare SOURCE OUT_DIR --format sft --tokenizer T`` (:func:`prepare_sft`) reads the
``.jsonl`` conversations that ``data.format: sft`` reads, renders and masks each with the
tokenizer's chat template exactly as :func:`moefast.data.sft.tokenize_conversation` does, and writes
the shards of :mod:`moefast.data.prepared` plus one mask array per shard::

    shards/train-00000.tokens.npy    uint16/uint32 [N]: the rendered conversations back to back
    shards/train-00000.offsets.npy   int64 [D + 1]: conversation d is tokens[offsets[d]:offsets[d+1]]
    shards/train-00000.mask.npy      uint8 [N]: 1 where the token is the assistant's (its loss weight
                                     as a target), 0 elsewhere

The manifest says ``"data_format": "sft"``, records each shard's ``mask`` file and its
``weighted_tokens`` (sum over conversations of ``mask[1:]``: the targets trained on), and under
``"sft"`` the number of conversations and assistant turns and the SHA-256 of the chat template (a
template changed since is refused at start, as another tokenizer is).

``data.format: sft`` with ``data.source`` set to such a directory trains from it
(:func:`open_prepared_sft`): the rows equal those of :func:`moefast.data.sft.load_sft` on the same
``.jsonl`` for every ``data.seq_len`` and ``data.sft_overlong``, each conversation whole in one row.
The packing rule (an example that does not fit in what is left of a row's window starts the next
row) makes each example's place depend on every example before it, so it cannot be found by a
binary search over the offsets as pretraining rows are: at start, one pass over the conversations'
lengths (from the offsets) places every kept example, and the reader keeps three int64 numbers per
conversation (its start in the packed stream, its length, its index), 24 bytes, not its tokens;
a row then reads the few conversations that overlap its window from the memory maps. Overlong
conversations (more than ``seq_len + 1`` tokens) are truncated (to ``seq_len`` tokens:
:func:`moefast.data.sft.truncated_length`) or dropped at start, so one prepared
corpus serves every ``seq_len``; only their masks are read to count the targets left.

One difference from the in-memory path: the train/validation split is made at prepare time over all
conversations (``blake2b(id) / 2**64 < val_fraction``), while ``load_sft`` splits after dropping
overlong ones. They agree whenever that rule holds out some but not all conversations; in the
fallback of a tiny corpus (the rule holds out none or all: the conversations of smallest hash are
held out instead), prepare chooses among all conversations, ``load_sft`` among the kept ones.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np

from moefast.data import prepared_format as fmt
from moefast.data import prepared_read as reader
from moefast.data import prepared_write as writer
from moefast.data.errors import DataError
from moefast.data.hf_tokenizer import HFTokenizer
from moefast.data.packing import PackedRows, row_index
from moefast.data.sources import SourceStats, id_fraction
from moefast.data.tokenizer_registry import get_tokenizer

__all__ = ["PreparedSFTRows", "open_prepared_sft", "prepare_sft", "template_identity"]


def template_identity(text: str) -> str:
    """``"sha256:<hex>"`` of a chat template's text."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


class _MaskedShardWriter(writer._ShardWriter):
    """:class:`moefast.data.prepared_write._ShardWriter` that also writes ``<split>-NNNNN.mask.npy``."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        super().__init__(directory, split, dtype, shard_tokens)
        self._masks: list[np.ndarray] = []
        self._weighted = 0
        self.weighted_tokens = 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        self._masks.append(mask.astype(np.uint8, copy=False))
        self._weighted += int(mask[1:].sum())
        super().add(ids)

    def flush(self) -> None:
        if not self._chunks:
            return
        masks, weighted = self._masks, self._weighted
        self._masks, self._weighted = [], 0
        super().flush()
        entry = self.shards[-1]
        name = Path(entry["tokens"]).name.removesuffix(".tokens.npy")
        path = self.directory / f"{name}.mask.npy"
        mask = np.concatenate(masks) if masks else np.zeros((0,), np.uint8)
        with writer._writing(self.directory):
            np.save(path, mask, allow_pickle=False)
        digest = hashlib.blake2b(entry["content"].encode(), digest_size=16)  # the tokens' digest, then the mask
        digest.update(mask.tobytes())
        entry.update({"mask": f"{fmt.SHARD_DIR}/{name}.mask.npy", "mask_bytes": path.stat().st_size,
                      "weighted_tokens": weighted, "content": "blake2b:" + digest.hexdigest()})
        self.weighted_tokens += weighted

    def summary(self) -> dict:
        return {**super().summary(), "weighted_tokens": self.weighted_tokens}


def prepare_sft(source: str, out_dir: str | os.PathLike, *, tokenizer: str, val_fraction: float = 0.02,
                force: bool = False, shard_tokens: int = writer.DEFAULT_SHARD_TOKENS, progress: bool = True) -> dict:
    """Tokenizes and masks the conversations of ``source`` once into shards under ``out_dir``.

    Args:
      source: a ``.jsonl`` file, glob or directory of conversations (as ``data.format: sft``).
      out_dir: the dataset directory; created if missing.
      tokenizer: a Hugging Face tokenizer directory with a chat template (``data.tokenizer``).
      val_fraction: fraction of conversations held out, in (0, 1), by hash of their id.
      force, shard_tokens, progress: as :func:`moefast.data.prepared.prepare`.

    Returns:
      The manifest written (``data_format: "sft"``; see the module docstring).

    Raises:
      DataError: any error of :func:`moefast.data.sft.read_conversations`,
        :meth:`~moefast.data.sft.ChatTemplate.from_tokenizer` or
        :func:`~moefast.data.sft.tokenize_conversation` (naming the file and line); fewer than 2
        conversations; ``out_dir`` not empty without ``force``.
    """
    from moefast.data import sft

    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction: must be in (0, 1), got {val_fraction}")
    tok = get_tokenizer(tokenizer)
    template = sft.ChatTemplate.from_tokenizer(tok)
    assert isinstance(tok, HFTokenizer)
    dtype = fmt._token_dtype(tok.vocab_size)
    listed = sft._source_files(source)
    files = [writer._file_entry(p) for p, _ in listed]
    out = Path(os.path.expanduser(os.fspath(out_dir)))
    args = writer._prepare_args(source, tokenizer, "sft", val_fraction, "text")
    t0 = time.perf_counter()
    with writer._preparing(out, force, [p for p, _ in listed], args) as partial, writer._Progress(progress) as bar:
        def write(held: set[str] | None) -> tuple[dict, dict, list[float]]:
            directory = partial / fmt.SHARD_DIR
            with writer._writing(partial):
                directory.mkdir()
            writers = {name: _MaskedShardWriter(directory, name, dtype, int(shard_tokens)) for name in fmt.SPLITS}
            counts = {"conversations": 0, "assistant_turns": 0, "bytes": 0}
            hashes = []
            for conv in sft.iter_conversations(source):
                ids, weights = sft.tokenize_conversation(tok, template, conv.messages, conv.where)
                h = id_fraction(conv.id)
                hashes.append(h)
                name = "val" if (conv.id in held if held is not None else h < val_fraction) else "train"
                writers[name].add(ids, (weights > 0).astype(np.uint8))
                counts["conversations"] += 1
                counts["assistant_turns"] += sum(m["role"] == "assistant" for m in conv.messages)
                counts["bytes"] += conv.bytes
                bar.update(len(ids))
            for w in writers.values():
                w.flush()
            return {name: w.summary() for name, w in writers.items()}, counts, hashes

        splits, counts, hashes = write(None)
        n = counts["conversations"]
        if n < 2:
            raise DataError(f"{source!r}: {n} conversation(s): SFT needs at least 2, one for training and one for "
                            "validation")
        rule = "hash"
        if not (splits["train"]["documents"] and splits["val"]["documents"]):
            # split_examples' fallback: hold out the conversations of smallest hash
            rule = "smallest_hash"
            k = min(n - 1, max(1, round(n * val_fraction)))
            ids = [c.id for c in sft.iter_conversations(source)]
            held = {ids[i] for i in sorted(range(n), key=lambda i: hashes[i])[:k]}
            shutil.rmtree(partial / fmt.SHARD_DIR)
            splits, counts, hashes = write(held)
        manifest = {
            "format": fmt.FORMAT,
            "format_version": fmt.FORMAT_VERSION,
            "data_format": "sft",
            "tokenizer": {"name": str(tokenizer), "identity": fmt.tokenizer_identity(tok), "vocab_size": tok.vocab_size,
                          "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id},
            "dtype": dtype.name,
            "val_fraction": val_fraction,
            "held_out_documents": True,
            "split": {"rule": rule, "note": writer._split_note(rule, n, splits["val"]["documents"], val_fraction,
                                                               unit="conversation")},
            "splits": splits,
            "sft": {"conversations": counts["conversations"], "assistant_turns": counts["assistant_turns"],
                    "chat_template": template_identity(template.text), "chat_template_source": template.source},
            "sources": {"source": source, "documents": counts["conversations"], "bytes": counts["bytes"],
                        "empty_documents": 0, "non_utf8_documents": 0, "skipped_files": [], "files": files},
            "prepare_args": args,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        writer._publish(out, partial, manifest)
    return manifest


class PreparedSFTRows:
    """Packed SFT rows of one split, read from memory-mapped shards (see the module docstring).

    Same interface and rows as the :class:`~moefast.data.packing.PackedRows` that
    :func:`moefast.data.sft.load_sft` builds for the split.

    Args:
      shards: ``(tokens, offsets, mask)`` per shard: tokens [N_k] uint16/uint32 and mask uint8 [N_k]
        (:class:`~moefast.data.prepared.ShardArray` or ndarray), offsets int64 [D_k + 1] (memory-mapped).
      seq_len: T, tokens per row.
      pad_id: id filling the gaps between examples and the tail of the last row.
      overlong: ``"truncate"`` or ``"drop"`` for an example of more than T + 1 tokens.
    """

    def __init__(self, shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]], seq_len: int, *, pad_id: int,
                 overlong: str):
        T = self.seq_len = int(seq_len)
        self.pad_id = int(pad_id)
        self._shards = [(t, np.asarray(o), m) for t, o, m in shards]
        self._doc_bases = [0, *np.cumsum([len(o) - 1 for _, o, _ in self._shards]).tolist()]
        lengths = (np.concatenate([np.diff(o) for _, o, _ in self._shards]) if self._shards
                   else np.zeros((0,), np.int64))
        self.truncated = self.dropped_overlong = self.dropped_no_target = 0
        self.lost_weighted = 0  # targets of the truncated and dropped examples
        from moefast.data.sft import truncated_length

        cut = truncated_length(T)  # what load_sft keeps of an overlong example
        long = np.flatnonzero(lengths - 1 > T)
        keep = np.ones(len(lengths), bool)
        for d in long.tolist():
            mask = self._slice(d, 0, int(lengths[d]), 2)
            full = int(mask[1:].sum())
            if overlong == "drop" or not mask[1:cut].any():
                keep[d] = False
                self.lost_weighted += full
                if overlong == "drop":
                    self.dropped_overlong += 1
                else:
                    self.dropped_no_target += 1
            else:
                self.truncated += 1
                self.lost_weighted += full - int(mask[1:cut].sum())
        self._docs = np.flatnonzero(keep).astype(np.int64)
        kept = lengths[self._docs]
        self._lens = np.where(kept - 1 > T, cut, kept).astype(np.int64)
        starts = np.zeros(len(self._docs), np.int64)
        cursor = 0
        for i, n in enumerate(self._lens.tolist()):  # packing._pack_examples' placement
            row = cursor // T
            if cursor + n - 1 > row * T + T:
                cursor = (row + 1) * T
            starts[i] = cursor
            cursor += n
        self._starts = starts
        self._L = cursor
        self._len = max(0, -(-(cursor - 1) // T)) if cursor else 0

    def _slice(self, d: int, lo: int, hi: int, which: int) -> np.ndarray:
        """Positions [lo, hi) of document d (global index): its tokens (which=0) or mask (2)."""
        k = bisect.bisect_right(self._doc_bases, d) - 1
        arrays = self._shards[k]
        base = int(arrays[1][d - self._doc_bases[k]])
        return arrays[which][base + lo: base + hi]

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        """L: length of the packed stream, padding between examples included (tokens)."""
        return self._L

    @property
    def num_documents(self) -> int:
        return len(self._docs)

    @property
    def tokens(self) -> int:
        """Tokens of the kept examples (after truncation)."""
        return int(self._lens.sum())

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = row_index(index, self._len)
        a = index * self.seq_len
        b = min(a + self.seq_len + 1, self._L)
        stream = np.full((b - a,), self.pad_id, np.int32)
        weights = np.zeros((b - a,), np.float32)
        i0 = max(int(np.searchsorted(self._starts, a, side="right")) - 1, 0)
        i1 = int(np.searchsorted(self._starts, b, side="left"))
        starts, ends = [], []
        for i in range(i0, i1):
            s, n = int(self._starts[i]), int(self._lens[i])
            lo, hi = max(s, a), min(s + n, b)
            if hi > lo:
                d = int(self._docs[i])
                stream[lo - a: hi - a] = self._slice(d, lo - s, hi - s, 0)
                weights[lo - a: hi - a] = self._slice(d, lo - s, hi - s, 2)
            starts.append(s - a)
            ends.append(s + n - a)
        return PackedRows(stream, np.asarray(starts, np.int64), self.seq_len, self.pad_id,
                          doc_ends=np.asarray(ends, np.int64), token_weights=weights)[0]

    def padding_row(self) -> dict[str, np.ndarray]:
        """An all-padding row (PAD tokens/targets, segment 0, position 0, loss_weight 0)."""
        return PackedRows(np.zeros((0,), np.int32), np.zeros((0,), np.int64), self.seq_len, self.pad_id).padding_row()

    def __repr__(self) -> str:
        return (f"PreparedSFTRows(rows={self._len}, seq_len={self.seq_len}, examples={len(self._docs)}, "
                f"tokens={self._L}, shards={len(self._shards)})")


def open_prepared_sft(directory: str | os.PathLike, *, tokenizer: str, seq_len: int, overlong: str):
    """Opens a corpus written by :func:`prepare_sft` for ``data.format: sft``.

    Args:
      directory: its ``OUT_DIR`` (``data.source``).
      tokenizer: ``data.tokenizer``; must be the one it was prepared with, with the same chat template.
      seq_len: T, tokens per row.
      overlong: ``data.sft_overlong``.

    Returns:
      ``(prepared_corpus, train_rows, val_rows, sft_stats)``: the checked
      :class:`~moefast.data.prepared.PreparedCorpus`, two :class:`PreparedSFTRows` and a
      :class:`~moefast.data.sft.SFTStats`.

    Raises:
      DataError: every error of :func:`~moefast.data.prepared.open_prepared`; the corpus was
        prepared without loss masks (not ``--format sft``); the chat template changed; a mask file
        is missing, truncated or of another shape; no example fits or a split has none left.
    """
    from moefast.data import sft

    root = Path(os.path.expanduser(os.fspath(directory)))
    corpus = reader.open_prepared(root, tokenizer=tokenizer, seq_len=seq_len, data_format="sft")
    manifest, mpath = corpus.manifest, root / fmt.MANIFEST
    template = sft.ChatTemplate.from_tokenizer(corpus.tokenizer)
    recorded = reader._field(manifest, mpath, "sft", "chat_template")
    if template_identity(template.text) != recorded:
        raise DataError(f"{mpath}: prepared with another chat template ({recorded}) than {template.source} "
                        f"({template_identity(template.text)}) now holds; " + fmt._again(root, manifest))
    dtype = np.dtype(manifest["dtype"])
    rows = {}
    stats = sft.SFTStats(conversations=int(reader._field(manifest, mpath, "sft", "conversations")),
                         assistant_turns=int(reader._field(manifest, mpath, "sft", "assistant_turns")))
    for name in fmt.SPLITS:
        shards = []
        weighted = 0
        for entry in reader._field(manifest, mpath, "splits", name, "shards"):
            n_docs, n_tok = entry["documents"], entry["num_tokens"]
            if not n_docs:
                continue
            mask_file = reader._field(entry, mpath, "mask")
            tokens = reader._open_array(root / entry["tokens"], dtype, (n_tok,), entry.get("tokens_bytes"), mpath,
                                        pread=True, manifest=manifest)
            offsets = reader._open_array(root / entry["offsets"], np.dtype(np.int64), (n_docs + 1,),
                                         entry.get("offsets_bytes"), mpath, manifest=manifest)
            mask = reader._open_array(root / mask_file, np.dtype(np.uint8), (n_tok,), entry.get("mask_bytes"), mpath,
                                      pread=True, manifest=manifest)
            shards.append((tokens, offsets, mask))
            weighted += int(reader._field(entry, mpath, "weighted_tokens"))
        r = rows[name] = PreparedSFTRows(shards, seq_len, pad_id=corpus.tokenizer.pad_id, overlong=overlong)
        stats.truncated += r.truncated
        stats.dropped_overlong += r.dropped_overlong
        stats.dropped_no_target += r.dropped_no_target
        stats.tokens += r.tokens
        stats.weighted_tokens += weighted - r.lost_weighted
    if not rows["train"].num_documents and not rows["val"].num_documents:
        raise DataError(f"data.source={str(directory)!r}: none of the {stats.conversations} conversations fits in "
                        f"data.seq_len={seq_len} tokens ({stats.summary()}); raise data.seq_len"
                        + (" or set data.sft_overlong=truncate" if overlong == "drop" else ""))
    for name in fmt.SPLITS:
        if not rows[name].num_documents:
            what = "validation" if name == "val" else "training"
            raise DataError(f"data.source={str(directory)!r}: no {what} conversation fits in data.seq_len={seq_len} "
                            f"tokens ({stats.summary()}); raise data.seq_len or set data.sft_overlong=truncate")
    return corpus, rows["train"], rows["val"], stats
