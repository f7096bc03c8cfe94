"""Prepared token shards (moefast.data.prepared): prepare -> shards -> the same rows and batches as the
in-memory pipeline, per-process reading, exact resume, and every bad input as one DataError."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import ByteLevelBPETokenizer, Tokenizer, models, pre_tokenizers

from moefast.config import DataConfig
from moefast.data import (ROW_KEYS, Corpus, DataError, eval_batches, get_tokenizer, load_corpus,
                          load_documents, pack_documents, split_documents, train_dataset)
from moefast.data import prepared as prepared_mod
from moefast.data import prepared_write
from moefast.data import sources as sources_mod
from moefast.data.prepared import MANIFEST, PreparedRows, is_prepared, open_prepared, prepare

WORDS = ["alpha", "beta", "gamma", "delta", "λx", "\n", "def f():", "日本", "🙂"]


def _write_corpus(root, n_files=40, seed=0):
    """Small text files of varied lengths (a few bytes to ~1 kB), some non-ASCII."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        words = rng.choice(WORDS, rng.integers(1, 150))
        (root / f"doc{i:03d}.txt").write_text(" ".join(words) + f" #{i}")
    return str(root)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_rows_equal(a, b, n=None):
    assert len(a) == len(b) and a.num_tokens == b.num_tokens and a.num_documents == b.num_documents
    for i in range(len(a) if n is None else n):
        x, y = a[i], b[i]
        assert set(x) == set(y) == set(ROW_KEYS)
        for k in ROW_KEYS:
            assert x[k].dtype == y[k].dtype, (i, k)
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"row {i} {k}")


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in ROW_KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return _write_corpus(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def prepared_dir(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "ds"
    prepare(corpus_dir, out, val_fraction=0.2, shard_tokens=2000, progress=False)  # several shards per split
    return str(out)


def _cfg(source, **kw):
    return DataConfig(**{"source": source, "seq_len": 16, "batch_size": 4, "val_fraction": 0.2, **kw})


# ----------------------------------------------------------------------------------------------- #
# round trip                                                                                        #
# ----------------------------------------------------------------------------------------------- #

def test_manifest_records_the_corpus(corpus_dir, prepared_dir):
    m = json.loads((open(os.path.join(prepared_dir, MANIFEST))).read())
    assert (m["format"], m["format_version"], m["dtype"]) == ("moefast-prepared", 1, "uint16")
    assert m["tokenizer"] == {"name": "byte", "identity": "byte", "vocab_size": 259, "bos_id": 257, "eos_id": 258,
                              "pad_id": 256}
    docs, stats = load_documents(corpus_dir)
    train, val = split_documents(docs, 0.2)
    assert m["held_out_documents"] is True and train and val
    assert m["splits"]["train"]["documents"] == len(train) and m["splits"]["val"]["documents"] == len(val)
    assert m["splits"]["train"]["tokens"] == sum(len(d.data) for d in train)  # byte tokenizer: 1 token a byte
    assert len(m["splits"]["train"]["shards"]) > 1
    src = m["sources"]
    assert (src["documents"], src["bytes"], src["source"]) == (stats.documents, stats.bytes, corpus_dir)
    assert len(src["files"]) == 40 and all(f["bytes"] > 0 and f["mtime"] > 0 for f in src["files"])
    assert sorted(os.listdir(prepared_dir)) == [MANIFEST, "shards"]


def test_rows_and_batches_equal_the_in_memory_pipeline(corpus_dir, prepared_dir):
    cfg = _cfg(corpus_dir)
    memory = load_corpus(cfg)
    prep = load_corpus(_cfg(prepared_dir))
    assert isinstance(prep.train, PreparedRows) and prep.held_out_documents
    _assert_rows_equal(prep.train, memory.train)
    _assert_rows_equal(prep.val, memory.val)
    assert prep.stats.documents == memory.stats.documents and prep.stats.bytes == memory.stats.bytes
    steps = len(memory.train) // 4 + 3  # into the second epoch
    _assert_batches_equal(_take(iter(train_dataset(prep, cfg, seed=5)), steps),
                          _take(iter(train_dataset(memory, cfg, seed=5)), steps))
    _assert_batches_equal(eval_batches(prep, cfg, 3), eval_batches(memory, cfg, 3))
    assert "rows" in prep.summary()
    assert prep.warnings(cfg) == memory.warnings(cfg) == []
    other = _cfg(prepared_dir, val_fraction=0.05)  # the split was fixed at prepare time
    assert load_corpus(other).warnings(other) == [f"data.val_fraction=0.05 is not used: data.source={prepared_dir!r} "
                                                  "was split with --val-fraction 0.2 when it was prepared"]


@pytest.mark.parametrize("seq_len", [7, 64, 2000])
def test_rows_equal_pack_documents_for_any_seq_len(corpus_dir, prepared_dir, seq_len):
    """One prepared corpus serves every data.seq_len: rows that cross documents and shards, and
    documents longer than a row, equal pack_documents' (with and without a BOS)."""
    tok = get_tokenizer("byte")
    train, _ = split_documents(load_documents(corpus_dir)[0], 0.2)
    shards = open_prepared(prepared_dir, tokenizer="byte", seq_len=seq_len).train._shards
    for bos in (tok.bos_id, None):
        expected = pack_documents([tok.encode(d.data) for d in train], seq_len, bos_id=bos, eos_id=tok.eos_id,
                                  pad_id=tok.pad_id)
        got = PreparedRows([(t, s.offsets) for t, s in shards], seq_len, bos_id=bos, eos_id=tok.eos_id,
                           pad_id=tok.pad_id)
        _assert_rows_equal(got, expected)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=12), cuts=st.lists(st.integers(0, 12), max_size=4),
       seq_len=st.integers(1, 9), bos=st.booleans(), seed=st.integers(0, 2**16))
