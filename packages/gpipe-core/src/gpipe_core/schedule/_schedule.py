"""Pipeline schedules as data: the order in which each worker runs its actions.

A schedule says, for ``m`` micro-batches, ``n`` partitions and a placement (the worker of
each partition), which actions each worker runs and in which order. An action names a
micro-batch ``i``, a partition ``j`` and what to do: the forward pass (``F``), the
backward pass (``B``), or the backward pass split in two, the input gradient (``I``, sent
upstream at once) and the weight gradient (``W``, accumulated into ``.grad`` later). It
says nothing about time. :meth:`GPipe.step <gpipe_core.GPipe.step>` gives each worker its
list, and the worker runs each action as soon as its inputs are there: the forward pass
of micro-batch ``i`` on partition ``j`` needs the output of partition ``j - 1``; its
backward pass (or input gradient) needs the gradient from partition ``j + 1`` (or, on the
last partition, the loss); a weight gradient needs its input gradient.

With one partition per worker (the default placement, partition ``j`` on worker ``j``),
an action may leave its partition out: it is the worker's. Several partitions per worker
come from a placement: ``"loop"`` puts partition ``j`` on worker ``j % W``, ``"v"`` puts
partitions ``j`` and ``2W - 1 - j`` on worker ``j`` (see :func:`place_partitions`).

Adding a schedule means writing its action lists: subclass :class:`Schedule` and implement
:meth:`Schedule.actions` (one partition per worker: any placement then runs it, each
worker running its partitions' lists merged) or :meth:`Schedule.worker_actions` (the
lists of any placement). :func:`check_actions` tells whether lists can run at all, and
:func:`simulate` and :meth:`Schedule.grid` show how they run, every action taking one
unit of time or the durations given.

Example:
    >>> print(get_schedule("1f1b").grid(microbatches=4, partitions=2))
    p0: F0 F1 .  B0 F2 B1 F3 B2 .  B3
    p1: .  F0 B0 F1 B1 F2 B2 F3 B3 .
    >>> print(get_schedule("interleaved-1f1b").grid(2, 4, placement="loop", workers=2))
    w0: 0F0 0F1 2F0 2F1 .   2B0 .   2B1 0B0 0B1
    w1: .   1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 .

It must not know tensors, devices, threads or transports: it is lists of actions, checked
and simulated in unit time.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, ParamSpec, TypeVar, cast

__all__ = [
    "Action",
    "GPipeSchedule",
    "Interleaved1F1BSchedule",
    "OneFOneBSchedule",
    "Schedule",
    "ScheduleError",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
    "check_actions",
    "clock_cycles",
    "get_schedule",
    "place_partitions",
    "schedules",
    "simulate",
    "step_actions",
]

ActionKind = Literal["forward", "backward", "input", "weight"]
_LETTERS: dict[str, str] = {"forward": "F", "backward": "B", "input": "I", "weight": "W"}
#: The kinds that send a gradient upstream: the whole backward pass, or its input gradient.
_GRADIENT_KINDS = ("backward", "input")


class ScheduleError(ValueError):
    """Action lists that cannot run: a missing or repeated action, or a deadlock."""

    # Tracebacks name it where users import it from.
    __module__ = "gpipe_core"


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a worker: the forward pass, backward pass, input gradient or weight
    gradient of one micro-batch, on one partition (None: the worker's only partition).

    Written ``F3`` (``B``, ``I``, ``W``) without a partition, ``2F3`` (partition 2) with one.

    Example:
        >>> Action("forward", 3), str(Action("backward", 0)), str(Action("input", 1, 2))
        (Action('forward', 3), 'B0', '2I1')
    """

    kind: ActionKind
    microbatch: int
    partition: int | None = None

    def __str__(self) -> str:
        label = _LETTERS[self.kind] + str(self.microbatch)
        return label if self.partition is None else f"{self.partition}{label}"

    def __repr__(self) -> str:
        if self.partition is None:
            return f"Action({self.kind!r}, {self.microbatch})"
        return f"Action({self.kind!r}, {self.microbatch}, {self.partition})"


def _forward(i: int, j: int | None = None) -> Action:
    return Action("forward", i, j)


def _backward(i: int, j: int | None = None) -> Action:
    return Action("backward", i, j)


# -- placement ------------------------------------------------------------------------------

PlacementSpec = Literal["loop", "v"] | Sequence[int] | None


