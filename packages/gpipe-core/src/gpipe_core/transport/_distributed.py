"""Partitions in several processes: the transport on ``torch.distributed``.

With ``GPipe(..., group=group)``, partition ``s`` runs on rank ``s % group.size()`` of the
process group, and :class:`DistributedTransport` carries the messages between partitions of
different ranks with point-to-point sends on gloo groups of the group's ranks that the
pipeline makes for itself (see :mod:`gpipe_core.transport._groups`), whatever the group's backend.

**Channels.** Between two ranks, every message of a run starts with a header (what the
message is, its tensors' dtypes and shapes), followed in the same piece by its tensors when
they fit, in one ordered channel (the pipeline's tag); if they do not fit, the rest of the
metadata and one payload (the tensor itself, or the tensors packed into one buffer) follow
in a second channel (the next tag). On the strict payload channel (see
:mod:`gpipe_core.transport._payloads`: on gloo when asked, or on NCCL), the header never carries
them: each tensor follows as a payload of its exact size. A receiver thread per peer reads
the headers in order and files each message under its key (:class:`MessageKey`); a
partition waits for its key in that mailbox. So the order in which partitions send never
has to match the order in which others receive, shapes may change from one run to the
next, and every wait is a wait on a condition that a timeout, a cancellation or a failure
ends.

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
import pickle
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._errors import add_note, describe_error
from ..schedule._action import Action
from ._agreement import Fields, RanksDisagree, compare
from ._groups import Connections
from ._payloads import Payloads, strict_requested
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
    "pipeline_tag",
]

#: Bytes of the smallest buffer a receiver posts for a message: the header (the length and
#: layout, the pickled metadata) and, when they fit, the tensors.
HEADER_BYTES = 4096
#: The largest buffer a receiver posts for a message (see :class:`_Capacity`).
INLINE_LIMIT = 1 << 20
_PREFIX = 8  # the metadata's length (4 bytes, little-endian), the layout, 3 bytes of padding
#: How a message's tensors travel: none, in the header, as one payload of the tensor
#: itself, packed into one payload, or one payload per tensor on the strict payload channel
#: (see :mod:`gpipe_core.transport._payloads`) (the header's fifth byte).
_LAYOUTS = ("none", "inline", "single", "packed", "channel")
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
    rank, which then raise the same :class:`~gpipe_core.transport._agreement.RanksDisagree`."""


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

    def counted(self, whole: int) -> _Capacity:
        """A copy, with a message of ``whole`` bytes counted."""
        copy = _Capacity(self.lag)
        copy.recent, copy.largest, copy.size = deque(self.recent), self.largest, self.size
        copy.count(whole)
        return copy

    def count(self, whole: int) -> None:
        """Count a message of ``whole`` bytes in one piece."""
        self.recent.append(whole if whole <= INLINE_LIMIT else 0)
        while len(self.recent) > self.lag:
            self.largest = max(self.largest, self.recent.popleft())
        while self.size < self.largest:
            self.size *= 2