def test_rows_equal_pack_documents_over_any_sharding(lengths, cuts, seq_len, bos, seed):
    """Any documents (empty ones too: a tokenizer may give no ids), cut into shards anywhere."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in lengths]
    bounds = sorted({0, len(docs), *(min(c, len(docs)) for c in cuts)})
    shards = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs[lo:hi]])]).astype(np.int64)
        shards.append((np.concatenate([np.zeros(0, np.uint16), *docs[lo:hi]]).astype(np.uint16), offsets))
    specials = dict(bos_id=257 if bos else None, eos_id=258, pad_id=256)
    _assert_rows_equal(PreparedRows(shards, seq_len, **specials), pack_documents(docs, seq_len, **specials))


def test_iter_documents_reads_one_file_at_a_time(corpus_dir, monkeypatch):
    read = []
    real = sources_mod._read_bytes
    monkeypatch.setattr(sources_mod, "_read_bytes", lambda path: read.append(path) or real(path))
    it = sources_mod.iter_documents(corpus_dir)
    first = next(it)
    assert first.id == "doc000.txt" and len(read) == 1
    assert [d.id for d in it][-1] == "doc039.txt" and len(read) == 40


def test_token_shards_are_read_not_mapped_or_loaded(prepared_dir, tmp_path):
    # tokens are read per row with pread (a memory map put whole page-cache folios in the process's
    # resident memory, growing with the corpus); offsets stay memory-mapped, nothing is loaded
    rows = open_prepared(prepared_dir, tokenizer="byte", seq_len=16).train
    for i in range(0, len(rows), 7):
        rows[i]
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else None
    for tokens, starts in rows._shards:
        assert isinstance(tokens, prepared_mod.ShardArray)
        assert not starts.offsets.flags.owndata and isinstance(starts.offsets.base, np.memmap)
        if maps is not None:
            assert tokens.path not in maps
    # ShardArray: the .npy's data by int and slice, copies only what is asked for, pickles
    src = np.arange(1000, dtype=np.uint16)
    np.save(tmp_path / "a.npy", src)
    header = np.load(tmp_path / "a.npy", mmap_mode="r")
    arr = prepared_mod.ShardArray(tmp_path / "a.npy", np.uint16, 1000, header.offset)
    assert len(arr) == 1000 and arr.shape == (1000,) and arr[3] == 3 and arr[-1] == 999
    np.testing.assert_array_equal(arr[10:20], src[10:20])
    np.testing.assert_array_equal(arr[990:2000], src[990:])
    assert arr[5:5].shape == (0,)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(arr))[0:4], src[:4])
    with pytest.raises(IndexError):
        arr[1000]
    with pytest.raises(TypeError):
        arr[::2]
    with open(tmp_path / "a.npy", "r+b") as f:  # truncated after it was opened: an error, not short data
        f.truncate(header.offset + 100)
    with pytest.raises(DataError, match="truncated after it was opened"):
        arr[0:100]


def _tiny_hf_tokenizer(tmp_path, vocab_size=None):
    """A byte-level BPE tokenizer trained here (no download); with ``vocab_size`` above 65536, a
    word-level one whose ids need uint32."""
    d = tmp_path / "tok"
    d.mkdir()
    if vocab_size is None:
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator([" ".join(WORDS)] * 8, vocab_size=300, min_frequency=1, show_progress=False,
                                special_tokens=["<|endoftext|>"])
        (d / "tokenizer.json").write_text(tok._tokenizer.to_str())
    else:
        vocab = {"<unk>": 0, "<eos>": 1, **{w: 2 + i for i, w in enumerate(WORDS)}}
        vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (d / "tokenizer.json").write_text(tok.to_str())
    eos = "<|endoftext|>" if vocab_size is None else "<eos>"
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return str(d)


@pytest.mark.parametrize("big_vocab", [False, True])
def test_hf_tokenizer_round_trip_and_dtype(tmp_path, corpus_dir, big_vocab):
    tok_dir = _tiny_hf_tokenizer(tmp_path, 70_000 if big_vocab else None)
    out = tmp_path / "ds"
    m = prepare(corpus_dir, out, tokenizer=tok_dir, val_fraction=0.2, progress=False)
    assert m["dtype"] == ("uint32" if big_vocab else "uint16")
    assert m["tokenizer"]["identity"].startswith("sha256:")
    cfg = _cfg(corpus_dir, tokenizer=tok_dir)
    _assert_rows_equal(load_corpus(_cfg(str(out), tokenizer=tok_dir)).train, load_corpus(cfg).train)
    # encode_batch (what prepare calls) gives encode's ids, invalid UTF-8 and special-token text included
    datas = [b"alpha beta \xff\xfe gamma", "日本 🙂 <|endoftext|>".encode(), b"", "text as str"]
    for tok in (get_tokenizer(tok_dir), get_tokenizer("byte")):
        batch = tok.encode_batch(datas)
        assert len(batch) == len(datas)
        for a, b in zip(batch, [tok.encode(x) for x in datas]):
            assert a.dtype == np.int32
            np.testing.assert_array_equal(a, b)


def test_jsonl_parquet_and_hf_datasets_directory(tmp_path):
    texts = ["first record", "", "zweiter Datensatz ü", None, "third"] * 3
    table = pa.table({"content": pa.array(texts, pa.string()), "n": pa.array(range(len(texts)))})
    hf = tmp_path / "hf"
    hf.mkdir()
    for i, part in enumerate((table.slice(0, 7), table.slice(7))):  # stream format, as save_to_disk writes
        with pa.OSFile(str(hf / f"data-{i:05d}-of-00002.arrow"), "wb") as f, pa.ipc.new_stream(f, part.schema) as w:
            w.write_table(part)
    (hf / "dataset_info.json").write_text(json.dumps({"features": {"content": {"dtype": "string"}}}))
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                                                               {"filename": "data-00001-of-00002.arrow"}]}))
    docs, stats = load_documents(str(hf), "content")
    assert [d.data.decode() for d in docs] == [t for t in texts if t]
    assert docs[0].id == "data-00000-of-00002.arrow:0" and stats.empty_documents == 6
    m = prepare(str(hf), tmp_path / "ds", text_field="content", val_fraction=0.3, progress=False)
    assert m["sources"]["documents"] == 9 and len(m["sources"]["files"]) == 2
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == sum(len(d.data) for d in docs)

    # the same records as .jsonl and as .parquet in several row groups, read batch by batch: same documents
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "c.parquet", row_group_size=4)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    for name, first_id in (("c.parquet", "c.parquet:0"), ("c.jsonl", "c.jsonl:1")):
        got, _ = load_documents(str(tmp_path / name), "content")
        assert [d.data for d in got] == [d.data for d in docs] and got[0].id == first_id
    assert [d.id for d in load_documents(str(tmp_path / "c.parquet"), "content")[0]][-1] == "c.parquet:14"

    (hf / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match=r"DatasetDict .*'train', 'test'.*one split's directory"):
        load_documents(str(hf), "content")


# ----------------------------------------------------------------------------------------------- #
# per-process reading and resume                                                                    #
# ----------------------------------------------------------------------------------------------- #

class _Recorder:
    """Rows that record which indices were read."""

    def __init__(self, rows):
        self.rows, self.read = rows, []

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.rows[i]


@pytest.mark.parametrize("process_count", [2, 4])
def test_each_process_reads_only_its_rows(prepared_dir, process_count):
    cfg = _cfg(prepared_dir, batch_size=8)
    corpus = load_corpus(cfg)
    steps = 3
    whole = _take(iter(train_dataset(corpus, cfg, seed=2)), steps)
    index = {corpus.train[i]["tokens"].tobytes() + corpus.train[i]["targets"].tobytes(): i
             for i in range(len(corpus.train))}
    reads = []
    for p in range(process_count):
        rec = _Recorder(corpus.train)
        local = Corpus(tokenizer=corpus.tokenizer, train=rec, val=corpus.val, stats=corpus.stats)
        got = _take(iter(train_dataset(local, cfg, seed=2, process_index=p, process_count=process_count)), steps)
        lo, hi = p * 8 // process_count, (p + 1) * 8 // process_count
        for k in range(steps):
            for key in ROW_KEYS:
                np.testing.assert_array_equal(got[k][key], whole[k][key][lo:hi])
        # read only its rows (grain may read ahead whole batches, never another process's rows)
        wanted = {index[t.tobytes() + g.tobytes()] for b in whole for t, g in
                  zip(b["tokens"][lo:hi], b["targets"][lo:hi])}
        assert wanted <= set(rec.read)
        reads.append(set(rec.read))
    for p in range(process_count):
        for q in range(p):
            assert not reads[p] & reads[q], (p, q)


def test_resume_mid_epoch_equals_a_straight_run(prepared_dir):
    cfg = _cfg(prepared_dir)
    corpus = load_corpus(cfg)
    per_epoch = len(corpus.train) // 4
    straight = _take(iter(train_dataset(corpus, cfg, seed=9)), per_epoch + 4)
    it = iter(train_dataset(corpus, cfg, seed=9))
    cut = per_epoch - 2  # resume two batches before the epoch ends
    _assert_batches_equal(_take(it, cut), straight[:cut])
    state = json.loads(json.dumps(it.get_state()))
    resumed = iter(train_dataset(load_corpus(cfg), cfg, seed=9))  # a new start: corpus reopened
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 6), straight[cut:])


# ----------------------------------------------------------------------------------------------- #
# bad input                                                                                         #
# ----------------------------------------------------------------------------------------------- #

@pytest.fixture
def fresh_prepared(corpus_dir, tmp_path):
    out = tmp_path / "ds"
    prepare(corpus_dir, out, val_fraction=0.2, shard_tokens=4000, progress=False)
    return out


def _manifest(out):
    return json.loads((out / MANIFEST).read_text())


def _shard(out, key="tokens", split="train", i=0):
    return out / _manifest(out)["splits"][split]["shards"][i][key]


def test_missing_truncated_or_retyped_shard(fresh_prepared):
    out = fresh_prepared
    cfg = _cfg(str(out))
    path = _shard(out)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(DataError, match=rf"{path}: .*(truncated|bytes)"):
        load_corpus(cfg)
    path.write_bytes(data[:60])  # header only: not even the array's start
    with pytest.raises(DataError, match=rf"{path}: "):
        load_corpus(cfg)
    arr = np.frombuffer(data[128:], np.uint16)
    np.save(path, arr.astype(np.uint32))
    with pytest.raises(DataError, match=rf"{path}: dtype uint32, but .*{MANIFEST} says uint16"):
        load_corpus(cfg)
    path.unlink()
    with pytest.raises(DataError, match=rf"{path}: missing"):
        load_corpus(cfg)
    path.write_bytes(data)
    offsets = _shard(out, "offsets", "val")
    o = np.load(offsets)
    o[1], o[2] = o[2], o[1]
    np.save(offsets, o)
    with pytest.raises(DataError, match=rf"{offsets}: corrupt document offsets"):
        load_corpus(cfg)


def test_truncated_shard_names_its_sizes_and_the_prepare_command(fresh_prepared, corpus_dir):
    """A newcomer's finding: a truncated token shard gave numpy's raw "mmap length is greater than file
    size" and advice with a placeholder SOURCE. Now: the file, its size and the expected one, and the
    command that prepared it (from the manifest), with or without the manifest's record of sizes."""
    out = fresh_prepared
    path = _shard(out)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    command = f"moefast prepare {corpus_dir} {out} --val-fraction 0.2 --force"
    with pytest.raises(DataError) as e:
        load_corpus(_cfg(str(out)))
    assert str(e.value) == (f"{path}: truncated: {size - 10} bytes, expected {size} (recorded in {out / MANIFEST}); "
                            f"prepare it again: {command}")
    m = _manifest(out)  # a manifest without the sizes: the .npy header says what the file must hold
    for split in m["splits"].values():
        for entry in split["shards"]:
            entry.pop("tokens_bytes"), entry.pop("offsets_bytes")
    (out / MANIFEST).write_text(json.dumps(m))
    n = m["splits"]["train"]["shards"][0]["num_tokens"]
    with pytest.raises(DataError) as e:
        load_corpus(_cfg(str(out)))
    assert str(e.value) == (f"{path}: truncated: {size - 10} bytes, expected {size} ({n} uint16 values after a "
                            f"{size - 2 * n}-byte header); prepare it again: {command}")


