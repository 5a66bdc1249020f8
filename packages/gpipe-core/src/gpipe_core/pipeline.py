"""The fill-drain (GPipe) schedule: micro-batches flow through partitions clock by clock.

At clock ``k`` partition ``j`` runs micro-batch ``k - j``, so ``m`` micro-batches cross
``n`` partitions in ``m + n - 1`` clocks, every partition working on a different
micro-batch at the same time.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import cached_property, partial
from queue import SimpleQueue

import torch
from torch import nn

from gpipe_checkpoint import (
    Checkpointing,
    RNGStates,
    device_rng_lock,
    is_checkpointing,
    is_recomputing,
    save_rng_states,
)
from gpipe_microbatch import (
    AbstractStream,
    Batch,
    TensorOrTensors,
    ThreadState,
    check,
    fork,
    is_cuda,
    join,
    use_device,
    use_stream,
    wait,
)
from gpipe_skip import SkipLayout

from .skips import PipelineSkips
from .tracing import Tracer, move
from .worker import ExcInfo, Task, WorkerPool

__all__ = ["PartitionTraits", "Pipeline", "clock_cycles"]

_Function = Callable[[TensorOrTensors], TensorOrTensors]


class _LockDepth(threading.local):
    """How many generator locks the current thread holds through :class:`PartitionTraits`."""

    depth = 0


_held = _LockDepth()


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """The fill-drain schedule: for each clock, the ``(micro-batch, partition)`` pairs.

    Example:
        >>> list(clock_cycles(3, 2))
        [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def clone(batch: Batch) -> Batch:
    """A batch of copies of ``batch``'s tensors (for a partition that modifies its input)."""
    return Batch(batch.tensor.clone() if batch.atomic else tuple(t.clone() for t in batch))


def trainable(partitions: Sequence[nn.Module]) -> list[bool]:
    """Whether each partition has parameters to train: a checkpointed output needs
    gradients then, even where its input needs none."""
    return [any(p.requires_grad for p in partition.parameters()) for partition in partitions]


class PartitionTraits:
    """What a pipeline run learns about each partition from its first checkpointed task.

    A model may change between runs (a dropout probability raised from 0, a layer put in
    eval mode), so every run learns afresh; the first task of each partition pays for it.

    **Random draws.**
    Partitions on one CPU (or one CUDA device) share a generator. When a checkpointed
    micro-batch draws random numbers while another worker draws from the same generator,
    the draws interleave and the recomputation could not replay them. So in a pipeline run
    with checkpointing, a partition that draws random numbers holds its device's
    generator lock while it computes; partitions that draw none run freely. Whether a
    partition draws is probed under the lock by its first task in such a run.

    **In-place input.** A partition that modifies its input in place (it starts with
    ``nn.ReLU(inplace=True)``, say) cannot be recomputed from that input. The first
    checkpointed task of each partition hands it a copy and watches; partitions seen
    modifying their input keep getting copies, the others get their input as it is.
    Tasks without checkpointing are watched the same way when there are several
    micro-batches: the inputs are then views of one mini-batch or aliases of other
    tensors of the run, which share version counters (and views that need grad cannot be
    modified in place at all).
    """

    def __init__(self, partitions: int) -> None:
        self.draws: list[bool | None] = [None] * partitions
        self.modifies_input: list[bool | None] = [None] * partitions

    def checkpoint(
        self, j: int, function: _Function, batch: Batch, requires_grad: bool
    ) -> Checkpointing:
        """A :class:`Checkpointing` of partition ``j``, copying its input if needed."""
        copy_input = self.modifies_input[j] is not False
        return Checkpointing(function, batch, copy_input=copy_input, requires_grad=requires_grad)

    def learn(self, j: int, chk: Checkpointing, join: torch.Tensor | None = None) -> Batch:
        """Run the checkpoint phase of ``chk`` (joining ``join``) and remember whether it
        modified its input."""
        batch = chk.checkpoint(join)
        if self.modifies_input[j] is None or chk.input_modified:
            self.modifies_input[j] = chk.input_modified
        return batch

    def call(self, j: int, function: _Function, what: str, batch: Batch, shared: bool) -> Batch:
        """Call partition ``j`` (``function``) on ``batch`` without checkpointing.

        ``shared``: the input shares its version counter with other tensors of the run
        (views of the mini-batch, or the aliases that order backward between
        micro-batches). Then the partition gets a copy and is watched, until it is seen
        not modifying its input in place (see above).
        """
        if not shared or self.modifies_input[j] is False or not torch.is_grad_enabled():
            return batch.call(function, what)
        copies = clone(batch)
        versions = [tensor._version for tensor in copies]
        output = copies.call(function, what)
        self.modifies_input[j] = any(
            tensor._version != version for tensor, version in zip(copies, versions, strict=True)
        )
        return output

    def run(self, j: int, device: torch.device, compute: Callable[[], Batch]) -> Batch:
        """Run ``compute`` for partition ``j``, under the generator lock if it draws."""
        draws = self.draws[j]
        if draws is False:
            return compute()
        with device_rng_lock(device):
            _held.depth += 1
            try:
                if draws is True:
                    return compute()
                before = save_rng_states(device)
                batch = compute()
                after = save_rng_states(device)
                self.draws[j] = not _same_states(before, after)
                return batch
            finally:
                _held.depth -= 1


def _same_states(a: RNGStates, b: RNGStates) -> bool:
    if not torch.equal(a.cpu, b.cpu):
        return False
    return a.cuda is None or b.cuda is None or torch.equal(a.cuda, b.cuda)


def _recompute(chk: Checkpointing, forked: list[torch.Tensor] | None, batch: Batch) -> None:
    """Hook ``chk``'s recompute phase onto ``batch``; keep the phony it forks in ``forked``."""
    phony = chk.recompute_in_backward(batch)
    if forked is not None:
        forked.append(phony)


class _Flow:
    """What the workers of one pipeline run share.

    Partition ``j``'s worker learns from ``inboxes[j]`` that partition ``j - 1`` has
    finished its next micro-batch (True) or has stopped (False). When a task fails, the
    tasks of later clocks are not run, as in clock order (see :func:`clock_cycles`), and
    the caller gets the error of the earliest clock (the first partition's of that clock).
    """

    def __init__(self, partitions: int) -> None:
        self.inboxes: list[SimpleQueue[bool]] = [SimpleQueue() for _ in range(partitions)]
        #: Tasks of clocks after this one are not run.
        self.stop = sys.maxsize
        self.lock = threading.Lock()
        self.errors: list[tuple[int, int, ExcInfo]] = []

    def fail(self, clock: int, j: int, exc_info: ExcInfo) -> None:
        """Record partition ``j``'s error at ``clock``; later clocks are not run."""
        with self.lock:
            self.errors.append((clock, j, exc_info))
            self.stop = min(self.stop, clock)

    def raise_first(self) -> None:
        """Raise the error of the earliest clock, if any, with its traceback."""
        if not self.errors:
            return
        _, _, (_, exc, tb) = min(self.errors, key=lambda error: error[:2])
        self.errors.clear()
        try:
            raise exc.with_traceback(tb)
        finally:
            del exc, tb


class Pipeline:
    """One pipelined forward pass over ``partitions``.

    Args:
        partitions: the partitions, each already on its device.
        devices: the device of each partition.
        copy_streams: ``copy_streams[j][i]`` carries micro-batch ``i`` into partition ``j``.
        checkpoint_stop: micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed.
        skip_layout: the skip connections between partitions, if any (see
            :mod:`gpipe_core.skips`).
        tracer: labels and records the tasks (when a profiler or a trace is active).
    """

    def __init__(
        self,
        partitions: Sequence[nn.Sequential],
        devices: Sequence[torch.device],
        copy_streams: Sequence[Sequence[AbstractStream]],
        compute_streams: Sequence[AbstractStream],
        checkpoint_stop: int,
        skip_layout: SkipLayout | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.partitions = partitions
        self.devices = devices
        self.copy_streams = copy_streams
        self.compute_streams = compute_streams
        self.checkpoint_stop = checkpoint_stop
        self.traits = PartitionTraits(len(partitions))
        self.tracer = tracer
        self.skips: PipelineSkips | None = None
        if skip_layout is not None and not skip_layout.empty:
            self.skips = PipelineSkips(skip_layout, devices, copy_streams, compute_streams, tracer)

    @cached_property
    def trainable(self) -> list[bool]:
        """Whether each partition has parameters to train (see :func:`trainable`); only
        checkpointing and tracing ask, so runs without them do not walk the parameters."""
        return trainable(self.partitions)

    def run(self, batches: list[Batch], pool: WorkerPool) -> None:
        """Run every micro-batch through every partition; ``batches`` is updated in place.

        With one partition the tasks run in the calling thread; otherwise each partition's
        tasks run on its worker in ``pool``, each task as soon as its input is ready (see
        :class:`_Flow`). A pipeline nested in a checkpointed partition also runs in the
        calling thread, in clock order: the outer recomputation must replay its random
        draws in the same order, and its workers would wait forever for a generator lock
        the calling thread holds.
        """
        state = ThreadState.capture()
        nested = _held.depth > 0 or is_checkpointing() or is_recomputing()
        if len(self.partitions) == 1 or nested:
            phonies: list[torch.Tensor | None] = [None] * len(self.partitions)
            for schedule in clock_cycles(len(batches), len(self.partitions)):
                for i, j in schedule:
                    # The caller's state is in effect: this is the caller's thread.
                    with self._placed(j):
                        phonies[j] = self._step(batches, i, j, state, phonies[j])
            return
        flow = _Flow(len(self.partitions))

        def stop() -> None:
            flow.stop = -1  # every worker stops after its current task

        pool.run_shares(
            [partial(self._flow, batches, j, state, flow) for j in range(len(self.partitions))],
            lambda j, exc_info: flow.fail(-1, j, exc_info),  # not raised by a task
            stop,
        )
        flow.raise_first()

    def _flow(self, batches: list[Batch], j: int, state: ThreadState, flow: _Flow) -> None:
        """Run partition ``j``'s tasks in order, each as soon as its input is ready.

        Runs on partition ``j``'s worker, under the caller's thread ``state``. The graph is
        the one clock order builds: in backward, partition ``j`` finishes micro-batch
        ``i`` before ``i - 1``, as the phony forked off its output for ``i - 1`` (before
        partition ``j + 1`` gets that output) is joined to its task for ``i``.
        """
        outbox = flow.inboxes[j + 1] if j + 1 < len(self.partitions) else None
        done = False
        try:
            # The caller's state is applied once, as the caller's thread has it throughout.
            with self._placed(j), state.apply():
                done = self._steps(batches, j, state, flow)
        finally:
            if outbox is not None and not done:
                outbox.put(False)

    def _steps(self, batches: list[Batch], j: int, state: ThreadState, flow: _Flow) -> bool:
        """The loop of :meth:`_flow`; returns whether every task ran."""
        m, n = len(batches), len(self.partitions)
        inbox, outbox = flow.inboxes[j], (flow.inboxes[j + 1] if j + 1 < n else None)
        phony: torch.Tensor | None = None
        for i in range(m):
            if j != 0 and not inbox.get():
                return False  # the previous partition stopped
            if i + j > flow.stop:
                return False  # a task of an earlier clock failed: clock order stops here
            try:
                phony = self._step(batches, i, j, state, phony)
            except BaseException:
                exc_type, exc, tb = sys.exc_info()
                assert exc_type is not None and exc is not None and tb is not None
                flow.fail(i + j, j, (exc_type, exc, tb))
                del exc_type, exc, tb
                return False
            if outbox is not None:
                outbox.put(True)
        return True

    def _placed(self, j: int) -> AbstractContextManager[object]:
        """Make partition ``j``'s device and compute stream current (nothing to do on CPU)."""
        device, stream = self.devices[j], self.compute_streams[j]
        if device.type != "cuda" and not is_cuda(stream):
            return nullcontext()
        stack = ExitStack()
        stack.enter_context(use_device(device))
        stack.enter_context(use_stream(stream))
        return stack

    def _step(
        self, batches: list[Batch], i: int, j: int, state: ThreadState, phony: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Run task ``(i, j)`` and its fence; the caller makes the partition's device,
        stream and ``state`` current.

        ``phony``: forked off partition ``j``'s output for micro-batch ``i - 1``; it is
        joined to this task, so that in backward partition ``j`` finishes micro-batch
        ``i`` before ``i - 1`` (each recomputation then runs right before its own
        backward). Returns the phony for micro-batch ``i + 1`` (None after the last).
        """
        checkpointed = i < self.checkpoint_stop
        batch = batches[i]
        if phony is not None and not checkpointed:
            # A checkpointed task joins the phony itself, saving an autograd node.
            index = batch.find_tensor_idx()
            batch.replace(index, join(batch[index], phony))
        if j != 0:
            move(
                batch, i, j, self.copy_streams[j - 1][i], self.copy_streams[j][i],
                self.devices[j], self.devices[j - 1] == self.devices[j], self.tracer,
            )  # fmt: skip
        forked: list[torch.Tensor] = []
        task = self._task(batches, i, j, state, phony if checkpointed else None, forked)
        output = task.compute()
        if task.finalize is not None:
            task.finalize(output)
        self._finish(batches, i, j, output)
        if i == len(batches) - 1:
            return None
        if forked:
            # Forked off the checkpointed output by its recompute phase.
            return forked[0]
        output = batches[i]
        index = output.find_tensor_idx()
        tensor, phony = fork(output[index])
        output.replace(index, tensor)
        return phony

    def _finish(self, batches: list[Batch], i: int, j: int, batch: Batch) -> None:
        """Store partition ``j``'s output for micro-batch ``i``."""
        if self.skips is not None and self.skips.involves(j):
            batch = self.skips.finish(i, j, batch)
        if j != len(self.partitions) - 1:
            # The copy to the next partition waits for this computation.
            wait(batch, self.compute_streams[j], self.copy_streams[j][i])
        batches[i] = batch

    def _task(
        self,
        batches: list[Batch],
        i: int,
        j: int,
        state: ThreadState,
        phony: torch.Tensor | None = None,
        forked: list[torch.Tensor] | None = None,
    ) -> Task:
        """Task ``(i, j)``; a checkpointed one joins ``phony`` and appends the phony its
        recompute phase forks to ``forked``."""
        partition = self.partitions[j]
        device = self.devices[j]
        stream = self.compute_streams[j]
        batch = batches[i]
        if j != 0:
            wait(batch, self.copy_streams[j][i], stream)
        what = f"output of partition {j}"
        tracer = self.tracer
        if tracer is not None:
            tracer.input(batch, i, j, device, stream, force=self.trainable[j])
        layers: _Function = partition
        if self.skips is not None and self.skips.involves(j):
            layers, batch = self.skips.prepare(i, j, partition, what, batch)

        def function(input: TensorOrTensors) -> TensorOrTensors:
            return check(layers(input), what)

        checkpointed: _Function = function
        if tracer is not None and i < self.checkpoint_stop:
            checkpointed = tracer.recomputed(function, i, j, device, stream)

        compute: Callable[[], Batch]
        finalize: Callable[[Batch], None] | None = None
        if i < self.checkpoint_stop:
            chk = self.traits.checkpoint(j, checkpointed, batch, self.trainable[j])
            compute = partial(self.traits.learn, j, chk, phony)
            finalize = partial(_recompute, chk, forked)
        else:
            compute = partial(self.traits.call, j, layers, what, batch, len(batches) > 1)
        if tracer is not None:
            wrapped = tracer.task(i, j, device, stream, compute, finalize, i < self.checkpoint_stop)
            compute, finalize = wrapped
        if self.checkpoint_stop > 0:
            # The lock must also cover the generator states the checkpoint phase saves.
            # (A task waiting for it is not busy: the tracer times what runs under it.)
            compute = partial(self.traits.run, j, device, compute)
        return Task(device, stream, state, compute=compute, finalize=finalize)
