"""Partitions in several processes: the transport on ``torch.distributed``.

With ``GPipe(..., group=group)``, partition ``s`` runs on rank ``s % group.size()`` of the
process group, and :class:`DistributedTransport` carries the messages between partitions of
different ranks with point-to-point sends of ``torch.distributed`` on gloo (on a gloo
group of the same ranks when the group uses another backend: see :func:`gloo_group`).

**Channels.** Between two ranks, every message of a run starts with a header (what the
message is, its tensors' dtypes and shapes), followed in the same piece by its tensors when
they fit, in one ordered channel (the pipeline's tag); if they do not fit, the rest of the
metadata and one payload (the tensor itself, or the tensors packed into one buffer) follow
in a second channel (the next tag). A receiver thread per peer reads the headers in order
and files each message under its key (:class:`MessageKey`); a partition waits for its key in
that mailbox. So the order in which partitions send never has to match the order in which
others receive, shapes may change from one run to the next, and every wait is a wait on a
condition that a timeout, a cancellation or a failure ends.

**Buffers ahead.** gloo moves a message only once its receive is posted (the receiver
tells the sender it is ready): a receive posted when the previous message is done costs a
round trip between the processes per message, however many are queued. So each receiver
thread keeps :data:`HEADERS_AHEAD` receives posted while a run lasts, and a burst of
messages streams; only a payload that did not fit waits for its header. gloo accepts a
message shorter than the buffer posted for it, and the buffers grow with the messages
(:class:`_Capacity`, up to :data:`INLINE_LIMIT`): once a message of some size has passed,
the next ones of that size (the activations and gradients of the following micro-batches)
travel in one piece, with no round trip.

**A run** is bracketed on every rank by :meth:`DistributedTransport.begin` and
:meth:`DistributedTransport.finish`. The last message of a run from each rank to each
other rank says the run is finished there, and whether it went well (it carries the
losses, from the last partition's rank). A rank whose action raises tells every other rank at
once (a ``failed`` message), which cancels their waits; every rank then finishes the run,
and raises: the failing rank its own error, the others a :class:`RemoteStageError` naming
the failing rank and its action. A rank that dies closes its connections:
the others fail at once with an error naming it, and refuse later runs. Between runs the
header receives posted ahead stay posted, but nothing waits on them, so an idle pipeline
never runs into the process group's timeout.

It must not know the layers, the schedules or GPipe: it carries messages under their keys
and the run's lifecycle across ranks, for the ranks and tags the placement gives it.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._agreement import Fields, RanksDisagree, compare
from ._errors import add_note, describe_error
from ._schedule import Action
from ._transport import (
    Cancelled,
    Message,
    MessageKey,
    RunLock,
    Transport,
    carried,
    outgoing,
)

__all__ = [
    "DistributedTransport",
    "RemoteStageError",
    "check_group",
    "gloo_group",
    "lower_group",
    "pipeline_tag",
]

#: Bytes of the smallest buffer a receiver posts for a message: the header (the length and
#: layout, the pickled metadata) and, when they fit, the tensors.
HEADER_BYTES = 4096
#: The largest buffer a receiver posts for a message (see :class:`_Capacity`).
INLINE_LIMIT = 1 << 20
_PREFIX = 8  # the metadata's length (4 bytes, little-endian), the layout, 3 bytes of padding
#: How a message's tensors travel: none, in the header, as one payload of the tensor
#: itself, or packed into one payload (the header's fifth byte).
_LAYOUTS = ("none", "inline", "single", "packed")
_ALIGN = 16
#: Header receives each receiver thread keeps posted during a run (see "Headers ahead").
HEADERS_AHEAD = 8
#: The first point-to-point tag gpipe uses; each pipeline on a group takes the next two
#: (headers, then payloads).
TAG_BASE = 0x47500000

_Meta = tuple[Any, ...]


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


class RemoteStageError(RuntimeError):
    """Another rank of the pipeline failed: raised on every rank but the failing one.

    Attributes:
        rank: the failing rank (in the pipeline's group).
        where: what it was doing (``'backward of micro-batch 2 on partition 1'``).
        remote_traceback: the failing rank's traceback, as text.
    """

    def __init__(self, rank: int, where: str, summary: str, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} of the pipeline failed in {where}: {summary}")
        self.rank = rank
        self.where = where
        self.remote_traceback = remote_traceback
        if remote_traceback:
            add_note(self, f"The traceback on rank {rank}:\n{remote_traceback.rstrip()}")


@dataclass
class _RemoteFailure:
    rank: int
    where: str
    summary: str
    text: str
    #: Whether it failed because its run fields differ from the plan's (every rank then
    #: compares the fields that each sent with its last message of the run).
    disagrees: bool = False

    def error(self) -> RemoteStageError:
        return RemoteStageError(self.rank, self.where, self.summary, self.text)


class _Differs(ValueError):
    """This rank's run fields differ from the first partition's rank's: the run fails on every
    rank, which then raise the same :class:`~gpipe_core._agreement.RanksDisagree`."""


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _bytes(tensor: Tensor) -> Tensor:
    """``tensor``'s data as a flat uint8 tensor (a view of a contiguous CPU copy)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


_Specs = Sequence[tuple[torch.dtype, tuple[int, ...]]]


def _offsets(start: int, sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where chunks of ``sizes`` bytes go in a buffer from ``start`` on (each aligned),
    and where the last one ends."""
    offsets = []
    end = start
    for size in sizes:
        end = _aligned(end)
        offsets.append(end)
        end += size
    return offsets, end


def _nbytes(specs: _Specs) -> list[int]:
    return [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs]


def _pack(buffer: Tensor, offsets: Sequence[int], chunks: Sequence[Tensor]) -> None:
    """Copy ``chunks`` (flat uint8 tensors) into ``buffer`` at ``offsets``."""
    for offset, chunk in zip(offsets, chunks, strict=True):
        buffer[offset : offset + len(chunk)].copy_(chunk)


def _unpack(buffer: Tensor, start: int, specs: _Specs) -> list[Tensor]:
    """Tensors of ``specs``, views of ``buffer`` placed from ``start`` on."""
    sizes = _nbytes(specs)
    offsets, _ = _offsets(start, sizes)
    return [
        buffer[offset : offset + size].view(dtype).view(shape)
        for offset, size, (dtype, shape) in zip(offsets, sizes, specs, strict=True)
    ]


def _whole(length: int, sizes: Sequence[int]) -> int:
    """The bytes of a message in one piece: the header with ``length`` bytes of metadata,
    then tensors of ``sizes`` bytes, each aligned."""
    return _offsets(_PREFIX + length, sizes)[1]


class _Capacity:
    """The size of the buffer posted for each message that one rank sends another, which
    the two ends work out alike from the messages before it.

    The receiver posts the buffer of message ``k`` once it has read message
    ``k - HEADERS_AHEAD``: the smallest power of two from :data:`HEADER_BYTES` that holds
    each of the messages up to that one whole (one larger than :data:`INLINE_LIMIT` does not
    count). The sender counts the same messages (all it sent but its last
    ``HEADERS_AHEAD - 1``), so it knows the size of the buffer each message lands in, and
    sends the message in one piece when it fits.

    Args:
        lag: how many of the latest messages counted do not count yet: the sender's
            ``HEADERS_AHEAD - 1``, the receiver's 0.
    """

    __slots__ = ("lag", "largest", "recent", "size")

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.recent: deque[int] = deque()
        self.largest = 0
        #: The size of the next buffer.
        self.size = HEADER_BYTES

    def count(self, whole: int) -> None:
        """Count a message of ``whole`` bytes in one piece."""
        self.recent.append(whole if whole <= INLINE_LIMIT else 0)
        while len(self.recent) > self.lag:
            self.largest = max(self.largest, self.recent.popleft())
        while self.size < self.largest:
            self.size *= 2


def _message(encoded: bytes, data: Sequence[Tensor], capacity: int) -> list[Tensor]:
    """The parts of a message, to be received into a buffer of ``capacity`` bytes: the
    message in one piece when it fits; else its header (with the metadata ``encoded`` if it
    fits), the metadata if not, then the tensors ``data`` (flat uint8) as one payload: the
    tensor itself, or the tensors packed."""
    sizes = [len(chunk) for chunk in data]
    fits = _PREFIX + len(encoded) <= capacity  # the metadata, in the header
    start = _PREFIX + len(encoded) if fits else _PREFIX
    offsets, end = _offsets(start, sizes)
    if not data:
        layout = "none"
    elif fits and end <= capacity:
        layout = "inline"
    elif len(data) == 1:
        layout = "single"
    else:
        layout = "packed"
    raw = bytearray(end if layout == "inline" else start)
    raw[0:4] = len(encoded).to_bytes(4, "little")
    raw[4] = _LAYOUTS.index(layout)
    header = torch.frombuffer(raw, dtype=torch.uint8)
    parts = [header]
    if fits:
        raw[_PREFIX:start] = encoded
    else:
        parts.append(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    if layout == "inline":
        _pack(header, offsets, data)
    elif layout == "single":
        parts.append(data[0])
    elif layout == "packed":
        offsets, total = _offsets(0, sizes)
        packed = torch.empty(total, dtype=torch.uint8)
        _pack(packed, offsets, data)
        parts.append(packed)
    return parts


class DistributedTransport(Transport):
    """Messages between partitions on the ranks of a gloo process group.

    Args:
        group: the pipeline's process group.
        partition_ranks: the rank (in ``group``) of each partition.
        devices: the device of each partition of this rank (others: unused).
        timeout: seconds any wait may last before it fails with an error that says who
            waits for what (None: no bound).
        tag: the point-to-point tag of this pipeline's headers (``tag + 1``: its
            payloads).
        to_lower: a second process group of ``group``'s ranks (see :func:`lower_group`):
            messages to a higher rank go on ``group``, to a lower one on this, so that
            each connection carries one direction (default: ``group`` for both).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        partition_ranks: Sequence[int],
        devices: Sequence[torch.device],
        *,
        timeout: float | None,
        tag: int,
        to_lower: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        # Each peer's group and its rank there, for messages to it and from it.
        other = group if to_lower is None else to_lower
        self.to_peer = {
            peer: (group, peer) if peer > group.rank() else _peer_in(other, group, peer)
            for peer in range(group.size())
        }
        self.from_peer = {
            peer: (group, peer) if peer < group.rank() else _peer_in(other, group, peer)
            for peer in range(group.size())
        }
        self.rank = group.rank()
        self.partition_ranks = list(partition_ranks)
        self.devices = list(devices)
        self.timeout = timeout
        self.tag = tag
        self.peers = [rank for rank in range(group.size()) if rank != self.rank]
        self.cond = threading.Condition()
        self.run_lock = RunLock(wait=False)
        self.send_locks = {peer: threading.Lock() for peer in self.peers}
        self.threads: dict[int, threading.Thread] = {}
        # The state of the current run, under ``cond``.
        self.run = 0
        self.active = False
        self.cancelled = False
        self.told = False  # whether this rank has told the others of its failure
        self.mailbox: dict[MessageKey, Message] = {}
        self.plan: _Meta | None = None
        #: The run's fields on the first partition's rank (sent with the plan), on this rank,
        #: and on each peer (sent with its last message of the run).
        self.plan_fields: Fields | None = None
        self.fields: Fields | None = None
        self.peer_fields: dict[int, Fields | None] = {}
        #: When each peer was last heard from in this run (the run's start at first).
        self.heard = dict.fromkeys(self.peers, 0.0)
        self.failures: list[_RemoteFailure] = []
        self.finished: dict[int, Any] = {}  # peer -> its payload
        self.served = dict.fromkeys(self.peers, 0)  # the last run each receiver served
        self.dead: dict[int, str] = {}
        self.closed = False
        self.sends: list[tuple[int, dist.Work, Tensor]] = []
        self.sends_lock = threading.Lock()
        # Each peer's receives posted ahead, oldest first (its receiver thread's).
        self.headers: dict[int, deque[tuple[dist.Work, bytearray, Tensor]]] = {
            peer: deque() for peer in self.peers
        }
        # The sizes of the buffers posted for the messages to each peer, and from it.
        self.sent = {peer: _Capacity(HEADERS_AHEAD - 1) for peer in self.peers}
        self.received = {peer: _Capacity(0) for peer in self.peers}

    # -- a run ----------------------------------------------------------------------

    def begin(self) -> None:
        """Start a run: receive from every peer until it says the run is finished.

        Raises:
            RuntimeError: a peer died in an earlier run; another thread's run lasts, or
                the call comes from inside the run (see :class:`RunLock`).
        """
        self.run_lock.acquire()
        with self.cond:
            if self.dead:
                self.run_lock.release()
                peer, reason = next(iter(self.dead.items()))
                raise RuntimeError(
                    f"rank {peer} of the pipeline's group is gone ({reason}); the pipeline "
                    "cannot run without it: restart every rank"
                )
            self.run += 1
            self.active = True
            self.cancelled = self.told = False
            self.mailbox.clear()
            self.plan = self.plan_fields = self.fields = None
            self.peer_fields = {}
            self.failures = []
            self.finished = {}
            self.heard = dict.fromkeys(self.peers, time.monotonic())
            self.cond.notify_all()
        for peer in self.peers:
            if peer not in self.threads:
                thread = threading.Thread(
                    target=self._receive_loop,
                    args=(peer,),
                    name=f"gpipe-receive-from-{peer}",
                    daemon=True,
                )
                self.threads[peer] = thread
                thread.start()

    def finish(self, error: BaseException | None, payload: object = None) -> dict[int, Any]:
        """End the run on this rank and wait until every peer has ended it too.

        A run that went well waits up to the timeout for each peer. A run that failed
        waits for each peer until the timeout has passed since it was last heard from in
        this run: a peer silent that long is counted as gone, so that a failed step raises
        within the timeout of the wait that failed, not twice that.

        Args:
            error: what this rank raised in the run, if anything (the others are told,
                unless they were already).
            payload: what this rank gives every peer (the losses, from the last partition's
                rank).

        Returns:
            Each peer's payload.

        Raises:
            RanksDisagree: the ranks were called with different run fields (on every
                rank, whatever else failed).
            RemoteStageError: this rank raised nothing, and a peer failed.
            TimeoutError: a peer did not end the run within the timeout.
        """
        try:
            return self._finish(error, payload)
        finally:
            self.run_lock.release()

    def _finish(self, error: BaseException | None, payload: object) -> dict[int, Any]:
        if error is not None and not isinstance(error, Cancelled):
            self.tell(None, error)
        ok = error is None
        if callable(payload) and self.peers:
            payload = payload()
        for peer in self.peers:
            self._post_if_alive(peer, ("finished", ok, payload, self.fields))
        with self.cond:
            failed = not ok or self.cancelled
        deadlines = self._deadlines(failed)
        self._drain_sends(deadlines)
        with self.cond:
            while True:
                waiting = [p for p in self.peers if p not in self.finished and p not in self.dead]
                if not waiting:
                    break
                now = time.monotonic()
                late = [p for p in waiting if (d := deadlines[p]) is not None and d <= now]
                if late:
                    self.active = False
                    self.dead.update(
                        (p, f"it did not finish run {self.run} within {self.timeout:g} s")
                        for p in late
                    )
                    self.cond.notify_all()
                    if failed:
                        continue  # the run raises its own error; these ranks are gone
                    raise TimeoutError(
                        f"rank {self.rank} waited {self.timeout:g} s for ranks {late} to "
                        "finish the run; is every rank calling the same method with the "
                        "same arguments?"
                    )
                bounds = [d - now for p in waiting if (d := deadlines[p]) is not None]
                self.cond.wait(min(bounds) if bounds else None)
            self.active = False
            self.mailbox.clear()
            failures = sorted(self.failures, key=lambda failure: failure.rank)
            payloads = dict(self.finished)
            fields = {self.rank: self.fields, **self.peer_fields}
        disagreement = self._disagreement(error, failures, fields)
        if disagreement is not None:
            raise disagreement
        if error is None and failures:
            raise failures[0].error()
        return payloads

    def _deadlines(self, failed: bool) -> dict[int, float | None]:
        """When the end of the run stops waiting for each peer (None: never)."""
        if self.timeout is None:
            return dict.fromkeys(self.peers, None)
        if not failed:
            return dict.fromkeys(self.peers, time.monotonic() + self.timeout)
        with self.cond:
            return {peer: self.heard[peer] + self.timeout for peer in self.peers}

    def _disagreement(
        self,
        error: BaseException | None,
        failures: Sequence[_RemoteFailure],
        fields: dict[int, Fields | None],
    ) -> RanksDisagree | None:
        """The error every rank raises when a rank found that its run fields differ from
        the plan's (None when none did): it names every rank's value, from the fields each
        sent with its last message of the run (ranks that failed before they had their
        fields aside)."""
        if not isinstance(error, _Differs) and not any(f.disagrees for f in failures):
            return None
        known = {rank: values for rank, values in sorted(fields.items()) if values}
        if self.plan_fields is not None:
            known.setdefault(self.partition_ranks[0], self.plan_fields)
        return compare(known)

    def send_plan(self, plan: _Meta, fields: Fields) -> None:
        """Give every peer the run's plan (its micro-batches' sizes) and this rank's run
        fields, from the first partition's rank."""
        self.plan_fields = self.fields = fields
        for peer in self.peers:
            self._post(peer, ("plan", plan, fields), [])

    def receive_plan(self, fields: Fields) -> _Meta:
        """Wait for the run's plan from the first partition's rank, and check that this rank's
        run ``fields`` are the same as there.

        Raises:
            Cancelled: the run was cancelled (a peer failed) while waiting.
            ValueError: this rank's ``fields`` differ (the run then fails on every rank
                with the same :class:`~gpipe_core._agreement.RanksDisagree`).
        """
        with self.cond:
            self.fields = fields
            self._wait(
                lambda: self.plan is not None, "the plan of the run", self.partition_ranks[0]
            )
            assert self.plan is not None and self.plan_fields is not None
            plan, theirs = self.plan, self.plan_fields
        if theirs != fields:
            disagreement = compare({self.partition_ranks[0]: theirs, self.rank: fields})
            if disagreement is not None:
                raise _Differs(str(disagreement))
        return plan

    # -- the Transport interface ----------------------------------------------------

    def send(
        self,
        key: MessageKey,
        values: Sequence[object],
        *,
        atomic: bool = False,
        needs_grad: bool = False,
        kind: type[tuple[Any, ...]] = tuple,
    ) -> None:
        message = outgoing(values, atomic, needs_grad, detach=True, kind=kind)
        target = self.partition_ranks[key.target]
        if target == self.rank:
            with self.cond:
                self.mailbox[key] = message
                self.cond.notify_all()
            return
        if self.cancelled:
            return  # the run is over: nobody waits for it
        _check_strided(key, message.tensors.tensors)
        meta = ("data", key, atomic, message.present, message.requires_grad, message.others, kind)
        self._post(target, meta, message.tensors.tensors)

    def receive(self, key: MessageKey) -> Message:
        source = self.partition_ranks[key.source]
        with self.cond:
            self._wait(lambda: key in self.mailbox, _describe(key), source)
            message = self.mailbox.pop(key)
        device = self.devices[key.target]
        if device.type != "cpu" and len(message.tensors):
            moved = [tensor.to(device, non_blocking=True) for tensor in message.tensors]
            message = message._replace(tensors=carried(moved, message.atomic))
        return message

    def tell(self, action: tuple[int, Action] | None, error: BaseException) -> None:
        """Tell every peer that this rank failed (once per run), and cancel the run."""
        with self.cond:
            told, self.told = self.told, True
            self.cancelled = True
            self.cond.notify_all()
        if told:
            return
        if action is None:
            where = "its step, outside the pipeline's actions"
        else:
            j, act = action
            where = f"{act.kind} of micro-batch {act.microbatch} on partition {j}"
        summary = describe_error(error)
        try:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        except Exception:  # an exception that cannot be printed still travels
            text = "".join(traceback.format_tb(error.__traceback__)) + summary
        disagrees = isinstance(error, _Differs)
        for peer in self.peers:
            self._post_if_alive(peer, ("failed", where, summary, text, disagrees))

    def fail(self, partition: int, action: Action | None, error: BaseException) -> None:
        self.tell((partition, action) if action is not None else None, error)

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()

    def reset(self) -> None:
        with self.cond:
            self.mailbox.clear()

    def close(self) -> None:
        """Stop the receiver threads that wait for a run, and wait (a bounded time) until
        they have ended (idempotent).

        Joined here, so that they do not end while the interpreter shuts down: a thread
        that drops the last reference to the process group then would abort the process
        ("terminate called without an active exception"), as when a script's ``main()``
        drops the pipeline right before the interpreter exits. A thread in the middle of a
        receive (a run that never finished) is not waited for longer than a second.
        """
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        deadline = time.monotonic() + 1.0
        current = threading.current_thread()
        for thread in list(self.threads.values()):
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- waiting -------------------------------------------------------------------------

    def _wait(self, ready: Any, what: str, source: int) -> None:
        """Wait (holding ``cond``) until ``ready()``; ``what`` comes from rank ``source``."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not ready():
            if self.cancelled:
                raise Cancelled
            if source != self.rank and (source in self.finished or source in self.dead):
                gone = "died" if source in self.dead else "finished its run"
                raise RuntimeError(
                    f"rank {self.rank} waits for {what} from rank {source}, which {gone} "
                    "without sending it; is every rank calling the same method with the "
                    "same arguments?"
                )
            if deadline is None:
                self.cond.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"rank {self.rank} waited {self.timeout:g} s for {what} from rank {source}"
                )
            self.cond.wait(remaining)

    # -- the wire ------------------------------------------------------------------------

    def _post(self, peer: int, meta: _Meta, tensors: Sequence[Tensor]) -> None:
        """Send a message to ``peer``: in one piece when it fits the buffer posted for it,
        else its header, then what does not fit in it."""
        data = [_bytes(tensor) for tensor in tensors]
        specs = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
        encoded = pickle.dumps((self.run, meta, specs), protocol=pickle.HIGHEST_PROTOCOL)
        whole = _whole(len(encoded), [len(chunk) for chunk in data])
        works: list[dist.Work] = []
        with self.send_locks[peer]:  # the messages' order: the sizes of their buffers
            capacity = self.sent[peer]
            parts = _message(encoded, data, capacity.size)
            capacity.count(whole)
            for k, part in enumerate(parts):
                tag = self.tag if k == 0 else self.tag + 1  # the header, then the payload
                try:
                    carrier, there = self.to_peer[peer]
                    work = dist.isend(part, group=carrier, group_dst=there, tag=tag)
                except RuntimeError as error:  # the connection is closed
                    with self.cond:
                        self.dead.setdefault(peer, f"{type(error).__name__}: {error}")
                    raise RuntimeError(
                        f"rank {self.rank} cannot send to rank {peer}, which died or left the "
                        f"group ({error})"
                    ) from error
                assert work is not None  # this process is in the group
                works.append(work)
        with self.sends_lock:
            self.sends.extend((peer, work, part) for work, part in zip(works, parts, strict=True))

    def _post_if_alive(self, peer: int, meta: _Meta) -> None:
        """Send a message without tensors to ``peer`` unless it is gone (a dead peer is
        recorded, and its receiver thread here reports it)."""
        if peer in self.dead:
            return
        with contextlib.suppress(RuntimeError):
            self._post(peer, meta, [])

    def _drain_sends(self, deadlines: dict[int, float | None]) -> None:
        """Wait until this run's sends have been received, their peer is gone, or the
        peer's deadline has passed (then the peer counts as gone: gloo closes a
        connection whose wait timed out)."""
        with self.sends_lock:
            sends, self.sends = self.sends, []
        for peer, work, _ in sends:
            if peer in self.dead:
                continue
            deadline = deadlines[peer]
            try:
                if deadline is None:
                    work.wait()
                else:
                    remaining = max(deadline - time.monotonic(), 0.001)
                    work.wait(datetime.timedelta(seconds=remaining))
            except RuntimeError as error:
                with self.cond:
                    # The receiver thread may have said so already (the peer died).
                    self.dead.setdefault(peer, f"{type(error).__name__}: {error}")
                    self.cond.notify_all()

    def _receive_loop(self, peer: int) -> None:
        """Receive ``peer``'s messages, run after run, and file them."""
        while True:
            with self.cond:
                while not self.closed and not (self.active and self.run > self.served[peer]):
                    self.cond.wait()
                if self.closed:
                    return
                run = self.served[peer] = self.run
            try:
                while self._receive_one(peer, run):
                    pass
            except Exception as error:  # the connection is gone: the peer died or left
                with self.cond:
                    self.dead[peer] = f"{type(error).__name__}: {error}"
                    if self.active:
                        self.failures.append(
                            _RemoteFailure(
                                peer, "its run", f"the process died or left the group ({error})", ""
                            )
                        )
                        self.cancelled = True
                    self.cond.notify_all()
                return

    def _receive_one(self, peer: int, run: int) -> bool:
        """Receive one message from ``peer``; False once it said the run is finished."""
        raw, header = self._next_header(peer)
        length = int.from_bytes(raw[0:4], "little")
        layout = _LAYOUTS[raw[4]]
        if _PREFIX + length <= len(raw):
            encoded = bytes(raw[_PREFIX : _PREFIX + length])
        else:
            extra = bytearray(length)
            self._recv(torch.frombuffer(extra, dtype=torch.uint8), peer)
            encoded = bytes(extra)
        sent_run, meta, specs = pickle.loads(encoded)
        if sent_run != run:
            raise RuntimeError(f"rank {peer} sent a message of run {sent_run} during run {run}")
        sizes = _nbytes(specs)
        self.received[peer].count(_whole(length, sizes))
        tensors: list[Tensor] = []
        if layout == "inline":
            tensors = _unpack(header, _PREFIX + length, specs)
            if 2 * sum(sizes) < len(raw) and len(raw) > HEADER_BYTES:
                # Views would keep the whole buffer, grown for larger messages, alive.
                tensors = [tensor.clone() for tensor in tensors]
        elif layout == "single":
            dtype, shape = specs[0]
            tensor = torch.empty(shape, dtype=dtype)
            self._recv(tensor.reshape(-1).view(torch.uint8), peer)
            tensors = [tensor]
        elif layout == "packed":
            _, total = _offsets(0, sizes)
            packed = torch.empty(total, dtype=torch.uint8)
            self._recv(packed, peer)
            tensors = _unpack(packed, 0, specs)
        kind = meta[0]
        with self.cond:
            self.heard[peer] = time.monotonic()
            if kind == "finished":
                self.finished[peer], self.peer_fields[peer] = meta[2], meta[3]
                self.cond.notify_all()
                return False
            if kind == "failed":
                self.failures.append(_RemoteFailure(peer, *meta[1:]))
                self.cancelled = True
            elif kind == "plan":
                self.plan, self.plan_fields = meta[1], meta[2]
            elif not self.cancelled:
                _, key, atomic, present, requires_grad, others, kind = meta
                batch = carried(tensors, atomic)
                self.mailbox[key] = Message(atomic, present, requires_grad, batch, others, kind)
            self.cond.notify_all()
        return True

    def _next_header(self, peer: int) -> tuple[bytearray, Tensor]:
        """``peer``'s next message (or its header), with :data:`HEADERS_AHEAD` receives
        posted ahead of it (each into a buffer of its own, of the size
        :class:`_Capacity` agrees on: the tensors inline in a message are views of it)."""
        posted = self.headers[peer]
        while len(posted) < HEADERS_AHEAD:
            raw = bytearray(self.received[peer].size)
            header = torch.frombuffer(raw, dtype=torch.uint8)
            carrier, there = self.from_peer[peer]
            work = dist.irecv(header, group=carrier, group_src=there, tag=self.tag)
            assert work is not None  # None only for a process outside the group
            posted.append((work, raw, header))
        work, raw, header = posted[0]
        work.wait()
        posted.popleft()
        return raw, header

    def _recv(self, tensor: Tensor, peer: int) -> None:
        """Receive the next payload (or metadata that did not fit in its header)."""
        carrier, there = self.from_peer[peer]
        dist.recv(tensor, group=carrier, group_src=there, tag=self.tag + 1)


