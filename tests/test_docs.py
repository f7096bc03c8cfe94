"""The generated config reference is up to date, the README's links resolve, and the documentation
site (mkdocs.yml, docs/, the API pages generated from the docstrings) builds with --strict."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (mkdocs.yml's toc slugify gives the same)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _without_code_blocks(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


def test_readme_links_exist():
    readme = (REPO / "README.md").read_text()
    for target in ("docs/architecture.md", "docs/config.md", "notebooks/routing.ipynb"):
        assert target in readme, target
    links = re.findall(r"\]\(((?:docs|notebooks)/[^)#]+)", readme)
    assert len(links) >= 10, links
    for link in links:
        assert (REPO / link).is_file(), link
    headings = {_github_anchor(h) for h in re.findall(r"^#+ (.+)$", _without_code_blocks(readme), re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", readme):
        assert anchor in headings, f"README links #{anchor}, which is none of its headings"


def test_ci_runs_the_readme_test_command():
    command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in command and command in (REPO / "README.md").read_text(), \
        ".ci/run must run the README's test command verbatim"


def test_api_reference_lists_the_top_level_api():
    import moefast

    text = (REPO / "docs" / "api" / "index.md").read_text()
    missing = [name for name in moefast.__all__ if f"`{name}`" not in text]
    assert not missing, f"docs/api/index.md does not list moefast.{missing}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed: the docs extra, pip install -c constraints.txt -e '.[test,docs]'")
def test_docs_site_builds_strict(tmp_path):
    """mkdocs build --strict (mkdocs.yml sets strict too): a broken link or anchor, a page left out of
    the nav, an API entry that does not exist or a docstring parameter not in its signature fails."""
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    log = "\n".join(line for line in (result.stdout + result.stderr).splitlines() if not line.startswith("INFO"))
    assert result.returncode == 0, f"mkdocs build --strict failed (run it to see):\n{log[-6000:]}"
    # The README's links to a heading of a docs page (GitHub's anchors) point at one the site has.
    readme = (REPO / "README.md").read_text()
    for page, anchor in re.findall(r"\]\(docs/([^)#]+)\.md#([^)]+)\)", readme):
        html = site / (page.removesuffix("index") if page.endswith("index") else page + "/") / "index.html"
        assert f'id="{anchor}"' in html.read_text(), f"README links docs/{page}.md#{anchor}: no such heading"
