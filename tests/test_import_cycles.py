"""No import cycles inside mppo: module A importing B (at the top, under TYPE_CHECKING or inside a function) while
B imports A. A cycle means neither module can be read, tested or moved without the other."""
from __future__ import annotations

import ast
from pathlib import Path

import mppo

ROOT = Path(mppo.__file__).parent
# plan() asks knobs for suggestions, and knobs re-plans trial configs with plan(): one algorithm in two files.
ALLOWED = [{"mppo.plan.knobs", "mppo.plan.planner"}]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every mppo module `path` imports, wherever in the file the import is."""
    name, found = _module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_inside_mppo():
    paths = list(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    # a package's __init__ re-exporting its modules is not a cycle with them: leave packages out
    packages = {_module_name(p) for p in paths if p.name == "__init__.py"}
    graph = {_module_name(p): _imports(p, modules) - packages for p in paths if p.name != "__init__.py"}
    assert [c for c in _cycles(graph) if c not in ALLOWED] == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
