"""The package structure holds: no import circle between packages, no
Python file over its size limit.

The graph is read from the source with ``ast`` (nothing is imported): a
node is a package under ``kvferry`` (``kvferry.core``, ``kvferry.serve``,
...) or a top-level module (``kvferry.messages``, ``kvferry.config``).
Every import counts, one made inside a function too (a lazy import still
ties the two packages together), except those under ``if TYPE_CHECKING:``,
which never run.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "kvferry"

MAX_LINES = 700
# Tighter limits for the files that grow fastest (issue 45).
FILE_LIMITS = {"core/scheduler.py": 550, "serve/engine_client.py": 350}
# Files over their limit today, each split on a branch in flight: strict
# xfail, so the marker must go the moment the file meets its limit.
OVER_LIMIT_TODAY: dict[str, str] = {}


def _node(module: str) -> str | None:
    """``kvferry.core.scheduler`` -> ``core``; ``kvferry`` itself -> None."""
    parts = module.split(".")
    if parts[0] != "kvferry" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolve against this module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    if stem == "kvferry":  # ``from kvferry import messages`` names a module; ``import LLM`` the root's re-export
        return [f"kvferry.{a.name}" for a in node.names
                if (PKG / f"{a.name}.py").exists() or (PKG / a.name / "__init__.py").exists()]
    return [stem]


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(target module, line) of every import that runs."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, module, is_package):
                    yield target, child.lineno
            else:
                stack.append(child)


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> ["module:line", ...]"""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        source = _node(module)
        if source is None:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for target, line in _imports(tree, module, path.name == "__init__.py"):
            dest = _node(target)
            if dest is not None and dest != source:
                edges[source][dest].append(f"{module}:{line}")
    return edges


def _cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_packages():
    edges = package_graph()
    cycles = _cycles(edges)
    detail = []
    for component in cycles:
        for a in component:
            for b in component:
                if b in edges.get(a, {}):
                    detail.append(f"  {a} -> {b}: {', '.join(edges[a][b][:4])}")
    assert not cycles, "import circles between packages:\n" + "\n".join(map(str, cycles)) + "\n" + "\n".join(detail)


def test_the_graph_sees_known_edges():
    # The checker itself: it must see a top-level, a lazy (in-function) and a
    # relative import, and skip TYPE_CHECKING ones.
    edges = package_graph()
    assert "types" in edges["messages"]                  # top-level
    assert "messages" in edges["core"]
    assert "engine" in edges["bench"]                    # bench.cli's lazy import of the engine
    assert "fleet" not in edges.get("router", {})        # router/supervisor.py: TYPE_CHECKING only


def _python_files():
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("rel", _python_files())
def test_file_size(rel: str, request):
    limit = FILE_LIMITS.get(rel, MAX_LINES)
    if rel in OVER_LIMIT_TODAY:
        request.applymarker(pytest.mark.xfail(reason=OVER_LIMIT_TODAY[rel], strict=True))
    lines = len((PKG / rel).read_text().splitlines())
    assert lines <= limit, f"{rel}: {lines} lines, limit {limit}"
