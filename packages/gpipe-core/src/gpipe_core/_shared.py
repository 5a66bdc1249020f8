"""Shared (tied) parameters and buffers: one tensor used by layers of several partitions.

A language model's token embedding and output head often share one matrix
(``head.weight = embedding.weight``). :func:`find_shared` finds every such tensor when the
pipeline is built, from the layers themselves: no declaration. Its *owner* is its first use
in the plain module's order; each use has the plain key it has there (``0.weight``,
``5.weight``).

In one process, partitions on one device use the tensor itself, and autograd adds their
gradients in its ``.grad``, as in the plain module. A partition on another device than the
owner's uses a copy on its device that autograd ties to the owner (:class:`Ties`): the
gradient reaches the owner's ``.grad`` through the copy, in ``forward()`` + ``backward()``
as in a step (a shared buffer across devices is refused by
:func:`~gpipe_core._partition.check_split`: a layer may update it in place).

Across processes, each rank whose partitions use it keeps a *replica* (the tensor object
its layers hold), and :class:`SharedReplicas` keeps the replicas the plain module's one
tensor:

- at construction, the replicas are made equal to the owner's rank's (the owner's rank
  sends its tensor);
- once per step, after the last backward pass, what the step added to the replicas'
  gradients is summed over the ranks that hold them (one sum per set of such ranks and
  dtype, added in the ranks' order, so alike on each), so every replica gets the plain
  module's gradient, and an identical optimizer keeps them identical; a parameter that no
  rank computed a gradient for keeps ``None``, as in the plain module;
- :meth:`SharedReplicas.drift` tells how far the replicas are from the owner's;
- :func:`views` names a replica as the plain module names it (its owner's key), also on a
  rank without the owner's layer.

Buffers are made equal at construction and not summed (their values are not gradients).

The tensors travel within a run of the pipeline, between the ranks that hold them (an
:data:`Exchange`, the transport's): a rank that fails or is interrupted ends the run on
every rank, rather than leaving the others in a collective it never joins, and no process
group is made for them.

This module knows nothing of schedules or transports: it works on tensors, ranks and an
exchange between ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._dtensor import gradient_like, local_part

__all__ = ["Exchange", "Shared", "SharedReplicas", "Ties", "find_shared", "views"]

#: Within a run: send tensors to some ranks of the pipeline's group, and receive what some
#: send this rank (``exchange(tensors, send_to, receive_from, what)``; see
#: :meth:`DistributedTransport.exchange
#: <gpipe_core.transport._distributed.DistributedTransport.exchange>`).
Exchange = Callable[
    [Sequence[torch.Tensor], Sequence[int], Sequence[int], str], dict[int, list[torch.Tensor]]
]

#: Tie the partitions on one device too, as if on different ones (the tests run the ties'
#: mechanism on the CPU with it).
TIE_ONE_DEVICE = False


@dataclass
class Shared:
    """One tensor used by layers of several partitions."""

    #: Each use: (partition, plain key), in the plain module's order; the first is the owner.
    uses: list[tuple[int, str]]
    #: Whether it is a parameter (else a buffer).
    parameter: bool

    @property
    def key(self) -> str:
        """The owner's plain key: the name the plain module gives the tensor."""
        return self.uses[0][1]

    @property
    def partitions(self) -> list[int]:
        """The partitions that use it, in order."""
        return sorted({j for j, _ in self.uses})


def find_shared(partitions: Sequence[nn.Sequential]) -> list[Shared]:
    """The tensors used by layers of more than one of ``partitions`` (every partition's
    layers, under their plain names), in the order of their owners."""
    found: dict[int, Shared] = {}
    for j, partition in enumerate(partitions):
        named = chain(
            ((key, t, True) for key, t in partition.named_parameters(remove_duplicate=False)),
            ((key, t, False) for key, t in partition.named_buffers(remove_duplicate=False)),
        )
        for key, tensor, parameter in named:
            entry = found.setdefault(id(tensor), Shared([], parameter))
            entry.uses.append((j, key))
    return [entry for entry in found.values() if len(entry.partitions) > 1]


