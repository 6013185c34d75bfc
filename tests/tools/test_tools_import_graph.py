"""The command modules import one another in one direction only: no
module of ``mlx_dualnorm.tools`` reaches itself through its imports,
imports inside functions (the lazy ones) included. ``mlx_lm_bench`` once
imported ``mlx_lm_launcher`` to start the ranks and was imported back by it
to write the JSON report."""

from __future__ import annotations

import ast
import pathlib

import mlx_dualnorm.tools

TOOLS_DIR = pathlib.Path(mlx_dualnorm.tools.__file__).resolve().parent
PACKAGE = "mlx_dualnorm.tools"


def tools_imports() -> dict[str, set[str]]:
    """Each tools module -> the tools modules it imports anywhere in it."""
    modules = {path.stem for path in TOOLS_DIR.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for module in modules:
        imported: set[str] = set()
        for node in ast.walk(ast.parse((TOOLS_DIR / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == PACKAGE:  # from mlx_dualnorm.tools import command
                    imported.update(alias.name for alias in node.names)
                elif node.module.startswith(PACKAGE + "."):
                    imported.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                imported.update(
                    alias.name.split(".")[2] for alias in node.names
                    if alias.name.startswith(PACKAGE + ".")
                )
        graph[module] = (imported & modules) - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as the path around it, or [] when it has none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return []


def test_the_walk_sees_the_imports():
    graph = tools_imports()
    assert "mlx_lm_launcher" in graph["mlx_lm_bench"]  # a lazy import, inside a function
    assert "command" in graph["benchmark"]
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_no_tools_module_imports_itself_round_about():
    assert find_cycle(tools_imports()) == []
