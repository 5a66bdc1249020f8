"""Losses whose denominator is the mini-batch's (:class:`~gpipe_core.BatchMean`): ignored
targets, class weights and masked means give the plain model's loss and gradients in every
schedule; a mean over each micro-batch's own count is refused with several micro-batches;
a failing loss names the micro-batch's shapes beside the mini-batch's."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

from core_support.models import MODES, PLANS, placed
from gpipe_core import BatchMean, GPipe, Losses

CLASSES = 5
WIDTH = 4


def classifier() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, CLASSES)
    ).double()


#: Four partitions of :func:`classifier`, for every plan.
FOUR = [2, 1, 1, 1]


def targets(batch: int, ignored: list[int]) -> torch.Tensor:
    target = torch.randint(CLASSES, (batch,), generator=torch.Generator().manual_seed(3))
    target[ignored] = -100
    return target


def plain_step(model: nn.Module, x: torch.Tensor, target: Any, loss_fn: Any) -> Any:
    loss = loss_fn(model(x), target)
    loss.backward()
    return loss.detach()


def assert_same_step(pipe: GPipe, plain: nn.Module, losses: Losses, expected: Any) -> None:
    torch.testing.assert_close(losses.reduced(), expected)
    for (name, got), want in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, msg=name)


@pytest.mark.parametrize(("schedule", "placement"), PLANS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_ignored_targets_give_the_plain_loss(
    checkpoint: str, schedule: str, placement: str | None
) -> None:
    """Micro-batches of 2: the first keeps one target, the second none (its own mean is
    NaN), the others all: the step's loss and gradients are the plain model's."""
    model = classifier()
    plain = copy.deepcopy(model)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = targets(8, ignored=[1, 2, 3])
    expected = plain_step(plain, x, y, nn.CrossEntropyLoss())
    pipe = GPipe(model, FOUR, chunks=4, checkpoint=checkpoint, **placed(placement))  # type: ignore[arg-type]
    loss_fn = BatchMean.from_module(nn.CrossEntropyLoss())
    losses = pipe.step(x, y, loss_fn, schedule=schedule)
    assert_same_step(pipe, plain, losses, expected)
    assert losses.counts == (1.0, 0.0, 2.0, 2.0)
    assert torch.isnan(losses[1])  # the micro-batch's own mean: nothing counted


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.CrossEntropyLoss(weight=torch.rand(CLASSES, dtype=torch.float64) + 0.5),
        lambda: nn.CrossEntropyLoss(ignore_index=2, label_smoothing=0.1),
        lambda: nn.CrossEntropyLoss(
            weight=torch.rand(CLASSES, dtype=torch.float64) + 0.5, label_smoothing=0.2
        ),
    ],
    ids=["weight", "smoothing", "weight-smoothing"],
)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_from_module_matches_the_plain_loss(make: Any, schedule: str) -> None:
    model = classifier()
    plain = copy.deepcopy(model)
    x = torch.randn(9, WIDTH, dtype=torch.float64)
    y = targets(9, ignored=[0, 5])
    y[y == -100] = 2  # the ignore_index of one case, a class of the others
    torch_loss = make()
    loss = BatchMean.from_module(torch_loss)
    expected = plain_step(plain, x, y, nn.CrossEntropyLoss(**_mean_of(torch_loss)))
    torch.testing.assert_close(loss(model(x), y), expected)  # the same object, unsplit
    pipe = GPipe(model, [3, 2], chunks=3)
    assert_same_step(pipe, plain, pipe.step(x, y, loss, schedule=schedule), expected)


def _mean_of(loss: nn.CrossEntropyLoss) -> dict[str, Any]:
    return {
        "weight": loss.weight,
        "ignore_index": loss.ignore_index,
        "label_smoothing": loss.label_smoothing,
    }


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        lambda: nn.NLLLoss(weight=torch.rand(CLASSES, dtype=torch.float64) + 0.5, reduction="sum"),
    ],
    ids=["cross-entropy", "nll-weight"],
)
def test_a_sum_is_refused_and_the_loss_itself_sums(make: Any) -> None:
    """A sum is no mean: ``from_module`` refuses it (it would divide by the count), and the
    loss itself gives the module's sum and gradients, as the error says."""
    torch_loss = make()
    with pytest.raises(
        ValueError,
        match=r"^BatchMean.from_module takes a loss with reduction='mean'; a sum needs no "
        r"BatchMean: pass the loss itself as loss_fn.*\(loss.reduction: 'sum'\)$",
    ):
        BatchMean.from_module(torch_loss)
    model = nn.Sequential(classifier(), nn.LogSoftmax(dim=1))
    plain = copy.deepcopy(model)
    x = torch.randn(9, WIDTH, dtype=torch.float64)
    y = targets(9, ignored=[0, 5])
    expected = plain_step(plain, x, y, torch_loss)
    pipe = GPipe(model, [1, 1], chunks=3)
    assert_same_step(pipe, plain, pipe.step(x, y, torch_loss), expected)


def test_nll_and_class_probabilities() -> None:
    model = nn.Sequential(classifier(), nn.LogSoftmax(dim=1))
    plain = copy.deepcopy(model)
    x = torch.randn(6, WIDTH, dtype=torch.float64)
    y = targets(6, ignored=[4])
    expected = plain_step(plain, x, y, nn.NLLLoss())
    pipe = GPipe(model, [1, 1], chunks=3)
    assert_same_step(pipe, plain, pipe.step(x, y, BatchMean.from_module(nn.NLLLoss())), expected)

    model, plain = classifier(), classifier()
    probabilities = torch.softmax(torch.randn(6, CLASSES, dtype=torch.float64), dim=1)
    expected = plain_step(plain, x, probabilities, nn.CrossEntropyLoss())
    pipe = GPipe(model, [2, 3], chunks=3)
    loss = BatchMean.from_module(nn.CrossEntropyLoss())
    assert_same_step(pipe, plain, pipe.step(x, probabilities, loss), expected)


