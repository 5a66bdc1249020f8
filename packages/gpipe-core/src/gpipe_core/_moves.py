"""Device moves of a pipeline (``.cuda()``, ``.cpu()``, ``.to(device)``): partitions stay
on the devices given at construction.

This module owns which moves are nothing to do (every partition of this process is on that
device already) and the refusal of the others, and the methods that apply them
(:class:`FixedDevices`, a base of :class:`~gpipe_core.GPipe`). It must not know runs or
processes: the placement gives the devices of this process's partitions, and of every
partition for the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from ._placement import Placement

__all__ = ["FixedDevices", "check_cpu", "check_cuda", "check_to"]

_Moved = TypeVar("_Moved", bound="FixedDevices")


def _refuse(how: str, device: object, devices: Sequence[torch.device]) -> NoReturn:
    raise TypeError(
        f"{how} would move every partition to one device; GPipe places partitions on "
        f"the devices given at construction (devices: {[str(d) for d in devices]}, "
        f"device: {device!r})"
    )


def _stays(device: torch.device, local: Sequence[torch.device]) -> bool:
    """Whether every partition of this process (on ``local``) is on ``device`` already (a
    CUDA device without an index meaning the current one): then moving there moves
    nothing."""
    if str(device) == "cuda":  # no index
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    return bool(local) and all(d == device for d in local)


def check_cuda(device: Any, local: Sequence[torch.device], devices: Sequence[torch.device]) -> None:
    """Refuse ``.cuda(device)`` unless it moves nothing."""
    if device is None:
        target = torch.device("cuda")
    elif isinstance(device, int):
        target = torch.device("cuda", device)
    else:
        target = torch.device(device)
    if not _stays(target, local):
        _refuse(".cuda()", device, devices)


def check_cpu(local: Sequence[torch.device], devices: Sequence[torch.device]) -> None:
    """Refuse ``.cpu()`` unless it moves nothing."""
    if not _stays(torch.device("cpu"), local):
        _refuse(".cpu()", "cpu", devices)


def check_to(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    local: Sequence[torch.device],
    devices: Sequence[torch.device],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Refuse the arguments of ``.to(...)`` where they name a device (or a tensor, which
    has one) that a partition of this process is not on; else the arguments that are left
    for :meth:`torch.nn.Module.to` (None: nothing left to do)."""
    # A device index is a CUDA device, resolved here: without an accelerator torch
    # would raise its own error for it.
    index = kwargs.get("device", args[0] if args else None)
    if isinstance(index, int) and not isinstance(index, bool):
        if not _stays(torch.device("cuda", index), local):
            _refuse(".to(device)", index, devices)
        rest = args[1:] if args and args[0] is index else args
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        return (rest, kwargs) if rest or kwargs else None
    device: torch.device | None = torch._C._nn._parse_to(*args, **kwargs)[0]
    if device is not None and not _stays(device, local):
        _refuse(".to(device)", device, devices)
    return args, kwargs


class FixedDevices(nn.Module):
    """The device moves of a module whose partitions stay on the devices of its
    ``_placement`` (:class:`~gpipe_core.GPipe`): a move to where they are is nothing to do,
    any other is refused."""

    _placement: Placement

    def cuda(self: _Moved, device: Any = None) -> _Moved:
        """Nothing to do when every partition is on that CUDA device already; otherwise
        refused: partitions stay on their devices.

        Raises:
            TypeError: a partition is on another device.
        """
        check_cuda(device, self._placement.local_devices(), self._placement.devices)
        return self

    def cpu(self: _Moved) -> _Moved:
        """Nothing to do when every partition is on the CPU already; otherwise refused:
        partitions stay on their devices.

        Raises:
            TypeError: a partition is on another device.
        """
        check_cpu(self._placement.local_devices(), self._placement.devices)
        return self

    def to(self: _Moved, *args: Any, **kwargs: Any) -> _Moved:
        """Convert the dtype of parameters and buffers; a device is accepted only where every
        partition is already, and moving to another one is refused.

        Raises:
            TypeError: the arguments name a device (or a tensor, which has one) that a
                partition is not on.
        """
        rest = check_to(args, kwargs, self._placement.local_devices(), self._placement.devices)
        return super().to(*rest[0], **rest[1]) if rest is not None else self
