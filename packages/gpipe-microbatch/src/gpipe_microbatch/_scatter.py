"""Scatter and gather: a mini-batch split into micro-batches along the batch dimension,
and micro-batches put back together.

A mini-batch's tensors are split along dimension 0 into micro-batches; a tensor wrapped in
:class:`~gpipe_microbatch.NoChunk`, and every value that is not a tensor (a number, a
string, ``None``, a small container), is copied whole into every micro-batch. Gathering does
the reverse: tensors are concatenated, and the other values of the micro-batches are
returned as a list, one entry per micro-batch. A tuple keeps its type and a mapping its type
and keys.

This module owns the split and the gathering and their errors (batch sizes, containers of
micro-batches). It must not know what runs on the micro-batches: devices, partitions and
pipelines are gpipe-core's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import Tensor

from ._batch import Batch
from ._checks import check_chunks, holds_tensor, shown
from ._mapping import MappingContainer, mapping_container
from ._nochunk import NoChunk
from ._values import Container, checked_values, labels, make_value, type_name

__all__ = ["gather", "scatter"]


def _batch_size(split: Sequence[tuple[str, Tensor]], what: str) -> int:
    """The batch size of the tensors to split, each ``(name, tensor)``, of ``what``.

    Raises:
        ValueError: a tensor has no batch dimension, or the batch sizes differ: the tensors
            not of the batch size most of them share (the first's, on a tie) are named.
    """
    sizes = []
    for name, tensor in split:
        if tensor.dim() == 0:
            raise ValueError(f"{name} must have a batch dimension ({name}: 0-dimensional tensor)")
        sizes.append(tensor.size(0))
    if all(size == sizes[0] for size in sizes):
        return sizes[0]
    common = max(sizes, key=sizes.count)  # the first of the most common, on a tie
    odd = [(name, size) for (name, _), size in zip(split, sizes, strict=True) if size != common]
    seen = ", ".join(f"{name}: {size}" for (name, _), size in zip(split, sizes, strict=True))
    if len(odd) == 1:
        it = odd[0][0]
        which = f"{it} has batch size {odd[0][1]}"
    else:
        it = "each"
        names = ", ".join(name for name, _ in odd)
        which = f"{names} have batch sizes {', '.join(str(size) for _, size in odd)}"
    raise ValueError(
        f"{which}, not the {common} of the other tensors of the {what}: every tensor split "
        f"into micro-batches needs the same batch size; wrap {it} in NoChunk(...) if it must "
        f"not be split, to pass it whole to every micro-batch (batch sizes: {seen})"
    )


def _values_to_split(
    input: object, what: str, names: Sequence[str] | None
) -> tuple[list[object], list[int], list[str]]:
    """The values of ``input`` (NoChunk tensors unwrapped), which of them to split, and
    their names in errors."""
    parts = checked_values(input, what)
    items = (input,) if parts is None else parts
    named = labels(input, what)
    if names is not None and parts is not None:
        if len(names) != len(items):
            raise ValueError(
                f"names must name each value of {what} (names: {len(names)}, values: {len(items)})"
            )
        named = list(names)
    values = list(items)
    split: list[int] = []
    for k, item in enumerate(items):
        if isinstance(item, Tensor):
            split.append(k)
        elif isinstance(item, NoChunk):
            values[k] = item.tensor
        elif holds_tensor(item):
            raise TypeError(
                f"{what} holds a tensor inside another value, where it can be neither split "
                "into micro-batches nor moved between devices: pass the tensor itself, or "
                f"NoChunk(tensor) to pass it whole to every micro-batch ({shown(named[k], item)})"
            )
    if not split:
        seen = ", ".join(shown(name, item) for name, item in zip(named, items, strict=True))
        empty = f"{what}: empty {type_name(input)}"
        raise TypeError(
            f"{what} must hold a tensor to split into micro-batches; NoChunk tensors and "
            f"values that are not tensors are passed whole ({seen or empty})"
        )
    return values, split, named


def scatter(
    input: object, chunks: int, *, what: str = "input", names: Sequence[str] | None = None
) -> list[Batch]:
    """Split a mini-batch into at most ``chunks`` micro-batches along dimension 0.

    ``input`` is one value, a tuple of values, or a mapping of values with string keys (a
    ``dict``, an ``OrderedDict``, a ``ModelOutput``: see :class:`MappingContainer`). Its
    tensors are split; a tensor wrapped in :class:`NoChunk` is unwrapped and passed whole to
    every micro-batch, and so is every value that is not a tensor. It must hold at least one
    tensor to split. Each micro-batch is a tuple of the input's type, or a mapping of its
    type and keys.

    The split follows :func:`torch.chunk`: every micro-batch but the last has
    ``ceil(batch_size / chunks)`` samples, and a batch smaller than ``chunks`` gives fewer
    micro-batches. An empty batch gives one empty micro-batch. A single micro-batch holds
    the input's own tensors; several micro-batches are views of them.

    Args:
        input: a tensor, or a tuple or mapping of values whose tensors have the same batch
            size.
        chunks: the largest number of micro-batches.

    Keyword Args:
        what: how error messages name the input (``"input"``; ``"input[1]"`` for an
            element of a tuple, ``"input['mask']"`` for a value of a mapping).
        names: how error messages name each value of a tuple or mapping input, in order,
            in place of ``what[k]`` (keyword arguments by their names, say).

    Raises:
        TypeError: ``input`` holds no tensor to split, holds a tensor inside another
            value (a list of tensors, say), or is a mapping that cannot be passed on (a key
            that is not a string, a type that cannot be made back: see
            :class:`MappingContainer`).
        ValueError: ``chunks`` is not positive, a tensor to split has no batch dimension,
            or the tensors to split have different batch sizes.

    Example:
        >>> [b.tensor.tolist() for b in scatter(torch.arange(5), chunks=2)]
        [[0, 1, 2], [3, 4]]
        >>> [b.values for b in scatter((torch.arange(4), "mean"), chunks=2)]
        [(tensor([0, 1]), 'mean'), (tensor([2, 3]), 'mean')]
        >>> [b.value for b in scatter({"x": torch.arange(4), "scale": 2}, chunks=2)]
        [{'x': tensor([0, 1]), 'scale': 2}, {'x': tensor([2, 3]), 'scale': 2}]
    """
    values, split, names = _values_to_split(input, what, names)
    check_chunks(chunks)
    atomic = not isinstance(input, (tuple, Mapping))
    container: Container = tuple
    if isinstance(input, tuple):
        container = type(input)
    elif isinstance(input, Mapping):
        container = mapping_container(input, what)
    size = _batch_size([(names[k], cast(Tensor, values[k])) for k in split], what)
    if size == 0 or chunks == 1 or size == 1:
        # One micro-batch: the input itself, not a view of it, so that a first layer may
        # modify it in place exactly as without micro-batches.
        return [Batch(values[0] if atomic else make_value(container, values))]
    if atomic:
        return [Batch(piece) for piece in cast(Tensor, values[0]).chunk(chunks)]
    pieces = {k: cast(Tensor, values[k]).chunk(chunks) for k in split}
    # Tensors of one batch size split into the same number of pieces.
    batches = []
    for i in range(len(pieces[split[0]])):
        row = list(values)
        for k in split:
            row[k] = pieces[k][i]
        batches.append(Batch(make_value(container, row)))
    return batches


def gather(outputs: Sequence[Batch]) -> object:
    """Put micro-batches back together into a mini-batch.

    Tensors are concatenated along dimension 0; values that are not tensors become a list
    with one entry per micro-batch (also for a single micro-batch). A single micro-batch of
    tensors is returned as it is.

    Raises:
        ValueError: no micro-batches.
        TypeError: the micro-batches do not hold their values in the same container: a tensor in one
            and a tuple or another value in another, tuples of different lengths, mappings
            of different types or keys.

    Example:
        >>> gather(scatter(torch.arange(5), chunks=2))
        tensor([0, 1, 2, 3, 4])
        >>> gather([Batch((torch.zeros(1), 1)), Batch((torch.ones(1), 2))])
        (tensor([0., 1.]), [1, 2])
    """
    if not outputs:
        raise ValueError("gather needs at least one micro-batch (outputs: [])")
    first = outputs[0]
    for i, batch in enumerate(outputs):
        if batch.atomic != first.atomic:
            names = [_container_name(b) for b in (first, batch)]
            raise TypeError(
                "micro-batch outputs mix single values and tuples or mappings "
                f"(micro-batch 0: {names[0]}, micro-batch {i}: {names[1]})"
            )
        if batch.container != first.container and (
            isinstance(batch.container, MappingContainer)
            or isinstance(first.container, MappingContainer)
        ):
            names = [_container_name(b) for b in (first, batch)]
            raise TypeError(
                "micro-batch outputs have different containers: mappings need the same type and "
                f"keys (micro-batch 0: {names[0]}, micro-batch {i}: {names[1]})"
            )
        if len(batch.present) != len(first.present):
            raise TypeError(
                "micro-batch outputs are tuples of different lengths "
                f"(micro-batch 0: {len(first.present)}, micro-batch {i}: {len(batch.present)})"
            )
        if batch.present != first.present:
            k = next(
                k
                for k, (a, b) in enumerate(zip(first.present, batch.present, strict=True))
                if a != b
            )
            name = labels(first.value, "output")[k]
            raise TypeError(
                "micro-batch outputs hold a tensor in some micro-batches and another value "
                "in others: a value must be a tensor in every micro-batch or in none "
                f"({name} of micro-batch 0: {type_name(first.values[k])}, "
                f"of micro-batch {i}: {type_name(batch.values[k])})"
            )
    if len(outputs) == 1 and all(first.present):
        return first.value
    columns = zip(*(batch.values for batch in outputs), strict=True)
    gathered = [
        (torch.cat(cast(list[Tensor], list(column))) if len(column) > 1 else column[0])
        if here
        else list(column)
        for here, column in zip(first.present, columns, strict=True)
    ]
    return gathered[0] if first.atomic else make_value(first.container, gathered)


def _container_name(batch: Batch) -> str:
    """How an error message names the container of a micro-batch's value."""
    if batch.atomic:
        return type_name(batch.value)
    if isinstance(batch.container, MappingContainer):
        return f"{batch.container.type.__name__} of keys {list(batch.container.keys)}"
    return "tuple"