def test_failed_prepare_removes_the_out_dir_it_created_and_marks_one_it_did_not(corpus_dir, tmp_path, capsys):
    """A newcomer's finding: a failed prepare left an empty OUT_DIR, and training on it said it "holds no
    regular non-hidden files". A failed prepare removes an OUT_DIR (and parents) it created; in one that
    existed it leaves only its in-progress marker, and training there is one error naming the command."""
    from moefast.cli import main

    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("x")  # cut fallback: 0 bytes of train, 1 of validation
    new = tmp_path / "new" / "deeper" / "ds"
    assert main(["prepare", str(one), str(new), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "training split is empty" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="training split is empty"):
        prepare(str(one), mine, force=True, progress=False)
    assert sorted(os.listdir(mine)) == [prepared_mod.IN_PROGRESS, "notes.txt"]
    assert (mine / "notes.txt").read_text() == "mine"
    for source in (str(mine), str(mine) + "/"):
        with pytest.raises(DataError) as e:
            load_corpus(_cfg(source))
        assert str(e.value) == (f"data.source={source!r}: the `moefast prepare` into {mine} did not finish "
                                f"(interrupted or failed: no {MANIFEST}); prepare it again: moefast prepare {one} "
                                f"{mine} --force")
    with pytest.raises(DataError, match="did not finish"):
        open_prepared(mine, tokenizer="byte", seq_len=16)
    prepare(corpus_dir, mine, force=True, progress=False)  # the run again: marker gone, the user's file kept
    assert sorted(os.listdir(mine)) == [MANIFEST, "notes.txt", "shards"] and is_prepared(str(mine))


def test_a_failed_force_prepare_keeps_the_dataset_it_was_to_replace(fresh_prepared, corpus_dir, monkeypatch,
                                                                     capsys):
    """A read-only OUT_DIR (simulated: root ignores permissions) or a full disk: one error naming the
    file and what to change; the dataset there, which --force was to replace, is intact."""
    from moefast.cli import main

    def files():
        return {p: p.read_bytes() for p in sorted(fresh_prepared.rglob("*")) if p.is_file()}

    before = files()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(fresh_prepared / "x"))

    monkeypatch.setattr(prepared_write.tempfile, "mkstemp", read_only)  # every JSON write: the marker first
    with pytest.raises(DataError, match=rf"{fresh_prepared / 'x'}: cannot write the prepared corpus \(Permission "
                                        r"denied\); make OUT_DIR writable"):
        prepare(corpus_dir, fresh_prepared, force=True, progress=False)
    monkeypatch.undo()
    assert files() == before
    real = prepared_write._write_json_beside
    monkeypatch.setattr(prepared_write, "_write_json_beside",  # the manifest write fails, after the shards
                        lambda path, obj: read_only() if path.name == MANIFEST else real(path, obj))
    with pytest.raises(DataError, match="cannot write the prepared corpus"):
        prepare(corpus_dir, fresh_prepared, force=True, val_fraction=0.5, progress=False)
    monkeypatch.undo()
    assert files() == before
    monkeypatch.setattr(prepared_write.np.lib.format, "open_memmap", read_only)  # a shard write fails
    assert main(["prepare", corpus_dir, str(fresh_prepared), "--force", "--no-progress"]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cannot write the prepared corpus" in err and len(err.splitlines()) == 1
    assert files() == before
    assert len(load_corpus(_cfg(str(fresh_prepared))).train) > 0


def test_manifest_from_another_tokenizer_or_version(fresh_prepared, tmp_path):
    out = fresh_prepared
    tok_dir = _tiny_hf_tokenizer(tmp_path)
    with pytest.raises(DataError, match=r"prepared with tokenizer 'byte' \(byte\), but data.tokenizer=.*tok.* is "
                                        r"sha256:"):
        load_corpus(_cfg(str(out), tokenizer=tok_dir))
    m = _manifest(out)
    m["format_version"] = 99
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match=rf"{out / MANIFEST}: format version 99, this moefast reads version 1"):
        load_corpus(_cfg(str(out)))
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match=rf"{out / MANIFEST}: cannot read it as JSON"):
        load_corpus(_cfg(str(out)))
    (out / MANIFEST).write_text(json.dumps({"something": "else"}))
    with pytest.raises(DataError, match="not a corpus written by moefast prepare"):
        load_corpus(_cfg(str(out)))


