"""Simulation: action lists run on a clock, every action taking one unit of time or the
durations given, and the idle share of that layout (the bubble).

It must not know tensors, devices, threads or transports: it lays out lists of actions in
time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from ._action import Action, action_label
from ._check import as_lists, clock, resolve, unit_durations
from ._placement import is_identity

__all__ = ["grid_text", "simulate"]


def simulate(
    lists: Sequence[Sequence[Action]],
    durations: Mapping[str, int] | None = None,
    *,
    placement: Sequence[int] | None = None,
    lanes: int | None = None,
) -> list[list[Action | None]]:
    """Run action lists on a clock.

    Each worker runs its next action as soon as the actions it waits for have finished.
    Returns, for each worker, its action in each unit of time (None: idle); an action that
    takes ``d`` units fills ``d`` of them. Every row lasts until the last action ends.

    Args:
        lists: each worker's actions.
        durations: the units each kind of action takes: ``"forward"``, ``"backward"``,
            ``"input"``, ``"weight"`` (default: one each; with ``durations`` given, one for
            each kind it leaves out, but the backward pass takes the input and weight
            gradients' sum).
        placement: the worker of each partition (default: partition ``j`` on worker ``j``).
        lanes: the lists are a decode run's of ``lanes`` lanes (see
            :class:`~gpipe_core.DecodeSchedule`): the first partition's forward pass of
            micro-batch ``i`` waits for the last partition's of ``i - lanes``.

    Raises:
        ScheduleError: the workers would wait for each other forever.

    Example:
        >>> from gpipe_core import GPipeSchedule
        >>> rows = simulate(GPipeSchedule().actions(2, 2))
        >>> [[str(a) if a else "." for a in row] for row in rows]
        [['F0', 'F1', '.', '.', 'B1', 'B0'], ['.', 'F0', 'F1', 'B1', 'B0', '.']]
        >>> rows = simulate(GPipeSchedule().actions(1, 2), {"forward": 1, "backward": 2})
        >>> [[str(a) if a else "." for a in row] for row in rows]
        [['F0', '.', '.', '.', 'B0', 'B0'], ['.', 'F0', 'B0', 'B0', '.', '.']]
    """
    units = unit_durations(durations)
    placement = list(range(len(lists))) if placement is None else list(placement)
    resolved = resolve(as_lists(lists, None, None), placement, None, len(placement))
    times = clock(resolved, len(placement), units, is_identity(placement), lanes)
    end = max((stop for row in times for _, stop in row), default=0)
    rows: list[list[Action | None]] = []
    for actions, row in zip(lists, times, strict=True):
        cells: list[Action | None] = [None] * end
        for action, (start, stop) in zip(actions, row, strict=True):
            cells[start:stop] = [action] * (stop - start)
        rows.append(cells)
    return rows


def columns(rows: Sequence[Sequence[Action | None]]) -> Iterator[list[tuple[int, Action]]]:
    """Each unit of time of :func:`~gpipe_core.simulate`'s ``rows``: its (worker, action) pairs, the
    workers in order."""
    for column in range(max((len(row) for row in rows), default=0)):
        yield [
            (w, action)
            for w, row in enumerate(rows)
            if column < len(row) and (action := row[column]) is not None
        ]


def idle_share(rows: Sequence[Sequence[Action | None]]) -> float:
    """The bubble: the idle share of the workers' time in :func:`~gpipe_core.simulate`'s
    ``rows`` (0: none). Every bubble gpipe-core reports is this one (see
    :meth:`Schedule.bubble <gpipe_core.Schedule.bubble>` and
    :func:`~gpipe_core.theoretical_bubble`).

    Example:
        >>> idle_share([[Action("forward", 0), None], [None, Action("forward", 0)]])
        0.5
    """
    cells = sum(len(row) for row in rows)
    idle = sum(action is None for row in rows for action in row)
    return idle / cells if cells else 0.0


def grid_text(rows: Sequence[Sequence[Action | None]], identity: bool) -> str:
    """``rows`` (:func:`simulate`'s) as text: one line per worker, one column per time unit,
    ``.`` for an idle unit; the rows are partitions (``p0``) whose actions leave their
    partition out where each worker runs one (``identity``), else workers (``w0``)."""
    labels = [
        ["." if action is None else action_label(action, identity) for action in row]
        for row in rows
    ]
    width = max((len(label) for row in labels for label in row), default=1)
    prefix = "p" if identity else "w"
    return "\n".join(
        f"{prefix}{k}: " + " ".join(label.ljust(width) for label in row).rstrip()
        for k, row in enumerate(labels)
    )
