"""A training step that owns the loss and the backward pass: :meth:`GPipe.step`.

Each partition's worker runs that partition's actions (see :mod:`gpipe_core.schedule`) in
order: the forward pass of a micro-batch, its loss on the last partition, and its backward
pass, with the recomputation of a checkpointed micro-batch right before its backward
pass. Partitions exchange tensors through a :class:`_Mailbox`, and a worker waits only for
what its next action needs: there is no global clock.

Each partition's autograd graph stops at its input: a forward pass detaches what it
receives, and its backward pass calls :func:`torch.autograd.backward` on its own outputs
with the gradients the next partition sent back (or on the scaled loss), then sends its
inputs' gradients to the partitions they came from. So backward passes of different
partitions run on different threads, at the same time, on the CPU as well.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any, Literal, NamedTuple, TypeVar, cast, overload

import torch
from torch import Tensor, nn

from gpipe_checkpoint import (
    RNGStates,
    enable_checkpointing,
    enable_recomputing,
    restore_rng_states,
    save_rng_states,
)
from gpipe_microbatch import AbstractStream, Batch, TensorOrTensors, ThreadState, check, wait
from gpipe_skip import SkipKey, SkipLayout

from .pipeline import PartitionTraits, clone, trainable
from .schedule import Action, simulate
from .skips import SkipCall
from .timeline import Phase
from .tracing import Tracer, _warn_workers_unseen, move
from .worker import ExcInfo, Task, WorkerPool

__all__ = ["LossFunction", "Losses", "Reduction", "StepRun"]

Reduction = Literal["mean", "sum"]
LossFunction = Callable[[Any, Any], Tensor]
_T = TypeVar("_T")


class Losses(Sequence[Tensor]):
    """The losses of one :meth:`GPipe.step <gpipe_core.GPipe.step>`, one per micro-batch.

    Each loss is what ``loss_fn`` returned for its micro-batch, detached, on the last
    partition's device. :meth:`reduced` combines them into the loss of the whole
    mini-batch.

    Attributes:
        sizes: the number of samples in each micro-batch.
        reduction: how ``loss_fn`` reduces over samples: ``'mean'`` or ``'sum'``.

    Example:
        >>> losses = Losses([torch.tensor(1.0), torch.tensor(4.0)], sizes=[3, 1], reduction="mean")
        >>> len(losses), losses[1].item()
        (2, 4.0)
        >>> losses.reduced().item()  # (3 * 1.0 + 1 * 4.0) / 4
        1.75
    """

    def __init__(self, losses: Sequence[Tensor], sizes: Sequence[int], reduction: Reduction):
        if len(losses) != len(sizes):
            raise ValueError(
                f"losses and sizes must have the same length (losses: {len(losses)}, "
                f"sizes: {len(sizes)})"
            )
        self._losses = tuple(losses)
        self.sizes: tuple[int, ...] = tuple(sizes)
        self.reduction: Reduction = reduction

    @overload
    def __getitem__(self, index: int) -> Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Tensor]: ...

    def __getitem__(self, index: int | slice) -> Tensor | Sequence[Tensor]:
        return self._losses[index]

    def __len__(self) -> int:
        return len(self._losses)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._losses)

    def reduced(self) -> Tensor:
        """The loss of the whole mini-batch, as ``loss_fn`` on all of it would return.

        With ``'mean'``, the mean of the micro-batch losses weighted by their sizes; with
        ``'sum'``, their sum.
        """
        stacked = torch.stack(self._losses)
        if self.reduction == "sum":
            return stacked.sum()
        weights = torch.tensor(self.sizes, dtype=stacked.dtype, device=stacked.device)
        return (stacked * weights).sum() / max(sum(self.sizes), 1)

    def __repr__(self) -> str:
        values = ", ".join(f"{loss.item():.4g}" for loss in self._losses)
        return f"Losses([{values}], sizes={list(self.sizes)}, reduction={self.reduction!r})"


class _Cancelled(Exception):
    """Raised in a worker waiting for a message when another worker has failed."""


class _Message(NamedTuple):
    """Tensors sent by partition ``source``: some values may be None (not carried)."""

    source: int
    atomic: bool
    #: Which values are tensors; the others are None.
    present: tuple[bool, ...]
    #: Whether each present tensor required grad where it was made.
    requires_grad: tuple[bool, ...]
    #: The present tensors, detached.
    tensors: Batch


class _Mailbox:
    """Messages in transit between workers, keyed by what they are for.

    Every wait ends when its message arrives or when the step is cancelled. The first
    error of the step is kept here for the caller.
    """

    def __init__(self, partitions: int) -> None:
        self.lock = threading.Lock()
        self.ready = [threading.Condition(self.lock) for _ in range(partitions)]
        self.items: dict[Hashable, _Message] = {}
        self.cancelled = False
        self.error: ExcInfo | None = None

    def put(self, j: int, key: Hashable, message: _Message) -> None:
        """Leave ``message`` for partition ``j``'s worker."""
        with self.lock:
            self.items[key] = message
            self.ready[j].notify()

    def take(self, j: int, key: Hashable) -> _Message:
        """Wait for the message ``key`` for partition ``j`` and take it."""
        with self.lock:
            while key not in self.items:
                if self.cancelled:
                    raise _Cancelled
                self.ready[j].wait()
            return self.items.pop(key)

    def cancel(self, error: ExcInfo | None) -> None:
        """Keep ``error`` if it is the first and wake every waiting worker to cancel it."""
        with self.lock:
            if self.error is None and error is not None:
                self.error = error
            self.cancelled = True
            self.items.clear()
            for ready in self.ready:
                ready.notify_all()


