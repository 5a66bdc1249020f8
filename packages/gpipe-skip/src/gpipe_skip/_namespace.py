"""Namespaces: one skip name used by several pairs of layers without a clash."""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["DEFAULT_NAMESPACE", "Namespace", "SkipKey"]


class Namespace:
    """A namespace for skip names, given to :meth:`Skippable.isolate`.

    Every namespace is distinct from every other one. A namespace keeps its identity
    through ``copy.deepcopy`` and pickling, so a copied or reloaded model keeps its
    skip connections; two namespaces are equal only if one is a copy of the other.

    Example:
        >>> a, b = Namespace(), Namespace()
        >>> a == b, a == a
        (False, True)
        >>> import copy
        >>> copy.deepcopy(a) == a
        True
    """

    __slots__ = ("_id",)

    def __init__(self) -> None:
        self._id = uuid.uuid4()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other._id == self._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __copy__(self) -> Namespace:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Namespace:
        return self

    def __getstate__(self) -> uuid.UUID:
        return self._id

    def __setstate__(self, state: uuid.UUID) -> None:
        self._id = state

    def __repr__(self) -> str:
        if self == DEFAULT_NAMESPACE:
            return "<default namespace>"
        return f"<Namespace {self._id.hex[:8]}>"


#: The namespace of every skip name that was not isolated.
DEFAULT_NAMESPACE = Namespace()
DEFAULT_NAMESPACE._id = uuid.UUID(int=0)

#: A skip connection's identity: its namespace and its name.
SkipKey = tuple[Namespace, str]
