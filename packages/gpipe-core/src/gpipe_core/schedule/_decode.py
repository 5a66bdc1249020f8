"""The decode schedule: forward passes over lanes, round after round, each lane's next round
made from its previous one's output on the last partition.

Micro-batch ``k`` of a decode run is lane ``k % lanes`` in round ``k // lanes``. Partition
``j`` computes lane ``i``'s round while partition ``j - 1`` computes lane ``i + 1``'s; the
first partition starts a lane's next round once the last partition has finished its
previous one. With at least as many lanes as partitions, no partition waits after the
first round fills the pipeline; with fewer, each round waits ``partitions - lanes`` units.

It must not know tensors, devices, threads or transports: it is lists of actions.
"""

from __future__ import annotations

import functools

from ._action import Action, Phase
from ._placement import PlacementSpec, check_sizes, count_argument, is_identity, place_partitions
from ._simulate import grid_text, idle_share, simulate

__all__ = ["DecodeSchedule", "decode_actions"]


def decode_actions(
    lanes: int, rounds: int, partitions: int, workers: tuple[int, ...] | None = None
) -> tuple[tuple[Action, ...], ...]:
    """Each worker's actions in a decode run of ``lanes`` lanes and ``rounds`` rounds over
    ``partitions`` partitions on ``workers`` (the worker of each partition; default one
    each), every action naming its partition (computed once per shape)."""
    check_sizes(lanes=lanes, rounds=rounds, partitions=partitions)
    placement = tuple(range(partitions)) if workers is None else tuple(workers)
    return _decode_actions(lanes, rounds, partitions, placement)


@functools.lru_cache(maxsize=32)
def _decode_actions(
    lanes: int, rounds: int, partitions: int, workers: tuple[int, ...]
) -> tuple[tuple[Action, ...], ...]:
    # Each action at its time when nothing but its inputs holds it: lane i's round r on
    # partition j starts at r * max(lanes, partitions) + i + j. Every action a worker
    # waits for starts earlier, so each worker's list in that order cannot deadlock.
    period = max(lanes, partitions)
    timed: list[list[tuple[int, int, Action]]] = [[] for _ in range(max(workers) + 1)]
    for k in range(lanes * rounds):
        start = (k // lanes) * period + k % lanes
        for j in range(partitions):
            timed[workers[j]].append((start + j, j, Action(Phase.FORWARD, k, j)))
    return tuple(tuple(action for _, _, action in sorted(row)) for row in timed)


class DecodeSchedule:
    """The order of each worker's forward passes in a decode run (see
    :meth:`GPipe.decode <gpipe_core.GPipe.decode>`): micro-batch ``k`` is lane
    ``k % lanes`` in round ``k // lanes``.

    Example:
        >>> print(DecodeSchedule().grid(lanes=2, rounds=2, partitions=2))
        p0: F0 F1 F2 F3 .
        p1: .  F0 F1 F2 F3
        >>> print(DecodeSchedule().grid(lanes=1, rounds=2, partitions=2))  # one lane waits
        p0: F0 .  F1 .
        p1: .  F0 .  F1
        >>> round(DecodeSchedule().bubble(lanes=4, rounds=8, partitions=4), 3)  # fill, drain
        0.086
    """

    name = "decode"

    def worker_actions(
        self,
        lanes: int,
        rounds: int,
        partitions: int,
        placement: PlacementSpec = None,
        worker_count: int | None = None,
    ) -> list[list[Action]]:
        """Each worker's actions, in the order it runs them (``placement``: see
        :func:`~gpipe_core.place_partitions`)."""  # fmt: skip
        workers = tuple(place_partitions(placement, partitions, worker_count))
        return [list(row) for row in decode_actions(lanes, rounds, partitions, workers)]

    def grid(
        self,
        lanes: int,
        rounds: int,
        partitions: int,
        *,
        placement: PlacementSpec = None,
        worker_count: int | None = None,
    ) -> str:
        """The actions laid out in unit time (see :func:`~gpipe_core.simulate`), as
        :meth:`Schedule.grid <gpipe_core.Schedule.grid>` prints them."""  # fmt: skip
        rows, workers = self._layout(lanes, rounds, partitions, placement, worker_count)
        return grid_text(rows, is_identity(workers))

    def bubble(
        self,
        lanes: int,
        rounds: int,
        partitions: int,
        *,
        placement: PlacementSpec = None,
        worker_count: int | None = None,
    ) -> float:
        """The idle share of the workers' time in unit time (0: none)."""  # fmt: skip
        rows, _ = self._layout(lanes, rounds, partitions, placement, worker_count)
        return idle_share(rows)

    @staticmethod
    def _layout(
        lanes: int,
        rounds: int,
        partitions: int,
        placement: PlacementSpec,
        worker_count: int | None,
    ) -> tuple[list[list[Action | None]], list[int]]:
        """The unit-time rows of the run, and the worker of each partition."""  # fmt: skip
        workers = place_partitions(placement, partitions, count_argument(worker_count, None))
        actions = decode_actions(lanes, rounds, partitions, tuple(workers))
        return simulate(actions, placement=workers, lanes=lanes), workers

    def __repr__(self) -> str:
        return "DecodeSchedule()"