def views(replicas: dict[str, torch.Tensor], present: set[str]) -> dict[str, nn.Module]:
    """Modules that hold the replicas whose owner's layer is not in this process, under the
    owner's plain key: ``{'0': module}`` with ``module.weight`` the replica of ``0.weight``,
    so that the owner's name resolves here too (see :meth:`GPipe.named_children
    <gpipe_core.GPipe.named_children>`).

    Args:
        replicas: each replica, under its owner's plain key.
        present: the names of this process's layers.
    """
    made: dict[str, nn.Module] = {}
    for key, tensor in replicas.items():
        layer, _, rest = key.partition(".")
        if layer in present or not rest:
            continue
        module = made.setdefault(layer, nn.Module())
        *path, leaf = rest.split(".")
        for name in path:
            inner = module._modules.get(name)
            if inner is None:
                inner = nn.Module()
                module.add_module(name, inner)
            module = inner
        if isinstance(tensor, nn.Parameter):
            module.register_parameter(leaf, tensor)
        else:
            module.register_buffer(leaf, tensor)
    return made


class _Tie:
    """The copy of a shared parameter (its *owner*, at ``home``: a module and a name) on
    ``device``, for the layers of the partitions there: while such a layer runs, its sites
    (module, name) hold the copy; otherwise what they held, the owner itself as in the
    plain module (so its state dict, copies and :meth:`GPipe.unwrap
    <gpipe_core.GPipe.unwrap>` are the plain module's).

    The copy is made on first use and again once the owner has changed (an optimizer's
    step, a tensor put in its place), or when grad mode needs one with autograd history:
    micro-batches and their recomputations share it, and autograd takes their gradients to
    the owner's ``.grad``.
    """

    def __init__(self, home: tuple[nn.Module, str], device: torch.device) -> None:
        self.home = home
        self.device = device
        self.copy: torch.Tensor | None = None
        self.source: torch.Tensor | None = None  # what the copy is of
        self.version = -1
        self.held: dict[int, list[torch.Tensor | None]] = {}  # what the sites held

    def current(self) -> torch.Tensor:
        """The copy for a layer about to run, made anew when the owner changed."""
        module, name = self.home
        owner = module._parameters[name]
        assert owner is not None
        copy = self.copy
        history = torch.is_grad_enabled() and owner.requires_grad
        if (
            copy is None
            or self.source is not owner
            or self.version != owner._version
            or (history and copy.grad_fn is None)
        ):
            copy = owner.to(self.device, copy=True)
            self.copy, self.source, self.version = copy, owner, owner._version
        return copy

    def enter(self, sites: list[tuple[nn.Module, str]], layer: nn.Module, args: object) -> None:
        """Forward pre-hook of a layer with ``sites``: they hold the copy."""
        copy = self.current()
        self.held[id(sites)] = [module._parameters[name] for module, name in sites]
        for module, name in sites:
            module._parameters[name] = copy  # type: ignore[assignment]

    def leave(
        self, sites: list[tuple[nn.Module, str]], layer: nn.Module, args: object, output: object
    ) -> None:
        """Forward hook of a layer with ``sites`` (also when it raises): they hold what they
        held again."""
        held = self.held.pop(id(sites), None)
        if held is not None:
            for (module, name), tensor in zip(sites, held, strict=True):
                module._parameters[name] = tensor  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:
        # A copy of the module makes its own copy of the owner (one with autograd history
        # cannot be copied).
        return {**self.__dict__, "copy": None, "source": None, "version": -1, "held": {}}


class Ties:
    """The ties of this process's partitions to shared parameters on other devices.

    Args:
        shared: the shared tensors (:func:`find_shared`).
        partitions: every partition (another rank's are empty).
        devices: each partition's device (``meta`` for another rank's).
    """

    def __init__(
        self,
        shared: Sequence[Shared],
        partitions: Sequence[nn.Sequential],
        devices: Sequence[torch.device],
    ) -> None:
        #: The ties, each with its layers' hooks installed.
        self.ties: list[_Tie] = []
        for entry in shared:
            uses = [(j, key) for j, key in entry.uses if devices[j].type != "meta"]
            if not entry.parameter or not uses:
                continue
            j0, key0 = uses[0]  # the owner, or this process's replica of it
            path0, _, name0 = key0.rpartition(".")
            home = (partitions[j0].get_submodule(path0), name0)
            by_device: dict[torch.device, list[tuple[int, str]]] = {}
            for j, key in uses[1:]:
                if devices[j] != devices[j0] or (TIE_ONE_DEVICE and j != j0):
                    by_device.setdefault(devices[j], []).append((j, key))
            for device, sites in by_device.items():
                self._tie(home, device, partitions, sites)

    def _tie(
        self,
        home: tuple[nn.Module, str],
        device: torch.device,
        partitions: Sequence[nn.Sequential],
        uses: list[tuple[int, str]],
    ) -> None:
        tie = _Tie(home, device)
        # Each layer swaps its own sites only: layers of partitions on one device may run
        # at once, in their workers.
        layers: dict[int, tuple[nn.Module, list[tuple[nn.Module, str]]]] = {}
        for j, key in uses:
            layer = partitions[j]._modules[key.partition(".")[0]]
            assert layer is not None
            path, _, name = key.rpartition(".")
            layers.setdefault(id(layer), (layer, []))[1].append(
                (partitions[j].get_submodule(path), name)
            )
        for layer, sites in layers.values():
            # Partials, which copy and pickle with the layer, rather than bound methods.
            layer.register_forward_pre_hook(functools.partial(_Tie.enter, tie, sites))
            layer.register_forward_hook(functools.partial(_Tie.leave, tie, sites), always_call=True)
        self.ties.append(tie)


