"""A run's input and target: their micro-batches, the first layer's positional arguments,
and the leaves that cut them from the caller's graph.

This module knows nothing of partitions, transports or schedules.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gpipe_microbatch import Batch, NoChunk, make_tuple

__all__ = [
    "UNSET",
    "Leaves",
    "StepArguments",
    "batch_sizes",
    "items",
    "positional",
    "step_arguments",
    "tensor_of",
    "to_device",
]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return batch.with_tensors(tensor.to(device) for tensor in batch)


def items(value: object) -> tuple[object, ...]:
    """The values of a mini-batch: the elements of a tuple, or the value itself."""
    return value if isinstance(value, tuple) else (value,)


def tensor_of(item: object) -> torch.Tensor | None:
    """The tensor an element of a mini-batch passes to the layers (NoChunk unwrapped)."""
    if isinstance(item, NoChunk):
        return item.tensor
    return item if isinstance(item, torch.Tensor) else None


def batch_sizes(value: object, batches: Sequence[Batch]) -> list[int]:
    """The number of samples in each micro-batch of ``value`` (the length of the first
    tensor that :func:`~gpipe_microbatch.scatter` split)."""
    index = 0
    for item in items(value):
        if isinstance(item, torch.Tensor):
            break
        index += isinstance(item, NoChunk)
    return [len(batch[index]) for batch in batches]


def positional(inputs: tuple[Any, ...]) -> tuple[object, bool, str]:
    """The mini-batch of ``forward(*inputs)`` and ``step(*inputs, ...)``: the value,
    whether its tuple is the first layer's positional arguments, and how error messages
    name it."""
    if not inputs:
        raise TypeError(
            "GPipe needs an input: the first layer's positional arguments, at least one of "
            "them holding a tensor to split into micro-batches (inputs: ())"
        )
    if len(inputs) == 1:
        return inputs[0], False, "input"
    return inputs, True, "inputs"


#: ``step()``'s ``target`` when it is not given by keyword.
UNSET: Any = object()


class StepArguments(NamedTuple):
    """``step()``'s arguments, whichever way they were passed."""

    #: The mini-batch (None where no input was given: another rank's first partition).
    input: object
    #: Whether ``input`` is a tuple of the first layer's positional arguments.
    unpack: bool
    #: How error messages name ``input``.
    what: str
    target: object
    loss_fn: object
    #: The ``unpack_input`` flag as given (compared across ranks).
    unpack_input: bool


def step_arguments(
    inputs: tuple[Any, ...], target: object, loss_fn: object, unpack_input: object
) -> StepArguments:
    """Read ``step(*inputs, target=..., loss_fn=...)``, whose positional arguments are the
    first layer's, as ``forward(*inputs)``'s are, or the shorthand for one input
    ``step(input, target, loss_fn)`` (where the deprecated ``unpack_input=True`` makes a
    tuple ``input`` the first layer's positional arguments)."""
    if not isinstance(unpack_input, bool):
        raise TypeError(f"unpack_input must be True or False (unpack_input: {unpack_input!r})")
    if target is not UNSET and loss_fn is not None:
        if unpack_input:
            raise TypeError(
                "unpack_input=True is for step(input, target, loss_fn) with a tuple input; "
                "with target= and loss_fn= by keyword, pass the first layer's positional "
                f"arguments themselves: step(a, b, target=..., loss_fn=...) "
                f"({len(inputs)} positional arguments given)"
            )
        if not inputs:
            return StepArguments(None, False, "input", target, loss_fn, False)
        value, unpack, what = positional(inputs)
        return StepArguments(value, unpack, what, target, loss_fn, False)
    if target is UNSET and loss_fn is None and len(inputs) == 3:
        input, target, loss_fn = inputs
        if unpack_input:
            warnings.warn(
                "step(input, target, loss_fn, unpack_input=True) is deprecated: pass the "
                "first layer's positional arguments themselves, as to forward(): "
                "step(*input, target=target, loss_fn=loss_fn)",
                DeprecationWarning,
                stacklevel=3,
            )
            return StepArguments(input, True, "input", target, loss_fn, True)
        return StepArguments(input, False, "input", target, loss_fn, False)
    given = ", ".join(
        f"{name}: {'given' if present else 'missing'}"
        for name, present in (("target", target is not UNSET), ("loss_fn", loss_fn is not None))
    )
    raise TypeError(
        "step() takes the first layer's positional arguments with target and loss_fn by "
        "keyword, step(*inputs, target=..., loss_fn=...), or one input, its target and the "
        "loss function positionally, step(input, target, loss_fn) "
        f"({len(inputs)} positional arguments given; {given})"
    )


class Leaves:
    """A step's input (or target) cut from the caller's graph, and its gradient passed back.

    Each micro-batch's backward pass accumulates the gradient of its slice into one leaf
    per tensor (a NoChunk tensor's leaf gets every micro-batch's gradient); :meth:`backward`
    then hands the whole gradient to the caller's graph at once, as one backward pass over
    the mini-batch would. Values that are not tensors are kept as they are.
    """

    def __init__(self, value: object, backward: bool) -> None:
        values = items(value)
        tensors = tuple(t for t in map(tensor_of, values) if t is not None)
        self.originals: tuple[torch.Tensor, ...] = ()
        self.leaves: tuple[torch.Tensor, ...] = ()
        self.value = value
        if backward and any(tensor.requires_grad for tensor in tensors):
            self.originals = tensors
            self.leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
            leaves = iter(self.leaves)
            cut = tuple(
                NoChunk(next(leaves))
                if isinstance(item, NoChunk)
                else next(leaves)
                if isinstance(item, torch.Tensor)
                else item
                for item in values
            )
            self.value = make_tuple(type(value), cut) if isinstance(value, tuple) else cut[0]

    def backward(self) -> None:
        pairs = [
            (original, leaf.grad)
            for original, leaf in zip(self.originals, self.leaves, strict=True)
            if original.requires_grad and leaf.grad is not None
        ]
        self.originals = self.leaves = ()
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
