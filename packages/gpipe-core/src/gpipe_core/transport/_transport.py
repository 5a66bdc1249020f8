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
plan and the end need nothing. The workers' turns are the transport's too
(:meth:`~Transport.take_turn`, :meth:`~Transport.took`, :meth:`~Transport.end_turn`,
:meth:`~Transport.one_turn`): between worker threads on the CPU short actions take turns,
since the threads share one interpreter lock, and a run of short actions only is one turn
in the calling thread; across processes there are no turns.

It must not know the layers, the schedule's order or the runner: it moves what it is given
under its key.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, cast

import torch
from torch import Tensor

from gpipe_checkpoint import is_differentiable
from gpipe_microbatch import Batch, make_tuple

from .._stream import AbstractStream, is_cuda
from ..run._order import action_kinds
from ..schedule._action import Action
from ..trace._tracing import Tracer
from ._agreement import Fields
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


#: An action of a run in one turn (the calling thread runs every action, see
#: :meth:`Transport.one_turn`) that has run this long (seconds) hands the rest of the run
#: over to the workers: it may wait for something the serial order runs later (a layer
#: waiting for another partition's layer). Longer than :data:`TAKE_OVER_AFTER`: a hand-over
#: wakes every worker, and one turn's actions are short (a blocked one is measured long, and
#: the next runs are no longer one turn).
HAND_OVER_AFTER = 0.05


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

    def take_turn(self, partition: int, kind: str) -> None:  # noqa: B027
        """Before an action of ``kind`` on ``partition``: wait for this worker's turn if
        the transport makes short actions take turns (see :class:`LocalTransport`); the
        default has no turns.

        Raises:
            Cancelled: the run was cancelled while waiting.
        """

    def took(self, partition: int, kind: str, seconds: float) -> None:  # noqa: B027
        """An action of ``kind`` on ``partition`` computed for ``seconds`` (its messages'
        waits excluded): what decides whether it takes turns next time."""

    #: How long (seconds) an action of a run in one turn may run before the run is handed
    #: over to the workers (:data:`HAND_OVER_AFTER`); None: never (for layers known never
    #: to wait for another's, as tests make them).
    hand_over_after: float | None = HAND_OVER_AFTER

    def one_turn(self, actions: Sequence[Sequence[Action]]) -> bool:
        """Whether the whole run may be one turn: every worker's ``actions`` run in the
        calling thread, in :func:`~gpipe_core.run._order.serial_order` (see
        :class:`LocalTransport`), handed over to the workers if an action runs for
        :attr:`hand_over_after`; the default never."""
        return False

    def end_turn(self) -> None:  # noqa: B027
        """This worker stops taking turns (its list ended, it failed, or its next action
        is long): another may go on."""

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


#: An action that computes for less than this (seconds) is short: on the CPU, short
#: actions of the workers take turns (see :class:`LocalTransport`).
SHORT_ACTION = 2e-4
#: How many times in a row an action (a partition's forward pass, say) must take at least
#: :data:`SHORT_ACTION` to count as long: one late time, the machine busy elsewhere, does
#: not make it long.
LONG_AFTER = 2
#: A long action takes a turn every this many times, if nobody holds it, to be measured
#: alone: measured among running workers, a short action can look long (they hand each
#: other the interpreter lock at every operator), and this lets it come back.
PROBE_EVERY = 16
#: A worker whose action has kept the turn this long (seconds) keeps it no longer: a
#: worker waiting for a turn takes it. The action is long, or blocked until another
#: worker moves (a layer waiting for another partition's layer): turns never make a
#: worker wait for longer than this on an action of another.
TAKE_OVER_AFTER = 10 * SHORT_ACTION


