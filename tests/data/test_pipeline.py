"""load_corpus, train_dataset (determinism, resume, sharding) and eval_batches."""

import json
import math
import time

import grain
import numpy as np
import pytest

from moefast.config import DataConfig
from moefast.data import (ROW_KEYS, ByteTokenizer, Corpus, DataError, SourceStats, eval_batches,
                          load_corpus, pack_documents, train_dataset)
from moefast.data import pipeline as pipeline_mod

TOK = ByteTokenizer()


def _text_corpus(tmp_path, n_files=40, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n_files):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "λx", "\n", "def f():"], rng.integers(5, 60))
        (tmp_path / f"doc{i:03d}.txt").write_text(" ".join(words) + f" #{i}")
    return str(tmp_path)


def _synthetic_corpus(train_rows=24, val_rows=5, seq_len=8, seed=0):
    """A corpus with an exact number of rows, each row's tokens unique (random bytes)."""
    rng = np.random.default_rng(seed)

    def rows(n):  # one document of n*T - 1 tokens -> L - 1 = n*T targets -> exactly n rows
        return pack_documents([rng.integers(0, 256, n * seq_len - 1)], seq_len,
                              bos_id=TOK.bos_id, eos_id=TOK.eos_id, pad_id=TOK.pad_id)

    corpus = Corpus(tokenizer=TOK, train=rows(train_rows), val=rows(val_rows), stats=SourceStats(documents=2))
    assert (len(corpus.train), len(corpus.val)) == (train_rows, val_rows)
    return corpus


def _row_ids(corpus_rows, batch):
    """Maps each row of a batch back to its index in the packed rows (rows are unique)."""
    index = {corpus_rows[i]["tokens"].tobytes(): i for i in range(len(corpus_rows))}
    assert len(index) == len(corpus_rows)
    return [index[t.tobytes()] for t in batch["tokens"]]


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y) == set(ROW_KEYS)
        for k in ROW_KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_load_corpus_small_directory(tmp_path):
    cfg = DataConfig(source=_text_corpus(tmp_path), seq_len=16, batch_size=4, val_fraction=0.2)
    corpus = load_corpus(cfg)
    assert corpus.tokenizer.vocab_size == 259
    assert len(corpus.train) >= 4 and len(corpus.val) >= 1
    assert corpus.stats.documents == 40
    assert corpus.train.num_tokens + corpus.val.num_tokens == corpus.stats.bytes + 2 * 40
    s = corpus.summary()
    assert "40 documents" in s and f"train {len(corpus.train)} rows" in s and f"val {len(corpus.val)} rows" in s


def test_load_corpus_too_small(tmp_path, monkeypatch):
    (tmp_path / "tiny.txt").write_text("just a few bytes")
    with pytest.raises(DataError, match=r"1 document .*data.batch_size=64"):
        load_corpus(DataConfig(source=str(tmp_path), seq_len=16, batch_size=64))
    monkeypatch.setattr(pipeline_mod, "split_documents", lambda docs, f: (docs, []))
    with pytest.raises(DataError, match="validation split is empty.*data.val_fraction"):
        load_corpus(DataConfig(source=str(tmp_path), seq_len=4, batch_size=1))


def test_stdlib_corpus_loads():
    start = time.perf_counter()
    corpus = load_corpus(DataConfig())
    elapsed = time.perf_counter() - start
    assert len(corpus.train) > 10_000 and len(corpus.val) > 8, corpus.summary()
    print(f"stdlib load_corpus: {elapsed:.2f} s; {corpus.summary()}")


def test_train_batches_shapes_and_seed_determinism(tmp_path):
    cfg = DataConfig(source=_text_corpus(tmp_path), seq_len=16, batch_size=4, val_fraction=0.2)
    corpus = load_corpus(cfg)
    ds = train_dataset(corpus, cfg, seed=7)
    assert isinstance(ds, grain.IterDataset)
    a = _take(iter(ds), 6)
    b = _take(iter(train_dataset(corpus, cfg, seed=7)), 6)
    c = _take(iter(train_dataset(corpus, cfg, seed=8)), 6)
    for batch in a:
        for k in ROW_KEYS:
            assert batch[k].shape == (4, 16), k
            assert batch[k].dtype == (np.float32 if k == "loss_weight" else np.int32), k
    _assert_batches_equal(a, b)
    assert any(not np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))


def test_epochs_cover_rows_and_reshuffle():
    corpus = _synthetic_corpus(train_rows=24)
    cfg = DataConfig(seq_len=8, batch_size=4)
    it = iter(train_dataset(corpus, cfg, seed=0))
    epochs = [[r for batch in _take(it, 6) for r in _row_ids(corpus.train, batch)] for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(24))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert epochs[0] != list(range(24))


