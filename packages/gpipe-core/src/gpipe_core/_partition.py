"""Checking the wrapped module, placing its layers and splitting it into partitions on devices.

It must not know how partitions run (runs, schedules, transports, threads): it checks the
module and splits it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from gpipe_microbatch import Device, check_balance, normalize_device

from ._materialize import InitStep, Materializer
from ._state_dict import KeyMap, Renaming, map_keys

__all__ = [
    "WithDevice",
    "balance_from_placement",
    "check_module_balance",
    "check_split",
    "layer_groups",
    "placed_layers",
    "resolve_devices",
    "split_module",
]


class WithDevice(nn.Module):
    """A layer placed on ``device``: where :class:`~gpipe_core.GPipe` puts it and its partition.

    Without ``balance``, :class:`~gpipe_core.GPipe` makes partitions of the runs of
    consecutive layers on one device, and reads a layer's device from its parameters. A
    layer without parameters (dropout, an activation) has none to read, so it joins the
    layer before it; wrapped, it is on ``device`` instead. A wrapped layer with parameters
    is on ``device`` too, wherever its parameters are now: GPipe moves it there.

    The wrapper itself moves nothing, and is transparent: its forward pass is the wrapped
    layer's, wherever the layer is, and its :meth:`~torch.nn.Module.state_dict` has the
    wrapped layer's keys (``weight``, not ``module.weight``), so a model with wrappers and
    the same model without them share their checkpoints. GPipe keeps the wrapped layer
    under the wrapper's name and drops the wrapper: :meth:`GPipe.unwrap()
    <gpipe_core.GPipe.unwrap>`, indexing and :meth:`~torch.nn.Module.state_dict` give the
    layer itself.

    With ``balance`` given, every wrapped layer must fall in a partition on its device
    (refused otherwise); a wrapper that is not a layer of the :class:`~torch.nn.Sequential`
    itself, but nested deeper, is refused by GPipe, as it could not place anything.

    Args:
        module: the layer to place.
        device: where it runs: a :class:`torch.device`, a device name (``'cuda:1'``) or a
            CUDA index. Devices are compared as torch compares those of tensors, so
            ``'cpu:0'`` is the CPU, ``'cpu'``. Whether the device exists is checked when
            GPipe places the layer, so a model with wrappers can still be built and run on
            a machine without it.

    Raises:
        TypeError: ``module`` is not an :class:`~torch.nn.Module` (or is a
            :class:`WithDevice` already), or ``device`` is not a device, a device name or
            an index.
        ValueError: ``device`` is not a device name, is a negative index, or is ``meta``.

    Example:
        The dropout and the last layer run on a GPU, the first layer on the CPU, where its
        parameters are (this part needs a GPU, so it is not run here):

        >>> import torch
        >>> from torch import nn
        >>> from gpipe_core import GPipe, WithDevice
        >>> model = nn.Sequential(
        ...     nn.Linear(8, 8),
        ...     WithDevice(nn.Dropout(0.1), "cuda:0"),  # unwrapped, it would join the layer before
        ...     WithDevice(nn.Linear(8, 2), "cuda:0"),  # GPipe moves it to the GPU
        ... )
        >>> pipe = GPipe(model, chunks=2)  # doctest: +SKIP
        >>> pipe.balance, [str(device) for device in pipe.devices]  # doctest: +SKIP
        ([1, 2], ['cpu', 'cuda:0'])

        On one device the layers do not say where to split: ``balance`` does, and each
        wrapped layer must fall in a partition on its device (``'cpu:0'`` is the CPU):

        >>> model = nn.Sequential(
        ...     nn.Linear(8, 8),
        ...     WithDevice(nn.Dropout(0.1), "cpu:0"),
        ...     WithDevice(nn.Linear(8, 2), "cpu"),
        ... )
        >>> pipe = GPipe(model, [1, 2], devices=["cpu", "cpu"], chunks=2)
        >>> pipe[1]  # the layer itself, without its wrapper
        Dropout(p=0.1, inplace=False)
        >>> pipe(torch.randn(4, 8)).shape
        torch.Size([4, 2])

        The keys of a wrapped layer are the layer's own:

        >>> list(nn.Sequential(WithDevice(nn.Linear(2, 2), "cpu")).state_dict())
        ['0.weight', '0.bias']
    """

    module: nn.Module

    def __init__(self, module: nn.Module, device: Device) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module (module: {module!r})")
        if isinstance(module, WithDevice):
            raise TypeError(
                "module is a WithDevice already: wrap the layer once "
                f"(module: WithDevice({type(module.module).__name__}) on {module.device})"
            )
        self._device = _parse_device(device, "device", f"device: {device!r}")
        self.module = module
        # The wrapper adds nothing to the keys: they are the wrapped layer's.
        map_keys(self, _WrappedKeys())

    @property
    def device(self) -> torch.device:
        """Where the layer runs."""
        return self._device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped layer's forward pass."""
        return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"device={self._device}"


class _WrappedKeys(KeyMap):
    """The wrapped layer's keys are ``module.<key>`` in the wrapper, ``<key>`` plainly; its
    metadata entry takes the wrapper's place."""

    def to_plain(self, module: nn.Module, key: str) -> str | None:
        if key == "module":
            return ""
        return key.removeprefix("module.")

    def from_plain(self, module: nn.Module, key: str) -> str | None:
        return f"module.{key}" if key else "module"


def _unwrapped(layer: nn.Module | None) -> nn.Module | None:
    """The layer that goes into a partition: the wrapped one for a :class:`WithDevice`."""
    return layer.module if isinstance(layer, WithDevice) else layer


def _describe(index: int, layer: WithDevice) -> str:
    return f"layer {index}: WithDevice({type(layer.module).__name__}) on {layer.device}"


def _check_wrappers(module: nn.Sequential) -> None:
    """Refuse a :class:`WithDevice` nested in a layer: only layers are placed."""
    layers: list[nn.Module | None] = list(module._modules.values())  # None: an empty slot
    for index, layer in enumerate(layers):
        inner = _unwrapped(layer)
        for path, nested in inner.named_modules() if inner is not None else ():
            if isinstance(nested, WithDevice) and path:
                raise TypeError(
                    "WithDevice must be a layer of the sequential module itself, where it "
                    f"places the layer (layer {index} ({type(layer).__name__}) has one at "
                    f"{path!r})"
                )


def placed_layers(module: nn.Sequential) -> nn.Sequential:
    """``module``'s layers under their names, each :class:`WithDevice` replaced by its layer.

    Raises:
        TypeError: a :class:`WithDevice` is nested in a layer rather than a layer itself.
    """
    _check_wrappers(module)
    layers: list[tuple[str, nn.Module | None]] = list(module._modules.items())
    placed = OrderedDict((name, _unwrapped(layer)) for name, layer in layers)
    return nn.Sequential(cast("OrderedDict[str, nn.Module]", placed))


def balance_from_placement(module: nn.Sequential) -> tuple[list[int], list[torch.device]]:
    """The balance and devices that follow where ``module``'s layers are.

    Partitions are the runs of consecutive layers on one device: a :class:`WithDevice`
    layer's device, else the device of the layer's first parameter or buffer. A layer with
    neither belongs with the layer before it (the first such layers, with the first layer
    that has a device). An empty module has no partitions.

    Raises:
        TypeError: every layer is on one device: where to split cannot be read from the
            module (the message shows how to measure a balance).
        ValueError: a :class:`WithDevice` names a device that cannot hold a partition here
            (CUDA not available, a CUDA index out of range).
    """
    if len(module) == 0:
        return [], []
    placed: list[torch.device | None] = []
    for index, layer in enumerate(module):
        if isinstance(layer, WithDevice):
            _check_available(layer.device, "a WithDevice", _describe(index, layer))
            placed.append(layer.device)
            continue
        tensor: torch.Tensor | None = None
        if layer is not None:
            tensor = next(iter(layer.parameters()), None)
        if tensor is None and layer is not None:
            tensor = next(iter(layer.buffers()), None)
        placed.append(tensor.device if tensor is not None else None)
    known = [device for device in placed if device is not None]
    if len(set(known)) < 2:
        where = str(known[0]) if known else "no device: no layer has parameters or a WithDevice"
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


def check_module_balance(module: nn.Sequential, balance: object) -> list[int]:
    """Check ``balance`` against ``module``; returns it as a list of layer counts.

    Raises:
        BalanceError: ``balance`` is empty, has an entry that is not a positive integer,
            or does not sum to the number of layers.
    """
    if len(module) == 0 and isinstance(balance, (list, tuple)) and not balance:
        return []  # an empty module: no partitions
    return check_balance(balance, len(module))


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
        hint = ""
        if devices is None:
            hint = (
                ": by default each partition gets a CUDA device of its own; pass devices= to "
                f"put several on one (devices=['cuda:0'] * {partitions}, say)"
            )
        raise ValueError(
            "too few devices to hold the partitions "
            f"(devices: {len(resolved)}, partitions: {partitions}){hint}"
        )
    return resolved[:partitions]


def _device(device: object, k: int, devices: object) -> torch.device:
    """``devices[k]`` as a device that can hold a partition, or a clear error."""
    where = f"devices[{k}]: {device!r}, devices: {devices!r}"
    resolved = _parse_device(device, "devices", where)
    _check_available(resolved, "devices", where)
    return resolved


def _parse_device(device: object, name: str, where: str) -> torch.device:
    """``device``, an entry of the argument ``name``, as a device that could hold layers.

    ``name`` is ``'devices'`` for an entry of a list, ``'device'`` for one device. Whether
    the device exists here is :func:`_check_available`'s question.
    """
    one = name != "devices"
    expected = (
        "be a device, a device name or an index" if one else "hold devices, device names or indices"
    )
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{name} must {expected} ({where})")
    if isinstance(device, int) and device < 0:
        raise ValueError(f"a device index cannot be negative ({where})")
    try:
        resolved = normalize_device(device)
    except (RuntimeError, ValueError) as error:
        what = f"{name} must {expected}" if one else f"{name} has an entry that is not a device"
        raise ValueError(f"{what} ({where})") from error
    if resolved.type in ("meta",):
        what = "a device that holds" if one else "devices that hold"
        raise ValueError(
            f"{name} must be {what} tensors' data; moving layers to meta would "
            f"lose their weights ({where})"
        )
    return resolved


def _check_available(device: torch.device, name: str, where: str) -> None:
    """Refuse a CUDA ``device`` (from the argument ``name``) that this process cannot use."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} names a CUDA device but CUDA is not available ({where})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{name} names a CUDA device that does not exist "
                f"(cuda devices: {torch.cuda.device_count()}, {where})"
            )


def _check_shared(partitions: Sequence[nn.Sequential], devices: Sequence[torch.device]) -> None:
    """Refuse a buffer shared by partitions on different devices of this process: its
    layers may update it in place, and each device's copy would drift from the others. A
    shared parameter is tied instead (see :class:`gpipe_core._shared.Ties`); a partition of
    another process (on ``meta`` here) keeps a replica (see :mod:`gpipe_core._shared`)."""
    owner: dict[int, tuple[int, str]] = {}
    for j, partition in enumerate(partitions):
        if devices[j].type == "meta":
            continue
        for key, tensor in partition.named_buffers(remove_duplicate=False):
            first, first_key = owner.setdefault(id(tensor), (j, key))
            if first != j and devices[first] != devices[j]:
                raise ValueError(
                    f"a buffer is shared by partitions on different devices of this process "
                    f"({first_key} in partition {first} on {devices[first]} is {key} in "
                    f"partition {j} on {devices[j]}), whose copies would drift apart (a layer "
                    "may update it in place): put the partitions that share it on one device, "
                    "or give each layer its own"
                )


def layer_groups(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """``module``'s layers in ``balance`` runs, where they are, under their names, without
    their :class:`WithDevice` wrappers."""
    layers = list(placed_layers(module)._modules.items())
    partitions: list[nn.Sequential] = []
    start = 0
    for count in balance:
        partitions.append(nn.Sequential(OrderedDict(layers[start : start + count])))
        start += count
    return partitions


def _check_placement(
    module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]
) -> None:
    """Refuse a :class:`WithDevice` layer that ``balance`` puts in a partition on another
    device than its own."""
    owner = [j for j, count in enumerate(balance) for _ in range(count)]
    for index, layer in enumerate(module._modules.values()):
        j = owner[index]
        # A partition of another process (meta here) is placed there.
        if (
            isinstance(layer, WithDevice)
            and devices[j].type != "meta"
            and layer.device != devices[j]
        ):
            raise ValueError(
                "a WithDevice layer must be in a partition on its device "
                f"({_describe(index, layer)}, partition {j} on {devices[j]}, "
                f"balance: {list(balance)}, devices: {[str(d) for d in devices]})"
            )


def check_split(
    module: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device]
) -> None:
    """Check that ``module`` can be split as :func:`split_module` would, changing nothing.

    Raises:
        TypeError: a :class:`WithDevice` is nested in a layer.
        ValueError: a :class:`WithDevice` layer is in a partition on another device, or a
            buffer is shared by partitions on different devices.
    """
    _check_placement(module, balance, devices)
    _check_shared(layer_groups(module, balance), devices)


def split_module(
    module: nn.Sequential,
    balance: Sequence[int],
    devices: Sequence[torch.device],
    local: Sequence[bool] | None = None,
    init: Sequence[InitStep] = (),
    renaming: Renaming | None = None,
) -> list[nn.Sequential]:
    """Split ``module`` into ``len(balance)`` partitions and move each to its device.

    Layers keep their names, so ``partitions[1][0]`` may be the original ``module[3]``; a
    :class:`WithDevice` layer is replaced by the layer it wraps. ``module`` itself keeps
    its layers and wrappers. A layer on the meta device is made on its partition's device
    and initialised (``reset_parameters()``, then the ``init`` steps), or refused: see
    :mod:`gpipe_core._materialize`.

    Args:
        local: which partitions this process keeps (default: all); the others are
            released (an empty :class:`~torch.nn.Sequential` stands in for each) and
            their layers are not moved.
        init: the checked ``init`` of :class:`~gpipe_core.GPipe`
            (:func:`~gpipe_core._materialize.check_init`).
        renaming: the names errors give the tensors of layers made from meta, if not the
            plain keys (:class:`~gpipe_core._state_dict.Renaming`).

    Raises:
        TypeError: a :class:`WithDevice` is nested in a layer.
        ValueError: a :class:`WithDevice` layer is in a partition on another device, a
            buffer is shared by partitions on different devices, or a layer made from
            the meta device was left with uninitialised tensors (then the layers made
            from meta are back on meta).
    """
    partitions = layer_groups(module, balance)
    _check_placement(module, balance, devices)
    _check_shared(partitions, devices)
    # Last partition first: a parameter shared by partitions on different devices ends on
    # its first partition's device (its owner's), where the others tie to it.
    materializer = Materializer(init, renaming)
    try:
        for j, (partition, device) in reversed(
            list(enumerate(zip(partitions, devices, strict=False)))
        ):
            if local is not None and not local[j]:
                partitions[j] = nn.Sequential()
            else:
                materializer.place(j, partition, device)
        materializer.check()
    except BaseException:
        materializer.revert()
        raise
    return partitions
