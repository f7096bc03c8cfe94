"""From a :class:`~moefast.config.DataConfig` to batches: load -> split -> tokenize -> pack -> grain.

Example::

    corpus = load_corpus(cfg.data)
    print(corpus.summary())
    ds = train_dataset(corpus, cfg.data, seed=cfg.train.seed,
                       process_index=jax.process_index(), process_count=jax.process_count())
    it = iter(ds)
    batch = next(it)                 # dict of np arrays [B / process_count, T]
    state = it.get_state()           # JSON-serialisable; save with orbax JsonSave
    it = iter(ds); it.set_state(state)   # resumes with the same batches
    val = eval_batches(corpus, cfg.data, cfg.train.eval_batches)
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import grain
import numpy as np

from moefast.data.errors import DataError
from moefast.data.packing import ROW_KEYS, PackedRows, pack_documents
from moefast.data.prepared import PreparedRows, corpus_identity, is_prepared, open_prepared
from moefast.data.sources import SourceStats, load_documents, split_documents
from moefast.data.tokenizer import Tokenizer
from moefast.data.tokenizer_registry import get_tokenizer

if TYPE_CHECKING:
    from moefast.config import DataConfig
    from moefast.data.prepared_sft import PreparedSFTRows
    from moefast.data.sft import SFTStats

__all__ = ["Corpus", "eval_batches", "load_corpus", "train_dataset"]

# Batches are cheap to build (a slice and a searchsorted per row): a couple of threads and a short
# prefetch keep the accelerator fed without competing with the training step for host cores.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


@dataclasses.dataclass
class Corpus:
    """A tokenized, split and packed corpus.

    Attributes:
      tokenizer: the tokenizer used (its ``vocab_size`` sizes the model's embedding).
      train: training rows (built in memory, or read from a prepared corpus's shards).
      val: validation rows.
      stats: what was read from the source.
      held_out_documents: validation documents are distinct from training documents; False when
        the corpus had too few documents and each was cut in two (see :func:`split_documents`).
      sft: with ``data.format: sft``, what was made of the conversations (truncated, dropped).
      prepared_val_fraction: for a corpus written by ``moefast prepare``, the validation fraction
        it was split with (``data.val_fraction`` is then not used); None otherwise.
      prepared_identity: for a corpus written by ``moefast prepare``, the hash of its manifest
        (:func:`moefast.data.prepared.corpus_identity`), which a run records with its checkpoints so
        that a resume on a re-prepared corpus is refused; None otherwise.
    """

    tokenizer: Tokenizer
    train: PackedRows | PreparedRows | PreparedSFTRows
    val: PackedRows | PreparedRows | PreparedSFTRows
    stats: SourceStats
    held_out_documents: bool = True
    sft: SFTStats | None = None
    prepared_val_fraction: float | None = None
    prepared_identity: str | None = None

    def warnings(self, cfg: DataConfig) -> list[str]:
        """What makes this corpus's validation figures weaker than they look, and settings it does not
        use (the run logs each)."""
        out = []
        fraction = cfg.val_fraction if self.prepared_val_fraction is None else self.prepared_val_fraction
        if self.prepared_val_fraction is not None and cfg.val_fraction != self.prepared_val_fraction:
            out.append(f"data.val_fraction={cfg.val_fraction} is not used: data.source={self.stats.source!r} was "
                       f"split with --val-fraction {self.prepared_val_fraction} when it was prepared")
        if not self.held_out_documents:
            out.append(f"data.source={self.stats.source!r} has {_plural(self.stats.documents, 'document')}, too few "
                       f"to hold whole documents out: validation is the last {fraction:.0%} of each document, whose "
                       "start is trained on, so the validation loss is not measured on unseen documents; add "
                       "documents for a held-out validation set")
        return out

    def summary(self) -> str:
        """One line for the console: documents, bytes, rows, tokens, skipped files."""
        s = self.stats
        skipped = f", {len(s.skipped_files)} unreadable files skipped" if s.skipped_files else ""
        non_utf8 = f", {s.non_utf8_documents} non-UTF-8" if s.non_utf8_documents else ""
        return (f"data {s.source!r}: {_plural(s.documents, 'document')} ({s.bytes / 1e6:.2f} MB{non_utf8}); "
                f"train {len(self.train)} rows / {self.train.num_tokens} tokens, "
                f"val {len(self.val)} rows / {self.val.num_tokens} tokens, seq_len {self.train.seq_len}{skipped}"
                + (f"; {self.sft.summary()}" if self.sft is not None else ""))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def load_corpus(cfg: DataConfig) -> Corpus:
    """Loads, splits, tokenizes and packs the corpus named by ``cfg``.

    Args:
      cfg: ``source``, ``text_field``, ``tokenizer``, ``seq_len``, ``batch_size`` and
        ``val_fraction`` are used.

    With ``format: sft``, ``source`` holds conversations and ``sft_overlong`` is used too
    (:func:`moefast.data.sft.load_sft`).

    A ``source`` that is a prepared corpus (a directory holding ``manifest.json``, written by
    ``moefast prepare``) is opened, not read: its rows come from the memory-mapped shards
    (:func:`moefast.data.prepared.open_prepared`); ``text_field`` and ``val_fraction`` were fixed
    when it was prepared.

    Raises:
      DataError: any error of :func:`load_documents`, :func:`get_tokenizer` or
        :func:`~moefast.data.prepared.open_prepared`; the validation split yields no row; or the
        training split yields fewer rows than ``cfg.batch_size``.
    """
    if cfg.format == "sft":
        return _load_sft(cfg)
    if is_prepared(cfg.source):
        return _load_prepared(cfg)
    tokenizer = get_tokenizer(cfg.tokenizer)
    docs, stats = load_documents(cfg.source, cfg.text_field)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    specials = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    train = pack_documents([tokenizer.encode(d.data) for d in train_docs], cfg.seq_len, **specials)
    val = pack_documents([tokenizer.encode(d.data) for d in val_docs], cfg.seq_len, **specials)
    size = (f"data.source={cfg.source!r} has {_plural(stats.documents, 'document')} ({stats.bytes} bytes): "
            f"{len(train_docs)} train documents -> {len(train)} rows, {len(val_docs)} validation documents -> "
            f"{len(val)} rows of data.seq_len={cfg.seq_len}")
    if len(val) == 0:
        raise DataError(f"{size}; the validation split is empty: use a larger corpus or raise data.val_fraction "
                        f"(now {cfg.val_fraction})")
    if len(train) < cfg.batch_size:
        raise DataError(f"{size}; training needs at least data.batch_size={cfg.batch_size} rows: use a larger "
                        f"corpus, or lower data.batch_size or data.seq_len")
    # split_documents cuts every document in two when whole ones cannot be held out
    held_out = {d.id for d in train_docs}.isdisjoint(d.id.removesuffix("#val") for d in val_docs)
    return Corpus(tokenizer=tokenizer, train=train, val=val, stats=stats, held_out_documents=held_out)


def _load_sft(cfg: DataConfig) -> Corpus:
    """``data.format: sft``: conversations, the loss on the assistant's tokens (:mod:`moefast.data.sft`)."""
    from moefast.data.sft import load_sft  # jinja2 is imported by SFT runs only

    prepared_val_fraction = prepared_identity = None
    if is_prepared(cfg.source):  # moefast prepare --format sft: the masks come from the shards
        from moefast.data.prepared_sft import open_prepared_sft

        p, train, val, sft = open_prepared_sft(cfg.source, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len,
                                               overlong=cfg.sft_overlong)
        tokenizer, stats, prepared_val_fraction = p.tokenizer, p.stats, p.manifest.get("val_fraction")
        prepared_identity = corpus_identity(p.manifest)
    else:
        tokenizer = get_tokenizer(cfg.tokenizer)
        train, val, stats, sft = load_sft(cfg.source, tokenizer, seq_len=cfg.seq_len, overlong=cfg.sft_overlong,
                                          val_fraction=cfg.val_fraction)
    if len(train) < cfg.batch_size:
        raise DataError(f"data.source={cfg.source!r}: {train.num_documents} training conversations -> {len(train)} "
                        f"rows of data.seq_len={cfg.seq_len} ({sft.summary()}); training needs at least "
                        f"data.batch_size={cfg.batch_size} rows: add conversations or lower data.batch_size")
    return Corpus(tokenizer=tokenizer, train=train, val=val, stats=stats, sft=sft,
                  prepared_val_fraction=prepared_val_fraction, prepared_identity=prepared_identity)


def _load_prepared(cfg: DataConfig) -> Corpus:
    p = open_prepared(cfg.source, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len)
    size = (f"data.source={cfg.source!r} (prepared) has {p.train.num_documents} train documents -> {len(p.train)} "
            f"rows, {p.val.num_documents} validation documents -> {len(p.val)} rows of data.seq_len={cfg.seq_len}")
    if len(p.train) < cfg.batch_size:
        raise DataError(f"{size}; training needs at least data.batch_size={cfg.batch_size} rows: prepare a larger "
                        f"corpus, or lower data.batch_size or data.seq_len")
    return Corpus(tokenizer=p.tokenizer, train=p.train, val=p.val, stats=p.stats,
                  held_out_documents=p.held_out_documents, prepared_val_fraction=p.manifest.get("val_fraction"),
                  prepared_identity=corpus_identity(p.manifest))


def _check_processes(cfg: DataConfig, process_index: int, process_count: int) -> int:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must be in [0, process_count={process_count})")
    if cfg.batch_size % process_count:
        raise DataError(f"data.batch_size={cfg.batch_size} is not divisible by the {process_count} processes; "
                        f"set data.batch_size to a multiple of {process_count}")
    return cfg.batch_size // process_count


def train_dataset(corpus: Corpus, cfg: DataConfig, *, seed: int, process_index: int = 0,
                  process_count: int = 1) -> grain.IterDataset:
    """An infinite, shuffled, per-process stream of training batches.

    The global batch sequence does not depend on the number of processes: the training row indices
    are shuffled with ``seed`` (grain's index shuffle), batched into global batches of
    ``batch_size`` indices (``drop_remainder``) and repeated forever (grain folds the epoch number
    into the shuffle seed, so every epoch has a different order); process p then reads only the rows
    of the contiguous indices ``[p·B/P, (p+1)·B/P)`` of each global batch, the slice its devices
    hold in the global array: no process builds the global batch. So 2 processes × 4 devices see
    exactly the batches of 1 process × 8 devices.

    Args:
      corpus: from :func:`load_corpus`.
      cfg: ``batch_size`` (global, in rows) is used.
      seed: shuffle seed, in [0, 2**32).
      process_index: this process (``jax.process_index()``).
      process_count: number of processes (``jax.process_count()``).

    Returns:
      A grain ``IterDataset``; ``iter(ds)`` yields dicts of numpy arrays, each
      [B / process_count, T], keys as :class:`PackedRows`. Its iterator's ``get_state()`` is a
      JSON-serialisable dict; ``set_state`` on a fresh iterator resumes with the same batches.

    Raises:
      DataError: ``batch_size`` is not divisible by ``process_count``, a bad process index or
        seed, or fewer training rows than one global batch.
    """
    local_batch = _check_processes(cfg, process_index, process_count)
    if not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**32:
        raise DataError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    rows = len(corpus.train)
    if rows < cfg.batch_size:
        raise DataError(f"{rows} training rows are fewer than one global batch (data.batch_size="
                        f"{cfg.batch_size}, per-process batch {local_batch}); use a larger corpus or lower "
                        "data.batch_size")
    rows_source = corpus.train
    lo, hi = process_index * local_batch, (process_index + 1) * local_batch

    def read_rows(index_b: np.ndarray) -> dict[str, np.ndarray]:
        rows = [rows_source[int(i)] for i in index_b[lo:hi]]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    ds = grain.MapDataset.range(rows).shuffle(seed=int(seed)).batch(cfg.batch_size, drop_remainder=True)
    return ds.repeat(None).map(read_rows).to_iter_dataset(read_options=_READ_OPTIONS)


def eval_batches(corpus: Corpus, cfg: DataConfig, num_batches: int, *, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """The first validation batches, in fixed order (no shuffle).

    Global batch k holds validation rows ``k*B .. k*B + B - 1``; process p gets the contiguous
    ``B / process_count`` rows starting at ``k*B + p*B/process_count``. When there are fewer than
    ``num_batches * B`` rows, only ``ceil(rows / B)`` batches are returned (at least 1), the last
    one filled up with all-padding rows (``loss_weight`` 0). Every process gets the same number of
    batches.

    Args:
      corpus: from :func:`load_corpus`.
      cfg: ``batch_size`` (global, in rows) is used.
      num_batches: wanted number of batches (>= 1).
      process_index: this process.
      process_count: number of processes.

    Returns:
      A non-empty list of dicts of numpy arrays, each [B / process_count, T].

    Raises:
      DataError: ``num_batches < 1``, ``batch_size`` not divisible by ``process_count``, a bad
        process index, or no validation rows.
    """
    local_batch = _check_processes(cfg, process_index, process_count)
    if num_batches < 1:
        raise DataError(f"eval batches: must be >= 1, got {num_batches}")
    rows = corpus.val
    if len(rows) == 0:
        raise DataError("the validation split has no rows; use a larger corpus or raise data.val_fraction")
    B = cfg.batch_size
    n = min(num_batches, math.ceil(len(rows) / B))
    pad = rows.padding_row()
    out = []
    for k in range(n):
        first = k * B + process_index * local_batch
        items = [rows[i] if i < len(rows) else pad for i in range(first, first + local_batch)]
        out.append({key: np.stack([it[key] for it in items]) for key in ROW_KEYS})
    return out
