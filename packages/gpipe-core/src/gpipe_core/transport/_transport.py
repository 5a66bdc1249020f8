"""The transport: what moves between partitions, and how.

Partitions never hand each other tensors directly. The runner sends each partition's results
through a :class:`Transport` and receives each partition's inputs from it, keyed by what they
are (:class:`MessageKey`): the activations of micro-batch ``i`` from partition ``j`` to partition
``j + 1``, their gradients back, and the skip tensors and their gradients between the
partition that stashes and the partition that pops. A message carries its tensors and what the
receiver needs to know of them (:class:`Message`): which values are tensors, whether each
tensor required grad, whether the value was one value, a tuple or a mapping. Values that are not
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
and tracer), the messages, then :meth:`~Transport.finish`
(every process ends the run, and learns the others' payloads and errors). Cancellation
state lives here: :attr:`Transport.cancelled`. Between worker threads of one process the
plan and the end need nothing. The workers' turns on the CPU are the runner's
(:mod:`gpipe_core.run._turns`): a wait for a message between worker threads only consults
them through a :class:`Turnstile`.

It must not know the layers, the schedule or the runner: it moves what it is given under
its key.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol, cast

import torch
from torch import Tensor

from gpipe_checkpoint import is_differentiable
from gpipe_microbatch import Batch, Container, make_value

from .._stream import AbstractStream, is_cuda
from ..trace._tracing import Tracer
from ._transfer import copy, wait

__all__ = [
    "Cancelled",
    "Contents",
    "Fields",
    "LocalTransport",
    "Message",
    "MessageKey",
    "Transport",
    "Turnstile",
    "carried",
    "outgoing",
]

#: What a message carries: activations (forward), their gradients (backward), skip
#: tensors, the gradients of skip tensors, or a decode run's feedback (a lane's next input,
#: from the last partition to the first).
Contents = Literal["activations", "gradients", "skips", "skip-gradients", "feedback"]


class MessageKey(NamedTuple):
    """What a message is: its contents, its micro-batch, and the partitions it goes
    between."""

    contents: Contents
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
    #: What the values were: the type of their tuple (a namedtuple, say), or the
    #: :class:`~gpipe_microbatch.MappingContainer` of their mapping (its type and keys); ``tuple``
    #: for one value.
    container: Container = tuple

    def values(self) -> list[object]:
        """Every value, in order: the tensors, and :attr:`others` where ``present`` is
        False."""
        tensors, others = iter(self.tensors), iter(self.others)
        return [next(tensors) if here else next(others) for here in self.present]

    def value(self, values: Sequence[object]) -> object:
        """What the message's :meth:`values` were sent as (one value, or a tuple or a
        mapping of :attr:`container`), with ``values`` in their place."""
        return values[0] if self.atomic else make_value(self.container, values)

    def detached(self) -> Message:
        """The message with its tensors detached from their graph (itself if none has
        one)."""
        if not any(tensor.requires_grad for tensor in self.tensors):
            return self
        tensors = [tensor.detach() for tensor in self.tensors]
        return self._replace(tensors=carried(tensors, self.atomic))


def carried(tensors: Sequence[Tensor], atomic: bool) -> Batch:
    """The batch of a message's ``tensors`` (one tensor when the value was one)."""
    return Batch(tensors[0] if atomic and tensors else tuple(tensors))


def outgoing(
    values: Sequence[object],
    *,
    atomic: bool = False,
    needs_grad: bool = False,
    detach: bool,
    container: Container = tuple,
) -> Message:
    """The message that carries ``values`` (the one place a message is built): its tensors
    are detached from their graph if ``detach``.

    Args:
        values: tensors, and values that are not tensors (None included), which are
            carried as Python objects (:attr:`Message.others`).
        atomic: the values are one value rather than a tuple of one.
        needs_grad: the values come from a checkpointed forward pass, without
            autograd history; their recomputation will need gradients.
        detach: detach the tensors from their graph (each partition starts its own).
        container: the type of the tuple the values are (a namedtuple, say), or the
            :class:`~gpipe_microbatch.MappingContainer` of their mapping, which the receiver
            gets back (:meth:`Message.value`).
    """
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
        atomic, tuple(present), requires_grad, carried(tensors, atomic), tuple(others), container
    )


