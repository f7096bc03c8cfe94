"""Data: tokenizer, corpus sources, packing into rows, and the grain input pipeline.

Depends on numpy, grain, pyarrow, Hugging Face ``tokenizers``, jinja2 (chat templates, in
:mod:`moefast.data.sft` only) and the standard library only (no JAX).
"""

from moefast.data.errors import DataError
from moefast.data.hf_tokenizer import HFTokenizer
from moefast.data.packing import ROW_KEYS, PackedRows, pack_documents
from moefast.data.pipeline import Corpus, eval_batches, load_corpus, train_dataset
from moefast.data.sources import Document, SourceStats, load_documents, split_documents
from moefast.data.tokenizer import ByteTokenizer, Tokenizer
from moefast.data.tokenizer_registry import TOKENIZERS, get_tokenizer

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "Document",
    "HFTokenizer",
    "PackedRows",
    "ROW_KEYS",
    "SourceStats",
    "TOKENIZERS",
    "Tokenizer",
    "eval_batches",
    "get_tokenizer",
    "load_corpus",
    "load_documents",
    "pack_documents",
    "split_documents",
    "train_dataset",
]
