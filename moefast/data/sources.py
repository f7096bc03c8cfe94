"""Corpus sources: read documents from the stdlib, a directory, a glob, ``.jsonl``, ``.parquet`` or a
Hugging Face ``datasets`` directory (``save_to_disk``).

Every source yields :class:`Document` s in a deterministic (sorted) order, with ids that do not
depend on where the corpus lives on disk (paths relative to the source root), so that
:func:`split_documents` holds out the same documents on every machine.

Files are dispatched by suffix wherever they come from (a directory, a glob or a single path):
``.jsonl`` files hold one JSON object per line, ``.parquet`` and ``.arrow`` files a text column, and
every other file is one document of raw bytes. :func:`iter_documents` reads one file at a time;
:func:`load_documents` collects them all.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from moefast.data.errors import DataError

__all__ = [
    "DataError",
    "Document",
    "SourceStats",
    "cut_document",
    "fallback_held_out",
    "glob_base",
    "id_fraction",
    "iter_documents",
    "list_files",
    "load_documents",
    "split_documents",
]

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_GLOB_CHARS = frozenset("*?[")
_SOURCE_HELP = ("set data.source to 'stdlib', a directory, a glob such as 'corpus/**/*.txt', "
                "a .jsonl file (or glob) or a .parquet file (or glob)")


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of the corpus.

    Attributes:
      id: stable name: a path relative to the source root; ``path:line`` (1-based) for ``.jsonl``
        records and ``path:row`` (0-based) for ``.parquet`` rows.
      data: the raw bytes (UTF-8 when the source was text; need not be valid UTF-8).
    """

    id: str
    data: bytes


@dataclasses.dataclass
class SourceStats:
    """What :func:`load_documents` read.

    Attributes:
      documents: non-empty documents returned.
      bytes: total bytes of those documents.
      skipped_files: ``(path, reason)`` of files that could not be read and were left out.
      non_utf8_documents: documents whose bytes are not valid UTF-8 (kept: the byte tokenizer
        handles any bytes).
      empty_documents: empty files / records (empty or null text), left out.
      source: the ``data.source`` string that was read.
    """

    documents: int = 0
    bytes: int = 0
    skipped_files: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    non_utf8_documents: int = 0
    empty_documents: int = 0
    source: str = ""


def load_documents(source: str, text_field: str = "text") -> tuple[list[Document], SourceStats]:
    """Reads a corpus into memory (:func:`iter_documents`, collected).

    Args:
      source: as for :func:`list_files`.
      text_field: the JSON field / parquet or Arrow column holding the text.

    Returns:
      ``(documents, stats)``: non-empty documents in sorted order of file, then line/row.

    Raises:
      DataError: as :func:`iter_documents`.
    """
    stats = SourceStats(source=source)
    docs = list(iter_documents(source, text_field, stats))
    return docs, stats


def list_files(source: str) -> tuple[list[tuple[Path, str]], bool]:
    """The files a corpus source names, in reading order.

    Args:
      source: ``"stdlib"`` (the running interpreter's standard-library ``.py`` files, without
        ``site-packages``/``dist-packages`` and without any directory named ``test``, ``tests`` or
        ``idle_test``); a Hugging Face ``datasets`` directory written by ``save_to_disk`` (holding
        ``state.json`` and ``dataset_info.json``: its ``.arrow`` files, in the order ``state.json``
        lists them); another directory (every regular, non-hidden file below it); a glob (``**``
        allowed); or a single file.

    Returns:
      ``(files, explicit)``: ``(path, id)`` pairs, ``id`` the path relative to the source root (sorted
      by it, except a ``datasets`` directory's), and whether ``source`` named a single file.

    Raises:
      DataError: nothing matches ``source``; a ``datasets`` directory holds a ``DatasetDict`` (name one
        split's directory instead) or its ``state.json`` is unreadable.
    """
    if not isinstance(source, str) or not source:
        raise DataError(f"data.source: expected a non-empty string, got {source!r}; {_SOURCE_HELP}")
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk(root, lambda rel: rel.suffix == ".py" and not (set(rel.parts[:-1]) & _STDLIB_EXCLUDED_DIRS))
        if not files:
            raise DataError(f"data.source='stdlib': found no .py files under {root} (is the standard library "
                            f"zipped or stripped?); {_SOURCE_HELP}")
        return files, False
    expanded = os.path.expanduser(source)
    path = Path(expanded)
    if _GLOB_CHARS & set(expanded):
        base = glob_base(expanded)
        files = [(Path(m), Path(os.path.relpath(m, base)).as_posix())
                 for m in sorted(globlib.glob(expanded, recursive=True)) if os.path.isfile(m)]
        if not files:
            raise DataError(f"data.source={source!r}: the glob matches no files; {_SOURCE_HELP}")
        return files, False
    if path.is_dir():
        files = _hf_dataset_files(path)
        if files is None:
            files = _walk(path, lambda rel: True)
        if not files:
            raise DataError(f"data.source={source!r}: the directory {path} holds no regular non-hidden files; "
                            f"{_SOURCE_HELP}")
        return files, False
    if path.is_file():
        return [(path, path.name)], True
    raise DataError(f"data.source={source!r}: no such file or directory, and not 'stdlib' or a glob; "
                    f"{_SOURCE_HELP}")


