"""Tokenizers: the :class:`Tokenizer` interface and the byte-level :class:`ByteTokenizer`.

A tokenizer maps bytes (or text, encoded as UTF-8) to int32 ids in ``[0, vocab_size)`` and back. It
also reports how many bytes of text each id stands for (:attr:`Tokenizer.bytes_per_token`), which
turns a per-token loss in nats into bits per byte::

    bpb = sum(loss_nats) / (ln(2) * sum(bytes_per_token[targets]))

Which tokenizer a run uses (``DataConfig.tokenizer``) is resolved by
:func:`moefast.data.tokenizer_registry.get_tokenizer`: ``"byte"``, or the path of a Hugging Face
tokenizer (:class:`~moefast.data.hf_tokenizer.HFTokenizer`). Another tokenizer plugs in by subclassing
:class:`Tokenizer` and adding a name to :data:`moefast.data.tokenizer_registry.TOKENIZERS`.
"""

from __future__ import annotations

import abc

import numpy as np

from moefast.data.errors import DataError

__all__ = ["ByteTokenizer", "Tokenizer"]


class Tokenizer(abc.ABC):
    """Maps bytes to token ids and back.

    Ids are int32 in ``[0, vocab_size)``. ``eos_id`` and ``pad_id`` are special ids and ``bos_id`` is
    one too, or ``None`` for a tokenizer without a BOS token (Qwen, GPT-NeoX/OLMoE): documents are
    then not prefixed. ``bos_id`` differs from both others; ``pad_id`` may equal ``eos_id``, which is
    safe because padding is never a target and never attended across (packing marks it by position,
    not by id). Special ids never come out of :meth:`encode`.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """V: number of ids, specials included."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """Id that fills the tail of the last packed row; never a training target."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None:
        """Id put before every document, or ``None``: the tokenizer has no BOS token."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """Id put after every document."""

    @property
    @abc.abstractmethod
    def bytes_per_token(self) -> np.ndarray:
        """int32 [V]: UTF-8 bytes of text each id stands for (0 for special ids)."""

    @abc.abstractmethod
    def encode(self, data: bytes | str) -> np.ndarray:
        """Tokenizes one document.

        Args:
          data: raw bytes, or text (encoded as UTF-8 first).

        Returns:
          int32 [N] ids, without BOS/EOS.
        """

    def encode_batch(self, datas) -> list[np.ndarray]:
        """Tokenizes many documents; equal to ``[self.encode(d) for d in datas]``.

        A subclass overrides it when it has a faster batch path (:class:`HFTokenizer` encodes on
        every core with the GIL released).

        Args:
          datas: sequence of raw bytes or text.

        Returns:
          One int32 [N_i] array of ids per document, without BOS/EOS.
        """
        return [self.encode(d) for d in datas]

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """Turns ids back into text.

        Args:
          ids: int array-like [N] of ids in ``[0, vocab_size)``.

        Returns:
          The text; special ids are skipped and bytes that are not valid UTF-8 become U+FFFD.

        Raises:
          DataError: an id is outside ``[0, vocab_size)``.
        """

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The distinct ids among ``pad_id``, ``bos_id`` and ``eos_id``, in that order (``None`` and a
        repeated id left out): ``(pad_id, bos_id, eos_id)`` for :class:`ByteTokenizer`."""
        ids = []
        for i in (self.pad_id, self.bos_id, self.eos_id):
            if i is not None and i not in ids:
                ids.append(i)
        return tuple(ids)


class ByteTokenizer(Tokenizer):
    """One id per byte: ids 0..255 are the byte values, then PAD=256, BOS=257, EOS=258 (V=259).

    Any byte string is representable, so files that are not valid UTF-8 need no special handling.
    """

    PAD = 256
    BOS = 257
    EOS = 258

    def __init__(self):
        bpt = np.zeros((259,), np.int32)
        bpt[:256] = 1
        bpt.setflags(write=False)
        self._bytes_per_token = bpt

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def bytes_per_token(self) -> np.ndarray:
        return self._bytes_per_token

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogatepass")
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"ByteTokenizer.encode expects bytes or str, got {type(data).__name__}")
        return np.frombuffer(bytes(data), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"ByteTokenizer.decode expects integer ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise DataError(f"ByteTokenizer.decode: id {int(ids[bad][0])} is outside [0, {self.vocab_size})")
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", "replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, pad=256, bos=257, eos=258)"
