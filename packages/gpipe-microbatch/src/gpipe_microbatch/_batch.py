"""Batch: one micro-batch, the values it holds and the tensors among them.

This module owns :class:`Batch`: a value, a tuple or a mapping of values, seen as the
sequence of its tensors (what copies, stream waits and autograd work on) with the other
values riding along, and made back as the caller passed it. It must not know how a
mini-batch is split into micro-batches or gathered back (:mod:`gpipe_microbatch._scatter`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import cast

from torch import Tensor

from ._checks import check_output
from ._mapping import mapping_container
from ._values import Container, make_value, type_name

__all__ = ["Batch"]


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
        >>> named.container.keys, len(named), named.value["n"]
        (('x', 'n'), 1, 3)
    """

    __slots__ = ("_others", "_present", "_values", "atomic", "container")

    def __init__(self, value: object) -> None:
        #: Whether the batch is one value rather than a tuple or a mapping.
        self.atomic = True
        #: What :attr:`value` gives back: the type of the tuple (a namedtuple, say), or the
        #: :class:`MappingContainer` of a mapping (its type and keys); ``tuple`` for an atomic
        #: batch.
        self.container: Container = tuple
        # Only the tensors are kept in _values; _present is None when every value is one.
        self._present: tuple[bool, ...] | None = None
        self._others: tuple[object, ...] = ()
        if isinstance(value, Tensor):
            self._values: tuple[Tensor, ...] = (value,)
            return
        items: tuple[object, ...]
        if isinstance(value, tuple):
            self.atomic, self.container, items = False, type(value), value
        elif isinstance(value, Mapping):
            self.atomic, self.container = False, mapping_container(value)
            items = tuple(value.values())
        else:
            items = (value,)
        if not self.atomic and all(isinstance(item, Tensor) for item in items):
            self._values = cast(tuple[Tensor, ...], items if type(items) is tuple else tuple(items))
        else:
            self._present = tuple(isinstance(item, Tensor) for item in items)
            self._values = tuple(item for item in items if isinstance(item, Tensor))
            self._others = tuple(item for item in items if not isinstance(item, Tensor))

    @property
    def kind(self) -> Container:
        """The former name of :attr:`container`, deprecated: reading it warns
        (:class:`DeprecationWarning`)."""
        warnings.warn(
            "Batch.kind is deprecated, use Batch.container", DeprecationWarning, stacklevel=2
        )
        return self.container

    @classmethod
    def from_parts(
        cls,
        atomic: bool,
        present: Sequence[bool],
        tensors: Iterable[Tensor],
        others: Iterable[object] = (),
        container: Container = tuple,
    ) -> Batch:
        """The batch whose values are ``tensors`` where ``present`` is True and ``others``
        elsewhere, in order (as a transport's message describes them), in a tuple or a
        mapping of ``container`` unless ``atomic``.

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
        batch.container = container
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
                f"an atomic batch of a {type_name(self._others[0])} has no tensor; use .value"
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
        :attr:`container`)."""
        values = self.values
        if self.atomic:
            return values[0]
        return values if self.container is tuple else make_value(self.container, values)

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
        batch.container = self.container
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
            str(tuple(value.shape)) if isinstance(value, Tensor) else type_name(value)
            for value in self.values
        )
        return f"Batch[atomic={self.atomic}]({shown})"
