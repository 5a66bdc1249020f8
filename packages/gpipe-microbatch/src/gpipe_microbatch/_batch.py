"""Micro-batches: a value, a tuple or a mapping of values, whose tensors are split along the
batch dimension.

A mini-batch is what a caller passes: one value, a tuple of values, or a mapping of values
(a ``dict``, an ``OrderedDict``, a Hugging Face ``ModelOutput``: see
:mod:`gpipe_microbatch._mapping`). Its tensors are split along dimension 0 into
micro-batches; a tensor wrapped in :class:`NoChunk`, and every value that is not a tensor (a
number, a string, ``None``, a small container), is copied whole into every micro-batch.
Gathering does the reverse: tensors are concatenated, and the other values of the
micro-batches are returned as a list, one entry per micro-batch. A tuple keeps its type and a
mapping its type and keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ._mapping import MappingKind, mapping_kind

__all__ = [
    "Batch",
    "Kind",
    "NoChunk",
    "TensorOrTensors",
    "check",
    "check_chunks",
    "check_output",
    "gather",
    "labels",
    "make_tuple",
    "make_value",
    "scatter",
]

#: A mini-batch or micro-batch of tensors only: a tensor or a tuple of tensors.
TensorOrTensors = Tensor | tuple[Tensor, ...]


def _type_name(value: object) -> str:
    return type(value).__name__


#: The type of a tuple: ``tuple`` itself, or a subclass (a namedtuple, what
#: ``torch.max(x, dim=1)`` returns).
TupleType = type[tuple[Any, ...]]


def make_tuple(kind: TupleType, items: Iterable[object]) -> tuple[object, ...]:
    """``items`` as a tuple of type ``kind``, as a value of that type was taken apart.

    A namedtuple is made with its ``_make``; another subclass (such as
    ``torch.return_types.max``) from the sequence of its items, as ``tuple`` itself.

    Example:
        >>> values = torch.tensor([[1.0, 3.0], [4.0, 2.0]]).max(dim=1)
        >>> type(make_tuple(type(values), (torch.zeros(2), torch.ones(2)))).__name__
        'max'
        >>> make_tuple(tuple, iter([1, 2]))
        (1, 2)
    """
    if kind is tuple:
        return tuple(items)
    make = getattr(kind, "_make", None)
    if make is not None:
        return cast(tuple[object, ...], make(items))
    return kind(tuple(items))


#: What a batch of several values is made back as: the type of a tuple, or the
#: :class:`~gpipe_microbatch.MappingKind` of a mapping (its type and keys).
Kind = TupleType | MappingKind


def make_value(kind: Kind, items: Iterable[object]) -> object:
    """``items`` as a value of ``kind``: a tuple (:func:`make_tuple`) or a mapping
    (:meth:`MappingKind.make <gpipe_microbatch.MappingKind.make>`).

    Example:
        >>> make_value(tuple, [1, 2])
        (1, 2)
        >>> make_value(Batch({"x": torch.zeros(1), "n": 3}).kind, [torch.ones(1), 4])
        {'x': tensor([1.]), 'n': 4}
    """
    if isinstance(kind, MappingKind):
        return kind.make(items)
    return make_tuple(kind, items)


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


class NoChunk:
    """A tensor of the input that every micro-batch gets whole, rather than a slice of it.

    :func:`scatter` splits the tensors of a mini-batch along dimension 0; a tensor wrapped
    in ``NoChunk`` (an attention mask shared by every sample, a table of positions) is
    unwrapped and passed whole to every micro-batch, as values that are not tensors are.
    Its gradient, if it requires one, is the sum over the micro-batches, as over the
    samples without micro-batches. ``NoChunk`` marks inputs only: the layers see the tensor
    itself, and a layer's output cannot hold a ``NoChunk``.

    Args:
        tensor: the tensor to pass whole (it needs no batch dimension).

    Raises:
        TypeError: ``tensor`` is not a tensor.

    Example:
        >>> x, scale = torch.ones(4, 2), torch.tensor([1.0, 10.0])
        >>> [batch.values[1] for batch in scatter((x, NoChunk(scale)), chunks=2)]
        [tensor([ 1., 10.]), tensor([ 1., 10.])]
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"NoChunk wraps a tensor (tensor: {_type_name(tensor)})")
        #: The wrapped tensor.
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk({self.tensor!r})"


