"""The house rules docs/design.md states, checked on the import graph and the source.

* the layers contract of pyproject.toml (``[tool.importlinter]``): nothing imports what is above
  it, direct or through another module;
* no import cycle between any two modules, imports inside functions included;
* an import of memkit inside a function says why on its line (the commands of ``cli/`` import
  what they run when they run it, so that ``memkit --help`` stays torch-free: its docstring says
  so once);
* every :class:`~memkit.advice.Advice` is made in ``memkit/advice/``, and each of its codes has a
  row and a section in docs/advice.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memkit"
LAZY_BY_DESIGN = ("cli",)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("memkit", exclude_type_checking_imports=True, cache_dir=None)


def test_the_layers_contract_is_kept(monkeypatch, capsys):
    """(import-linter configures logging as its command does, which disables every logger
    made before it: memkit's are put back, or a later test in the process misses their
    warnings.)"""
    import logging

    monkeypatch.chdir(ROOT)
    loggers = [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    before = [(found, found.disabled) for found in loggers]
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        code = lint_imports(
            config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True
        )
    finally:
        for found, was in before:
            found.disabled = was
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert code == 0, capsys.readouterr().out


def _cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle among the modules, or ``None`` (an iterative depth-first search)."""
    done: set[str] = set()
    for start in sorted(graph.modules):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph.find_modules_directly_imported_by(start)))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph.find_modules_directly_imported_by(nxt))))
    return None


def test_no_module_is_in_an_import_cycle(graph):
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_cycle_search_finds_a_cycle():
    """The search above can fail: a two-module cycle is found."""
    g = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c"):
        g.add_module(name)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    assert _cycle(g) is None
    g.add_import(importer="p.c", imported="p.b")
    assert _cycle(g) == ["p.b", "p.c", "p.b"]


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _late_memkit_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of each import of memkit inside a function of ``path``."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for sub in ast.walk(node):
            names = (
                [sub.module or ""]
                if isinstance(sub, ast.ImportFrom)
                else [a.name for a in sub.names]
                if isinstance(sub, ast.Import)
                else []
            )
            if any(n == "memkit" or n.startswith("memkit.") for n in names):
                out.append((sub.lineno, " ".join(lines[sub.lineno - 1 : sub.end_lineno])))
    return sorted(set(out))


def test_a_late_import_of_memkit_says_why():
    unexplained = [
        f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
        for path in _sources()
        if path.relative_to(PACKAGE).parts[0] not in LAZY_BY_DESIGN
        for line, text in _late_memkit_imports(path)
        if "#" not in text
    ]
    assert not unexplained, "\n".join(unexplained)


def test_the_lazy_package_says_why_it_imports_late():
    for name in LAZY_BY_DESIGN:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        assert "torch" in doc and "import" in doc, f"memkit/{name}/__init__.py: {doc[:200]!r}"


def test_every_advice_is_made_in_the_advice_package():
    makers = []
    for path in _sources():
        if path.relative_to(PACKAGE).parts[0] == "advice":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Advice":
                makers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not makers, "Advice made outside memkit/advice/: " + ", ".join(makers)


def test_every_advice_code_is_in_docs_advice_md():
    codes: set[str] = set()
    for path in (PACKAGE / "advice").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            literal = isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant)
            if literal and node.arg == "code":  # not a copy's ``code=a.code``
                codes.add(node.value.value)
    assert len(codes) > 20  # the walk found the rules
    doc = (ROOT / "docs" / "advice.md").read_text(encoding="utf-8")
    table = {
        c for line in doc.splitlines() if line.startswith("| `") for c in line.split("`")[1::2]
    }
    headings = {
        code
        for line in doc.splitlines()
        if line.startswith("## ")
        for code in line[3:].replace(",", " ").split()
    }
    missing = sorted(c for c in codes if c not in table or c not in headings)
    assert not missing, f"codes without a row and a section in docs/advice.md: {missing}"


def test_the_checks_read_the_whole_package():
    """The source walks above see every module the import graph has (none skipped)."""
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in _sources()
    }
    assert modules == set(grimp.build_graph("memkit", cache_dir=None).modules)
