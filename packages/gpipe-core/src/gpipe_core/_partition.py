"""Checking the wrapped module and splitting it into partitions on devices."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from gpipe_microbatch import Device, normalize_device
from gpipe_microbatch import check_balance as check_counts

__all__ = [
    "check_balance",
    "check_split",
    "layer_groups",
    "resolve_devices",
    "split_module",
]


def balance_from_placement(module: nn.Sequential) -> tuple[list[int], list[torch.device]]:
    """The balance and devices that follow where ``module``'s layers are.

    Partitions are the runs of consecutive layers on one device; a layer without
    parameters or buffers belongs with the layer before it (the first such layers, with
    the first layer that has a device). An empty module has no partitions.

    Raises:
        TypeError: every layer is on one device: where to split cannot be read from the
            module (the message shows how to measure a balance).
    """
    if len(module) == 0:
        return [], []
    placed: list[torch.device | None] = []
    for layer in module:
        tensor: torch.Tensor | None = None
        if layer is not None:
            tensor = next(iter(layer.parameters()), None)
        if tensor is None and layer is not None:
            tensor = next(iter(layer.buffers()), None)
        placed.append(tensor.device if tensor is not None else None)
    known = [device for device in placed if device is not None]
    if len(set(known)) < 2:
        where = str(known[0]) if known else "no device: no layer has parameters"
        raise TypeError(
            f"balance must be given when every layer is on one device (layers: {len(module)}, "
            f"device: {where}): pass the number of layers in each partition, or measure it, "
            "for example balance = gpipe.balance.balance_by_time(2, module, sample) (or "
            "balance_by_size) and then GPipe(module, balance)"
        )
    current = known[0]
    runs: list[tuple[torch.device, int]] = []
    for device in placed:
        current = device if device is not None else current
        if runs and runs[-1][0] == current:
            runs[-1] = (current, runs[-1][1] + 1)
        else:
            runs.append((current, 1))
    return [count for _, count in runs], [device for device, _ in runs]


def check_balance(module: nn.Sequential, balance: object) -> list[int]:
    """Check ``balance`` against ``module``; returns it as a list of layer counts.

    Raises:
        BalanceError: ``balance`` is empty, has an entry that is not a positive integer,
            or does not sum to the number of layers.
    """
    if len(module) == 0 and isinstance(balance, (list, tuple)) and not balance:
        return []  # an empty module: no partitions
    return check_counts(balance, len(module))


def resolve_devices(devices: Iterable[Device] | None, partitions: int) -> list[torch.device]:
    """The device of every partition.

    Without ``devices``: every CUDA device in order when CUDA is available, else the CPU
    for every partition.

    Raises:
        TypeError: ``devices`` is not a list, or an entry is not a device, a device name
            or an index.
        ValueError: fewer devices than partitions, or a device that cannot hold a
            partition (unknown, without CUDA, a CUDA index out of range, ``meta``).
    """
    if devices is None:
        if torch.cuda.is_available():
            resolved = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        else:
            resolved = [torch.device("cpu")] * partitions
    else:
        if isinstance(devices, (str, torch.device, int)):
            raise TypeError(
                f"devices must be a list of devices, one per partition (devices: {devices!r})"
            )
        resolved = [_device(device, k, devices) for k, device in enumerate(devices)]
    if len(resolved) < partitions:
        raise ValueError(
            "too few devices to hold the partitions "
            f"(devices: {len(resolved)}, partitions: {partitions})"
        )
    return resolved[:partitions]


def _device(device: object, k: int, devices: object) -> torch.device:
    """``devices[k]`` as a device that can hold a partition, or a clear error."""
    where = f"devices[{k}]: {device!r}, devices: {devices!r}"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"devices must hold devices, device names or indices ({where})")
    if isinstance(device, int) and device < 0:
        raise ValueError(f"a device index cannot be negative ({where})")
    try:
        resolved = normalize_device(device)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"devices has an entry that is not a device ({where})") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"devices names a CUDA device but CUDA is not available ({where})")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                "devices names a CUDA device that does not exist "
                f"(cuda devices: {torch.cuda.device_count()}, {where})"
            )
    elif resolved.type in ("meta",):
        raise ValueError(
            f"devices must be devices that hold tensors' data; moving layers to meta would "
            f"lose their weights ({where})"
        )
    return resolved


def _check_shared(partitions: Sequence[nn.Sequential], devices: Sequence[torch.device]) -> None:
    """Refuse a parameter or buffer shared by partitions on different devices."""
    owner: dict[int, int] = {}
    for j, partition in enumerate(partitions):
        tensors = [*partition.parameters(), *partition.buffers()]
        for tensor in tensors:
            first = owner.setdefault(id(tensor), j)
            if first != j and devices[first] != devices[j]:
                raise ValueError(
                    "a parameter or buffer is shared by partitions on different devices "
                    f"(partition {first} on {devices[first]}, partition {j} on {devices[j]})"
                )


def layer_groups(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """``module``'s layers in ``len(balance)`` sequentials, where they are, under their
    names."""
    layers = list(module._modules.items())
    partitions: list[nn.Sequential] = []
    start = 0
    for count in balance:
        partitions.append(nn.Sequential(OrderedDict(layers[start : start + count])))
        start += count
    return partitions


def check_split(
    module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]
) -> None:
    """Check that ``module`` can be split as :func:`split_module` would, changing nothing.

    Raises:
        ValueError: a parameter is shared by partitions on different devices.
    """
    _check_shared(layer_groups(module, balance), devices)


def split_module(
    module: nn.Sequential,
    balance: Sequence[int],
    devices: Sequence[torch.device],
    local: Sequence[bool] | None = None,
) -> list[nn.Sequential]:
    """Split ``module`` into ``len(balance)`` partitions and move each to its device.

    Layers keep their names, so ``partitions[1][0]`` may be the original ``module[3]``.
    A partition whose layers are on the meta device is made on its device with
    uninitialized tensors, then each layer's ``reset_parameters()`` initializes it.

    Args:
        local: which partitions this process keeps (default: all); the others are
            released (an empty :class:`~torch.nn.Sequential` stands in for each) and
            their layers are not moved.

    Raises:
        ValueError: a parameter is shared by partitions on different devices.
    """
    partitions = layer_groups(module, balance)
    _check_shared(partitions, devices)
    for j, (partition, device) in enumerate(zip(partitions, devices, strict=False)):
        if local is not None and not local[j]:
            partitions[j] = nn.Sequential()
        elif any(tensor.is_meta for tensor in (*partition.parameters(), *partition.buffers())):
            partition.to_empty(device=device)
            for layer in partition.modules():
                reset = getattr(layer, "reset_parameters", None)
                if callable(reset):
                    reset()
        else:
            partition.to(device)
    return partitions
