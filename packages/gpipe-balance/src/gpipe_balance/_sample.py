"""The sample as the first layer takes it, and the tensors inside the values layers pass.

A sample is the first layer's arguments, with one rule and no guessing:

* a ``tuple`` is its positional arguments: ``layer(*sample)``;
* a ``dict`` (any :class:`~collections.abc.Mapping` with string keys) is its keyword
  arguments: ``layer(**sample)``;
* a tensor is its one argument: ``layer(sample)``.

A tuple or a dict that the first layer takes as *one* argument goes in a one-element tuple:
``sample=((a, b),)`` calls ``layer((a, b))``. This is :meth:`GPipe.forward
<gpipe_core.GPipe.forward>`'s convention spelt with one value: ``model(a, b)`` calls
``layer(a, b)`` as ``sample=(a, b)`` does, ``model(**batch)`` as ``sample=batch``.

From the second layer on, a layer gets the previous layer's output as one argument, as in
:class:`~torch.nn.Sequential`. Values between layers may hold tensors inside tuples,
lists and mappings (a ``dict``, a model output); the profilers find them there to cut the
graph between layers, and to measure them. A :class:`~gpipe_microbatch.NoChunk` in the
sample is unwrapped, as a pipeline unwraps it, and is passed whole to the micro-batch.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

from torch import Tensor, nn

from gpipe_microbatch import NoChunk, make_tuple

__all__ = ["Arguments", "Sample", "arguments", "check_call", "first_micro_batch", "map_tensors"]

#: What the profilers take: a tensor (the first layer's one argument), a tuple (its
#: positional arguments) or a mapping with string keys (its keyword arguments).
Sample = Tensor | tuple[Any, ...] | Mapping[str, Any]


class Arguments(NamedTuple):
    """The first layer's arguments: ``layer(*args, **kwargs)``."""

    args: tuple[object, ...]
    kwargs: dict[str, object]

    def call(self, layer: Callable[..., object]) -> object:
        return layer(*self.args, **self.kwargs)

    def tensors(self) -> list[Tensor]:
        return list(tensors((self.args, self.kwargs)))

    def map(self, function: Callable[[Tensor], Tensor]) -> Arguments:
        return Arguments(
            tuple(map_tensors(arg, function) for arg in self.args),
            {key: map_tensors(value, function) for key, value in self.kwargs.items()},
        )


def _type_name(value: object) -> str:
    return type(value).__name__


def _form(sample: object) -> str:
    """How errors show the sample and how it reached the first layer."""
    if isinstance(sample, tuple):
        count = len(sample)
        return f"{_type_name(sample)} of {count}, passed as {count} positional argument" + (
            "" if count == 1 else "s"
        )
    if isinstance(sample, Mapping):
        return f"{_type_name(sample)} of keys {list(sample)}, passed as keyword arguments"
    return f"{_type_name(sample)}, passed as one argument"


def _hint(what: str) -> str:
    return (
        f"a tuple {what} is the first layer's positional arguments, a dict its keyword "
        f"arguments, a tensor its one argument: pass {what}=(a, b) for forward(a, b), "
        f"{what}={{'a': a, 'b': b}} for keywords, or {what}=(pair,) for a tuple (or a dict) "
        "taken as one argument"
    )


def arguments(sample: object, what: str) -> Arguments:
    """The first layer's arguments that ``sample`` (named ``what`` in errors) stands for.

    Raises:
        TypeError: ``sample`` is none of a tensor, a tuple and a mapping with string keys,
            or holds no tensor.
    """
    if isinstance(sample, Tensor):
        found = Arguments((sample,), {})
    elif isinstance(sample, tuple):
        found = Arguments(tuple(sample), {})
    elif isinstance(sample, Mapping):
        bad = [key for key in sample if not isinstance(key, str)]
        if bad:
            raise TypeError(
                f"{what} given as a mapping holds the first layer's keyword arguments, whose "
                f"names are strings ({what} keys: {[repr(key) for key in bad]})"
            )
        found = Arguments((), dict(sample))
    else:
        raise TypeError(
            f"{what} must be a tensor, a tuple or a dict: {_hint(what)} "
            f"({what}: {_type_name(sample)})"
        )
    if not found.tensors():
        raise TypeError(
            f"{what} must hold a tensor, which tells the profiled device and the batch "
            f"({what}: {_form(sample)}, without a tensor)"
        )
    return found


