"""Fork and join: ordering edges between otherwise independent branches of autograd.

``fork`` splits a phony off a tensor; ``join`` makes another tensor depend on that phony.
In backward, the gradient reaches the forked tensor's producer only after the joined
tensor's backward has run, which fixes the order of otherwise independent work. The phony
itself is gpipe_microbatch's (:func:`~gpipe_microbatch.get_phony`, shared with
gpipe-checkpoint); the partitions decide what to order.

It must not know partitions, schedules or runs: it orders the backward passes of two tensors
for whoever asks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpipe_microbatch import get_phony

__all__ = ["Fork", "Join", "fork", "join"]


class Fork(torch.autograd.Function):
    """Returns its input and a phony that backward waits on."""

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> tuple[Tensor, Tensor]:
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor, grad_phony: Tensor) -> Tensor:
        return grad_input


class Join(torch.autograd.Function):
    """Returns its input; in backward, also sends a gradient to the phony."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor) -> tuple[Tensor, None]:
        return grad_input, None


def fork(input: Tensor) -> tuple[Tensor, Tensor]:
    """Split a phony off ``input``: returns ``(input, phony)``.

    Pass the phony to :func:`join` on another tensor: in backward, the gradient reaches
    ``input``'s producer only after the joined tensor's backward has run. Without autograd
    (grad disabled, or ``input`` not requiring grad) the phony carries no edge.

    Example:
        >>> a = torch.ones(2, requires_grad=True)
        >>> b = torch.ones(2, requires_grad=True)
        >>> _, phony = fork(a * 2)
        >>> join(b * 3, phony).sum().backward()  # reaches a's branch, after b's
        >>> a.grad, b.grad
        (tensor([0., 0.]), tensor([3., 3.]))
    """
    if torch.is_grad_enabled() and input.requires_grad:
        output, phony = Fork.apply(input)  # type: ignore[no-untyped-call]
        return output, phony
    return input, get_phony(input.device, requires_grad=False)


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Make ``input``'s backward feed ``phony`` first: returns ``input`` with the edge."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        output: Tensor = Join.apply(input, phony)  # type: ignore[no-untyped-call]
        return output
    return input
