"""Checks: what a user passes and what a layer returns, checked before it is used.

This module owns the checks of values: :func:`check` (tensors only), :func:`check_chunks`,
:func:`check_output` (what may be passed on as a micro-batch), and what they share with
the split's errors: whether a value hides a tensor (:func:`holds_tensor`) and how an error
shows a value (:func:`shown`). It must not know :class:`~gpipe_microbatch.Batch` nor how a
mini-batch is split or gathered (:mod:`gpipe_microbatch._scatter`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast

from torch import Tensor

from ._nochunk import NoChunk
from ._values import TensorOrTensors, checked_values, labels, type_name

__all__ = ["check", "check_chunks", "check_output", "holds_tensor", "shown"]


def check(value: object, what: str = "input") -> TensorOrTensors:
    """Check that ``value`` is a tensor or a non-empty tuple of tensors.

    This is the check of code that takes tensors only (:func:`gpipe_checkpoint.checkpoint`,
    the balancing tools). A pipeline's values may also hold other values: see
    :func:`scatter` and :func:`check_output`.

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
                    f"({what}[{index}]: {type_name(item)})"
                )
        return cast(tuple[Tensor, ...], value)
    raise TypeError(f"{what} must be a tensor or a tuple of tensors ({what}: {type_name(value)})")


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


def holds_tensor(value: object, seen: set[int] | None = None) -> bool:
    """Whether ``value`` is, or holds in a built-in container or a mapping, a tensor or a
    NoChunk."""
    if isinstance(value, (Tensor, NoChunk)):
        return True
    if isinstance(value, (list, tuple, set, frozenset, Mapping)):
        seen = set() if seen is None else seen
        if id(value) in seen:
            return False
        seen.add(id(value))
        items: Iterable[object] = value
        if isinstance(value, Mapping):
            items = (*value.keys(), *value.values())
        return any(holds_tensor(item, seen) for item in items)
    return False


def shown(name: str, value: object) -> str:
    """How an error message shows a value that is not a tensor."""
    if isinstance(value, NoChunk):
        return f"{name}: NoChunk"
    if isinstance(value, Tensor) or not holds_tensor(value):
        return f"{name}: {type_name(value)}"
    return f"{name}: {type_name(value)} holding a tensor"


def check_output(value: object, what: str = "output") -> object:
    """Check that ``value`` can be passed on as a micro-batch; returns it.

    A micro-batch is a tensor, or a tuple or a mapping (with string keys) that holds at
    least one tensor among its values; its other values may be any values (numbers,
    strings, ``None``, small containers) that hold no tensor, since only the values
    themselves are split, moved between devices and differentiated. This is the check of
    every partition's output.

    Args:
        value: the value to check.
        what: how the error message names the value, such as ``"output of partition 1"``.

    Raises:
        TypeError: ``value`` holds no tensor, holds a tensor inside a list, dict or other
            container, holds a :class:`NoChunk`, or is a mapping with a key that is not
            a string or whose type cannot be made back (see :class:`MappingContainer`).

    Example:
        >>> check_output((torch.zeros(2), "label"))[1]
        'label'
        >>> check_output({"logits": torch.zeros(2), "loss": None})["loss"] is None
        True
        >>> check_output(None, "out")
        Traceback (most recent call last):
          ...
        TypeError: out must be a tensor, or a tuple or mapping holding a tensor (out: NoneType)
    """
    if isinstance(value, Tensor):
        return value
    parts = checked_values(value, what)
    items = (value,) if parts is None else parts
    found = False
    for index, item in enumerate(items):
        if isinstance(item, Tensor):
            found = True
        elif parts is not None and isinstance(item, NoChunk):
            raise TypeError(
                f"{what} holds a NoChunk, which marks inputs only: return the tensor itself "
                f"({shown(labels(value, what)[index], item)})"
            )
        elif parts is not None and holds_tensor(item):
            raise TypeError(
                f"{what} holds a tensor inside another value, where it can be neither moved "
                "between devices nor gathered: make it a value of the output tuple or mapping "
                f"({shown(labels(value, what)[index], item)})"
            )
    if found:
        return value
    if parts is not None:
        named = labels(value, what)
        seen = ", ".join(shown(name, item) for name, item in zip(named, items, strict=True))
        seen = seen or f"{what}: empty {type_name(value)}"
    else:
        seen = shown(what, value)
    raise TypeError(f"{what} must be a tensor, or a tuple or mapping holding a tensor ({seen})")