def _holds_tensor(value: object, seen: set[int] | None = None) -> bool:
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
        return any(_holds_tensor(item, seen) for item in items)
    return False


def _items(value: object, what: str) -> tuple[object, ...] | None:
    """The values of a tuple or a mapping ``value`` (named ``what`` in errors); None for one
    value.

    Raises:
        TypeError: a mapping that cannot be passed on (see :func:`mapping_kind`).
    """
    if isinstance(value, tuple):
        return value
    if isinstance(value, Mapping):
        mapping_kind(value, what)
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


def _seen(name: str, value: object) -> str:
    """How an error message shows a value that is not a tensor."""
    if isinstance(value, NoChunk):
        return f"{name}: NoChunk"
    if isinstance(value, Tensor) or not _holds_tensor(value):
        return f"{name}: {_type_name(value)}"
    return f"{name}: {_type_name(value)} holding a tensor"


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
            a string or whose type cannot be made back (see :class:`MappingKind`).

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
    parts = _items(value, what)
    items = (value,) if parts is None else parts
    found = False
    for index, item in enumerate(items):
        if isinstance(item, Tensor):
            found = True
        elif parts is not None and isinstance(item, NoChunk):
            raise TypeError(
                f"{what} holds a NoChunk, which marks inputs only: return the tensor itself "
                f"({_seen(labels(value, what)[index], item)})"
            )
        elif parts is not None and _holds_tensor(item):
            raise TypeError(
                f"{what} holds a tensor inside another value, where it can be neither moved "
                "between devices nor gathered: make it a value of the output tuple or mapping "
                f"({_seen(labels(value, what)[index], item)})"
            )
    if found:
        return value
    if parts is not None:
        named = labels(value, what)
        seen = ", ".join(_seen(name, item) for name, item in zip(named, items, strict=True))
        seen = seen or f"{what}: empty {_type_name(value)}"
    else:
        seen = _seen(what, value)
    raise TypeError(f"{what} must be a tensor, or a tuple or mapping holding a tensor ({seen})")


