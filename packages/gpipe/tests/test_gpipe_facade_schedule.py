"""The gpipe.schedule facade re-exports gpipe-core's schedule names as they are."""

from __future__ import annotations

import gpipe
import gpipe.schedule
import gpipe_core


def test_every_name_is_the_same_object() -> None:
    assert "schedule" in gpipe.__all__
    assert sorted(gpipe.schedule.__all__) == gpipe.schedule.__all__
    for name in gpipe.schedule.__all__:
        assert getattr(gpipe.schedule, name) is getattr(gpipe_core, name), name


def test_step_through_the_facade() -> None:
    import torch
    from torch import nn

    model = gpipe.GPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), [1, 1], chunks=2)
    losses = model.step(torch.randn(4, 3), torch.randn(4, 1), nn.MSELoss(), schedule="1f1b")
    assert isinstance(losses, gpipe.schedule.Losses)
    assert len(losses) == 2