def _message(
    encoded: bytes, data: Sequence[Tensor], capacity: int, *, channel: bool = False
) -> list[Tensor]:
    """The parts of a message, to be received into a buffer of ``capacity`` bytes: the
    message in one piece when it fits; else its header (with the metadata ``encoded`` if it
    fits), the metadata if not, then the tensors ``data`` (flat uint8) as one payload: the
    tensor itself, or the tensors packed. With ``channel``, the message's tensors travel
    on the strict payload channel (``data`` is empty): the header says so."""
    sizes = [len(chunk) for chunk in data]
    fits = _PREFIX + len(encoded) <= capacity  # the metadata, in the header
    start = _PREFIX + len(encoded) if fits else _PREFIX
    offsets, end = _offsets(start, sizes)
    if channel:
        layout = "channel"
    elif not data:
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
    """Messages between partitions on the ranks of a pipeline's group.

    Args:
        connections: the pipeline's gloo groups (see :func:`~gpipe_core.transport._groups.connect`):
            messages to a higher rank go on the first, to a lower one on the second, so
            that each connection carries one direction (gloo's connection between two
            processes serves one message at a time in both directions: 1F1B sends both
            ways at once). A rank's rank there is its rank in the pipeline's group.
        rank: this process's rank in the pipeline's group.
        partition_ranks: the rank (in the group) of each partition.
        devices: the device of each partition of this rank (others: unused).
        timeout: seconds any wait may last before it fails with an error that says who
            waits for what (None: no bound).
        tag: the point-to-point tag of this pipeline's headers (``tag + 1``: its
            payloads).
        payloads: the channel of the messages' tensors (see :mod:`gpipe_core.transport._payloads`;
            default: strict on ``connections`` where ``GPIPE_STRICT_PAYLOADS=1``, else
            tagged).
    """

    def __init__(
        self,
        connections: Connections,
        rank: int,
        partition_ranks: Sequence[int],
        devices: Sequence[torch.device],
        *,
        timeout: float | None,
        tag: int,
        payloads: Payloads | None = None,
    ) -> None:
        higher, lower = connections
        size = higher.size()
        # The group of the messages to each peer, and of those from it.
        self.to_peer = {peer: higher if peer > rank else lower for peer in range(size)}
        self.from_peer = {peer: higher if peer < rank else lower for peer in range(size)}
        self.rank = rank
        self.partition_ranks = list(partition_ranks)
        self.devices = list(devices)
        self.timeout = timeout
        self.tag = tag
        if payloads is None:
            mode = "strict" if strict_requested() else "tagged"
            payloads = Payloads(mode, self.to_peer, self.from_peer, tag + 1)
        self.payloads = payloads
        self.peers = [peer for peer in range(size) if peer != rank]
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
        self.unfinished: set[int] = set()  # the peers that ended the run failed or cancelled
        #: The peers this rank told that it ended the run, and what it told them.
        self.ended: set[int] = set()
        self.ending: _Meta | None = None
        #: The tensors each peer gave this rank in the run's exchanges, in order.
        self.exchanged: dict[int, deque[tuple[str, list[Tensor]]]] = {
            peer: deque() for peer in self.peers
        }
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

        An exception that interrupts it (``KeyboardInterrupt``) leaves no run begun, or
        ends the one begun as failed, on every rank.

        Raises:
            RuntimeError: a peer is gone (it died, or did not end an earlier run within
                the timeout); another thread's run lasts, or the call comes from inside
                the run (see :class:`RunLock`).
        """
        self.run_lock.acquire()
        begun = False
        try:
            self._start_receivers()  # before the run: an interrupt here begins nothing
            with self.cond:
                if self.dead:
                    peer, reason = next(iter(self.dead.items()))
                    raise RuntimeError(
                        f"rank {peer} of the pipeline's group is gone ({reason}); this "
                        "pipeline cannot run without it: build it again on every rank, or "
                        "restart every rank if a process died"
                    )
                self.cancelled = self.told = False
                self.mailbox.clear()
                self.plan = self.plan_fields = self.fields = None
                self.peer_fields = {}
                self.failures = []
                self.finished = {}
                self.unfinished = set()
                self.ended = set()
                self.ending = None
                self.exchanged = {peer: deque() for peer in self.peers}
                self.heard = dict.fromkeys(self.peers, time.monotonic())
                self.run += 1
                self.active = begun = True
                self.cond.notify_all()
        except BaseException as error:
            try:
                if begun:
                    self._abandon(error)
            finally:
                self.run_lock.release()
            raise

    def _start_receivers(self) -> None:
        """Start the receiver thread of each peer not started yet (once: one thread
        reads a peer's messages, run after run)."""
        for peer in self.peers:
            thread = self.threads.get(peer)
            if thread is None:
                thread = self.threads[peer] = threading.Thread(
                    target=self._receive_loop,
                    args=(peer,),
                    name=f"gpipe-receive-from-{peer}",
                    daemon=True,
                )
            if thread.ident is None:
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
        except BaseException as interrupt:
            # Interrupted while ending the run (KeyboardInterrupt): end it anyway, so that
            # the other ranks do not wait for this one and the next run starts alike.
            self._abandon(interrupt)
            raise
        finally:
            self.run_lock.release()

    def _abandon(self, error: BaseException) -> None:
        """End the run here without waiting for the peers (idempotent): tell those that
        have not heard of its end that it ended, as the others heard (if this rank began
        telling them: every peer then hears the same), else that it failed. The peers'
        messages of this run that still come are dropped (see :meth:`_receive_one`)."""
        with self.cond:
            if not self.active:
                return
        ending = self.ending
        if ending is None:
            self.tell(None, error)
            ending = ("finished", False, None, self.fields)
        for peer in self.peers:
            if peer not in self.ended:
                self.ended.add(peer)
                self._post_if_alive(peer, ending)
        with self.cond:
            self.active = False
            self.mailbox.clear()
            self.cond.notify_all()

    def _finish(self, error: BaseException | None, payload: object) -> dict[int, Any]:
        if error is not None and not isinstance(error, Cancelled):
            self.tell(None, error)
        with self.cond:  # a run cancelled here did not end well either: the peers see it
            ok = error is None and not self.cancelled
        if callable(payload) and self.peers:
            payload = payload()
        self.ending = ending = ("finished", ok, payload, self.fields)
        for peer in self.peers:
            self.ended.add(peer)
            self._post_if_alive(peer, ending)
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
                with the same :class:`~gpipe_core.transport._agreement.RanksDisagree`).
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

    def exchange(
        self,
        tensors: Sequence[Tensor],
        send_to: Sequence[int],
        receive_from: Sequence[int],
        what: str,
    ) -> dict[int, list[Tensor]]:
        """Within a run, send ``tensors`` to the ranks ``send_to`` and receive what the
        ranks ``receive_from`` send this rank in the same exchange (on the CPU): the
        exchanges between two ranks pair up in the order they make them, and ``what``
        (the same on both) names it in errors. The waits are the run's: bounded by the
        timeout, ended by a failure on any rank.

        Raises:
            Cancelled: the run was cancelled (a peer failed) while waiting.
            RuntimeError: a peer ended its run without this exchange, or made another
                one (``what`` differs).
        """
        for peer in send_to:
            if peer != self.rank:
                self._post(peer, ("exchange", what), tensors)
        received: dict[int, list[Tensor]] = {}
        with self.cond:
            for peer in receive_from:
                if peer == self.rank:
                    continue
                queue = self.exchanged[peer]
                self._wait(queue.__len__, what, peer)
                theirs, values = queue.popleft()
                if theirs != what:
                    raise RuntimeError(
                        f"rank {self.rank} waits for {what} from rank {peer}, which sent "
                        f"{theirs}; is every rank calling the same method with the same "
                        "arguments?"
                    )
                received[peer] = values
        return received

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
            if device.type == "cuda" and self.payloads.mode == "nccl":
                # Received on the channel's stream, used on this one from now on.
                stream = torch.cuda.current_stream(device)
                for tensor in moved:
                    if tensor.device == device:
                        tensor.record_stream(stream)
            message = message._replace(tensors=carried(moved, message.atomic))
        return message

    def pending(self) -> dict[str, int]:
        """The point-to-point operations of this transport not done yet: ``sends`` (this
        run's, until :meth:`finish` waits for them) and payload ``receives`` posted.
        Both are 0 once a run ended on every rank, whether it went well or not."""
        with self.sends_lock:
            sends = sum(not work.is_completed() for _, work, _ in self.sends)
        return {"sends": sends, "receives": self.payloads.receiving}

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
            if peer not in self.ended:  # a peer told the run ended serves the next one
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
            if self.cancelled or source in self.unfinished:
                # The run failed (its error comes at its end, from the rank that failed).
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
        strict = self.payloads.strict
        # On the strict channel, the tensors travel apart from the header, on their device.
        data = [] if strict else [_bytes(tensor) for tensor in tensors]
        payloads = self.payloads.outgoing(tensors) if strict else []
        specs = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
        encoded = pickle.dumps((self.run, meta, specs), protocol=pickle.HIGHEST_PROTOCOL)
        whole = _whole(len(encoded), [len(chunk) for chunk in data])
        carrier = self.to_peer[peer]
        assert carrier is not None  # a peer: the group has two ranks or more
        with self.send_locks[peer]:  # the messages' order: the sizes of their buffers
            capacity = self.sent[peer]
            parts = _message(encoded, data, capacity.size, channel=strict and bool(tensors))
            counted = capacity.counted(whole)
            # The header on the pipeline's tag, what does not fit in it on the next one.
            tags = [self.tag] + [self.tag + 1] * (len(parts) - 1)
            # Each part sent, and recorded for the end of the run, by C calls only; on the
            # strict channel, the tensors' payloads right after (in the headers' order).
            sending: Iterable[tuple[int, dist.Work, Tensor]] = zip(
                repeat(peer), map(carrier.send, [[p] for p in parts], repeat(peer), tags), parts
            )
            if payloads:
                posting = self.payloads.sending(peer, payloads)
                sending = chain(sending, zip(repeat(peer), posting, payloads))
            expected = len(parts) + len(payloads)
            with self.sends_lock:
                start = len(self.sends)
                try:
                    # An interrupt (KeyboardInterrupt) lands between Python instructions: it
                    # finds the message counted and sent whole, or neither.
                    self.sent[peer] = counted
                    self.sends.extend(sending)
                    self.payloads.count_sent(peer, len(payloads))
                except RuntimeError as error:  # the connection is closed
                    with self.cond:
                        self.dead.setdefault(peer, f"{type(error).__name__}: {error}")
                    raise RuntimeError(
                        f"rank {self.rank} cannot send to rank {peer}, which died or left the "
                        f"group ({error})"
                    ) from error
                except BaseException:
                    sent = len(self.sends) - start
                    if sent != (expected if self.sent[peer] is counted else 0):
                        with self.cond:  # the peer cannot read what would follow
                            self.dead.setdefault(peer, "a message to it was interrupted half-sent")
                    raise

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
        sends.reverse()  # drained from the end: what is left is kept if interrupted
        try:
            while sends:
                peer, work, _ = sends[-1]
                if peer not in self.dead:
                    self._wait_sent(peer, work, deadlines[peer])
                sends.pop()
        finally:
            # Interrupted (KeyboardInterrupt): the next run waits for the sends not waited
            # for yet (a wait that returned counts the send's completion: gloo's next wait
            # on it would wait for another).
            left = [send for send in reversed(sends) if not send[1].is_completed()]
            if left:
                with self.sends_lock:
                    self.sends[:0] = left

    def _wait_sent(self, peer: int, work: dist.Work, deadline: float | None) -> None:
        """Wait until a send to ``peer`` has been received, or until ``deadline``."""
        try:
            self.payloads.wait_sent(work, deadline)
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
        self.received[peer].count(_whole(length, [] if layout == "channel" else sizes))
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
        elif layout == "channel":
            # Every payload a header announces is received, whatever the run's state here:
            # none stays posted on the peer (see "Failures" in _payloads).
            tensors = self.payloads.receive(peer, specs)
        kind = meta[0]
        with self.cond:
            if run != self.run or not self.active:
                # A run this rank ended without waiting for the peer (it was interrupted):
                # its messages are dropped, up to the one that ends it.
                return bool(kind != "finished")
            self.heard[peer] = time.monotonic()
            if kind == "finished":
                self.finished[peer], self.peer_fields[peer] = meta[2], meta[3]
                if not meta[1]:
                    self.unfinished.add(peer)
                self.cond.notify_all()
                return False
            if kind == "failed":
                self.failures.append(_RemoteFailure(peer, *meta[1:]))
                self.cancelled = True
            elif kind == "plan":
                self.plan, self.plan_fields = meta[1], meta[2]
            elif kind == "exchange":
                if not self.cancelled:  # the exchanges' tensors are on the CPU
                    self.exchanged[peer].append((meta[1], [t.cpu() for t in tensors]))
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
            carrier = self.from_peer[peer]
            assert carrier is not None  # a peer: the group has two ranks or more
            work = carrier.recv([header], peer, self.tag)
            posted.append((work, raw, header))
        work, raw, header = posted[0]
        work.wait()
        posted.popleft()
        return raw, header

    def _recv(self, tensor: Tensor, peer: int) -> None:
        """Receive the next payload (or metadata that did not fit in its header)."""
        carrier = self.from_peer[peer]
        assert carrier is not None  # a peer: the group has two ranks or more
        carrier.recv([tensor], peer, self.tag + 1).wait()


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
