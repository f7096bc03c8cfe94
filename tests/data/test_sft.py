"""SFT data (moefast/data/sft.py): chat templates rendered and masked token by token, with small
word-level tokenizers built here and Qwen-, Llama-3- and Mistral-style templates written here (none
with ``{% generation %}`` markers, as the stock ones), a marked template, a byte-level BPE checked
against the characters of every assistant turn, and every bad input."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, ByteLevelBPETokenizer, Regex, Tokenizer, models, pre_tokenizers

from moefast.config import DataConfig
from moefast.data import (ROW_KEYS, ByteTokenizer, DataError, HFTokenizer, eval_batches, load_corpus, pack_documents,
                          train_dataset)
from moefast.data.sft import (ChatTemplate, SFTExample, load_sft, read_conversations, split_examples,
                              tokenize_conversation)

# Qwen2-style: <|im_start|>role\ncontent<|im_end|>\n, generation prompt <|im_start|>assistant\n.
QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The same with transformers' {% generation %} markers around the assistant's text.
QWEN_MARKED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-3-Instruct-style: BOS once, trimmed content, <|eot_id|> ends every turn.
LLAMA3_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Mistral-Instruct-style: no generation prompt, the answer follows [/INST] after a space, then </s>.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

WORDS = ["hello", "hi", "there", "who", "are", "you", "a", "bot", "system", "user", "assistant", "?", ".", " ", "\n",
         "\n\n", "\n \n"]
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
MISTRAL_WORDS = ["[INST]", "▁[/INST]", "▁hello", "▁hi", "▁there", "▁who", "▁are", "▁you", "▁a", "▁bot", "▁?", "▁.",
                 "▁"]

CONVERSATION = [
    {"role": "system", "content": "you are a bot"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "who are you ?"},
    {"role": "assistant", "content": "a bot ."},
]


def _word_level(words, specials, *, metaspace=False) -> str:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    if metaspace:  # SentencePiece-style pieces: "▁word", the space belongs to the next word
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    else:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\w+|[^\w\s]"), behavior="isolated")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok.to_str()


def _save(directory, tokenizer_json: str, config: dict, jinja: str | None = None) -> HFTokenizer:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return HFTokenizer(directory)


@pytest.fixture
def qwen(tmp_path):
    return _save(tmp_path / "qwen", _word_level(WORDS, QWEN_SPECIALS),
                 {"chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


@pytest.fixture
def llama3(tmp_path):
    return _save(tmp_path / "llama3", _word_level(WORDS, LLAMA3_SPECIALS),
                 {"chat_template": LLAMA3_TEMPLATE, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                  "add_bos_token": True})


@pytest.fixture
def mistral(tmp_path):
    return _save(tmp_path / "mistral", _word_level(MISTRAL_WORDS, ["<s>", "</s>"], metaspace=True),
                 {"chat_template": MISTRAL_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})


def _marked(tok: HFTokenizer, messages) -> list[str]:
    """The conversation's tokens, each weighted one prefixed with "+"."""
    ids, weights = tokenize_conversation(tok, ChatTemplate.from_tokenizer(tok), messages)
    assert ids.dtype == np.int32 and weights.dtype == np.float32 and ids.shape == weights.shape
    assert set(np.unique(weights)) <= {0.0, 1.0}
    return [("+" if w else "") + tok.token_text(i) for i, w in zip(ids, weights)]


def test_qwen_style_multi_turn_with_system(qwen):
    assert _marked(qwen, CONVERSATION) == [
        "<|im_start|>", "system", "\n", "you", " ", "are", " ", "a", " ", "bot", "<|im_end|>", "\n",
        "<|im_start|>", "user", "\n", "hello", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "+hi", "+ ", "+there", "+<|im_end|>", "\n",
        "<|im_start|>", "user", "\n", "who", " ", "are", " ", "you", " ", "?", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "+a", "+ ", "+bot", "+ ", "+.", "+<|im_end|>", "\n"]