def place_partitions(placement: object, partitions: int, workers: int | None = None) -> list[int]:
    """The worker of each partition.

    Args:
        placement: None (partition ``j`` on worker ``j``), ``"loop"`` (partition ``j`` on
            worker ``j % workers``), ``"v"`` (partitions ``j`` and ``2 * workers - 1 - j``
            on worker ``j``), or a list giving each partition's worker.
        partitions: the number of partitions.
        workers: the number of workers (default: one per partition for None, the
            length of the list's range for a list; needed for ``"loop"`` and ``"v"``).

    Raises:
        ValueError: the placement does not fit the numbers (every worker must run a
            partition).
        TypeError: ``placement`` is none of the above.

    Example:
        >>> place_partitions("loop", 4, 2), place_partitions("v", 4, 2)
        ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    _check_sizes(partitions=partitions)
    if placement is None:
        if workers is not None and workers != partitions:
            raise ValueError(
                "placement must be given to run several partitions per worker "
                f"(placement: None, partitions: {partitions}, workers: {workers})"
            )
        return list(range(partitions))
    if isinstance(placement, str):
        if placement not in ("loop", "v"):
            raise ValueError(
                f"placement must be 'loop', 'v', a list of workers or None "
                f"(placement: {placement!r})"
            )
        if workers is None:
            raise ValueError(f"placement {placement!r} needs the number of workers")
        _check_sizes(workers=workers)
        if placement == "loop":
            if partitions % workers:
                raise ValueError(
                    "placement 'loop' needs a multiple of the workers' number of partitions "
                    f"(partitions: {partitions}, workers: {workers})"
                )
            return [j % workers for j in range(partitions)]
        if partitions != 2 * workers:
            raise ValueError(
                "placement 'v' needs two partitions per worker "
                f"(partitions: {partitions}, workers: {workers})"
            )
        return [min(j, 2 * workers - 1 - j) for j in range(partitions)]
    if not isinstance(placement, (list, tuple)) or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in placement
    ):
        raise TypeError(
            f"placement must be 'loop', 'v', a list of workers or None (placement: {placement!r})"
        )
    count = workers if workers is not None else max(placement, default=-1) + 1
    if len(placement) != partitions:
        raise ValueError(
            "placement must give the worker of each partition "
            f"(placement: {list(placement)}, partitions: {partitions})"
        )
    bad = [w for w in placement if not 0 <= w < count]
    if bad:
        raise ValueError(
            f"placement must name workers 0 to {count - 1} (placement: {list(placement)}, "
            f"workers: {count})"
        )
    idle = sorted(set(range(count)) - set(placement))
    if idle:
        raise ValueError(
            f"placement must give every worker a partition (placement: {list(placement)}, "
            f"workers without one: {idle})"
        )
    return list(placement)


def _is_identity(workers: Sequence[int]) -> bool:
    return list(workers) == list(range(len(workers)))


def _partitions_of(workers: Sequence[int]) -> list[list[int]]:
    """Each worker's partitions, in pipeline order."""
    result: list[list[int]] = [[] for _ in range(max(workers, default=-1) + 1)]
    for j, w in enumerate(workers):
        result[w].append(j)
    return result


# -- schedules ------------------------------------------------------------------------------


