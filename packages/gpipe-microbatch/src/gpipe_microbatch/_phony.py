"""Phony tensors: empty tensors whose only job is to carry an edge in the autograd graph."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

__all__ = ["get_phony"]

_phonies: dict[tuple[torch.device, bool], Tensor] = {}
_lock = threading.Lock()


def get_phony(device: torch.device, *, requires_grad: bool) -> Tensor:
    """An empty tensor on ``device``, cached, to carry ordering edges through autograd.

    A phony occupies no memory. Autograd functions take and return it to create
    dependencies between nodes that share no real tensor.

    Example:
        >>> phony = get_phony(torch.device("cpu"), requires_grad=False)
        >>> phony.numel(), phony is get_phony(torch.device("cpu"), requires_grad=False)
        (0, True)
    """
    key = (device, requires_grad)
    phony = _phonies.get(key)
    if phony is None:
        with _lock:
            phony = _phonies.get(key)
            if phony is None:
                phony = torch.empty(0, device=device, requires_grad=requires_grad)
                _phonies[key] = phony
    return phony