class Batch:
    """A micro-batch: one value (*atomic*), a tuple or a mapping of values, and the tensors
    among them.

    Layers receive exactly what the user passed: a tuple stays a tuple (of its type) and a
    mapping a mapping (of its type, with its keys), and either is passed to a layer as a
    single argument, as :class:`torch.nn.Sequential` does. Values that are not tensors ride
    along untouched.

    A batch is the sequence of its **tensors**: ``len(batch)``, ``batch[k]``, iteration,
    :attr:`tensors` and :meth:`replace` see the tensors only, in order, which is what
    copies, stream waits and autograd work on. :attr:`values` has every value, and
    :attr:`present` and :attr:`others` describe the values that are not tensors.

    Example:
        >>> batch = Batch(torch.zeros(4, 2))
        >>> batch.atomic, len(batch)
        (True, 1)
        >>> batch.call(lambda x: x + 1).tensor
        tensor([[1., 1.],
                [1., 1.],
                [1., 1.],
                [1., 1.]])
        >>> mixed = Batch((torch.zeros(2), 3, None))
        >>> len(mixed), mixed.present, mixed.others
        (1, (True, False, False), (3, None))
        >>> named = Batch({"x": torch.zeros(2), "n": 3})
        >>> named.kind.keys, len(named), named.value["n"]
        (('x', 'n'), 1, 3)
    """

    __slots__ = ("_others", "_present", "_values", "atomic", "kind")

    def __init__(self, value: object) -> None:
        #: Whether the batch is one value rather than a tuple or a mapping.
        self.atomic = True
        #: What :attr:`value` gives back: the type of the tuple (a namedtuple, say), or the
        #: :class:`MappingKind` of a mapping (its type and keys); ``tuple`` for an atomic
        #: batch.
        self.kind: Kind = tuple
        # Only the tensors are kept in _values; _present is None when every value is one.
        self._present: tuple[bool, ...] | None = None
        self._others: tuple[object, ...] = ()
        if isinstance(value, Tensor):
            self._values: tuple[Tensor, ...] = (value,)
            return
        items: tuple[object, ...]
        if isinstance(value, tuple):
            self.atomic, self.kind, items = False, type(value), value
        elif isinstance(value, Mapping):
            self.atomic, self.kind = False, mapping_kind(value)
            items = tuple(value.values())
        else:
            items = (value,)
        if not self.atomic and all(isinstance(item, Tensor) for item in items):
            self._values = cast(tuple[Tensor, ...], items if type(items) is tuple else tuple(items))
        else:
            self._present = tuple(isinstance(item, Tensor) for item in items)
            self._values = tuple(item for item in items if isinstance(item, Tensor))
            self._others = tuple(item for item in items if not isinstance(item, Tensor))

    @classmethod
    def from_parts(
        cls,
        atomic: bool,
        present: Sequence[bool],
        tensors: Iterable[Tensor],
        others: Iterable[object] = (),
        kind: Kind = tuple,
    ) -> Batch:
        """The batch whose values are ``tensors`` where ``present`` is True and ``others``
        elsewhere, in order (as a transport's message describes them), in a tuple or a
        mapping of ``kind`` unless ``atomic``.

        Raises:
            ValueError: the counts do not match ``present``, or an atomic batch of several
                values.

        Example:
            >>> Batch.from_parts(False, [True, False], [torch.zeros(1)], ["a"]).value
            (tensor([0.]), 'a')
        """
        tensors, others = tuple(tensors), tuple(others)
        present = tuple(present)
        count = sum(present)
        if (
            count != len(tensors)
            or len(present) - count != len(others)
            or (atomic and len(present) != 1)
        ):
            raise ValueError(
                "a batch needs one tensor per True and one other value per False in present "
                f"(atomic: {atomic}, present: {list(present)}, tensors: {len(tensors)}, "
                f"others: {len(others)})"
            )
        batch = cls.__new__(cls)
        batch.atomic = atomic
        batch.kind = kind
        batch._values = tensors
        batch._present = None if count == len(present) else present
        batch._others = others
        return batch

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch."""
        if not self.atomic:
            raise AttributeError("a non-atomic batch has no single tensor; use .tensors")
        if not self._values:
            raise AttributeError(
                f"an atomic batch of a {_type_name(self._others[0])} has no tensor; use .value"
            )
        return self._values[0]

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors of the batch, in order, as a tuple (one for an atomic tensor)."""
        return self._values

    @property
    def present(self) -> tuple[bool, ...]:
        """For each value, whether it is a tensor."""
        if self._present is None:
            return (True,) * len(self._values)
        return self._present

    @property
    def others(self) -> tuple[object, ...]:
        """The values that are not tensors, in order."""
        return self._others

    @property
    def values(self) -> tuple[object, ...]:
        """Every value, in order (one for an atomic batch)."""
        if self._present is None:
            return self._values
        tensors, others = iter(self._values), iter(self._others)
        return tuple(next(tensors) if here else next(others) for here in self._present)

    @property
    def value(self) -> object:
        """The batch as the user sees it (the value, or the tuple or mapping of values, of
        :attr:`kind`)."""
        values = self.values
        if self.atomic:
            return values[0]
        return values if self.kind is tuple else make_value(self.kind, values)

    def with_tensors(self, tensors: Iterable[Tensor]) -> Batch:
        """A batch of the same values but with ``tensors`` in place of its tensors.

        Example:
            >>> Batch((torch.zeros(1), "a")).with_tensors([torch.ones(1)]).value
            (tensor([1.]), 'a')
        """
        tensors = tuple(tensors)
        if len(tensors) != len(self._values):
            raise ValueError(
                f"with_tensors needs one tensor per tensor of the batch "
                f"(batch: {len(self._values)}, tensors: {len(tensors)})"
            )
        batch = Batch.__new__(Batch)
        batch.atomic = self.atomic
        batch.kind = self.kind
        batch._values = tensors
        batch._present = self._present
        batch._others = self._others
        return batch

    def call(self, function: Callable[[object], object], what: str = "output") -> Batch:
        """Call ``function`` on :attr:`value` and wrap its result, checked by
        :func:`check_output`, in a new batch."""
        return Batch(check_output(function(self.value), what))

    def find_tensor_idx(self) -> int:
        """The index (among the tensors) of the first floating-point tensor, else 0.

        Ordering edges (phony tensors) are attached to this tensor, since integer tensors
        cannot carry gradients.
        """
        for index, tensor in enumerate(self._values):
            if tensor.is_floating_point() or tensor.is_complex():
                return index
        return 0

    def replace(self, index: int, tensor: Tensor) -> None:
        """Replace the tensor at ``index`` among the tensors (used to attach autograd edges)."""
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
        shown = ", ".join(
            str(tuple(value.shape)) if isinstance(value, Tensor) else _type_name(value)
            for value in self.values
        )
        return f"Batch[atomic={self.atomic}]({shown})"


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
    parts = _items(input, what)
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
        elif _holds_tensor(item):
            raise TypeError(
                f"{what} holds a tensor inside another value, where it can be neither split "
                "into micro-batches nor moved between devices: pass the tensor itself, or "
                f"NoChunk(tensor) to pass it whole to every micro-batch ({_seen(named[k], item)})"
            )
    if not split:
        seen = ", ".join(_seen(name, item) for name, item in zip(named, items, strict=True))
        empty = f"{what}: empty {_type_name(input)}"
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
    ``dict``, an ``OrderedDict``, a ``ModelOutput``: see :class:`MappingKind`). Its
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
            :class:`MappingKind`).
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
    kind: Kind = tuple
    if isinstance(input, tuple):
        kind = type(input)
    elif isinstance(input, Mapping):
        kind = mapping_kind(input, what)
    size = _batch_size([(names[k], cast(Tensor, values[k])) for k in split], what)
    if size == 0 or chunks == 1 or size == 1:
        # One micro-batch: the input itself, not a view of it, so that a first layer may
        # modify it in place exactly as without micro-batches.
        return [Batch(values[0] if atomic else make_value(kind, values))]
    if atomic:
        return [Batch(piece) for piece in cast(Tensor, values[0]).chunk(chunks)]
    pieces = {k: cast(Tensor, values[k]).chunk(chunks) for k in split}
    # Tensors of one batch size split into the same number of pieces.
    batches = []
    for i in range(len(pieces[split[0]])):
        row = list(values)
        for k in split:
            row[k] = pieces[k][i]
        batches.append(Batch(make_value(kind, row)))
    return batches