def iter_documents(source: str, text_field: str = "text", stats: SourceStats | None = None, *,
                   files: tuple[list[tuple[Path, str]], bool] | None = None) -> Iterator[Document]:
    """Reads a corpus lazily: memory holds a document (a file, a ``.jsonl`` line, a batch of
    parquet/Arrow rows) at a time, not the corpus.

    ``.jsonl`` files hold one JSON object per line, ``.parquet`` files and ``.arrow`` files (Arrow IPC
    stream or file format, as Hugging Face ``datasets`` writes them) a text column; every other file
    is one document of raw bytes.

    Args:
      source: as for :func:`list_files`.
      text_field: the JSON field / parquet or Arrow column holding the text.
      stats: updated as documents are read (see :class:`SourceStats`); ``None`` for none.
      files: what :func:`list_files` returned for ``source``, when the caller has it already.

    Yields:
      Non-empty documents in the order of :func:`list_files`, then line/row.

    Raises:
      DataError: any error of :func:`list_files`; a single named file cannot be read; a ``.jsonl``
        line is not a JSON object with a string ``text_field``; a ``.parquet``/``.arrow`` file lacks
        the column or is not parquet/Arrow; every file was unreadable; or no document has any bytes
        (raised once the files are exhausted). Files of a directory, glob or the stdlib that cannot
        be read (permissions) are skipped and listed in ``stats.skipped_files`` instead (one that
        fails part-way keeps the documents read before).
    """
    files, explicit = list_files(source) if files is None else files
    if stats is None:
        stats = SourceStats(source=source)
    for path, rel in files:
        if path.suffix == ".jsonl":
            records = _read_jsonl(path, rel, text_field)
        elif path.suffix == ".parquet":
            records = _read_parquet(path, rel, text_field)
        elif path.suffix == ".arrow":
            records = _read_arrow(path, rel, text_field)
        else:
            records = _read_document(path, rel)
        try:  # the readers open their file on the first next(): a file that cannot be opened yields nothing
            for doc in records:
                if not doc.data:
                    stats.empty_documents += 1
                    continue
                try:
                    doc.data.decode("utf-8")
                except UnicodeDecodeError:
                    stats.non_utf8_documents += 1
                stats.documents += 1
                stats.bytes += len(doc.data)
                yield doc
        except OSError as e:
            reason = f"{type(e).__name__}: {e.strerror or e}"
            if explicit:
                raise DataError(f"{path}: cannot read ({reason}); fix its permissions or {_SOURCE_HELP}") from None
            stats.skipped_files.append((str(path), reason))

    if not stats.documents:
        if stats.skipped_files and len(stats.skipped_files) == len(files):
            first_path, first_reason = stats.skipped_files[0]
            raise DataError(f"data.source={source!r}: all {len(files)} files are unreadable (first: {first_path}: "
                            f"{first_reason}); fix their permissions or {_SOURCE_HELP}")
        raise DataError(f"data.source={source!r}: the corpus is empty: {len(files)} file(s) "
                        f"(first: {files[0][0]}) hold no document with any bytes "
                        f"({stats.empty_documents} empty, {len(stats.skipped_files)} unreadable); "
                        f"point data.source at non-empty files, or check data.text_field={text_field!r}")


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Splits documents into train and validation, identically on every machine.

    A document goes to validation iff ``blake2b(id) / 2**64 < val_fraction`` (a fixed hash, not
    Python's salted ``hash``), so the split depends only on the ids, not on order or machine.

    That rule holds out no document at all with probability ``(1 - val_fraction)**n``: 45 % for 40
    documents at the default 0.02. Then (or when it holds out every one) the fallback is, as
    :func:`fallback_held_out` decides:

    - whole documents: the ``k = max(1, round(n * val_fraction))`` documents of smallest hash are
      held out, when ``k`` is at most twice the fraction asked for (``k <= 2 * val_fraction * n``:
      25 documents or more at 0.02);
    - else (too few documents: one of 5 would hold out 20 % where 2 % was asked) every document is
      cut: its first ``floor(len * (1 - val_fraction))`` bytes (moved back to a UTF-8 character
      boundary) go to train as ``id``, the rest to validation as ``id + "#val"``. Empty pieces are
      dropped, so a side can still end up empty when documents are tiny.

    Args:
      docs: the corpus.
      val_fraction: expected fraction held out, in (0, 1) (dimensionless).

    Returns:
      ``(train, val)``, each in the input order.

    Raises:
      DataError: ``val_fraction`` is not in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction: must be in (0, 1), got {val_fraction}")
    hashes = [id_fraction(d.id) for d in docs]
    held = [h < val_fraction for h in hashes]
    if any(held) and not all(held):
        return [d for d, v in zip(docs, held) if not v], [d for d, v in zip(docs, held) if v]
    k = fallback_held_out(len(docs), val_fraction)
    if k:
        chosen = set(sorted(range(len(docs)), key=lambda i: hashes[i])[:k])
        return ([d for i, d in enumerate(docs) if i not in chosen], [d for i, d in enumerate(docs) if i in chosen])
    train: list[Document] = []
    val: list[Document] = []
    for d in docs:
        head, tail = cut_document(d, val_fraction)
        if head is not None:
            train.append(head)
        if tail is not None:
            val.append(tail)
    return train, val


def fallback_held_out(n: int, val_fraction: float) -> int:
    """Documents :func:`split_documents`' fallback holds out whole, when the hash rule held out none
    or all of ``n``: ``k = min(n - 1, max(1, round(n * val_fraction)))`` if ``k <= 2 * val_fraction * n``,
    else 0 (every document is cut instead).

    Args:
      n: documents in the corpus.
      val_fraction: the fraction asked for, in (0, 1) (dimensionless).

    Returns:
      k (documents), or 0 for the cut fallback.
    """
    if n < 2:
        return 0
    k = min(n - 1, max(1, round(n * val_fraction)))
    return k if k <= 2 * val_fraction * n + 1e-9 else 0


def cut_document(doc: Document, val_fraction: float) -> tuple[Document | None, Document | None]:
    """:func:`split_documents`' fallback for one document: ``(train piece, validation piece)``.

    The first ``floor(len * (1 - val_fraction))`` bytes, moved back to a UTF-8 character boundary,
    keep ``doc.id``; the rest is ``doc.id + "#val"``. An empty piece is ``None``.
    """
    cut = _utf8_boundary(doc.data, int(len(doc.data) * (1.0 - val_fraction)))
    head = Document(doc.id, doc.data[:cut]) if cut > 0 else None
    tail = Document(doc.id + "#val", doc.data[cut:]) if cut < len(doc.data) else None
    return head, tail


def id_fraction(doc_id: str) -> float:
    """``blake2b(doc_id) / 2**64`` in [0, 1): a document goes to validation iff this is below
    ``val_fraction`` (:func:`split_documents`); the same on every machine, unlike ``hash``."""
    digest = hashlib.blake2b(doc_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _utf8_boundary(data: bytes, cut: int) -> int:
    """Moves ``cut`` back over UTF-8 continuation bytes (at most 3) so a character is not split."""
    for _ in range(3):
        if 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
            cut -= 1
    return cut


def _walk(root: Path, keep) -> list[tuple[Path, str]]:
    """Regular non-hidden files below ``root`` (hidden directories pruned), sorted by relative path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            full = Path(dirpath) / name
            rel = full.relative_to(root)
            if full.is_file() and keep(rel):
                out.append((full, rel.as_posix()))
    out.sort(key=lambda x: x[1])
    return out


def glob_base(pattern: str) -> str:
    """The directory part of ``pattern`` before its first glob character (ids are relative to it)."""
    head = pattern
    for i, ch in enumerate(pattern):
        if ch in _GLOB_CHARS:
            head = pattern[:i]
            break
    return os.path.dirname(head) or "."


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _read_document(path: Path, rel: str) -> Iterator[Document]:
    yield Document(rel, _read_bytes(path))


def _read_jsonl(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    """One document per line, read line by line."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield _jsonl_document(line, f"{path}:{lineno}", f"{rel}:{lineno}", text_field)


def _jsonl_document(line: bytes, where: str, doc_id: str, text_field: str) -> Document:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise DataError(f"{where}: not valid JSON ({msg}); each line of a .jsonl file must be one JSON object "
                        f"such as {{\"{text_field}\": \"...\"}}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}; each line of a .jsonl "
                        f"file must be one object such as {{\"{text_field}\": \"...\"}}")
    if text_field not in record:
        raise DataError(f"{where}: no field {text_field!r} (fields: {sorted(record)[:10]}); set data.text_field "
                        "to the field that holds the text"
                        + ("; for conversations use data.format=sft"
                           if "messages" in record else ""))
    text = record[text_field]
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string; set "
                        "data.text_field to the field that holds the text")
    return Document(doc_id, text.encode("utf-8", "surrogatepass"))


def _read_parquet(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    """The ``text_field`` column, read batch by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(path, "rb") as f:  # raises PermissionError like any other file
        try:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
        except pa.ArrowException as e:
            raise DataError(f"{path}: not a readable parquet file ({e}); rewrite it or remove it from "
                            "data.source") from None
        _check_text_column(path, schema, text_field)
        yield from _column_documents(path, rel, text_field, "parquet", pf.iter_batches(columns=[text_field]))


def _check_text_column(path: Path, schema, text_field: str) -> None:
    """Raises unless the Arrow ``schema`` has a string or binary column ``text_field``."""
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {schema.names[:20]}); set data.text_field "
                        "to the column that holds the text")
    typ = schema.field(text_field).type
    is_text = pa.types.is_string(typ) or pa.types.is_large_string(typ)
    is_binary = pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
    if not (is_text or is_binary):
        raise DataError(f"{path}: column {text_field!r} has type {typ}, expected string or binary; set "
                        "data.text_field to the column that holds the text")


def _column_documents(path: Path, rel: str, text_field: str, kind: str, batches) -> Iterator[Document]:
    """Documents ``rel:row`` (rows counted from 0 over all ``batches``, Arrow record batches)."""
    import pyarrow as pa

    row = 0
    try:
        for batch in batches:
            for value in batch.column(text_field).to_pylist():
                if value is None:
                    value = b""
                elif isinstance(value, str):
                    value = value.encode("utf-8", "surrogatepass")
                yield Document(f"{rel}:{row}", value)
                row += 1
    except pa.ArrowException as e:  # an OSError (pyarrow's ArrowIOError) is left to the caller
        raise DataError(f"{path}: not a readable {kind} file ({e}); rewrite it or remove it from "
                        "data.source") from None


def _hf_dataset_files(path: Path) -> list[tuple[Path, str]] | None:
    """The ``.arrow`` files of a Hugging Face ``datasets`` directory (``save_to_disk``), in the order
    its ``state.json`` lists them; ``None`` when ``path`` is not one."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits")
        except (OSError, ValueError, AttributeError):
            splits = None
        raise DataError(f"{path}: a Hugging Face DatasetDict (splits {splits}); set data.source to one split's "
                        f"directory, such as {path / 'train'}")
    state = path / "state.json"
    if not (state.is_file() and (path / "dataset_info.json").is_file()):
        return None
    try:
        entries = json.loads(state.read_text())["_data_files"]
        names = [e["filename"] for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: not a Hugging Face datasets state file ({type(e).__name__}: {e}); write the "
                        "dataset with save_to_disk again") from None
    return [(path / name, name) for name in names]


def _read_arrow(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    """An Arrow IPC file (stream format, as ``datasets`` writes it, or file format), batch by batch."""
    import pyarrow as pa

    with open(path, "rb") as f:  # raises PermissionError like any other file
        try:
            try:
                reader = pa.ipc.open_stream(f)
                batches = iter(reader)
            except pa.ArrowInvalid:
                f.seek(0)
                reader = pa.ipc.open_file(f)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            schema = reader.schema
        except pa.ArrowException as e:
            raise DataError(f"{path}: not a readable Arrow IPC file ({e}); rewrite it or remove it from "
                            "data.source") from None
        _check_text_column(path, schema, text_field)
        yield from _column_documents(path, rel, text_field, "Arrow IPC", batches)
