"""A Hugging Face ``tokenizers`` tokenizer behind the :class:`~moefast.data.tokenizer.Tokenizer`
interface.

``HFTokenizer(path)`` reads ``tokenizer.json`` (with :meth:`tokenizers.Tokenizer.from_file`) and the
special tokens from the files a Hugging Face model directory holds next to it. Which token is BOS,
EOS and PAD follows the tokenizer's post-processor and configs, in this order:

- BOS: the special token the post-processor prepends on ``encode(..., add_special_tokens=True)``
  (Llama/Mixtral ``<s>``), else ``bos_token`` of ``tokenizer_config.json`` if it sets
  ``add_bos_token: true``, else none (Qwen, GPT-NeoX/OLMoE): ``bos_id`` is then ``None`` and
  documents are not prefixed. A ``bos_token`` alone is not a BOS: GPT-2- and OLMoE-style configs
  name one that nothing adds, and ``transformers`` 5 encodes such a tokenizer without it (checked
  in ``tests/data/test_hf_tokenizer.py``); it is kept in :attr:`HFTokenizer.unused_bos_token` so
  that ``moefast prepare`` can say so. An ``add_bos_token: false`` does not remove a
  post-processor's BOS (``transformers`` 5 keeps it too).
- EOS: the special token the post-processor appends, else ``eos_token`` of ``tokenizer_config.json``
  (then ``special_tokens_map.json``), else ``eos_token_id`` of ``config.json`` (then
  ``generation_config.json``; a list means its first id).
- PAD: ``pad_token`` of ``tokenizer_config.json`` / ``special_tokens_map.json``, else ``pad_token_id``
  of ``config.json`` / ``generation_config.json``, else the EOS id. Reusing EOS is safe: padding is
  never a training target and never attended across (packing marks it by position).

Example::

    tok = HFTokenizer("/models/Mixtral-8x7B-v0.1")     # or ".../tokenizer.json"
    tok.encode("Hello")                                 # int32 [N], no BOS/EOS
    tok.bos_id, tok.eos_id, tok.pad_id                  # 1, 2, 2
"""

from __future__ import annotations

import functools
import json
import os
import re

import numpy as np
import tokenizers

from moefast.data.errors import DataError
from moefast.data.tokenizer import Tokenizer

__all__ = ["HFTokenizer"]