def test_a_default_system_prompt_is_not_trained(tmp_path):
    # Qwen2.5 writes a system turn of its own when the conversation has none.
    template = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nyou are a bot<|im_end|>\\n' }}"
                "{% endif %}" + QWEN_TEMPLATE)
    tok = _save(tmp_path / "q25", _word_level(WORDS, QWEN_SPECIALS),
                {"chat_template": template, "eos_token": "<|im_end|>"})
    assert _marked(tok, CONVERSATION[1:3]) == [
        "<|im_start|>", "system", "\n", "you", " ", "are", " ", "a", " ", "bot", "<|im_end|>", "\n",
        "<|im_start|>", "user", "\n", "hello", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "+hi", "+ ", "+there", "+<|im_end|>", "\n"]


def test_generation_markers_give_the_same_mask(tmp_path, qwen):
    marked = _save(tmp_path / "marked", _word_level(WORDS, QWEN_SPECIALS),
                   {"chat_template": QWEN_MARKED_TEMPLATE, "eos_token": "<|im_end|>"})
    assert ChatTemplate.from_tokenizer(marked).has_generation_markers
    assert not ChatTemplate.from_tokenizer(qwen).has_generation_markers
    assert _marked(marked, CONVERSATION) == _marked(qwen, CONVERSATION)


def test_llama3_style_mask_with_trimmed_content(llama3):
    messages = [{"role": "system", "content": "you are a bot"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": " hi there \n"}]  # the template trims it
    assert _marked(llama3, messages) == [
        "<|begin_of_text|>", "<|start_header_id|>", "system", "<|end_header_id|>", "\n\n", "you", " ", "are", " ", "a",
        " ", "bot", "<|eot_id|>",
        "<|start_header_id|>", "user", "<|end_header_id|>", "\n\n", "hello", "<|eot_id|>",
        "<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n", "+hi", "+ ", "+there", "+<|eot_id|>"]


def test_mistral_style_mask_counts_the_piece_holding_the_templates_space(mistral):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
                {"role": "user", "content": "who are you ?"}, {"role": "assistant", "content": "a bot ."}]
    assert _marked(mistral, messages) == [
        "<s>", "[INST]", "▁hello", "▁[/INST]", "+▁hi", "+▁there", "+</s>",
        "[INST]", "▁who", "▁are", "▁you", "▁?", "▁[/INST]", "+▁a", "+▁bot", "+▁.", "+</s>"]


# OLMoE-Instruct (Tulu)-style: plain-text role tags, EOS ends an assistant turn, a newline follows
# it except after the last message.
TULU_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + "
    "eos_token }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% else %}{{ '<|' + message['role'] + '|>\\n' + "
    "message['content'] + '\\n' }}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% endif %}{% endfor %}")
# Phi-3-style: <|end|> ends every turn; the conversation ends with EOS unless a generation prompt follows.
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")
ROLE_TAGS = ["<|system|>", "<|user|>", "<|assistant|>"]


def test_tulu_style_mask_with_unspecial_role_tags(tmp_path):
    tok = Tokenizer.from_str(_word_level(WORDS, ["<|endoftext|>"]))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ROLE_TAGS])
    tok = _save(tmp_path / "tulu", tok.to_str(), {"chat_template": TULU_TEMPLATE, "eos_token": "<|endoftext|>"})
    assert _marked(tok, CONVERSATION) == [
        "<|system|>", "\n", "you", " ", "are", " ", "a", " ", "bot", "\n", "<|user|>", "\n", "hello", "\n",
        "<|assistant|>", "\n", "+hi", "+ ", "+there", "+<|endoftext|>", "\n",
        "<|user|>", "\n", "who", " ", "are", " ", "you", " ", "?", "\n",
        "<|assistant|>", "\n", "+a", "+ ", "+bot", "+ ", "+.", "+<|endoftext|>"]


