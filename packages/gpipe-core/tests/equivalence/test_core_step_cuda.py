"""GPipe.step on CUDA devices: the plain model's losses and gradients, targets moved.

Every test here needs a GPU (the ``cuda`` marker, and a module-level ``skipif`` for runs
without the root conftest).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core_support.models import MODES
from gpipe_core import GPipe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICES = [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 4)
    ).double()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("devices", DEVICES)
def test_step_matches_plain(devices: list[str], checkpoint: str, schedule: str) -> None:
    net = model().eval()  # no dropout: compared with the plain model
    plain = copy.deepcopy(net).to(devices[0])
    pipe = GPipe(net, [3, 2], devices=devices, chunks=4, checkpoint=checkpoint)
    pipe.train()
    pipe[3].eval()
    x = torch.randn(10, 8, dtype=torch.float64, device=devices[0], requires_grad=True)
    # The target is on the first device: the step moves it to the last partition's.
    y = torch.randn(10, 4, dtype=torch.float64, device=devices[0])
    x_plain = x.detach().clone().requires_grad_()

    losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    expected = nn.MSELoss()(plain(x_plain), y)
    expected.backward()

    assert all(loss.device == pipe.devices[-1] for loss in losses)
    torch.testing.assert_close(losses.reduced().to(devices[0]), expected.detach())
    assert x.grad is not None and x.grad.device == x.device
    torch.testing.assert_close(x.grad, x_plain.grad)
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and p.grad.device == p.device
        torch.testing.assert_close(p.grad.to(q.device), q.grad)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_recomputation_on_cuda_replays_the_draws(schedule: str) -> None:
    x = torch.randn(16, 8, dtype=torch.float64, device="cuda:0")
    y = torch.randn(16, 4, dtype=torch.float64, device="cuda:0")
    grads = {}
    for checkpoint in ("always", "never"):
        pipe = GPipe(model(), [4, 1], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint)
        torch.manual_seed(1)
        pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        grads[checkpoint] = [p.grad for p in pipe.parameters()]
    torch.testing.assert_close(grads["always"], grads["never"])
