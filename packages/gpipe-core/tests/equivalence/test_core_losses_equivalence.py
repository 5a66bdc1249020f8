"""Losses whose denominator is the mini-batch's, in one process: random ignored targets
(micro-batches that keep none included), balances, chunks, checkpoint modes, every
built-in schedule and three losses (cross entropy, with class weights and label smoothing,
NLL) give the plain model's loss and gradients with :class:`~gpipe_core.BatchMean`. The
models, targets and losses are the distributed tests' (``distributed_cases.py``), so both
check the same numbers."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings

from core_support.models import placed
from core_support.strategies import batch_mean_specs
from gpipe_core import GPipe


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=batch_mean_specs())
def test_random_batch_means_match_plain(cases: ModuleType, spec: dict[str, Any]) -> None:
    plain = cases.classifier(spec["seed"])
    pipe = GPipe(
        cases.classifier(spec["seed"]), spec["balance"], chunks=spec["chunks"],
        checkpoint=spec["checkpoint"], **placed(spec["placement"]),
    )  # fmt: skip
    x, y = cases.ignored_targets(spec["seed"], spec["batch"], spec["ignored"])
    loss_fn, batch_mean = cases.mean_losses(spec["variant"])
    expected = loss_fn(plain(x), y)
    expected.backward()
    losses = pipe.step(x, y, batch_mean, schedule=spec["schedule"])
    torch.testing.assert_close(losses.reduced(), expected.detach(), equal_nan=True)
    for (name, got), want in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name, equal_nan=True)
