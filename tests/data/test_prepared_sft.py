"""``moefast prepare --format sft``: conversations with their loss masks in memory-mapped shards give the
rows and batches of the in-memory SFT path (moefast/data/prepared_sft.py)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

from moefast.config import DataConfig
from moefast.data import DataError, eval_batches, load_corpus, train_dataset
from moefast.data.packing import pack_documents
from moefast.data.prepared import prepare
from moefast.data.prepared_sft import PreparedSFTRows, prepare_sft

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ["hello", "hi", "there", "who", "are", "you", "a", "bot", "system", "user", "assistant", "?", ".", " ", "\n"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *WORDS])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\w+|[^\w\s]"), behavior="isolated")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    (d / "tokenizer.json").write_text(tok.to_str())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>",
                                                         "pad_token": "<|endoftext|>"}))
    return str(d)


def _conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "you are a bot ."}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": " ".join(rng.choice(["who", "are", "you", "?"],
                                                                              int(rng.integers(1, 6))))})
            messages.append({"role": "assistant", "content": " ".join(rng.choice(["hi", "there", "a", "bot", "."],
                                                                                   int(rng.integers(1, 12))))})
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    d = tmp_path_factory.mktemp("chats")
    for k in range(2):  # two files: ids name the file and line
        (d / f"part{k}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _conversations(40, seed=k)))
    return str(d)


@pytest.fixture(scope="module")
def prepared_sft(chats, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "sft"
    prepare_sft(chats, out, tokenizer=tok_dir, val_fraction=0.2, shard_tokens=300, progress=False)
    return str(out)


def _cfg(source, tok_dir, **kw):
    return DataConfig(**{"source": source, "tokenizer": tok_dir, "format": "sft", "seq_len": 48, "batch_size": 4,
                         "val_fraction": 0.2, **kw})


def _assert_rows_equal(a, b):
    assert len(a) == len(b) and a.num_tokens == b.num_tokens and a.num_documents == b.num_documents
    for i in range(len(a)):
        ra, rb = a[i], b[i]
        for k in ra:
            np.testing.assert_array_equal(ra[k], rb[k], err_msg=f"row {i} {k}")


def test_manifest_records_masks_and_the_template(prepared_sft):
    m = json.loads(open(f"{prepared_sft}/manifest.json").read())
    assert m["data_format"] == "sft" and m["sft"]["conversations"] == 80
    shards = m["splits"]["train"]["shards"]
    assert len(shards) > 1 and all(s["mask"].endswith(".mask.npy") for s in shards)
    mask = np.load(f"{prepared_sft}/{shards[0]['mask']}", mmap_mode="r")
    assert mask.dtype == np.uint8 and mask.shape == (shards[0]["num_tokens"],) and set(np.unique(mask)) == {0, 1}
    assert m["sft"]["chat_template"].startswith("sha256:")


@pytest.mark.parametrize("seq_len, overlong", [(48, "truncate"), (48, "drop"), (20, "truncate"), (200, "drop")])
def test_rows_and_batches_equal_the_in_memory_sft_path(chats, tok_dir, prepared_sft, seq_len, overlong):
    mem = load_corpus(_cfg(chats, tok_dir, seq_len=seq_len, sft_overlong=overlong))
    cfg = _cfg(prepared_sft, tok_dir, seq_len=seq_len, sft_overlong=overlong)
    disk = load_corpus(cfg)
    assert isinstance(disk.train, PreparedSFTRows)
    _assert_rows_equal(disk.train, mem.train)
    _assert_rows_equal(disk.val, mem.val)
    assert disk.sft == mem.sft
    if seq_len == 48:  # the same batches for the same seed, and the same validation batches
        a, b = iter(train_dataset(disk, cfg, seed=3)), iter(train_dataset(mem, cfg, seed=3))
        for _ in range(5):
            x, y = next(a), next(b)
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])
        for x, y in zip(eval_batches(disk, cfg, 3), eval_batches(mem, cfg, 3)):
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), seq_len=st.integers(1, 9), overlong=st.sampled_from(["truncate", "drop"]))
def test_rows_equal_pack_documents_over_any_sharding(data, seq_len, overlong):
    lengths = data.draw(st.lists(st.integers(1, 14), min_size=1, max_size=10))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    docs = [rng.integers(0, 50, n).astype(np.int32) for n in lengths]
    masks = [(rng.random(n) < 0.6).astype(np.uint8) for n in lengths]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(docs) - 1)), max_size=3))))
    shards = []
    for lo, hi in zip([0, *cuts], [*cuts, len(docs)]):
        if lo >= hi:
            continue
        part = docs[lo:hi]
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in part])]).astype(np.int64)
        shards.append((np.concatenate(part).astype(np.uint16), offsets, np.concatenate(masks[lo:hi])))
    rows = PreparedSFTRows(shards, seq_len, pad_id=99, overlong=overlong)
    # the in-memory rule (moefast.data.sft.load_sft): truncate to T tokens (2 at T=1), or drop; none without a target
    cut = max(seq_len, 2)
    kept_t, kept_w = [], []
    for d, w in zip(docs, masks):
        if len(d) - 1 > seq_len:
            if overlong == "drop" or not w[1:cut].any():
                continue
            d, w = d[:cut], w[:cut]
        kept_t.append(d)
        kept_w.append(w.astype(np.float32))
    ref = pack_documents(kept_t, seq_len, bos_id=None, eos_id=98, pad_id=99, loss_weights=kept_w)
    _assert_rows_equal(rows, ref)


def test_text_manifest_with_sft_and_sft_manifest_with_text_are_one_clear_error(chats, tok_dir, prepared_sft,
                                                                               tmp_path):
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    for i in range(6):
        (text_dir / f"{i}.txt").write_text("hello there who are you ? " * (i + 3))
    plain = tmp_path / "plain"
    prepare(str(text_dir), plain, tokenizer=tok_dir, val_fraction=0.3, progress=False)
    with pytest.raises(DataError, match=r"manifest.json: prepared as pretraining text, without loss masks, but "
                                        r"data.format=sft .* --format sft"):
        load_corpus(_cfg(str(plain), tok_dir))
    with pytest.raises(DataError, match=r"prepared with --format sft .*set data.format=sft"):
        load_corpus(_cfg(prepared_sft, tok_dir, format="text"))


def test_a_changed_chat_template_or_a_missing_mask_is_refused(chats, tok_dir, tmp_path):
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(tok_dir, tok)
    out = tmp_path / "p"
    prepare_sft(chats, out, tokenizer=str(tok), val_fraction=0.2, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    mask = out / m["splits"]["train"]["shards"][0]["mask"]
    saved = mask.read_bytes()
    mask.unlink()
    with pytest.raises(DataError, match=r"mask.npy: missing"):
        load_corpus(_cfg(str(out), str(tok)))
    mask.write_bytes(saved[:-3])
    with pytest.raises(DataError, match=r"mask.npy"):
        load_corpus(_cfg(str(out), str(tok)))
    mask.write_bytes(saved)
    load_corpus(_cfg(str(out), str(tok)))
    (tok / "chat_template.jinja").write_text(TEMPLATE.replace("'\\n' }}{% endfor %}", "'\\n\\n' }}{% endfor %}"))
    with pytest.raises(DataError, match=r"another chat template"):
        load_corpus(_cfg(str(out), str(tok)))


def test_prepare_sft_errors_name_the_line(tmp_path, tok_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: no assistant message"):
        prepare_sft(str(bad), tmp_path / "o", tokenizer=tok_dir, progress=False)
    assert not (tmp_path / "o" / "manifest.json").exists()
    with pytest.raises(DataError, match=r"data.format=sft needs a Hugging Face tokenizer"):
        prepare_sft(str(bad), tmp_path / "o2", tokenizer="byte", progress=False)


def test_a_failed_sft_prepare_prints_the_error_and_no_progress_bar(tmp_path, tok_dir, capsys):
    """A newcomer's finding: a jsonl line without "messages", or a conversation without an assistant
    turn, printed empty tqdm bars before the error. Now the error is the only output, and the OUT_DIR
    the prepare created is gone."""
    from moefast.cli import main

    no_messages = tmp_path / "a.jsonl"
    no_messages.write_text(json.dumps({"text": "hi"}) + "\n")
    no_assistant = tmp_path / "b.jsonl"
    no_assistant.write_text("".join(json.dumps(c) + "\n" for c in _conversations(20))
                            + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    for path, message in ((no_messages, "a.jsonl:1: "), (no_assistant, "b.jsonl:21: no assistant message")):
        out = tmp_path / f"out-{path.stem}"
        assert main(["prepare", str(path), str(out), "--format", "sft", "--tokenizer", tok_dir]) == 2  # bar enabled
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ") and message in captured.err, captured.err
        assert len(captured.err.splitlines()) == 1 and "\r" not in captured.err and "tok/s" not in captured.err
        assert captured.out == "" and not out.exists()


def test_moefast_prepare_format_sft(chats, tok_dir, tmp_path, capsys):
    from moefast.cli import main

    out = tmp_path / "cli"
    assert main(["prepare", chats, str(out), "--format", "sft", "--tokenizer", tok_dir, "--no-progress"]) == 0
    assert json.loads((out / "manifest.json").read_text())["data_format"] == "sft"
    manifest = json.loads((out / "manifest.json").read_text())
    printed = capsys.readouterr().out
    assert "80 conversations" in printed
    assert f"of which {manifest['splits']['train']['weighted_tokens']} are targets" in printed
    # the split rule, printed and recorded as for text (a newcomer's finding: SFT printed none)
    assert manifest["split"]["rule"] == "hash"
    assert f"split: {manifest['split']['note']}" in printed
    assert (f"{manifest['splits']['val']['documents']} of 80 conversations held out for validation"
            in manifest["split"]["note"])


def test_a_tiny_sft_corpus_says_it_held_out_the_conversation_of_smallest_hash(tok_dir, tmp_path):
    src = tmp_path / "two.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in _conversations(2)))
    m = prepare_sft(str(src), tmp_path / "o", tokenizer=tok_dir, val_fraction=0.02, progress=False)
    assert m["split"]["rule"] == "smallest_hash"
    assert "of 2, so the conversation of smallest hash is held out instead" in m["split"]["note"]


def test_cli_sft_without_a_chat_tokenizer_names_the_flags(chats, tmp_path, capsys):
    from moefast.cli import main

    assert main(["prepare", chats, str(tmp_path / "o"), "--format", "sft", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--format sft needs a Hugging Face tokenizer" in err and "--tokenizer set to its directory" in err, err
    assert "data." not in err
