"""Losses: the per-micro-batch losses of a step, and the reduced loss of the mini-batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpipe_core import Losses
from gpipe_core._stream import CPUStream
from gpipe_core.run._description import RunDescription
from gpipe_core.run._losses import LossSpec
from gpipe_core.run._partition_run import PartitionRun
from gpipe_microbatch import Batch


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


# -- each micro-batch's loss, scaled in its backward pass -------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_a_partition_differentiates_each_loss_times_its_scale_bit_for_bit(
    dtype: torch.dtype, sizes: list[int], seed: int
) -> None:
    # The loss is seeded with its scale rather than multiplied by it: the gradients are
    # those of (loss * scale).backward(), exactly.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    x, y = torch.randn(sum(sizes), 3, dtype=dtype), torch.randn(sum(sizes), 2, dtype=dtype)
    xs, ys = x.split(sizes), y.split(sizes)
    scales = [size / sum(sizes) for size in sizes]
    loss_fn = nn.MSELoss()
    for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
        (loss_fn(model(xi), yi) * scales[i]).backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)

    cpu = torch.device("cpu")
    losses = LossSpec(loss_fn, [Batch(yi) for yi in ys], scales, backward=True)
    description = RunDescription(
        [], [], len(sizes), grad=True, checkpoint_stop=0, autograd_backward=False,
        loss=losses, partitions=[model], devices=[cpu],
    )  # fmt: skip
    run = PartitionRun(0, description, CPUStream)
    for i, xi in enumerate(xs):
        run.forward(i, Batch(xi), {})
        run.backward(i, [], {})
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
