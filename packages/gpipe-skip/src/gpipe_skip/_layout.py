"""The skip layout of a partitioned model: which skips cross which partitions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import nn

from ._namespace import Namespace, SkipKey
from ._skippable import Skippable
from ._verify import raise_problems, scan_layers

__all__ = ["SkipLayout", "SkipRoute", "inspect_skip_layout"]


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


def inspect_skip_layout(partitions: Iterable[nn.Sequential]) -> SkipLayout:
    """The skip layout of a model split into ``partitions``.

    Pass the ``partitions`` of a :class:`~gpipe_core.GPipe` module (which also keeps its
    layout as ``skip_layout``), or slices of a sequential model to see a split before
    making it.

    Raises:
        TypeError: a partition is not an :class:`~torch.nn.Sequential`, or the skip
            connections are inconsistent (as :func:`verify_skippables` reports them).

    Example:
        >>> from gpipe_skip import pop, skippable, stash
        >>> @skippable(stash=["skip"])
        ... class Stash(nn.Module):
        ...     def forward(self, x):
        ...         yield stash("skip", x)
        ...         return x
        >>> @skippable(pop=["skip"])
        ... class Pop(nn.Module):
        ...     def forward(self, x):
        ...         return x + (yield pop("skip"))
        >>> model = nn.Sequential(Stash(), nn.ReLU(), nn.ReLU(), Pop())
        >>> inspect_skip_layout([model[:1], model[1:3], model[3:]])
        SkipLayout(3 partitions, 1 skip)
          'skip' in <default namespace>: partition 0 (layer 0) -> partition 2 (layer 3)
    """
    layers: list[nn.Module] = []
    owner: list[int] = []
    count = 0
    for j, partition in enumerate(partitions):
        if not isinstance(partition, nn.Sequential):
            raise TypeError(
                f"every partition must be nn.Sequential (partition {j}: {type(partition).__name__})"
            )
        for layer in partition._modules.values():
            if layer is not None:
                layers.append(layer)
                owner.append(j)
        count = j + 1
    scan = scan_layers(layers)
    raise_problems(scan)
    routes = [
        SkipRoute(key[0], key[1], owner[stash], owner[scan.pops[key]], stash, scan.pops[key])
        for key, stash in scan.stashes.items()
    ]
    skippable = {owner[i] for i, layer in enumerate(layers) if isinstance(layer, Skippable)}
    return SkipLayout(count, routes, skippable)
