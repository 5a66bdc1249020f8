"""Root pytest configuration: tests marked ``cuda`` are skipped without a CUDA GPU.

This file imports nothing but pytest and torch, so every distribution's test suite can use
it whatever else is installed.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # The marker is registered in the root pyproject.toml; register it here too when the
    # tests run with another configuration file (or none), so --strict-markers still works.
    markers = config.getini("markers")
    if not any(str(line).split(":", 1)[0].strip() == "cuda" for line in markers):
        config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict[str, object]) -> None:
    # Docstring examples use torch and nn as the modules that define them do; public names
    # are documented under their package (gpipe_core.GPipe), whose namespace lacks them.
    doctest_namespace["torch"] = torch
    doctest_namespace["nn"] = torch.nn