class Schedule(ABC):
    """The order of each worker's actions, for any number of micro-batches and partitions."""

    #: The name :func:`get_schedule` knows the schedule by.
    name: ClassVar[str]

    @abstractmethod
    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        """Each partition's actions, in the order it runs them, one partition per worker.

        Every partition runs the forward pass of every micro-batch once, and its backward
        pass once (``B``) or split (``I`` then ``W``), after the forward pass.
        """

    def worker_actions(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        """Each worker's actions, in the order it runs them, for ``placement`` (the worker
        of each partition; None: partition ``j`` on worker ``j``).

        The default runs :meth:`actions` (one list per partition), each worker merging
        the lists of its partitions as they would run in unit time (the action of the
        later partition first when several are ready). Schedules made for several
        partitions per worker override it.
        """
        lists = self.actions(microbatches, partitions)
        if placement is None or _is_identity(placement):
            return lists
        resolved = _resolve(
            _as_lists(lists, partitions, self), list(range(partitions)), self, partitions
        )
        return _merge(resolved, place_partitions(list(placement), partitions))

    def forward_only(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        """The forward actions alone, in the same order (a step without backward)."""
        workers = place_partitions(placement, partitions)
        lists = _as_lists(
            self.worker_actions(microbatches, partitions, placement),
            len(_partitions_of(workers)),
            self,
        )
        return [[action for action in actions if action.kind == "forward"] for actions in lists]

    def grid(
        self,
        microbatches: int,
        partitions: int,
        *,
        placement: PlacementSpec = None,
        workers: int | None = None,
        durations: Mapping[str, int] | None = None,
    ) -> str:
        """The actions laid out in time (see :func:`simulate`): one row per worker, one
        column per time unit; ``.`` is an idle unit. With one partition per worker the rows
        are the partitions (``p0``) and the actions leave their partition out; otherwise
        the rows are the workers (``w0``).

        Args:
            microbatches: the number of micro-batches.
            partitions: the number of partitions.
            placement: see :func:`place_partitions`.
            workers: the number of workers, for ``"loop"`` and ``"v"``.
            durations: the units each kind of action takes (see :func:`simulate`).
        """
        where = place_partitions(placement, partitions, workers)
        lists = self.worker_actions(microbatches, partitions, where)
        rows = simulate(lists, durations, placement=where)
        identity = _is_identity(where)
        prefix = "p" if identity else "w"
        labels = [
            ["." if action is None else _label(action, identity) for action in row] for row in rows
        ]
        width = max((len(label) for row in labels for label in row), default=1)
        return "\n".join(
            f"{prefix}{k}: " + " ".join(label.ljust(width) for label in row).rstrip()
            for k, row in enumerate(labels)
        )

    def bubble(
        self,
        microbatches: int,
        partitions: int,
        *,
        placement: PlacementSpec = None,
        workers: int | None = None,
        durations: Mapping[str, int] | None = None,
    ) -> float:
        """The idle share of the workers' time in :func:`simulate`'s layout (0: none).

        Example:
            >>> get_schedule("gpipe").bubble(6, 3)  # (n - 1) / (m + n - 1)
            0.25
        """
        where = place_partitions(placement, partitions, workers)
        rows = simulate(
            self.worker_actions(microbatches, partitions, where), durations, placement=where
        )
        cells = sum(len(row) for row in rows)
        idle = sum(action is None for row in rows for action in row)
        return idle / cells if cells else 0.0

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
        _check_sizes(microbatches=microbatches, partitions=partitions)
        order = [_forward(i) for i in range(microbatches)]
        order += [_backward(i) for i in reversed(range(microbatches))]
        return [list(order) for _ in range(partitions)]


def _one_f_one_b(
    forwards: Sequence[Action], backwards: Sequence[Action], warmup: int
) -> list[Action]:
    """``warmup`` forward actions, then one forward and one backward action in turn, then the
    remaining backward actions."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    for forward, backward in zip(forwards[warmup:], backwards, strict=False):
        order += [forward, backward]
    order += backwards[len(forwards) - warmup :]
    return order


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
        _check_sizes(microbatches=microbatches, partitions=partitions)
        forwards = [_forward(i) for i in range(microbatches)]
        backwards = [_backward(i) for i in range(microbatches)]
        return [_one_f_one_b(forwards, backwards, partitions - j - 1) for j in range(partitions)]


def _loop_chunks(name: str, partitions: int, placement: Sequence[int] | None) -> int:
    """How many partitions each worker of a loop ``placement`` runs; a clear error if the
    placement is not a loop."""
    workers = place_partitions(placement, partitions)
    count = max(workers) + 1
    if partitions % count or workers != [j % count for j in range(partitions)]:
        raise ScheduleError(
            f"schedule {name!r} needs the loop placement, partition j on worker j % workers "
            f"(placement: {workers}, partitions: {partitions}, workers: {count})"
        )
    return partitions // count


def _check_rounds(name: str, microbatches: int, partitions: int, chunks: int) -> None:
    """Interleaved 1F1B runs the micro-batches in rounds of one per worker: with several
    partitions per worker, a last round shorter than the others (``m`` more than the
    workers and not a multiple of them) would make it slower than 1F1B on the same
    placement, or deadlock (from four workers), so it is refused."""
    workers = partitions // chunks
    if chunks > 1 and microbatches > workers and microbatches % workers:
        raise ScheduleError(
            f"schedule {name!r} with several partitions per worker needs a number of "
            "micro-batches that is a multiple of the workers, or at most the workers "
            f"(micro-batches: {microbatches}, workers: {workers}, partitions: {partitions}, "
            f"placement: {[j % workers for j in range(partitions)]}); choose the batch "
            "size and chunks to give such a number, or use schedule '1f1b'"
        )


def _interleaved(
    microbatches: int, partitions: int, chunks: int, split: bool
) -> list[list[Action]]:
    """Interleaved 1F1B over ``partitions // chunks`` workers, each running ``chunks``
    partitions in a loop; the backward passes split into input gradients alone if
    ``split`` (their weight gradients are left to the caller)."""
    workers = partitions // chunks
    groups = [
        range(start, min(start + workers, microbatches))
        for start in range(0, microbatches, workers)
    ]
    kind: ActionKind = "input" if split else "backward"
    lists = []
    for w in range(workers):
        forwards = [
            _forward(i, c * workers + w) for group in groups for c in range(chunks) for i in group
        ]
        backwards = [
            Action(kind, i, c * workers + w)
            for group in groups
            for c in reversed(range(chunks))
            for i in group
        ]
        # 1F1B's warm-up; interleaved, twice as long, plus a round of the other partitions.
        warmup = workers - w - 1 if chunks == 1 else 2 * (workers - w - 1) + (chunks - 1) * workers
        lists.append(_one_f_one_b(forwards, backwards, warmup))
    return lists


class Interleaved1F1BSchedule(Schedule):
    """Interleaved 1F1B (Megatron-LM's): each of ``W`` workers runs ``v`` partitions of a
    loop placement (partition ``j`` on worker ``j % W``).

    Each worker runs the forward passes of ``W`` micro-batches on its first partition, then
    on its second, and so on, then the next ``W`` micro-batches; the backward passes in the
    same order with the partitions reversed. Worker ``w`` runs ``2 (W - w - 1) + (v - 1) W``
    forward passes before its first backward pass, then alternates one forward and one
    backward pass. The bubble shrinks about ``v`` times from 1F1B's; each worker holds the
    activations of up to ``W`` micro-batches on each of its partitions (partitions ``v``
    times smaller than 1F1B's). With one partition per worker it is 1F1B. With several, the
    number of micro-batches ``m`` must be a multiple of ``W`` or at most ``W`` (a shorter
    last round is slower than 1F1B): other numbers raise :class:`ScheduleError`.

    Example:
        >>> lists = Interleaved1F1BSchedule().worker_actions(2, 4, placement=[0, 1, 0, 1])
        >>> [" ".join(str(a) for a in actions) for actions in lists]
        ['0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1', '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1']
    """

    name = "interleaved-1f1b"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        return OneFOneBSchedule().actions(microbatches, partitions)

    def worker_actions(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        _check_sizes(microbatches=microbatches, partitions=partitions)
        chunks = _loop_chunks(self.name, partitions, placement)
        if chunks == 1:
            return self.actions(microbatches, partitions)
        _check_rounds(self.name, microbatches, partitions, chunks)
        return _interleaved(microbatches, partitions, chunks, split=False)


class ZeroBubbleH1Schedule(Schedule):
    """Zero bubble H1 (Qi et al., 2023), on a loop placement: interleaved 1F1B with every
    backward pass split into its input gradient, sent upstream at once, and its weight
    gradient, run later where the worker would otherwise wait.

    Each worker runs its forward passes and input gradients in interleaved 1F1B's order
    (1F1B's, with one partition per worker), and a weight gradient whenever its next action
    is not ready yet (in unit time), or before a forward pass that would hold more
    partition micro-batches than that order does at most. With one partition per worker
    that is 1F1B's memory, and with forward, input and weight gradients of equal times the
    bubble is a third of 1F1B's; with several, it is interleaved 1F1B's memory (its warm-up
    holds more than 1F1B's: the V placement of :class:`ZeroBubbleVSchedule` keeps to
    1F1B's), and the number of micro-batches must be a multiple of the workers or at most
    them, as interleaved 1F1B's. The weight gradients only fill what the order leaves, so
    the lists stay good when the three kinds of action take different times.

    Example:
        >>> print(ZeroBubbleH1Schedule().grid(4, 2))
        p0: F0 F1 .  I0 W0 F2 I1 W1 F3 I2 W2 I3 W3
        p1: .  F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3
    """

    name = "zb-h1"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        lists = self.worker_actions(microbatches, partitions)
        return [[replace(action, partition=None) for action in actions] for actions in lists]

    def worker_actions(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        _check_sizes(microbatches=microbatches, partitions=partitions)
        chunks = _loop_chunks(self.name, partitions, placement)
        _check_rounds(self.name, microbatches, partitions, chunks)
        base = _interleaved(microbatches, partitions, chunks, split=True)
        return _fill_weights(base, place_partitions(placement, partitions))


class ZeroBubbleVSchedule(Schedule):
    """Zero bubble V (Qi et al., 2023): two partitions per worker in a V (partitions ``j``
    and ``2W - 1 - j`` on worker ``j``), backward passes split into input and weight
    gradients.

    Each worker runs its forward passes and input gradients in 1F1B's order over the V:
    forward passes of its first partition to fill the way down and up (``2 (W - w) - 1``
    on worker ``w``), then of both partitions in turn, then in the steady state a forward
    pass and an input gradient of each partition in turn; the weight gradients fill what
    that order leaves idle (in unit time), and run before a forward pass that would hold
    more than ``2W`` partition micro-batches (1F1B's memory: ``W`` micro-batches of
    partitions half as large). The last partition is on the first worker, so the loss is
    where the input is; with forward, input and weight gradients of equal times the lists
    take the lower bound, ``6 m + W - 1`` units (the last worker starts after ``W - 1``),
    and they stay good when the three kinds of action take different times.

    Example:
        >>> print(ZeroBubbleVSchedule().grid(2, 2, placement="v", workers=1))
        w0: 0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 0I1 1W1 0W1
        >>> round(ZeroBubbleVSchedule().bubble(16, 4, placement="v", workers=2), 2)
        0.01
    """

    name = "zbv"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        return self.worker_actions(microbatches, partitions)

    def worker_actions(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        _check_sizes(microbatches=microbatches, partitions=partitions)
        workers = place_partitions(placement, partitions)
        count = max(workers) + 1
        if partitions != 2 * count or workers != place_partitions("v", partitions, count):
            raise ScheduleError(
                f"schedule {self.name!r} needs the V placement, two partitions per worker "
                f"(partitions j and 2 * workers - 1 - j on worker j) (placement: {workers}, "
                f"partitions: {partitions}, workers: {count})"
            )
        return _fill_weights(_v_order(microbatches, count), workers, cap=partitions)


def _check_sizes(**sizes: object) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer ({name}: {value!r})")


_SCHEDULES: dict[str, type[Schedule]] = {
    kind.name: kind
    for kind in (
        GPipeSchedule,
        OneFOneBSchedule,
        Interleaved1F1BSchedule,
        ZeroBubbleH1Schedule,
        ZeroBubbleVSchedule,
    )
}


def schedules() -> list[str]:
    """The names :func:`get_schedule` knows.

    Example:
        >>> schedules()
        ['1f1b', 'gpipe', 'interleaved-1f1b', 'zb-h1', 'zbv']
    """
    return sorted(_SCHEDULES)


def get_schedule(schedule: object) -> Schedule:
    """The schedule named ``schedule`` (one of :func:`schedules`), or ``schedule`` itself.

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


# -- dependencies and simulation ------------------------------------------------------------


def _dependencies(
    action: Action, partitions: int, gradients: Mapping[tuple[int, int | None], Action]
) -> list[Action]:
    """The actions (partitions resolved) that ``action`` waits for: on other partitions,
    and the input gradient before its weight gradient."""
    i, j = action.microbatch, action.partition
    assert j is not None
    if action.kind == "forward":
        return [_forward(i, j - 1)] if j > 0 else []
    if action.kind == "weight":
        return [Action("input", i, j)]
    if j < partitions - 1:
        return [gradients.get((i, j + 1), _backward(i, j + 1))]
    return []


def _label(action: Action, identity: bool) -> str:
    return str(replace(action, partition=None) if identity else action)


def _durations(durations: Mapping[str, int] | None) -> dict[str, int]:
    if durations is None:
        return dict.fromkeys(_LETTERS, 1)
    if not isinstance(durations, Mapping) or not set(durations) <= set(_LETTERS):
        raise ValueError(
            f"durations must map action kinds {sorted(_LETTERS)} to units (durations: "
            f"{durations!r})"
        )
    for units in durations.values():
        if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
            raise ValueError(
                f"durations must be positive integers (durations: {dict(durations)!r})"
            )
    result = {kind: durations.get(kind, 1) for kind in ("forward", "input", "weight")}
    result["backward"] = durations.get("backward", result["input"] + result["weight"])
    return result


def simulate(
    lists: Sequence[Sequence[Action]],
    durations: Mapping[str, int] | None = None,
    *,
    placement: Sequence[int] | None = None,
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

    Raises:
        ScheduleError: the workers would wait for each other forever.

    Example:
        >>> rows = simulate(GPipeSchedule().actions(2, 2))
        >>> [[str(a) if a else "." for a in row] for row in rows]
        [['F0', 'F1', '.', '.', 'B1', 'B0'], ['.', 'F0', 'F1', 'B1', 'B0', '.']]
        >>> rows = simulate(GPipeSchedule().actions(1, 2), {"forward": 1, "backward": 2})
        >>> [[str(a) if a else "." for a in row] for row in rows]
        [['F0', '.', '.', '.', 'B0', 'B0'], ['.', 'F0', 'B0', 'B0', '.', '.']]
    """
    units = _durations(durations)
    workers = list(range(len(lists))) if placement is None else list(placement)
    resolved = _resolve(_as_lists(lists, None, None), workers, None, len(workers))
    times = _clock(resolved, len(workers), units, _is_identity(workers))
    end = max((stop for row in times for _, stop in row), default=0)
    rows: list[list[Action | None]] = []
    for actions, row in zip(lists, times, strict=True):
        cells: list[Action | None] = [None] * end
        for action, (start, stop) in zip(actions, row, strict=True):
            cells[start:stop] = [action] * (stop - start)
        rows.append(cells)
    return rows


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _per_lists(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` of action lists (its first argument) and hashable arguments, computed
    once per arguments where the lists are tuples (the built-in schedules' lists are,
    cached by :func:`step_actions`): a run needs it every run."""
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
    lists: Sequence[Sequence[Action]], placement: Sequence[int] | None = None
) -> tuple[Action, ...]:
    """Every action of ``lists`` in the order one thread runs them: unit-time column by
    column of :func:`simulate`, the workers in order within a column (computed once per
    lists and placement where the lists are tuples).

    Example:
        >>> [str(a) for a in serial_order(GPipeSchedule().actions(2, 2))]
        ['F0', 'F1', 'F0', 'F1', 'B1', 'B1', 'B0', 'B0']
    """
    return _serial_order(lists, None if placement is None else tuple(placement))


@_per_lists
def _serial_order(
    lists: Sequence[Sequence[Action]], placement: tuple[int, ...] | None
) -> tuple[Action, ...]:
    rows = simulate(lists, placement=placement)
    return tuple(action for column in _columns(rows) for _, action in column)


@_per_lists
def action_kinds(lists: Sequence[Sequence[Action]]) -> frozenset[tuple[int | None, ActionKind]]:
    """The (partition, kind) pairs of the actions of ``lists`` (computed once per lists
    where they are tuples).

    Example:
        >>> sorted(action_kinds(((Action("forward", 0, 1), Action("backward", 0, 1)),)))
        [(1, 'backward'), (1, 'forward')]
    """
    return frozenset((action.partition, action.kind) for row in lists for action in row)


def _columns(rows: Sequence[Sequence[Action | None]]) -> Iterator[list[tuple[int, Action]]]:
    """Each unit of time of :func:`simulate`'s ``rows``: its (worker, action) pairs, the
    workers in order."""
    for column in range(max((len(row) for row in rows), default=0)):
        yield [
            (w, action)
            for w, row in enumerate(rows)
            if column < len(row) and (action := row[column]) is not None
        ]


def _clock(
    lists: Sequence[Sequence[Action]], partitions: int, units: Mapping[str, int], identity: bool
) -> list[list[tuple[int, int]]]:
    """Each action's start and end, for resolved ``lists``; a deadlock raises."""
    gradients = {
        (a.microbatch, a.partition): a
        for actions in lists
        for a in actions
        if a.kind in _GRADIENT_KINDS
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
                waits = _dependencies(action, partitions, gradients)
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
                f"{prefix}{w}": _label(actions[len(times[w])], identity)
                for w, actions in enumerate(lists)
                if len(times[w]) < len(actions)
            }
            raise ScheduleError(f"the actions deadlock: every {who} waits (next: {waiting})")
    return times


def _resolve(
    lists: Sequence[Sequence[Action]],
    workers: Sequence[int],
    schedule: object,
    partitions: int,
) -> list[list[Action]]:
    """``lists`` with every action's partition named (an action without one is its
    worker's only partition's), or a :class:`ScheduleError`."""
    owned = _partitions_of(workers)
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
        result = _as_lists(lists, partitions, schedule)
        workers = list(range(len(result)))
    else:
        workers = place_partitions(list(placement), len(placement))
        if partitions is not None and partitions != len(workers):
            raise ScheduleError(
                f"placement must give the worker of each of {partitions} partitions "
                f"(placement: {workers})"
            )
        result = _as_lists(lists, None, schedule)
    _check_resolved(_resolve(result, workers, schedule, len(workers)), workers, microbatches,
                    backward)  # fmt: skip
    return result


def _check_resolved(
    lists: Sequence[Sequence[Action]], workers: Sequence[int], microbatches: int, backward: bool
) -> None:
    identity = _is_identity(workers)
    n = len(workers)
    by_partition: list[list[Action]] = [[] for _ in range(n)]
    for actions in lists:
        for action in actions:
            by_partition[action.partition].append(action)  # type: ignore[index]
    for j, actions in enumerate(by_partition):
        split = {a.microbatch for a in actions if a.kind in ("input", "weight")}
        expected = {_forward(i, j) for i in range(microbatches)}
        if backward:
            for i in range(microbatches):
                if i in split:
                    expected |= {Action("input", i, j), Action("weight", i, j)}
                else:
                    expected.add(_backward(i, j))
        names = [_label(action, identity) for action in actions]
        if len(set(actions)) != len(actions) or set(actions) != expected:
            missing = sorted(_label(a, identity) for a in expected - set(actions))
            extra = sorted(
                {
                    _label(a, identity)
                    for a in actions
                    if a not in expected or names.count(_label(a, identity)) > 1
                }
            )
            raise ScheduleError(
                f"partition {j} must run each of {len(expected)} actions once "
                f"(missing: {missing}, unexpected or repeated: {extra})"
            )
        seen: set[tuple[str, int]] = set()
        for action in actions:
            before = {"forward": None, "backward": "forward", "input": "forward"}.get(
                action.kind, "input"
            )
            if before is not None and (before, action.microbatch) not in seen:
                first = _label(Action(before, action.microbatch, j), identity)  # type: ignore[arg-type]
                raise ScheduleError(
                    f"partition {j} runs {_label(action, identity)} before {first} "
                    f"(actions: {names})"
                )
            seen.add((action.kind, action.microbatch))
    _clock(lists, n, _durations(None), identity)


def _as_lists(lists: object, partitions: int | None, schedule: object) -> list[list[Action]]:
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


# -- generation in unit time ----------------------------------------------------------------


def _generate(
    partitions: int,
    workers: Sequence[int],
    pending: Sequence[set[Action]],
    choose: Callable[[int, list[Action]], Action | None],
) -> list[list[Action]]:
    """Each worker's list, built on a unit-time clock (every action one unit): each free
    worker runs ``choose(worker, ready)``'s pick among its ready actions (None:
    idle). ``pending`` holds each worker's actions still to run (emptied)."""
    gradients = {
        (a.microbatch, a.partition): a
        for actions in pending
        for a in actions
        if a.kind in _GRADIENT_KINDS
    }
    done: set[Action] = set()
    lists: list[list[Action]] = [[] for _ in pending]
    while any(pending):
        ran: list[Action] = []
        for w, todo in enumerate(pending):
            ready = [
                a
                for a in todo
                if all(d in done for d in _dependencies(a, partitions, gradients))
                and (a.kind == "forward" or Action("forward", a.microbatch, a.partition) in done)
            ]
            pick = choose(w, ready) if ready else None
            if pick is not None:
                todo.remove(pick)
                lists[w].append(pick)
                ran.append(pick)
        if not ran:
            raise AssertionError(f"schedule generation stalled (placement: {list(workers)})")
        done.update(ran)
    return lists


def _merge(per_partition: Sequence[Sequence[Action]], workers: Sequence[int]) -> list[list[Action]]:
    """Per-partition lists (partitions resolved) merged into per-worker lists: each worker
    runs the next action of one of its partitions when it is ready, the later partition's
    first."""
    heads = [0] * len(per_partition)
    owned = _partitions_of(workers)

    def choose(w: int, ready: list[Action]) -> Action | None:
        for j in reversed(owned[w]):
            if heads[j] < len(per_partition[j]) and per_partition[j][heads[j]] in ready:
                heads[j] += 1
                return per_partition[j][heads[j] - 1]
        return None

    pending = [{a for j in owned[w] for a in per_partition[j]} for w in range(len(owned))]
    return _generate(len(workers), workers, pending, choose)


def _fill_weights(
    base: Sequence[Sequence[Action]], workers: Sequence[int], cap: int | None = None
) -> list[list[Action]]:
    """``base`` (per worker: forward passes and input gradients) with the weight gradients
    placed: each worker runs its next base action when ready, unless it is a forward pass
    that would hold more than ``cap`` micro-batches (forward pass run, weight gradient
    not yet; default: the most the base list holds, forward pass run, input gradient
    not yet); else its oldest pending weight gradient; else it waits."""
    if cap is None:
        cap = 0
        for actions in base:
            live = 0
            for action in actions:
                live += 1 if action.kind == "forward" else -1
                cap = max(cap, live)
    heads = [0] * len(base)
    held = [0] * len(base)  # forward passes run whose weight gradient has not
    weights: list[list[Action]] = [[] for _ in base]

    def choose(w: int, ready: list[Action]) -> Action | None:
        actions = base[w]
        if heads[w] < len(actions):
            action = actions[heads[w]]
            if action in ready and (action.kind != "forward" or held[w] < cap):
                heads[w] += 1
                if action.kind == "forward":
                    held[w] += 1
                else:
                    weights[w].append(Action("weight", action.microbatch, action.partition))
                return action
        for weight in weights[w]:
            if weight in ready:
                weights[w].remove(weight)
                held[w] -= 1
                return weight
        return None

    pending = [
        set(actions)
        | {Action("weight", a.microbatch, a.partition) for a in actions if a.kind == "input"}
        for actions in base
    ]
    return _generate(len(workers), workers, pending, choose)


def _v_order(microbatches: int, workers: int) -> list[list[Action]]:
    """ZB-V's forward passes and input gradients, per worker of a V placement (partitions
    ``w`` and ``2W - 1 - w`` on worker ``w``), in the order :class:`ZeroBubbleVSchedule`
    describes; its weight gradients are left to :func:`_fill_weights`."""
    return [_v_worker(microbatches, workers, w) for w in range(workers)]


def _v_worker(m: int, workers: int, w: int) -> list[Action]:
    """Worker ``w``'s forward passes and input gradients (see :func:`_v_order`)."""
    partitions = (w, 2 * workers - 1 - w)  # on the way down, on the way up
    forwards, inputs = [0, 0], [0, 0]  # how many have run, down and up
    actions: list[Action] = []

    def run(kind: ActionKind, side: int) -> None:
        done = forwards if kind == "forward" else inputs
        actions.append(Action(kind, done[side], partitions[side]))
        done[side] += 1

    for _ in range(min(2 * (workers - w) - 1, m)):
        run("forward", 0)
    for _ in range(w):
        if forwards[1] < m:
            run("forward", 1)
        if forwards[0] < m:
            run("forward", 0)
    for _ in range(workers - w):
        if forwards[1] < min(forwards[0], m):
            run("forward", 1)
            run("input", 1)
    while inputs[0] < m or inputs[1] < m:
        before = len(actions)
        if forwards[0] < m:
            run("forward", 0)
        if inputs[0] < inputs[1]:
            run("input", 0)
        if forwards[1] < forwards[0]:
            run("forward", 1)
        if inputs[1] < forwards[1]:
            run("input", 1)
        elif inputs[0] < inputs[1]:
            run("input", 0)
        if len(actions) == before:  # a bug, never a loop without end
            raise AssertionError(f"ZB-V's order is stuck on worker {w} (m={m}, workers={workers})")
    return actions


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """The fill-drain forward passes on a clock: for each clock, its ``(micro-batch,
    partition)`` pairs (the forward-only lists of :class:`GPipeSchedule`, simulated).

    At clock ``k`` partition ``j`` runs micro-batch ``k - j``, so ``m`` micro-batches cross
    ``n`` partitions in ``m + n - 1`` clocks.

    Example:
        >>> list(clock_cycles(3, 2))
        [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    """
    for column in _columns(simulate(GPipeSchedule().forward_only(m, n))):
        yield [(action.microbatch, j) for j, action in column]


@functools.lru_cache(maxsize=64)
def _builtin_actions(
    kind: type[Schedule], m: int, n: int, backward: bool, workers: tuple[int, ...]
) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(actions) for actions in _checked(kind(), m, n, backward, workers))


def _checked(
    plan: Schedule, m: int, n: int, backward: bool, workers: Sequence[int]
) -> list[list[Action]]:
    placement = None if _is_identity(workers) else list(workers)
    make = plan.worker_actions if backward else plan.forward_only
    lists = make(m, n, placement)
    result = _as_lists(lists, len(_partitions_of(workers)), plan)
    resolved = _resolve(result, workers, plan, n)
    _check_resolved(resolved, workers, m, backward)
    return resolved


def step_actions(
    plan: Schedule, m: int, n: int, backward: bool, workers: Sequence[int] | None = None
) -> Sequence[Sequence[Action]]:
    """``plan``'s actions for a run of ``m`` micro-batches over ``n`` partitions placed on
    ``workers`` (the worker of each partition; default one each), forward ones only without
    ``backward``; checked (once per shape for the built-in schedules), every action naming
    its partition."""
    where = tuple(range(n)) if workers is None else tuple(workers)
    if type(plan) in _SCHEDULES.values():
        return _builtin_actions(type(plan), m, n, backward, where)
    return _checked(plan, m, n, backward, where)
