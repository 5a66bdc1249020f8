"""Checking action lists: each worker's actions resolved to their partitions, each
partition's actions complete and in order, and the workers run on a clock that tells a
deadlock.

It must not know tensors, devices, threads or transports: it checks lists of actions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ._action import (
    GRADIENT_KINDS,
    KIND_NAMES,
    Action,
    Phase,
    action_kind,
    action_label,
    backward_of,
    forward_of,
)
from ._placement import is_identity, partitions_of, place_partitions

__all__ = ["ScheduleError", "check_actions"]

_SPLIT = (Phase.INPUT_GRADIENT, Phase.WEIGHT_GRADIENT)
#: The action of the same micro-batch and partition each kind of action runs after.
_BEFORE: dict[Phase, Phase] = {
    Phase.BACKWARD: Phase.FORWARD,
    Phase.INPUT_GRADIENT: Phase.FORWARD,
    Phase.WEIGHT_GRADIENT: Phase.INPUT_GRADIENT,
}


class ScheduleError(ValueError):
    """Action lists that cannot run: a missing or repeated action, or a deadlock."""

    # Tracebacks name it where users import it from.
    __module__ = "gpipe_core"


def dependencies(
    action: Action,
    partitions: int,
    gradients: Mapping[tuple[int, int | None], Action],
    lanes: int | None = None,
) -> list[Action]:
    """The actions (partitions resolved) that ``action`` waits for: on other partitions,
    and the input gradient before its weight gradient; in a decode run of ``lanes`` lanes,
    the first partition's forward pass of micro-batch ``i`` also waits for the last
    partition's of ``i - lanes`` (the lane's previous round, whose output makes its
    input)."""
    i, j = action.microbatch, action.partition
    assert j is not None
    if action.kind is Phase.FORWARD:
        if j > 0:
            return [forward_of(i, j - 1)]
        return [forward_of(i - lanes, partitions - 1)] if lanes and i >= lanes else []
    if action.kind is Phase.WEIGHT_GRADIENT:
        return [Action(Phase.INPUT_GRADIENT, i, j)]
    if j < partitions - 1:
        return [gradients.get((i, j + 1), backward_of(i, j + 1))]
    return []


def unit_durations(durations: Mapping[str, int] | None) -> dict[Phase, int]:
    """The units each kind of action takes (see :func:`~gpipe_core.simulate`): one each by
    default; with ``durations`` (keyed by the kinds' short names, values or members), one
    for each kind it leaves out, but the backward pass takes the input and weight
    gradients' sum."""
    if durations is None:
        return dict.fromkeys(KIND_NAMES, 1)
    kinds: dict[Phase, int] = {}
    if isinstance(durations, Mapping):
        for key, units in durations.items():
            try:
                kinds[action_kind(key)] = units
            except ValueError:
                break
    if not isinstance(durations, Mapping) or len(kinds) != len(durations):
        raise ValueError(
            f"durations must map action kinds {sorted(KIND_NAMES.values())} to units "
            f"(durations: {durations!r})"
        )
    for units in durations.values():
        if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
            raise ValueError(
                f"durations must be positive integers (durations: {dict(durations)!r})"
            )
    result = {kind: kinds.get(kind, 1) for kind in (Phase.FORWARD, *_SPLIT)}
    split = result[Phase.INPUT_GRADIENT] + result[Phase.WEIGHT_GRADIENT]
    result[Phase.BACKWARD] = kinds.get(Phase.BACKWARD, split)
    return result


def clock(
    lists: Sequence[Sequence[Action]],
    partitions: int,
    units: Mapping[Phase, int],
    identity: bool,
    lanes: int | None = None,
) -> list[list[tuple[int, int]]]:
    """Each action's start and end, for resolved ``lists`` (of a decode run of ``lanes``
    lanes, if given); a deadlock raises."""
    gradients = {
        (a.microbatch, a.partition): a
        for actions in lists
        for a in actions
        if a.kind in GRADIENT_KINDS
    }
    ends: dict[Action, int] = {}
    free = [0] * len(lists)
    times: list[list[tuple[int, int]]] = [[] for _ in lists]
    remaining = sum(len(actions) for actions in lists)
    while remaining:
        progress = False
        for w, actions in enumerate(lists):
            while len(times[w]) < len(actions):
                action = actions[len(times[w])]
                waits = dependencies(action, partitions, gradients, lanes)
                if any(dependency not in ends for dependency in waits):
                    break
                start = max([free[w], *(ends[dependency] for dependency in waits)])
                free[w] = ends[action] = start + units[action.kind]
                times[w].append((start, free[w]))
                remaining -= 1
                progress = True
        if not progress:
            who, prefix = ("partition", "p") if identity else ("worker", "w")
            waiting = {
                f"{prefix}{w}": action_label(actions[len(times[w])], identity)
                for w, actions in enumerate(lists)
                if len(times[w]) < len(actions)
            }
            raise ScheduleError(f"the actions deadlock: every {who} waits (next: {waiting})")
    return times


def resolve(
    lists: Sequence[Sequence[Action]],
    workers: Sequence[int],
    schedule: object,
    partitions: int,
) -> list[list[Action]]:
    """``lists`` with every action's partition named (an action without one is its
    worker's only partition's), or a :class:`ScheduleError`."""
    owned = partitions_of(workers)
    if len(lists) != len(owned):
        who = f"schedule {schedule!r} returned" if schedule is not None else "got"
        raise ScheduleError(
            f"action lists must be one per worker ({who} {len(lists)} lists for "
            f"{len(owned)} workers, placement: {list(workers)})"
        )
    resolved: list[list[Action]] = []
    for w, actions in enumerate(lists):
        mine = owned[w]
        row: list[Action] = []
        for action in actions:
            if action.partition is None:
                if len(mine) != 1:
                    raise ScheduleError(
                        f"worker {w} runs partitions {mine}: its action {action} must name "
                        f"its partition (placement: {list(workers)})"
                    )
                action = replace(action, partition=mine[0])
            elif not 0 <= action.partition < partitions or workers[action.partition] != w:
                raise ScheduleError(
                    f"worker {w} runs {action}, whose partition is not one of its partitions "
                    f"{mine} (placement: {list(workers)})"
                )
            row.append(action)
        resolved.append(row)
    return resolved


def check_actions(
    lists: Sequence[Sequence[Action]],
    microbatches: int,
    *,
    backward: bool = True,
    partitions: int | None = None,
    schedule: object = None,
    placement: Sequence[int] | None = None,
) -> list[list[Action]]:
    """Check that action lists can run: each action once, in an order that cannot deadlock.

    Every partition runs the forward pass of every micro-batch, and with ``backward`` its
    backward pass: whole (``B``) or split (``I``, then ``W``), after the forward pass.

    Args:
        lists: each worker's actions.
        microbatches: the number of micro-batches.
        backward: whether the lists have backward actions (else forward ones only).
        partitions: how many partitions there are (default: one per list, or the
            placement's).
        schedule: the schedule that made the lists, named in the errors.
        placement: the worker of each partition (default: partition ``j`` on worker ``j``).

    Returns:
        The lists, as lists.

    Raises:
        ScheduleError: the lists are not one list of actions per worker, a partition
            misses or repeats an action, runs a backward pass before its forward pass or a
            weight gradient before its input gradient, a worker runs an action of another
            worker's partition, or the workers would wait for each other forever.

    Example:
        >>> check_actions([[Action("backward", 0), Action("forward", 0)]], 1)
        Traceback (most recent call last):
          ...
        gpipe_core.ScheduleError: partition 0 runs B0 before F0 (actions: ['B0', 'F0'])
    """
    if placement is None:
        result = as_lists(lists, partitions, schedule)
        placement = list(range(len(result)))
    else:
        placement = place_partitions(list(placement), len(placement))
        if partitions is not None and partitions != len(placement):
            raise ScheduleError(
                f"placement must give the worker of each of {partitions} partitions "
                f"(placement: {placement})"
            )
        result = as_lists(lists, None, schedule)
    resolved = resolve(result, placement, schedule, len(placement))
    check_resolved(resolved, placement, microbatches, backward)
    return result


def check_resolved(
    lists: Sequence[Sequence[Action]], workers: Sequence[int], microbatches: int, backward: bool
) -> None:
    """:func:`check_actions` on lists whose actions name their partitions."""
    identity = is_identity(workers)
    n = len(workers)
    by_partition: list[list[Action]] = [[] for _ in range(n)]
    for actions in lists:
        for action in actions:
            by_partition[action.partition].append(action)  # type: ignore[index]
    for j, actions in enumerate(by_partition):
        split = {a.microbatch for a in actions if a.kind in _SPLIT}
        expected = {forward_of(i, j) for i in range(microbatches)}
        if backward:
            for i in range(microbatches):
                if i in split:
                    expected |= {Action(kind, i, j) for kind in _SPLIT}
                else:
                    expected.add(backward_of(i, j))
        names = [action_label(action, identity) for action in actions]
        if len(set(actions)) != len(actions) or set(actions) != expected:
            missing = sorted(action_label(a, identity) for a in expected - set(actions))
            extra = sorted(
                {
                    action_label(a, identity)
                    for a in actions
                    if a not in expected or names.count(action_label(a, identity)) > 1
                }
            )
            raise ScheduleError(
                f"partition {j} must run each of {len(expected)} actions once "
                f"(missing: {missing}, unexpected or repeated: {extra})"
            )
        seen: set[tuple[Phase, int]] = set()
        for action in actions:
            before = _BEFORE.get(action.kind)
            if before is not None and (before, action.microbatch) not in seen:
                first = action_label(Action(before, action.microbatch, j), identity)
                raise ScheduleError(
                    f"partition {j} runs {action_label(action, identity)} before {first} "
                    f"(actions: {names})"
                )
            seen.add((action.kind, action.microbatch))
    clock(lists, n, unit_durations(None), identity)


def as_lists(lists: object, partitions: int | None, schedule: object) -> list[list[Action]]:
    """``lists`` as one list of actions per worker, or a :class:`ScheduleError`."""
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