def test_empty_split(fresh_prepared, tmp_path):
    m = _manifest(fresh_prepared)
    m["splits"]["val"] = {"documents": 0, "tokens": 0, "shards": []}
    (fresh_prepared / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match=rf"{fresh_prepared / MANIFEST}: the validation split has 0 documents"):
        load_corpus(_cfg(str(fresh_prepared)))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("x")  # cut fallback: 0 bytes of train, 1 of validation
    with pytest.raises(DataError, match="training split is empty"):
        prepare(str(tmp_path / "one"), tmp_path / "out1", progress=False)
    assert not (tmp_path / "out1" / MANIFEST).exists()


def test_cut_fallback_matches_split_documents(tmp_path):
    """Too few documents to hold whole ones out (one of 2 would be 50% where 20% was asked): each is
    cut, as split_documents does."""
    src = _write_corpus(tmp_path / "two", n_files=2, seed=3)
    m = prepare(src, tmp_path / "ds", val_fraction=0.2, progress=False)
    assert m["held_out_documents"] is False and m["split"]["rule"] == "cut"
    assert "2 documents are too few to hold whole ones out" in m["split"]["note"]
    cfg = _cfg(src, val_fraction=0.2, batch_size=1, seq_len=4)
    prep = load_corpus(_cfg(str(tmp_path / "ds"), val_fraction=0.2, batch_size=1, seq_len=4))
    assert not prep.held_out_documents
    memory = load_corpus(cfg)
    _assert_rows_equal(prep.train, memory.train)
    _assert_rows_equal(prep.val, memory.val)
    for corpus in (prep, memory):  # the same warning, naming each its own data.source
        (warning,) = corpus.warnings(cfg)
        assert "has 2 documents, too few" in warning and "the last 20% of each document" in warning


