"""The generated config reference is up to date, and the docs README points at exist."""

import dataclasses
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "scripts" / "gen_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_reference_is_up_to_date():
    gen = _generator()
    assert (REPO / "docs" / "config.md").read_text() == gen.render(), \
        "docs/config.md is out of date: run python scripts/gen_config_docs.py"


def test_config_reference_has_one_row_per_field():
    text = (REPO / "docs" / "config.md").read_text()
    for name, cls in _generator().config_sections():
        for f in dataclasses.fields(cls):
            rows = [line for line in text.splitlines() if line.startswith(f"| `{name}.{f.name}` |")]
            assert len(rows) == 1 and not rows[0].endswith("|  |"), f"{name}.{f.name}"


def test_a_field_without_a_docstring_entry_is_refused():
    import pytest

    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        """A section.

        Attributes:
          a, c: documented together.
        """

        a: int = 1
        b: int = 2
        c: str = "x"

    with pytest.raises(SystemExit, match=r"Undocumented\.b(?!,)"):
        _generator().render([("extra", Undocumented)])


def test_readme_links_exist():
    readme = (REPO / "README.md").read_text()
    for target in ("docs/architecture.md", "docs/config.md", "notebooks/routing.ipynb"):
        assert target in readme, target
    for link in re.findall(r"\]\(((?:docs|notebooks)/[^)#]+)", readme):
        assert (REPO / link).is_file(), link
