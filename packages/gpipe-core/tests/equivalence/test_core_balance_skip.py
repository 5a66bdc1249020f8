"""Automatic balancing of models with skip connections, then pipelining them.

gpipe-balance profiles layer by layer without importing gpipe-skip; a skippable layer must
still profile (its pop served by the stash of an earlier layer), leave the model as it was,
and give a balance that GPipe runs with the plain model's outputs and gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from core_support.checks import assert_matches_plain
from gpipe_balance import balance_by_size, balance_by_time
from gpipe_core import GPipe
from gpipe_skip import Namespace, pop, skippable, stash


@skippable(stash=["skip"])
class Down(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        yield stash("skip", x)
        return torch.relu(self.norm(self.linear(x)))


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.25)

    def forward(self, x):
        skip = yield pop("skip")
        return self.dropout(self.linear(x)) + skip


def unet(width: int = 8, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    namespaces = [Namespace() for _ in range(depth)]
    return nn.Sequential(
        *[Down(width).isolate(ns) for ns in namespaces],
        nn.Linear(width, width),
        *[Up(width).isolate(ns) for ns in reversed(namespaces)],
        nn.Linear(width, 1),
    )


def state(model: nn.Module) -> dict[str, Any]:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [p.grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


PROFILERS: dict[str, Callable[[nn.Sequential, torch.Tensor], list[int]]] = {
    "time": lambda model, x: balance_by_time(3, model, x, timeout=0),
    "size": lambda model, x: balance_by_size(3, model, x, chunks=2),
}


@pytest.mark.parametrize("profiler", sorted(PROFILERS))
def test_skippable_model_profiles_without_trace_and_pipelines(profiler: str) -> None:
    model = unet()
    x = torch.randn(16, 8)
    before = state(model)

    balance = PROFILERS[profiler](model, x)

    after = state(model)
    assert balance and sum(balance) == len(model) and min(balance) >= 1 and len(balance) == 3
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, value in before["tensors"].items():
        assert torch.equal(after["tensors"][name], value), name
    assert after["grads"] == before["grads"] == [None] * len(before["grads"])
    assert after["training"] == before["training"]
    assert torch.equal(after["rng"], before["rng"])

    # The balance found is one GPipe runs, with the plain model's results (eval mode: the
    # dropout and the batch statistics would otherwise differ between micro-batches).
    plain = copy.deepcopy(model).eval()
    pipe = GPipe(copy.deepcopy(model), balance, chunks=4, checkpoint="always").eval()
    assert_matches_plain(pipe, plain, x)
