"""Devices as users name them: :data:`Device`, its normal form, and making one current.

Shared by gpipe-core (the pipeline's devices) and gpipe-balance (the device a profile
runs on). Streams are not here: they are gpipe-core's, their only user.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch

__all__ = ["Device", "normalize_device", "use_device"]


#: A device as users may name it: a :class:`torch.device`, a string, or a CUDA index.
Device = torch.device | str | int


def normalize_device(device: Device) -> torch.device:
    """``device`` as a :class:`torch.device`, named as torch names the device of a tensor
    made there, so that two names of one device compare equal.

    A bare ``'cuda'`` gets the current index (without CUDA it stays as it is: no tensor
    can be there; the caller says so). The CPU is one device, whatever its index:
    ``'cpu:0'`` and ``torch.device('cpu', 1)`` are ``'cpu'``, as
    ``torch.randn(1, device='cpu:0').device`` is.

    Example:
        >>> normalize_device(0)
        device(type='cuda', index=0)
        >>> normalize_device("cpu")
        device(type='cpu')
        >>> normalize_device("cpu:0")
        device(type='cpu')
    """
    result = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    index: int | None = result.index
    if result.type == "cuda" and index is None and torch.cuda.is_available():
        result = torch.device("cuda", torch.cuda.current_device())
    elif result.type == "cpu" and index is not None:
        result = torch.device("cpu")
    return result


@contextmanager
def use_device(device: torch.device) -> Generator[None, None, None]:
    """Make ``device`` the current CUDA device; a no-op for other devices."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield
