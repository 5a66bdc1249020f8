"""Thread-local flags telling a layer whether it runs in a checkpoint or a recompute phase."""

from __future__ import annotations

import threading
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager

__all__ = ["enable_checkpointing", "enable_recomputing", "is_checkpointing", "is_recomputing"]


class _Phase(threading.local):
    checkpointing = False
    recomputing = False


_phase = _Phase()


@contextmanager
def _raised(flag: str) -> Generator[None, None, None]:
    previous = getattr(_phase, flag)
    setattr(_phase, flag, True)
    try:
        yield
    finally:
        setattr(_phase, flag, previous)


def enable_checkpointing() -> AbstractContextManager[None]:
    """Mark the body as the checkpoint phase (the first, gradient-free forward pass)."""
    return _raised("checkpointing")


def enable_recomputing() -> AbstractContextManager[None]:
    """Mark the body as the recompute phase (the forward pass re-run during backward)."""
    return _raised("recomputing")


def is_checkpointing() -> bool:
    """Whether the current thread runs a forward pass under checkpointing.

    In that pass autograd records nothing; the same forward pass runs again, with
    autograd, when the gradient arrives (see :func:`is_recomputing`).

    Example:
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
