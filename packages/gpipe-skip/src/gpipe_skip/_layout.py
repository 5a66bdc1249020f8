"""The skip layout of a partitioned model: which skips cross which partitions.

The layout is data: :func:`~gpipe_skip.inspect_skip_layout` (``_inspect``) finds it. A module
that keeps the layout of its own layers pairs their skips itself (see ``_verify``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ._namespace import Namespace, SkipKey

__all__ = ["SkipLayout", "SkipRoute"]


class SkipRoute(NamedTuple):
    """One skip connection: where it is stashed and where it is popped.

    Layer indices count the layers of the whole model; partition indices count the
    partitions.
    """

    namespace: Namespace
    name: str
    stash_partition: int
    pop_partition: int
    stash_layer: int
    pop_layer: int

    @property
    def key(self) -> SkipKey:
        """The skip's identity, ``(namespace, name)``."""
        return (self.namespace, self.name)

    @property
    def crosses(self) -> bool:
        """Whether the skip leaves the partition that stashes it."""
        return self.stash_partition != self.pop_partition

    def __str__(self) -> str:
        where = f"{self.name!r} in {self.namespace!r}"
        text = (
            f"{where}: partition {self.stash_partition} (layer {self.stash_layer}) -> "
            f"partition {self.pop_partition} (layer {self.pop_layer})"
        )
        return text if self.crosses else f"{text}, inside one partition"


class SkipLayout:
    """Which skip connections cross which partitions, as :func:`inspect_skip_layout` finds.

    A skip stashed in partition ``j`` and popped in partition ``k > j`` goes from ``j``
    straight to ``k``; the partitions in between never see it. A skip stashed and popped
    in one partition stays there.

    Attributes:
        partitions: the number of partitions.
        routes: every skip connection, in the order of the layers that stash them.
    """

    def __init__(self, partitions: int, routes: Iterable[SkipRoute], skippable: Iterable[int]):
        self.partitions = partitions
        self.routes: tuple[SkipRoute, ...] = tuple(routes)
        self._skippable = frozenset(skippable)
        self._requires: list[list[SkipRoute]] = [[] for _ in range(partitions)]
        self._provides: list[list[SkipRoute]] = [[] for _ in range(partitions)]
        for route in self.routes:
            if route.crosses:
                self._requires[route.pop_partition].append(route)
                self._provides[route.stash_partition].append(route)

    @property
    def empty(self) -> bool:
        """Whether no partition has a skippable layer (the pipeline needs no skip work)."""
        return not self._skippable

    def has_skippables(self, partition: int) -> bool:
        """Whether ``partition`` has a skippable layer."""
        return partition in self._skippable

    def crossing(self) -> list[SkipRoute]:
        """The skips that leave the partition that stashes them."""
        return [route for route in self.routes if route.crosses]

    def requires(self, partition: int) -> list[SkipRoute]:
        """The skips ``partition`` pops that an earlier partition stashes."""
        return list(self._requires[partition])

    def provides(self, partition: int) -> list[SkipRoute]:
        """The skips ``partition`` stashes that a later partition pops."""
        return list(self._provides[partition])

    def __repr__(self) -> str:
        count = len(self.routes)
        head = f"SkipLayout({self.partitions} partitions, {count} skip{'' if count == 1 else 's'})"
        return head + "".join(f"\n  {route}" for route in self.routes)
