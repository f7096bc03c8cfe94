"""HFTokenizer: special-token resolution, round trips, bytes per token, packing and generation with
tiny tokenizers trained here (offline) in the two common families: byte-level BPE (GPT-2/Qwen/OLMoE
style, no BOS) and SentencePiece-style BPE (Metaspace ``▁`` + byte fallback, ``<s>`` prepended by a
TemplateProcessing post-processor, as Llama/Mixtral)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (ByteLevelBPETokenizer, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

from moefast.config import DataConfig, load_config
from moefast.data import (DataError, HFTokenizer, get_tokenizer, load_corpus, load_documents, pack_documents,
                          split_documents)
from moefast.train import ModelDef, generate

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "def f(x):\n    return x * 2  # double it\n",
    "héllo wörld, naïve café — λx. x",
    "mixture of experts routes each token to the top k experts",
    "tokens per expert, capacity factor, aux loss and z loss",
] * 4
# Non-ASCII the training text has and has not seen (the SentencePiece-style one falls back to bytes).
TEXTS = ["héllo wörld", "the lazy dog\n\tdef g(y): return y", "日本語のテキスト 🙂 ok", "a  b   c", "x",
         "Ω≈ç√ ∫˜µ≤"]
SP_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def _byte_level_json() -> str:
    tok = ByteLevelBPETokenizer()  # ByteLevel pre-tokenizer (no prefix space) and decoder
    tok.train_from_iterator(SENTENCES, vocab_size=320, min_frequency=1, show_progress=False,
                            special_tokens=["<|endoftext|>", "<|padding|>"])
    return tok._tokenizer.to_str()


def _sentencepiece_json(bos_template: bool, prepend_scheme: str = "always", llama2_style: bool = False,
                        eos_template: bool = False) -> str:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if llama2_style:  # Llama 2's tokenizer.json: no pre-tokenizer, Prepend + Replace normalizers
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
        tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme),
                                         decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=200, special_tokens=SP_SPECIALS,
                                                           show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # SentencePiece keeps the 256 byte pieces in the vocabulary
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    if bos_template or eos_template:
        single = ("<s> " if bos_template else "") + "$A" + (" </s>" if eos_template else "")
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B", special_tokens=[(t, tok.token_to_id(t)) for t in ("<s>", "</s>")])
    return tok.to_str()


BYTE_LEVEL = _byte_level_json()
SENTENCEPIECE = _sentencepiece_json(bos_template=True)


def _save(directory, tokenizer_json: str, **files) -> str:
    """Writes tokenizer.json and ``files`` (``tokenizer_config={...}`` -> tokenizer_config.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json)
    for name, obj in files.items():
        (directory / f"{name}.json").write_text(json.dumps(obj))
    return str(directory)


@pytest.fixture
def byte_level(tmp_path):
    return HFTokenizer(_save(tmp_path / "bl", BYTE_LEVEL, tokenizer_config={"eos_token": "<|endoftext|>"}))


@pytest.fixture
def sentencepiece(tmp_path):
    return HFTokenizer(_save(tmp_path / "sp", SENTENCEPIECE, tokenizer_config={"eos_token": "</s>",
                                                                             "pad_token": "<pad>"}))


