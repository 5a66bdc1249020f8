"""The gpipe-core tests' fixtures: the payload channels, the test clusters and their cases.

Only fixtures live here; what test modules share otherwise they import from the
:mod:`core_support` package beside this file.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from core_support.cluster import Cluster, load_cases, tested_payload_modes


@pytest.fixture(scope="session", autouse=True)
def _frozen_imports() -> Iterator[None]:
    """What exists once the tests are collected (torch, the test modules, hypothesis) is
    moved out of the collector's sight, so that the tests' ``gc.collect()`` (to retire the
    pipelines of earlier tests before counting threads or tensors) scans only what the
    tests made since: a tenth of a second less each."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module", name="payloads", params=tested_payload_modes())
def payloads_fixture(request: pytest.FixtureRequest) -> str:
    """The payload channel of the clusters of a module's tests, one after the other (one
    fixture for every cluster fixture, so that a test with two clusters has both on one)."""
    return str(request.param)


@pytest.fixture(scope="module", name="cluster2")
def cluster2_fixture(payloads: str) -> Iterator[Cluster]:
    """Two ranks, shared by the tests of a module (each test's cases leave them ready),
    on each payload channel."""
    cluster = Cluster(2, payloads=payloads)
    try:
        yield cluster
    finally:
        cluster.close()


def _clusters(payloads: str) -> Iterator[Callable[[int], Cluster]]:
    made: list[Cluster] = []

    def make(world: int, *, gpus: bool = False) -> Cluster:
        made.append(Cluster(world, gpus=gpus, payloads=payloads))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


@pytest.fixture(name="new_cluster")
def new_cluster_fixture(payloads: str) -> Iterator[Callable[[int], Cluster]]:
    """Make clusters of a given size for one test, on each payload channel; they are
    closed after it."""
    yield from _clusters(payloads)


@pytest.fixture(scope="module", name="new_cluster_module")
def new_cluster_module_fixture(payloads: str) -> Iterator[Callable[[int], Cluster]]:
    """Make clusters of a given size for a test module, on each payload channel; they are
    closed after it."""
    yield from _clusters(payloads)


@pytest.fixture(scope="module", name="cases")
def cases_fixture() -> ModuleType:
    """``distributed_cases.py`` as the ranks run it: the models and inputs the tests compare
    the ranks' results with (loaded once per module)."""
    return load_cases()
