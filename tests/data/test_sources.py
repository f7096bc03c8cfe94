"""load_documents over every source kind, its errors, and split_documents."""

import hashlib
import json
import os
import random
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moefast.data import DataError, Document, load_documents, split_documents
from moefast.data import sources as sources_mod


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


def test_stdlib_default():
    docs, stats = load_documents("stdlib")
    assert len(docs) > 500
    ids = [d.id for d in docs]
    assert ids == sorted(ids)
    assert "os.py" in ids and "json/decoder.py" in ids
    for i in ids:
        parts = i.split("/")
        assert i.endswith(".py") and not os.path.isabs(i), i
        assert not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(parts), i
    assert stats.documents == len(docs)
    assert stats.bytes == sum(len(d.data) for d in docs)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert docs[0].data == (root / docs[0].id).read_bytes()


def test_directory_recursive_sorted_skips_hidden(tmp_path):
    _write(tmp_path / "b.txt", "bee")
    _write(tmp_path / "a" / "x.txt", "ex")
    _write(tmp_path / "sub" / "y.md", "why")
    _write(tmp_path / ".hidden", "no")
    _write(tmp_path / ".git" / "config", "no")
    _write(tmp_path / "sub" / ".swp", "no")
    docs, stats = load_documents(str(tmp_path))
    assert [(d.id, d.data) for d in docs] == [("a/x.txt", b"ex"), ("b.txt", b"bee"), ("sub/y.md", b"why")]
    assert (stats.documents, stats.bytes, stats.skipped_files) == (3, 8, [])


def test_directory_empty_files_are_dropped_and_counted(tmp_path):
    _write(tmp_path / "a.txt", "")
    _write(tmp_path / "b.txt", "text")
    docs, stats = load_documents(str(tmp_path))
    assert [d.id for d in docs] == ["b.txt"]
    assert stats.empty_documents == 1


def test_glob_of_text_files(tmp_path):
    _write(tmp_path / "one.txt", "1")
    _write(tmp_path / "two.txt", "22")
    _write(tmp_path / "skip.md", "no")
    _write(tmp_path / "deep" / "three.txt", "333")
    docs, _ = load_documents(str(tmp_path / "*.txt"))
    assert [(d.id, d.data) for d in docs] == [("one.txt", b"1"), ("two.txt", b"22")]
    docs, _ = load_documents(str(tmp_path / "**" / "*.txt"))
    assert [d.id for d in docs] == ["deep/three.txt", "one.txt", "two.txt"]


def test_jsonl_file_and_glob(tmp_path):
    lines = [json.dumps({"text": "first", "meta": 1}), "", json.dumps({"text": "sécond"}),
             json.dumps({"text": ""}), json.dumps({"text": None})]
    _write(tmp_path / "a.jsonl", "\n".join(lines) + "\n")
    _write(tmp_path / "b.jsonl", json.dumps({"body": "other field"}) + "\n")
    docs, stats = load_documents(str(tmp_path / "a.jsonl"))
    assert [(d.id, d.data) for d in docs] == [("a.jsonl:1", b"first"), ("a.jsonl:3", "sécond".encode())]
    assert stats.empty_documents == 2
    docs, _ = load_documents(str(tmp_path / "b*.jsonl"), text_field="body")
    assert [(d.id, d.data) for d in docs] == [("b.jsonl:1", b"other field")]


def test_directory_dispatches_jsonl_by_suffix(tmp_path):
    _write(tmp_path / "raw.txt", "plain")
    _write(tmp_path / "recs.jsonl", json.dumps({"text": "rec"}) + "\n")
    docs, _ = load_documents(str(tmp_path))
    assert [(d.id, d.data) for d in docs] == [("raw.txt", b"plain"), ("recs.jsonl:1", b"rec")]


def test_parquet_file_and_glob(tmp_path):
    pq.write_table(pa.table({"text": ["alpha", None, "gamma"], "n": [1, 2, 3]}), tmp_path / "p1.parquet")
    pq.write_table(pa.table({"content": pa.array([b"\xffbin"], pa.binary()), "text": ["x"]}), tmp_path / "p2.parquet")
    docs, stats = load_documents(str(tmp_path / "p1.parquet"))
    assert [(d.id, d.data) for d in docs] == [("p1.parquet:0", b"alpha"), ("p1.parquet:2", b"gamma")]
    assert stats.empty_documents == 1
    docs, stats = load_documents(str(tmp_path / "*.parquet"))
    assert [d.id for d in docs] == ["p1.parquet:0", "p1.parquet:2", "p2.parquet:0"]
    docs, stats = load_documents(str(tmp_path / "p2.parquet"), text_field="content")
    assert docs == [Document("p2.parquet:0", b"\xffbin")] and stats.non_utf8_documents == 1


def test_non_utf8_file_is_accepted_and_counted(tmp_path):
    _write(tmp_path / "bad.bin", b"ok \xff\xfe\x00 bytes")
    _write(tmp_path / "good.txt", "fine")
    docs, stats = load_documents(str(tmp_path))
    assert docs[0] == Document("bad.bin", b"ok \xff\xfe\x00 bytes")
    assert stats.non_utf8_documents == 1 and stats.documents == 2


@pytest.mark.parametrize("source", ["does/not/exist", "does/not/*.txt"])
def test_nothing_matches(tmp_path, source):
    source = str(tmp_path / source)
    with pytest.raises(DataError, match="data.source") as e:
        load_documents(source)
    assert source in str(e.value)


def test_empty_corpus(tmp_path):
    _write(tmp_path / "empty.txt", "")
    with pytest.raises(DataError, match="empty.*empty.txt"):
        load_documents(str(tmp_path))
    (tmp_path / "nothing_here").mkdir()
    with pytest.raises(DataError, match="nothing_here.*no regular"):
        load_documents(str(tmp_path / "nothing_here"))
    _write(tmp_path / "recs.jsonl", "\n\n")
    with pytest.raises(DataError, match="empty.*recs.jsonl"):
        load_documents(str(tmp_path / "recs.jsonl"))


