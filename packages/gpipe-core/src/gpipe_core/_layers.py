"""A pipeline's layers as the plain module holds them: the :class:`~torch.nn.Module`
container protocol (names, indexing, ``len``, iteration) over the
partitions' layers (:class:`LayersModule`, which :class:`~gpipe_core.GPipe` is), and the
plain module itself (``unwrap``).

This module owns how the layers look from outside the pipeline: under the plain module's
names (``0.weight``), whichever partition holds them. It must not know runs, transports or
processes: it is given the partitions this process holds and the replicas of the shared
tensors whose owner's layer another process runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, cast

from torch import nn

from gpipe_bn import convert_plain_batch_norm

from ._sequential import PipeSequential
from ._shared import SharedReplicas, views
from ._state_dict import Renaming

__all__ = ["LayersModule", "Layout", "PlainLayers", "named_modules"]


class Layout(Protocol):
    """What the layers' container reads of the pipeline's configuration."""

    #: Whether the partitions keep a PipeSequential's calling convention.
    unpacks: bool
    #: The layers' names, in the plain module's order.
    layer_names: list[str]
    #: The replicas of the tensors that partitions share.
    shared: SharedReplicas


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
        container = PipeSequential if unpacks else nn.Sequential
        return container(
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


class LayersModule(nn.Module):
    """A module whose layers are the plain module's, under its names, held by partitions.

    A base of :class:`~gpipe_core.GPipe`, which sets the attributes below; what it adds
    is how the layers run. Its two hooks, :meth:`_renaming` and :meth:`_agreed_fields`, are
    a subclass's to override, and GPipe's constructor calls them before any state of its
    own exists: they read only what the subclass set before calling it (plain attributes).
    """

    partitions: nn.ModuleList
    _config: Layout

    def _partition_list(self) -> list[nn.Sequential]:
        return cast(list[nn.Sequential], list(self.partitions))

    def _layers(self) -> PlainLayers:
        config = self.__dict__.get("_config")
        return PlainLayers(self._partition_list(), config.shared if config else None)

    def unwrap(self) -> nn.Sequential:
        """The layers as one :class:`~torch.nn.Sequential`, in order, under their names.

        The same layer objects, trained, wherever they are (a
        :class:`~gpipe_core.WithDevice` layer gives the layer it wraps): a copy
        (``copy.deepcopy``) is the plain model without the pipeline, to move, save or
        serve alone. Its :meth:`~torch.nn.Module.state_dict` has the same keys as this
        module's. A wrapped :class:`~gpipe_core.PipeSequential` comes back as one.

        A :class:`~gpipe_bn.DeferredBatchNorm` (``deferred_batch_norm=True``) comes back
        as a plain ``nn.BatchNorm{d}d`` holding the same parameters and running
        statistics (see :func:`~gpipe_bn.convert_plain_batch_norm`; a layer holding one
        is a shallow copy), so that the model alone updates its statistics on every call;
        the pipeline keeps its deferred layers.

        Example:
            >>> import copy
            >>> import torch
            >>> from gpipe_core import GPipe
            >>> pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), [2, 1])
            >>> plain = copy.deepcopy(pipe.unwrap())
            >>> x = torch.randn(3, 4)
            >>> torch.equal(plain(x), pipe(x)), list(plain.state_dict()) == list(pipe.state_dict())
            (True, True)
        """
        return self._layers().unwrap(self._config.unpacks)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        """The layers of this process's partitions under their names in the plain
        module, so that :meth:`~torch.nn.Module.named_parameters`,
        :meth:`~torch.nn.Module.named_buffers` and :meth:`~torch.nn.Module.named_modules`
        give the plain module's names (``0.weight``), as ``state_dict()`` does, and
        every name resolves on the pipeline (``pipe.get_parameter('0.weight')``). The
        partitions stay in :attr:`partitions`.

        Across processes, a rank holds only its partitions' layers. A shared (tied)
        parameter whose first use is in another rank's layer has a replica here, named as
        in the plain module (``0.weight``): a module standing for that layer holds it
        alone, so that an optimizer's state for it has the plain module's key.
        """
        yield from self._layers().named_children(self._config.layer_names)

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """The pipeline, then its layers and theirs under the plain module's names (see
        :meth:`named_children`), or under the names a subclass gives them (a model's own)."""
        renaming = self._renaming()
        if renaming is None:
            yield from named_modules(self, self.named_children(), memo, prefix, remove_duplicate)
            return
        for path, module in named_modules(self, self.named_children(), memo, "", remove_duplicate):
            name = renaming.rename(path) if path else ""
            if name is not None:
                yield ".".join(filter(None, (prefix, name))), module

    def _renaming(self) -> Renaming | None:
        """The names this pipeline shows for the plain keys, if not those (see
        :class:`~gpipe_core._state_dict.Renaming`); a subclass's to give."""
        return None

    def _agreed_fields(self) -> tuple[tuple[str, object], ...]:
        """What the ranks of a pipeline across processes must also agree on, as
        ``(what, value)`` pairs compared before the layers (a differing one is reported
        as ``what differs across ranks (rank 0: ..., rank 1: ...)``); a subclass's to
        give."""
        return ()

    def _plain_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters under the plain module's keys, each once, whatever names the
        pipeline shows (its own bookkeeping: the shared replicas, clipping across ranks)."""
        seen: set[nn.Parameter] = set()
        for path, module in named_modules(self, self.named_children(), None, "", True):
            for name, parameter in module._parameters.items():
                if parameter is not None and parameter not in seen:
                    seen.add(parameter)
                    yield ".".join(filter(None, (path, name))), parameter

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            # A layer under its plain name, as on the plain module (``pipe.get_submodule('3')``).
            modules = self.__dict__.get("_modules", {})
            if "partitions" in modules and not name.startswith("_"):
                layer = self._layers().get(name)
                if layer is not None:
                    return layer
            raise error

    def __len__(self) -> int:
        return len(self._layers())

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._layers())

    def __getitem__(self, index: int) -> nn.Module:
        return self._layers()[index]
