"""gpipe_transformers' modules import one another one way: no import circle."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import gpipe_transformers


def _imported(node: ast.AST) -> list[str]:
    """The package's modules that ``node`` imports (none if it is no import)."""
    if isinstance(node, ast.ImportFrom) and node.level:  # from ._pipeline import ...
        return [node.module] if node.module else [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module == "gpipe_transformers":
        return [alias.name for alias in node.names]  # from gpipe_transformers import _pieces
    if isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
    elif isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        return []
    package = "gpipe_transformers."
    return [name.removeprefix(package).split(".")[0] for name in names if name.startswith(package)]


def test_modules_make_no_import_circle() -> None:
    # Every import of one of the package's modules: at the top, inside a function, or
    # under TYPE_CHECKING.
    root = Path(gpipe_transformers.__file__).parent
    modules = {path.stem: path for path in root.glob("*.py")}
    assert {"_pipeline", "_pretrained"} <= set(modules)
    edges = {
        name: {
            imported
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            for imported in _imported(node)
            if imported in modules
        }
        for name, path in modules.items()
    }
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(f"import circle: {' -> '.join(reversed(error.args[1]))}") from None
