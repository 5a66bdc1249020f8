"""Mappings as micro-batches: how a mapping is taken apart into its values and made back.

A mini-batch, a micro-batch or a partition's output may be a :class:`~collections.abc.Mapping`
with string keys: a ``dict``, an ``OrderedDict``, or another mapping type such as a
Hugging Face ``ModelOutput``. Its values are split, moved and differentiated as a tuple's
are; its type and keys are kept in a :class:`MappingContainer`, which makes the mapping back from
its values.

The rule that makes a mapping back from its type, keys and values: a ``dict`` or an
``OrderedDict`` from its items; any other type with its items as keywords,
``container(**items)`` (a dataclass-like ``ModelOutput``), or else as one mapping,
``container(items)``: the first of the two that gives back a mapping of the same type, keys
and values, tried once per type and keys. A type made back neither way is refused, with what
to do.

It must not know micro-batches: it describes one mapping.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MappingContainer", "mapping_container"]


@dataclass(frozen=True)
class MappingContainer:
    """The type and keys of a mapping whose values a batch holds, and how to make it back.

    :attr:`Batch.container <gpipe_microbatch.Batch.container>` is one for a mapping (a
    tuple type for a tuple). It is compared, hashed and pickled as a value (the mapping type by its
    name, as pickle names classes), so it travels between processes.

    Example:
        >>> container = mapping_container({"x": 1, "mask": None})
        >>> container.keys
        ('x', 'mask')
        >>> container.make([2, 3])
        {'x': 2, 'mask': 3}
    """

    #: The mapping's type.
    type: type[Mapping[Any, Any]]
    #: Its keys, in order.
    keys: tuple[str, ...]
    #: Whether the type is made with its items as keywords (else as one mapping).
    keywords: bool = False

    def make(self, values: Iterable[object]) -> Mapping[str, object]:
        """The mapping of :attr:`type` whose values, in key order, are ``values``."""
        items = dict(zip(self.keys, values, strict=True))
        if self.type is dict:
            return items
        if self.keywords:
            return self.type(**items)
        return self.type(items)  # type: ignore[call-arg]


# Learned once per type and keys (a rebuild is tried on the first mapping of each).
_CONTAINERS: dict[tuple[type[Any], tuple[object, ...]], MappingContainer] = {}
_LIMIT = 4096
_lock = threading.Lock()


def _gives_back(mapping: Mapping[Any, Any], container: MappingContainer) -> bool:
    try:
        made = container.make(mapping.values())
    except Exception:
        return False
    return (
        type(made) is container.type
        and tuple(made.keys()) == container.keys
        and all(made[key] is value for key, value in mapping.items())
    )


def mapping_container(value: Mapping[Any, Any], what: str = "value") -> MappingContainer:
    """The :class:`MappingContainer` of ``value`` (named ``what`` in errors).

    Raises:
        TypeError: a key is not a string, or the mapping's type cannot be made back
            from its keys and values (see the module's rule).

    Example:
        >>> from collections import OrderedDict
        >>> container = mapping_container(OrderedDict(a=1))
        >>> container.type.__name__, dict(container.make([2]))
        ('OrderedDict', {'a': 2})
        >>> mapping_container({1: "one"}, "out")
        Traceback (most recent call last):
          ...
        TypeError: out must have string keys to be passed on (out key: 1, an int)
    """
    container_type, keys = type(value), tuple(value.keys())
    cached = _CONTAINERS.get((container_type, keys))
    if cached is not None:
        return cached
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(
                f"{what} must have string keys to be passed on "
                f"({what} key: {key!r}, {_article(type(key).__name__)})"
            )
    names = tuple(str(key) for key in keys)
    if container_type is dict or container_type is OrderedDict:
        container = MappingContainer(container_type, names)
    else:
        for keywords in (True, False):
            container = MappingContainer(container_type, names, keywords)
            if _gives_back(value, container):
                break
        else:
            name = container_type.__name__
            raise TypeError(
                f"{what} is a {name} that cannot be made back from its keys and values: give "
                f"{name} a constructor that takes its items as keywords, {name}(**items), or "
                f"as one mapping, {name}(items); or return a dict ({what}: {name})"
            )
    with _lock:
        if len(_CONTAINERS) >= _LIMIT:
            _CONTAINERS.clear()
        _CONTAINERS[container_type, keys] = container
    return container


def _article(name: str) -> str:
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"
