"""The checks of a split: a sequential module and a balance of its layers into partitions.

They live here, with :func:`check_chunks` and the other checks of what a user passes, so that
the balancing tools (gpipe-balance) and the pipeline (gpipe-core) raise the same errors
without depending on each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

from torch import nn

__all__ = ["BalanceError", "check_balance", "check_module"]


class BalanceError(ValueError):
    """The ``balance`` argument does not describe a split of the module into partitions.

    Also raised by the balancing tools of gpipe-balance for a number of partitions that no
    split can have, and for costs that cannot be balanced. It is a :class:`ValueError`, so
    ``except ValueError`` catches it too.

    Example:
        >>> try:
        ...     check_balance([2, 1], layers=4)
        ... except ValueError as error:
        ...     print(type(error).__name__, error)
        BalanceError balance must sum to the number of layers (balance: [2, 1], layers: 4)
    """


def check_balance(balance: object, layers: int) -> list[int]:
    """Check that ``balance`` splits ``layers`` layers into non-empty partitions.

    Args:
        balance: the number of layers in each partition, in order.
        layers: the number of layers of the module to split.

    Returns:
        ``balance`` as a list of layer counts.

    Raises:
        BalanceError: ``balance`` is not a list of counts, is empty, has an entry that is
            not a positive integer, or does not sum to ``layers``.

    Example:
        >>> check_balance((2, 1), layers=3)
        [2, 1]
        >>> try:
        ...     check_balance([2, 0], layers=2)
        ... except BalanceError as error:
        ...     print(error)
        balance must contain only positive integers (balance: [2, 0])
    """
    if isinstance(balance, (str, bytes, Mapping, AbstractSet)) or not isinstance(balance, Iterable):
        # A mapping or a set has no order of partitions (a dict would give its keys).
        raise BalanceError(f"balance must be a list of layer counts (balance: {balance!r})")
    counts = list(balance)
    if not counts:
        raise BalanceError("balance must have at least one partition (balance: [])")
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise BalanceError(f"balance must contain only positive integers (balance: {counts})")
    if sum(counts) != layers:
        raise BalanceError(
            f"balance must sum to the number of layers (balance: {counts}, layers: {layers})"
        )
    return counts


def check_module(module: object) -> nn.Sequential:
    """Check that ``module`` is an :class:`~torch.nn.Sequential`, the only module that splits.

    Args:
        module: the module to split into partitions.

    Returns:
        ``module`` itself, typed as :class:`~torch.nn.Sequential`.

    Raises:
        TypeError: ``module`` is not an :class:`~torch.nn.Sequential` (the message says how
            to write a model as one).

    Example:
        >>> check_module(nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
          ...
        TypeError: module must be nn.Sequential to be partitioned (module: Linear); write ...
    """
    if not isinstance(module, nn.Sequential):
        name = type(module).__name__
        if type(module).__module__.startswith("transformers."):
            raise TypeError(
                f"module must be nn.Sequential to be partitioned (module: {name}, a Hugging "
                "Face model); a causal language model is pipelined as it is by "
                "gpipe.transformers.pipeline(model, balance=..., chunks=...) (pip install "
                "'gpipe[transformers]')"
            )
        raise TypeError(
            f"module must be nn.Sequential to be partitioned (module: {name}); "
            "write the model as a sequence of its layers, with what its forward() does between "
            "them as layers of their own: see the guide's 'Models that are not a sequence'"
        )
    return module