def test_phi3_style_final_eos_is_left_out(tmp_path):
    tok = _save(tmp_path / "phi3", _word_level(WORDS, ["<|end|>", "<|endoftext|>", *ROLE_TAGS]),
                {"chat_template": PHI3_TEMPLATE, "eos_token": "<|endoftext|>"})
    assert _marked(tok, CONVERSATION[1:]) == [
        "<|user|>", "\n", "hello", "<|end|>", "\n", "<|assistant|>", "\n", "+hi", "+ ", "+there", "+<|end|>", "\n",
        "<|user|>", "\n", "who", " ", "are", " ", "you", " ", "?", "<|end|>", "\n",
        "<|assistant|>", "\n", "+a", "+ ", "+bot", "+ ", "+.", "+<|end|>", "\n", "<|endoftext|>"]


def test_end_of_turn_is_the_first_special_token_after_the_content(qwen):
    # Content that contains special-token text keeps all of it; the turn still ends at <|im_end|>.
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi<|endoftext|>there"}]
    assert _marked(qwen, messages)[-6:] == ["\n", "+hi", "+<|endoftext|>", "+there", "+<|im_end|>", "\n"]


def test_template_text_after_an_unspecial_turn_end_is_weighted(tmp_path):
    # A template that ends turns with plain text: the whole turn is the assistant's.
    template = ("{% for m in messages %}{{ m['role'] + '\\n' + m['content'] + '\\n\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant\\n' }}{% endif %}")
    tok = _save(tmp_path / "plain", _word_level(WORDS, ["<|endoftext|>"]),
                {"chat_template": template, "eos_token": "<|endoftext|>"})
    assert _marked(tok, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]) == [
        "user", "\n", "hello", "\n\n", "assistant", "\n", "+hi", "+\n\n"]


def test_chat_template_jinja_file_wins_and_encode_is_unchanged(tmp_path):
    tok = _save(tmp_path / "j", _word_level(WORDS, QWEN_SPECIALS), {"eos_token": "<|im_end|>"}, jinja=QWEN_TEMPLATE)
    assert ChatTemplate.from_tokenizer(tok).source.endswith("chat_template.jinja")
    im_end = tok.encode_chat("<|im_end|>")[0]
    assert im_end.tolist() == [tok.eos_id]
    # Pretraining's encode still reads special-token text as plain text.
    assert tok.eos_id not in tok.encode("<|im_end|>").tolist()


# Byte-level BPE (Qwen's family) with non-ASCII text: the weighted tokens cover exactly the
# characters of each assistant message plus its <|im_end|>.
_BPE = None


def _byte_level_qwen(tmp_path_factory) -> HFTokenizer:
    global _BPE
    if _BPE is None:
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(["hello there, héllo wörld 日本語", "who are you? a bot."], vocab_size=300,
                                min_frequency=1, show_progress=False, special_tokens=QWEN_SPECIALS)
        _BPE = _save(tmp_path_factory.mktemp("bpe"), bpe._tokenizer.to_str(),
                     {"chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>"})
    return _BPE


_TEXT = st.text(alphabet=st.sampled_from(list("ab é日\n?")), max_size=12)


@settings(max_examples=25, deadline=None)
@given(turns=st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=3), system=st.none() | _TEXT)
def test_byte_level_weights_cover_exactly_the_assistant_text(tmp_path_factory, turns, system):
    tok = _byte_level_qwen(tmp_path_factory)
    template = ChatTemplate.from_tokenizer(tok)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
    ids, weights = tokenize_conversation(tok, template, messages)
    text = template.render(messages)
    _, offsets = tok.encode_chat(text)
    covered = np.zeros(len(text), bool)
    for (s, e), w in zip(offsets, weights):
        if w:
            covered[s:e] = True
    want = np.zeros(len(text), bool)
    pos = 0
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        pos += len(head)
        end = pos + len(m["content"]) + len("<|im_end|>")
        if m["role"] == "assistant":
            want[pos:end] = True
        pos = end + 1
    np.testing.assert_array_equal(covered, want)


