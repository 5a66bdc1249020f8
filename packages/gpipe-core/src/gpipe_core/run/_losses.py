"""The losses of a training step (:meth:`GPipe.step <gpipe_core.GPipe.step>`).

It must not know how a step runs: it holds, reduces and converts the losses it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

__all__ = ["LossFunction", "Losses", "Numbers", "Reduction", "from_numbers", "to_numbers"]

#: How a loss function reduces over the samples of a micro-batch.
Reduction = Literal["mean", "sum"]
#: ``loss_fn(output, target)``, returning a scalar tensor.
LossFunction = Callable[[Any, Any], Tensor]


class Losses(Sequence[Tensor]):
    """The losses of one :meth:`GPipe.step <gpipe_core.GPipe.step>`, one per micro-batch.

    Each loss is what ``loss_fn`` returned for its micro-batch, detached, on the last
    partition's device. :meth:`reduced` combines them into the loss of the whole
    mini-batch.

    Attributes:
        sizes: the number of samples in each micro-batch.
        reduction: how ``loss_fn`` reduces over samples: ``'mean'`` or ``'sum'``.

    Example:
        >>> losses = Losses([torch.tensor(1.0), torch.tensor(4.0)], sizes=[3, 1], reduction="mean")
        >>> len(losses), losses[1].item()
        (2, 4.0)
        >>> losses.reduced().item()  # (3 * 1.0 + 1 * 4.0) / 4
        1.75
    """

    def __init__(self, losses: Sequence[Tensor], sizes: Sequence[int], reduction: Reduction):
        if len(losses) != len(sizes):
            raise ValueError(
                f"losses and sizes must have the same length (losses: {len(losses)}, "
                f"sizes: {len(sizes)})"
            )
        self._losses = tuple(losses)
        self.sizes: tuple[int, ...] = tuple(sizes)
        self.reduction: Reduction = reduction

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

        With ``'mean'``, the mean of the micro-batch losses weighted by their sizes; with
        ``'sum'``, their sum.
        """
        stacked = torch.stack(self._losses)
        if self.reduction == "sum":
            return stacked.sum()
        weights = torch.tensor(self.sizes, dtype=stacked.dtype, device=stacked.device)
        return (stacked * weights).sum() / max(sum(self.sizes), 1)

    def __repr__(self) -> str:
        values = ", ".join(f"{loss.item():.4g}" for loss in self._losses)
        return f"Losses([{values}], sizes={list(self.sizes)}, reduction={self.reduction!r})"


#: Losses as numbers: the values, their dtype, the micro-batches' sizes, the reduction.
Numbers = tuple[list[float], torch.dtype, Sequence[int], Reduction]


def to_numbers(losses: Losses) -> Numbers:
    """``losses`` as numbers and a dtype, exact for every float dtype (for the other ranks:
    pickling tensors is slow)."""
    dtype = losses[0].dtype if len(losses) else torch.float32
    return [loss.item() for loss in losses], dtype, losses.sizes, losses.reduction


def from_numbers(numbers: Numbers) -> Losses:
    values, dtype, sizes, reduction = numbers
    return Losses([torch.tensor(value, dtype=dtype) for value in values], sizes, reduction)
