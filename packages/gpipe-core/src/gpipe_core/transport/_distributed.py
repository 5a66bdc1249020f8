"""Partitions in several processes: the transport on ``torch.distributed``.

With ``GPipe(..., group=group)``, partition ``s`` runs on rank ``s % group.size()`` of the
process group, and :class:`DistributedTransport` carries the messages between partitions of
different ranks with point-to-point sends on gloo groups of the group's ranks that the
pipeline makes for itself (see :mod:`gpipe_core.transport._groups`), whatever the group's backend.

The messages travel as :mod:`gpipe_core.transport._wire` lays them out: a header per
message, in order, on the pipeline's tag, with receives posted ahead; a receiver thread
per peer files each message under its key (:class:`MessageKey`), where a partition waits
for it.

**A run** is bracketed on every rank by :meth:`DistributedTransport.begin` and
:meth:`DistributedTransport.finish`. The last message of a run from each rank to each
other rank says the run is finished there, and whether it went well (it carries the
losses, from the last partition's rank). A rank whose action raises tells every other rank at
once (a ``failed`` message), which cancels their waits; every rank then finishes the run,
and raises: the failing rank its own error, the others a :class:`~gpipe_core.RemotePartitionError`
naming the failing rank and its action. A rank that dies closes its connections:
the others fail at once with an error naming it, and refuse later runs. Between runs the
header receives posted ahead stay posted, but nothing waits on them, so an idle pipeline
never runs into the process group's timeout.

It must not know the layers, the schedules or GPipe: it carries messages under their keys
and the run's lifecycle across ranks, for the ranks and tags the placement gives it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._dtensor import settled
from .._errors import Failure
from . import _wire
from ._agreement import Differs, compare, disagreement
from ._groups import Connections
from ._links import Links
from ._payloads import Payloads, strict_requested
from ._transport import (
    Cancelled,
    Fields,
    Message,
    MessageKey,
    RunLock,
    Transport,
    carried,
)
from ._wire import Meta

__all__ = ["DistributedTransport"]


class DistributedTransport(Links, Transport):
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
        self.plan: Meta | None = None
        #: The run's fields on the first partition's rank (sent with the plan), on this rank,
        #: and on each peer (sent with its last message of the run).
        self.plan_fields: Fields | None = None
        self.fields: Fields | None = None
        self.peer_fields: dict[int, Fields | None] = {}
        #: When each peer was last heard from in this run (the run's start at first).
        self.heard = dict.fromkeys(self.peers, 0.0)
        self.failures: list[Failure] = []
        self.finished: dict[int, Any] = {}  # peer -> its payload
        self.unfinished: set[int] = set()  # the peers that ended the run failed or cancelled
        #: The peers this rank told that it ended the run, and what it told them.
        self.ended: set[int] = set()
        self.ending: Meta | None = None
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
        self.sent = {peer: _wire.Capacity(_wire.HEADERS_AHEAD - 1) for peer in self.peers}
        self.received = {peer: _wire.Capacity(0) for peer in self.peers}

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
            RemotePartitionError: this rank raised nothing, and a peer failed.
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
        if isinstance(error, Differs) or any(failure.disagrees for failure in failures):
            disagrees = disagreement(fields, self.partition_ranks[0], self.plan_fields)
            if disagrees is not None:
                raise disagrees
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

    def send_plan(self, plan: Meta, fields: Fields) -> None:
        """Give every peer the run's plan (its micro-batches' sizes) and this rank's run
        fields, from the first partition's rank."""
        self.plan_fields = self.fields = fields
        for peer in self.peers:
            self._post(peer, ("plan", plan, fields), [])

    def receive_plan(self, fields: Fields) -> Meta:
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
                raise Differs(str(disagreement))
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

    def send(self, key: MessageKey, message: Message) -> None:
        message = message.detached()  # no graph crosses ranks
        target = self.partition_ranks[key.target]
        if target == self.rank:
            with self.cond:
                self.mailbox[key] = message
                self.cond.notify_all()
            return
        if self.cancelled:
            return  # the run is over: nobody waits for it
        tensors = [settled(tensor) for tensor in message.tensors.tensors]
        _wire.check_strided(key, tensors)
        meta = ("data", key, message.atomic, message.present, message.requires_grad)
        self._post(target, (*meta, message.others, message.container), tensors)

    def receive(self, key: MessageKey) -> Message:
        source = self.partition_ranks[key.source]
        with self.cond:
            self._wait(lambda: key in self.mailbox, _wire.describe(key), source)
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

    def tell(self, where: str | None, error: BaseException) -> None:
        """Tell every peer that this rank failed in ``where`` (None: outside any action;
        once per run), and cancel the run."""
        with self.cond:
            told, self.told = self.told, True
            self.cancelled = True
            self.cond.notify_all()
        if told:
            return
        failure = Failure.of(
            self.rank,
            where or "its step, outside the pipeline's actions",
            error,
            disagrees=isinstance(error, Differs),
        )
        for peer in self.peers:
            if peer not in self.ended:  # a peer told the run ended serves the next one
                self._post_if_alive(peer, ("failed", failure))

    def fail(self, where: str | None, error: BaseException) -> None:
        self.tell(where, error)

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

    # -- receiving (the sends: see Links) -------------------------------------------------

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
                            Failure(
                                peer, "its run", f"the process died or left the group ({error})", ""
                            )
                        )
                        self.cancelled = True
                    self.cond.notify_all()
                return

    def _receive_one(self, peer: int, run: int) -> bool:
        """Receive one message from ``peer``; False once it said the run is finished."""
        raw, header = self._next_header(peer)

        def check(sent: tuple[Any, ...]) -> None:
            if sent[0] != run:
                raise RuntimeError(f"rank {peer} sent a message of run {sent[0]} during run {run}")

        (_, meta, _), tensors = _wire.read(
            raw,
            header,
            lambda tensor: self._recv(tensor, peer),
            lambda specs: self.payloads.receive(peer, specs),
            self.received[peer],
            check,
        )
        what = meta[0]
        with self.cond:
            if run != self.run or not self.active:
                # A run this rank ended without waiting for the peer (it was interrupted):
                # its messages are dropped, up to the one that ends it.
                return bool(what != "finished")
            self.heard[peer] = time.monotonic()
            if what == "finished":
                self.finished[peer], self.peer_fields[peer] = meta[2], meta[3]
                if not meta[1]:
                    self.unfinished.add(peer)
                self.cond.notify_all()
                return False
            if what == "failed":
                self.failures.append(meta[1])
                self.cancelled = True
            elif what == "plan":
                self.plan, self.plan_fields = meta[1], meta[2]
            elif what == "exchange":
                if not self.cancelled:  # the exchanges' tensors are on the CPU
                    self.exchanged[peer].append((meta[1], [t.cpu() for t in tensors]))
            elif not self.cancelled:
                _, key, atomic, present, requires_grad, others, container = meta
                batch = carried(tensors, atomic)
                self.mailbox[key] = Message(
                    atomic, present, requires_grad, batch, others, container
                )
            self.cond.notify_all()
        return True
