"""Placement: the worker of each partition.

With one partition per worker (the default, partition ``j`` on worker ``j``) a schedule's
actions may leave their partition out. Several partitions per worker come from a
placement: ``"loop"`` puts partition ``j`` on worker ``j % W``, ``"v"`` puts partitions
``j`` and ``2W - 1 - j`` on worker ``j``, or a list names each partition's worker.

It must not know actions, schedules, devices or processes: a placement is a list of
worker indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["PlacementSpec", "place_partitions"]

PlacementSpec = Literal["loop", "v"] | Sequence[int] | None


def place_partitions(
    placement: object,
    partitions: int,
    worker_count: int | None = None,
    *,
    workers: int | None = None,
) -> list[int]:
    """The worker of each partition.

    Args:
        placement: None (partition ``j`` on worker ``j``), ``"loop"`` (partition ``j`` on
            worker ``j % worker_count``), ``"v"`` (partitions ``j`` and ``2 * worker_count - 1 - j``
            on worker ``j``), or a list giving each partition's worker.
        partitions: the number of partitions.
        worker_count: the number of workers (default: one per partition for None, the
            length of the list's range for a list; needed for ``"loop"`` and ``"v"``).
        workers: the former name of ``worker_count``, still accepted.

    Raises:
        ValueError: the placement does not fit the numbers (every worker must run a
            partition).
        TypeError: ``placement`` is none of the above.

    Example:
        >>> place_partitions("loop", 4, 2), place_partitions("v", 4, 2)
        ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    check_sizes(partitions=partitions)
    worker_count = count_argument(worker_count, workers)
    if placement is None:
        if worker_count is not None and worker_count != partitions:
            raise ValueError(
                "placement must be given to run several partitions per worker "
                f"(placement: None, partitions: {partitions}, workers: {worker_count})"
            )
        return list(range(partitions))
    if isinstance(placement, str):
        if placement not in ("loop", "v"):
            raise ValueError(
                f"placement must be 'loop', 'v', a list of workers or None "
                f"(placement: {placement!r})"
            )
        if worker_count is None:
            raise ValueError(f"placement {placement!r} needs the number of workers")
        check_sizes(workers=worker_count)
        if placement == "loop":
            if partitions % worker_count:
                raise ValueError(
                    "placement 'loop' needs a multiple of the workers' number of partitions "
                    f"(partitions: {partitions}, workers: {worker_count})"
                )
            return [j % worker_count for j in range(partitions)]
        if partitions != 2 * worker_count:
            raise ValueError(
                "placement 'v' needs two partitions per worker "
                f"(partitions: {partitions}, workers: {worker_count})"
            )
        return [min(j, 2 * worker_count - 1 - j) for j in range(partitions)]
    if not isinstance(placement, (list, tuple)) or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in placement
    ):
        raise TypeError(
            f"placement must be 'loop', 'v', a list of workers or None (placement: {placement!r})"
        )
    count = worker_count if worker_count is not None else max(placement, default=-1) + 1
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


def is_identity(workers: Sequence[int]) -> bool:
    """Whether ``workers`` puts partition ``j`` on worker ``j``."""
    return list(workers) == list(range(len(workers)))


def partitions_of(workers: Sequence[int]) -> list[list[int]]:
    """Each worker's partitions, in pipeline order."""
    result: list[list[int]] = [[] for _ in range(max(workers, default=-1) + 1)]
    for j, w in enumerate(workers):
        result[w].append(j)
    return result


def count_argument(worker_count: int | None, workers: int | None) -> int | None:
    """The number of workers given as ``worker_count`` or by its former name ``workers``."""
    if workers is None:
        return worker_count
    if worker_count is not None:
        raise TypeError(
            "give the number of workers once, as worker_count (worker_count: "
            f"{worker_count!r}, workers: {workers!r})"
        )
    return workers


def check_sizes(**sizes: object) -> None:
    """A :class:`ValueError` unless every size given is a positive integer."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer ({name}: {value!r})")
