"""Finding the skip layout of a model split into partitions."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ._layout import SkipLayout, SkipRoute
from ._skippable import Skippable
from ._verify import raise_problems, scan_layers

__all__ = ["inspect_skip_layout"]


def inspect_skip_layout(partitions: Iterable[nn.Sequential]) -> SkipLayout:
    """The skip layout of a model split into ``partitions``.

    Pass the ``partitions`` of a pipeline (:class:`~gpipe_core.GPipe` also keeps its layout
    as ``skip_layout``), or slices of a sequential model to see a split before making it.
    A module that keeps the layout it returns pairs the skips of its layers itself:
    :func:`verify_skippables` leaves them alone when the module is nested in another.

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
