"""Calling conventions of a sequential model: one value from layer to layer, or positional
arguments unpacked from tuples (:class:`PipeSequential`); the first layer's keyword
arguments.

It must not know partitions or pipelines: it calls one layer after another.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["FirstLayerCall", "PipeSequential", "call_partition"]


class PipeSequential(nn.Sequential):
    """A :class:`~torch.nn.Sequential` that unpacks tuples into positional arguments.

    ``nn.Sequential`` passes one value from layer to layer: a layer that returns a tuple
    hands the next layer one tuple. ``PipeSequential`` calls its first layer with its own
    positional arguments, and every later layer with the previous layer's output unpacked
    when it is a tuple: ``layer(*output)``. Other outputs (a tensor, a list) are passed as
    one argument. This is the convention of the sequential of PyTorch's pipeline port, for
    models written for it.

    Wrapped in :class:`~gpipe_core.GPipe`, its partitions keep the convention across
    partition boundaries: a partition's tuple output is unpacked into the next partition's
    first layer, and ``GPipe.unwrap()`` returns a ``PipeSequential``. Its keyword arguments
    are its first layer's. Without layers it returns its argument (or the tuple of its
    arguments, if several).

    Example:
        >>> import torch
        >>> class Scale(nn.Module):
        ...     def forward(self, x, factor):
        ...         return x * factor, factor
        >>> class Drop(nn.Module):
        ...     def forward(self, x, factor):
        ...         return x
        >>> model = PipeSequential(Scale(), Scale(), Drop())
        >>> model(torch.ones(2), 3.0)
        tensor([9., 9.])
    """

    def forward(self, *inputs: Any, **keywords: Any) -> Any:
        if len(self) == 0:
            return inputs[0] if len(inputs) == 1 else inputs  # the identity
        layers = iter(self)
        value: Any = next(layers)(*inputs, **keywords)
        for layer in layers:
            value = layer(*value) if isinstance(value, tuple) else layer(value)
        return value


class FirstLayerCall(nn.Sequential):
    """An :class:`~torch.nn.Sequential` called as one module with its first layer's
    arguments: ``partition(*args, **keywords)`` is ``first(*args, **keywords)``, then one
    value from layer to layer, as :func:`call_partition` calls a plain ``nn.Sequential``
    partition layer by layer. A partition whose own hooks must run on every call (FSDP's,
    on a sharded partition) is one of these.

    Example:
        >>> import torch
        >>> class Masked(nn.Module):
        ...     def forward(self, x, mask=None):
        ...         return x * mask
        >>> FirstLayerCall(Masked(), nn.Identity())(torch.ones(2), mask=torch.zeros(2))
        tensor([0., 0.])
    """

    def forward(self, *inputs: Any, **keywords: Any) -> Any:
        if len(self) == 0:
            return inputs[0] if len(inputs) == 1 else inputs  # the identity
        layers = iter(self)
        output: Any = next(layers)(*inputs, **keywords)
        for layer in layers:
            output = layer(output)
        return output


def call_partition(
    partition: nn.Sequential, value: object, unpack: bool, keywords: tuple[str, ...] = ()
) -> object:
    """Call ``partition`` on ``value``.

    With ``unpack`` and a tuple ``value``, the tuple's elements are the positional
    arguments of the partition's first layer (the arguments of ``GPipe.forward(*inputs)``,
    or a :class:`PipeSequential` partition's input); the layers of an ``nn.Sequential``
    then pass one value on, as ``nn.Sequential`` does. Otherwise ``partition(value)``.
    With ``keywords``, the last ``len(keywords)`` elements of the tuple are the first
    layer's keyword arguments of those names (``GPipe.forward(*inputs, **keywords)``).

    Example:
        >>> import torch
        >>> class Masked(nn.Module):
        ...     def forward(self, x, mask=None):
        ...         return x * mask
        >>> call_partition(
        ...     nn.Sequential(Masked()), (torch.ones(2), torch.zeros(2)), True, ("mask",)
        ... )
        tensor([0., 0.])
    """
    if not (unpack and isinstance(value, tuple)):
        return partition(value)
    args: tuple[object, ...] = value
    named: dict[str, object] = {}
    if keywords:
        count = len(value) - len(keywords)
        args, named = value[:count], dict(zip(keywords, value[count:], strict=True))
    if isinstance(partition, (PipeSequential, FirstLayerCall)):
        return partition(*args, **named)
    layers = iter(partition)
    output = next(layers)(*args, **named)
    for layer in layers:
        output = layer(output)
    return output
