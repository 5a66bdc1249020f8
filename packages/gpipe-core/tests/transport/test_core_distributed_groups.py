"""Across processes, whatever the program did before and whatever it does on one rank only.

A pipeline is built on three ranks after the program made a group of two of them (with
``new_group``, with local synchronization, or for a pipeline of its own), with weights tied
across two different pairs of ranks, twice in a row; it trains as the plain model. A
collective outside a run called on one rank only (``shared_drift()``) makes every rank raise
at once, and a rank interrupted in a step (``KeyboardInterrupt``) leaves every rank able to
step. The ranks are processes started by the ``cluster2``/``new_cluster_module`` fixtures
(see ``distributed_cases.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from core_support.distributed_checks import PROMPT


@pytest.fixture(scope="module")
def cluster3(new_cluster_module: Callable[[int], Any]) -> Any:
    return new_cluster_module(3)


def plain_steps(cases: ModuleType, model: torch.nn.Module, steps: int) -> list[dict[str, Any]]:
    """The plain model trained as ``case_groups_first`` trains its pipelines."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return cases.lm_steps(  # type: ignore[no-any-return]
        model, optimizer, seed=4, first=0, steps=steps, batch=4, chunks=2, max_norm=1e9
    )


def check_steps(got: list[list[dict[str, Any]]], want: list[dict[str, Any]]) -> None:
    """Each rank's steps against the plain model's: the losses, and every parameter and
    buffer (each rank's own and its replicas) after each step."""
    for k, expected in enumerate(want):
        seen: set[str] = set()
        for rank, steps in enumerate(got):
            step = steps[k]
            torch.testing.assert_close(step["loss"], expected["loss"], msg=f"rank {rank}")
            for key, value in step["state"].items():
                torch.testing.assert_close(value, expected["state"][key], msg=f"{key}, {k}")
                seen.add(key)
        assert seen == expected["state"].keys()


# -- building: groups made before, and ties across different pairs of ranks ---------------------


@pytest.mark.parametrize("before", ["new_group", "local", "pipeline"])
def test_three_ranks_build_after_the_programs_own_groups_with_two_tied_pairs(
    cluster3: Any, cases: ModuleType, before: str
) -> None:
    results = cluster3.results("groups_first", timeout=120, before=before, steps=2)
    want = plain_steps(cases, cases.two_ties_model(4), 2)
    for k in range(2):  # two pipelines in a row, each as the plain model
        check_steps([r["pipelines"][k]["steps"] for r in results], want)
        drifts = [r["pipelines"][k]["drift"] for r in results]
        assert drifts == [
            {"0.weight": 0.0},
            {"1.linear.weight": 0.0},
            {"0.weight": 0.0, "1.linear.weight": 0.0},
        ]


def test_a_late_rank_is_named_by_every_wait_in_building(cluster3: Any, cases: ModuleType) -> None:
    results = cluster3.results("late_builder", timeout=90, late_rank=2, seconds=2.0)
    for rank in (0, 1):  # they wait for rank 2 to agree on what they build
        assert results[rank]["error"]["type"] == "TimeoutError"
        assert results[rank]["error"]["message"].startswith(
            f"rank {rank} waited 2 s for ranks [2] to build the pipeline"
        )
    # Rank 2 finds the others' agreement, and waits for them to connect.
    assert results[2]["error"]["type"] == "TimeoutError"
    assert results[2]["error"]["message"].startswith(
        "rank 2 waited 2 s for ranks [0, 1] to connect the pipeline; building a pipeline "
        "across processes is collective"
    )
    assert all(result["seconds"] < PROMPT for result in results)
    assert len({result["reduced"] for result in results}) == 1  # then a pipeline steps


# -- a collective outside a run on one rank only -------------------------------------------------


def plain_step(cases: ModuleType, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain model's loss and gradients for the step of ``case_drift_alone`` and
    ``case_interrupted``."""
    model, _ = cases.tied(world, 7)
    x, y = cases.tokens(7, 4)
    reduced = 0.0
    for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
        loss = cases.TokenLoss()(model(xi), yi)
        (loss * len(xi) / len(x)).backward()
        reduced += loss.item() * len(xi) / len(x)
    return reduced, {name: p.grad for name, p in model.named_parameters()}


def check_step(
    cases: ModuleType, world: int, reduced: float, grads: dict[str, torch.Tensor | None]
) -> None:
    want_reduced, want_grads = plain_step(cases, world)
    torch.testing.assert_close(reduced, want_reduced)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], msg=name)


@pytest.mark.parametrize(("world", "odd_rank"), [(2, 0), (2, 1), (3, 0), (3, 2)])
def test_shared_drift_on_one_rank_raises_on_every_rank_at_once_then_steps_run(
    cluster2: Any, cluster3: Any, cases: ModuleType, world: int, odd_rank: int
) -> None:
    cluster = cluster2 if world == 2 else cluster3
    results = cluster.results("drift_alone", timeout=90, odd_rank=odd_rank)
    messages = {result["error"].get("message") for result in results}
    assert len(messages) == 1, messages  # the same error on every rank
    others = [rank for rank in range(world) if rank != odd_rank]
    stepping = f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(map(str, others))}"
    shown = sorted(
        [(odd_rank, f"rank {odd_rank}: 'shared_drift'"), (others[0], f"{stepping}: 'step'")]
    )
    assert messages == {
        f"the method called differs across ranks ({', '.join(s for _, s in shown)})"
    }
    assert all(result["error"]["is_value_error"] for result in results)
    assert all(result["seconds"] < PROMPT for result in results)  # not the timeout
    for result in results:
        check_step(cases, world, result["reduced"], result["grads"])
        assert set(result["drift"].values()) == {0.0}


# -- a step interrupted on one rank ----------------------------------------------------------------

DELAYS = [0.0, 0.002, 0.005, 0.01, 0.02, 0.04]


@pytest.mark.parametrize(("world", "odd_rank"), [(2, 0), (2, 1), (3, 1), (3, 2)])
def test_a_step_interrupted_on_one_rank_leaves_every_rank_able_to_step(
    cluster2: Any, cluster3: Any, cases: ModuleType, world: int, odd_rank: int
) -> None:
    cluster = cluster2 if world == 2 else cluster3
    results = cluster.results("interrupted", timeout=240, odd_rank=odd_rank, delays=DELAYS)
    phases = results[odd_rank]["phases"]
    landed = [phase["outcomes"].count("interrupted") for phase in phases]
    assert sum(landed) >= len(DELAYS) // 2, landed  # most interrupts land in a step
    print(f"{world} ranks, rank {odd_rank} interrupted in", [p["landed"] for p in phases])
    for k, delay in enumerate(DELAYS):
        phases = [result["phases"][k] for result in results]
        interrupted = phases[odd_rank]["outcomes"]
        assert interrupted.count("interrupted") <= 1, (delay, interrupted)
        for rank, phase in enumerate(phases):
            for outcome in phase["outcomes"]:
                # A step either ran, or says which rank failed (the interrupted one).
                assert outcome in ("ok", "interrupted") or outcome.startswith(
                    f"RemotePartitionError: rank {odd_rank} of the pipeline failed"
                ), (delay, rank, outcome)
            for step in phase["after"]:
                check_step(cases, world, step["reduced"], copy.copy(step["grads"]))
