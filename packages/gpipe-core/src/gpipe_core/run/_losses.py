"""The losses of a step (:meth:`GPipe.step <gpipe_core.GPipe.step>`): what the last
partition needs to compute them (:class:`LossSpec`), what the step returns
(:class:`Losses`), and a loss whose denominator is the mini-batch's (:class:`BatchMean`).

It must not know how a step runs: it computes, holds, reduces and converts the losses of
the micro-batches it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast, overload

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gpipe_microbatch import Batch

from .._errors import add_note

__all__ = [
    "BatchMean",
    "LossFunction",
    "LossSpec",
    "Losses",
    "Numbers",
    "Reduction",
    "from_numbers",
    "to_numbers",
]

#: How a loss function reduces over the samples of a micro-batch.
Reduction = Literal["mean", "sum"]
#: ``loss_fn(output, target)``, returning a scalar tensor.
LossFunction = Callable[[Any, Any], Tensor]
#: ``count(target)``: how many targets a micro-batch's summed loss is over (a number or a
#: scalar tensor).
CountFunction = Callable[[Any], "Tensor | float"]


class BatchMean:
    """A loss averaged over the whole mini-batch's count, whatever each micro-batch holds.

    A mean whose denominator depends on the data, such as
    ``nn.CrossEntropyLoss(ignore_index=-100)`` (every causal language model's loss, with
    padding), class weights, or a masked token mean, divides each micro-batch by its own
    count: averaging those means is not the mini-batch's mean (and a micro-batch whose
    targets are all ignored gives NaN). :class:`BatchMean` says the loss's two parts
    instead: ``total(output, target)``, the micro-batch's summed loss, and
    ``count(target)``, what it is summed over. :meth:`GPipe.step
    <gpipe_core.GPipe.step>` counts the whole mini-batch first (summed over the data-parallel
    replicas too), then scales each micro-batch's backward pass by ``1 / count``: the loss
    and gradients are the plain model's.

    Called like any loss, ``loss(output, target)`` is ``total / count`` on what it is
    given, so the same object computes the plain model's loss.

    Args:
        total: ``total(output, target)`` returns the micro-batch's loss summed over its
            targets (a scalar tensor).
        count: ``count(target)`` returns the number of targets ``total`` sums over, or the
            sum of their weights (a number or a scalar tensor).

    Example:
        >>> loss = BatchMean.from_module(nn.CrossEntropyLoss(ignore_index=-100))
        >>> output = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
        >>> target = torch.tensor([0, -100, 1])
        >>> float(loss.count(target)), round(loss(output, target).item(), 4)
        (2.0, 0.41)

        A masked mean, written by hand (the target is a ``(values, mask)`` tuple):

        >>> masked = BatchMean(
        ...     lambda output, target: ((output - target[0]) ** 2 * target[1]).sum(),
        ...     lambda target: target[1].sum(),
        ... )
    """

    # What the step reads as the reduction: a mean, over the mini-batch's count.
    reduction = "mean"

    def __init__(self, total: LossFunction, count: CountFunction) -> None:
        if not callable(total) or not callable(count):
            raise TypeError(
                "BatchMean takes two callables, total(output, target) and count(target) "
                f"(total: {type(total).__name__}, count: {type(count).__name__})"
            )
        self.total = total
        self.count = count

    @classmethod
    def from_module(cls, loss: nn.CrossEntropyLoss | nn.NLLLoss) -> BatchMean:
        """The :class:`BatchMean` of a :class:`~torch.nn.CrossEntropyLoss` or
        :class:`~torch.nn.NLLLoss`: its sum over the targets it keeps, divided by their
        count (the sum of their class weights with ``weight``), as ``reduction='mean'``
        computes on one batch. Class-probability targets of a cross entropy count one per
        sample and position.

        A sum (``reduction='sum'``) needs no :class:`BatchMean`: the loss itself, as
        ``loss_fn``, gives the mini-batch's sum (the step adds up the micro-batches').

        Raises:
            TypeError: ``loss`` is neither of those.
            ValueError: ``loss.reduction`` is not ``'mean'`` (a sum, divided by the count,
                would be a mean).
        """
        if not isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)):
            raise TypeError(
                "BatchMean.from_module takes an nn.CrossEntropyLoss or an nn.NLLLoss; for "
                "another loss pass its two parts, BatchMean(total, count) "
                f"(loss: {type(loss).__name__})"
            )
        if loss.reduction == "sum":
            # Divided by the count it would be a mean: refused rather than changed.
            raise ValueError(
                "BatchMean.from_module takes a loss with reduction='mean'; a sum needs no "
                "BatchMean: pass the loss itself as loss_fn, and the step adds up the "
                f"micro-batches' sums (loss.reduction: {loss.reduction!r})"
            )
        if loss.reduction != "mean":
            raise ValueError(
                "BatchMean.from_module takes a loss with reduction='mean'; "
                f"reduction={loss.reduction!r} gives one loss per target, not the scalar a "
                f"step needs: use reduction='mean' (loss.reduction: {loss.reduction!r})"
            )
        weight, ignore = loss.weight, loss.ignore_index
        if isinstance(loss, nn.CrossEntropyLoss):
            smoothing = loss.label_smoothing

            def total(output: Tensor, target: Tensor) -> Tensor:
                return F.cross_entropy(
                    output, target, weight, ignore_index=ignore, reduction="sum",
                    label_smoothing=smoothing,
                )  # fmt: skip

        else:

            def total(output: Tensor, target: Tensor) -> Tensor:
                return F.nll_loss(output, target, weight, ignore_index=ignore, reduction="sum")

        def count(target: Tensor) -> Tensor:
            if target.is_floating_point():  # class probabilities, along dimension 1
                classes = target.shape[1] if target.dim() > 1 else target.numel()
                return torch.tensor(target.numel() // max(classes, 1), dtype=torch.float64)
            kept = target != ignore
            if weight is None:
                return kept.sum()
            return weight.to(target.device)[target[kept]].sum()

        return cls(total, count)

    def __call__(self, output: Any, target: Any) -> Tensor:
        return self.total(output, target) / self.count(target)

    def __repr__(self) -> str:
        return f"BatchMean(total={self.total!r}, count={self.count!r})"


class LossSpec:
    """What the last partition of a step needs for the losses.

    Args:
        loss_fn: ``loss_fn(output, target)`` returns a scalar tensor.
        targets: the micro-batches of the target, on the last partition's device.
        scales: what each micro-batch's loss is multiplied by in its backward pass (the
            gradient it is seeded with, :meth:`seed`).
        backward: whether the losses are differentiated (grad mode on).
        counts: with a :class:`BatchMean`, each micro-batch's count (its loss is then
            ``loss_fn.total``; :meth:`result` divides each by its count).
    """

    def __init__(
        self,
        loss_fn: LossFunction,
        targets: Sequence[Batch],
        scales: Sequence[float],
        backward: bool,
        counts: Sequence[float] | None = None,
        batch_size: int = 0,
    ) -> None:
        self.loss_fn = loss_fn
        #: The mini-batch's number of samples (for error messages).
        self.batch_size = batch_size
        self.targets = targets
        self.scales = scales
        self.backward = backward
        self.counts = counts
        #: Each micro-batch's loss, detached, once computed.
        self.losses: list[Tensor | None] = [None] * len(targets)

    def __call__(self, i: int, output: Batch) -> Tensor:
        target = self.targets[i]
        loss_fn = self.loss_fn.total if isinstance(self.loss_fn, BatchMean) else self.loss_fn
        try:
            loss = loss_fn(output.value, target.value)
        except Exception as error:
            add_note(error, self._where(i, output, target))
            raise
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            seen = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor (micro-batch {i}, loss_fn returned: {seen})"
            )
        if self.backward and not loss.requires_grad:
            # loss.backward() would raise here; a step would silently train nothing.
            raise ValueError(
                "loss_fn must return a loss with autograd history when the step computes gradients "
                f"(micro-batch {i}, loss_fn returned a tensor that does not require grad: "
                "detached, constant or integer)"
            )
        self.losses[i] = loss.detach()
        return loss

    def result(self, sizes: Sequence[int], reduction: Reduction) -> Losses:
        """The step's :class:`Losses`, once every micro-batch's loss is recorded: with a
        :class:`BatchMean`, each total divided by its count (one division for them all, off
        the partitions' path)."""
        losses = cast(list[Tensor], self.losses)
        if self.counts is not None and losses:
            totals = torch.stack(losses)
            counts = torch.tensor(self.counts, dtype=totals.dtype, device=totals.device)
            losses = list((totals / counts).unbind())
        return Losses(losses, sizes, reduction, self.counts)

    def _where(self, i: int, output: Batch, target: Batch) -> str:
        """Where ``loss_fn`` failed: the micro-batch's shapes beside the mini-batch's size
        (a loss written for the whole batch, a view by the batch size, fails on a part)."""
        size = len(output[0]) if len(output) and output[0].dim() else "?"

        def shapes(batch: Batch) -> str:
            return ", ".join(str(tuple(tensor.shape)) for tensor in batch) or "no tensor"

        return (
            f"loss_fn failed on micro-batch {i}: {size} of the mini-batch's {self.batch_size} "
            f"samples (output: {shapes(output)}; target: {shapes(target)}); a loss must "
            "work on any number of samples"
        )

    def seed(self, i: int, loss: Tensor) -> Tensor:
        """The gradient micro-batch ``i``'s ``loss`` is differentiated with: its scale.

        The same as differentiating ``loss * scale`` with a gradient of one (which
        multiplies one by the scale in the loss's dtype), without the multiplication and
        its autograd node.
        """
        return torch.full_like(loss, self.scales[i])


class Losses(Sequence[Tensor]):
    """The losses of one :meth:`GPipe.step <gpipe_core.GPipe.step>`, one per micro-batch.

    Each loss is what ``loss_fn`` returned for its micro-batch, detached, on the last
    partition's device (with a :class:`BatchMean`, the micro-batch's own mean,
    ``total / count``). :meth:`reduced` combines them into the loss of the whole
    mini-batch.

    Attributes:
        sizes: the number of samples in each micro-batch.
        reduction: how ``loss_fn`` reduces over samples: ``'mean'`` or ``'sum'``.
        counts: with a :class:`BatchMean`, each micro-batch's count (what its loss is
            averaged over); None otherwise.

    Example:
        >>> losses = Losses([torch.tensor(1.0), torch.tensor(4.0)], sizes=[3, 1], reduction="mean")
        >>> len(losses), losses[1].item()
        (2, 4.0)
        >>> losses.reduced().item()  # (3 * 1.0 + 1 * 4.0) / 4
        1.75
    """

    def __init__(
        self,
        losses: Sequence[Tensor],
        sizes: Sequence[int],
        reduction: Reduction,
        counts: Sequence[float] | None = None,
    ):
        if len(losses) != len(sizes):
            raise ValueError(
                f"losses and sizes must have the same length (losses: {len(losses)}, "
                f"sizes: {len(sizes)})"
            )
        if counts is not None and len(counts) != len(sizes):
            raise ValueError(
                f"counts must have one entry per micro-batch (sizes: {len(sizes)}, "
                f"counts: {len(counts)})"
            )
        self._losses = tuple(losses)
        self.sizes: tuple[int, ...] = tuple(sizes)
        self.reduction: Reduction = reduction
        self.counts: tuple[float, ...] | None = None if counts is None else tuple(counts)

    @overload
    def __getitem__(self, index: int) -> Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Tensor]: ...

    def __getitem__(self, index: int | slice) -> Tensor | Sequence[Tensor]:
        return self._losses[index]

    def __len__(self) -> int:
        return len(self._losses)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._losses)

    def reduced(self) -> Tensor:
        """The loss of the whole mini-batch, as ``loss_fn`` on all of it would return.

        With ``'mean'``, the mean of the micro-batch losses weighted by their sizes (with
        a :class:`BatchMean`, by their counts: a micro-batch that counts nothing adds
        nothing); with ``'sum'``, their sum.
        """
        stacked = torch.stack(self._losses)
        if self.reduction == "sum":
            return stacked.sum()
        counts = self.sizes if self.counts is None else self.counts
        weights = torch.tensor(counts, dtype=stacked.dtype, device=stacked.device)
        totals = torch.where(weights != 0, stacked * weights, torch.zeros_like(stacked))
        return totals.sum() / sum(counts)

    def __repr__(self) -> str:
        values = ", ".join(f"{loss.item():.4g}" for loss in self._losses)
        return f"Losses([{values}], sizes={list(self.sizes)}, reduction={self.reduction!r})"


#: Losses as numbers: the values, their dtype, the micro-batches' sizes, the reduction,
#: the counts.
Numbers = tuple[list[float], torch.dtype, Sequence[int], Reduction, Sequence[float] | None]


def to_numbers(losses: Losses) -> Numbers:
    """``losses`` as numbers and a dtype, exact for every float dtype (for the other ranks:
    pickling tensors is slow)."""
    dtype = losses[0].dtype if len(losses) else torch.float32
    return [loss.item() for loss in losses], dtype, losses.sizes, losses.reduction, losses.counts


def from_numbers(numbers: Numbers) -> Losses:
    values, dtype, sizes, reduction, counts = numbers
    return Losses([torch.tensor(value, dtype=dtype) for value in values], sizes, reduction, counts)
