"""The package's import graph, read from the source (imports inside
functions, the lazy ones, included): no module reaches itself through its
imports; the product (the facade and the integration) imports nothing of
the commands; the commands stand on the package's public API; and each
command stays small. ``mlx_lm_bench`` once imported its rank launcher to
start the ranks and was imported back by it to write the JSON report; the
integration's engine and registry once imported each other."""

from __future__ import annotations

import ast
import pathlib

import pytest

import mlx_dualnorm

PACKAGE_DIR = pathlib.Path(mlx_dualnorm.__file__).resolve().parent
COMMANDS = "mlx_dualnorm.commands"
WRAPPER = "mlx_dualnorm.mlx_lm"  # the mlx-lm command wrapper, a command too
COMMAND_SUBPACKAGES = ("parity", "replay", "bench", "mlx_lm_check", "mlx_lm_bench")
MODULES_PER_COMMAND = 3
COMMAND_LINES = 4500
# What a command may import of the rest of the package: its public API.
PUBLIC = {"mlx_dualnorm", "mlx_dualnorm.bits", "mlx_dualnorm.integrations",
          "mlx_dualnorm.integrations.mlx_lm"}


def module_files() -> dict[str, pathlib.Path]:
    """Each module of the package, by its dotted name."""
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def package_imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Each module -> the package modules it imports anywhere in it (a
    ``from package import name`` counts as the module ``package.name`` where
    there is one, else as ``package``)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    imported.add(name if name in modules else base)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph[module] = {name for name in imported if name in modules} - {module}
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


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for imported in graph[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def is_command(module: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in (COMMANDS, WRAPPER))


MODULES = module_files()
GRAPH = package_imports(MODULES)


def test_the_walk_sees_the_imports():
    # A lazy import, inside a function: collect_metadata's ``import mlx_dualnorm``.
    assert "mlx_dualnorm" in GRAPH[f"{COMMANDS}.bench.results"]
    assert f"{COMMANDS}.shared.command" in GRAPH[f"{COMMANDS}.bench"]
    assert "mlx_dualnorm._binding" in GRAPH["mlx_dualnorm"]  # from mlx_dualnorm import _binding
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert reachable({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


def test_no_package_module_imports_itself_round_about():
    assert find_cycle(GRAPH) == []


def test_no_command_module_imports_itself_round_about():
    commands = {module: GRAPH[module] for module in MODULES if is_command(module)}
    assert find_cycle({module: imported & commands.keys() for module, imported in commands.items()}) == []


def test_the_product_imports_no_command():
    product = [module for module in MODULES if not is_command(module) and module != "mlx_dualnorm.__main__"]
    assert "mlx_dualnorm.integrations.mlx_lm" in product
    for module in product:
        assert not any(is_command(imported) for imported in reachable(GRAPH, module)), module


def test_the_commands_import_only_the_public_api():
    for module in MODULES:
        if not is_command(module):
            continue
        private = {name for name in GRAPH[module] if not is_command(name)} - PUBLIC
        assert private == set(), f"{module} imports {sorted(private)}"


@pytest.mark.parametrize("command", COMMAND_SUBPACKAGES)
def test_each_command_is_at_most_three_modules(command):
    prefix = f"{COMMANDS}.{command}"
    modules = [module for module in MODULES if module == prefix or module.startswith(prefix + ".")]
    assert 1 <= len(modules) <= MODULES_PER_COMMAND, sorted(modules)


def test_no_command_module_is_over_400_lines():
    long_modules = {
        module: lines for module, path in MODULES.items()
        if is_command(module) and (lines := len(path.read_text().splitlines())) > 400
    }
    assert long_modules == {}


def test_the_commands_together_stay_small():
    lines = sum(
        len(path.read_text().splitlines()) for module, path in MODULES.items() if is_command(module)
    )
    assert lines <= COMMAND_LINES, f"the commands are {lines} lines"