class Cancelled(Exception):
    """Raised in a partition waiting for a message when the run has been cancelled."""


#: A run's plan: what the first partition's process tells the others (the sizes of the
#: micro-batches).
Plan = tuple[Any, ...]

#: What one process says of its run, sent with the plan to be compared (see
#: :mod:`gpipe_core.transport._agreement`): ``(field, value)`` pairs in the order they
#: are compared.
Fields = tuple[tuple[str, Any], ...]


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
        tracer: Tracer | None,
    ) -> None:
        """The run's settings, once its micro-batches are known: each partition's compute
        stream, ``copy_streams[j][i]`` for micro-batch ``i`` into and out of partition
        ``j``, and the tracer of the device copies. The default uses none of them.
        (Whether messages keep their tensors' autograd history is the sender's choice,
        see :func:`outgoing`.)"""

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

    def exchange(
        self,
        tensors: Sequence[Tensor],
        send_to: Sequence[int],
        receive_from: Sequence[int],
        what: str,
    ) -> dict[int, list[Tensor]]:
        """Within a run, send ``tensors`` to the processes ``send_to`` and receive what the
        processes ``receive_from`` send this one (see the transport across processes);
        within one process there is nobody else: nothing is sent or received.

        Raises:
            Cancelled: the run was cancelled while waiting.
        """
        return {}

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
            RemotePartitionError: across processes, another process failed in the run.
        """

    @abstractmethod
    def send(self, key: MessageKey, message: Message) -> None:
        """Send ``message`` (built by :func:`outgoing`) from ``key.source`` to
        ``key.target``."""

    @abstractmethod
    def receive(self, key: MessageKey) -> Message:
        """Wait for the message ``key``; its tensors are on the target partition's device,
        ready for its compute stream.

        Raises:
            Cancelled: the run was cancelled while waiting.
        """

    def fail(self, where: str | None, error: BaseException) -> None:
        """The run raised ``error`` in ``where`` (``'backward of micro-batch 2 on partition
        1'``; None outside any action): end the run. The default cancels it; a transport
        across processes tells the other processes too."""
        self.cancel()

    @abstractmethod
    def cancel(self) -> None:
        """Wake every wait with :class:`Cancelled`, now and until :meth:`reset`."""

    @abstractmethod
    def reset(self) -> None:
        """Drop undelivered messages and cancellation, for the next run."""

    def close(self) -> None:  # noqa: B027
        """Release what the transport holds beyond a run (threads); idempotent."""


class Turnstile(Protocol):
    """The workers' turns (the runner's, see :class:`gpipe_core.run._turns.Turns`), as a
    wait for a message between worker threads sees them: a worker that holds the turn
    gives it up while it waits, and takes it back once its message is there and the turn
    is free. Each method is called with the transport's lock held."""

    def leave(self) -> bool:
        """Give the calling thread's turn up if it holds it (waking a worker that waits
        for one); whether it did."""

    def free(self) -> bool:
        """Whether a worker may take the turn now."""

    def patience(self) -> float:
        """How long a worker waiting for the turn sleeps before it looks again."""

    def hold(self) -> None:
        """The calling thread takes the turn."""

    def busy(self) -> bool:
        """Whether a worker holds the turn."""

    def clear(self) -> None:
        """Nobody holds the turn (a new run)."""