def test_exact_resume_through_json():
    corpus = _synthetic_corpus(train_rows=24)
    cfg = DataConfig(seq_len=8, batch_size=4)
    ds = train_dataset(corpus, cfg, seed=3)
    it = iter(ds)
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 5)  # crosses the epoch boundary after batch 6
    resumed = iter(train_dataset(corpus, cfg, seed=3))
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 5), expected)
    fresh = _take(iter(ds), 5)
    assert any(not np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(fresh, expected))


@pytest.mark.parametrize("batch_size, process_count", [(4, 2), (6, 3), (4, 4)])
def test_process_slices_make_up_the_single_process_batches(batch_size, process_count):
    corpus = _synthetic_corpus(train_rows=24)
    cfg = DataConfig(seq_len=8, batch_size=batch_size)
    local = batch_size // process_count
    steps = 24 // batch_size + 2  # more than one epoch
    whole = _take(iter(train_dataset(corpus, cfg, seed=1)), steps)
    parts = [_take(iter(train_dataset(corpus, cfg, seed=1, process_index=p, process_count=process_count)), steps)
             for p in range(process_count)]
    for k in range(steps):
        assert all(parts[p][k]["tokens"].shape == (local, 8) for p in range(process_count))
        for key in ROW_KEYS:
            np.testing.assert_array_equal(np.concatenate([parts[p][k][key] for p in range(process_count)]),
                                          whole[k][key])
        shards = [set(_row_ids(corpus.train, parts[p][k])) for p in range(process_count)]
        assert len(set().union(*shards)) == batch_size  # disjoint within a step
    epoch = {r for bt in whole[: 24 // batch_size] for r in _row_ids(corpus.train, bt)}
    assert epoch == set(range(24))


def test_train_dataset_bad_arguments():
    corpus = _synthetic_corpus(train_rows=24)
    with pytest.raises(DataError, match="data.batch_size=6.*multiple of 4"):
        train_dataset(corpus, DataConfig(seq_len=8, batch_size=6), seed=0, process_count=4)
    with pytest.raises(DataError, match="process_index"):
        train_dataset(corpus, DataConfig(seq_len=8, batch_size=4), seed=0, process_index=2, process_count=2)
    with pytest.raises(DataError, match="fewer than one global batch"):
        train_dataset(corpus, DataConfig(seq_len=8, batch_size=32), seed=0)
    with pytest.raises(DataError, match="seed"):
        train_dataset(corpus, DataConfig(seq_len=8, batch_size=4), seed=-1)


def test_eval_batches_fixed_order():
    corpus = _synthetic_corpus(val_rows=13)
    cfg = DataConfig(seq_len=8, batch_size=4)
    batches = eval_batches(corpus, cfg, 3)
    assert len(batches) == 3
    _assert_batches_equal(batches, eval_batches(corpus, cfg, 3))
    for k, bt in enumerate(batches):
        for key in ROW_KEYS:
            np.testing.assert_array_equal(bt[key], np.stack([corpus.val[k * 4 + j][key] for j in range(4)]))


def test_eval_batches_pads_when_short():
    corpus = _synthetic_corpus(val_rows=5)
    cfg = DataConfig(seq_len=8, batch_size=4)
    batches = eval_batches(corpus, cfg, 8)
    assert len(batches) == math.ceil(5 / 4) == 2
    last = batches[1]
    np.testing.assert_array_equal(last["tokens"][0], corpus.val[4]["tokens"])
    assert (last["tokens"][1:] == TOK.pad_id).all() and (last["targets"][1:] == TOK.pad_id).all()
    assert (last["loss_weight"][1:] == 0).all() and (last["segment_ids"][1:] == 0).all()
    assert last["loss_weight"][0].sum() > 0
    one = eval_batches(_synthetic_corpus(val_rows=1), DataConfig(seq_len=8, batch_size=4), 2)
    assert len(one) == 1 and one[0]["loss_weight"][1:].sum() == 0 and one[0]["loss_weight"][0].sum() > 0


def test_eval_batches_per_process_slices_the_global_batch():
    corpus = _synthetic_corpus(val_rows=7)
    cfg = DataConfig(seq_len=8, batch_size=4)
    whole = eval_batches(corpus, cfg, 2)
    parts = [eval_batches(corpus, cfg, 2, process_index=p, process_count=2) for p in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole) == 2
    for k in range(2):
        for key in ROW_KEYS:
            np.testing.assert_array_equal(np.concatenate([parts[0][k][key], parts[1][k][key]]), whole[k][key])
    with pytest.raises(DataError, match="num|>= 1"):
        eval_batches(corpus, cfg, 0)
