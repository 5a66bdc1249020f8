"""What the ranks of a pipeline across processes must agree on, and how they find out.

A pipeline across processes is built and run by every rank of its group alike. A rank set
up differently (another ``balance``, another ``chunks``, a model in eval mode where the
others train) would otherwise train silently wrong, or wait for a message that never comes.
So the ranks compare:

- **when the pipeline is built** (:class:`Construction`): the layers (their names, types and
  parameter shapes), ``balance``, ``chunks``, ``checkpoint``, ``deferred_batch_norm``,
  which rank runs which partition, and the types of this rank's devices. The values go
  through the process group's store, which needs no collective call, so a rank whose
  constructor fails tells the others (they raise :class:`~gpipe_core.RemotePartitionError`
  naming it) instead of leaving them waiting in a collective it never joins;
- **at every run** (:func:`run_fields`): the method (``step`` or ``forward``), ``chunks``,
  the schedule, training and grad mode, autocast (the device types it is on for, and its
  dtype) and the reduction. They travel inside the run's
  plan, which the first partition's rank sends every other rank anyway; a rank whose own
  values differ fails the run and tells every rank its values.

Either way every rank raises the same :class:`ValueError`, which names the first field that
differs and each rank's value: ``balance differs across ranks (rank 0: [2, 3], rank 1:
[3, 2])``.

This module knows nothing of the transport's messages or of the module it describes
beyond its layers.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gpipe_microbatch import ThreadState

from .._errors import Failure, describe_error
from ._transport import Fields

__all__ = [
    "Construction",
    "Differs",
    "Fields",
    "RanksDisagree",
    "autocast_field",
    "compare",
    "disagreement",
    "layer_fields",
    "run_fields",
]


class RanksDisagree(ValueError):
    """The ranks of a pipeline across processes were set up differently.

    Attributes:
        field: the first field that differs.
        values: each rank's value of it.
    """

    def __init__(self, field: str, values: Mapping[int, object]) -> None:
        by_value: dict[str, list[int]] = {}
        for rank in sorted(values):
            by_value.setdefault(_shown(values[rank]), []).append(rank)
        shown = ", ".join(
            f"rank {ranks[0]}: {value}"
            if len(ranks) == 1
            else f"ranks {', '.join(map(str, ranks))}: {value}"
            for value, ranks in sorted(by_value.items(), key=lambda item: item[1][0])
        )
        super().__init__(f"{field} differs across ranks ({shown})")
        self.field = field
        self.values = dict(values)


def _shown(value: object) -> str:
    return value if isinstance(value, _Text) else repr(value)


class _Text(str):
    """A value shown as it is in an error (a description, not a Python value)."""

    __slots__ = ()


def compare(fields: Mapping[int, Fields]) -> RanksDisagree | None:
    """The error for the first field in which the ranks' ``fields`` differ, or None.

    The fields are compared in order while every rank names the same one there (the
    method called comes first, so ranks that call different methods are told so). From
    the first place where the ranks name different fields, or some lack one (another
    method's fields, or a newer version on one rank), the lists themselves differ.
    """
    lists = list(fields.values())
    for index in range(max((len(values) for values in lists), default=0)):
        names = {values[index][0] if index < len(values) else None for values in lists}
        if len(names) > 1:
            shown = {rank: _Text(", ".join(n for n, _ in each)) for rank, each in fields.items()}
            return RanksDisagree("the fields compared", shown)
        name = lists[0][index][0]
        values = {rank: values[index][1] for rank, values in fields.items()}
        if len({pickle.dumps(value) for value in values.values()}) > 1:
            return RanksDisagree(name, values)
    return None


def layer_fields(layers: nn.Sequential) -> Fields:
    """The number of layers and, for each, its name, type and parameters' shapes."""
    described: list[tuple[str, Any]] = [("the number of layers", len(layers))]
    slots = cast(dict[str, nn.Module | None], layers._modules)  # None: an empty slot
    for index, (name, layer) in enumerate(slots.items()):
        if layer is None:
            text = f"{name!r}: None"
        else:
            tensors = [
                f"{key} {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
                for key, tensor in (*layer.named_parameters(), *layer.named_buffers())
            ]
            text = f"{name!r}: {type(layer).__qualname__}({', '.join(tensors)})"
        described.append((f"layer {index}", _Text(text)))
    return tuple(described)


def run_fields(
    method: str,
    *,
    chunks: int,
    schedule: object = None,
    reduction: str | None = None,
    training: bool,
) -> Fields:
    """What the ranks must agree on for one run (``None`` where the method has no such
    argument): with the module's ``chunks`` and ``training`` mode, the calling thread's grad
    mode and autocast."""
    if schedule is not None and not isinstance(schedule, str):
        schedule = _Text(f"{type(schedule).__module__}.{type(schedule).__qualname__}")
    return (
        ("the method called", method),
        ("chunks", chunks),
        ("schedule", schedule),
        ("training mode", training),
        ("grad mode", torch.is_grad_enabled()),
        ("autocast", autocast_field()),
        ("reduction", reduction),
    )


def autocast_field() -> str:
    """The calling thread's autocast, as the ranks compare it: each device type it is on
    for, with its dtype (``cpu bfloat16``, ``cpu bfloat16 and cuda float16``), or ``off``."""
    on = [
        f"{device_type} {str(dtype).removeprefix('torch.')}"
        for device_type, enabled, dtype in ThreadState.capture().autocast
        if enabled
    ]
    return _Text(" and ".join(on) if on else "off")


class Differs(ValueError):
    """This rank's run fields differ from the first partition's rank's: the run fails on every
    rank, which then raise the same :class:`RanksDisagree` (see :func:`disagreement`)."""


def disagreement(
    fields: Mapping[int, Fields | None], first: int, first_fields: Fields | None
) -> RanksDisagree | None:
    """The error every rank raises when a rank found that its run fields differ from the
    plan's (None when none differ): it names every rank's value, from the ``fields`` each
    sent with its last message of the run (ranks that failed before they had their fields
    aside), and the ``first_fields`` the first partition's rank ``first`` sent with the
    plan."""
    known = {rank: values for rank, values in sorted(fields.items()) if values}
    if first_fields is not None:
        known.setdefault(first, first_fields)
    return compare(known)


class Construction:
    """The agreement of the ranks on a pipeline being built, in two steps.

    ``checked``: every rank has checked its arguments and compares what it would build,
    before anything is changed. ``built``: every rank has built its partitions. A rank
    whose constructor fails in either step says so (:meth:`failed`), and the others raise
    :class:`~gpipe_core.RemotePartitionError` naming it, rather than waiting for it.

    The values travel through the process group's store (keys under ``gpipe/``, one per
    rank and step of each pipeline ``tag``), which needs no collective call.
    """

    STEPS = ("checked", "built")

    def __init__(self, group: dist.ProcessGroup, tag: int) -> None:
        self.group = group
        self.tag = tag
        self.ranks = "-".join(map(str, dist.get_process_group_ranks(group)))
        #: The step this rank has not yet published (None once every step is).
        self.step: str | None = self.STEPS[0]

    def _key(self, step: str, rank: int) -> str:
        return f"gpipe/{self.ranks}/{self.tag}/{step}/{rank}"

    def _publish(self, value: object) -> str:
        step = self.step
        assert step is not None
        index = self.STEPS.index(step)
        self.step = self.STEPS[index + 1] if index + 1 < len(self.STEPS) else None
        store = dist.distributed_c10d._get_default_store()
        data = pickle.dumps(value)
        store.set(self._key(step, self.group.rank()), data)  # type: ignore[arg-type]
        return step

    def failed(self, error: BaseException) -> None:
        """Tell the other ranks that this rank's constructor raised ``error`` (unless
        this rank already published its step: then the others learn from that)."""
        if self.step is not None:
            self._publish(
                Failure(self.group.rank(), "building the pipeline", describe_error(error))
            )
            self.step = None

    def agree(self, mine: Fields, timeout: float | None) -> None:
        """Publish this rank's ``mine`` for the current step, and compare it with every
        other rank's.

        Raises:
            RanksDisagree: the ranks' fields differ (on every rank alike).
            RemotePartitionError: another rank failed (naming the first such rank).
            TimeoutError: a rank did not come within ``timeout`` seconds (None: no bound).
        """
        step = self._publish(mine)
        me, size = self.group.rank(), self.group.size()
        if size == 1:
            return
        store = dist.distributed_c10d._get_default_store()
        others = [self._key(step, rank) for rank in range(size) if rank != me]
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while not store.check(others):
            if deadline is not None and time.monotonic() >= deadline:
                missing = [
                    rank
                    for rank in range(size)
                    if rank != me and not store.check([self._key(step, rank)])
                ]
                raise TimeoutError(
                    f"rank {me} waited {timeout:g} s for ranks {missing} to build the "
                    "pipeline; building a pipeline across processes is collective: every "
                    "rank of the group builds it, in the same order"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        fields: dict[int, Fields] = {}
        for rank in range(size):
            value = mine if rank == me else pickle.loads(store.get(self._key(step, rank)))
            if isinstance(value, Failure):
                raise value.error()
            fields[rank] = value
        disagreement = compare(fields)
        if disagreement is not None:
            raise disagreement
