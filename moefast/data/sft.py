"""Supervised fine-tuning data: conversations with the loss on the assistant's tokens only.

A ``.jsonl`` line holds one conversation::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

Each conversation is rendered with the tokenizer's own chat template (jinja2 in a sandbox, with the
variables and helpers Hugging Face ``transformers``' ``apply_chat_template`` gives templates:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``,
``tojson``, ``strftime_now``), tokenized with the template's special-token text read as those
special tokens (:meth:`~moefast.data.hf_tokenizer.HFTokenizer.encode_chat`; pretraining text is
not tokenized that way), and given one loss weight per token: 1 on the assistant turns' tokens, 0
on system, user and template tokens. ``weights[n]`` is the weight of token n as a target, i.e. of
predicting it from the tokens before it; packing carries it into the rows' ``loss_weight``.

The template is ``chat_template.jinja`` beside ``tokenizer.json`` if that file exists, else the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``
of which ``"default"`` is used).

Which tokens are the assistant's
--------------------------------
**With** ``{% generation %}...{% endgeneration %}`` **markers** in the template: exactly the text
they enclose, nothing else.

**Without markers** (stock Qwen, Llama 3, Mistral, OLMoE/Tulu and Phi-3 templates), each assistant
message i is located by rendering prefixes of the conversation (every prefix must render as a
prefix of the whole conversation's text, which the stock templates do, apart from text written only
at the end of a conversation, such as Phi-3's final EOS, which is then left out):

- the turn starts where ``render(messages[:i], add_generation_prompt=True)`` ends: the header the
  generation prompt writes (``<|im_start|>assistant\\n``, ``<|start_header_id|>assistant
  <|end_header_id|>\\n\\n``) is the prompt and gets 0; what the model must write after it gets 1.
  Where that render is not a prefix of the conversation's, the turn starts at the message's
  content, found after ``render(messages[:i])``;
- the turn ends where ``render(messages[:i + 1])`` ends;
- the **end-of-turn token** is the first special token (an added token marked special, or the
  tokenizer's BOS/EOS/PAD) that starts at or after the end of the message's content inside the
  turn: ``<|im_end|>``, ``<|eot_id|>``, ``</s>``. It gets 1; template text after it inside the
  turn (Qwen's newline) gets 0. A turn with no special token after its content (a template that
  ends turns with plain text) gets 1 throughout. The content is looked up as it is, then stripped
  (Llama 3 trims it); when the template changes it beyond that, the first special token of the
  turn ends it.

Character spans become tokens through the tokenizer's offsets: a token gets 1 when any character it
was made from lies in a weighted span (so a SentencePiece ``▁answer`` whose ``▁`` is the template's
space is the assistant's). Every assistant message of a multi-turn conversation is weighted.
Special-token text inside a message (one quoting ``<|im_end|>``) is read as that special token too,
as ``apply_chat_template`` reads it; the end-of-turn rule looks past the content all the same.

A template that renders an earlier turn differently from the last one (Qwen3 drops earlier
reasoning) breaks the prefix rule and is refused with a :class:`DataError` asking for
``{% generation %}`` markers.

:func:`load_sft` packs each example whole into one row, never split across rows, so every target
sees its conversation from the first token on (:func:`~moefast.data.packing.pack_documents` with
``loss_weights``); an example longer than a row is truncated or dropped (``data.sft_overlong``).

Example::

    tok = HFTokenizer("/models/Qwen1.5-MoE-A2.7B-Chat")
    template = ChatTemplate.from_tokenizer(tok)
    ids, weights = tokenize_conversation(tok, template, messages)   # int32 [N], float32 [N]
"""

from __future__ import annotations

import dataclasses
import datetime
import glob as globlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np

from moefast.data.errors import DataError
from moefast.data.hf_tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, HFTokenizer, _read_json
from moefast.data.packing import PackedRows, pack_documents
from moefast.data.sources import SourceStats, glob_base, id_fraction
from moefast.data.tokenizer import Tokenizer

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "OVERLONG_CHOICES",
    "ChatTemplate",
    "Conversation",
    "SFTExample",
    "SFTStats",
    "iter_conversations",
    "load_sft",
    "read_conversations",
    "split_examples",
    "tokenize_conversation",
    "truncated_length",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