def test_round_trip_and_ids(byte_level, sentencepiece):
    for tok in (byte_level, sentencepiece):
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids.dtype == np.int32 and ids.ndim == 1 and ids.size
            assert ((ids >= 0) & (ids < tok.vocab_size)).all()
            assert not np.isin(ids, tok.special_ids).any()
            assert tok.decode(ids) == tok.decode(ids.tolist()) == text
            np.testing.assert_array_equal(tok.encode(text.encode("utf-8")), ids)
        assert tok.encode("").shape == (0,)
        assert tok.decode(tok.encode(b"a\xffb")) == "a\ufffdb"
        # special tokens' text in a document is plain text, never a control token
        ids = tok.encode("<s></s><|endoftext|><pad>")
        assert not np.isin(ids, tok.special_ids).any() and tok.decode(ids) == "<s></s><|endoftext|><pad>"
        wrapped = np.concatenate([[i] for i in tok.special_ids] + [tok.encode("héllo"), [tok.eos_id, tok.pad_id]])
        assert tok.decode(wrapped) == "héllo"
        with pytest.raises(DataError, match=str(tok.vocab_size)):
            tok.decode([0, tok.vocab_size])
        with pytest.raises(DataError, match="-1"):
            tok.decode([-1])
    # the SentencePiece-style one falls back to bytes for what it never saw
    pieces = [sentencepiece._tok.id_to_token(int(i)) for i in sentencepiece.encode("日")]
    assert pieces[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    with pytest.raises(TypeError):
        byte_level.encode(123)


def test_special_ids(byte_level, sentencepiece):
    assert byte_level.bos_id is None  # no post-processor BOS, no add_bos_token
    assert byte_level.eos_id == byte_level.pad_id == byte_level._tok.token_to_id("<|endoftext|>")
    assert byte_level.special_ids == (byte_level.eos_id,)
    assert byte_level.vocab_size == byte_level._tok.get_vocab_size(with_added_tokens=True) == 320
    t = sentencepiece._tok.token_to_id
    assert (sentencepiece.bos_id, sentencepiece.eos_id, sentencepiece.pad_id) == (t("<s>"), t("</s>"), t("<pad>"))
    assert sentencepiece.special_ids == (t("<pad>"), t("<s>"), t("</s>"))


def test_bos_from_post_processor_or_config(tmp_path):
    no_template = _sentencepiece_json(bos_template=False)
    s = Tokenizer.from_str(SENTENCEPIECE).token_to_id("<s>")
    cases = [  # (tokenizer.json, tokenizer_config.json, expected BOS)
        (SENTENCEPIECE, {"eos_token": "</s>"}, s),
        (no_template, {"eos_token": "</s>"}, None),
        (no_template, {"eos_token": "</s>", "bos_token": "<s>"}, None),  # a bos_token alone adds nothing
        (no_template, {"eos_token": "</s>", "bos_token": {"content": "<s>"}, "add_bos_token": True}, s),
        (SENTENCEPIECE, {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False}, s),  # the template decides
    ]
    for i, (spec, cfg, bos) in enumerate(cases):
        tok = HFTokenizer(_save(tmp_path / str(i), spec, tokenizer_config=cfg))
        assert tok.bos_id == bos, (i, cfg)
    with pytest.raises(DataError, match="add_bos_token is true but no bos_token"):
        HFTokenizer(_save(tmp_path / "x", no_template, tokenizer_config={"eos_token": "</s>", "add_bos_token": True}))
    with pytest.raises(DataError, match="BOS and EOS are the same.*add_bos_token"):
        HFTokenizer(_save(tmp_path / "y", BYTE_LEVEL, tokenizer_config={
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": True}))


def test_a_bos_token_alone_is_no_bos_as_in_transformers(tmp_path, capsys):
    """A newcomer's finding: tokenizer_config.json set bos_token, yet the prepared manifest said bos_id
    null. That is right: nothing adds that token (no post-processor BOS, no add_bos_token), and
    transformers encodes the tokenizer without it; README now says so, and prepare says why."""
    from moefast.cli import main

    path = _save(tmp_path / "tok", _sentencepiece_json(bos_template=False),
                 tokenizer_config={"eos_token": "</s>", "bos_token": "<s>"})
    tok = HFTokenizer(path)
    assert tok.bos_id is None and tok.unused_bos_token == "<s>"
    with_bos = HFTokenizer(_save(tmp_path / "tok2", SENTENCEPIECE,
                                 tokenizer_config={"eos_token": "</s>", "bos_token": "<s>"}))
    assert with_bos.bos_id is not None and with_bos.unused_bos_token is None
    gpt2 = HFTokenizer(_save(tmp_path / "gpt2", BYTE_LEVEL, tokenizer_config={"bos_token": "<|endoftext|>",
                                                                             "eos_token": "<|endoftext|>"}))
    assert gpt2.bos_id is None and gpt2.unused_bos_token is None  # the EOS could not be a BOS: nothing to say
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(" ".join(SENTENCES))
    assert main(["prepare", str(tmp_path / "src"), str(tmp_path / "ds"), "--tokenizer", path, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "note: the tokenizer's config names bos_token '<s>', but neither its post-processor nor" in out
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["tokenizer"]["bos_id"] is None
    transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text).tolist(), text  # no BOS from transformers either


def test_eos_and_pad_resolution_order(tmp_path):
    bl = Tokenizer.from_str(BYTE_LEVEL)
    eot, padding = bl.token_to_id("<|endoftext|>"), bl.token_to_id("<|padding|>")
    cases = [  # (files, expected EOS, expected PAD)
        (dict(tokenizer_config={"eos_token": "<|padding|>", "pad_token": "<|endoftext|>"},
              config={"eos_token_id": 7, "pad_token_id": 8}), padding, eot),
        (dict(special_tokens_map={"eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|padding|>"}), eot, padding),
        (dict(tokenizer_config={"eos_token": None}, config={"eos_token_id": 5, "pad_token_id": 6},
              generation_config={"eos_token_id": 9, "pad_token_id": 10}), 5, 6),
        (dict(config={"eos_token_id": None}, generation_config={"eos_token_id": [9, 4], "pad_token_id": 10}), 9, 10),
        (dict(generation_config={"eos_token_id": eot}), eot, eot),  # no PAD anywhere: EOS
    ]
    for i, (files, eos, pad) in enumerate(cases):
        tok = HFTokenizer(_save(tmp_path / str(i), BYTE_LEVEL, **files))
        assert (tok.eos_id, tok.pad_id, tok.bos_id) == (eos, pad, None), (i, files)
    # an EOS the post-processor appends wins over the config's
    sp = _sentencepiece_json(bos_template=True, eos_template=True)
    tok = HFTokenizer(_save(tmp_path / "appended", sp, tokenizer_config={"eos_token": "<pad>"}))
    assert tok.eos_id == Tokenizer.from_str(sp).token_to_id("</s>") and tok.bos_id is not None
    # a PAD equal to BOS would look like a document start: EOS instead
    tok = HFTokenizer(_save(tmp_path / "padbos", SENTENCEPIECE, tokenizer_config={"eos_token": "</s>",
                                                                                 "pad_token": "<s>"}))
    assert tok.pad_id == tok.eos_id != tok.bos_id


def test_errors_name_the_files(tmp_path):
    with pytest.raises(DataError, match=r"no EOS.*tokenizer_config\.json.*special_tokens_map\.json.*config\.json"
                                        r".*generation_config\.json"):
        HFTokenizer(_save(tmp_path / "noeos", BYTE_LEVEL, config={"pad_token_id": 1}))
    with pytest.raises(DataError, match="eos_token '<eos>' is not in the vocabulary"):
        HFTokenizer(_save(tmp_path / "unknown", BYTE_LEVEL, tokenizer_config={"eos_token": "<eos>"}))
    with pytest.raises(DataError, match=r"config\.json: eos_token_id=1000000 is outside"):
        HFTokenizer(_save(tmp_path / "range", BYTE_LEVEL, config={"eos_token_id": 10**6}))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer file"):
        HFTokenizer(tmp_path / "bad")
    (tmp_path / "bad" / "tokenizer.json").write_text(BYTE_LEVEL)
    (tmp_path / "bad" / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(DataError, match="expected a JSON object"):
        HFTokenizer(tmp_path / "bad")
    with pytest.raises(DataError, match="no tokenizer.json at"):
        HFTokenizer(tmp_path)


def test_get_tokenizer_and_config(tmp_path):
    d = _save(tmp_path / "tok", BYTE_LEVEL, tokenizer_config={"eos_token": "<|endoftext|>"})
    for path in (d, f"{d}/tokenizer.json"):
        tok = get_tokenizer(path)
        assert isinstance(tok, HFTokenizer) and tok.eos_id == 0 and tok.path == f"{d}/tokenizer.json"
    assert DataConfig(tokenizer=d).tokenizer == d
    assert load_config(None, [f"data.tokenizer={d}"]).data.tokenizer == d
    with pytest.raises(DataError, match=r"data\.tokenizer.*'/no/such/dir'.*\['byte'\].*tokenizer\.json"):
        get_tokenizer("/no/such/dir")


def test_bytes_per_token_marks_specials_and_byte_fallback(byte_level, sentencepiece):
    for tok in (byte_level, sentencepiece):
        bpt = tok.bytes_per_token
        assert bpt.shape == (tok.vocab_size,) and bpt.dtype == np.int32 and not bpt.flags.writeable
        special = [*tok.special_ids, *(i for i, t in tok._tok.get_added_tokens_decoder().items() if t.special)]
        assert len(special) > len(tok.special_ids)  # <|padding|> / <unk> are special but not PAD, BOS or EOS
        np.testing.assert_array_equal(bpt[special], 0)
        assert (np.delete(bpt, special) > 0).all()
    sp_id, sp_bpt = sentencepiece._tok.token_to_id, sentencepiece.bytes_per_token
    np.testing.assert_array_equal(sp_bpt[[sp_id(f"<0x{b:02X}>") for b in range(256)]], 1)
    assert sp_bpt[sp_id("<unk>")] == 0  # an added special token, not text
    assert sp_bpt[sp_id("▁the")] == 4
    assert byte_level.bytes_per_token[byte_level._tok.token_to_id("Ġthe")] == 4


FAMILIES = {
    "byte_level": BYTE_LEVEL,
    "metaspace_always": SENTENCEPIECE,
    "metaspace_never": _sentencepiece_json(bos_template=True, prepend_scheme="never"),
    "llama2_normalizer": _sentencepiece_json(bos_template=True, llama2_style=True),
}
# The space byte a family prepends to a document (counted by its first token).
PREPENDED = {
    "byte_level": lambda text: 0,
    "metaspace_always": lambda text: int(bool(text) and not text.startswith(" ")),
    "metaspace_never": lambda text: 0,
    "llama2_normalizer": lambda text: int(bool(text)),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: HFTokenizer(_save(root / name, spec, tokenizer_config={
        "eos_token": "<|endoftext|>" if name == "byte_level" else "</s>"})) for name, spec in FAMILIES.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bytes_per_token_sums_to_the_text_length(families, family):
    tok = families[family]
    for text in [*TEXTS, *SENTENCES[:5], " leading space", "  two", "", "\n\n"]:
        ids = tok.encode(text)
        assert tok.bytes_per_token[ids].sum() == len(text.encode("utf-8")) + PREPENDED[family](text), text


# Any text for byte-level BPE; for SentencePiece-style, any text without the "▁" it writes spaces as.
@settings(max_examples=80, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="▁"), max_size=40),
       family=st.sampled_from(sorted(FAMILIES)))
def test_bytes_per_token_is_exact_on_any_text(families, text, family):
    tok = families[family]
    assert tok.bytes_per_token[tok.encode(text)].sum() == len(text.encode("utf-8")) + PREPENDED[family](text)


def test_documents_are_wrapped_as_the_tokenizer_says(tmp_path, byte_level, sentencepiece):
    docs = ["héllo wörld", "the lazy dog", "x"]
    for tok in (byte_level, sentencepiece):
        ids = [tok.encode(d) for d in docs]
        rows = pack_documents(ids, 4, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
        bos = [] if tok.bos_id is None else [tok.bos_id]
        np.testing.assert_array_equal(rows.stream, np.concatenate([np.r_[bos, t, tok.eos_id] for t in ids]))
        assert rows.num_tokens == sum(len(t) + 1 + len(bos) for t in ids)
        # every EOS is a target (also when PAD is EOS), each document's first token is one only after a BOS
        w = np.concatenate([rows[r]["loss_weight"] for r in range(len(rows))])
        tgt = np.concatenate([rows[r]["targets"] for r in range(len(rows))])
        assert w.sum() == sum(len(t) + bool(bos) for t in ids) and (w[tgt[: len(w)] == tok.eos_id] == 1).sum() == 3
    # the pipeline: load_corpus with a tokenizer path
    src = tmp_path / "corpus"
    src.mkdir()
    for i in range(30):
        (src / f"d{i:02d}.txt").write_text(f"{SENTENCES[i % 5]} #{i}")
    path = _save(tmp_path / "tokdir", BYTE_LEVEL, tokenizer_config={"eos_token": "<|endoftext|>"})
    corpus = load_corpus(DataConfig(source=str(src), tokenizer=path, seq_len=16, batch_size=2, val_fraction=0.2))
    assert isinstance(corpus.tokenizer, HFTokenizer) and corpus.tokenizer.bos_id is None
    train_docs, _ = split_documents(load_documents(str(src), "text")[0], 0.2)
    tok = corpus.tokenizer
    np.testing.assert_array_equal(corpus.train.stream, np.concatenate([np.r_[tok.encode(d.data), tok.eos_id]
                                                                       for d in train_docs]))


TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.head_dim=16", "model.d_ff=32",
        "model.max_seq_len=64", "data.seq_len=32", "moe.num_experts=2", "moe.top_k=1", "model.tie_embeddings=true"]


def _random_params(md, seed: int) -> dict:
    """Gaussian parameters (std 0.3) of ``md``'s shapes: as good as ``init_params`` here and built
    without tracing the initialisers (seconds on a CPU)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype), md.abstract_params)


def test_generate_without_bos_conditions_on_the_prompt_only(byte_level):
    md = ModelDef(load_config(None, TINY), byte_level.vocab_size)
    params = _random_params(md, seed=1)
    prompt = "the lazy"
    _, logits = generate(md, params, byte_level, prompt, max_new_tokens=1, temperature=0.0, return_logits=True)
    ids = byte_level.encode(prompt)  # no BOS in front
    full = jax.jit(lambda p, t: md.module(p)(t, drop_tokens=False).logits)(params, jnp.asarray(ids)[None])
    np.testing.assert_allclose(logits[0], np.asarray(full[0, -1]), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="no BOS"):
        generate(md, params, byte_level, "", max_new_tokens=2)


def _rigged_params(md, tok, row0: dict[int, float]):
    """Parameters whose next-token logits are ``sqrt(D) * embed[v, 0]`` whatever the context: every
    block outputs 0 (all its weights are 0) and each embedding is ``[embed[v, 0], 0, ...]``, so the
    final RMSNorm (scale 1) gives ``[sqrt(D), 0, ...]``. Ordinary ids get 1, ids at or above the
    tokenizer's vocabulary 5, and the ids in ``row0`` their value."""
    params = _random_params(md, seed=0)
    params["blocks"] = jax.tree_util.tree_map(jnp.zeros_like, params["blocks"])
    params["final_norm"] = jax.tree_util.tree_map(jnp.ones_like, params["final_norm"])
    col = np.ones((params["embed"].shape[0],), np.float32)
    col[tok.vocab_size:] = 5.0
    for i, v in row0.items():
        col[i] = v
    params["embed"] = jnp.zeros_like(params["embed"]).at[:, 0].set(col)
    return params


def test_generate_never_samples_banned_ids_and_stops_at_eos(byte_level, sentencepiece, monkeypatch):
    seen = []

    def spy(tok):
        decode = tok.decode
        monkeypatch.setattr(tok, "decode", lambda ids: seen.append(np.asarray(ids)) or decode(ids))

    # BOS (3) and PAD (2) score above "▁the" (1.5), which beats every other ordinary id (1), EOS
    # below: "▁the" comes out 12 times
    tok = sentencepiece
    the = tok._tok.token_to_id("▁the")
    md = ModelDef(load_config(None, TINY), tok.vocab_size + 8)  # 8 ids past the tokenizer's: banned too
    params = _rigged_params(md, tok, {tok.bos_id: 3.0, tok.pad_id: 2.0, tok.eos_id: 0.5, the: 1.5})
    spy(tok)
    text, logits = generate(md, params, tok, "the", max_new_tokens=12, temperature=0.0, return_logits=True)
    assert np.argmax(logits[0]) >= tok.vocab_size and logits.shape == (12, tok.vocab_size + 8)
    np.testing.assert_array_equal(seen[-1], [the] * 12)
    assert text == "the" + " the" * 11

    # PAD == EOS (byte-level): EOS, second only to the banned ids, must still stop generation at once
    tok = byte_level
    assert tok.pad_id == tok.eos_id and tok.bos_id is None
    md = ModelDef(load_config(None, TINY), tok.vocab_size + 8)
    text, logits = generate(md, _rigged_params(md, tok, {tok.eos_id: 3.0}), tok, "the", max_new_tokens=12,
                            temperature=0.0, return_logits=True)
    assert (text, logits.shape) == ("", (1, tok.vocab_size + 8))


def test_same_ids_as_transformers(tmp_path, byte_level, sentencepiece):
    transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    no_bos = HFTokenizer(_save(tmp_path / "nobos", SENTENCEPIECE, tokenizer_config={
        "eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False}))
    for tok in (byte_level, sentencepiece, no_bos):
        for hf in (transformers.PreTrainedTokenizerFast(tokenizer_file=tok.path),
                   transformers.PreTrainedTokenizerFast.from_pretrained(os.path.dirname(tok.path))):
            for text in TEXTS:
                ids = tok.encode(text).tolist()
                assert hf.encode(text, add_special_tokens=False) == ids, text
                bos = [] if tok.bos_id is None else [tok.bos_id]
                assert hf.encode(text) == bos + ids, text  # the BOS transformers prepends is ours
                assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids) == text
