"""Micro-batches: a tensor or a tuple of tensors, split along the batch dimension."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch import Tensor

__all__ = ["Batch", "TensorOrTensors", "check", "check_chunks", "gather", "scatter"]

#: A mini-batch or micro-batch as a user sees it: a tensor or a tuple of tensors.
TensorOrTensors = Tensor | tuple[Tensor, ...]


def _type_name(value: object) -> str:
    return type(value).__name__


def check(value: object, what: str = "input") -> TensorOrTensors:
    """Check that ``value`` is a tensor or a non-empty tuple of tensors.

    Args:
        value: the value to check.
        what: how the error message names the value, for example ``"input"`` or
            ``"output of partition 1"``.

    Returns:
        ``value`` itself, typed as :data:`TensorOrTensors`.

    Raises:
        TypeError: ``value`` is neither a tensor nor a tuple of tensors.

    Example:
        >>> check((torch.zeros(2), torch.ones(2)))[1]
        tensor([1., 1.])
        >>> check([torch.zeros(2)])
        Traceback (most recent call last):
          ...
        TypeError: input must be a tensor or a tuple of tensors (input: list)
    """
    if isinstance(value, Tensor):
        return value
    if isinstance(value, tuple):
        if not value:
            raise TypeError(f"{what} must be a tensor or a tuple of tensors ({what}: empty tuple)")
        for index, item in enumerate(value):
            if not isinstance(item, Tensor):
                raise TypeError(
                    f"{what} must be a tensor or a tuple of tensors "
                    f"({what}[{index}]: {_type_name(item)})"
                )
        return cast(tuple[Tensor, ...], value)
    raise TypeError(f"{what} must be a tensor or a tuple of tensors ({what}: {_type_name(value)})")


def check_chunks(chunks: object) -> int:
    """Check that ``chunks`` is a positive integer; returns it.

    Raises:
        ValueError: ``chunks`` is not a positive integer (booleans are refused too).

    Example:
        >>> check_chunks(0)
        Traceback (most recent call last):
          ...
        ValueError: chunks must be a positive integer (chunks: 0)
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise ValueError(f"chunks must be a positive integer (chunks: {chunks!r})")
    return chunks


class Batch:
    """A micro-batch: one tensor (*atomic*) or a tuple of tensors.

    Layers receive exactly what the user passed: a tuple stays a tuple and is passed to a
    layer as a single argument, as :class:`torch.nn.Sequential` does.

    Example:
        >>> batch = Batch(torch.zeros(4, 2))
        >>> batch.atomic, len(batch)
        (True, 1)
        >>> batch.call(lambda x: x + 1).tensor
        tensor([[1., 1.],
                [1., 1.],
                [1., 1.],
                [1., 1.]])
    """

    __slots__ = ("_values", "atomic")

    def __init__(self, value: TensorOrTensors) -> None:
        self.atomic = isinstance(value, Tensor)
        self._values: tuple[Tensor, ...] = (value,) if isinstance(value, Tensor) else tuple(value)

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch."""
        if not self.atomic:
            raise AttributeError("a non-atomic batch has no single tensor; use .tensors")
        return self._values[0]

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors of the batch, as a tuple (one element for an atomic batch)."""
        return self._values

    @property
    def value(self) -> TensorOrTensors:
        """The batch as the user sees it (a tensor, or a tuple of tensors)."""
        return self._values[0] if self.atomic else self._values

    def call(self, function: Callable[[TensorOrTensors], object], what: str = "output") -> Batch:
        """Call ``function`` on :attr:`value` and wrap its checked result in a new batch."""
        return Batch(check(function(self.value), what))

    def find_tensor_idx(self) -> int:
        """The index of the first floating-point tensor, else 0.

        Ordering edges (phony tensors) are attached to this tensor, since integer tensors
        cannot carry gradients.
        """
        for index, tensor in enumerate(self._values):
            if tensor.is_floating_point() or tensor.is_complex():
                return index
        return 0

    def replace(self, index: int, tensor: Tensor) -> None:
        """Replace the tensor at ``index`` (used to attach autograd edges)."""
        values = list(self._values)
        values[index] = tensor
        self._values = tuple(values)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index: int) -> Tensor:
        return self._values[index]

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._values)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(t.shape)) for t in self._values)
        return f"Batch[atomic={self.atomic}]({shapes})"


def _batch_size(value: TensorOrTensors) -> int:
    tensors = (value,) if isinstance(value, Tensor) else value
    sizes = []
    for index, tensor in enumerate(tensors):
        if tensor.dim() == 0:
            where = "input" if isinstance(value, Tensor) else f"input[{index}]"
            raise ValueError(f"{where} must have a batch dimension ({where}: 0-dimensional tensor)")
        sizes.append(tensor.size(0))
    if any(size != sizes[0] for size in sizes):
        raise ValueError(
            f"every tensor of the input must have the same batch size (batch sizes: {sizes})"
        )
    return sizes[0]


def scatter(input: object, chunks: int) -> list[Batch]:
    """Split a mini-batch into at most ``chunks`` micro-batches along dimension 0.

    The split follows :func:`torch.chunk`: every micro-batch but the last has
    ``ceil(batch_size / chunks)`` samples, and a batch smaller than ``chunks`` gives fewer
    micro-batches. An empty batch gives one empty micro-batch. A single micro-batch holds
    the input's own tensors; several micro-batches are views of them.

    Args:
        input: a tensor or a tuple of tensors with the same batch size.
        chunks: the largest number of micro-batches.

    Raises:
        TypeError: ``input`` is not a tensor or a tuple of tensors.
        ValueError: ``chunks`` is not positive, a tensor has no batch dimension, or the
            tensors of a tuple have different batch sizes.

    Example:
        >>> [b.tensor.tolist() for b in scatter(torch.arange(5), chunks=2)]
        [[0, 1, 2], [3, 4]]
    """
    value = check(input, "input")
    check_chunks(chunks)
    size = _batch_size(value)
    if size == 0:
        return [Batch(value)]
    if chunks == 1 or size == 1:
        # One micro-batch: the input itself, not a view of it, so that a first layer may
        # modify it in place exactly as without micro-batches.
        return [Batch(value)]
    if isinstance(value, Tensor):
        return [Batch(piece) for piece in value.chunk(chunks)]
    split = [tensor.chunk(chunks) for tensor in value]
    # Tensors of one batch size split into the same number of pieces.
    return [Batch(pieces) for pieces in zip(*split, strict=True)]


def gather(outputs: Sequence[Batch]) -> TensorOrTensors:
    """Concatenate micro-batches back into a mini-batch along dimension 0.

    Example:
        >>> gather(scatter(torch.arange(5), chunks=2))
        tensor([0, 1, 2, 3, 4])
    """
    if not outputs:
        raise ValueError("gather needs at least one micro-batch (outputs: [])")
    if len(outputs) == 1:
        return outputs[0].value
    first = outputs[0]
    if first.atomic:
        if any(not batch.atomic for batch in outputs):
            raise TypeError("micro-batch outputs mix tensors and tuples of tensors")
        return torch.cat([batch.tensor for batch in outputs])
    if any(batch.atomic or len(batch) != len(first) for batch in outputs):
        raise TypeError("micro-batch outputs are tuples of different lengths")
    return tuple(
        torch.cat(column) for column in zip(*(batch.tensors for batch in outputs), strict=True)
    )
