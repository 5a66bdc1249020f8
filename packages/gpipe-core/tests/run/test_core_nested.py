"""A GPipe nested inside a partition of another GPipe, with random draws under checkpointing.

The outer partition holds the CPU generator lock while it computes; the inner pipeline must
not hand its work to workers that would wait for that lock.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from core_support.models import TrainableScale
from gpipe_core import GPipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_nested_pipeline_with_dropout_finishes_and_replays_masks(checkpoint: str) -> None:
    torch.manual_seed(0)
    inner = GPipe(
        nn.Sequential(nn.Dropout(0.5), TrainableScale(), nn.Dropout(0.5)),
        [2, 1],
        chunks=2,
        checkpoint=checkpoint,
    )
    outer = GPipe(
        nn.Sequential(nn.Dropout(0.5), inner, TrainableScale()),
        [1, 2],
        chunks=4,
        checkpoint=checkpoint,
    )
    before = threading.active_count()
    result: dict[str, object] = {}

    def step() -> None:
        x = (torch.rand(16, 8, dtype=torch.float64) + 0.5).requires_grad_()
        y = outer(x)
        y.sum().backward()
        result["x"], result["y"] = x, y

    # A hang would be a deadlock on the generator lock: run with a deadline.
    for _ in range(3):
        runner = threading.Thread(target=step, daemon=True)
        runner.start()
        runner.join(timeout=60)
        assert not runner.is_alive(), "nested pipeline did not finish"
        x, y = result["x"], result["y"]
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        # y = mask * x * c for a constant c, so dy/dx = y / x wherever the masks kept x.
        assert x.grad is not None
        torch.testing.assert_close(x.grad, y.detach() / x.detach())
    # Each GPipe starts its workers once; nothing more is left behind.
    assert threading.active_count() <= before + 4
