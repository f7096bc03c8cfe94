"""The tokenizer a run uses: ``DataConfig.tokenizer`` resolved to a :class:`~moefast.data.tokenizer.Tokenizer`.

A name in :data:`TOKENIZERS` (``"byte"``: :class:`~moefast.data.tokenizer.ByteTokenizer`), or else the
path of a Hugging Face tokenizer (:class:`~moefast.data.hf_tokenizer.HFTokenizer`). Both tokenizer
modules know only the :class:`~moefast.data.tokenizer.Tokenizer` interface; this module knows them
both, so neither imports the other. Another tokenizer plugs in by subclassing
:class:`~moefast.data.tokenizer.Tokenizer` and adding a name to :data:`TOKENIZERS`.
"""

from __future__ import annotations

import os

from moefast.data.errors import DataError
from moefast.data.hf_tokenizer import HFTokenizer
from moefast.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["TOKENIZERS", "get_tokenizer"]

TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer}


def get_tokenizer(name: str | os.PathLike) -> Tokenizer:
    """Builds the tokenizer that ``DataConfig.tokenizer`` names.

    Args:
      name: a name in :data:`TOKENIZERS` (``"byte"``), or else a path: a Hugging Face tokenizer
        directory holding ``tokenizer.json``, or a ``tokenizer.json`` file (``~`` is expanded;
        relative to the working directory).

    Returns:
      The tokenizer; :class:`~moefast.data.hf_tokenizer.HFTokenizer` for a path.

    Raises:
      DataError: neither a known name nor an existing path (the message lists the names and says
        what path to pass), or any error of :class:`~moefast.data.hf_tokenizer.HFTokenizer`.
    """
    if isinstance(name, str) and name in TOKENIZERS:
        return TOKENIZERS[name]()
    path = os.path.expanduser(os.fspath(name)) if isinstance(name, (str, os.PathLike)) else None
    if not path or not os.path.exists(path):
        raise DataError(f"data.tokenizer: unknown tokenizer {name!r}; valid names: {sorted(TOKENIZERS)}, or the path "
                        "of a Hugging Face tokenizer directory holding tokenizer.json or of a tokenizer.json file "
                        f"(no such path: {os.path.abspath(path) if path else name!r})")
    return HFTokenizer(path)
