"""The transport: what moves between partitions, and how.

Partitions never hand each other tensors directly. The runner sends each partition's results
through a :class:`Transport` and receives each partition's inputs from it, keyed by what they
are (:class:`MessageKey`): the activations of micro-batch ``i`` from partition ``j`` to partition
``j + 1``, their gradients back, and the skip tensors and their gradients between the
partition that stashes and the partition that pops. A message carries its tensors and what the
receiver needs to know of them (:class:`Message`): which values are tensors, whether each
tensor required grad, whether the value was one value or a tuple. Values that are not
tensors (``None`` included: a missing gradient, a ``None`` skip; or a number, a string,
a small container a partition returned) travel as Python objects beside the tensors.

:class:`LocalTransport` moves tensors between worker threads of one process: a stream wait
when both partitions share a device, else a device copy on the copy streams. A transport
across processes implements the same interface on ``torch.distributed``; neither the
partitions nor the schedules know which transport carries their tensors.

Every wait ends when its message arrives or when the run is cancelled
(:meth:`Transport.cancel`): then it raises :class:`Cancelled`.

**A run's lifecycle** is the transport's too, whichever transport it is: :meth:`~Transport.begin`
(one run at a time: a call from another thread waits, or is refused across processes;
a call from inside the run is refused), :meth:`~Transport.send_plan` and
:meth:`~Transport.receive_plan` (the micro-batches' sizes and the run's fields, from the
first partition's process to the others), :meth:`~Transport.prepare` (the run's streams
and whether messages keep their graph), the messages, then :meth:`~Transport.finish`
(every process ends the run, and learns the others' payloads and errors). Cancellation
state lives here: :attr:`Transport.cancelled`. Between worker threads of one process the
plan and the end need nothing.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from gpipe_checkpoint import is_differentiable
from gpipe_microbatch import Batch, make_tuple

from ._agreement import Fields
from ._schedule import Action
from ._stream import AbstractStream, is_cuda
from ._tracing import Tracer
from ._transfer import copy, wait

__all__ = [
    "Cancelled",
    "LocalTransport",
    "Message",
    "MessageKey",
    "MessageKind",
    "Transport",
    "carried",
    "outgoing",
]

#: What a message carries: activations (forward), their gradients (backward), skip
#: tensors, or the gradients of skip tensors.
MessageKind = Literal["activations", "gradients", "skips", "skip-gradients"]


class MessageKey(NamedTuple):
    """What a message is: its kind, its micro-batch, and the partitions it goes between."""

    kind: MessageKind
    microbatch: int
    source: int
    target: int


class Message(NamedTuple):
    """Values sent by one partition to another: tensors, and the other values beside them."""

    #: Whether the value was one value (rather than a tuple).
    atomic: bool
    #: Which values are tensors; the others are in :attr:`others`.
    present: tuple[bool, ...]
    #: Whether each carried tensor requires grad where it was made (or will, once its
    #: checkpointed forward pass is recomputed).
    requires_grad: tuple[bool, ...]
    #: The carried tensors.
    tensors: Batch
    #: The values that are not tensors (``None`` included), in order, as Python objects.
    others: tuple[object, ...] = ()
    #: The type of the tuple the values were (a namedtuple, say); ``tuple`` for one value.
    kind: type[tuple[Any, ...]] = tuple

    def values(self) -> list[object]:
        """Every value, in order: the tensors, and :attr:`others` where ``present`` is
        False."""
        tensors, others = iter(self.tensors), iter(self.others)
        return [next(tensors) if here else next(others) for here in self.present]

    def value(self, values: Sequence[object]) -> object:
        """What the message's :meth:`values` were sent as (one value, or a tuple of type
        :attr:`kind`), with ``values`` in their place."""
        return values[0] if self.atomic else make_tuple(self.kind, values)


def carried(tensors: Sequence[Tensor], atomic: bool) -> Batch:
    """The batch of a message's ``tensors`` (one tensor when the value was one)."""
    return Batch(tensors[0] if atomic and tensors else tuple(tensors))


def outgoing(
    values: Sequence[object],
    atomic: bool,
    needs_grad: bool,
    *,
    detach: bool,
    kind: type[tuple[Any, ...]] = tuple,
) -> Message:
    """The message that carries ``values`` (see :meth:`Transport.send`); its tensors are
    detached from their graph if ``detach``."""
    # One pass over the values: this runs for every message.
    tensors: list[Tensor] = []
    present: list[bool] = []
    others: list[object] = []
    for value in values:
        if isinstance(value, Tensor):
            tensors.append(value)
            present.append(True)
        else:
            others.append(value)
            present.append(False)
    if needs_grad:
        requires_grad = tuple(
            tensor.requires_grad or is_differentiable(tensor) for tensor in tensors
        )
    else:
        requires_grad = tuple(tensor.requires_grad for tensor in tensors)
    if detach:
        tensors = [tensor.detach() for tensor in tensors]
    return Message(
        atomic, tuple(present), requires_grad, carried(tensors, atomic), tuple(others), kind
    )