@pytest.mark.parametrize(("schedule", "placement"), PLANS)
def test_masked_token_mean(schedule: str, placement: str | None) -> None:
    """A hand-written BatchMean over (values, mask) targets: 3-D outputs, a mean over the
    positions the mask keeps."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)
    ).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 5, WIDTH, dtype=torch.float64)
    values = torch.randn(8, 5, 2, dtype=torch.float64)
    mask = (torch.rand(8, 5, 1) > 0.6).double()
    mask[:2] = 0  # the first micro-batch counts nothing
    loss = BatchMean(
        lambda output, target: ((output - target[0]) ** 2 * target[1]).sum(),
        lambda target: target[1].sum() * 2,
    )
    expected = plain_step(plain, x, (values, mask), loss)
    pipe = GPipe(model, [1, 1, 1, 1], chunks=4, **placed(placement))
    losses = pipe.step(x, target=(values, mask), loss_fn=loss, schedule=schedule)
    assert_same_step(pipe, plain, losses, expected)
    assert losses.counts is not None and losses.counts[0] == 0


def test_without_grad_mode_the_losses_only() -> None:
    pipe = GPipe(classifier(), [2, 3], chunks=4)
    x, y = torch.randn(8, WIDTH, dtype=torch.float64), targets(8, ignored=[0, 1, 2])
    with torch.no_grad():
        losses = pipe.step(x, y, BatchMean.from_module(nn.CrossEntropyLoss()))
    torch.testing.assert_close(losses.reduced(), nn.CrossEntropyLoss()(classifier()(x), y))
    assert all(p.grad is None for p in pipe.parameters())


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_fn", "ignored", "seen"),
    [
        (nn.CrossEntropyLoss(), [0], r"ignore_index=-100.*1 of the target's 8 are ignored"),
        (nn.NLLLoss(ignore_index=3), [], r"NLLLoss\(ignore_index=3\)"),
        (nn.CrossEntropyLoss(weight=torch.ones(CLASSES, dtype=torch.float64)), [], "weight"),
    ],
)
def test_a_mean_over_each_micro_batch_is_refused(
    loss_fn: Any, ignored: list[int], seen: str
) -> None:
    model = classifier()
    pipe = GPipe(nn.Sequential(model, nn.LogSoftmax(dim=1)), [1, 1], chunks=2)
    x, y = torch.randn(8, WIDTH, dtype=torch.float64), targets(8, ignored)
    if isinstance(loss_fn, nn.NLLLoss):
        y[0] = 3
    with pytest.raises(ValueError, match=seen) as caught:
        pipe.step(x, y, loss_fn)
    assert "BatchMean.from_module(loss_fn)" in str(caught.value)
    assert "2 micro-batches" in str(caught.value)
    assert all(p.grad is None for p in pipe.parameters())  # refused before anything ran
    pipe.step(x, y, BatchMean.from_module(loss_fn))  # still usable, the way it names
    # One micro-batch, or no ignored target: the mean is the plain one, accepted.
    GPipe(classifier(), [2, 3], chunks=1).step(x, y, nn.CrossEntropyLoss())
    GPipe(classifier(), [2, 3], chunks=2).step(x, y.clamp(min=0), nn.CrossEntropyLoss())


def test_batch_mean_arguments() -> None:
    with pytest.raises(TypeError, match=r"total: int, count: function"):
        BatchMean(1, lambda t: t.numel())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"BatchMean\(total, count\).*loss: MSELoss"):
        BatchMean.from_module(nn.MSELoss())  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"reduction='none' gives one loss per target.*\(loss.reduction: 'none'\)"
    ):
        BatchMean.from_module(nn.CrossEntropyLoss(reduction="none"))
    pipe = GPipe(classifier(), [2, 3], chunks=2)
    x, y = torch.randn(4, WIDTH, dtype=torch.float64), targets(4, [])
    with pytest.raises(ValueError, match=r"reduction must be 'mean'.*reduction: 'sum'"):
        loss = BatchMean.from_module(nn.CrossEntropyLoss())
        pipe.step(x, target=y, loss_fn=loss, reduction="sum")


def test_losses_with_counts() -> None:
    losses = Losses(
        [torch.tensor(2.0), torch.tensor(float("nan")), torch.tensor(1.0)],
        sizes=[2, 2, 2], reduction="mean", counts=[1.0, 0.0, 3.0],
    )  # fmt: skip
    assert losses.reduced().item() == pytest.approx((2.0 + 3.0) / 4)
    with pytest.raises(ValueError, match="counts: 2"):
        Losses([torch.tensor(1.0)], [1], "mean", counts=[1.0, 2.0])


def test_a_failing_loss_names_the_micro_batch_shapes() -> None:
    """A loss written for the whole batch (a view by its size) fails on a micro-batch:
    the error says which shapes it saw, beside the mini-batch's size."""
    pipe = GPipe(classifier(), [2, 3], chunks=4)
    x, y = torch.randn(8, WIDTH, dtype=torch.float64), targets(8, [])

    def whole_batch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.view(8, CLASSES), target)

    with pytest.raises(RuntimeError) as caught:
        pipe.step(x, y, whole_batch_loss)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert re.search(
        r"micro-batch \d: 2 of the mini-batch's 8 samples \(output: \(2, 5\); target: \(2,\)\)",
        notes,
    ), notes
