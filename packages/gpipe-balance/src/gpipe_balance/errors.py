"""The error raised for a balance that cannot describe a split of a module."""

from __future__ import annotations

__all__ = ["BalanceError"]


class BalanceError(ValueError):
    """The ``balance`` argument does not describe a split of the module into partitions.

    Also raised by the balancing tools of this package for a number of partitions that no
    split can have, and for costs that cannot be balanced. It is a :class:`ValueError`, so
    ``except ValueError`` catches it too.

    Example:
        >>> from gpipe_balance import solve
        >>> try:
        ...     solve([1.0, 2.0], partitions=3)
        ... except ValueError as error:
        ...     print(error)
        partitions must not exceed the number of layers (partitions: 3, layers: 2)
    """
