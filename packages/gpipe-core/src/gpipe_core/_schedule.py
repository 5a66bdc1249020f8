"""Pipeline schedules as data: the order in which each partition runs its actions.

A schedule says, for ``m`` micro-batches and ``n`` partitions, which actions each
partition runs and in which order: the forward pass of micro-batch ``i`` (``F i``) and its
backward pass (``B i``). It says nothing about time. :meth:`GPipe.step
<gpipe_core.GPipe.step>` gives each partition's list to that partition's worker, which runs
each action as soon as its inputs are there: the forward pass of micro-batch ``i`` on
partition ``j`` needs the output of partition ``j - 1``; its backward pass needs the
gradient from partition ``j + 1`` (or, on the last partition, the loss).

Adding a schedule means writing its action lists: subclass :class:`Schedule` and implement
:meth:`Schedule.actions`. :func:`check_actions` tells whether lists can run at all, and
:func:`simulate` and :meth:`Schedule.grid` show how they run when every action takes the
same time.

Example:
    >>> print(get_schedule("1f1b").grid(microbatches=4, partitions=2))
    p0: F0 F1 .  B0 F2 B1 F3 B2 .  B3
    p1: .  F0 B0 F1 B1 F2 B2 F3 B3 .
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

__all__ = [
    "Action",
    "GPipeSchedule",
    "OneFOneBSchedule",
    "Schedule",
    "ScheduleError",
    "check_actions",
    "clock_cycles",
    "get_schedule",
    "schedules",
    "simulate",
    "step_actions",
]

ActionKind = Literal["forward", "backward"]


class ScheduleError(ValueError):
    """Action lists that cannot run: a missing or repeated action, or a deadlock."""


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a partition: the forward or backward pass of one micro-batch.

    Example:
        >>> Action("forward", 3), str(Action("backward", 0))
        (Action('forward', 3), 'B0')
    """

    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return ("F" if self.kind == "forward" else "B") + str(self.microbatch)

    def __repr__(self) -> str:
        return f"Action({self.kind!r}, {self.microbatch})"


def _forward(i: int) -> Action:
    return Action("forward", i)


def _backward(i: int) -> Action:
    return Action("backward", i)