# ---- bad input: one DataError naming the file and line --------------------------------------------------


def _jsonl(path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


GOOD = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}


@pytest.mark.parametrize("record, match", [
    ({"text": "hello"}, r"no field 'messages'"),
    ({"messages": []}, r"'messages' must be a non-empty list"),
    ({"messages": [{"content": "hello"}, {"role": "assistant", "content": "hi"}]}, r"message 0 has no usable 'role'"),
    ({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant"}]}, r"message 1 has no usable 'content'"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "hi"}]},
     r"message 0 has no usable 'content' \(NoneType"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]},
     r"no assistant message \(roles: \['system', 'user'\]\)"),
    ("[1, 2]", r"expected a JSON object"),
    ("{not json", r"not valid JSON"),
])
def test_bad_lines_name_file_and_line(tmp_path, record, match):
    path = _jsonl(tmp_path / "chat.jsonl", GOOD, "", record)
    with pytest.raises(DataError, match=match) as e:
        read_conversations(path)
    assert f"{path}:3:" in str(e.value)


def test_reads_globs_and_ids(tmp_path):
    (tmp_path / "d").mkdir()
    _jsonl(tmp_path / "d" / "a.jsonl", GOOD, GOOD)
    _jsonl(tmp_path / "d" / "b.jsonl", GOOD)
    convs = read_conversations(str(tmp_path / "d" / "*.jsonl"))
    assert [c.id for c in convs] == ["a.jsonl:1", "a.jsonl:2", "b.jsonl:1"]
    assert [c.id for c in read_conversations(str(tmp_path / "d"))] == [c.id for c in convs]
    with pytest.raises(DataError, match="no such file"):
        read_conversations(str(tmp_path / "missing.jsonl"))


def test_tokenizer_without_chat_template(tmp_path):
    tok = _save(tmp_path / "nt", _word_level(WORDS, QWEN_SPECIALS), {"eos_token": "<|im_end|>"})
    with pytest.raises(DataError, match=r"has no chat template: looked for .*chat_template\.jinja and for "
                                        r"\"chat_template\" in .*tokenizer_config\.json"):
        ChatTemplate.from_tokenizer(tok)
    with pytest.raises(DataError, match="needs a Hugging Face tokenizer with a chat template"):
        ChatTemplate.from_tokenizer(ByteTokenizer())


def test_template_errors_name_the_line(tmp_path, mistral):
    path = _jsonl(tmp_path / "chat.jsonl", GOOD, {"messages": [{"role": "system", "content": "s"}, *GOOD["messages"]]})
    with pytest.raises(DataError, match=r"chat\.jsonl:2: the chat template .* refuses this conversation: "
                                        r"TemplateError: Only user and assistant roles are supported!"):
        load_sft(path, mistral, seq_len=64, overlong="truncate", val_fraction=0.5)
    bad = _save(tmp_path / "bad", _word_level(WORDS, QWEN_SPECIALS), {"chat_template": "{% for %}",
                                                                       "eos_token": "<|im_end|>"})
    with pytest.raises(DataError, match=r"tokenizer_config\.json: the chat template is not valid jinja2"):
        ChatTemplate.from_tokenizer(bad)


def test_template_that_renders_the_last_turn_differently_is_refused(tmp_path):
    # As Qwen3 keeps reasoning only in the last turn: the last message is written differently.
    template = ("{% for m in messages %}{{ m['role'] + '\\n' }}{% if loop.last %}{{ '? ' }}{% endif %}"
                "{{ m['content'] + '\\n' }}{% endfor %}")
    tok = _save(tmp_path / "odd", _word_level(WORDS, ["<|endoftext|>"]),
                {"chat_template": template, "eos_token": "<|endoftext|>"})
    messages = [*GOOD["messages"], {"role": "user", "content": "hello"}]
    with pytest.raises(DataError, match=r"x\.jsonl:7: .*renders the conversation up to message 1 differently.*"
                                        r"\{% generation %\}"):
        tokenize_conversation(tok, ChatTemplate.from_tokenizer(tok), messages, "x.jsonl:7")