TOKENIZER_FILE = "tokenizer.json"
# Files read for special tokens, next to tokenizer.json; each is optional.
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` (Radford et al. 2019, ``encoder.py``): the char a
    byte-level BPE vocabulary writes for each of the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _read_json(path: str) -> dict:
    """A JSON object from ``path``; ``{}`` when the file does not exist.

    Raises:
      DataError: the file is not valid JSON or not a JSON object.
    """
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token_content(value) -> str | None:
    """A special-token entry of ``tokenizer_config.json``: a string, ``{"content": ...}`` or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_id(value) -> int | None:
    """A ``*_token_id`` entry of ``config.json``: an int, a list of ints (the first) or null."""
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _flat_decoders(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder.get("decoders", []) for d in _flat_decoders(sub)]
    return [decoder]


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` tokenizer (BPE, Unigram, WordPiece, ...).

    :meth:`encode` never adds special tokens and treats special tokens' text in the input as plain
    text (``encode_special_tokens``), so BOS/EOS/PAD only enter the stream where packing puts them;
    padding and truncation set in ``tokenizer.json`` are turned off. :meth:`encode_chat` is the
    exception, for the text a chat template renders (SFT, :mod:`moefast.data.sft`): there special
    tokens' text is read as those tokens. A BOS, EOS or PAD that is a
    plain vocabulary token rather than a special added token is still treated as special (0 bytes,
    skipped by :meth:`decode`).

    Args:
      path: a directory holding ``tokenizer.json`` (and optionally ``tokenizer_config.json``,
        ``special_tokens_map.json``, ``config.json``, ``generation_config.json``), or the path of a
        ``tokenizer.json`` file, whose directory is then searched for those optional files.

    Attributes:
      unused_bos_token: the ``bos_token`` a config names when neither the post-processor nor
        ``add_bos_token: true`` adds it (``bos_id`` is then None) and it is not the EOS, else None.

    Raises:
      DataError: no ``tokenizer.json`` at ``path`` or it cannot be loaded; a config file is not a
        JSON object; a special token named by a config is not in the vocabulary or an id is outside
        ``[0, vocab_size)``; no EOS token anywhere (the message names the files looked at); or BOS
        equals EOS.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if os.path.isdir(path):
            directory, file = path, os.path.join(path, TOKENIZER_FILE)
        else:
            directory, file = os.path.dirname(path), path
        if not os.path.isfile(file):
            raise DataError(f"data.tokenizer: no {TOKENIZER_FILE} at {file}; pass a Hugging Face tokenizer directory "
                            f"holding {TOKENIZER_FILE}, or the path of a {TOKENIZER_FILE} file")
        try:
            tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise DataError(f"{file}: not a Hugging Face tokenizer file ({e})") from None
        tok.no_padding()
        tok.no_truncation()
        tok.encode_special_tokens = True
        self._tok = tok
        self.path = file
        self._files = {name: os.path.join(directory, name)
                       for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, MODEL_CONFIG, GENERATION_CONFIG)}
        tok_cfg = {**_read_json(self._files[SPECIAL_TOKENS_MAP]), **_read_json(self._files[TOKENIZER_CONFIG])}
        id_cfgs = [(name, _read_json(self._files[name])) for name in (MODEL_CONFIG, GENERATION_CONFIG)]

        vocab = tok.get_vocab(with_added_tokens=True)
        # == get_vocab_size(with_added_tokens=True) unless the ids have holes; then every id still fits.
        self._vocab_size = max(tok.get_vocab_size(with_added_tokens=True), 1 + max(vocab.values(), default=-1))
        self._added = tok.get_added_tokens_decoder()  # id -> AddedToken
        prefix, suffix = self._post_processor_specials()

        bos = prefix[0] if prefix else None
        if bos is None and tok_cfg.get("add_bos_token") is True:
            bos = self._token_id(tok_cfg, "bos_token")
            if bos is None:
                raise DataError(f"{self._files[TOKENIZER_CONFIG]}: add_bos_token is true but no bos_token is set")
        eos = suffix[-1] if suffix else self._token_id(tok_cfg, "eos_token")
        if eos is None:
            eos = self._config_id(id_cfgs, "eos_token_id")
        if eos is None:
            looked = [f"{file} (post-processor)", *self._files.values()]
            raise DataError("data.tokenizer: no EOS token found; looked at " + ", ".join(looked) + ": set eos_token in "
                            f"{TOKENIZER_CONFIG} (or eos_token_id in {MODEL_CONFIG})")
        # A bos_token that nothing adds (OLMoE-style): named by the config, never put before a document.
        # One equal to EOS (GPT-2's <|endoftext|>) could not be a BOS anyway.
        named_bos = self._token_id(tok_cfg, "bos_token") if bos is None else None
        self.unused_bos_token = (_token_content(tok_cfg.get("bos_token"))
                                 if named_bos is not None and named_bos != eos else None)
        pad = self._token_id(tok_cfg, "pad_token")
        if pad is None:
            pad = self._config_id(id_cfgs, "pad_token_id")
        if bos is not None and bos == eos:
            fix = (f"remove it from the post-processor of {file}" if prefix else
                   f"set \"add_bos_token\": false in {self._files[TOKENIZER_CONFIG]}")
            raise DataError(f"data.tokenizer: BOS and EOS are the same token {self._tok.id_to_token(eos)!r} (id {eos}); "
                            f"a document start must differ from a document end: {fix} to train without a BOS")
        if pad is None or pad == bos:  # a PAD equal to BOS would look like a document start
            pad = eos
        self._bos, self._eos, self._pad = bos, eos, pad
        self._special = np.zeros((self._vocab_size,), bool)
        self._special[[i for i, t in self._added.items() if t.special]] = True
        self._special[list(self.special_ids)] = True
        self._bytes_per_token = self._compute_bytes_per_token()
        self._bytes_per_token.setflags(write=False)

    def _config_id(self, id_cfgs: list[tuple[str, dict]], key: str) -> int | None:
        """``key`` (``eos_token_id``, ...) from the first of ``config.json`` / ``generation_config.json``
        that sets it, or None."""
        for name, cfg in id_cfgs:
            i = _first_id(cfg.get(key))
            if i is not None:
                if not 0 <= i < self._vocab_size:
                    raise DataError(f"{self._files[name]}: {key}={i} is outside the tokenizer's ids "
                                    f"[0, {self._vocab_size}) ({self.path})")
                return i
        return None

    def _token_id(self, tok_cfg: dict, key: str) -> int | None:
        """The id of ``tok_cfg[key]`` (``bos_token``, ...), or None when it is not set."""
        content = _token_content(tok_cfg.get(key))
        if content is None:
            return None
        i = self._tok.token_to_id(content)
        if i is None:
            raise DataError(f"{self._files[TOKENIZER_CONFIG]} (or {SPECIAL_TOKENS_MAP}): {key} {content!r} is not in "
                            f"the vocabulary of {self.path}")
        return i

    def _post_processor_specials(self) -> tuple[list[int], list[int]]:
        """The special ids the post-processor puts before and after a one-sequence input."""
        enc = self._tok.encode("a", add_special_tokens=True)
        mask = list(enc.special_tokens_mask)
        if 0 not in mask:  # the probe vanished: nothing tells prefix from suffix
            return [], []
        first, last = mask.index(0), len(mask) - mask[::-1].index(0)
        return list(enc.ids[:first]), list(enc.ids[last:])

    def _compute_bytes_per_token(self) -> np.ndarray:
        """int32 [V]: see :attr:`bytes_per_token`."""
        spec = json.loads(self._tok.to_str())
        decoders = _flat_decoders(spec.get("decoder"))
        kinds = {d.get("type") for d in decoders}
        space = None  # the char a SentencePiece-style vocabulary writes for a space
        for d in decoders:
            if d.get("type") == "Metaspace":
                space = d.get("replacement", "\u2581")
            elif d.get("type") == "Replace" and d.get("content") == " " and isinstance(d.get("pattern"), dict):
                space = d["pattern"].get("String", space)
        byte_fallback = "ByteFallback" in kinds or bool((spec.get("model") or {}).get("byte_fallback"))

        bpt = np.zeros((self._vocab_size,), np.int32)
        vocab = self._tok.get_vocab(with_added_tokens=False)
        if "ByteLevel" in kinds:
            u2b = _unicode_to_byte()
            for token, i in vocab.items():
                bpt[i] = sum(1 if c in u2b else len(c.encode("utf-8")) for c in token)
        elif space is not None:
            for token, i in vocab.items():
                bpt[i] = 1 if byte_fallback and _BYTE_FALLBACK.fullmatch(token) else len(
                    token.replace(space, " ").encode("utf-8"))
        else:
            ids = sorted(vocab.values())
            texts = self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
            bpt[ids] = [len(t.encode("utf-8")) for t in texts]
        for i, token in self._added.items():  # matched verbatim in the input text
            bpt[i] = len(token.content.encode("utf-8"))
        bpt[self._special] = 0
        return bpt

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bytes_per_token(self) -> np.ndarray:
        """int32 [V]: UTF-8 bytes of text each id stands for; 0 for special ids.

        Exact for the two common families, read from the decoder: byte-level BPE (a ``ByteLevel``
        decoder: GPT-2, Llama 3, Qwen, GPT-NeoX/OLMoE), where each vocabulary char stands for one
        byte (GPT-2's bytes-to-unicode map inverted), and SentencePiece-style vocabularies (a
        ``Metaspace`` decoder or a ``Replace("▁", " ")`` one: Llama 2, Mistral/Mixtral, Gemma),
        where ``▁`` is one space byte and a byte-fallback token ``<0xNN>`` is one byte. Non-special
        added tokens count the bytes of their text. Any other decoder (WordPiece, ...) falls back to
        ``len(decode([id]).encode())``, which can miss spaces and continuation markers.

        The sum over ``encode(text)`` is ``len(text.encode())`` when the normalizer leaves the text
        as it is (and, SentencePiece-style, the text holds no ``▁`` of its own), plus the one space
        byte a tokenizer prepends to a document, which its first token counts: a ``Prepend("▁")``
        normalizer (Llama 2) always does, Metaspace ``prepend_scheme="always"``/``"first"`` and
        ByteLevel ``add_prefix_space`` do unless the text starts with a space.
        """
        return self._bytes_per_token

    def encode(self, data: bytes | str) -> np.ndarray:
        """Tokenizes one document, without special tokens.

        Args:
          data: text, or bytes decoded as UTF-8 first (invalid bytes become U+FFFD, which
            :attr:`bytes_per_token` counts as its 3 UTF-8 bytes).

        Returns:
          int32 [N] ids, without BOS/EOS.

        Raises:
          TypeError: ``data`` is neither bytes nor str.
        """
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data).decode("utf-8", "replace")
        elif not isinstance(data, str):
            raise TypeError(f"HFTokenizer.encode expects bytes or str, got {type(data).__name__}")
        return np.asarray(self._tok.encode(data, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, datas) -> list[np.ndarray]:
        """Tokenizes many documents as :meth:`encode` does each one, on every core.

        ``tokenizers``' ``encode_batch_fast`` (Rust threads, the GIL released, no character
        offsets computed) with the configuration :meth:`encode` uses.

        Args:
          datas: sequence of bytes (decoded as UTF-8, invalid bytes become U+FFFD) or str.

        Returns:
          One int32 [N_i] array of ids per document, without BOS/EOS.

        Raises:
          TypeError: an element is neither bytes nor str.
        """
        texts = []
        for d in datas:
            if isinstance(d, (bytes, bytearray, memoryview)):
                d = bytes(d).decode("utf-8", "replace")
            elif not isinstance(d, str):
                raise TypeError(f"HFTokenizer.encode_batch expects bytes or str, got {type(d).__name__}")
            texts.append(d)
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_chat(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Tokenizes text a chat template rendered, with each token's character offsets.

        Unlike :meth:`encode`, the text of added tokens is read as those tokens: a chat template
        writes its special tokens (``<|im_start|>``, ``<|eot_id|>``, ``<s>``) as text, and the model
        was trained on them as single ids. Pretraining text is not read that way (a document that
        quotes ``<|endoftext|>`` would end early), so :meth:`encode` is unchanged. As in
        ``transformers``' ``apply_chat_template``, special-token text inside a message's content is
        read as the special token too. Nothing is added: the template writes its own BOS.

        Args:
          text: the rendered conversation.

        Returns:
          ``(ids, offsets)``: int32 [N] ids and int64 [N, 2] ``[start, end)`` offsets, in characters
          of ``text``, of what each token was made from (the tokens of one multi-byte character
          share its offsets).

        Raises:
          TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode_chat expects str, got {type(text).__name__}")
        enc = self._chat_tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)

    @functools.cached_property
    def _chat_tokenizer(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads added tokens' text as those tokens (for :meth:`encode_chat`)."""
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        tok.no_padding()
        tok.no_truncation()
        tok.encode_special_tokens = False
        return tok

    @property
    def special_mask(self) -> np.ndarray:
        """bool [V], read-only: True for special ids (added tokens marked special, and BOS/EOS/PAD)."""
        view = self._special.view()
        view.setflags(write=False)
        return view

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (``"<|im_end|>"``, ``"Ġthe"``), or None when no token has it."""
        return self._tok.id_to_token(int(token_id))

    def decode(self, ids) -> str:
        """Turns ids back into text with the tokenizer's decoder.

        Args:
          ids: int array-like [N] of ids in ``[0, vocab_size)``.

        Returns:
          The text; special ids (added tokens marked special, and BOS/EOS/PAD) are skipped and bytes
          that are not valid UTF-8 become U+FFFD.

        Raises:
          DataError: an id is outside ``[0, vocab_size)`` or the ids are not integers.
        """
        ids = np.asarray(ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"HFTokenizer.decode expects integer ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self._vocab_size)
        if bad.any():
            raise DataError(f"HFTokenizer.decode: id {int(ids[bad][0])} is outside [0, {self._vocab_size})")
        ids = ids[~self._special[ids]]
        return self._tok.decode(ids.tolist(), skip_special_tokens=True)

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.path!r}, vocab_size={self._vocab_size}, pad={self._pad}, bos={self._bos}, "
                f"eos={self._eos})")