class Schedule(ABC):
    """The order of each partition's actions, for any number of micro-batches and partitions."""

    #: The name :func:`get_schedule` knows the schedule by.
    name: ClassVar[str]

    @abstractmethod
    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        """Each partition's actions, in the order it runs them.

        Every partition runs the forward and the backward pass of every micro-batch once,
        the forward pass first.
        """

    def forward_only(self, microbatches: int, partitions: int) -> list[list[Action]]:
        """The forward actions alone, in the same order (a step without backward)."""
        lists = _as_lists(self.actions(microbatches, partitions), partitions, self)
        return [[action for action in actions if action.kind == "forward"] for actions in lists]

    def grid(self, microbatches: int, partitions: int) -> str:
        """The actions laid out in time, every action taking one unit (see :func:`simulate`).

        One row per partition, one column per time unit; ``.`` is an idle unit.
        """
        rows = simulate(self.actions(microbatches, partitions))
        labels = [[str(action) if action else "." for action in row] for row in rows]
        width = max((len(label) for row in labels for label in row), default=1)
        return "\n".join(
            f"p{j}: " + " ".join(label.ljust(width) for label in row).rstrip()
            for j, row in enumerate(labels)
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GPipeSchedule(Schedule):
    """Fill-drain: every forward pass, then every backward pass (last micro-batch first).

    Partition ``j`` holds the activations of all ``m`` micro-batches at the end of the
    forward passes.

    Example:
        >>> [[str(a) for a in p] for p in GPipeSchedule().actions(2, 2)]
        [['F0', 'F1', 'B1', 'B0'], ['F0', 'F1', 'B1', 'B0']]
    """

    name = "gpipe"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        _check_sizes(microbatches, partitions)
        order = [_forward(i) for i in range(microbatches)]
        order += [_backward(i) for i in reversed(range(microbatches))]
        return [list(order) for _ in range(partitions)]


class OneFOneBSchedule(Schedule):
    """One forward, one backward (PipeDream-flush).

    Partition ``j`` first runs ``n - j - 1`` forward passes (the warm-up), then alternates
    one forward and one backward pass, then runs the remaining backward passes. So at most
    ``n - j`` micro-batches are in flight on partition ``j`` (forward pass run, backward
    pass not yet), whatever ``m``; the total time is the same as fill-drain's when forward
    and backward passes take the same time on every partition.

    Example:
        >>> [[str(a) for a in p] for p in OneFOneBSchedule().actions(3, 2)]
        [['F0', 'F1', 'B0', 'F2', 'B1', 'B2'], ['F0', 'B0', 'F1', 'B1', 'F2', 'B2']]
    """

    name = "1f1b"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        _check_sizes(microbatches, partitions)
        lists: list[list[Action]] = []
        for j in range(partitions):
            warmup = min(partitions - j - 1, microbatches)
            order = [_forward(i) for i in range(warmup)]
            for i in range(microbatches - warmup):
                order += [_forward(warmup + i), _backward(i)]
            order += [_backward(i) for i in range(microbatches - warmup, microbatches)]
            lists.append(order)
        return lists


def _check_sizes(microbatches: int, partitions: int) -> None:
    for name, value in (("microbatches", microbatches), ("partitions", partitions)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer ({name}: {value!r})")


_SCHEDULES: dict[str, type[Schedule]] = {
    GPipeSchedule.name: GPipeSchedule,
    OneFOneBSchedule.name: OneFOneBSchedule,
}


def schedules() -> list[str]:
    """The names :func:`get_schedule` knows.

    Example:
        >>> schedules()
        ['1f1b', 'gpipe']
    """
    return sorted(_SCHEDULES)


def get_schedule(schedule: object) -> Schedule:
    """The schedule named ``schedule`` (``'gpipe'`` or ``'1f1b'``), or ``schedule`` itself.

    Raises:
        ValueError: no schedule has that name.
        TypeError: ``schedule`` is neither a name nor a :class:`Schedule`.
    """
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        found = _SCHEDULES.get(schedule)
        if found is None:
            raise ValueError(f"schedule must be one of {schedules()} (schedule: {schedule!r})")
        return found()
    if isinstance(schedule, type) and issubclass(schedule, Schedule):
        raise TypeError(
            f"schedule must be a schedule name or a Schedule instance, not a class; "
            f"call it (schedule: {schedule.__name__})"
        )
    raise TypeError(
        f"schedule must be a schedule name or a Schedule (schedule: {type(schedule).__name__})"
    )


def _dependencies(action: Action, j: int, partitions: int) -> list[tuple[int, Action]]:
    """The actions of other partitions that ``action`` of partition ``j`` waits for."""
    i = action.microbatch
    if action.kind == "forward":
        return [(j - 1, _forward(i))] if j > 0 else []
    if j < partitions - 1:
        return [(j + 1, _backward(i))]
    return []


def check_actions(
    lists: Sequence[Sequence[Action]],
    microbatches: int,
    *,
    backward: bool = True,
    partitions: int | None = None,
    schedule: object = None,
) -> list[list[Action]]:
    """Check that action lists can run: each action once, in an order that cannot deadlock.

    Args:
        lists: each partition's actions.
        microbatches: the number of micro-batches.
        backward: whether the lists have backward actions (else forward ones only).
        partitions: how many lists there must be (default: any number).
        schedule: the schedule that made the lists, named in the errors.

    Returns:
        The lists, as lists.

    Raises:
        ScheduleError: the lists are not one list of actions per partition, a partition
            misses or repeats an action, runs a backward pass before its forward pass, or
            the partitions would wait for each other forever.

    Example:
        >>> check_actions([[Action("backward", 0), Action("forward", 0)]], 1)
        Traceback (most recent call last):
          ...
        gpipe_core._schedule.ScheduleError: partition 0 runs B0 before F0 (actions: ['B0', 'F0'])
    """
    lists = _as_lists(lists, partitions, schedule)
    kinds: tuple[ActionKind, ...] = ("forward", "backward") if backward else ("forward",)
    expected = {Action(kind, i) for kind in kinds for i in range(microbatches)}
    for j, actions in enumerate(lists):
        names = [str(action) for action in actions]
        if len(set(actions)) != len(actions) or set(actions) != expected:
            missing = sorted(str(a) for a in expected - set(actions))
            extra = sorted(
                {str(a) for a in actions if a not in expected or names.count(str(a)) > 1}
            )
            raise ScheduleError(
                f"partition {j} must run each of {len(expected)} actions once "
                f"(missing: {missing}, unexpected or repeated: {extra})"
            )
        seen: set[int] = set()
        for action in actions:
            if action.kind == "forward":
                seen.add(action.microbatch)
            elif action.microbatch not in seen:
                raise ScheduleError(
                    f"partition {j} runs {action} before F{action.microbatch} (actions: {names})"
                )
    simulate(lists)
    return lists


def _as_lists(lists: object, partitions: int | None, schedule: object) -> list[list[Action]]:
    """``lists`` as one list of actions per partition, or a :class:`ScheduleError`."""
    who = f"schedule {schedule!r} returned" if schedule is not None else "got"
    if not isinstance(lists, (list, tuple)):
        raise ScheduleError(
            f"action lists must be a list with one list of actions per partition ({who}: "
            f"{type(lists).__name__})"
        )
    if partitions is not None and len(lists) != partitions:
        raise ScheduleError(
            f"action lists must be one per partition ({who} {len(lists)} lists for "
            f"{partitions} partitions)"
        )
    result: list[list[Action]] = []
    for j, actions in enumerate(lists):
        if not isinstance(actions, (list, tuple)) or not all(
            isinstance(action, Action) for action in actions
        ):
            seen = type(actions).__name__
            if isinstance(actions, (list, tuple)):
                seen = f"{seen} holding {sorted({type(a).__name__ for a in actions})}"
            raise ScheduleError(
                f"the action list of partition {j} must be a list of Action ({who}: {seen})"
            )
        result.append(list(actions))
    return result


def simulate(lists: Sequence[Sequence[Action]]) -> list[list[Action | None]]:
    """Run action lists on a clock, every action taking one unit of time.

    Each partition runs its next action as soon as the actions it waits for have finished
    in an earlier unit. Returns, for each partition, its action in each unit (None: idle).

    Raises:
        ScheduleError: the partitions would wait for each other forever.

    Example:
        >>> rows = simulate(GPipeSchedule().actions(2, 2))
        >>> [[str(a) if a else "." for a in row] for row in rows]
        [['F0', 'F1', '.', '.', 'B1', 'B0'], ['.', 'F0', 'F1', 'B1', 'B0', '.']]
    """
    partitions = len(lists)
    done: set[tuple[int, Action]] = set()
    positions = [0] * partitions
    rows: list[list[Action | None]] = [[] for _ in range(partitions)]
    remaining = sum(len(actions) for actions in lists)
    while remaining:
        finished: list[tuple[int, Action]] = []
        for j, actions in enumerate(lists):
            action = actions[positions[j]] if positions[j] < len(actions) else None
            if action is not None and all(
                dependency in done for dependency in _dependencies(action, j, partitions)
            ):
                finished.append((j, action))
                positions[j] += 1
                rows[j].append(action)
            else:
                rows[j].append(None)
        if not finished:
            waiting = {
                f"p{j}": str(actions[positions[j]])
                for j, actions in enumerate(lists)
                if positions[j] < len(actions)
            }
            raise ScheduleError(f"the actions deadlock: every partition waits (next: {waiting})")
        done.update(finished)
        remaining -= len(finished)
    return rows


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """The fill-drain forward passes on a clock: for each clock, its ``(micro-batch,
    partition)`` pairs (the forward-only lists of :class:`GPipeSchedule`, simulated).

    At clock ``k`` partition ``j`` runs micro-batch ``k - j``, so ``m`` micro-batches cross
    ``n`` partitions in ``m + n - 1`` clocks.

    Example:
        >>> list(clock_cycles(3, 2))
        [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    """
    rows = simulate(GPipeSchedule().forward_only(m, n))
    for column in range(max((len(row) for row in rows), default=0)):
        yield [
            (action.microbatch, j)
            for j, row in enumerate(rows)
            if column < len(row) and (action := row[column]) is not None
        ]


@functools.lru_cache(maxsize=64)
def _builtin_actions(
    kind: type[Schedule], m: int, n: int, backward: bool
) -> tuple[tuple[Action, ...], ...]:
    plan = kind()
    lists = plan.actions(m, n) if backward else plan.forward_only(m, n)
    checked = check_actions(lists, m, backward=backward, partitions=n, schedule=plan)
    return tuple(tuple(actions) for actions in checked)


def step_actions(plan: Schedule, m: int, n: int, backward: bool) -> Sequence[Sequence[Action]]:
    """``plan``'s actions for a run of ``m`` micro-batches over ``n`` partitions (forward
    ones only without ``backward``), checked: once per shape for the built-in schedules."""
    if type(plan) in (GPipeSchedule, OneFOneBSchedule):
        return _builtin_actions(type(plan), m, n, backward)
    lists = plan.actions(m, n) if backward else plan.forward_only(m, n)
    return check_actions(lists, m, backward=backward, partitions=n, schedule=plan)
