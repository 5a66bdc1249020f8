"""Skip connections through GPipe on CUDA: real copies between devices, on the copy streams.

A long skip from a CPU partition to a GPU partition crosses devices once per micro-batch,
as a differentiable copy (the gradient comes back the same way), and never visits the
partitions in between. Every test here needs a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES
from gpipe_core import GPipe
from gpipe_core.transport._transport import LocalTransport, MessageKey
from gpipe_skip import pop, skippable, stash

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


@skippable(stash=["long"])
class LongStash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(4, 6)

    def forward(self, x):
        yield stash("long", torch.tanh(self.project(x)))
        return x * 2


@skippable(pop=["long"])
class LongPop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.back = nn.Linear(6, 4)

    def forward(self, x):
        skip = yield pop("long")
        assert skip.device == x.device, (skip.device, x.device)
        return x + self.back(skip)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        LongStash(),
        nn.Linear(4, 4),
        nn.Tanh(),
        nn.Linear(4, 4),
        nn.ReLU(),
        nn.Linear(4, 4),
        nn.Tanh(),
        LongPop(),
    ).double()


def check(
    devices: list[str],
    checkpoint: str,
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[int, int, bool]]:
    sends: list[tuple[int, int, bool]] = []
    real_receive = LocalTransport.receive

    def counting_receive(self: LocalTransport, key: MessageKey) -> Any:
        if key.contents == "skips":
            same = self.devices[key.source] == self.devices[key.target]
            sends.append((key.source, key.target, same))
        return real_receive(self, key)

    monkeypatch.setattr(LocalTransport, "receive", counting_receive)
    net = model()
    plain = copy.deepcopy(net).to(devices[0])
    pipe = GPipe(net, [2, 2, 2, 2], devices=devices, chunks=3, checkpoint=checkpoint)
    x = torch.randn(9, 4, dtype=torch.float64)
    output, _ = assert_matches_plain(pipe, plain, x, weighted=True, device=devices[0])
    assert output.device == pipe.devices[-1]
    torch.cuda.synchronize()
    return sends


@pytest.mark.parametrize("checkpoint", MODES)
def test_long_skip_from_cpu_to_gpu_is_copied_once_per_micro_batch(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sends = check(["cpu", "cpu", "cpu", "cuda:0"], checkpoint, monkeypatch)
    # (source, target, same_device): a real copy, from partition 0 straight to partition 3.
    assert sends == [(0, 3, False)] * 3


@pytest.mark.parametrize("checkpoint", MODES)
def test_long_skip_on_one_gpu(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sends = check(["cuda:0"] * 4, checkpoint, monkeypatch)
    assert sends == [(0, 3, True)] * 3


@two_gpus
@pytest.mark.parametrize("checkpoint", MODES)
def test_long_skip_between_two_gpus(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    devices = ["cuda:0", "cuda:0", "cuda:0", "cuda:1"]
    sends = check(devices, checkpoint, monkeypatch)
    assert sends == [(0, 3, False)] * 3