def test_directory_the_hash_rule_holds_none_of_keeps_documents_whole(corpus_dir, tmp_path, capsys):
    """A newcomer's finding: a directory of .txt files prepared at the default --val-fraction 0.02
    was cut document by document (held_out_documents false), though README says documents are split
    by hash: the rule blake2b(id) < 0.02 holds out none of 39 documents 45% of the time. The 1
    document of smallest hash is held out instead, whole, in memory and prepared alike."""
    import shutil

    from moefast.cli import main
    from moefast.data.sources import id_fraction

    src = tmp_path / "src"
    shutil.copytree(corpus_dir, src, ignore=lambda d, names: ["doc026.txt"])  # the one with a hash below 0.02
    src = str(src)
    docs, _ = load_documents(src)
    assert len(docs) == 39 and min(id_fraction(d.id) for d in docs) >= 0.02  # the hash rule holds out none
    out = tmp_path / "ds"
    assert main(["prepare", src, str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert ("split: the hash rule (blake2b(id) < 0.02) held out no document of 39, so the document of smallest hash "
            "is held out instead, whole") in printed
    assert "validation 1 document /" in printed  # not "1 documents"
    m = _manifest(out)
    assert m["held_out_documents"] is True and m["split"]["rule"] == "smallest_hash"
    assert (m["splits"]["train"]["documents"], m["splits"]["val"]["documents"]) == (38, 1)
    train, val = split_documents(docs, 0.02)
    assert [d.id for d in val] == [min(docs, key=lambda d: id_fraction(d.id)).id] and len(train) == 38
    cfg = _cfg(src, val_fraction=0.02)
    prep, memory = load_corpus(_cfg(str(out), val_fraction=0.02)), load_corpus(cfg)
    assert prep.held_out_documents and memory.held_out_documents
    assert prep.warnings(cfg) == memory.warnings(cfg) == []
    _assert_rows_equal(prep.val, memory.val)
    _assert_rows_equal(prep.train, memory.train, n=5)


# ----------------------------------------------------------------------------------------------- #
# the output directory                                                                              #
# ----------------------------------------------------------------------------------------------- #

def test_refuses_a_non_empty_out_dir_unless_forced(corpus_dir, fresh_prepared, tmp_path):
    with pytest.raises(DataError, match=rf"{fresh_prepared}: not empty .*--force"):
        prepare(corpus_dir, fresh_prepared, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        prepare(corpus_dir, other, progress=False)
    assert (other / "notes.txt").read_text() == "mine" and sorted(os.listdir(other)) == ["notes.txt"]
    m = prepare(corpus_dir, fresh_prepared, val_fraction=0.5, force=True, progress=False)
    assert _manifest(fresh_prepared)["val_fraction"] == 0.5 == m["val_fraction"]
    assert sorted(os.listdir(fresh_prepared)) == [MANIFEST, "shards"]


def test_never_removes_what_a_prepare_did_not_write(corpus_dir, tmp_path):
    """A newcomer's finding: a folder holding only shards/ was taken for leftovers and removed,
    even when shards/ was the source being prepared (its files were gone, the error blamed
    permissions)."""
    import shutil

    ds = tmp_path / "ds"
    shutil.copytree(corpus_dir, ds / "shards")
    with pytest.raises(DataError, match="the source's files lie inside OUT_DIR"):
        prepare(str(ds / "shards"), ds, progress=False, force=True)
    mine = tmp_path / "mine"
    (mine / "shards" / "sub").mkdir(parents=True)
    (mine / "shards" / "a.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(DataError, match=r"shards: holds files a prepare did not write \(a.txt, sub\)"):
            prepare(corpus_dir, mine, progress=False, force=force)
    assert sorted(os.listdir(ds / "shards")) == sorted(os.listdir(corpus_dir))
    assert (mine / "shards" / "a.txt").read_text() == "mine" and (mine / "shards" / "sub").is_dir()
    with pytest.raises(DataError, match="cannot create OUT_DIR"):
        prepare(corpus_dir, tmp_path / "mine" / "shards" / "a.txt" / "out", progress=False)


def test_the_manifest_is_readable_by_others(fresh_prepared, tmp_path):
    """As any file this process creates (the umask's mode), not tempfile's 0600."""
    (tmp_path / "probe").write_text("")
    want = (tmp_path / "probe").stat().st_mode & 0o777
    assert (fresh_prepared / MANIFEST).stat().st_mode & 0o777 == want


def test_interrupted_prepare_leaves_no_dataset_and_reruns_cleanly(corpus_dir, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    real_flush, calls = prepared_write._ShardWriter.flush, []

    def failing_flush(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C inside the writer
        real_flush(self)

    monkeypatch.setattr(prepared_write._ShardWriter, "flush", failing_flush)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus_dir, out, shard_tokens=1000, progress=False)
    assert len(calls) == 3 and not out.exists()  # it created OUT_DIR: nothing of value, removed
    monkeypatch.undo()
    # a killed prepare leaves its partial directory behind: not a dataset, and a re-run removes it
    (out / ".partial-killed").mkdir(parents=True)
    (out / ".partial-killed" / "train-00000.tokens.npy").write_bytes(b"\x93NUMPY")
    assert not (out / MANIFEST).exists()
    with pytest.raises(DataError, match="`moefast prepare` into .* did not finish"):
        load_corpus(_cfg(str(out)))
    prepare(corpus_dir, out, progress=False)
    assert sorted(os.listdir(out)) == [MANIFEST, "shards"] and is_prepared(str(out))
    assert len(load_corpus(_cfg(str(out))).train) > 0


def test_cli_prepare(corpus_dir, tmp_path, capsys):
    from moefast.cli import main

    out = tmp_path / "ds"
    assert main(["prepare", corpus_dir, str(out), "--val-fraction", "0.2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "40 documents" in printed and f"data.source={out}" in printed
    assert main(["prepare", corpus_dir, str(out), "--no-progress"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["prepare", corpus_dir, str(out), "--force", "--tokenizer", "nope", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown tokenizer 'nope'" in err and "--tokenizer" in err and "data.tokenizer" not in err
    assert is_prepared(str(out))  # a failed --force run before any change leaves the dataset
    # errors name prepare's own arguments, not the run config's keys
    assert main(["prepare", str(tmp_path / "nothing-*.txt"), str(tmp_path / "ds2"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "SOURCE" in err and "data.source" not in err


def test_sigterm_cleans_up_like_ctrl_c_and_says_what_is_left(corpus_dir, tmp_path, monkeypatch, capsys):
    """A newcomer's finding: SIGTERM (timeout, Slurm, docker stop) killed prepare with 143 and left
    OUT_DIR/.partial-* and the in-progress marker. Now it is a Ctrl-C: what prepare wrote is removed,
    the message says what is left, and the exit status is still 143."""
    import signal

    from moefast.cli import main

    real_flush, calls = prepared_write._ShardWriter.flush, []

    def terminated_flush(self):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        real_flush(self)

    def unhandled(signum, frame):  # without prepare's own handler, fail the test, not the test process
        raise AssertionError("SIGTERM reached the process's handler: moefast prepare installs none")

    monkeypatch.setattr(prepared_write._ShardWriter, "flush", terminated_flush)
    handler = signal.signal(signal.SIGTERM, unhandled)
    out = tmp_path / "new" / "ds"
    try:
        _check_sigterm(main, corpus_dir, out, tmp_path, calls, capsys)
        assert signal.getsignal(signal.SIGTERM) is unhandled  # prepare restores the handler it replaced
    finally:
        signal.signal(signal.SIGTERM, handler)


def _check_sigterm(main, corpus_dir, out, tmp_path, calls, capsys):
    assert main(["prepare", corpus_dir, str(out), "--no-progress"]) == 143
    assert not (tmp_path / "new").exists() and len(calls) == 2
    assert capsys.readouterr().err == f"interrupted (SIGTERM): removed {out}\n"
    existing = tmp_path / "existing"
    existing.mkdir()
    calls.clear()
    assert main(["prepare", corpus_dir, str(existing), "--no-progress"]) == 143
    assert sorted(os.listdir(existing)) == [".prepare-in-progress.json"]  # no .partial-*
    assert capsys.readouterr().err.startswith(f"interrupted (SIGTERM): left {existing / '.prepare-in-progress.json'}")


def test_a_chats_jsonl_prepared_as_text_points_to_format_sft(tmp_path, capsys):
    from moefast.cli import main

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["prepare", str(chats), str(tmp_path / "ds"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no field 'text' (fields: ['messages'])" in err and "for conversations use --format sft" in err, err
    assert "set --text-field to the field" in err and "data.text_field" not in err and "data.format" not in err, err


def test_corpus_identity_is_kept_by_the_same_files_and_changed_by_other_ones(corpus_dir, tmp_path):
    """What a run records of its prepared corpus (a resume refuses another: tests/train/test_run_identity.py):
    the same texts prepared again (--force), also copied elsewhere with other mtimes, keep it; a
    changed file gives another."""
    import shutil

    from moefast.data.prepared import corpus_identity

    src = tmp_path / "src"
    shutil.copytree(corpus_dir, src)
    out = tmp_path / "ds"
    first = corpus_identity(prepare(str(src), out, val_fraction=0.2, progress=False))
    assert load_corpus(_cfg(str(out))).prepared_identity == first
    assert load_corpus(_cfg(str(src))).prepared_identity is None  # not prepared: nothing to record
    assert corpus_identity(prepare(str(src), out, val_fraction=0.2, force=True, progress=False)) == first
    # the same texts from another place, with other mtimes: the shards are the same, so is the corpus
    moved = tmp_path / "elsewhere"
    shutil.copytree(src, moved)
    for f in moved.iterdir():
        os.utime(f, (1e9, 1e9))
    assert corpus_identity(prepare(str(moved), out, val_fraction=0.2, force=True, progress=False)) == first
    (src / "doc003.txt").write_text("another text altogether")
    assert corpus_identity(prepare(str(src), out, val_fraction=0.2, force=True, progress=False)) != first
    assert load_corpus(_cfg(str(out))).prepared_identity != first
