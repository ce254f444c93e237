"""solver/ imports without cycles: the module-level relative imports form a DAG (issue 12: space.py, the
launchers and plan.py used to import each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

SOLVER = Path(__file__).resolve().parents[2] / "solver"


def module_name(path: Path) -> str:
    parts = path.relative_to(SOLVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Edges module -> module for every module-level relative import; `from . import x` names submodule x."""
    graph = nx.DiGraph()
    for path in SOLVER.rglob("*.py"):
        module = module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph.add_node(module)
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            if node.module:
                graph.add_edge(module, f"{base}.{node.module}")
            else:
                for alias in node.names:
                    graph.add_edge(module, f"{base}.{alias.name}")
    return graph


def test_solver_has_no_import_cycles():
    graph = import_graph()
    assert graph.number_of_edges() > 20  # the analysis sees the imports
    assert list(nx.simple_cycles(graph)) == []


def test_the_analysis_finds_a_cycle_through_a_package_init():
    graph = import_graph()
    graph.add_edge("solver.capability", "solver")  # what `from . import api` in capability.py would add
    graph.add_edge("solver", "solver.capability")
    assert list(nx.simple_cycles(graph))
