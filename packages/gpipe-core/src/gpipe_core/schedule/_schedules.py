"""The built-in schedules and their registry: the order in which each worker runs its
actions.

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
partitions ``j`` and ``2W - 1 - j`` on worker ``j`` (see :func:`~gpipe_core.place_partitions`).

Adding a schedule means writing its action lists: subclass :class:`Schedule` and implement
:meth:`Schedule.actions` (one partition per worker: any placement then runs it, each
worker running its partitions' lists merged) or :meth:`Schedule.worker_actions` (the
lists of any placement). :func:`~gpipe_core.check_actions` tells whether lists can run at all, and
:func:`~gpipe_core.simulate` and :meth:`Schedule.grid` show how they run, every action taking one
unit of time or the durations given.

Example:
    >>> print(get_schedule("1f1b").grid(microbatches=4, partitions=2))
    p0: F0 F1 .  B0 F2 B1 F3 B2 .  B3
    p1: .  F0 B0 F1 B1 F2 B2 F3 B3 .
    >>> print(get_schedule("interleaved-1f1b").grid(2, 4, placement="loop", worker_count=2))
    w0: 0F0 0F1 2F0 2F1 .   2B0 .   2B1 0B0 0B1
    w1: .   1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 .

It must not know tensors, devices, threads or transports: it is lists of actions, checked
and simulated in unit time.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import ClassVar

from ._action import Action, Phase, backward_of, forward_of
from ._check import ScheduleError, as_lists, check_resolved, resolve
from ._generate import fill_weights, merge, v_order
from ._placement import (
    PlacementSpec,
    check_sizes,
    count_argument,
    is_identity,
    partitions_of,
    place_partitions,
)
from ._simulate import columns, grid_text, idle_share, simulate

__all__ = [
    "GPipeSchedule",
    "InterleavedOneFOneBSchedule",
    "OneFOneBSchedule",
    "Schedule",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
    "clock_cycles",
    "get_schedule",
    "schedules",
    "step_actions",
]


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
        if placement is None or is_identity(placement):
            return lists
        resolved = resolve(
            as_lists(lists, partitions, self), list(range(partitions)), self, partitions
        )
        return merge(resolved, place_partitions(list(placement), partitions))

    def forward_only(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        """The forward actions alone, in the same order (a step without backward)."""
        worker_count = len(partitions_of(place_partitions(placement, partitions)))
        lists = as_lists(
            self.worker_actions(microbatches, partitions, placement),
            worker_count,
            self,
        )
        return [[action for action in actions if action.kind is Phase.FORWARD] for actions in lists]

    def grid(
        self,
        microbatches: int,
        partitions: int,
        *,
        placement: PlacementSpec = None,
        worker_count: int | None = None,
        durations: Mapping[str, int] | None = None,
        workers: int | None = None,
    ) -> str:
        """The actions laid out in time (see :func:`~gpipe_core.simulate`): one row per worker, one
        column per time unit; ``.`` is an idle unit. With one partition per worker the rows
        are the partitions (``p0``) and the actions leave their partition out; otherwise
        the rows are the workers (``w0``).

        Args:
            microbatches: the number of micro-batches.
            partitions: the number of partitions.
            placement: see :func:`~gpipe_core.place_partitions`.
            worker_count: the number of workers, for ``"loop"`` and ``"v"``.
            durations: the units each kind of action takes (see :func:`~gpipe_core.simulate`).
            workers: the former name of ``worker_count``, still accepted.
        """
        placement = place_partitions(placement, partitions, count_argument(worker_count, workers))
        lists = self.worker_actions(microbatches, partitions, placement)
        rows = simulate(lists, durations, placement=placement)
        return grid_text(rows, is_identity(placement))

    def bubble(
        self,
        microbatches: int,
        partitions: int,
        *,
        placement: PlacementSpec = None,
        worker_count: int | None = None,
        durations: Mapping[str, int] | None = None,
        workers: int | None = None,
    ) -> float:
        """The idle share of the workers' time in :func:`~gpipe_core.simulate`'s layout (0: none);
        the arguments are :meth:`grid`'s.

        Example:
            >>> get_schedule("gpipe").bubble(6, 3)  # (n - 1) / (m + n - 1)
            0.25
        """
        placement = place_partitions(placement, partitions, count_argument(worker_count, workers))
        lists = self.worker_actions(microbatches, partitions, placement)
        return idle_share(simulate(lists, durations, placement=placement))

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
        check_sizes(microbatches=microbatches, partitions=partitions)
        order = [forward_of(i) for i in range(microbatches)]
        order += [backward_of(i) for i in reversed(range(microbatches))]
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
        check_sizes(microbatches=microbatches, partitions=partitions)
        forwards = [forward_of(i) for i in range(microbatches)]
        backwards = [backward_of(i) for i in range(microbatches)]
        return [_one_f_one_b(forwards, backwards, partitions - j - 1) for j in range(partitions)]


def _loop_per_worker(name: str, partitions: int, placement: Sequence[int] | None) -> int:
    """How many partitions each worker of a loop ``placement`` runs; a clear error if the
    placement is not a loop."""
    placement = place_partitions(placement, partitions)
    count = max(placement) + 1
    if partitions % count or placement != [j % count for j in range(partitions)]:
        raise ScheduleError(
            f"schedule {name!r} needs the loop placement, partition j on worker j % workers "
            f"(placement: {placement}, partitions: {partitions}, workers: {count})"
        )
    return partitions // count


def _check_rounds(name: str, microbatches: int, partitions: int, per_worker: int) -> None:
    """Interleaved 1F1B runs the micro-batches in rounds of one per worker: with several
    partitions per worker, a last round shorter than the others (``m`` more than the
    workers and not a multiple of them) would make it slower than 1F1B on the same
    placement, or deadlock (from four workers), so it is refused."""
    worker_count = partitions // per_worker
    if per_worker > 1 and microbatches > worker_count and microbatches % worker_count:
        raise ScheduleError(
            f"schedule {name!r} with several partitions per worker needs a number of "
            "micro-batches that is a multiple of the workers, or at most the workers "
            f"(micro-batches: {microbatches}, workers: {worker_count}, partitions: {partitions}, "
            f"placement: {[j % worker_count for j in range(partitions)]}); choose the batch "
            "size and chunks to give such a number, or use schedule '1f1b'"
        )


def _interleaved(
    microbatches: int, partitions: int, per_worker: int, split: bool
) -> list[list[Action]]:
    """Interleaved 1F1B over ``partitions // per_worker`` workers, each running ``per_worker``
    partitions in a loop; the backward passes split into input gradients alone if
    ``split`` (their weight gradients are left to the caller)."""
    worker_count = partitions // per_worker
    groups = [
        range(start, min(start + worker_count, microbatches))
        for start in range(0, microbatches, worker_count)
    ]
    kind = Phase.INPUT_GRADIENT if split else Phase.BACKWARD
    lists = []
    for w in range(worker_count):
        forwards = [
            forward_of(i, c * worker_count + w)
            for group in groups
            for c in range(per_worker)
            for i in group
        ]
        backwards = [
            Action(kind, i, c * worker_count + w)
            for group in groups
            for c in reversed(range(per_worker))
            for i in group
        ]
        # 1F1B's warm-up; interleaved, twice as long, plus a round of the other partitions.
        warmup = (
            worker_count - w - 1
            if per_worker == 1
            else 2 * (worker_count - w - 1) + (per_worker - 1) * worker_count
        )
        lists.append(_one_f_one_b(forwards, backwards, warmup))
    return lists


class InterleavedOneFOneBSchedule(Schedule):
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
    last round is slower than 1F1B): other numbers raise :class:`~gpipe_core.ScheduleError`.

    Example:
        >>> lists = InterleavedOneFOneBSchedule().worker_actions(2, 4, placement=[0, 1, 0, 1])
        >>> [" ".join(str(a) for a in actions) for actions in lists]
        ['0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1', '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1']
    """

    name = "interleaved-1f1b"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        return OneFOneBSchedule().actions(microbatches, partitions)

    def worker_actions(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        check_sizes(microbatches=microbatches, partitions=partitions)
        per_worker = _loop_per_worker(self.name, partitions, placement)
        if per_worker == 1:
            return self.actions(microbatches, partitions)
        _check_rounds(self.name, microbatches, partitions, per_worker)
        return _interleaved(microbatches, partitions, per_worker, split=False)


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
        check_sizes(microbatches=microbatches, partitions=partitions)
        per_worker = _loop_per_worker(self.name, partitions, placement)
        _check_rounds(self.name, microbatches, partitions, per_worker)
        base = _interleaved(microbatches, partitions, per_worker, split=True)
        return fill_weights(base, place_partitions(placement, partitions))


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
        >>> print(ZeroBubbleVSchedule().grid(2, 2, placement="v", worker_count=1))
        w0: 0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 0I1 1W1 0W1
        >>> round(ZeroBubbleVSchedule().bubble(16, 4, placement="v", worker_count=2), 2)
        0.01
    """

    name = "zbv"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        return self.worker_actions(microbatches, partitions)

    def worker_actions(
        self, microbatches: int, partitions: int, placement: Sequence[int] | None = None
    ) -> list[list[Action]]:
        check_sizes(microbatches=microbatches, partitions=partitions)
        placement = place_partitions(placement, partitions)
        count = max(placement) + 1
        if partitions != 2 * count or placement != place_partitions("v", partitions, count):
            raise ScheduleError(
                f"schedule {self.name!r} needs the V placement, two partitions per worker "
                f"(partitions j and 2 * workers - 1 - j on worker j): build the pipeline with "
                f'placement="v" (placement: {placement}, partitions: {partitions}, workers: '
                f"{count})"
            )
        return fill_weights(v_order(microbatches, count), placement, cap=partitions)


_SCHEDULES: dict[str, type[Schedule]] = {
    schedule_type.name: schedule_type
    for schedule_type in (
        GPipeSchedule,
        OneFOneBSchedule,
        InterleavedOneFOneBSchedule,
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


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """The fill-drain forward passes on a clock: for each clock, its ``(micro-batch,
    partition)`` pairs (the forward-only lists of :class:`GPipeSchedule`, simulated).

    At clock ``k`` partition ``j`` runs micro-batch ``k - j``, so ``m`` micro-batches cross
    ``n`` partitions in ``m + n - 1`` clocks.

    Example:
        >>> list(clock_cycles(3, 2))
        [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    """
    for column in columns(simulate(GPipeSchedule().forward_only(m, n))):
        yield [(action.microbatch, j) for j, action in column]


@functools.lru_cache(maxsize=64)
def _builtin_actions(
    schedule_type: type[Schedule], m: int, n: int, backward: bool, workers: tuple[int, ...]
) -> tuple[tuple[Action, ...], ...]:
    lists = _checked(schedule_type(), m, n, backward, workers)
    return tuple(tuple(actions) for actions in lists)


def _checked(
    schedule: Schedule, m: int, n: int, backward: bool, workers: Sequence[int]
) -> list[list[Action]]:
    given = None if is_identity(workers) else list(workers)
    make = schedule.worker_actions if backward else schedule.forward_only
    lists = make(m, n, given)
    result = as_lists(lists, len(partitions_of(workers)), schedule)
    resolved = resolve(result, workers, schedule, n)
    check_resolved(resolved, workers, m, backward)
    return resolved


def step_actions(
    schedule: Schedule, m: int, n: int, backward: bool, workers: Sequence[int] | None = None
) -> Sequence[Sequence[Action]]:
    """``schedule``'s actions for a run of ``m`` micro-batches over ``n`` partitions on
    ``workers`` (the worker of each partition; default one each), forward ones only
    without ``backward``; checked (once per shape for the built-in schedules), every action
    naming its partition."""
    workers = tuple(range(n)) if workers is None else tuple(workers)
    if type(schedule) in _SCHEDULES.values():
        return _builtin_actions(type(schedule), m, n, backward, workers)
    return _checked(schedule, m, n, backward, workers)