Overlong = Literal["truncate", "drop"]
OVERLONG_CHOICES = ("truncate", "drop")


def truncated_length(seq_len: int) -> int:
    """Tokens an overlong example keeps under ``data.sft_overlong: truncate``: T (2 when T is 1).

    Not T + 1, although an example of T + 1 tokens fits a row (T inputs, T targets): rows share
    their boundary token (row r is the packed stream's ``[r*T, r*T + T]``), so an example ending at
    ``r*T + T`` takes the first token of row r + 1, and the next example, if it too had T + 1
    tokens, could only start at row r + 2, leaving row r + 1 all padding. Cut to T tokens, each
    truncated example fills one row and the next starts at the next row: one target is given up
    per truncated example instead of a row (29 overlong conversations at T = 64 packed into 57
    rows, 28 of them without a target, before this rule; 29 rows after).

    Args:
      seq_len: T, tokens per row.

    Returns:
      The truncated example's length (tokens).
    """
    return int(seq_len) if int(seq_len) > 1 else 2

# Noncharacters (never in interchange text) that the {% generation %} tag writes around its body;
# removed from the rendered text, their places are the weighted spans.
_GEN_OPEN, _GEN_CLOSE = "\ufdd0", "\ufdd1"
_MESSAGES_HELP = ('each line of an SFT .jsonl file must be one conversation such as {"messages": [{"role": "user", '
                  '"content": "..."}, {"role": "assistant", "content": "..."}]}')


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One conversation of an SFT ``.jsonl`` file.

    Attributes:
      id: ``path:line`` (1-based line; path relative to the source's root, as :mod:`sources` names
        records), stable across machines: the train/validation split hashes it.
      where: ``absolute path:line``, for error messages.
      messages: the ``messages`` list, each a dict with string ``role`` and ``content`` (other keys
        are passed to the template as they are).
      bytes: length of the line (bytes).
    """

    id: str
    where: str
    messages: list[dict]
    bytes: int


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One tokenized conversation.

    Attributes:
      id: the conversation's id.
      tokens: int32 [N] ids of the rendered conversation (the template's own BOS included, if it
        writes one; nothing added).
      weights: float32 [N] loss weight of each token as a target (1 on the assistant's tokens).
    """

    id: str
    tokens: np.ndarray
    weights: np.ndarray