def gather(outputs: Sequence[Batch]) -> object:
    """Put micro-batches back together into a mini-batch.

    Tensors are concatenated along dimension 0; values that are not tensors become a list
    with one entry per micro-batch (also for a single micro-batch). A single micro-batch of
    tensors is returned as it is.

    Raises:
        ValueError: no micro-batches.
        TypeError: the micro-batches do not have the same kind of values: a tensor in one
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
            kinds = [_kind_name(b) for b in (first, batch)]
            raise TypeError(
                "micro-batch outputs mix single values and tuples or mappings "
                f"(micro-batch 0: {kinds[0]}, micro-batch {i}: {kinds[1]})"
            )
        if batch.kind != first.kind and (
            isinstance(batch.kind, MappingKind) or isinstance(first.kind, MappingKind)
        ):
            kinds = [_kind_name(b) for b in (first, batch)]
            raise TypeError(
                "micro-batch outputs are of different kinds: mappings need the same type and "
                f"keys (micro-batch 0: {kinds[0]}, micro-batch {i}: {kinds[1]})"
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
                f"({name} of micro-batch 0: {_type_name(first.values[k])}, "
                f"of micro-batch {i}: {_type_name(batch.values[k])})"
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
    return gathered[0] if first.atomic else make_value(first.kind, gathered)


def _kind_name(batch: Batch) -> str:
    """How an error message names the kind of a micro-batch's value."""
    if batch.atomic:
        return _type_name(batch.value)
    if isinstance(batch.kind, MappingKind):
        return f"{batch.kind.type.__name__} of keys {list(batch.kind.keys)}"
    return "tuple"
