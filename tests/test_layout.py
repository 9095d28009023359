"""The package's shape, read from its source: layers that import only downwards, no import circles and no
module-level mutable state.

An import circle (function-level imports included: they only hide one) means two modules that cannot be read,
changed or tested apart; module-level mutable state means a result that depends on what ran before in the process.
Both are read with ``ast``, without importing anything. What is left of either is listed below, by name: the
lists only shrink (a new circle or new state fails, and so does an entry that no longer holds, until it is
removed from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_ulysses"
HOW_IT_WORKS = PACKAGE.parent / "docs" / "how-it-works.md"

REMAINING_CIRCLES: list[list[str]] = []
"""None left: the loss reads the context the strategy publishes (``LossContext``), not the strategy."""

REMAINING_STATE: list[str] = []
"""None left: the ring layout, the per-batch cache of gathered position ids and the observer of the all-to-alls live
on the parallel-groups object (``lightning_ulysses.groups.SequenceParallelGroups``)."""

MUTATING_METHODS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
    }
)


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(), filename=str(path))
    return modules


def _package_of(name: str, tree: ast.Module, modules: dict[str, ast.Module]) -> str:
    is_package = any(other.startswith(name + ".") for other in modules)
    return name if is_package else name.rpartition(".")[0]


def _imports(name: str, tree: ast.Module, modules: dict[str, ast.Module]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its body."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(name, tree, modules).split(".")
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
    assert _circles(graph) == REMAINING_CIRCLES


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _mutable_state(name: str, tree: ast.Module, modules: dict[str, ast.Module]) -> list[str]:
    """What in module ``name`` changes module-level state: ``global`` statements, mutation of a module-level
    container, and assignment to an attribute of another package module (monkeypatching)."""
    problems = []
    containers = {
        target.id
        for statement in tree.body
        if isinstance(statement, (ast.Assign, ast.AnnAssign))
        and isinstance(statement.value, (ast.Dict, ast.List, ast.Set, ast.Call))
        for target in (statement.targets if isinstance(statement, ast.Assign) else [statement.target])
        if isinstance(target, ast.Name)
    }
    imported_modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported_modules.update(
                alias.asname or alias.name for alias in node.names if f"{node.module}.{alias.name}" in modules
            )
        elif isinstance(node, ast.Import):
            imported_modules.update(alias.asname or alias.name for alias in node.names if alias.name in modules)
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            where = f"{name}:{node.lineno}" if hasattr(node, "lineno") else name
            if isinstance(node, ast.Global):
                problems.append(f"{where} global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in containers and node.func.attr in MUTATING_METHODS:
                    problems.append(f"{where} {owner.id}.{node.func.attr}(...)")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Name)
                        and target.value.id in containers
                    ):
                        problems.append(f"{where} {target.value.id}[...] changed")
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id in imported_modules
                    ):
                        problems.append(f"{where} {target.value.id}.{target.attr} assigned")
    return problems


def test_no_module_level_mutable_state() -> None:
    modules = _modules()
    problems = [problem for name, tree in modules.items() for problem in _mutable_state(name, tree, modules)]
    without_lines = [f"{where.split(':')[0]} {what}" for where, what in (p.split(" ", 1) for p in problems)]
    assert sorted(without_lines) == REMAINING_STATE


def test_the_state_finder_finds_state() -> None:
    source = (
        "from lightning_ulysses import other\n_CACHE = {}\n_last = None\n"
        "def f():\n    global _last\n    _CACHE[1] = 2\n    _CACHE.pop(1)\n    other.value = 3\n"
    )
    modules = {"lightning_ulysses.m": ast.parse(source), "lightning_ulysses.other": ast.parse("")}
    problems = _mutable_state("lightning_ulysses.m", modules["lightning_ulysses.m"], modules)
    assert sorted(problem.split(" ", 1)[1] for problem in problems) == [
        "_CACHE.pop(...)",
        "_CACHE[...] changed",
        "global _last",
        "other.value assigned",
    ]


def _layers(markdown: str) -> list[list[str]]:
    """The rows of the table under ``## Layers`` in docs/how-it-works.md, top layer first: each row's modules (the
    first part of a module's name below ``lightning_ulysses``; ``__init__`` for the package itself)."""
    section = markdown.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    return [[cell.strip(" `") for cell in row.split("|")[2].split(",")] for row in rows]


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Every import of a module from a layer above its own (``layers`` top first)."""
    height = {unit: len(layers) - i for i, row in enumerate(layers) for unit in row}
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        for target in targets
        if height[_unit(target)] > height[_unit(name)]
    )


def test_every_module_has_one_layer() -> None:
    layers = _layers(HOW_IT_WORKS.read_text())
    placed = [unit for row in layers for unit in row]
    units = {_unit(name) for name in _modules()}
    assert sorted(placed) == sorted(set(placed)), "a module is in two layers"
    assert units == set(placed), f"without a layer: {units - set(placed)}; no such module: {set(placed) - units}"


def test_imports_go_down_the_layers() -> None:
    modules = _modules()
    graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
    assert _upward_imports(graph, _layers(HOW_IT_WORKS.read_text())) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    layers = _layers("\n## Layers\n\n| layer | modules |\n|---|---|\n| top | `b` |\n| bottom | `a`, `c` |\n")
    assert layers == [["b"], ["a", "c"]]
    graph = {"lightning_ulysses.a": {"lightning_ulysses.b.x"}, "lightning_ulysses.b.x": {"lightning_ulysses.c"}}
    assert _upward_imports(graph, layers) == ["lightning_ulysses.a imports lightning_ulysses.b.x"]
