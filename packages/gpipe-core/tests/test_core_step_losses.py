"""Losses: the per-micro-batch losses of a step, and the reduced loss of the mini-batch."""

from __future__ import annotations

import pytest
import torch

from gpipe_core import Losses


def test_sequence_of_losses() -> None:
    values = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)]
    losses = Losses(values, sizes=[3, 3, 2], reduction="mean")
    assert len(losses) == 3
    assert list(losses) == values
    assert losses[2] is values[2]
    assert list(losses[1:]) == values[1:]
    assert losses.sizes == (3, 3, 2)
    assert losses.reduction == "mean"
    assert repr(losses) == "Losses([1, 2, 4], sizes=[3, 3, 2], reduction='mean')"


def test_reduced_mean_weights_by_size() -> None:
    losses = Losses([torch.tensor(1.0), torch.tensor(4.0)], sizes=[3, 1], reduction="mean")
    torch.testing.assert_close(losses.reduced(), torch.tensor(1.75))


def test_reduced_sum_adds() -> None:
    losses = Losses([torch.tensor(1.0), torch.tensor(4.0)], sizes=[3, 1], reduction="sum")
    torch.testing.assert_close(losses.reduced(), torch.tensor(5.0))


def test_reduced_keeps_the_dtype() -> None:
    values = [torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)]
    reduced = Losses(values, sizes=[1, 2], reduction="mean").reduced()
    assert reduced.dtype == torch.float64
    torch.testing.assert_close(reduced, torch.tensor((0.1 + 0.4) / 3, dtype=torch.float64))


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError, match=r"same length \(losses: 2, sizes: 1\)"):
        Losses([torch.tensor(1.0), torch.tensor(2.0)], sizes=[1], reduction="mean")
