"""The gpipe.bn facade re-exports gpipe_bn's names, the very objects."""

from __future__ import annotations

import ast
from pathlib import Path

import gpipe.bn
import gpipe_bn


def test_every_name_is_the_same_object() -> None:
    assert gpipe.bn.__all__ == [
        "DeferredBatchNorm",
        "convert_deferred_batch_norm",
        "convert_plain_batch_norm",
        "mini_batch",
    ]
    for name in gpipe.bn.__all__:
        assert getattr(gpipe.bn, name) is getattr(gpipe_bn, name), name
    assert set(gpipe.bn.__all__) == set(gpipe_bn.__all__) - {"__version__"}


def test_names_are_listed_explicitly() -> None:
    assert gpipe.bn.__file__ is not None
    tree = ast.parse(Path(gpipe.bn.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert all(alias.name != "*" for alias in node.names), ast.unparse(node)