# ---- packing: examples whole inside one row, isolated, weights carried ----------------------------------

P = 0  # PAD


def _pack_sft(examples, weights, seq_len):
    return pack_documents([np.asarray(t, np.int32) for t in examples], seq_len, bos_id=None, eos_id=99, pad_id=P,
                          loss_weights=[np.asarray(w, np.float32) for w in weights])


def _assert_row(row, **expected):
    assert set(row) == set(ROW_KEYS)
    for key, want in expected.items():
        want = np.asarray(want, np.float32 if key == "loss_weight" else np.int32)
        assert row[key].dtype == want.dtype, key
        np.testing.assert_array_equal(row[key], want, err_msg=key)


def test_an_example_that_does_not_fit_starts_the_next_row():
    rows = _pack_sft([[1, 2, 3], [4, 5, 6]], [[0, 0, 1], [0, 1, 1]], seq_len=4)  # stream 1 2 3 p | 4 5 6
    assert len(rows) == 2 and rows.num_tokens == 7 and rows.num_documents == 2
    _assert_row(rows[0], tokens=[1, 2, 3, P], targets=[2, 3, P, 4], segment_ids=[1, 1, 1, 0],
                positions=[0, 1, 2, 0], loss_weight=[0, 1, 0, 0])
    _assert_row(rows[1], tokens=[4, 5, 6, P], targets=[5, 6, P, P], segment_ids=[1, 1, 1, 0],
                positions=[0, 1, 2, 0], loss_weight=[1, 1, 0, 0])


def test_examples_sharing_a_row_are_isolated():
    rows = _pack_sft([[1, 2], [3, 4, 5]], [[0, 1], [0, 0, 1]], seq_len=8)
    assert len(rows) == 1
    _assert_row(rows[0], tokens=[1, 2, 3, 4, 5, P, P, P], targets=[2, 3, 4, 5, P, P, P, P],
                segment_ids=[1, 1, 2, 2, 2, 0, 0, 0], positions=[0, 1, 0, 1, 2, 0, 0, 0],
                loss_weight=[1, 0, 0, 1, 0, 0, 0, 0])


def test_an_example_of_seq_len_plus_one_tokens_fills_a_row():
    rows = _pack_sft([[1, 2, 3, 4, 5], [6, 7]], [[1, 1, 1, 1, 1], [1, 1]], seq_len=4)
    assert len(rows) == 2
    _assert_row(rows[0], tokens=[1, 2, 3, 4], targets=[2, 3, 4, 5], segment_ids=[1, 1, 1, 1],
                positions=[0, 1, 2, 3], loss_weight=[1, 1, 1, 1])
    # The row's first input is the previous example's last token: its own segment, no target.
    _assert_row(rows[1], tokens=[5, 6, 7, P], targets=[6, 7, P, P], segment_ids=[1, 2, 2, 0],
                positions=[0, 0, 1, 0], loss_weight=[0, 1, 0, 0])


def test_pack_refuses_an_example_longer_than_a_row_and_mismatched_weights():
    with pytest.raises(DataError, match=r"example 1 has 6 tokens, more than seq_len \+ 1 = 5"):
        _pack_sft([[1], [1, 2, 3, 4, 5, 6]], [[0], [0] * 6], seq_len=4)
    with pytest.raises(DataError, match=r"loss_weights\[0\] has shape \(2,\), expected \(3,\)"):
        _pack_sft([[1, 2, 3]], [[0, 1]], seq_len=4)
    with pytest.raises(DataError, match="2 loss_weights for 1 documents"):
        _pack_sft([[1, 2, 3]], [[0, 1, 1], [1]], seq_len=4)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), seq_len=st.integers(1, 9))
