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
"""

from __future__ import annotations

import numpy as np

from moefast.data.errors import DataError

__all__ = ["ROW_KEYS", "PackedRows", "pack_documents"]

ROW_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_weight")


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
      (so the target is not padding), else 0 (EOS -> next document and padding get 0).
    """

    def __init__(self, stream: np.ndarray, doc_starts: np.ndarray, seq_len: int, pad_id: int):
        """Use :func:`pack_documents`; this only wraps precomputed arrays.

        Args:
          stream: int32 [L] concatenated ``[BOS] + tokens + [EOS]`` (or ``tokens + [EOS]``) of every
            document.
          doc_starts: int64 [num_documents] offset of each document's first id (its BOS when there
            is one) in ``stream`` (ascending).
          seq_len: T, tokens per row.
          pad_id: id filling the tail of the last row.
        """
        self._stream = stream
        self._doc_starts = doc_starts
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
        index = int(index)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} out of range for {self._len} packed rows")
        T = self.seq_len
        L = len(self._stream)
        start = index * T
        end = min(start + T + 1, L)
        row = np.full((T + 1,), self.pad_id, np.int32)
        row[: end - start] = self._stream[start:end]
        idx = np.arange(start, start + T + 1, dtype=np.int64)
        doc = np.searchsorted(self._doc_starts, idx, side="right").astype(np.int64) - 1
        valid = idx < L
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
                   pad_id: int) -> PackedRows:
    """Packs tokenized documents into rows of ``seq_len`` tokens (see the module docstring).

    Args:
      token_docs: one int array [N_d] per document, without BOS/EOS (may be empty: it still
        contributes ``[BOS, EOS]``, or ``[EOS]``).
      seq_len: T, tokens per row (>= 1).
      bos_id: id put before every document, or ``None`` for none (the tokenizer has no BOS).
      eos_id: id put after every document.
      pad_id: id filling the tail of the last row; may equal ``eos_id``.

    Returns:
      :class:`PackedRows` with ``ceil((L - 1) / T)`` rows, L = sum(N_d + 2), or sum(N_d + 1) without
      a BOS (0 rows for no documents).

    Raises:
      DataError: ``seq_len < 1``, ``bos_id`` equal to ``eos_id`` or ``pad_id`` (the special ids
        must be distinct, except that PAD may be EOS), or a document that is not 1-D integer.
    """
    if int(seq_len) < 1:
        raise DataError(f"data.seq_len: must be >= 1, got {seq_len}")
    if bos_id is not None and bos_id in (eos_id, pad_id):
        raise DataError(f"bos_id={bos_id}, eos_id={eos_id}, pad_id={pad_id} must be distinct (only pad_id may "
                        "equal eos_id)")
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
