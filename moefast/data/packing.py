"""Packing tokenized documents into fixed-length rows for next-token prediction.

Every document becomes ``[BOS] + tokens + [EOS]`` (``tokens + [EOS]`` for a tokenizer without a
BOS, ``bos_id=None``); documents are concatenated into one stream S of length L. Row r covers
``S[r*T : r*T + T + 1]`` (T = ``seq_len``): consecutive rows overlap by one token, so every position
of S after the first is a target exactly once. The last row is padded with PAD. Rows are built on
demand from S and the document start offsets; nothing per row is stored. Documents and padding are
told apart by position (the start offsets and L), never by id, so PAD may equal EOS.

Example (T=4, BOS=b, EOS=e, PAD=p, documents ``[1, 2]`` and ``[3]``)::

    stream        b 1 2 e b 3 e                 (L = 7, rows = ceil((L-1)/T) = 2)
    row 0         b 1 2 e b     tokens  b 1 2 e   targets 1 2 e b
                                segment 1 1 1 1   positions 0 1 2 3   loss_weight 1 1 1 0
    row 1         b 3 e p p     tokens  b 3 e p   targets 3 e p p
                                segment 1 1 1 0   positions 0 1 2 0   loss_weight 1 1 0 0

Without a BOS the same documents give the stream ``1 2 e 3 e`` (L = 5); a document's first token is
then never a target (the previous document's EOS is not attended across).

SFT examples (``pack_documents(..., loss_weights=...)``, built by :mod:`moefast.data.sft`) are
packed as they are, without BOS/EOS (the chat template wrote its own), each whole inside one row so
every target sees its example from the first token on: an example that does not fit in what is
left of the current row's window starts the next row, the gap filled with PAD that belongs to no
document (segment 0, loss weight 0). ``loss_weight`` is then also multiplied by the example's
weight of the target token. Example (T=4, examples ``[1, 2, 3]`` with weights ``[0, 0, 1]`` and
``[4, 5, 6]`` with ``[0, 1, 1]``)::

    stream        1 2 3 p 4 5 6                 (the second example does not fit in row 0's window)
    row 0         tokens  1 2 3 p   targets 2 3 p 4   segment 1 1 1 0   positions 0 1 2 0   loss_weight 0 1 0 0
    row 1         tokens  4 5 6 p   targets 5 6 p p   segment 1 1 1 0   positions 0 1 2 0   loss_weight 1 1 0 0
"""

from __future__ import annotations

import numpy as np

from moefast.data.errors import DataError

__all__ = ["ROW_KEYS", "PackedRows", "pack_documents", "row_index"]

ROW_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_weight")


def row_index(index: int, rows: int) -> int:
    """``index`` as a row number in ``[0, rows)`` (negative counts from the end, as for a list).

    Raises:
      IndexError: outside ``[-rows, rows)``.
    """
    index = int(index)
    if index < 0:
        index += rows
    if not 0 <= index < rows:
        raise IndexError(f"row {index} out of range for {rows} packed rows")
    return index


