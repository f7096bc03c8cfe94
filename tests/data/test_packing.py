"""pack_documents / PackedRows: exact rows for hand-built documents and stream-level laws."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moefast.data import ROW_KEYS, DataError, PackedRows, pack_documents

PAD, BOS, EOS = 256, 257, 258
SPECIALS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)
b, e, p = BOS, EOS, PAD


def _pack(docs, seq_len):
    return pack_documents([np.asarray(d, np.int32) for d in docs], seq_len, **SPECIALS)


def _assert_row(row, **expected):
    assert set(row) == set(ROW_KEYS)
    for key, want in expected.items():
        want = np.asarray(want, np.float32 if key == "loss_weight" else np.int32)
        assert row[key].dtype == want.dtype, key
        np.testing.assert_array_equal(row[key], want, err_msg=key)


def test_two_short_documents():
    rows = _pack([[1, 2], [3]], seq_len=4)  # stream: b 1 2 e b 3 e
    assert len(rows) == 2 and rows.num_tokens == 7
    _assert_row(rows[0], tokens=[b, 1, 2, e], targets=[1, 2, e, b], segment_ids=[1, 1, 1, 1],
                positions=[0, 1, 2, 3], loss_weight=[1, 1, 1, 0])
    _assert_row(rows[1], tokens=[b, 3, e, p], targets=[3, e, p, p], segment_ids=[1, 1, 1, 0],
                positions=[0, 1, 2, 0], loss_weight=[1, 1, 0, 0])


def test_document_spanning_rows_restarts_positions():
    rows = _pack([[10, 11, 12, 13, 14, 15], [20]], seq_len=3)  # b 10 11 12 13 14 15 e b 20 e
    assert len(rows) == 4
    _assert_row(rows[0], tokens=[b, 10, 11], targets=[10, 11, 12], segment_ids=[1, 1, 1],
                positions=[0, 1, 2], loss_weight=[1, 1, 1])
    _assert_row(rows[1], tokens=[12, 13, 14], targets=[13, 14, 15], segment_ids=[1, 1, 1],
                positions=[0, 1, 2], loss_weight=[1, 1, 1])
    _assert_row(rows[2], tokens=[15, e, b], targets=[e, b, 20], segment_ids=[1, 1, 2],
                positions=[0, 1, 0], loss_weight=[1, 0, 1])
    _assert_row(rows[3], tokens=[20, e, p], targets=[e, p, p], segment_ids=[1, 1, 0],
                positions=[0, 1, 0], loss_weight=[1, 0, 0])
    _assert_row(rows[-1], tokens=[20, e, p])


def test_three_documents_in_one_row_and_an_empty_document():
    rows = _pack([[5], [], [6, 7]], seq_len=8)  # b 5 e b e b 6 7 e
    assert len(rows) == 1
    _assert_row(rows[0], tokens=[b, 5, e, b, e, b, 6, 7], targets=[5, e, b, e, b, 6, 7, e],
                segment_ids=[1, 1, 1, 2, 2, 3, 3, 3], positions=[0, 1, 2, 0, 1, 0, 1, 2],
                loss_weight=[1, 1, 0, 1, 0, 1, 1, 1])


def test_exact_fit_has_no_padding_row_and_index_errors():
    rows = _pack([[1, 2, 3]], seq_len=4)  # b 1 2 3 e: L - 1 = 4 targets = one full row
    assert len(rows) == 1
    _assert_row(rows[0], tokens=[b, 1, 2, 3], targets=[1, 2, 3, e], loss_weight=[1, 1, 1, 1])
    with pytest.raises(IndexError):
        rows[1]
    assert len(_pack([], seq_len=4)) == 0
    pad = rows.padding_row()
    _assert_row(pad, tokens=[p] * 4, targets=[p] * 4, segment_ids=[0] * 4, positions=[0] * 4,
                loss_weight=[0] * 4)


def test_bad_arguments():
    with pytest.raises(DataError, match="seq_len"):
        _pack([[1]], seq_len=0)
    with pytest.raises(DataError, match="distinct"):
        pack_documents([np.array([1])], 4, bos_id=1, eos_id=1, pad_id=0)
    with pytest.raises(DataError, match="document 0"):
        pack_documents([np.zeros((2, 2), np.int32)], 4, **SPECIALS)


def _reference(docs):
    """Stream and document index per stream position, built by a plain loop."""
    stream, doc_of = [], []
    for i, d in enumerate(docs):
        piece = [BOS, *d, EOS]
        stream += piece
        doc_of += [i] * len(piece)
    return np.array(stream), np.array(doc_of)


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=8), seq_len=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_rows_cover_the_stream_once(lengths, seq_len, seed):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, n) for n in lengths]
    rows = _pack(docs, seq_len)
    stream, doc_of = _reference(docs)
    L = len(stream)
    assert len(rows) == -(-(L - 1) // seq_len)
    seen = np.zeros(L, np.int64)
    for r in range(len(rows)):
        row = rows[r]
        for key in ROW_KEYS:
            assert row[key].shape == (seq_len,), key
        tok, tgt, seg, pos, w = (row[k] for k in ROW_KEYS)
        assert ((pos >= 0) & (pos < seq_len)).all()
        prev_pos = prev_seg = None
        for c in range(seq_len):
            i = r * seq_len + c  # stream index of the input token; its target is i + 1
            if i < L:
                assert tok[c] == stream[i]
            else:
                assert (tok[c], seg[c], pos[c], w[c]) == (PAD, 0, 0, 0)
            if i + 1 < L:
                assert tgt[c] == stream[i + 1]
                seen[i + 1] += 1
                assert w[c] == float(doc_of[i] == doc_of[i + 1])  # 0 exactly at EOS -> BOS
            else:
                assert tgt[c] == PAD and w[c] == 0
            if i < L:  # segments: start at 1, change exactly at BOS; positions count from there
                if c == 0:
                    assert seg[c] == 1 and pos[c] == 0
                elif tok[c] == BOS:
                    assert seg[c] == prev_seg + 1 and pos[c] == 0
                else:
                    assert seg[c] == prev_seg and pos[c] == prev_pos + 1
                prev_seg, prev_pos = seg[c], pos[c]
        # No attention across documents: equal segment id <=> same document.
        real = np.arange(r * seq_len, r * seq_len + seq_len)
        real = real[real < L]
        same_seg = seg[: len(real)][:, None] == seg[: len(real)][None, :]
        same_doc = doc_of[real][:, None] == doc_of[real][None, :]
        np.testing.assert_array_equal(same_seg, same_doc)
    np.testing.assert_array_equal(seen[1:], 1)  # every target once
    total_weight = sum(rows[r]["loss_weight"].sum() for r in range(len(rows)))
    assert total_weight == sum(n + 1 for n in lengths)  # BOS->t0 ... t_last->EOS per document


def test_rows_are_not_materialised():
    docs = [np.full(1000, 7, np.int32)] * 100
    rows = _pack(docs, seq_len=16)
    assert isinstance(rows, PackedRows)
    held = [v for v in vars(rows).values() if isinstance(v, np.ndarray)]
    assert sum(a.size for a in held) <= rows.num_tokens + rows.num_documents


def test_no_bos_and_pad_equal_to_eos():
    # stream: 1 2 e 3 e (no BOS); PAD is EOS, yet the EOS targets keep their weight
    rows = pack_documents([np.array([1, 2], np.int32), np.array([3], np.int32)], 3, bos_id=None, eos_id=EOS,
                          pad_id=EOS)
    assert len(rows) == 2 and rows.num_tokens == 5
    _assert_row(rows[0], tokens=[1, 2, e], targets=[2, e, 3], segment_ids=[1, 1, 1], positions=[0, 1, 2],
                loss_weight=[1, 1, 0])
    _assert_row(rows[1], tokens=[3, e, e], targets=[e, e, e], segment_ids=[1, 1, 0], positions=[0, 1, 0],
                loss_weight=[1, 0, 0])
    empty = pack_documents([np.zeros((0,), np.int32)] * 2, 4, bos_id=None, eos_id=EOS, pad_id=PAD)  # e e
    _assert_row(empty[0], tokens=[e, e, p, p], segment_ids=[1, 2, 0, 0], loss_weight=[0, 0, 0, 0])
    with pytest.raises(DataError, match="distinct"):
        pack_documents([np.array([1])], 4, bos_id=PAD, eos_id=EOS, pad_id=PAD)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=6), seq_len=st.integers(1, 9),
       pad_is_eos=st.booleans(), seed=st.integers(0, 2**16))
def test_rows_without_bos_cover_the_stream_once(lengths, seq_len, pad_is_eos, seed):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, n) for n in lengths]
    rows = pack_documents(docs, seq_len, bos_id=None, eos_id=EOS, pad_id=EOS if pad_is_eos else PAD)
    stream = np.concatenate([np.r_[d, EOS] for d in docs]).astype(np.int32)
    doc_of = np.concatenate([np.full(len(d) + 1, i) for i, d in enumerate(docs)])
    np.testing.assert_array_equal(rows.stream, stream)
    L = len(stream)
    assert len(rows) == -(-(L - 1) // seq_len)
    tok, tgt, w = (np.concatenate([np.zeros((0,)), *(rows[r][k] for r in range(len(rows)))])
                   for k in ("tokens", "targets", "loss_weight"))
    np.testing.assert_array_equal(tok[: L - 1], stream[:-1])
    np.testing.assert_array_equal(tgt[: L - 1], stream[1:])  # every target once
    np.testing.assert_array_equal(w[: L - 1], doc_of[:-1] == doc_of[1:])  # 0 exactly at EOS -> next document
    assert not w[L - 1:].any()
    assert w.sum() == sum(lengths)  # t0 -> t1 ... t_last -> EOS per document: its first token is no target
