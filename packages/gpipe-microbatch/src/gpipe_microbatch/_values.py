"""Values: the forms of value a mini-batch or a micro-batch is, and how to walk them.

A mini-batch is what a caller passes: one value, a tuple of values, or a mapping of values
(a ``dict``, an ``OrderedDict``, a Hugging Face ``ModelOutput``: see
:mod:`gpipe_microbatch._mapping`). This module owns what such a value is made of: its
values in order (:func:`values_of`), how errors name them (:func:`labels`), and how a
value of the same form is made back from them (:func:`make_tuple`, :func:`make_value`,
:func:`with_values`), the tuple's type or the mapping's :class:`MappingContainer` kept as its
:data:`Container`. gpipe-core walks a run's inputs with the same functions.

It must not know :class:`~gpipe_microbatch.NoChunk`, the checks of what a value may hold
(:mod:`gpipe_microbatch._checks`), micro-batches or their split: it describes one value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from torch import Tensor

from ._mapping import MappingContainer, mapping_container

__all__ = [
    "Container",
    "TensorOrTensors",
    "TupleType",
    "checked_values",
    "labels",
    "make_tuple",
    "make_value",
    "type_name",
    "values_of",
    "with_values",
]

#: A mini-batch or micro-batch of tensors only: a tensor or a tuple of tensors.
TensorOrTensors = Tensor | tuple[Tensor, ...]


def type_name(value: object) -> str:
    """How an error message names the type of ``value``."""
    return type(value).__name__


#: The type of a tuple: ``tuple`` itself, or a subclass (a namedtuple, what
#: ``torch.max(x, dim=1)`` returns).
TupleType = type[tuple[Any, ...]]


def make_tuple(container: TupleType, items: Iterable[object]) -> tuple[object, ...]:
    """``items`` as a tuple of type ``container``, as a value of that type was taken apart.

    A namedtuple is made with its ``_make``; another subclass (such as
    ``torch.return_types.max``) from the sequence of its items, as ``tuple`` itself.

    Example:
        >>> values = torch.tensor([[1.0, 3.0], [4.0, 2.0]]).max(dim=1)
        >>> type(make_tuple(type(values), (torch.zeros(2), torch.ones(2)))).__name__
        'max'
        >>> make_tuple(tuple, iter([1, 2]))
        (1, 2)
    """
    if container is tuple:
        return tuple(items)
    make = getattr(container, "_make", None)
    if make is not None:
        return cast(tuple[object, ...], make(items))
    return container(tuple(items))


#: What a batch of several values is made back as: the type of a tuple, or the
#: :class:`~gpipe_microbatch.MappingContainer` of a mapping (its type and keys).
Container = TupleType | MappingContainer


def make_value(container: Container, items: Iterable[object]) -> object:
    """``items`` as a value of ``container``: a tuple (:func:`make_tuple`) or a mapping
    (:meth:`MappingContainer.make <gpipe_microbatch.MappingContainer.make>`).

    Example:
        >>> make_value(tuple, [1, 2])
        (1, 2)
        >>> make_value(mapping_container({"x": torch.zeros(1), "n": 3}), [torch.ones(1), 4])
        {'x': tensor([1.]), 'n': 4}
    """
    if isinstance(container, MappingContainer):
        return container.make(items)
    return make_tuple(container, items)


def values_of(value: object) -> tuple[object, ...]:
    """The values of a tuple or a mapping ``value``, in order, or the value itself alone.

    Example:
        >>> values_of({"x": 1, "n": 2}), values_of(3)
        ((1, 2), (3,))
    """
    if isinstance(value, tuple):
        return value
    if isinstance(value, Mapping):
        return tuple(value.values())
    return (value,)


def with_values(value: object, values: Sequence[object]) -> object:
    """``value`` (a tuple, a mapping or one value) with ``values`` in place of its
    :func:`values_of`.

    Example:
        >>> with_values({"x": 1, "n": 2}, [3, 4]), with_values(1, [2])
        ({'x': 3, 'n': 4}, 2)
    """
    if isinstance(value, tuple):
        return make_tuple(type(value), values)
    if isinstance(value, Mapping):
        return make_value(mapping_container(value), values)
    return values[0]


def checked_values(value: object, what: str) -> tuple[object, ...] | None:
    """The values of a tuple or a mapping ``value``, as :func:`values_of`, a mapping checked
    first (named ``what`` in errors); None for one value.

    Raises:
        TypeError: a mapping that cannot be passed on (see :func:`mapping_container`).
    """
    if isinstance(value, tuple):
        return value
    if isinstance(value, Mapping):
        mapping_container(value, what)
        return tuple(value.values())
    return None


def labels(value: object, what: str) -> list[str]:
    """How errors name the values of ``value``: ``what[0]``, ``what['key']``, or ``what``.

    Example:
        >>> labels({"ids": 1, "mask": 2}, "input"), labels((1, 2), "input")
        (["input['ids']", "input['mask']"], ['input[0]', 'input[1]'])
    """
    if isinstance(value, tuple):
        return [f"{what}[{k}]" for k in range(len(value))]
    if isinstance(value, Mapping):
        return [f"{what}[{key!r}]" for key in value]
    return [what]
