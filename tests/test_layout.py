"""The source tree stays readable: short functions, classes and files, no import cycle, and titan stands alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MODULES = {
    ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p for p in SRC.rglob("*.py")
}
LIMITS = {"function": 60, "class": 250, "file": 400}


def _oversized(path: Path) -> list[str]:
    text = path.read_text()
    found = [f"file {path.name}: {text.count(chr(10))} lines"] if text.count("\n") > LIMITS["file"] else []
    for node in ast.walk(ast.parse(text)):
        kind = ("function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else "class" if isinstance(node, ast.ClassDef) else None)
        if kind and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
            found.append(f"{kind} {node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines")
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_class_or_file_is_too_long(module):
    assert _oversized(MODULES[module]) == [], f"limits {LIMITS}"


def _module_level_imports(module: str) -> set[str]:
    """Project modules imported when `module` is imported (not those imported inside functions or only for
    type checking)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {t for t in targets if t in MODULES and t != module}


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_import_graph_has_no_cycle():
    graph = {m: _module_level_imports(m) for m in MODULES}
    assert _find_cycle(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_titan_never_imports_lcsm_or_morphens():
    for module, path in MODULES.items():
        if module.startswith("titan"):
            names = {n.module or "" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
            names |= {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import)
                      for a in n.names}
            assert not {n.split(".")[0] for n in names} & {"lcsm", "morphens"}, module