class LocalTransport(Transport):
    """Messages between worker threads of one process.

    Runs from several threads take turns (:class:`RunLock`). Each run's settings come
    from :meth:`prepare`: with ``keep_graph``, messages keep their tensors' autograd
    history and device copies are differentiable (``GPipe.forward``); otherwise tensors
    are detached when sent (``GPipe.step``: each partition starts its own graph).

    **Short actions take turns on the CPU.** Python threads share one interpreter lock,
    which every PyTorch operator releases and takes again: two workers running small
    operators at the same time hand it to each other at almost every operator, and each
    hand-over wakes a thread (on a 2-core machine, two threads each running a tiny
    ``Linear``'s forward and backward passes took 2 x as long as one thread running both
    in turn). So where every partition is on the CPU, a short action runs only in its
    worker's turn: one worker at a time runs short actions, keeps its turn while its next
    action is ready, and gives it up when it waits for a message (or its list ends, or its
    next action is long), waking one worker whose action is ready. Long actions (and
    every action off the CPU) never wait for a turn, so partitions that compute for longer
    still overlap.

    An action (a partition and a kind: the forward pass of partition 1, say) is long once
    it computed for at least :data:`SHORT_ACTION` :data:`LONG_AFTER` times in a row, and
    short again after one shorter time; never measured, it is short. A long action takes
    a turn every :data:`PROBE_EVERY` times if nobody holds it (it never waits for one),
    so that it is measured alone. The measurements are the transport's, kept from run to
    run. An action that has kept the turn for :data:`TAKE_OVER_AFTER` loses it to a
    waiting worker, so a turn never waits on an action that waits for another worker.
    Once every action of a run is measured short (:meth:`one_turn`), the run is one turn:
    the calling thread runs all of them, and no worker thread computes (a first run, which
    measures them, runs on the workers; one worker's thread, asleep, watches for an action
    that blocks, and hands the rest of the run to the workers after
    :data:`HAND_OVER_AFTER`, see :mod:`gpipe_core.run._runner`). Whatever the turns, every
    worker runs its own list in order, so the results are those of any other interleaving.

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
        self.turns = False
        self.lock = threading.Lock()
        self.arrived = [threading.Condition(self.lock) for _ in devices]
        self.messages: dict[MessageKey, Message] = {}
        self.cancelled = False
        self.run_lock = RunLock(wait=True)
        #: The thread whose turn it is (None: nobody's), and when its current action
        #: began (``time.perf_counter()``).
        self.holder: int | None = None
        self.since = 0.0
        #: What the worker waiting on ``arrived[j]`` waits for: a message (None: only a
        #: turn), and whether it needs a turn too.
        self.waiting: dict[int, tuple[MessageKey | None, bool]] = {}
        #: How many times in a row each action (partition, kind) computed for at least
        #: :data:`SHORT_ACTION`.
        self.slow: dict[tuple[int, str], int] = {}

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
        # Turns only where every partition is on the CPU (one device without streams).
        self.turns = not self.moves and bool(self.devices) and self.devices[0].type == "cpu"

    def take_turn(self, partition: int, kind: str) -> None:
        if not self.turns:
            return
        me = threading.get_ident()
        slow = self.slow.get((partition, kind), 0)
        # A long action takes no turn, but is measured alone every PROBE_EVERY times if the
        # turn is free then: it never waits for one.
        probe = slow >= LONG_AFTER and slow % PROBE_EVERY == 0
        if slow >= LONG_AFTER and not probe:
            if self.holder == me:
                self.end_turn()
            return
        if self.holder == me:
            self.since = time.perf_counter()
            return
        with self.lock:
            if not self._turn_free():
                if probe:
                    return
                self.waiting[partition] = (None, True)
                try:
                    while not self._turn_free():
                        if self.cancelled:
                            raise Cancelled
                        self.arrived[partition].wait(self._patience())
                finally:
                    del self.waiting[partition]
            self.holder, self.since = me, time.perf_counter()

    def _turn_free(self) -> bool:
        """Whether a worker may take the turn now (the lock held): nobody's, or held by an
        action for :data:`TAKE_OVER_AFTER` already."""
        return self.holder is None or time.perf_counter() - self.since >= TAKE_OVER_AFTER

    def _patience(self) -> float:
        """How long a worker waiting for a turn sleeps before it looks again (the lock
        held): until the holder's action has kept the turn for :data:`TAKE_OVER_AFTER`."""
        if self.holder is None:
            return TAKE_OVER_AFTER
        return max(TAKE_OVER_AFTER - (time.perf_counter() - self.since), SHORT_ACTION / 10)

    def took(self, partition: int, kind: str, seconds: float) -> None:
        if not self.turns:
            return
        action = (partition, kind)  # only its worker's thread counts it
        self.slow[action] = 0 if seconds < SHORT_ACTION else self.slow.get(action, 0) + 1

    def one_turn(self, actions: Sequence[Sequence[Action]]) -> bool:
        if not self.turns:
            return False
        slow = self.slow
        # Never measured counts as long here: a first run shows what each action takes.
        return all(
            slow.get((cast(int, j), kind), LONG_AFTER) < LONG_AFTER
            for j, kind in action_kinds(actions)
        )

    def end_turn(self) -> None:
        if self.holder != threading.get_ident():
            return
        with self.lock:
            self._pass_turn()

    def _pass_turn(self) -> None:
        """Give up the turn (the lock held): wake one worker that waits for a turn and can
        go on with it (one that waits for a message only would not take it)."""
        self.holder = None
        for target, (key, turn) in self.waiting.items():
            if turn and (key is None or key in self.messages):
                self.arrived[target].notify()
                return

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
            # Wake the receiver only if it waits for this message, and can go on with it.
            waits = self.waiting.get(key.target)
            if waits is not None and waits[0] == key and not (waits[1] and self.holder is not None):
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
        me = threading.get_ident()
        turn = self.holder == me
        if turn:
            self._pass_turn()
        self.waiting[key.target] = (key, turn)
        try:
            while key not in self.messages or (turn and not self._turn_free()):
                if self.cancelled:
                    raise Cancelled
                # Waiting for a turn too, it looks again in case the holder's action lasts.
                self.arrived[key.target].wait(self._patience() if turn else None)
        finally:
            del self.waiting[key.target]
        if turn:
            self.holder, self.since = me, time.perf_counter()
        return self.messages.pop(key)

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
            self.holder = None
            self.waiting.clear()