@dataclasses.dataclass
class SFTStats:
    """What :func:`load_sft` made of the conversations (both splits).

    Attributes:
      conversations: conversations read.
      assistant_turns: assistant messages among them.
      tokens: tokens of the kept examples (after truncation).
      weighted_tokens: tokens with loss weight 1 among them.
      truncated: examples longer than a row (more than ``seq_len + 1`` tokens), cut to
        :func:`truncated_length` (``seq_len``) tokens (``overlong=truncate``).
      dropped_overlong: examples longer than a row, left out (``overlong=drop``).
      dropped_no_target: examples whose assistant tokens all lay beyond the truncation,
        left out after it (nothing to train on).
    """

    conversations: int = 0
    assistant_turns: int = 0
    tokens: int = 0
    weighted_tokens: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_target: int = 0

    def summary(self) -> str:
        """One line for the console."""
        parts = [f"sft: {self.conversations} conversations, {self.assistant_turns} assistant turns, "
                 f"{self.weighted_tokens}/{self.tokens} tokens trained on"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to data.seq_len")
        if self.dropped_overlong:
            parts.append(f"{self.dropped_overlong} longer than data.seq_len dropped")
        if self.dropped_no_target:
            parts.append(f"{self.dropped_no_target} dropped (no assistant token within data.seq_len)")
        return ", ".join(parts)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text (transformers' tag)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return _GEN_OPEN + caller() + _GEN_CLOSE


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A tokenizer's chat template, compiled once in a sandboxed jinja2 environment.

    Args:
      text: the jinja2 source.
      source: where it came from (a file name), for messages.
      special_tokens: template variables such as ``bos_token``/``eos_token`` (their text).

    Raises:
      DataError: the template is not valid jinja2.
    """

    def __init__(self, text: str, source: str, special_tokens: dict[str, str] | None = None):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"{source}: the chat template is not valid jinja2 (line {e.lineno}: {e.message})") from None
        self.text = text
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.has_generation_markers = any(
            isinstance(node.call, jinja2.nodes.Call) and isinstance(node.call.node, jinja2.nodes.ExtensionAttribute)
            and node.call.node.name == "_mark" for node in env.parse(text).find_all(jinja2.nodes.CallBlock))

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """The chat template stored beside ``tokenizer``'s ``tokenizer.json``.

        Looks for ``chat_template.jinja``, then ``chat_template`` in ``tokenizer_config.json``; the
        template variables ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` come from
        ``tokenizer_config.json`` / ``special_tokens_map.json``, else from the tokenizer's ids.

        Raises:
          DataError: ``tokenizer`` is not a Hugging Face tokenizer, or no chat template is found
            (the message names the files looked at), or the template is invalid.
        """
        if not isinstance(tokenizer, HFTokenizer):
            raise DataError(f"data.format=sft needs a Hugging Face tokenizer with a chat template (data.tokenizer set "
                            f"to its directory), got {type(tokenizer).__name__}")
        directory = os.path.dirname(tokenizer.path)
        jinja_file = os.path.join(directory, CHAT_TEMPLATE_FILE)
        config_file = os.path.join(directory, TOKENIZER_CONFIG)
        config = _read_json(os.path.join(directory, SPECIAL_TOKENS_MAP))
        config.update(_read_json(config_file))
        if os.path.isfile(jinja_file):
            try:
                with open(jinja_file, encoding="utf-8") as f:
                    text, source = f.read(), jinja_file
            except (OSError, UnicodeDecodeError) as e:
                raise DataError(f"{jinja_file}: cannot read the chat template ({e})") from None
        else:
            text, source = _template_from_config(config.get("chat_template"), config_file), config_file
            if text is None:
                raise DataError(f"data.tokenizer={directory!r} has no chat template: looked for {jinja_file} and for "
                                f"\"chat_template\" in {config_file}; SFT renders conversations with the model's own "
                                "template: add one of them (the chat model's tokenizer_config.json has it)")
        specials = {}
        ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if not isinstance(value, str) and ids.get(key) is not None:
                value = tokenizer.token_text(ids[key])
            if isinstance(value, str):
                specials[key] = value
        return cls(text, source, specials)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``, with the generation markers' noncharacters kept.

        Raises:
          jinja2.TemplateError (or whatever the template raises): the template refuses them.
        """
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)

    def __repr__(self) -> str:
        return f"ChatTemplate({self.source!r}, generation_markers={self.has_generation_markers})"


def _template_from_config(value, config_file: str) -> str | None:
    """``chat_template`` of ``tokenizer_config.json``: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise DataError(f"{config_file}: chat_template is a list without a \"default\" template (names: "
                        f"{sorted(str(n) for n in named)})")
    raise DataError(f"{config_file}: chat_template is {type(value).__name__}, expected a string or a list of "
                    "{\"name\", \"template\"} objects")


def _strip_markers(text: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    """Removes the generation markers; returns the text and the character spans they enclosed."""
    out, spans, start, pos = [], [], None, 0
    for i, ch in enumerate(text):
        if ch == _GEN_OPEN or ch == _GEN_CLOSE:
            out.append(text[pos:i])
            pos = i + 1
            n = sum(map(len, out))
            if ch == _GEN_OPEN:
                if start is not None:
                    raise DataError(f"{where}: the chat template nests {{% generation %}} blocks")
                start = n
            else:
                spans.append((start, n))
                start = None
    out.append(text[pos:])
    return "".join(out), [s for s in spans if s[1] > s[0]]


def _render(template: ChatTemplate, messages: list[dict], where: str, *, add_generation_prompt: bool = False) -> str:
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt)
    except DataError:
        raise
    except Exception as e:  # a template may raise anything; raise_exception raises TemplateError
        raise DataError(f"{where}: the chat template ({template.source}) refuses this conversation: "
                        f"{type(e).__name__}: {e}") from None


def _clean(text: str) -> str:
    return text.replace(_GEN_OPEN, "").replace(_GEN_CLOSE, "")


def _assistant_turns(template: ChatTemplate, messages: list[dict], full: str,
                     where: str) -> list[tuple[int, int, int]]:
    """``(turn_start, content_end, turn_end)`` character offsets into ``full`` per assistant message
    (see the module docstring)."""
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = _as_prefix(_clean(_render(template, messages[: i + 1], where)), full)
        prompt = _clean(_render(template, messages[:i], where, add_generation_prompt=True))
        plain = _as_prefix(_clean(_render(template, messages[:i], where)), full)
        if through is None or plain is None:
            raise DataError(f"{where}: the chat template ({template.source}) renders the conversation up to message "
                            f"{i} differently from the start of the whole conversation, so the assistant's tokens "
                            "cannot be found by rendering prefixes; add {% generation %}...{% endgeneration %} "
                            "around the assistant's text in the template")
        content = message["content"]
        if through.startswith(prompt) and len(prompt) >= len(plain):
            start = len(prompt)
            found = _find_content(through, content, start)
            content_end = found[1] if found else start
        else:
            found = _find_content(through, content, len(plain))
            if found is None:
                raise DataError(f"{where}: message {i} (assistant): its content is not in the template's text after "
                                f"the previous messages ({template.source}); add {{% generation %}} markers to the "
                                "template")
            start, content_end = found
        if len(through) <= start:
            raise DataError(f"{where}: message {i} (assistant): the chat template ({template.source}) writes nothing "
                            "for it")
        turns.append((start, content_end, len(through)))
    return turns


def _as_prefix(text: str, full: str) -> str | None:
    """``text`` (a prefix of the conversation, rendered) as the start of ``full``: itself, or without
    the text a template writes only at the end of a conversation (Phi-3 ends one with its EOS);
    None when neither is a start of ``full``."""
    if full.startswith(text):
        return text
    for n in range(1, len(text) + 1):  # the shortest ending that text and full share and that explains it
        if text[-n:] == full[-n:] and full.startswith(text[:-n]):
            return text[:-n]
        if text[-n:] != full[-n:]:
            return None
    return None


def _find_content(text: str, content: str, start: int) -> tuple[int, int] | None:
    for c in (content, content.strip()):
        i = text.find(c, start)
        if i >= 0:
            return i, i + len(c)
    return None


def _overlapping(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    """bool [N]: tokens whose characters overlap ``[start, end)``."""
    return (offsets[:, 0] < end) & (offsets[:, 1] > start)


def tokenize_conversation(tokenizer: HFTokenizer, template: ChatTemplate, messages: list[dict],
                          where: str = "conversation") -> tuple[np.ndarray, np.ndarray]:
    """Renders, tokenizes and masks one conversation (see the module docstring for the rules).

    Args:
      tokenizer: the Hugging Face tokenizer whose template ``template`` is.
      template: from :meth:`ChatTemplate.from_tokenizer`.
      messages: checked messages (dicts with string ``role`` and ``content``), at least one of
        them the assistant's.
      where: names the conversation in error messages (``path:line``).

    Returns:
      ``(tokens, weights)``: int32 [N] ids and float32 [N] loss weights (1 on the assistant's
      tokens, their end-of-turn token included; 0 elsewhere).

    Raises:
      DataError: the template refuses the conversation, breaks the prefix rule, writes nothing for
        an assistant message, or its markers enclose no token.
    """
    rendered = _render(template, messages, where)
    full, marked = _strip_markers(rendered, where)
    ids, offsets = tokenizer.encode_chat(full)
    weights = np.zeros(ids.shape, np.float32)
    if template.has_generation_markers:
        for start, end in marked:
            weights[_overlapping(offsets, start, end)] = 1
        if not weights.any():
            raise DataError(f"{where}: the {{% generation %}} blocks of the chat template ({template.source}) enclose "
                            "no token of this conversation's assistant messages")
        return ids, weights
    special = tokenizer.special_mask[ids]
    for start, content_end, end in _assistant_turns(template, messages, full, where):
        stop = end
        eot = np.flatnonzero(special & (offsets[:, 0] >= content_end) & (offsets[:, 0] < end))
        if eot.size:
            stop = int(offsets[eot[0], 1])
        weights[_overlapping(offsets, start, stop)] = 1
    if not weights.any():
        raise DataError(f"{where}: no token of the assistant's turns survives tokenization ({tokenizer.path}); "
                        "check the tokenizer's normalizer")
    return ids, weights


def _source_files(source: str) -> list[tuple[Path, str]]:
    """``(path, id prefix)`` of the ``.jsonl`` files of ``source``: a file, a glob or a directory."""
    expanded = os.path.expanduser(source)
    if set("*?[") & set(expanded):
        base = glob_base(expanded)
        files = [(Path(m), Path(os.path.relpath(m, base)).as_posix())
                 for m in sorted(globlib.glob(expanded, recursive=True)) if os.path.isfile(m)]
    elif os.path.isdir(expanded):
        root = Path(expanded)
        files = [(p, p.relative_to(root).as_posix()) for p in sorted(root.rglob("*.jsonl")) if p.is_file()]
    elif os.path.isfile(expanded):
        files = [(Path(expanded), Path(expanded).name)]
    else:
        raise DataError(f"data.source={source!r}: no such file or directory, and no file matches it as a glob; "
                        "data.format=sft reads a .jsonl file of conversations (or a glob or directory of them)")
    if not files:
        raise DataError(f"data.source={source!r}: no .jsonl file found; data.format=sft reads .jsonl files of "
                        "conversations")
    return files


def _check_messages(record, where: str) -> list[dict]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}; {_MESSAGES_HELP}")
    if "messages" not in record:
        raise DataError(f"{where}: no field 'messages' (fields: {sorted(record)[:10]}); {_MESSAGES_HELP}")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list, got {messages!r:.80}; {_MESSAGES_HELP}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {k} is {type(m).__name__}, expected an object with 'role' and "
                            f"'content'; {_MESSAGES_HELP}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"{type(m[key]).__name__}, expected a string"
                raise DataError(f"{where}: message {k} has no usable {key!r} ({got}; keys: {sorted(m)}); "
                                f"{_MESSAGES_HELP}")
            if _GEN_OPEN in m[key] or _GEN_CLOSE in m[key]:
                raise DataError(f"{where}: message {k} holds the noncharacter U+FDD0 or U+FDD1, which moefast "
                                "reserves to mark the assistant's text")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message (roles: {[m['role'] for m in messages]}); SFT trains on "
                        "the assistant's turns only, so a conversation without one has nothing to learn")
    return messages


def iter_conversations(source: str) -> Iterator[Conversation]:
    """The conversations of ``source`` one file at a time (:func:`read_conversations` without the
    list: ``moefast prepare --format sft`` holds one file's lines at most).

    Raises:
      DataError: as :func:`read_conversations`, except that no conversation at all is not checked.
    """
    for path, rel in _source_files(source):
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read ({type(e).__name__}: {e.strerror or e})") from None
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                raise DataError(f"{where}: not valid JSON ({msg}); {_MESSAGES_HELP}") from None
            yield Conversation(f"{rel}:{lineno}", where, _check_messages(record, where), len(line))


def read_conversations(source: str) -> list[Conversation]:
    """Reads and checks every conversation of ``source``.

    Args:
      source: a ``.jsonl`` file, a glob of them, or a directory (its ``*.jsonl`` files, recursively).

    Returns:
      Conversations in sorted file order, then line order (blank lines skipped).

    Raises:
      DataError: no file; a file cannot be read; a line is not JSON or not an object, has no
        ``messages`` list, a message without a string ``role`` or ``content``, or no assistant
        message; or there is no conversation at all. The message names the file and line.
    """
    out = list(iter_conversations(source))
    if not out:
        raise DataError(f"data.source={source!r}: no conversation (every line is blank); {_MESSAGES_HELP}")
    return out


def split_examples(examples: list[SFTExample], val_fraction: float) -> tuple[list[SFTExample], list[SFTExample]]:
    """Train/validation split by a fixed hash of each example's id (as :func:`split_documents`).

    An example goes to validation iff ``blake2b(id) / 2**64 < val_fraction``. When that holds out
    nothing, the ``max(1, round(n * val_fraction))`` examples of smallest hash are held out
    instead (conversations are never cut in two).

    Returns:
      ``(train, val)`` in input order.

    Raises:
      DataError: fewer than 2 examples, or ``val_fraction`` not in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction: must be in (0, 1), got {val_fraction}")
    if len(examples) < 2:
        raise DataError(f"{len(examples)} usable conversation(s): SFT needs at least 2, one for training and one for "
                        "validation")
    h = [id_fraction(e.id) for e in examples]
    held = [x < val_fraction for x in h]
    if all(held) or not any(held):
        k = min(len(examples) - 1, max(1, round(len(examples) * val_fraction)))
        chosen = set(sorted(range(len(examples)), key=lambda i: h[i])[:k])
        held = [i in chosen for i in range(len(examples))]
    return ([e for e, v in zip(examples, held) if not v], [e for e, v in zip(examples, held) if v])


def load_sft(source: str, tokenizer: Tokenizer, *, seq_len: int, overlong: Overlong,
             val_fraction: float) -> tuple[PackedRows, PackedRows, SourceStats, SFTStats]:
    """Conversations to packed train and validation rows.

    Args:
      source: ``data.source``: a ``.jsonl`` file, glob or directory of conversations.
      tokenizer: a :class:`HFTokenizer` with a chat template beside its ``tokenizer.json``.
      seq_len: T, tokens per row; an example of N tokens has N - 1 targets and fits a row when
        N - 1 <= T.
      overlong: ``"truncate"``: an example that does not fit keeps its first T tokens
        (:func:`truncated_length`), and is left out if none of its targets there is the
        assistant's; ``"drop"``: it is left out.
      val_fraction: see :func:`split_examples`.

    Returns:
      ``(train, val, source_stats, sft_stats)``: two :class:`PackedRows` (examples never cross a
      row or attend to each other; see :func:`~moefast.data.packing.pack_documents`), what was read
      and what was made of it.

    Raises:
      DataError: any error of :func:`read_conversations`, :meth:`ChatTemplate.from_tokenizer`,
        :func:`tokenize_conversation` or :func:`split_examples`, or no example fits.
    """
    if overlong not in OVERLONG_CHOICES:
        raise DataError(f"data.sft_overlong: must be one of {OVERLONG_CHOICES}, got {overlong!r}")
    template = ChatTemplate.from_tokenizer(tokenizer)
    conversations = read_conversations(source)
    stats = SFTStats(conversations=len(conversations))
    source_stats = SourceStats(documents=len(conversations), bytes=sum(c.bytes for c in conversations),
                               source=source)
    examples = []
    for conv in conversations:
        stats.assistant_turns += sum(m["role"] == "assistant" for m in conv.messages)
        ids, weights = tokenize_conversation(tokenizer, template, conv.messages, conv.where)
        if len(ids) - 1 > seq_len:
            if overlong == "drop":
                stats.dropped_overlong += 1
                continue
            keep = truncated_length(seq_len)
            ids, weights = ids[:keep], weights[:keep]
            if not weights[1:].any():
                stats.dropped_no_target += 1
                continue
            stats.truncated += 1
        stats.tokens += len(ids)
        stats.weighted_tokens += int(weights[1:].sum())
        examples.append(SFTExample(conv.id, ids, weights))
    if not examples:
        raise DataError(f"data.source={source!r}: none of the {len(conversations)} conversations fits in "
                        f"data.seq_len={seq_len} tokens ({stats.summary()}); raise data.seq_len"
                        + (" or set data.sft_overlong=truncate" if overlong == "drop" else ""))
    train, val = split_examples(examples, val_fraction)
    rows = [pack_documents([e.tokens for e in part], seq_len, bos_id=None, eos_id=tokenizer.eos_id,
                           pad_id=tokenizer.pad_id, loss_weights=[e.weights for e in part])
            for part in (train, val)]
    return rows[0], rows[1], source_stats, stats

