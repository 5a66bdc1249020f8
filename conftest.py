"""Root pytest configuration: tests marked ``cuda`` are skipped without a CUDA GPU, and
the others run as on a machine without one.

It also hands out :func:`check_public_names` as a fixture, for each distribution's
public-names test. This file imports nothing but pytest, torch and the standard library,
so every distribution's test suite can use it whatever else is installed.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from types import ModuleType

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
def _no_gpu_unless_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # A test not marked ``cuda`` runs as on a machine without a GPU, also on one that has
    # some: its defaults (every partition on the CPU) are those of a CPU-only machine, and
    # the processes it starts see no GPU either. Tests marked ``cuda`` see the GPUs.
    if request.node.get_closest_marker("cuda") is not None or not torch.cuda.is_available():
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict[str, object]) -> None:
    # Docstring examples use torch and nn as the modules that define them do; public names
    # are documented under their package (gpipe_core.GPipe), whose namespace lacks them.
    doctest_namespace["torch"] = torch
    doctest_namespace["nn"] = torch.nn


def check_public_names(package: ModuleType, names: list[str], submodules: list[str]) -> None:
    """Check that ``package``'s public surface is exactly ``names`` and ``submodules``.

    ``package.__all__``, sorted, must be ``names``, every name in it must resolve, and the
    package's submodules without a leading underscore must be ``submodules`` (sorted): the
    implementation modules are private, so that a change to the public surface is deliberate.
    """
    assert sorted(package.__all__) == names
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == [], f"{package.__name__} lists names it does not define: {missing}"
    found = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name[0] != "_")
    assert found == submodules


@pytest.fixture
def public_names() -> Callable[[ModuleType, list[str], list[str]], None]:
    """:func:`check_public_names`, for tests that cannot import this file by name."""
    return check_public_names
