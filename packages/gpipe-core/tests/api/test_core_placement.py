"""Where partitions come from when ``balance`` is omitted, and the empty pipeline.

Without ``balance`` (and ``devices``), partitions are the runs of consecutive layers on one
device; when every layer is on one device the error says how to measure a balance. An
empty ``nn.Sequential`` is the identity, on both paths.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_core import GPipe, NoChunk


def test_balance_omitted_on_one_device_says_how_to_measure_one() -> None:
    with pytest.raises(
        TypeError,
        match=r"balance must be given when every layer is on one device .*balance_by_time",
    ):
        GPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))


def test_balance_omitted_with_devices_is_refused() -> None:
    with pytest.raises(TypeError, match=r"balance must be given with devices"):
        GPipe(nn.Sequential(nn.Linear(2, 2)), devices=["cpu"])


@pytest.mark.cuda
def test_partitions_follow_the_layers_devices() -> None:
    model = nn.Sequential(
        nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2).cuda(), nn.Tanh(), nn.Linear(2, 2).cuda()
    )
    pipe = GPipe(model, chunks=2)
    assert pipe.balance == [2, 3]
    assert [d.type for d in pipe.devices] == ["cpu", "cuda"]


def test_an_empty_sequential_is_the_identity() -> None:
    pipe = GPipe(nn.Sequential(), chunks=4)
    assert pipe.balance == [] and pipe.devices == [] and len(pipe) == 0
    x = torch.randn(6, 3, requires_grad=True)
    assert pipe(x) is x
    pair = (torch.randn(2, 3), torch.randn(2, 1))
    assert pipe(pair) == pair
    with pytest.raises(TypeError, match=r"input must hold a tensor to split.*\(input: str\)"):
        pipe("not a tensor")
    # Several inputs come back as the tuple of them; NoChunk tensors as the tensors.
    mask = torch.ones(3)
    out = pipe(x, NoChunk(mask), 2)
    assert isinstance(out, tuple) and out[0] is x and out[1] is mask and out[2] == 2
    assert GPipe(nn.Sequential(), []).balance == []


def test_an_empty_sequential_steps_like_the_identity() -> None:
    pipe = GPipe(nn.Sequential(), chunks=3)
    x = torch.randn(6, 3, requires_grad=True)
    y = torch.randn(6, 3)
    losses = pipe.step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(x, y)
    torch.testing.assert_close(losses.reduced(), expected.detach())
    assert x.grad is not None
    (grad,) = torch.autograd.grad(nn.MSELoss()(x, y), x)
    torch.testing.assert_close(x.grad, grad)