def test_every_weighted_target_is_trained_once_with_its_whole_example_before_it(data, seq_len):
    lengths = data.draw(st.lists(st.integers(1, seq_len + 1), min_size=1, max_size=8))
    examples = [list(range(100 * (e + 1), 100 * (e + 1) + n)) for e, n in enumerate(lengths)]
    weights = [data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)) for n in lengths]
    rows = _pack_sft(examples, weights, seq_len)
    seen = []
    for r in range(len(rows)):
        row = rows[r]
        for t in np.flatnonzero(row["loss_weight"]):
            pos, seg = int(row["positions"][t]), row["segment_ids"][t]
            assert seg > 0 and (row["segment_ids"][t - pos: t + 1] == seg).all()
            context = [*row["tokens"][t - pos: t + 1].tolist(), int(row["targets"][t])]
            e = context[0] // 100 - 1
            assert context == examples[e][: pos + 2]  # the example from its first token on
            seen.append((e, pos + 1))
    assert sorted(seen) == [(e, j) for e, w in enumerate(weights) for j in range(1, len(w)) if w[j]]


# ---- load_sft and the pipeline ----------------------------------------------------------------------------


def _conversations(n, long_every=0):
    out = []
    for i in range(n):
        answer = "a bot ." if not long_every or i % long_every else " ".join(["hi there"] * 20)
        out.append({"messages": [{"role": "user", "content": "who are you ?"},
                                 {"role": "assistant", "content": answer}]})
    return out


def test_overlong_examples_are_truncated_or_dropped_and_counted(tmp_path, qwen):
    path = _jsonl(tmp_path / "chat.jsonl", *_conversations(6, long_every=3))  # examples 0 and 3 are long
    train, val, src, stats = load_sft(path, qwen, seq_len=24, overlong="drop", val_fraction=0.3)
    assert (stats.conversations, stats.dropped_overlong, stats.truncated) == (6, 2, 0)
    assert train.num_documents + val.num_documents == 4 and src.documents == 6
    assert "2 longer than data.seq_len dropped" in stats.summary()
    train, val, _, stats = load_sft(path, qwen, seq_len=24, overlong="truncate", val_fraction=0.3)
    assert (stats.dropped_overlong, stats.truncated, train.num_documents + val.num_documents) == (0, 2, 6)
    assert "2 truncated to data.seq_len" in stats.summary()
    # A prompt longer than a row leaves no assistant token: dropped, and said so.
    with pytest.raises(DataError, match=r"none of the 6 conversations fits in data.seq_len=6 tokens .*6 dropped "
                                        r"\(no assistant token within data.seq_len\)"):
        load_sft(path, qwen, seq_len=6, overlong="truncate", val_fraction=0.3)


def test_truncated_examples_fill_one_row_each(tmp_path, qwen):
    """A newcomer's finding: 29 overlong conversations at seq_len 64 packed into 57 rows. Truncated to
    T + 1 tokens, each example took the next row's first token (rows share their boundary), so the
    next truncated one started a row later, leaving an all-padding row between every two."""
    path = _jsonl(tmp_path / "chat.jsonl", *_conversations(8, long_every=1))  # every example longer than a row
    train, val, _, stats = load_sft(path, qwen, seq_len=16, overlong="truncate", val_fraction=0.3)
    for rows in (train, val):
        assert len(rows) == rows.num_documents  # one row per truncated example, none of padding only
        assert all(rows[i]["loss_weight"].sum() > 0 for i in range(len(rows)))
    assert stats.truncated == 8 and stats.tokens == 8 * 16  # each cut to T tokens (one target less than T + 1)


