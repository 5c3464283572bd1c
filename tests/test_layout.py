"""The repository's shape: no import circle among strata/ and link/ modules at run time, no module imported by a
computed name, few loose modules at strata/'s top, every module docs/internals.md names exists, test modules that
import no other test module."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("strata", "link")
MAX_LOOSE = 4


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root's PACKAGES (a package is its __init__)."""
    out = {}
    for base in PACKAGES:
        for p in sorted((root / base).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports when it runs: at module level and inside functions alike, except under
    `if TYPE_CHECKING:`. `from pkg import sub` names the submodule when `sub` is one, else the package."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.If) and _is_type_checking(ch.test):
                for c in ch.orelse:
                    visit(c)
                continue
            if isinstance(ch, ast.Import):
                out.update(r for a in ch.names if (r := resolve(a.name)))
            elif isinstance(ch, ast.ImportFrom):
                if ch.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - (ch.level - 1)]
                    base = ".".join(up + ([ch.module] if ch.module else []))
                else:
                    base = ch.module or ""
                for a in ch.names:
                    r = f"{base}.{a.name}" if f"{base}.{a.name}" in known else resolve(base)
                    if r:
                        out.add(r)
            visit(ch)

    visit(ast.parse(path.read_text(), str(path)))
    out.discard(name)
    return out


def import_circles(root: Path) -> list[list[str]]:
    """Every strongly connected set of two or more modules in the run-time import graph (Tarjan)."""
    known = modules(root)
    edges = {m: sorted(imports_of(m, p, known)) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in edges:
        if v not in index:
            connect(v)
    return circles


def test_no_import_circle_at_run_time():
    assert import_circles(ROOT) == []


def test_the_circle_finder_finds_circles_inside_functions_and_ignores_type_checking(tmp_path):
    pkg = tmp_path / "strata"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "link").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from strata.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from strata import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from strata import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert import_circles(tmp_path) == [["strata.a", "strata.sub.b"]]


def test_no_module_is_imported_by_a_computed_name():
    bad = []
    for name, path in modules(ROOT).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in ("import_module", "__import__"):
                    arg = node.args[0] if node.args else None
                    literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                    if not literal or arg.value.split(".")[0] in PACKAGES:
                        bad.append(f"{name}:{node.lineno}")
    assert bad == []


def test_few_loose_modules_at_the_top_of_strata():
    loose = sorted(p.name for p in (ROOT / "strata").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE, loose


def test_every_module_internals_names_exists():
    text = (ROOT / "docs" / "internals.md").read_text()
    named = set(re.findall(r"`((?:strata|link|native|bench|tools|tests)/[\w/.*-]+\.(?:py|c|cu|cuh|h|md))`", text))
    assert len(named) > 40                       # the module map is there and read
    missing = sorted(n for n in named if not list(ROOT.glob(n)))
    assert missing == []


def test_no_test_module_imports_another():
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    bad = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.level or node.module == "tests":        # from . import test_x, from tests import test_x
                    names += [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                if n.rpartition(".")[2] in tests:
                    bad.append(f"{p.name}:{node.lineno} imports {n}")
    assert bad == []