@dataclass
class _Site:
    """Where this process's replica of a shared tensor is: a partition and its key there
    (looked up at each use, so that a load with ``assign=True`` that replaces the tensor
    is followed)."""

    partition: nn.Sequential
    key: str
    parameter: bool

    def tensor(self) -> torch.Tensor:
        if self.parameter:
            return self.partition.get_parameter(self.key)
        return self.partition.get_buffer(self.key)


@dataclass
class _Set:
    """The shared tensors held by one set of ranks."""

    ranks: tuple[int, ...]  # in the pipeline's group, in order
    owners: dict[str, int] = field(default_factory=dict)  # key -> the owner's rank
    sites: dict[str, _Site] = field(default_factory=dict)  # key -> this replica's site

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """This process's replicas, under their owners' keys."""
        return {key: site.tensor() for key, site in self.sites.items()}


class SharedReplicas:
    """The replicas of shared tensors in this process, across the ranks of a pipeline.

    Args:
        shared: the shared tensors (:func:`find_shared`).
        partition_ranks: the rank (in ``group``) of each partition.
        local: this process's partitions (another rank's are empty).
        group: the pipeline's process group (None: one process; nothing to keep equal).
        timeout: the seconds a collective may wait for the other ranks (None: no bound).
    """

    def __init__(
        self,
        shared: Sequence[Shared],
        partition_ranks: Sequence[int],
        local: Sequence[nn.Sequential],
        group: dist.ProcessGroup | None,
        timeout: float | None,
    ) -> None:
        self.timeout = timeout
        self.rank = 0
        self.sets: list[_Set] = []
        self._sites: dict[str, _Site] = {}
        #: The owner's keys of the replicas here whose owner another rank holds.
        self.foreign: set[str] = set()
        if group is None:
            return
        self.rank = rank = group.rank()
        by_ranks: dict[tuple[int, ...], _Set] = {}
        for entry in shared:
            ranks = tuple(sorted({partition_ranks[j] for j in entry.partitions}))
            mine = [(j, key) for j, key in entry.uses if partition_ranks[j] == rank]
            if mine:
                j, key = mine[0]
                site = self._sites[entry.key] = _Site(local[j], key, entry.parameter)
                if partition_ranks[entry.uses[0][0]] != rank:
                    self.foreign.add(entry.key)
            if len(ranks) < 2:
                continue  # on one rank: the tensor itself
            # Every rank walks the sets in one order, so their exchanges pair up.
            found = by_ranks.setdefault(ranks, _Set(ranks))
            found.owners[entry.key] = partition_ranks[entry.uses[0][0]]
            if mine:
                found.sites[entry.key] = site
        self.sets = [s for _, s in sorted(by_ranks.items())]

    @property
    def replicas(self) -> dict[str, torch.Tensor]:
        """This process's replica of each shared tensor it holds, under the owner's key."""
        return {key: site.tensor() for key, site in self._sites.items()}

    def connect(self, exchange: Exchange) -> None:
        """Make the replicas equal to the owners' (within a run of every rank: the owners'
        ranks send their tensors to the other ranks that hold them)."""
        with torch.no_grad():
            for found in self.sets:
                for key, tensor in found.tensors.items():
                    tensor = local_part(tensor)
                    owner = self._from_owner(found, key, tensor, exchange)
                    if owner is not tensor:
                        tensor.copy_(owner)

    def _from_owner(
        self, found: _Set, key: str, tensor: torch.Tensor, exchange: Exchange
    ) -> torch.Tensor:
        """The owner's ``key`` (this rank's ``tensor`` on the owner's rank, which sends it
        to the other ranks of ``found``)."""
        owner = found.owners[key]
        what = f"the owner's {key}"
        if owner == self.rank:
            exchange([tensor.detach()], [r for r in found.ranks if r != owner], [], what)
            return tensor
        return exchange([], [], [owner], what)[owner][0].to(tensor.device)

    def _sum(
        self, found: _Set, tensor: torch.Tensor, exchange: Exchange, what: str
    ) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks of ``found``, added in the ranks' order (so
        the same on each)."""
        others = [r for r in found.ranks if r != self.rank]
        theirs = exchange([tensor], others, others, what)
        parts = [tensor if r == self.rank else theirs[r][0] for r in found.ranks]
        total = parts[0].to(tensor.device, copy=True)
        for part in parts[1:]:
            total += part.to(tensor.device)
        return total

    def _parameters(self, found: _Set) -> list[nn.Parameter]:
        """The replicas of ``found`` that are parameters and require grad, in order."""
        return [
            t for t in found.tensors.values() if isinstance(t, nn.Parameter) and t.requires_grad
        ]

    def gradients(self) -> dict[int, torch.Tensor | None]:
        """The replicas' gradients before a step (by ``id``: a copy, or None where there is
        none): the step sums only what it adds, so that gradients accumulated over several
        steps are summed once."""
        return {
            id(p): None if p.grad is None else local_part(p.grad).detach().clone()
            for found in self.sets
            for p in self._parameters(found)
        }

    def sum_gradients(self, before: dict[int, torch.Tensor | None], exchange: Exchange) -> None:
        """Sum what the step added to the gradients of this process's replicas of shared
        parameters over the ranks that hold them (one sum per set of ranks and dtype,
        within the step's run), and add the sum to the gradients they had ``before`` the
        step (equal on every rank).

        A rank whose uses of a parameter computed no gradient (its layers skipped, their
        input detached) has none to add: the sum carries, beside the gradients, whether
        each rank has one, so that every rank knows who does. A parameter none of
        whose uses computed a gradient on any rank keeps what it held before the step
        (``None``, as in the plain module, where an optimizer then leaves it alone); one
        that some rank has a gradient for gets the sum on every rank."""
        for found in self.sets:
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in self._parameters(found):
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype in sorted(by_dtype, key=str):
                same = by_dtype[dtype]
                added = []
                for p in same:
                    earlier = before.get(id(p))
                    grad = (
                        local_part(p.grad)
                        if p.grad is not None
                        else torch.zeros_like(local_part(p))
                    )
                    added.append((grad if earlier is None else grad - earlier).reshape(-1))
                # Then, for each parameter, 1 where this rank has a gradient: the sum
                # counts the ranks that have one.
                has = [float(p.grad is not None) for p in same]
                added.append(torch.tensor(has, dtype=dtype, device=added[0].device))
                flat = torch.cat(added)
                flat = self._sum(
                    found, flat, exchange,
                    "the gradients of the shared parameters "
                    f"{[k for k, t in found.tensors.items() if any(t is p for p in same)]}",
                )  # fmt: skip
                counts = flat[-len(same) :].tolist()
                offset = 0
                for p, count in zip(same, counts, strict=True):
                    shard = local_part(p)
                    summed = flat[offset : offset + shard.numel()].view_as(shard)
                    offset += shard.numel()
                    if count == 0:
                        continue  # no rank has a gradient: none was computed
                    earlier = before.get(id(p))
                    if earlier is not None:
                        summed = earlier + summed
                    if p.grad is None:
                        p.grad = gradient_like(p, summed.clone())
                    else:
                        local_part(p.grad).copy_(summed)

    def drift(self, exchange: Exchange) -> dict[str, float]:
        """The largest absolute difference between each replica this process holds and the
        owner's, under the owner's plain key (the same on every rank that holds it; 0.0 for
        a tensor on one rank), within a run of every rank."""
        drifts = dict.fromkeys(self.replicas, 0.0)
        for found in self.sets:
            others = [r for r in found.ranks if r != self.rank]
            for key, tensor in found.tensors.items():
                tensor = local_part(tensor)
                owner = self._from_owner(found, key, tensor, exchange)
                difference = (tensor.detach() - owner).abs().max().reshape(1).double().cpu()
                theirs = exchange([difference], others, others, f"the drift of {key}")
                drifts[key] = max([float(difference), *(float(t[0]) for t in theirs.values())])
        return drifts
