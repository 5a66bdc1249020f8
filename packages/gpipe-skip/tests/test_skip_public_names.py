"""The public names of gpipe_skip: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import gpipe_skip

NAMES = [
    "DEFAULT_NAMESPACE",
    "Namespace",
    "Pop",
    "SkipKey",
    "SkipLayout",
    "SkipRoute",
    "SkipTracker",
    "Skippable",
    "Stash",
    "__version__",
    "current_skip_tracker",
    "inspect_skip_layout",
    "pop",
    "run_partition",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_skip, NAMES, [])


def test_modules_import_no_upper_package_and_make_no_circle() -> None:
    # Every import, at the top or inside a function: gpipe_skip knows nothing of the
    # packages above it, and its modules import one another without a circle.
    root = Path(gpipe_skip.__file__).parent
    edges: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    found.update([node.module] if node.module else [a.name for a in node.names])
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in {"gpipe", "gpipe_core"}, (path.name, name)
        edges[path.stem] = found
    done: set[str] = set()

    def visit(module: str, trail: tuple[str, ...]) -> None:
        assert module not in trail, f"import circle: {' -> '.join((*trail, module))}"
        if module in done:
            return
        for target in edges.get(module, ()):
            visit(target, (*trail, module))
        done.add(module)

    for module in edges:
        visit(module, ())
