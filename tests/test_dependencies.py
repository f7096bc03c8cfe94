"""moefast's imports point one way (docs/architecture.md, "Dependencies point one way").

Every module of ``moefast/`` and ``kernels/`` (installed as ``moefast.kernels``) is parsed with
``ast``; every ``import`` and ``from ... import`` in it counts, at module level or inside a
function, relative ones resolved (only those under ``if TYPE_CHECKING:`` are left out: they never
run). ``from package import name`` is an edge to ``package.name`` when that is a module, else to
the package's ``__init__``. From that graph of moefast-internal imports:

* no cycle (a cycle means a module sees the other half-initialised, or a helper in the wrong place);
* the layers: ``kernels`` imports nothing of moefast; ``routing`` and ``parallel`` import neither
  ``model`` nor ``data``, ``train``, ``cli``, ``bench``; ``model`` imports neither ``data``,
  ``train``, ``cli`` nor ``bench``; ``data`` and ``train`` import neither ``cli`` nor ``bench``;
  only ``moefast/__main__.py`` imports ``cli`` (the ``moefast/cli/`` package; its own modules import
  each other).
"""

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"moefast": REPO / "moefast", "moefast.kernels": REPO / "kernels"}

# (importer prefix, forbidden imported prefixes): a module whose name starts with the first may not
# import a module whose name starts with any of the second.
LAYERS = [
    ("moefast.kernels", ("moefast.",)),  # except moefast.kernels itself, see _forbidden
    ("moefast.routing", ("moefast.model", "moefast.data", "moefast.train", "moefast.cli", "moefast.bench")),
    ("moefast.parallel", ("moefast.model", "moefast.data", "moefast.train", "moefast.cli", "moefast.bench")),
    ("moefast.model", ("moefast.data", "moefast.train", "moefast.cli", "moefast.bench")),
    ("moefast.data", ("moefast.cli", "moefast.bench")),
    ("moefast.train", ("moefast.cli", "moefast.bench")),
    ("moefast", ("moefast.cli",)),  # only moefast.__main__ (and the cli package itself) may import the command line
]

# Known exceptions, each with the reason it is allowed: (importer, imported) -> why. Empty: add an
# entry only for a violation that cannot be fixed now, and say what would fix it.
ALLOWED: dict[tuple[str, str], str] = {}