class Cancelled(Exception):
    """Raised in a partition waiting for a message when the run has been cancelled."""


#: A run's plan: what the first partition's process tells the others (the sizes of the
#: micro-batches).
Plan = tuple[Any, ...]


class RunLock:
    """One run at a time on a transport, and no run from inside a run.

    Args:
        wait: whether a run begun in another thread while one runs waits for it (in one
            process) rather than being refused (across processes, where every process must
            make the same calls in the same order, so queued calls could pair wrongly).
    """

    def __init__(self, *, wait: bool) -> None:
        self.wait = wait
        self.lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self) -> None:
        """Hold the transport for a run.

        Raises:
            RuntimeError: called from inside the run (a layer or a hook calling the
                pipeline again), or, without ``wait``, while another thread's run lasts.
        """
        current = threading.current_thread()
        if self.owner == current.ident:
            raise RuntimeError(
                "a GPipe module was called from inside its own run (a layer or a hook of the "
                "module called it, or its step, again); it cannot wait for its own run to "
                f"end, so re-entering a module is not supported (thread: {current.name})"
            )
        if not self.lock.acquire(blocking=self.wait):
            raise RuntimeError(
                "a GPipe module across processes runs one call at a time, and another thread "
                f"is running one (thread: {current.name}); every rank must make the same calls "
                "in the same order, so call step() and forward() from one thread per rank"
            )
        self.owner = current.ident

    def release(self) -> None:
        self.owner = None
        self.lock.release()


class Transport(ABC):
    """Moves messages between partitions, and owns the lifecycle of the run that sends them
    (see the module's docstring). One run at a time."""

    #: Whether the current run was cancelled (every wait raises :class:`Cancelled`).
    cancelled: bool

    @abstractmethod
    def begin(self) -> None:
        """Start a run.

        Raises:
            RuntimeError: see :meth:`RunLock.acquire`, or the run cannot start (another
                process is gone).
        """

    def prepare(  # noqa: B027
        self,
        compute_streams: Sequence[AbstractStream],
        copy_streams: Sequence[Sequence[AbstractStream]],
        *,
        keep_graph: bool,
        tracer: Tracer | None,
    ) -> None:
        """The run's settings, once its micro-batches are known: each partition's compute
        stream, ``copy_streams[j][i]`` for micro-batch ``i`` into and out of partition
        ``j``, whether messages keep their tensors' autograd history (``GPipe.forward``:
        autograd reaches across partitions) rather than detaching them (``GPipe.step``),
        and the tracer of the device copies. The default uses none of them."""

    def send_plan(self, plan: Plan, fields: Fields) -> None:  # noqa: B027
        """Give the other processes the run's ``plan`` and this process's run ``fields``
        (from the first partition's process; nothing to do within one process)."""

    def receive_plan(self, fields: Fields) -> Plan:
        """Wait for the run's plan from the first partition's process, and check that
        ``fields`` are the same there.

        Raises:
            Cancelled: the run was cancelled while waiting.
            ValueError: ``fields`` differ from the first partition's process's.
        """
        raise RuntimeError("the first partition runs in this process: nobody sends a plan")

    @abstractmethod
    def finish(self, error: BaseException | None, payload: object = None) -> dict[int, Any]:
        """End the run (whatever happened in it).

        Args:
            error: what this process raised in the run, if anything.
            payload: what this process gives the others (a callable is called for it,
                only if there are others).

        Returns:
            Each other process's payload (none within one process).

        Raises:
            RemoteStageError: across processes, another process failed in the run.
        """

    @abstractmethod
    def send(
        self,
        key: MessageKey,
        values: Sequence[object],
        *,
        atomic: bool = False,
        needs_grad: bool = False,
        kind: type[tuple[Any, ...]] = tuple,
    ) -> None:
        """Send ``values`` from ``key.source`` to ``key.target``.

        Args:
            key: what the message is.
            values: tensors, and values that are not tensors (None included), which are
                carried as Python objects (:attr:`Message.others`).
            atomic: the values are one value rather than a tuple of one.
            needs_grad: the values come from a checkpointed forward pass, without
                autograd history; their recomputation will need gradients.
            kind: the type of the tuple the values are (a namedtuple, say), which the
                receiver gets back (:meth:`Message.value`).
        """

    @abstractmethod
    def receive(self, key: MessageKey) -> Message:
        """Wait for the message ``key``; its tensors are on the target partition's device,
        ready for its compute stream.

        Raises:
            Cancelled: the run was cancelled while waiting.
        """

    def fail(self, partition: int, action: Action | None, error: BaseException) -> None:
        """PartitionRun ``partition``'s ``action`` raised ``error`` (``action`` is None outside any
        action): end the run. The default cancels it; a transport across processes tells
        the other processes too."""
        self.cancel()

    @abstractmethod
    def cancel(self) -> None:
        """Wake every wait with :class:`Cancelled`, now and until :meth:`reset`."""

    @abstractmethod
    def reset(self) -> None:
        """Drop undelivered messages and cancellation, for the next run."""

    def close(self) -> None:  # noqa: B027
        """Release what the transport holds beyond a run (threads); idempotent."""


