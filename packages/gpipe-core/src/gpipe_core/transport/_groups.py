"""The connections of a pipeline across processes: gloo groups of its own, named alike on
every rank.

A pipeline across processes sends its messages on two gloo groups of its group's ranks
(one per direction, see :class:`~gpipe_core.transport._distributed.DistributedTransport`). gpipe
makes them itself, from the process group's store, under a name every rank of the group
derives from what it agrees on: the group's ranks and the pipeline's tag (see
:func:`pipeline_tag`). ``torch.distributed.new_group`` names a
group by how many groups the calling process made before, so a group the program made on
some ranks only (``new_group([0, 2])``, an earlier pipeline on a sub-group) would make
the ranks name one group differently and wait for each other forever.

Every rank of the group makes them together, while the pipeline is built; each rank first
says it is there (a key in the store), and waits at most ``timeout`` for the others, so a
rank that never comes is named. The groups belong to the pipeline: they are closed with it,
and a pipeline built again gets new ones.

This module knows nothing of messages or runs: it checks process groups, gives each
pipeline its tags and makes connections.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Protocol, cast

import torch.distributed as dist
from torch import Tensor

__all__ = ["Carrier", "Connections", "check_group", "connect", "pipeline_tag"]

_Store = dist.distributed_c10d.Store


class Carrier(Protocol):
    """What the transport uses of a gloo group: point-to-point sends and receives, by the
    rank in the group."""

    def size(self) -> int: ...

    def send(self, tensors: list[Tensor], dstRank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[Tensor], srcRank: int, tag: int) -> dist.Work: ...


#: The seconds gloo lets an operation of the pipeline's groups wait at least (its default).
GLOO_TIMEOUT = 1800.0

#: The gloo groups of a pipeline: to higher ranks, and to lower ones (None for one rank).
Connections = tuple[Carrier, Carrier | None]


def connect(group: dist.ProcessGroup, tag: int, timeout: float | None) -> Connections:
    """The gloo groups that carry the messages of the pipeline ``tag`` on ``group``, made
    on every rank of ``group`` together (each rank's rank in them is its rank in
    ``group``).

    Raises:
        TimeoutError: a rank did not come within ``timeout`` seconds (None: no bound),
            naming the ranks not heard from.
        RuntimeError: gloo could not connect the ranks.
    """
    ranks = dist.get_process_group_ranks(group)
    me, size = group.rank(), group.size()
    name = f"gpipe/{'-'.join(map(str, ranks))}/{tag}/connections"
    store = dist.distributed_c10d._get_default_store()
    _meet(store, name, me, size, timeout)
    # gloo's own bound on a wait that gives none: a receiver waits for its peer's next
    # message as long as a run lasts (gpipe bounds its own waits, by ``timeout``).
    bound = datetime.timedelta(seconds=max(GLOO_TIMEOUT, timeout or 0.0))
    try:
        higher = _gloo(store, f"{name}/higher/", me, size, bound)
        lower = _gloo(store, f"{name}/lower/", me, size, bound) if size > 1 else None
    except RuntimeError as error:
        raise RuntimeError(
            f"rank {me} could not connect to the other ranks of the pipeline's group "
            f"(ranks: {ranks}): {error}"
        ) from error
    return higher, lower


def _gloo(store: _Store, prefix: str, rank: int, size: int, bound: datetime.timedelta) -> Carrier:
    """A gloo group of ``size`` ranks, met under ``prefix`` in ``store``."""
    prefixed = dist.distributed_c10d.PrefixStore(prefix, store)
    return cast(Carrier, dist.ProcessGroupGloo(prefixed, rank, size, bound))


def _meet(store: _Store, name: str, me: int, size: int, timeout: float | None) -> None:
    """Say that rank ``me`` is there, and wait until every rank of ``size`` is.

    Raises:
        TimeoutError: some did not come within ``timeout`` seconds, named.
    """
    store.set(f"{name}/here/{me}", "1")
    keys = [f"{name}/here/{rank}" for rank in range(size)]
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while not store.check(keys):
        if deadline is not None and time.monotonic() >= deadline:
            missing = _missing(store, keys)
            raise TimeoutError(
                f"rank {me} waited {timeout:g} s for ranks {missing} to connect the "
                "pipeline; building a pipeline across processes is collective: every rank "
                "of the group builds it, in the same order"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _missing(store: _Store, keys: Sequence[str]) -> list[int]:
    """The ranks whose key is not in ``store``."""
    return [rank for rank, key in enumerate(keys) if not store.check([key])]


#: The first point-to-point tag gpipe uses; each pipeline on a group takes the next two
#: (headers, then payloads).
TAG_BASE = 0x47500000

_tags: dict[tuple[int, ...], int] = {}


def pipeline_tag(group: dist.ProcessGroup) -> int:
    """The point-to-point tag of the next pipeline made on ``group`` in this process
    (every rank makes its pipelines in the same order, so they agree). The pipeline uses
    this tag for its headers and the next one for its payloads."""
    ranks = tuple(dist.get_process_group_ranks(group))
    count = _tags.get(ranks, 0)
    _tags[ranks] = count + 1
    return TAG_BASE + 2 * count


def check_group(group: object, name: str = "group") -> dist.ProcessGroup:
    """``group`` (the argument ``name``) as a process group this process belongs to, or a
    clear error.

    Raises:
        TypeError: ``group`` is not a process group.
        RuntimeError: torch.distributed is not initialized.
        ValueError: this process is not in ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{name} needs torch.distributed to be initialized first, for example "
            f"torch.distributed.init_process_group('gloo') ({name}: {group!r})"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed process group, such as "
            f"torch.distributed.group.WORLD or one made by new_group() ({name}: {group!r})"
        )
    if group.rank() < 0:
        raise ValueError(
            f"{name} must be a process group this process belongs to (rank: {dist.get_rank()})"
        )
    return group