class LocalTransport(Transport):
    """Messages between worker threads of one process.

    Runs from several threads take turns (:class:`RunLock`). Each run's settings come
    from :meth:`prepare`. A message's tensors keep their autograd history where the sender
    kept it (``GPipe.forward``: device copies are differentiable then); ``GPipe.step``
    detaches them (each partition starts its own graph).

    **Turns.** Where the workers' short actions take turns on the CPU (see
    :mod:`gpipe_core.run._turns`), a worker waiting for a message gives its turn up
    meanwhile and takes it back once the message is there: the waits here consult the
    runner's :class:`Turnstile` (:attr:`turnstile`) for that, and know nothing else of turns.

    Args:
        devices: the device of each partition.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = devices
        self.copy_streams: Sequence[Sequence[AbstractStream]] = []
        self.compute_streams: Sequence[AbstractStream] = []
        self.tracer: Tracer | None = None
        # Whether messages need stream waits or device copies: not between partitions on
        # one device without CUDA streams (the CPU), where tensors are ready when sent.
        self.moves = True
        #: Whether every partition is on the CPU (one device without streams): where the
        #: workers' short actions take turns (see :mod:`gpipe_core.run._turns`).
        self.one_cpu = False
        #: The workers' turns, as the waits for messages see them (set by the runner).
        self.turnstile: Turnstile | None = None
        self.lock = threading.Lock()
        self.arrived = [threading.Condition(self.lock) for _ in devices]
        self.messages: dict[MessageKey, Message] = {}
        self.cancelled = False
        self.run_lock = RunLock(wait=True)
        #: What the worker waiting on ``arrived[j]`` waits for: a message (None: only a
        #: turn), and whether it needs a turn too.
        self.waiting: dict[int, tuple[MessageKey | None, bool]] = {}

    def begin(self) -> None:
        self.run_lock.acquire()
        self.reset()

    def prepare(
        self,
        compute_streams: Sequence[AbstractStream],
        copy_streams: Sequence[Sequence[AbstractStream]],
        *,
        tracer: Tracer | None,
    ) -> None:
        self.compute_streams = compute_streams
        self.copy_streams = copy_streams
        self.tracer = tracer
        streams = [*compute_streams, *(stream for row in copy_streams for stream in row)]
        self.moves = len(set(self.devices)) > 1 or any(is_cuda(stream) for stream in streams)
        self.one_cpu = not self.moves and bool(self.devices) and self.devices[0].type == "cpu"

    def finish(self, error: BaseException | None, payload: object = None) -> dict[int, Any]:
        self.tracer = None  # the run's tracer is not kept past it
        self.run_lock.release()
        return {}

    def send(self, key: MessageKey, message: Message) -> None:
        if self.moves and message.tensors:
            # The copy to the other partition waits for this partition's computation.
            source, i = key.source, key.microbatch
            wait(message.tensors, self.compute_streams[source], self._copy_stream(source, i))
        with self.lock:
            self.messages[key] = message
            # Wake the receiver only if it waits for this message, and can go on with it.
            waits = self.waiting.get(key.target)
            if waits is not None and waits[0] == key:
                turnstile = self.turnstile
                if not (waits[1] and turnstile is not None and turnstile.busy()):
                    self.arrived[key.target].notify()

    def receive(self, key: MessageKey) -> Message:
        with self.lock:
            message = self.messages.pop(key, None)
            if message is None:
                message = self._wait(key)
        tensors = message.tensors
        if self.moves and len(tensors):
            self._move(key, tensors)
        return message

    def _wait(self, key: MessageKey) -> Message:
        """Wait for ``key`` (the lock held), giving up this worker's turn meanwhile."""
        turnstile = self.turnstile
        turn = turnstile is not None and turnstile.leave()
        self.waiting[key.target] = (key, turn)
        try:
            while key not in self.messages or (turn and not cast(Turnstile, turnstile).free()):
                if self.cancelled:
                    raise Cancelled
                # Waiting for a turn too, it looks again in case the holder's action lasts.
                patience = cast(Turnstile, turnstile).patience() if turn else None
                self.arrived[key.target].wait(patience)
        finally:
            del self.waiting[key.target]
        if turn:
            cast(Turnstile, turnstile).hold()
        return self.messages.pop(key)

    def _copy_stream(self, j: int, i: int) -> AbstractStream:
        """Partition ``j``'s copy stream of micro-batch ``i`` (a decode run's micro-batches
        share their lane's)."""
        row = self.copy_streams[j]
        return row[i % len(row)]

    def _move(self, key: MessageKey, batch: Batch) -> None:
        """Bring ``batch`` to the target's device and compute stream (in place)."""
        source, target, i = key.source, key.target, key.microbatch
        source_stream = self._copy_stream(source, i)
        target_stream = self._copy_stream(target, i)
        if self.devices[source] == self.devices[target]:
            wait(batch, source_stream, target_stream)
        elif self.tracer is not None:
            backward = key.contents in ("gradients", "skip-gradients")
            self.tracer.copy(
                lambda: copy(batch, source_stream, target_stream),
                batch, i, target, source_stream, target_stream, self.devices[target], backward,
            )  # fmt: skip
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
            if self.turnstile is not None:
                self.turnstile.clear()
            self.waiting.clear()