def _module_names(roots: dict[str, Path] = ROOTS) -> dict[str, Path]:
    """Module name -> file, for every .py file under the roots (package name -> directory)."""
    out = {}
    for prefix, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([prefix, *parts])
            if name.startswith("moefast.kernels") and prefix == "moefast":
                continue  # no moefast/kernels directory is expected; kernels/ is the package
            out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes of a module, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the moefast modules it imports."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for t in targets:
                # `import moefast.data.tokenizer` names that module; a name not a module is its package's
                while t and t not in modules and "." in t:
                    t = t.rpartition(".")[0]
                if t in modules and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """``(cycle, component)`` per strongly connected component of more than one module (Tarjan's
    algorithm): one concrete cycle through it, and all its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in components:  # a concrete cycle inside the component: walk from its first module
        start = min(comp)
        path, seen = [start], {start}
        while True:
            nxt = min(w for w in graph[path[-1]] if w in comp)
            if nxt in seen:
                out.append((path[path.index(nxt):] + [nxt], sorted(comp)))
                break
            path.append(nxt)
            seen.add(nxt)
    return out


@functools.cache
def _project_graph() -> dict[str, set[str]]:
    return _graph(_module_names())


def _forbidden(importer: str, imported: str) -> bool:
    for prefix, banned in LAYERS:
        if importer == prefix or importer.startswith(prefix + "."):
            if prefix == "moefast" and importer == "moefast.__main__":
                continue
            if prefix == "moefast" and (importer + ".").startswith("moefast.cli.") and (
                    imported + ".").startswith("moefast.cli."):
                continue  # the command line's modules (moefast/cli/) import each other
            if prefix == "moefast.kernels" and (imported + ".").startswith("moefast.kernels."):
                continue
            if any(imported == b.rstrip(".") or imported.startswith(b.rstrip(".") + ".") for b in banned):
                return True
    return False


def test_the_walk_sees_every_part():
    graph = _project_graph()
    for part in ("moefast.kernels.routing.ops", "moefast.routing", "moefast.parallel.expert", "moefast.model.moe",
                 "moefast.data.pipeline", "moefast.train.loop", "moefast.cli", "moefast.bench.process"):
        assert part in graph, part
    # function-level and relative imports are seen
    assert "moefast.data.tokenizer_registry" in graph["moefast.data.pipeline"]
    assert "moefast.cli" in graph["moefast.__main__"]
    assert "moefast.bench.malloc" in graph["moefast.cli.bench"]  # imported inside a function
    assert "moefast.cli.bench" in graph["moefast.cli"]
    assert "moefast.kernels.platform" in graph["moefast.kernels.routing"]  # `from ..platform import ...`


def test_relative_function_level_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "moefast"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("from .a import f\n")
    (pkg / "data" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from moefast import cli\n"
                                       "def f():\n    from ..data import b\n    from . import b as c\n")
    (pkg / "data" / "b.py").write_text("import moefast.data.a.f\nfrom .. import cli\n")
    graph = _graph(_module_names({"moefast": pkg}))
    assert graph == {"moefast": set(), "moefast.cli": set(), "moefast.data": {"moefast.data.a"},
                     "moefast.data.a": {"moefast.data.b"}, "moefast.data.b": {"moefast.data.a", "moefast.cli"}}
    assert _cycles(graph) == [(["moefast.data.a", "moefast.data.b", "moefast.data.a"],
                               ["moefast.data.a", "moefast.data.b"])]


def test_no_import_cycles():
    cycles = _cycles(_project_graph())
    assert not cycles, "import cycles:\n" + "\n".join(f"{' -> '.join(c)} (modules importing each other: "
                                                     f"{', '.join(comp)})" for c, comp in cycles)


def test_dependencies_point_one_way():
    graph = _project_graph()
    bad = sorted((a, b) for a, edges in graph.items() for b in edges
                 if _forbidden(a, b) and (a, b) not in ALLOWED)
    assert not bad, ("imports against the one-way rule (docs/architecture.md):\n"
                     + "\n".join(f"{a} imports {b}" for a, b in bad))
    stale = [k for k in ALLOWED if k[1] not in graph.get(k[0], set())]
    assert not stale, f"allowed exceptions that no longer happen; remove them: {stale}"


def test_the_checks_catch_what_they_should():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [(["a", "b", "c", "a"], ["a", "b", "c"])]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _forbidden("moefast.kernels.routing.ops", "moefast.config")
    assert not _forbidden("moefast.kernels.routing.ops", "moefast.kernels.platform")
    assert _forbidden("moefast.parallel.mesh", "moefast.model.layout")
    assert _forbidden("moefast.bench.peers", "moefast.cli") and not _forbidden("moefast.__main__", "moefast.cli")
    assert _forbidden("moefast.bench.peers", "moefast.cli.bench") and _forbidden("moefast.train.loop", "moefast.cli.hf")
    assert not _forbidden("moefast.cli", "moefast.cli.bench") and not _forbidden("moefast.cli.hf", "moefast.cli.common")
    assert not _forbidden("moefast.train.loop", "moefast.model")


def test_a_session_at_the_checkout_root_imports_the_installed_kernels_package(tmp_path):
    """Python started at the checkout's root has the root first on ``sys.path``, where ``kernels/``
    (moefast.kernels) sits: ``import kernels`` still gives the installed ``kernels`` distribution (a
    stand-in of Hugging Face's here, which transformers imports), with its submodules, and
    ``moefast.kernels`` is unaffected; with no such distribution the import fails as it would
    anywhere else."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("from .layers import CUDAProperties\n")
    (site / "kernels" / "layers.py").write_text("class CUDAProperties:\n    pass\n")
    (site / "kernels-0.12.0.dist-info").mkdir()
    (site / "kernels-0.12.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.12.0\n")
    code = ("import kernels, importlib.metadata, moefast.kernels, moefast.kernels.routing\n"
            "from kernels import CUDAProperties\n"
            "print(kernels.__file__, importlib.metadata.version('kernels'), moefast.kernels.__file__)\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    found, version, ours = got.stdout.split()
    assert Path(found) == site / "kernels" / "__init__.py" and version == "0.12.0"
    assert Path(ours) == REPO / "kernels" / "__init__.py"
    env.pop("PYTHONPATH")  # -S: without site-packages, where a real kernels distribution may be installed
    code = ("import kernels\nassert kernels.__file__ is None and not list(kernels.__path__)\n"
            "try:\n    from kernels import CUDAProperties\nexcept ImportError:\n    print('absent')\n")
    got = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert got.returncode == 0 and got.stdout == "absent\n", got.stderr
    # transformers' own check (it imports the name when no distribution metadata is found): at the
    # root the same answer as anywhere else
    code = "from transformers.utils import import_utils as u\nprint(u.is_kernels_available())\n"
    at_root, elsewhere = (subprocess.run([sys.executable, "-c", code], cwd=where, env=env, capture_output=True,
                                         text=True) for where in (REPO, tmp_path))
    assert at_root.returncode == 0 and at_root.stdout == elsewhere.stdout, at_root.stderr


def test_a_wheel_holds_every_package_and_data_file():
    """pyproject.toml's explicit ``packages`` list names every package folder of ``moefast/`` and
    ``kernels/`` (an editable install finds a missing one anyway; a wheel silently leaves it out),
    and ``package-data`` covers every non-Python file inside them."""
    import fnmatch
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    data = tool.get("package-data", {})
    for root_name, root in ROOTS.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            package = ".".join((root_name, *rel))
            assert package in listed, f"pyproject.toml [tool.setuptools] packages lacks {package!r}"
            for f in init.parent.iterdir():
                if f.is_file() and f.suffix not in (".py", ".pyc") and not f.name.startswith("."):
                    raise AssertionError(f"{f}: a data file directly in a package; give it a folder and package-data")
            for sub in init.parent.iterdir():
                if sub.is_dir() and not (sub / "__init__.py").exists() and sub.name != "__pycache__":
                    for f in sub.rglob("*"):
                        if f.is_file() and "__pycache__" not in f.parts:
                            rel_f = f.relative_to(init.parent).as_posix()
                            assert any(fnmatch.fnmatch(rel_f, pat) for pat in data.get(package, [])), \
                                f"pyproject.toml package-data of {package!r} does not cover {rel_f}"
