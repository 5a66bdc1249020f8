"""Thread-local flags telling a layer whether it runs in a checkpoint or a recompute phase."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager

__all__ = ["enable_checkpointing", "enable_recomputing", "is_checkpointing", "is_recomputing"]


class _Phase(threading.local):
    checkpointing = False
    recomputing = False


_phase = _Phase()


class _Raised:
    """Raise a flag of the current thread for the body; put back what it was after.

    A class rather than a generator: it runs around every checkpointed task.
    """

    __slots__ = ("flag", "previous")

    def __init__(self, flag: str) -> None:
        self.flag = flag
        self.previous = False

    def __enter__(self) -> None:
        self.previous = getattr(_phase, self.flag)
        setattr(_phase, self.flag, True)

    def __exit__(self, *exc_info: object) -> None:
        setattr(_phase, self.flag, self.previous)


def enable_checkpointing() -> AbstractContextManager[None]:
    """Mark the body as the checkpoint phase (the first, gradient-free forward pass)."""
    return _Raised("checkpointing")


def enable_recomputing() -> AbstractContextManager[None]:
    """Mark the body as the recompute phase (the forward pass re-run during backward)."""
    return _Raised("recomputing")


def is_checkpointing() -> bool:
    """Whether the current thread runs a forward pass under checkpointing.

    In that pass autograd records nothing; the same forward pass runs again, with
    autograd, when the gradient arrives (see :func:`is_recomputing`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Probe(nn.Module):
        ...     def forward(self, x):
        ...         print("checkpointing:", is_checkpointing())
        ...         return x
        >>> _ = Probe()(torch.zeros(1))
        checkpointing: False
    """
    return _phase.checkpointing


def is_recomputing() -> bool:
    """Whether the current thread re-runs a checkpointed forward pass for backward.

    A layer with side effects that must happen once per mini-batch (updating running
    statistics, say) skips them when this is true.

    Example:
        >>> is_recomputing()
        False
    """
    return _phase.recomputing
