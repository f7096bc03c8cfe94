"""ByteTokenizer: round trip, special ids, bytes per token, and the name registry."""

import numpy as np
import pytest

from moefast.data import ByteTokenizer, DataError, Tokenizer, get_tokenizer


def test_round_trip_text_and_bytes():
    tok = ByteTokenizer()
    text = "héllo, wörld — λ 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
    assert tok.decode(ids) == text
    raw = bytes(range(256))
    np.testing.assert_array_equal(tok.encode(raw), np.arange(256))
    assert tok.encode("").shape == (0,)


def test_special_ids_and_decode_skips_them():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)
    ids = tok.encode("abc")
    assert not np.isin(ids, [tok.pad_id, tok.bos_id, tok.eos_id]).any()
    wrapped = np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id, tok.pad_id]])
    assert tok.decode(wrapped) == "abc"
    assert tok.decode(wrapped.tolist()) == "abc"


def test_decode_replaces_invalid_utf8_and_rejects_bad_ids():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(b"a\xffb")) == "a\ufffdb"
    with pytest.raises(DataError, match="259"):
        tok.decode([97, 259])
    with pytest.raises(DataError, match="-1"):
        tok.decode([-1])


def test_bytes_per_token_counts_utf8_bytes():
    tok = ByteTokenizer()
    bpt = tok.bytes_per_token
    assert bpt.shape == (259,) and bpt.dtype == np.int32
    np.testing.assert_array_equal(bpt[:256], 1)
    np.testing.assert_array_equal(bpt[[256, 257, 258]], 0)
    text = "añ€🙂"
    ids = np.concatenate([[tok.bos_id], tok.encode(text), [tok.eos_id]])
    assert bpt[ids].sum() == len(text.encode("utf-8")) == 10


def test_get_tokenizer():
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match=r"gpt2.*\['byte'\]"):
        get_tokenizer("gpt2")


def test_tokenizer_is_an_abstract_interface():
    with pytest.raises(TypeError):
        Tokenizer()