_GlooGroups = weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]
_gloo_groups: _GlooGroups = weakref.WeakKeyDictionary()
_lower_groups: _GlooGroups = weakref.WeakKeyDictionary()


def _gloo_copy(group: dist.ProcessGroup, made: _GlooGroups) -> dist.ProcessGroup:
    """A gloo group of ``group``'s ranks, kept in ``made``: the first pipeline on
    ``group`` makes it, on every rank of ``group`` together (only them), and the
    pipelines made after it on ``group`` share it."""
    copy = made.get(group)
    if copy is None:
        ranks = dist.get_process_group_ranks(group)
        new = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        assert isinstance(new, dist.ProcessGroup)  # this process is one of ranks
        copy = made[group] = new
    return copy


def gloo_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The gloo group that carries the messages of the pipelines on ``group``: ``group``
    itself when it uses gloo, else a gloo group of the same ranks (for a group of NCCL,
    or of ``init_process_group()`` without a backend, whose backend is ``'undefined'``).

    gpipe's messages start with headers in host memory and wait with timeouts, which
    gloo serves for any device (CUDA tensors through host memory).
    """
    if str(dist.get_backend(group)) == "gloo":
        return group
    return _gloo_copy(group, _gloo_groups)


def lower_group(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """A second gloo group of the ranks of ``group`` (a gloo group), for the messages to
    lower ranks (None for a group of one), made once per group (see :func:`_gloo_copy`).

    gloo's connection between two processes serves one message at a time in both
    directions: with the messages of one direction on a connection of their own, a
    send does not wait behind a receive (1F1B sends both ways at once).
    """
    if group.size() < 2:
        return None
    return _gloo_copy(group, _lower_groups)


def _peer_in(
    carrier: dist.ProcessGroup, group: dist.ProcessGroup, peer: int
) -> tuple[dist.ProcessGroup, int]:
    """``carrier`` (a group of the same ranks) and the rank there of ``group``'s rank
    ``peer``."""
    return carrier, dist.get_group_rank(carrier, dist.get_global_rank(group, peer))


def _check_strided(key: MessageKey, tensors: Sequence[Tensor]) -> None:
    """Refuse a message to another rank holding a tensor that is not dense (a sparse
    tensor, say), which travels as the bytes of its storage.

    Raises:
        TypeError: such a tensor, named by the partition that sends it and its layout.
    """
    for k, tensor in enumerate(tensors):
        if tensor.layout != torch.strided:
            raise TypeError(
                f"{_describe(key)} hold a tensor of layout {tensor.layout}, which cannot be "
                "sent to another rank (only dense, torch.strided tensors cross ranks); make "
                "it dense (.to_dense()) at the end of the partition "
                f"(tensor {k} of the message: layout {tensor.layout}, shape {tuple(tensor.shape)})"
            )


def _describe(key: MessageKey) -> str:
    what = {
        "activations": "the activations",
        "gradients": "the gradients",
        "skips": "the skips",
        "skip-gradients": "the skips' gradients",
    }[key.kind]
    return (
        f"{what} of micro-batch {key.microbatch} from partition {key.source} to partition "
        f"{key.target}"
    )