def _differentiable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


class _InFlight:
    """What a partition keeps of a micro-batch between its forward and backward pass."""

    __slots__ = ("call", "inputs", "loss", "outputs", "rng")

    def __init__(self, inputs: Batch, call: SkipCall | None) -> None:
        #: The flat input: leaves (views of the mini-batch on partition 0).
        self.inputs = inputs
        #: How the partition runs when it has skippable layers.
        self.call = call
        #: The flat output with its autograd graph (None while checkpointed).
        self.outputs: tuple[Tensor, ...] | None = None
        #: The scaled loss to differentiate, on the last partition.
        self.loss: Tensor | None = None
        #: The generator states a checkpointed forward pass started from.
        self.rng: RNGStates | None = None


class StepRun:
    """One :meth:`GPipe.step <gpipe_core.GPipe.step>`: each partition's program and messages.

    Args:
        partitions: the partitions, each on its device.
        devices: the device of each partition.
        copy_streams: ``copy_streams[j][i]`` carries micro-batch ``i`` into and out of
            partition ``j``.
        compute_streams: each partition's compute stream.
        inputs: the micro-batches of the input.
        targets: the micro-batches of the target, on the last partition's device.
        loss_fn: ``loss_fn(output, target)`` returns a scalar tensor.
        scales: what each micro-batch's loss is multiplied by before its backward pass.
        actions: each partition's actions.
        checkpoint_stop: micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed.
        backward: whether the actions include backward passes (else forward passes and
            losses only, without autograd history).
        skip_layout: the skip connections between partitions.
        tracer: records the tasks, if a trace or a profiler is active.
    """

    def __init__(
        self,
        partitions: Sequence[nn.Sequential],
        devices: Sequence[torch.device],
        copy_streams: Sequence[Sequence[AbstractStream]],
        compute_streams: Sequence[AbstractStream],
        inputs: list[Batch],
        targets: list[Batch],
        loss_fn: LossFunction,
        scales: Sequence[float],
        actions: Sequence[Sequence[Action]],
        checkpoint_stop: int,
        backward: bool,
        skip_layout: SkipLayout,
        tracer: Tracer | None,
    ) -> None:
        n = len(partitions)
        self.partitions = partitions
        self.devices = devices
        self.copy_streams = copy_streams
        self.compute_streams = compute_streams
        self.inputs = inputs
        self.targets = targets
        self.loss_fn = loss_fn
        self.scales = scales
        self.actions = actions
        self.checkpoint_stop = checkpoint_stop
        self.backward = backward
        self.tracer = tracer
        self.traits = PartitionTraits(n)
        self.trainable = trainable(partitions)
        self.losses: list[Tensor | None] = [None] * len(inputs)
        self.mailbox = _Mailbox(n)
        self.in_flight: list[dict[int, _InFlight]] = [{} for _ in range(n)]
        self.layout = None if skip_layout.empty else skip_layout
        # The partitions each partition receives skips from, and sends skips to.
        self.skip_sources: list[list[int]] = [[] for _ in range(n)]
        self.skip_targets: list[list[int]] = [[] for _ in range(n)]
        if self.layout is not None:
            for j in range(n):
                self.skip_sources[j] = sorted({r.stash_partition for r in self.layout.requires(j)})
                self.skip_targets[j] = sorted({r.pop_partition for r in self.layout.provides(j)})

    # -- running the programs ------------------------------------------------------------

    def run(self, pool: WorkerPool, state: ThreadState, threaded: bool) -> list[Tensor]:
        """Run every partition's actions and return the losses.

        ``threaded``: each partition's actions run on its worker in ``pool``. Otherwise
        they run in the calling thread in the order of a clock (:func:`simulate`), so
        that no wait ever blocks.
        """
        try:
            if threaded:
                self._run_threaded(pool, state)
            else:
                self._run_serial(state)
            error = self.mailbox.error
            if error is not None:
                raise error[1].with_traceback(error[2])
        finally:
            self.mailbox.error = None
            self.mailbox.items.clear()
            for in_flight in self.in_flight:
                in_flight.clear()
        return cast(list[Tensor], self.losses)

    def _run_serial(self, state: ThreadState) -> None:
        rows = simulate(self.actions)
        for column in range(max((len(row) for row in rows), default=0)):
            for j, row in enumerate(rows):
                action = row[column] if column < len(row) else None
                if action is not None:
                    self._task(j, state, (action,)).run()
                    if self.mailbox.cancelled:
                        return

    def _run_threaded(self, pool: WorkerPool, state: ThreadState) -> None:
        """Run each partition's program on its worker and wait until every one has ended."""
        pool.run_shares(
            [self._task(j, state, actions).run for j, actions in enumerate(self.actions)],
            lambda j, exc_info: self.mailbox.cancel(exc_info),  # raised around a program
            lambda: self.mailbox.cancel(None),
        )

    def _task(self, j: int, state: ThreadState, actions: Sequence[Action]) -> Task:
        def program() -> Batch:
            try:
                for action in actions:
                    if self.mailbox.cancelled:
                        break
                    if action.kind == "forward":
                        self._forward(j, action.microbatch)
                    else:
                        self._backward(j, action.microbatch)
            except _Cancelled:
                pass
            except BaseException:
                self.mailbox.cancel(cast(ExcInfo, sys.exc_info()))
            return _NOTHING

        return Task(self.devices[j], self.compute_streams[j], state, compute=program)

    def _record(
        self, phase: Phase, i: int, j: int, backward: bool, function: Callable[[], _T]
    ) -> _T:
        tracer = self.tracer
        if tracer is None:
            return function()
        if tracer.local_profile and threading.get_ident() != tracer.caller:
            _warn_workers_unseen()
        stream = self.compute_streams[j]
        return tracer._run(phase, i, j, self.devices[j], stream, backward, function)

    def _run_locked(self, j: int, compute: Callable[[], Batch]) -> Batch:
        """Run ``compute`` under the generator lock when the partition draws (see traits)."""
        if self.checkpoint_stop == 0:
            return compute()
        return self.traits.run(j, self.devices[j], compute)

    # -- messages ------------------------------------------------------------------------

    def _send(
        self,
        source: int,
        target: int,
        i: int,
        key: Hashable,
        values: Sequence[Tensor | None],
        atomic: bool = False,
        needs_grad: bool = False,
    ) -> None:
        """Send micro-batch ``i``'s ``values`` from partition ``source`` to ``target``.

        ``needs_grad``: the values come from a checkpointed forward pass, without autograd
        history; their recomputation will need gradients.
        """
        present = tuple(value is not None for value in values)
        tensors = [value for value in values if value is not None]
        requires_grad = tuple(
            tensor.requires_grad or (needs_grad and _differentiable(tensor)) for tensor in tensors
        )
        batch = Batch(tuple(tensor.detach() for tensor in tensors))
        if tensors:
            # The copy to the other partition waits for this partition's computation.
            wait(batch, self.compute_streams[source], self.copy_streams[source][i])
        message = _Message(source, atomic, present, requires_grad, batch)
        self.mailbox.put(target, key, message)

    def _receive(
        self, j: int, i: int, key: Hashable, backward: bool
    ) -> tuple[_Message, list[Tensor | None]]:
        """Wait for a message to partition ``j`` and bring its tensors to ``j``'s device."""
        message = self.mailbox.take(j, key)
        tensors = message.tensors
        if len(tensors):
            source = message.source
            same_device = self.devices[source] == self.devices[j]
            source_stream = self.copy_streams[source][i]
            target_stream = self.copy_streams[j][i]
            device = self.devices[j]

            def transfer() -> None:
                move(tensors, i, j, source_stream, target_stream, device, same_device, None)

            if same_device:
                transfer()
            else:
                self._record(Phase.COPY, i, j, backward, transfer)
            wait(tensors, target_stream, self.compute_streams[j])
        moved = iter(tensors)
        return message, [next(moved) if here else None for here in message.present]

    # -- forward -------------------------------------------------------------------------

    def _forward(self, j: int, i: int) -> None:
        n = len(self.partitions)
        grad = self.backward
        if j == 0:
            batch = self.inputs[i]
        else:
            message, values = self._receive(j, i, ("forward", i, j), False)
            flags = message.requires_grad
            tensors = [
                _leaf(cast(Tensor, t), grad and r) for t, r in zip(values, flags, strict=True)
            ]
            batch = Batch(tensors[0] if message.atomic else tuple(tensors))
        call: SkipCall | None = None
        layers: Callable[[TensorOrTensors], TensorOrTensors] = self.partitions[j]
        what = f"output of partition {j}"
        if self.layout is not None and self.layout.has_skippables(j):
            skips_in: dict[SkipKey, Tensor | None] = {}
            for source in self.skip_sources[j]:
                skips_in.update(self._receive_skips(j, i, ("skips", i, j, source), grad))
            provides = [route.key for route in self.layout.provides(j)]
            call = SkipCall(self.partitions[j], what, batch, skips_in, provides)
            batch = call.flat_input(batch, skips_in)
            layers = call
        entry = _InFlight(batch, call)
        checkpointed = grad and i < self.checkpoint_stop

        def function(input: TensorOrTensors) -> TensorOrTensors:
            return check(layers(input), what)

        def compute() -> Batch:
            if not checkpointed:
                return self.traits.call(j, function, what, batch, shared=True)
            if self.traits.draws[j] is not False:
                entry.rng = save_rng_states(self.devices[j])
            copy_input = self.traits.modifies_input[j] is not False
            arguments = clone(batch) if copy_input else batch
            versions = [tensor._version for tensor in arguments]
            with torch.no_grad(), enable_checkpointing():
                output = arguments.call(function, what)
            if copy_input:
                self.traits.modifies_input[j] = any(
                    t._version != v for t, v in zip(arguments, versions, strict=True)
                )
            return output

        output = self._record(Phase.FORWARD, i, j, False, lambda: self._run_locked(j, compute))
        if grad and not checkpointed:
            entry.outputs = output.tensors
        # A checkpointed output has no autograd history; its recomputation will need
        # gradients where an input does, or the partition has parameters to train.
        needs_grad = checkpointed and (
            self.trainable[j] or any(tensor.requires_grad for tensor in batch)
        )
        main, skips_out = _split(call, output)
        if j == n - 1:
            if not checkpointed:  # else the loss is computed once, after the recomputation
                self._loss(i, j, main, entry, keep=grad)
        else:
            key = ("forward", i, j + 1)
            self._send(j, j + 1, i, key, main.tensors, main.atomic, needs_grad)
        if self.layout is not None:
            for target in self.skip_targets[j]:
                keys = [r.key for r in self.layout.provides(j) if r.pop_partition == target]
                values = [skips_out[key] for key in keys]
                self._send(j, target, i, ("skips", i, target, j), values, needs_grad=needs_grad)
        if grad:
            self.in_flight[j][i] = entry

    def _receive_skips(
        self, j: int, i: int, key: Hashable, grad: bool
    ) -> dict[SkipKey, Tensor | None]:
        assert self.layout is not None
        message, values = self._receive(j, i, key, False)
        source = message.source
        keys = [r.key for r in self.layout.requires(j) if r.stash_partition == source]
        flags = iter(message.requires_grad)
        leaves = [None if value is None else _leaf(value, grad and next(flags)) for value in values]
        return dict(zip(keys, leaves, strict=True))

    def _loss(self, i: int, j: int, main: Batch, entry: _InFlight, keep: bool) -> None:
        def compute() -> Tensor:
            return self._call_loss(i, main)

        loss = self._record(Phase.LOSS, i, j, False, compute)
        self.losses[i] = loss.detach()
        if keep:
            entry.loss = self._scaled(i, loss)

    def _call_loss(self, i: int, main: Batch) -> Tensor:
        loss = self.loss_fn(main.value, self.targets[i].value)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            seen = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor (micro-batch {i}, loss_fn returned: {seen})"
            )
        return loss

    def _scaled(self, i: int, loss: Tensor) -> Tensor:
        scale = self.scales[i]
        return loss if scale == 1.0 else loss * scale

    # -- backward ------------------------------------------------------------------------

    def _backward(self, j: int, i: int) -> None:
        n = len(self.partitions)
        entry = self.in_flight[j].pop(i)
        # The gradients of the partition's flat output: its main output's, then its skips'.
        grads: list[Tensor | None] = []
        if j != n - 1:
            grads = self._receive(j, i, ("backward", i, j), True)[1]
        skip_grads: dict[SkipKey, Tensor | None] = {}
        if self.layout is not None:
            for target in self.skip_targets[j]:
                values = self._receive(j, i, ("skip-grads", i, j, target), True)[1]
                keys = [r.key for r in self.layout.provides(j) if r.pop_partition == target]
                skip_grads.update(zip(keys, values, strict=True))
        if i < self.checkpoint_stop:
            self._recompute(j, i, entry)

        def compute() -> None:
            roots: list[Tensor] = []
            gradients: list[Tensor] = []
            if entry.loss is not None and entry.loss.requires_grad:
                roots.append(entry.loss)
                gradients.append(torch.ones_like(entry.loss))
            outputs = entry.outputs or ()
            if entry.call is not None:
                assert entry.call.structure is not None
                grads.extend(skip_grads.get(key) for key in entry.call.structure[2])
            for tensor, gradient in zip(outputs, grads, strict=False):
                if gradient is not None and tensor.requires_grad:
                    roots.append(tensor)
                    gradients.append(gradient)
            if roots:
                _run_backward(roots, gradients)

        self._record(Phase.BACKWARD, i, j, True, compute)
        entry.outputs = entry.loss = None
        inputs, entry.inputs = entry.inputs.tensors, _NOTHING
        if j == 0:
            return
        # The gradients of the partition's inputs go back where the inputs came from.
        call = entry.call
        count = call.inputs if call is not None else len(inputs)
        self._send(j, j - 1, i, ("backward", i, j - 1), [_grad(t) for t in inputs[:count]])
        if call is not None and self.layout is not None:
            by_key = dict(zip(call.in_keys, inputs[count:], strict=True))
            for source in self.skip_sources[j]:
                keys = [r.key for r in self.layout.requires(j) if r.stash_partition == source]
                values = [_grad(by_key[key]) if key in by_key else None for key in keys]
                self._send(j, source, i, ("skip-grads", i, source, j), values)

    def _recompute(self, j: int, i: int, entry: _InFlight) -> None:
        n = len(self.partitions)
        device = self.devices[j]
        call = entry.call
        what = f"output of partition {j}"
        layers: Callable[[TensorOrTensors], TensorOrTensors] = (
            call if call is not None else self.partitions[j]
        )

        def function(input: TensorOrTensors) -> TensorOrTensors:
            return check(layers(input), what)

        def compute() -> Batch:
            rng = entry.rng
            replay = restore_rng_states(device, rng) if rng is not None else nullcontext()
            with replay, torch.enable_grad(), enable_recomputing():
                arguments = entry.inputs
                if self.traits.modifies_input[j]:
                    arguments = clone(arguments)
                output = arguments.call(function, what)
            return output

        output = self._record(Phase.RECOMPUTE, i, j, True, lambda: self._run_locked(j, compute))
        entry.outputs = output.tensors
        if j == n - 1:
            # The loss of a checkpointed micro-batch, once: its forward pass skipped it.
            self._loss(i, j, _split(call, output)[0], entry, keep=True)


