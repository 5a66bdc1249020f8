"""The runner's views of action lists, computed once per lists: the order one thread runs
them in (:func:`serial_order`) and the (partition, kind) pairs they hold
(:func:`action_kinds`).

It must not know tensors, devices or transports: it reads lists of actions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar, cast

from ..schedule._action import Action, Phase
from ..schedule._simulate import columns, simulate

__all__ = ["action_kinds", "serial_order"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _per_lists(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` of action lists (its first argument) and hashable arguments, computed
    once per arguments where the lists are tuples (the built-in schedules' lists are,
    cached by :func:`~gpipe_core.schedule._schedules.step_actions`): a run needs it
    every run."""
    # The arguments are hashable where the lists are tuples (checked below).
    cached = cast(Callable[_P, _R], functools.lru_cache(maxsize=64)(function))

    @functools.wraps(function)
    def per_lists(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        lists = args[0]
        if isinstance(lists, tuple) and all(isinstance(row, tuple) for row in lists):
            return cached(*args, **kwargs)
        return function(*args, **kwargs)

    return per_lists


def serial_order(
    lists: Sequence[Sequence[Action]],
    workers: Sequence[int] | None = None,
    lanes: int | None = None,
) -> tuple[Action, ...]:
    """Every action of ``lists`` in the order one thread runs them: unit-time column by
    column of :func:`~gpipe_core.simulate`, the workers in order within a column (computed
    once per lists and workers where the lists are tuples).

    Example:
        >>> from gpipe_core import GPipeSchedule
        >>> [str(a) for a in serial_order(GPipeSchedule().actions(2, 2))]
        ['F0', 'F1', 'F0', 'F1', 'B1', 'B1', 'B0', 'B0']
    """
    return _serial_order(lists, None if workers is None else tuple(workers), lanes)


@_per_lists
def _serial_order(
    lists: Sequence[Sequence[Action]], workers: tuple[int, ...] | None, lanes: int | None
) -> tuple[Action, ...]:
    rows = simulate(lists, placement=workers, lanes=lanes)
    return tuple(action for column in columns(rows) for _, action in column)


@_per_lists
def action_kinds(lists: Sequence[Sequence[Action]]) -> frozenset[tuple[int | None, Phase]]:
    """The (partition, kind) pairs of the actions of ``lists`` (computed once per lists
    where they are tuples).

    Example:
        >>> sorted(action_kinds(((Action("forward", 0, 1), Action("input", 0, 1)),)))
        [(1, <Phase.FORWARD: 'forward'>), (1, <Phase.INPUT_GRADIENT: 'input-gradient'>)]
    """
    return frozenset((action.partition, action.kind) for row in lists for action in row)
