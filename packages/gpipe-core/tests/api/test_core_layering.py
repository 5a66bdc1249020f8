"""gpipe-core's floors, read from its source: imports go down the layers that
``docs/internals.rst`` draws, and no import circle joins two modules, or two layers.

The layers, from the top: the API modules (``gpipe_core/*.py``), ``run/``, ``transport/``,
``trace/``, ``schedule/``, and the modules every layer shares (:data:`SHARED`), which import
nothing of gpipe-core's. Every import counts, function-local ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpipe_core

#: The layers from the top, each importing only those after it.
LAYERS = ("api", "run", "transport", "trace", "schedule", "shared")
#: The modules at the top that every layer may import.
SHARED = ("_errors", "_stream", "_sequential", "_dtensor")
ROOT = Path(gpipe_core.__file__).resolve().parent

Edge = tuple[str, str, int]  # (importing module, imported module, line)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> list[Edge]:
    """Every import of a gpipe-core module by another, wherever it stands in the file."""
    edges: list[Edge] = []
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                # ``from . import x`` and ``from .run import _runner`` import modules.
                targets = [
                    f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base
                    for alias in node.names
                ]
            else:
                continue
            edges += [
                (name, target, node.lineno)
                for target in targets
                if target.split(".")[0] == "gpipe_core" and target != name
            ]
    return edges


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    if len(parts) > 1 and parts[1] in SHARED:
        return "shared"
    return "api"


def upward(edges: list[Edge]) -> list[str]:
    """The imports that go up, or sideways between the shared modules' layer and another."""
    return [
        f"{source}:{line} imports {target} ({layer(source)} -> {layer(target)})"
        for source, target, line in edges
        if layer(source) != layer(target)
        and LAYERS.index(layer(target)) < LAYERS.index(layer(source))
    ]


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle of ``graph`` (each node's imports), if there is one."""
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if node in trail:
            return [*trail[trail.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            found = visit(target, [*trail, node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


def graph_of(edges: list[Edge], node: object = None) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for source, target, _ in edges:
        a, b = (layer(source), layer(target)) if node == "layer" else (source, target)
        if a != b:
            graph.setdefault(a, set()).add(b)
    return graph


def test_imports_go_down_the_layers() -> None:
    assert upward(imports()) == []


def test_no_import_circle_between_modules() -> None:
    assert circle(graph_of(imports())) is None


def test_no_import_circle_between_layers() -> None:
    assert circle(graph_of(imports(), "layer")) is None


def test_the_checks_fail_on_an_upward_import_and_a_circle() -> None:
    # What a deliberate upward import (the trace importing the transport's copy) and a
    # circle would make the tests above report.
    edges = [
        *imports(),
        ("gpipe_core.trace._tracing", "gpipe_core.transport._transfer", 1),
    ]
    assert upward(edges) == [
        "gpipe_core.trace._tracing:1 imports gpipe_core.transport._transfer (trace -> transport)"
    ]
    assert circle(graph_of(edges, "layer")) is not None
    looped = [("gpipe_core.a", "gpipe_core.b", 1), ("gpipe_core.b", "gpipe_core.a", 2)]
    assert circle(graph_of(looped)) == ["gpipe_core.a", "gpipe_core.b", "gpipe_core.a"]


def test_the_internals_page_states_the_same_layers() -> None:
    page = Path(__file__).resolve().parents[4] / "docs" / "internals.rst"
    if not page.is_file():  # an installed package's tests, without the checkout's docs
        return
    text = " ".join(page.read_text(encoding="utf-8").split())
    order = "the API modules, ``run/``, ``transport/``, ``trace/``, ``schedule/``"
    assert order in text
    assert all(f"``{name}``" in text for name in SHARED)
