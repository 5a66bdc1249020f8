"""Losses whose denominator is the mini-batch's (:class:`~gpipe_core.BatchMean`) across
processes: on two ranks in every schedule, and over data-parallel replicas whose counts
differ, the step gives the plain model's loss and gradients of the whole batch."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from core_support.distributed_checks import plain_name
from core_support.models import PLANS
from core_support.strategies import batch_mean_specs


def plain_gradients(cases: ModuleType, seed: int, batch: int) -> tuple[float, dict[str, Any]]:
    model = cases.classifier(seed)
    x, y = cases.ignored_targets(seed, batch)
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def gathered(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every rank's gradients under the plain model's names; a replica's must equal the
    other replica's."""
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        for name, grad in result["grads"].items():
            name = plain_name(name)
            if name in grads:
                torch.testing.assert_close(grad, grads[name], msg=name)
            grads[name] = grad
    return grads


@pytest.mark.parametrize(("schedule", "placement"), PLANS)
def test_batch_mean_on_two_ranks(
    cluster2: Any, cases: ModuleType, schedule: str, placement: str | None
) -> None:
    results = cluster2.results("batch_mean", schedule=schedule, placement=placement, seed=4)
    loss, expected = plain_gradients(cases, 4, 8)
    for result in results:  # every rank returns the last partition's losses
        assert result["reduced"] == pytest.approx(loss, rel=1e-12)
        assert result["counts"] == (1.0, 0.0, 2.0, 2.0)
    grads = gathered(results)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


@pytest.mark.parametrize("bad_rank", [None, 3], ids=["steps", "a-replica-fails-first"])
def test_batch_mean_over_data_parallel_replicas(
    new_cluster: Callable[[int], Any], cases: ModuleType, bad_rank: int | None
) -> None:
    """The replicas keep 5 and 3 targets of their 8: each micro-batch is divided by the
    8 both keep, and the averaged gradients are the plain model's on the 16 samples (a
    mean over each replica's own count would weight the second replica's targets more).
    When the last partition of one replica fails before its losses (a short target), every
    rank raises (none waits for it), and the next step is the plain model's."""
    results = new_cluster(4).results(
        "batch_mean", schedule="1f1b", placement=None, seed=5, data_parallel=True,
        bad_rank=bad_rank, timeout=90,
    )  # fmt: skip
    if bad_rank is not None:
        failures = [result["failed"] for result in results]
        assert all(failures), failures
        assert failures[3].startswith("ValueError: target must have the input's batch size")
        assert "data-parallel replica(s) failed before the step's losses" in failures[1]
    _, expected = plain_gradients(cases, 5, 16)
    grads = gathered(results)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    model = cases.classifier(5)
    x, y = cases.ignored_targets(5, 16)
    for rank, result in enumerate(results):  # each replica's losses are its own half's
        half = slice((rank // 2) * 8, (rank // 2 + 1) * 8)
        own = nn.CrossEntropyLoss()(model(x[half]), y[half]).item()
        assert result["reduced"] == pytest.approx(own, rel=1e-12)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=batch_mean_specs())
def test_random_batch_means_match_plain(
    cluster2: Any, cases: ModuleType, spec: dict[str, Any]
) -> None:
    """Random ignored targets (micro-batches that keep none included), balances, chunks,
    plans and losses on two ranks: the plain model's loss and gradients on the batch."""
    results = cluster2.results("batch_mean", **spec)
    model = cases.classifier(spec["seed"])
    x, y = cases.ignored_targets(spec["seed"], spec["batch"], spec["ignored"])
    loss_fn, _ = cases.mean_losses(spec["variant"])
    loss = loss_fn(model(x), y)
    loss.backward()
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["reduced"], dtype=torch.float64), loss.detach(), equal_nan=True
        )
    grads = gathered(results)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name, equal_nan=True)