@pytest.mark.parametrize("line, what", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"body": "x"}', "no field 'text'.*data.text_field"),
    ('{"text": 3}', "is int, expected a string"),
])
def test_bad_jsonl_line(tmp_path, line, what):
    _write(tmp_path / "bad.jsonl", json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=what) as e:
        load_documents(str(tmp_path))
    assert "bad.jsonl:2" in str(e.value)


def test_parquet_without_column(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(DataError, match=r"nocol.parquet.*no column 'text'.*\['body'\].*data.text_field"):
        load_documents(str(tmp_path / "nocol.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match="ints.parquet.*int64"):
        load_documents(str(tmp_path / "ints.parquet"))
    _write(tmp_path / "junk.parquet", b"this is not parquet")
    with pytest.raises(DataError, match="junk.parquet.*not a readable parquet"):
        load_documents(str(tmp_path / "junk.parquet"))


@pytest.fixture
def deny_reading(monkeypatch):
    """Makes the named files unreadable (tests run as root, where chmod does not stop reads)."""
    denied: set[str] = set()
    real_read = sources_mod._read_bytes

    def fake_read(path):
        if Path(path).name in denied:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(sources_mod, "_read_bytes", fake_read)
    return denied


def test_unreadable_single_file_is_an_error(tmp_path, deny_reading):
    _write(tmp_path / "secret.txt", "x")
    deny_reading.add("secret.txt")
    with pytest.raises(DataError, match="secret.txt.*cannot read.*Permission"):
        load_documents(str(tmp_path / "secret.txt"))


def test_unreadable_files_in_directory_are_skipped_and_reported(tmp_path, deny_reading):
    _write(tmp_path / "secret.txt", "x")
    _write(tmp_path / "open.txt", "y")
    deny_reading.add("secret.txt")
    docs, stats = load_documents(str(tmp_path))
    assert [d.id for d in docs] == ["open.txt"]
    assert len(stats.skipped_files) == 1
    path, reason = stats.skipped_files[0]
    assert path.endswith("secret.txt") and "PermissionError" in reason
    deny_reading.add("open.txt")
    with pytest.raises(DataError, match="all 2 files are unreadable.*open.txt"):
        load_documents(str(tmp_path))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read chmod-000 files")
def test_unreadable_by_permissions(tmp_path):
    p = _write(tmp_path / "locked.txt", "x")
    _write(tmp_path / "open.txt", "y")
    p.chmod(0)
    try:
        docs, stats = load_documents(str(tmp_path))
        assert [d.id for d in docs] == ["open.txt"] and len(stats.skipped_files) == 1
        with pytest.raises(DataError, match="locked.txt"):
            load_documents(str(p))
    finally:
        p.chmod(0o644)


def _docs(n, seed=0):
    rng = random.Random(seed)
    return [Document(f"dir{i % 7}/file{i}.txt", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20))))
            for i in range(n)]


def test_split_is_the_documented_hash_rule_deterministic_and_disjoint():
    docs = _docs(2000)
    train, val = split_documents(docs, 0.1)
    expected_val = [d for d in docs
                    if int.from_bytes(hashlib.blake2b(d.id.encode(), digest_size=8).digest(), "big") / 2**64 < 0.1]
    assert val == expected_val
    assert {d.id for d in train}.isdisjoint({d.id for d in val})
    assert len(train) + len(val) == len(docs)
    assert 0.07 < len(val) / len(docs) < 0.13
    shuffled = list(docs)
    random.Random(1).shuffle(shuffled)
    train2, val2 = split_documents(shuffled, 0.1)
    assert {d.id for d in val2} == {d.id for d in val}


def test_split_single_document_falls_back_to_cutting_bytes():
    doc = Document("only.txt", bytes(range(100)))
    train, val = split_documents([doc], 0.1)
    assert train == [Document("only.txt", bytes(range(90)))]
    assert val == [Document("only.txt#val", bytes(range(90, 100)))]
    text = ("é" * 50).encode()  # 100 bytes; a cut at 95 would split a character
    train, val = split_documents([Document("u.txt", text)], 0.05)
    assert train[0].data + val[0].data == text
    assert len(train[0].data) == 94
    train[0].data.decode("utf-8")
    val[0].data.decode("utf-8")


def test_split_fallback_keeps_documents_whole_unless_too_few():
    """When the hash rule holds out none (or all), the k = max(1, round(n * f)) documents of smallest
    hash go to validation, whole, if k <= 2 * f * n; fewer documents are cut instead."""
    from moefast.data.sources import fallback_held_out, id_fraction

    assert [fallback_held_out(n, 0.02) for n in (1, 2, 24, 25, 40, 74, 75)] == [0, 0, 0, 1, 1, 1, 2]
    assert fallback_held_out(2, 0.5) == 1 and fallback_held_out(2, 0.2) == 0
    docs = [d for d in _docs(200) if id_fraction(d.id) >= 0.02][:30]  # none held out by the rule
    train, val = split_documents(docs, 0.02)
    assert val == [min(docs, key=lambda d: id_fraction(d.id))] and len(train) == 29
    assert {d.id for d in train}.isdisjoint(d.id for d in val)
    train, val = split_documents(docs[:20], 0.02)  # 1 of 20 would be 5%: cut
    assert len(train) == len(val) == 20 and all(d.id.endswith("#val") for d in val)


def test_split_rejects_bad_fraction():
    with pytest.raises(DataError, match="val_fraction"):
        split_documents(_docs(3), 1.0)
