"""The repository's import graph: no cycle at any level (module-level and function-level imports alike), and the
layers import one way only (solver -> costmodels -> graphs; inside solver, cli -> api -> search -> plan, with
hardware beside search).

A cycle through a package's `__init__` counts: a submodule that imports its own package's re-exports depends on
every module the `__init__` imports."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graphs", "costmodels", "solver")

# Which top-level and solver subpackages may import which (a module may always import its own package).
BELOW_API = {"graphs", "costmodels", "solver.plan", "solver.search", "solver.hardware"}
LAYERS = {
    "graphs": set(),
    "costmodels": {"graphs"},
    "solver.plan": {"graphs", "costmodels"},
    "solver.search": {"graphs", "costmodels", "solver.plan", "solver.hardware"},
    "solver.hardware": {"graphs", "costmodels", "solver.plan"},
    "solver.api": BELOW_API,
    "solver.choose": {*BELOW_API, "solver.api"},
    "solver.cli": {*BELOW_API, "solver.api", "solver.choose"},
    "solver": {*BELOW_API, "solver.api"},
    "solver.__main__": {"solver.cli"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The project modules one import statement loads (`from a import b` loads a.b when b is a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(max(0, node.level - 1)):
            base = base.rpartition(".")[0]
        target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
        names = [f"{target}.{alias.name}" for alias in node.names]
        if not all(name in known for name in names):  # some name is an attribute of `target`, not a submodule
            names.append(target)
    return {name for name in names if name in known}


def import_graph(*, function_level: bool = True) -> nx.DiGraph:
    """Edges module -> module for every import of a project module (inside functions too, unless told not)."""
    known = modules()
    graph = nx.DiGraph()
    for module, path in known.items():
        graph.add_node(module)
        tree = ast.parse(path.read_text())
        nodes = ast.walk(tree) if function_level else iter(tree.body)
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in imported(node, module, path.name == "__init__.py", known) - {module}:
                    graph.add_edge(module, target)
    return graph


def layer_of(module: str) -> str:
    """The LAYERS key a module belongs to (its longest matching prefix)."""
    return max((key for key in LAYERS if module == key or module.startswith(key + ".")), key=len)


def test_the_repository_has_no_import_cycle_at_any_level():
    graph = import_graph()
    assert graph.number_of_edges() > 300  # the analysis sees the imports
    cycles = [sorted(component) for component in nx.strongly_connected_components(graph) if len(component) > 1]
    assert cycles == []


def test_layers_import_one_way():
    wrong = sorted((a, b) for a, b in import_graph().edges
                   if layer_of(a) != layer_of(b) and layer_of(b) not in LAYERS[layer_of(a)])
    assert wrong == []


@pytest.mark.parametrize("function_level", [False, True])
def test_the_analysis_finds_a_cycle_through_a_package_init(function_level: bool):
    graph = import_graph(function_level=function_level)
    graph.add_edge("solver.plan.capability", "solver")  # what `from solver import api` in capability.py would add
    graph.add_edge("solver", "solver.plan.capability")
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))


@pytest.mark.parametrize("package", ["graphs", "costmodels", "solver"])
def test_no_lazily_exported_name_is_also_a_submodule(package: str):
    """A package's lazy export named like one of its submodules would be replaced by that module once imported."""
    import importlib

    exported = set(importlib.import_module(package).__all__)
    submodules = {name.rpartition(".")[2] for name in modules() if name.rpartition(".")[0] == package}
    assert exported & submodules == set()