def test_chat_template_list_uses_default(tmp_path):
    listed = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
              {"name": "default", "template": QWEN_TEMPLATE}]
    tok = _save(tmp_path / "l", _word_level(WORDS, QWEN_SPECIALS), {"chat_template": listed, "eos_token": "<|im_end|>"})
    assert ChatTemplate.from_tokenizer(tok).text == QWEN_TEMPLATE
    tok = _save(tmp_path / "n", _word_level(WORDS, QWEN_SPECIALS),
                {"chat_template": listed[:1], "eos_token": "<|im_end|>"})
    with pytest.raises(DataError, match=r"chat_template is a list without a \"default\" template \(names: "
                                        r"\['tool_use'\]\)"):
        ChatTemplate.from_tokenizer(tok)


def test_split_holds_out_whole_conversations_even_when_few():
    examples = [SFTExample(f"c.jsonl:{i}", np.zeros(3, np.int32), np.ones(3, np.float32)) for i in range(1, 4)]
    train, val = split_examples(examples, 0.01)  # the hash rule alone would hold out none
    assert len(val) == 1 and len(train) == 2 and not {e.id for e in train} & {e.id for e in val}
    assert split_examples(examples, 0.01) == (train, val)
    with pytest.raises(DataError, match="SFT needs at least 2"):
        split_examples(examples[:1], 0.5)


def test_load_corpus_trains_on_the_assistants_tokens(tmp_path, qwen):
    path = _jsonl(tmp_path / "chat.jsonl", *_conversations(12, long_every=5))
    cfg = DataConfig(source=path, tokenizer=str(tmp_path / "qwen"), format="sft", sft_overlong="drop", seq_len=32,
                     batch_size=2, val_fraction=0.25)
    corpus = load_corpus(cfg)
    assert corpus.sft.dropped_overlong == 3 and corpus.train.num_documents + corpus.val.num_documents == 9
    assert "sft: 12 conversations, 12 assistant turns" in corpus.summary()
    assert "3 longer than data.seq_len dropped" in corpus.summary()
    batch = next(iter(train_dataset(corpus, cfg, seed=0)))
    assert batch["tokens"].shape == (2, 32) and batch["loss_weight"].sum() > 0
    # Every weighted target is the answer "a bot ." or its <|im_end|>, and it sees its own question.
    trained = {qwen.token_text(i) for i in batch["targets"][batch["loss_weight"] > 0]}
    assert trained == {"a", " ", "bot", ".", "<|im_end|>"}
    val = eval_batches(corpus, cfg, 1)[0]
    assert val["loss_weight"].sum() > 0


def test_nested_generation_markers_are_refused(tmp_path):
    template = ("{% for m in messages %}{% generation %}{{ m['content'] }}{% generation %}{{ '.' }}{% endgeneration %}"
                "{% endgeneration %}{% endfor %}")
    tok = _save(tmp_path / "nest", _word_level(WORDS, QWEN_SPECIALS), {"chat_template": template,
                                                                        "eos_token": "<|im_end|>"})
    with pytest.raises(DataError, match=r"c\.jsonl:1: the chat template nests \{% generation %\} blocks"):
        tokenize_conversation(tok, ChatTemplate.from_tokenizer(tok), GOOD["messages"], "c.jsonl:1")


def test_a_runs_tokenizer_record_follows_its_chat_template_file(qwen):
    """A newcomer's finding: an SFT run resumed silently after chat_template.jinja beside its
    tokenizer changed (what it trains on changed); the checkpoint's tokenizer record now covers it."""
    from moefast.train.loop import tokenizer_record

    before = tokenizer_record(qwen, "qwen")
    assert before["vocab_size"] == qwen.vocab_size and before["identity"].startswith("sha256:")
    jinja = Path(qwen.path).parent / "chat_template.jinja"
    jinja.write_text(QWEN_TEMPLATE)
    with_file = tokenizer_record(qwen, "qwen")["identity"]
    jinja.write_text(QWEN_TEMPLATE.replace("<|im_start|>", "<|im_start|> "))
    assert len({before["identity"], with_file, tokenizer_record(qwen, "qwen")["identity"]}) == 3