class PackedRows:
    """Random-access packed rows (a grain ``RandomAccessDataSource``).

    Build with :func:`pack_documents`. ``rows[i]`` is a dict of numpy arrays, each [T]:

    - ``tokens`` int32: input ids, ``row[:-1]``.
    - ``targets`` int32: next-token ids, ``row[1:]``.
    - ``segment_ids`` int32: 1, 2, 3, ... numbering the document pieces inside the row (by input
      token), 0 for padding. Attention must not cross segments.
    - ``positions`` int32: position inside the document piece; 0 at a document's first token (its
      BOS when there is one) and 0 at the start of a row that continues a document, so always < T.
    - ``loss_weight`` float32: 1 where the input token and its target belong to the same document
      (so the target is not padding), else 0 (EOS -> next document and padding get 0); times the
      target's weight in ``token_weights`` when given.
    """

    def __init__(self, stream: np.ndarray, doc_starts: np.ndarray, seq_len: int, pad_id: int, *,
                 doc_ends: np.ndarray | None = None, token_weights: np.ndarray | None = None):
        """Use :func:`pack_documents`; this only wraps precomputed arrays.

        Args:
          stream: int32 [L] concatenated ``[BOS] + tokens + [EOS]`` (or ``tokens + [EOS]``) of every
            document.
          doc_starts: int64 [num_documents] offset of each document's first id (its BOS when there
            is one) in ``stream`` (ascending).
          seq_len: T, tokens per row.
          pad_id: id filling the tail of the last row.
          doc_ends: int64 [num_documents] offset one past each document's last id, or None: each
            document runs to the next one's start (or L). Ids between a document's end and the next
            start are padding inside the stream.
          token_weights: float32 [L] loss weight of each stream id as a target, or None (all 1).
        """
        self._stream = stream
        self._doc_starts = doc_starts
        self._doc_ends = doc_ends
        self._token_weights = token_weights
        self.seq_len = int(seq_len)
        self.pad_id = int(pad_id)
        self._len = max(0, -(-(len(stream) - 1) // self.seq_len)) if len(stream) else 0

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        """L: length of the packed stream, BOS (if any) and EOS included (tokens)."""
        return len(self._stream)

    @property
    def num_documents(self) -> int:
        return len(self._doc_starts)

    @property
    def stream(self) -> np.ndarray:
        """int32 [L] read-only view of the packed stream."""
        view = self._stream.view()
        view.setflags(write=False)
        return view

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = row_index(index, self._len)
        T = self.seq_len
        L = len(self._stream)
        start = index * T
        end = min(start + T + 1, L)
        row = np.full((T + 1,), self.pad_id, np.int32)
        row[: end - start] = self._stream[start:end]
        idx = np.arange(start, start + T + 1, dtype=np.int64)
        doc = np.searchsorted(self._doc_starts, idx, side="right").astype(np.int64) - 1
        valid = idx < L
        if self._doc_ends is not None:  # padding between documents belongs to none
            valid &= (doc >= 0) & (idx < self._doc_ends[np.maximum(doc, 0)])
        doc = np.where(valid, doc, -1)
        offset = np.where(valid, idx - self._doc_starts[np.maximum(doc, 0)], 0)

        doc_in, doc_tgt = doc[:-1], doc[1:]
        off_in = offset[:-1]
        real = doc_in >= 0
        segment_ids = np.where(real, doc_in - doc_in[0] + 1, 0).astype(np.int32)
        first = doc_in == doc_in[0]
        positions = np.where(real, np.where(first, off_in - off_in[0], off_in), 0).astype(np.int32)
        targets = row[1:]
        loss_weight = ((doc_in == doc_tgt) & real).astype(np.float32)  # padding: doc_tgt == -1
        if self._token_weights is not None:
            loss_weight *= self._token_weights[np.minimum(idx[1:], L - 1)]
        return {
            "tokens": row[:-1],
            "targets": targets,
            "segment_ids": segment_ids,
            "positions": positions,
            "loss_weight": loss_weight,
        }

    def padding_row(self) -> dict[str, np.ndarray]:
        """An all-padding row (PAD tokens/targets, segment 0, position 0, loss_weight 0)."""
        T = self.seq_len
        pad = np.full((T,), self.pad_id, np.int32)
        return {
            "tokens": pad,
            "targets": pad.copy(),
            "segment_ids": np.zeros((T,), np.int32),
            "positions": np.zeros((T,), np.int32),
            "loss_weight": np.zeros((T,), np.float32),
        }

    def __repr__(self) -> str:
        return (f"PackedRows(rows={self._len}, seq_len={self.seq_len}, documents={self.num_documents}, "
                f"tokens={self.num_tokens})")


def pack_documents(token_docs: list[np.ndarray], seq_len: int, *, bos_id: int | None, eos_id: int,
                   pad_id: int, loss_weights: list[np.ndarray] | None = None) -> PackedRows:
    """Packs tokenized documents into rows of ``seq_len`` tokens (see the module docstring).

    Args:
      token_docs: one int array [N_d] per document, without BOS/EOS (may be empty: it still
        contributes ``[BOS, EOS]``, or ``[EOS]``).
      seq_len: T, tokens per row (>= 1).
      bos_id: id put before every document, or ``None`` for none (the tokenizer has no BOS).
      eos_id: id put after every document.
      pad_id: id filling the tail of the last row; may equal ``eos_id``.
      loss_weights: None (pretraining), or one float array [N_d] per document: the loss weight of
        each of its tokens as a target. The documents are then SFT examples, packed as they are
        (``bos_id`` and ``eos_id`` are not added) and each inside one row (see the module
        docstring); each must have at most ``seq_len + 1`` tokens.

    Returns:
      :class:`PackedRows` with ``ceil((L - 1) / T)`` rows, L = sum(N_d + 2), or sum(N_d + 1) without
      a BOS (0 rows for no documents); with ``loss_weights``, L = sum(N_d) plus the padding that
      keeps each example inside a row.

    Raises:
      DataError: ``seq_len < 1``, ``bos_id`` equal to ``eos_id`` or ``pad_id`` (the special ids
        must be distinct, except that PAD may be EOS), a document that is not 1-D integer; with
        ``loss_weights``: not one weight array per document of its shape, or an example of more
        than ``seq_len + 1`` tokens.
    """
    if int(seq_len) < 1:
        raise DataError(f"data.seq_len: must be >= 1, got {seq_len}")
    if bos_id is not None and bos_id in (eos_id, pad_id):
        raise DataError(f"bos_id={bos_id}, eos_id={eos_id}, pad_id={pad_id} must be distinct (only pad_id may "
                        "equal eos_id)")
    if loss_weights is not None:
        return _pack_examples(token_docs, loss_weights, int(seq_len), pad_id)
    has_bos = bos_id is not None
    lengths = np.zeros((len(token_docs),), np.int64)
    for i, t in enumerate(token_docs):
        t = np.asarray(t)
        if t.ndim != 1 or (t.size and not np.issubdtype(t.dtype, np.integer)):
            raise DataError(f"document {i}: expected a 1-D integer token array, got shape {t.shape} dtype {t.dtype}")
        lengths[i] = t.size + 1 + has_bos
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else np.zeros((0,), np.int64)
    stream = np.empty((int(lengths.sum()),), np.int32)
    for s, n, t in zip(doc_starts, lengths, token_docs):
        if has_bos:
            stream[s] = bos_id
        stream[s + has_bos: s + n - 1] = t
        stream[s + n - 1] = eos_id
    return PackedRows(stream, doc_starts, seq_len, pad_id)


def _pack_examples(token_docs: list[np.ndarray], loss_weights: list[np.ndarray], seq_len: int,
                   pad_id: int) -> PackedRows:
    """``pack_documents`` for SFT examples: each whole in one row's window ``[r*T, r*T + T]``."""
    if len(loss_weights) != len(token_docs):
        raise DataError(f"{len(loss_weights)} loss_weights for {len(token_docs)} documents; pass one weight array "
                        "per document")
    T = seq_len
    starts = np.zeros((len(token_docs),), np.int64)
    cursor = 0
    for i, (t, w) in enumerate(zip(token_docs, loss_weights)):
        t, w = np.asarray(t), np.asarray(w)
        if t.ndim != 1 or (t.size and not np.issubdtype(t.dtype, np.integer)):
            raise DataError(f"document {i}: expected a 1-D integer token array, got shape {t.shape} dtype {t.dtype}")
        if w.shape != t.shape:
            raise DataError(f"loss_weights[{i}] has shape {w.shape}, expected {t.shape} (one weight per token)")
        if t.size > T + 1:
            raise DataError(f"example {i} has {t.size} tokens, more than seq_len + 1 = {T + 1}: truncate or drop it "
                            "first (data.sft_overlong)")
        row = cursor // T
        if cursor + t.size - 1 > row * T + T:  # not inside row `row`'s window: start the next row
            cursor = (row + 1) * T
        starts[i] = cursor
        cursor += t.size
    stream = np.full((cursor,), pad_id, np.int32)
    weights = np.zeros((cursor,), np.float32)
    ends = starts + np.array([np.asarray(t).size for t in token_docs], np.int64)
    for s, e, t, w in zip(starts, ends, token_docs, loss_weights):
        stream[s:e] = t
        weights[s:e] = w
    return PackedRows(stream, starts, T, pad_id, doc_ends=ends, token_weights=weights)
