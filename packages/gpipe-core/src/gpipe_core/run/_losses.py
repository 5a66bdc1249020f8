"""The losses of a training step (:meth:`GPipe.step <gpipe_core.GPipe.step>`): what the last
partition needs to compute them (:class:`LossSpec`), and what the step returns
(:class:`Losses`).

It must not know how a step runs: it computes, holds, reduces and converts the losses of
the micro-batches it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from gpipe_microbatch import Batch

__all__ = [
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


class LossSpec:
    """What the last partition of a step needs for the losses.

    Args:
        loss_fn: ``loss_fn(output, target)`` returns a scalar tensor.
        targets: the micro-batches of the target, on the last partition's device.
        scales: what each micro-batch's loss is multiplied by in its backward pass (the
            gradient it is seeded with, :meth:`seed`).
        backward: whether the losses are differentiated (a training step).
    """

    def __init__(
        self,
        loss_fn: LossFunction,
        targets: Sequence[Batch],
        scales: Sequence[float],
        backward: bool,
    ) -> None:
        self.loss_fn = loss_fn
        self.targets = targets
        self.scales = scales
        self.backward = backward
        #: Each micro-batch's loss, detached, once computed.
        self.losses: list[Tensor | None] = [None] * len(targets)

    def __call__(self, i: int, output: Batch) -> Tensor:
        loss = self.loss_fn(output.value, self.targets[i].value)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            seen = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor (micro-batch {i}, loss_fn returned: {seen})"
            )
        if self.backward and not loss.requires_grad:
            # loss.backward() would raise here; a step would silently train nothing.
            raise ValueError(
                "loss_fn must return a loss with autograd history in a training step "
                f"(micro-batch {i}, loss_fn returned a tensor that does not require grad: "
                "detached, constant or integer)"
            )
        self.losses[i] = loss.detach()
        return loss

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
