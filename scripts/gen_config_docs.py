#!/usr/bin/env python
"""Writes docs/config.md, the reference of every config field, from moefast/config/.

Each section is a frozen dataclass of :mod:`moefast.config`; the type and default of a field come
from the dataclass, its meaning from the ``Attributes:`` entry of the class docstring (an entry may
name several fields: ``a, b: ...``). A field without an entry is an error, so the reference cannot
silently fall behind the code. ``--check`` exits 1 when docs/config.md differs from what would be
written (tests/test_docs.py runs it)::

    python scripts/gen_config_docs.py          # rewrite docs/config.md
    python scripts/gen_config_docs.py --check  # is it up to date?
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "config.md"


def _attributes(cls) -> dict[str, str]:
    """``{field: meaning}`` from the ``Attributes:`` block of ``cls``'s docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return {}
    entries: dict[str, list[str]] = {}
    names: list[str] = []
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next docstring section
        m = re.match(r"^  ([A-Za-z_][\w, /]*):(?:\s+(.*))?$", line)
        if m:
            names = [n.strip() for n in re.split(r"[,/]", m.group(1)) if n.strip()]
            for n in names:
                entries[n] = [m.group(2) or ""]
        elif line.strip() and names:
            for n in names:
                entries[n].append(line.strip())
    return {n: " ".join(t for t in text if t) for n, text in entries.items()}


def _md(text: str) -> str:
    """reStructuredText roles and literals of the docstrings as markdown code."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _first_paragraph(doc: str) -> str:
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _type_name(tp) -> str:
    if isinstance(tp, str):
        return tp
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`".replace("'", '"') for a in typing.get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return "(required)"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, str):
        return f'`"{v}"`'
    if isinstance(v, tuple):
        return f"`{list(v)}`"
    return f"`{v}`"


def config_sections() -> list[tuple[str, type]]:
    """``(name, dataclass)`` of each section of :class:`moefast.config.ExperimentConfig`, in order."""
    from moefast import config  # the installed package (pip install -e .): configs/ is moefast.configs

    hints = typing.get_type_hints(config.ExperimentConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(config.ExperimentConfig)
            if dataclasses.is_dataclass(hints[f.name])]


def render(sections: list[tuple[str, type]] | None = None) -> str:
    """The text of docs/config.md for ``sections`` (default: :func:`config_sections`).

    Raises:
      SystemExit: a field has no ``Attributes:`` entry in its section's docstring (names it).
    """
    sections = config_sections() if sections is None else sections
    out = ["# Config reference", "",
           "Every field of the experiment config (`moefast/config/`), by section: its type, default and "
           "meaning. Set them in a YAML file (`--config`, see `configs/`) or on the command line as "
           "`section.key=value` overrides (later ones win), e.g. `moefast train moe.top_k=1 train.steps=200`. "
           "A typo is refused with the valid keys.", "",
           "Generated from the dataclasses and their docstrings by `python scripts/gen_config_docs.py`; "
           "`tests/test_docs.py` fails when this file is out of date. Do not edit it by hand.", ""]
    missing = []
    out += ["## Sections", ""]
    out += [f"- [`{name}`](#{name}): {_md(_first_paragraph(cls.__doc__).split('. ')[0].rstrip('.'))}."
            for name, cls in sections]
    out += ["- `name` (str, default `\"tiny\"`): the experiment's name; the default run directory is `runs/<name>`.", ""]
    for name, cls in sections:
        doc = inspect.cleandoc(cls.__doc__ or "")
        intro = doc.split("\nAttributes:")[0].strip()
        attrs = _attributes(cls)
        hints = typing.get_type_hints(cls)
        out += [f"## {name}", "", _md(" ".join(intro.split())), "", "| key | type | default | meaning |",
                "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            meaning = attrs.get(f.name)
            if not meaning:
                missing.append(f"{cls.__name__}.{f.name}")
                continue
            cell = _md(meaning).replace("|", "\\|")
            out.append(f"| `{name}.{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {cell} |")
        out.append("")
    if missing:
        raise SystemExit("gen_config_docs: no 'Attributes:' entry in the class docstring for: " + ", ".join(missing)
                         + " (document each field where it is defined, in moefast/config/)")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is not what would be written")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(REPO)} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
