"""The transport: what moves between stages, and how.

Stages never hand each other tensors directly. The runner sends each stage's results
through a :class:`Transport` and receives each stage's inputs from it, keyed by what they
are (:class:`MessageKey`): the activations of micro-batch ``i`` from stage ``j`` to stage
``j + 1``, their gradients back, and the skip tensors and their gradients between the
stage that stashes and the stage that pops. A message carries its tensors and what the
receiver needs to know of them (:class:`Message`): which values are tensors, whether each
tensor required grad, whether the value was one value or a tuple. Values that are not
tensors (``None`` included: a missing gradient, a ``None`` skip; or a number, a string,
a small container a partition returned) travel as Python objects beside the tensors.

:class:`LocalTransport` moves tensors between worker threads of one process: a stream wait
when both stages share a device, else a device copy on the copy streams. A transport
across processes implements the same interface on ``torch.distributed``; neither the
stages nor the schedules know which transport carries their tensors.

Every wait ends when its message arrives or when the run is cancelled
(:meth:`Transport.cancel`): then it raises :class:`Cancelled`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from gpipe_checkpoint import is_differentiable
from gpipe_microbatch import AbstractStream, Batch, copy, make_tuple, wait

from ._schedule import Action
from ._tracing import Tracer

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
    """What a message is: its kind, its micro-batch, and the stages it goes between."""

    kind: MessageKind
    microbatch: int
    source: int
    target: int


class Message(NamedTuple):
    """Values sent by one stage to another: tensors, and the other values beside them."""

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
    tensors = [value for value in values if isinstance(value, Tensor)]
    requires_grad = tuple(
        tensor.requires_grad or (needs_grad and is_differentiable(tensor)) for tensor in tensors
    )
    if detach:
        tensors = [tensor.detach() for tensor in tensors]
    return Message(
        atomic,
        tuple(isinstance(value, Tensor) for value in values),
        requires_grad,
        carried(tensors, atomic),
        tuple(value for value in values if not isinstance(value, Tensor)),
        kind,
    )


class Cancelled(Exception):
    """Raised in a stage waiting for a message when the run has been cancelled."""


class Transport(ABC):
    """Moves messages between stages. One transport serves one run at a time."""

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
        """Wait for the message ``key``; its tensors are on the target stage's device,
        ready for its compute stream.

        Raises:
            Cancelled: the run was cancelled while waiting.
        """

    def fail(self, stage: int, action: Action | None, error: BaseException) -> None:
        """Stage ``stage``'s ``action`` raised ``error`` (``action`` is None outside any
        action): end the run. The default cancels it; a transport across processes tells
        the other processes too."""
        self.cancel()

    @abstractmethod
    def cancel(self) -> None:
        """Wake every wait with :class:`Cancelled`, now and until :meth:`reset`."""

    @abstractmethod
    def reset(self) -> None:
        """Drop undelivered messages and cancellation, for the next run."""


class LocalTransport(Transport):
    """Messages between worker threads of one process.

    Args:
        devices: the device of each stage.
        copy_streams: ``copy_streams[j][i]`` carries micro-batch ``i`` into and out of
            stage ``j``.
        compute_streams: each stage's compute stream.
        keep_graph: messages keep their tensors' autograd history, and device copies are
            differentiable (``GPipe.forward``: autograd reaches across stages). Otherwise
            tensors are detached when sent (``GPipe.step``: each stage starts its own
            graph).
        tracer: records the device copies, if the run is traced.
    """

    def __init__(
        self,
        devices: Sequence[torch.device],
        copy_streams: Sequence[Sequence[AbstractStream]],
        compute_streams: Sequence[AbstractStream],
        *,
        keep_graph: bool,
        tracer: Tracer | None = None,
    ) -> None:
        self.devices = devices
        self.copy_streams = copy_streams
        self.compute_streams = compute_streams
        self.keep_graph = keep_graph
        self.tracer = tracer
        self.lock = threading.Lock()
        self.arrived = [threading.Condition(self.lock) for _ in devices]
        self.messages: dict[MessageKey, Message] = {}
        self.cancelled = False

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
        if message.tensors:
            # The copy to the other stage waits for this stage's computation.
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
        if len(tensors):
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