def check_call(layer: nn.Module, sample: object, given: Arguments, what: str) -> None:
    """Refuse, before profiling, a ``sample`` whose arguments the first layer's ``forward``
    does not take (its signature, where Python can tell it).

    Raises:
        TypeError: the arguments do not bind to the signature; the message names the
            sample's form and what to pass.
    """
    try:
        signature = inspect.signature(layer.forward)
    except (TypeError, ValueError):  # no signature to check (a builtin, say): call it
        return
    try:
        signature.bind(*given.args, **given.kwargs)
    except TypeError as error:
        stars: dict[object, str] = {
            inspect.Parameter.VAR_POSITIONAL: "*",
            inspect.Parameter.VAR_KEYWORD: "**",
        }
        names = ", ".join(
            stars.get(parameter.kind, "") + name for name, parameter in signature.parameters.items()
        )
        raise TypeError(
            f"the first layer ({_type_name(layer)}.forward({names})) does not take {what} "
            f"as given ({error}; {what}: {_form(sample)}); {_hint(what)}"
        ) from error


def tensors(value: object) -> Iterator[Tensor]:
    """The tensors in ``value``: itself, or inside tuples, lists, mappings and NoChunks."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, NoChunk):
        yield value.tensor
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(item)


def _rebuild(value: Mapping[Any, Any], items: dict[Any, object]) -> Mapping[Any, Any]:
    """A mapping of ``value``'s type holding ``items``."""
    kind: Callable[[dict[Any, object]], Mapping[Any, Any]] = type(value)
    if kind in (dict, OrderedDict):
        return kind(items)
    if isinstance(value, MutableMapping):
        # A copy keeps the type and what its constructor set (a model output's fields).
        rebuilt = copy.copy(value)
        for key, item in items.items():
            rebuilt[key] = item
        return rebuilt
    return kind(items)


def map_tensors(value: object, function: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with ``function`` applied to each of its tensors (see :func:`tensors`),
    its tuples, lists and mappings rebuilt with their types, and NoChunks unwrapped."""
    if isinstance(value, Tensor):
        return function(value)
    if isinstance(value, NoChunk):
        return function(value.tensor)
    if isinstance(value, tuple):
        return make_tuple(type(value), [map_tensors(item, function) for item in value])
    if isinstance(value, list):
        return [map_tensors(item, function) for item in value]
    if isinstance(value, Mapping):
        if not any(True for _ in tensors(value)):
            return value
        return _rebuild(value, {k: map_tensors(v, function) for k, v in value.items()})
    return value


def _split_tensors(value: object, found: list[tuple[str, Tensor]], name: str) -> None:
    """The tensors of ``value`` to split, with their names (NoChunks are passed whole)."""
    if isinstance(value, Tensor):
        found.append((name, value))
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _split_tensors(item, found, f"{name}[{index}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _split_tensors(item, found, f"{name}[{key!r}]")


def first_micro_batch(given: Arguments, chunks: int, what: str) -> Arguments:
    """The first, largest, micro-batch of ``given`` split into ``chunks``, as a pipeline
    splits it: every tensor along dimension 0 (``ceil(batch / chunks)`` samples), NoChunk
    tensors and other values whole.

    Raises:
        ValueError: a tensor to split has no batch dimension, or the tensors to split have
            different batch sizes.
    """
    found: list[tuple[str, Tensor]] = []
    for index, arg in enumerate(given.args):
        _split_tensors(arg, found, f"{what}[{index}]")
    for key, value in given.kwargs.items():
        _split_tensors(value, found, f"{what}[{key!r}]")
    sizes = {}
    for name, tensor in found:
        if tensor.dim() == 0:
            raise ValueError(
                f"{name} must have a batch dimension to split into micro-batches, or be "
                f"wrapped in NoChunk to pass it whole ({name}: 0-dimensional tensor)"
            )
        sizes[name] = tensor.size(0)
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"every tensor of {what} must have the same batch size (batch sizes: {sizes})"
        )
    if not sizes:
        return given.map(lambda tensor: tensor)
    size = max(1, math.ceil(next(iter(sizes.values())) / chunks))
    split = {id(tensor) for _, tensor in found}
    return given.map(lambda tensor: tensor[:size] if id(tensor) in split else tensor)
