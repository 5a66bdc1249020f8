"""Placement: which partitions a pipeline has, where each runs, and which are this process's.

A :class:`Placement` is built once, from ``balance``, ``devices``, ``group`` and
``placement``: ``workers``, the worker that runs each partition (one worker thread runs
one action list for all its partitions), the rank (in ``group``) that runs each
partition, each partition's device (``meta`` for another rank's), and, across processes,
the process groups and the tag its messages travel on and the seconds any wait for another
rank may last. It makes the pipeline's connections (see :mod:`gpipe_core.transport._groups`) and its
transport. It is the only place that knows whether a pipeline spans processes: the rest
of gpipe-core asks it which partitions are local and which transport carries their
messages.

It knows nothing of the layers beyond their count, of schedules or of partitions.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from gpipe_microbatch import Device

from ._partition import resolve_devices
from .schedule._placement import place_partitions
from .transport._agreement import Construction
from .transport._distributed import DistributedTransport
from .transport._groups import Connections, check_group, connect, pipeline_tag
from .transport._payloads import Payloads, choose_payloads
from .transport._session import share_plan
from .transport._transport import Fields, LocalTransport, Plan, Transport

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "Placement",
    "check_timeout",
    "construction_for",
    "warn_without_process_group",
]


#: The default ``timeout``: the seconds any wait for another rank may last.
DEFAULT_TIMEOUT = 1800.0
#: The longest bounded timeout (a longer one is clamped to it): a century, a wait that
#: every wait given the timeout holds. gloo's waits end at a deadline counted in
#: nanoseconds since 1970 in a signed 64-bit integer, which overflows past the year 2262
#: (about 292 years from 1970, not from now: a wait of 250 years fails at once, or never
#: ends); Python's threads accept about 292 years from now (less on some platforms: the
#: clamp is never past :data:`threading.TIMEOUT_MAX`).
MAX_TIMEOUT = min(100 * 365.25 * 24 * 3600.0, float(threading.TIMEOUT_MAX))


def check_timeout(timeout: object, group: object) -> float | None:
    """``timeout`` in seconds, None for no bound (only meaningful with a group)."""
    if group is None:
        if timeout is not None and timeout != DEFAULT_TIMEOUT:
            raise ValueError(
                f"timeout bounds the waits for other ranks and needs group (timeout: {timeout!r})"
            )
        return DEFAULT_TIMEOUT
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be seconds, a timedelta or None for no bound (timeout: {timeout!r})"
        )
    if not seconds > 0:
        raise ValueError(f"timeout must be positive (timeout: {timeout!r})")
    if not math.isfinite(seconds):
        raise ValueError(
            "timeout must be a finite number of seconds, or None for no bound "
            f"(timeout: {timeout!r})"
        )
    return min(seconds, MAX_TIMEOUT)


_warned_without_process_group = False


def construction_for(group: dist.ProcessGroup | None) -> Construction | None:
    """How the ranks of ``group`` agree on the pipeline being built (the group checked
    first, before anything can fail on one rank only: the ranks then count their pipelines
    on the group alike, and tell each other of a failure); None in one process, which
    warns where the environment says it is one of several (see
    :func:`warn_without_process_group`)."""
    if group is None:
        warn_without_process_group(stacklevel=4)
        return None
    check_group(group)
    return Construction(group, pipeline_tag(group))


def warn_without_process_group(stacklevel: int) -> None:
    """Warn (once per process) when the environment says this process is one of several
    but ``torch.distributed`` is not initialized: every rank would then train the whole
    model alone (a pipeline inside the user's own data parallelism is initialized).
    ``stacklevel`` points the warning at the user's call."""
    global _warned_without_process_group
    if _warned_without_process_group or (dist.is_available() and dist.is_initialized()):
        return
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 2:
        return
    _warned_without_process_group = True
    warnings.warn(
        f"this process is one of {world} (WORLD_SIZE={world}) but torch.distributed is not "
        "initialized, so this pipeline runs every partition in this process, as every "
        "other process does; to run the partitions across the processes, call "
        "torch.distributed.init_process_group() first and pass "
        "group=torch.distributed.group.WORLD",
        UserWarning,
        stacklevel=stacklevel,
    )


class Placement:
    """Where each partition of a pipeline runs.

    Args:
        balance: the number of layers of each partition (checked already).
        devices: the devices of this process's partitions (default: see
            :func:`~gpipe_core._partition.resolve_devices`, or across processes the CUDA
            device ``LOCAL_RANK``, else the CPU).
        group: the process group whose ranks run the partitions (None: this process runs
            them all). Partition ``j`` runs on rank ``j % group.size()`` unless
            ``placement`` says otherwise.
        timeout: across processes, the seconds any wait for another rank may last (None:
            no bound).
        placement: None (each partition is a worker of its own), or several partitions per
            worker (see :func:`~gpipe_core.place_partitions`): ``"loop"``,
            ``"v"`` or each partition's worker. A worker is an entry of ``devices`` in one
            process, a rank of ``group`` across processes.

    Raises:
        ValueError: the number of partitions is not a multiple of the group's size,
            ``devices`` does not fit (see :func:`~gpipe_core._partition.resolve_devices`),
            ``placement`` does not fit the partitions and workers, or puts partitions on
            two devices on one rank (they share its worker, with no device copy between
            them).
        TypeError: ``placement`` is not a placement.
    """

    def __init__(
        self,
        balance: Sequence[int],
        devices: Iterable[Device] | None,
        group: dist.ProcessGroup | None,
        timeout: float | None,
        placement: object = None,
    ) -> None:
        n = len(balance)
        self.balance = list(balance)
        self.group = group
        self.timeout = timeout
        #: This process's rank in ``group`` (0 without one).
        self.rank = 0
        #: The rank of each partition (all 0 without a group).
        self.ranks = [0] * n
        if group is not None:
            size = group.size()
            if n < size or n % size:
                raise ValueError(
                    "balance must have a multiple of group.size() partitions, one or more "
                    f"per rank (partitions: {n}, group.size(): {size})"
                )
            self.rank = group.rank()
            self.ranks = [j % size for j in range(n)]
        #: The worker of each partition (each its own without ``placement``).
        self.workers = list(range(n))
        if placement is not None:
            self.workers = _place(placement, n, devices, group)
            if group is not None:
                self.ranks = list(self.workers)
        #: Whether each partition runs in this process.
        self.local = [rank == self.rank for rank in self.ranks]
        #: The device of each partition (``meta`` for another rank's).
        if group is not None:
            self.devices = _rank_devices(devices, self.local)
            if placement is not None:
                _check_one_device(self.local_devices(), self.rank, placement)
        elif placement is not None:
            # One device per worker: its partitions share it.
            own = resolve_devices(devices, max(self.workers, default=-1) + 1)
            self.devices = [own[w] for w in self.workers]
        else:
            self.devices = resolve_devices(devices, n)
        #: Whether the ranks compare their run fields at every run (see
        #: :mod:`gpipe_core.transport._agreement`); a benchmark turns it off for its
        #: pipeline to measure what the check costs.
        self.check_runs = True
        self._transport: Transport | None = None
        self._tag = 0
        self._connections: Connections | None = None
        self._payloads: Payloads | None = None

    @property
    def spans_processes(self) -> bool:
        """Whether other processes run some of the partitions."""
        return self.group is not None

    def is_local(self, j: int) -> bool:
        """Whether partition ``j`` (``-1``: the last) runs in this process (an empty
        pipeline's missing partitions do: its input is its output)."""
        return self.local[j] if self.local else True

    @property
    def local_worker_count(self) -> int:
        """How many workers (worker threads) this process runs."""
        return len({w for w, here in zip(self.workers, self.local, strict=True) if here})

    def local_devices(self) -> list[torch.device]:
        """The devices of this process's partitions."""
        return [device for device, here in zip(self.devices, self.local, strict=True) if here]

    def threaded(self, nested: bool) -> bool:
        """Whether a run gives each local partition its worker thread, rather than running
        them in the calling thread: with several local partitions, unless the pipeline is
        ``nested`` in a checkpointed partition (whose recomputation must replay its draws
        in order) and all of them are here."""
        return self.local_worker_count > 1 and (self.spans_processes or not nested)

    def connect(self, tag: int) -> None:
        """Make the gloo groups the messages travel on (collective over ``group``: every
        rank calls it, once the ranks agree on what they build; see
        :func:`~gpipe_core.transport._groups.connect`); ``tag`` is the pipeline's tag (see
        :func:`~gpipe_core.transport._groups.pipeline_tag`).

        Raises:
            TimeoutError: a rank did not come within the timeout (named).
        """
        if self.group is None:
            return
        self._tag = tag
        self._connections = connect(self.group, tag, self.timeout)
        self._payloads = choose_payloads(
            self.group, self._connections, tag, self.local_devices(), self.timeout
        )

    def transport(self) -> Transport:
        """The pipeline's transport, made on first use: between worker threads of this
        process, or across the processes of ``group``."""
        if self._transport is None:
            if self.group is None:
                self._transport = LocalTransport(self.devices)
            else:
                assert self._connections is not None, "connect() first"
                self._transport = DistributedTransport(
                    self._connections,
                    self.group.rank(),
                    self.ranks,
                    self.devices,
                    timeout=self.timeout,
                    tag=self._tag,
                    payloads=self._payloads,
                )
        return self._transport

    def share_plan(self, plan: Plan | None, fields: Fields) -> Plan:
        """The run's ``plan``, from the first partition's rank to every rank, with the
        run's ``fields`` checked to agree unless ``check_runs`` is off (see
        :func:`~gpipe_core.transport._session.share_plan`)."""
        return share_plan(
            self.transport(), plan, fields, first=self.is_local(0), check=self.check_runs
        )

    def close(self) -> None:
        """Stop the transport's threads, if any (idempotent)."""
        if self._transport is not None:
            self._transport.close()

    def __getstate__(self) -> dict[str, object]:
        # A copy makes its own transport (locks and threads cannot be copied).
        return {**self.__dict__, "_transport": None}

    def describe_group(self) -> str:
        """The group's ranks, for errors (``'ranks: [0, 1]'``)."""
        if self.group is None:
            return "no process group"
        return f"ranks: {dist.get_process_group_ranks(self.group)}"


def _place(
    placement: object, partitions: int, devices: Iterable[Device] | None, group: object
) -> list[int]:
    """The worker of each partition for ``placement``: the workers are the ranks of
    ``group``, else the entries of ``devices``."""
    if group is not None:
        worker_count: int | None = cast(dist.ProcessGroup, group).size()
    elif devices is not None and not isinstance(devices, (str, torch.device, int)):
        devices = list(devices)
        worker_count = len(devices)
    elif isinstance(placement, str):
        raise ValueError(
            f"placement {placement!r} needs devices (one per worker) or group (placement: "
            f"{placement!r}, devices: {devices!r})"
        )
    else:
        worker_count = None
    return place_partitions(placement, partitions, worker_count)


def _check_one_device(devices: Sequence[torch.device], rank: int, placement: object) -> None:
    """A rank's partitions under ``placement`` share its worker thread, and the messages
    between them stay in that thread without a device copy: one device for all."""
    if len(set(devices)) > 1:
        raise ValueError(
            "with placement, the partitions of a rank run on its one worker and must share "
            f"one device (placement: {placement!r}, rank: {rank}, devices of its partitions: "
            f"{[str(device) for device in devices]})"
        )


def _rank_devices(devices: Iterable[Device] | None, local: Sequence[bool]) -> list[torch.device]:
    """The device of each partition of a pipeline across processes: ``devices`` (or the
    default) for this rank's partitions, ``meta`` for the others'."""
    count = sum(local)
    if devices is None:
        if torch.cuda.is_available():
            own = [torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))] * count
        else:
            own = [torch.device("cpu")] * count
    else:
        own = resolve_devices(devices, count)
    mine = iter(own)
    return [next(mine) if here else torch.device("meta") for here in local]