_NOTHING = Batch(())

# torch.autograd.backward checks and converts its arguments in Python on every call,
# which costs about as much as a small partition's backward pass. The roots and gradients
# here are made to match (a gradient per root, of its shape, dtype and device), so the
# engine call behind it is made directly where this PyTorch has it (as gpipe_checkpoint
# does for a recomputed graph).
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _run_backward(roots: list[Tensor], gradients: list[Tensor]) -> None:
    """``torch.autograd.backward(roots, gradients)``, gradients accumulating into leaves."""
    if _engine_run_backward is None:  # pragma: no cover - torch < 2.3
        torch.autograd.backward(roots, gradients)
        return
    _engine_run_backward(
        tuple(roots), tuple(gradients), False, False, (), allow_unreachable=True,
        accumulate_grad=True,
    )  # fmt: skip


def _split(call: SkipCall | None, output: Batch) -> tuple[Batch, dict[SkipKey, Tensor | None]]:
    """A partition's main output and the skips it stashed for later partitions."""
    if call is None:
        return output, {}
    return call.split(output)


def _leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    """Where a partition's graph starts: ``tensor`` detached, needing grad as it did."""
    return tensor.detach().requires_grad_(requires_grad and _differentiable(tensor))


def _grad(tensor: Tensor) -> Tensor | None:
    return tensor.grad if tensor.requires_grad else None
