"""A first layer that modifies the pipeline's input in place, as nn.ReLU(inplace=True) does.

Without micro-batches that is fine whenever the input is not a leaf that needs grad. With
micro-batches the first partition's inputs are views of one tensor: they share a version
counter (an in-place change to one invalidates what another saved for backward) and, when
they need grad, torch refuses to modify them in place at all. The pipeline must give the
same results as the plain model anyway, in every checkpoint mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES
from gpipe_core import GPipe


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)
    ).double()


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("input_requires_grad", [False, True])
@pytest.mark.parametrize("checkpoint", MODES)
def test_inplace_first_layer_matches_plain(
    checkpoint: str,
    input_requires_grad: bool,
    chunks: int,
) -> None:
    plain = model()
    pipe = GPipe(copy.deepcopy(plain), [2, 2], chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(2):  # the second run learns afresh
        # ``t * 1`` is not a leaf, so the plain model may modify it in place too.
        assert_matches_plain(
            pipe, plain, x, input_requires_grad=input_requires_grad, feed=lambda t: t * 1
        )


@pytest.mark.parametrize("checkpoint", MODES)
def test_layers_that_leave_their_input_alone_get_views(checkpoint: str) -> None:
    seen: list[torch.Tensor] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return x * 2

    pipe = GPipe(nn.Sequential(Probe(), nn.Linear(4, 4)), [1, 1], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 4)
    pipe(x)
    pipe(x)
    # At most the first task of a run is handed a copy to watch; the others see views of x.
    views = [t for t in seen if t._base is x]
    assert len(views) >= len(seen) - 2 and len(seen) >= 8


class Double(nn.Module):
    """A parameter-free layer: its output needs no gradient when its input needs none."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class HalveLargeRows(nn.Module):
    """Halves, in place, the rows of its input whose mean exceeds 1: a change in place that
    only some micro-batches trigger."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        large = x.mean(dim=1) > 1
        if bool(large.any()):
            x[large] *= 0.5
        return x


@pytest.mark.parametrize("path", ["forward", "step"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_in_place_change_that_starts_on_a_later_micro_batch(checkpoint: str, path: str) -> None:
    # Micro-batch 0 leaves the input of partition 1 alone, micro-batches 1 and 2 change it:
    # the pipeline gives the plain model's numbers or refuses, never another number.
    torch.manual_seed(0)
    plain = nn.Sequential(Double(), HalveLargeRows(), nn.Linear(4, 2)).double()
    pipe = GPipe(copy.deepcopy(plain), [1, 2], chunks=3, checkpoint=checkpoint)
    x = torch.cat([torch.zeros(2, 4), torch.full((4, 4), 3.0)]).double() + 0.01 * torch.randn(
        6, 4, dtype=torch.float64
    )
    y = torch.randn(6, 2, dtype=torch.float64)
    expected_loss = nn.MSELoss()(plain(x), y)
    expected_loss.backward()
    try:
        if path == "forward":
            loss = nn.MSELoss()(pipe(x), y)
            loss.backward()
        else:
            loss = pipe.step(x, y, nn.MSELoss()).reduced()
    except RuntimeError as error:
        assert "in place" in str(error) or "in-place" in str(error), error
        return
    torch.testing.assert_close(loss.detach(), expected_loss.detach())
    for mine, theirs in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)
