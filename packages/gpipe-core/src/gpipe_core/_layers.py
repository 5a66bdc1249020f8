"""A pipeline's layers as the plain module holds them: the :class:`~torch.nn.Module`
container protocol (names, indexing, ``len``, iteration) over the partitions' layers, and
the plain module itself (``unwrap``).

This module owns how the layers look from outside the pipeline: under the plain module's
names (``0.weight``), whichever partition holds them. It must not know runs, transports or
processes: it is given the partitions this process holds and the replicas of the shared
tensors whose owner's layer another process runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from torch import nn

from gpipe_bn import convert_plain_batch_norm

from ._sequential import PipeSequential
from ._shared import SharedReplicas, views

__all__ = ["PlainLayers", "named_modules"]


class PlainLayers:
    """The layers of ``partitions``, in order, under their names in the plain module;
    ``shared`` (None while the pipeline is built) gives the replicas of shared tensors
    whose owner's layer another rank runs."""

    def __init__(self, partitions: Sequence[nn.Sequential], shared: SharedReplicas | None) -> None:
        self.partitions = partitions
        self.shared = shared

    def children(self) -> dict[str, nn.Module]:
        """This process's layers under their names in the plain module, in its order."""
        return {
            name: layer
            for partition in self.partitions
            for name, layer in partition._modules.items()
            if layer is not None
        }

    def replica_views(self) -> dict[str, nn.Module]:
        """The replicas of shared tensors whose owner's layer another rank runs, each held
        alone by a module under the owner's layer name."""
        if self.shared is None or not self.shared.foreign:
            return {}
        return views(self.shared.replicas, set(self.children()))

    def named_children(self, names: Sequence[str]) -> Iterator[tuple[str, nn.Module]]:
        """The layers and replica views this process holds, in the order of ``names`` (the
        plain module's layer names)."""
        children = {**self.children(), **self.replica_views()}
        for name in names:
            if name in children:
                yield name, children[name]

    def get(self, name: str) -> nn.Module | None:
        """The layer (or replica view) named ``name`` in the plain module, if held here."""
        return self.children().get(name, self.replica_views().get(name))

    def __len__(self) -> int:
        return sum(len(partition) for partition in self.partitions)

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    def __getitem__(self, index: int) -> nn.Module:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int (index: {index!r})")
        size = len(self)
        position = index + size if index < 0 else index
        if not 0 <= position < size:
            raise IndexError(f"layer index out of range (index: {index}, layers: {size})")
        for partition in self.partitions:
            if position < len(partition):
                return partition[position]
            position -= len(partition)
        raise AssertionError("unreachable")

    def unwrap(self, unpacks: bool) -> nn.Sequential:
        """The layers as one Sequential (a PipeSequential where the partitions ``unpacks``),
        with each deferred batch norm as a plain one (see ``GPipe.unwrap``)."""
        kind = PipeSequential if unpacks else nn.Sequential
        return kind(
            OrderedDict(
                (name, convert_plain_batch_norm(layer))
                for partition in self.partitions
                for name, layer in partition._modules.items()
                if layer is not None
            )
        )


def named_modules(
    module: nn.Module,
    children: Iterable[tuple[str, nn.Module]],
    memo: set[nn.Module] | None,
    prefix: str,
    remove_duplicate: bool,
) -> Iterator[tuple[str, nn.Module]]:
    """``module``, then its ``children`` and theirs, as
    :meth:`torch.nn.Module.named_modules` walks a module."""
    if memo is None:
        memo = set()
    if module in memo:
        return
    if remove_duplicate:
        memo.add(module)
    yield prefix, module
    for name, layer in children:
        yield from layer.named_modules(
            memo, f"{prefix}.{name}" if prefix else name, remove_duplicate
        )