class LocalTransport(Transport):
    """Messages between worker threads of one process.

    Runs from several threads take turns (:class:`RunLock`). Each run's settings come
    from :meth:`prepare`: with ``keep_graph``, messages keep their tensors' autograd
    history and device copies are differentiable (``GPipe.forward``); otherwise tensors
    are detached when sent (``GPipe.step``: each partition starts its own graph).

    Args:
        devices: the device of each partition.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = devices
        self.copy_streams: Sequence[Sequence[AbstractStream]] = []
        self.compute_streams: Sequence[AbstractStream] = []
        self.keep_graph = False
        self.tracer: Tracer | None = None
        # Whether messages need stream waits or device copies: not between partitions on
        # one device without CUDA streams (the CPU), where tensors are ready when sent.
        self.moves = True
        self.lock = threading.Lock()
        self.arrived = [threading.Condition(self.lock) for _ in devices]
        self.messages: dict[MessageKey, Message] = {}
        self.cancelled = False
        self.run_lock = RunLock(wait=True)

    def begin(self) -> None:
        self.run_lock.acquire()
        self.reset()

    def prepare(
        self,
        compute_streams: Sequence[AbstractStream],
        copy_streams: Sequence[Sequence[AbstractStream]],
        *,
        keep_graph: bool,
        tracer: Tracer | None,
    ) -> None:
        self.compute_streams = compute_streams
        self.copy_streams = copy_streams
        self.keep_graph = keep_graph
        self.tracer = tracer
        streams = [*compute_streams, *(stream for row in copy_streams for stream in row)]
        self.moves = len(set(self.devices)) > 1 or any(is_cuda(stream) for stream in streams)

    def finish(self, error: BaseException | None, payload: object = None) -> dict[int, Any]:
        self.tracer = None  # the run's tracer is not kept past it
        self.run_lock.release()
        return {}

    def send(
        self,
        key: MessageKey,
        values: Sequence[object],
        *,
        atomic: bool = False,
        needs_grad: bool = False,
        kind: type[tuple[Any, ...]] = tuple,
    ) -> None:
        message = outgoing(values, atomic, needs_grad, detach=not self.keep_graph, kind=kind)
        if self.moves and message.tensors:
            # The copy to the other partition waits for this partition's computation.
            source, i = key.source, key.microbatch
            wait(message.tensors, self.compute_streams[source], self.copy_streams[source][i])
        with self.lock:
            self.messages[key] = message
            self.arrived[key.target].notify()

    def receive(self, key: MessageKey) -> Message:
        with self.lock:
            message = self.messages.pop(key, None)
            while message is None:
                if self.cancelled:
                    raise Cancelled
                self.arrived[key.target].wait()
                message = self.messages.pop(key, None)
        tensors = message.tensors
        if self.moves and len(tensors):
            self._move(key, tensors)
        return message

    def _move(self, key: MessageKey, batch: Batch) -> None:
        """Bring ``batch`` to the target's device and compute stream (in place)."""
        source, target, i = key.source, key.target, key.microbatch
        source_stream = self.copy_streams[source][i]
        target_stream = self.copy_streams[target][i]
        if self.devices[source] == self.devices[target]:
            wait(batch, source_stream, target_stream)
        elif self.tracer is not None:
            backward = key.kind in ("gradients", "skip-gradients")
            self.tracer.copy(
                batch, i, target, source_stream, target_stream, self.devices[target], backward
            )
        else:
            copy(batch, source_stream, target_stream)
        wait(batch, target_stream, self.compute_streams[target])

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            self.messages.clear()
            for arrived in self.arrived:
                arrived.notify_all()

    def reset(self) -> None:
        with self.lock:
            self.cancelled = False
            self.messages.clear()
