"""Dicts and ``ModelOutput``-like mappings between partitions (issue 36, item 5): forward and
step equal the plain model's outputs, losses and gradients in float64, in every checkpoint
mode, the mapping's type and keys kept; a dict mini-batch splits by its tensors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from core_support.models import MODES, Output, mapping_model
from gpipe_core import GPipe

WIDTH = 4


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in module.parameters()]


def _assert_grads(pipe: nn.Module, plain: nn.Module) -> None:
    for got, want in zip(_grads(pipe), _grads(plain), strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[1, 1, 1, 1, 1], [2, 3], [1, 2, 2]])
def test_mappings_between_partitions_match_plain(checkpoint: str, balance: list[int]) -> None:
    plain = mapping_model(WIDTH, seed=0)
    pipe = GPipe(copy.deepcopy(plain), balance, chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(7, WIDTH, dtype=torch.double)
    y = torch.randn(7, WIDTH, dtype=torch.double)

    # forward, and autograd through it
    out = pipe(x)
    want = plain(x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    want.square().sum().backward()
    _assert_grads(pipe, plain)

    # step, every schedule on one worker per partition
    for schedule in ("gpipe", "1f1b"):
        pipe.zero_grad()
        plain.zero_grad()
        losses = pipe.step(x, target=y, loss_fn=nn.MSELoss(), schedule=schedule)
        expected = nn.functional.mse_loss(plain(x), y)
        expected.backward()
        torch.testing.assert_close(losses.reduced(), expected.detach(), rtol=1e-12, atol=1e-12)
        _assert_grads(pipe, plain)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", MODES)
def test_mapping_output_is_gathered_with_its_type_and_keys(checkpoint: str) -> None:
    model = mapping_model(WIDTH, seed=1)[:-1]  # ends with an Output
    pipe = GPipe(copy.deepcopy(model), [2, 2], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(5, WIDTH, dtype=torch.double)
    out = pipe(x)
    want = model(x)
    assert type(out) is Output and list(out) == list(want) == ["hidden", "gate"]
    for key in want:
        torch.testing.assert_close(out[key], want[key], rtol=1e-12, atol=1e-12)

    seen: list[type] = []

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        seen.append(type(output))
        return nn.functional.mse_loss(output["hidden"], target)

    loss_fn.reduction = "mean"  # type: ignore[attr-defined]
    pipe.step(x, x, loss_fn)
    assert seen and set(seen) == {Output}


class TakesDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        assert set(batch) == {"x", "mask", "scale"}
        return self.linear(batch["x"] * batch["mask"]) * batch["scale"]


@pytest.mark.timeout(60)
def test_a_dict_mini_batch_splits_by_its_tensors() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(TakesDict(), nn.Tanh(), nn.Linear(WIDTH, 1)).double()
    pipe = GPipe(copy.deepcopy(plain), [1, 2], chunks=4)
    batch = {
        "x": torch.randn(8, WIDTH, dtype=torch.double),
        "mask": torch.randint(0, 2, (8, 1)).double(),
        "scale": 0.5,
    }
    y = torch.randn(8, 1, dtype=torch.double)
    torch.testing.assert_close(pipe(batch), plain(batch))
    losses = pipe.step(batch, target=y, loss_fn=nn.MSELoss())
    assert list(losses.sizes) == [2, 2, 2, 2]
    nn.functional.mse_loss(plain(batch), y).backward()
    _assert_grads(pipe, plain)
