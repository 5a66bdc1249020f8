"""The runner: each worker's action list, executed on its worker thread, with one failure channel.

A run executes action lists (see :mod:`gpipe_core.schedule`) over partitions
(:mod:`gpipe_core.run._partition_run`): each worker's list on its worker thread, for all the
partitions of that worker, each action as soon as the messages it needs have arrived through
the transport (:mod:`gpipe_core.transport._transport`). The forward action of micro-batch ``i`` on
partition ``j`` receives its activations from partition ``j - 1`` (the first partition takes
the micro-batch itself) and the skips it pops, runs the partition, and sends its output and
the skips it stashes on; the backward action (or the input gradient of a split one) receives
the gradients of both, runs the partition's backward pass and sends its input's gradients
back; a weight gradient sends nothing.

Messages between two partitions of one worker stay in that worker's thread: a mailbox of the
run, never the transport.

**Turns.** Before each action a worker asks for its turn (:meth:`Turns.take_turn`), and
tells how long the action computed (:meth:`Turns.took`): on the CPU, short actions of the
workers run one at a time, so that threads do not hand each other the interpreter lock at
every operator (see :mod:`gpipe_core.run._turns`). A worker gives its turn up when its
list ends, however it ends (:meth:`Turns.end_turn`).

**Failures.** The first error of a run is kept (:class:`FailureChannel`); it cancels the
transport, so that every wait for a message ends, and every worker stops after its
current action. The caller gets the error with its traceback; among errors raised at
about the same time, the one of the earliest action in unit time (:func:`simulate`), then
the first partition, so that the outcome does not depend on thread timing.

**Serially.** With one partition, inside a checkpointed partition (a nested pipeline), or
where the turns make the whole run one turn (every action short, :meth:`Turns.one_turn`),
the actions run in the calling thread, in the order of :func:`simulate`: no wait for a
message ever blocks. In one turn, an action that blocks on something else (a layer
waiting for another partition's layer) hands the run over to the workers after
:attr:`Turns.hand_over_after` (see :meth:`_Executor.run_one_turn`).

It must not know which transport carries the messages (threads or processes), nor what a
partition computes: a partition of another process is None here, and a transport is its
interface.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import partial
from types import TracebackType
from typing import cast

import torch
from torch import Tensor

from gpipe_microbatch import Batch, Container, ThreadState, use_device
from gpipe_skip import SkipKey

from .._errors import add_note
from .._stream import is_cuda, use_stream
from ..schedule._action import Action, Phase
from ..schedule._simulate import simulate
from ..transport._transport import Cancelled, Message, MessageKey, Transport, outgoing
from ._description import RunDescription
from ._gradient_sync import GradientSync
from ._lanes import DecodeRun, Stopped
from ._order import serial_order
from ._partition_run import PartitionRun
from ._threads import NO_SHARE, ThreadShare
from ._turns import Turns
from ._worker import ExcInfo, Jobs, WorkerPool

__all__ = ["FailureChannel", "run"]


class FailureChannel:
    """The failure channel of one run: the first error, and the cancellation it causes
    (what a rank tells the others of its failure is :class:`gpipe_core._errors.Failure`)."""

    def __init__(
        self,
        transport: Transport,
        actions: Sequence[Sequence[Action]],
        workers: Sequence[int] | None = None,
        lanes: int | None = None,
    ) -> None:
        self.transport = transport
        self.actions = actions
        #: The worker of each partition (None: partition ``j`` on worker ``j``).
        self.workers = workers
        #: A decode run's lanes (None: a forward or a step).
        self.lanes = lanes
        self.lock = threading.Lock()
        self.errors: list[tuple[int, int, ExcInfo]] = []
        self.cancelled = False

    def fail(self, w: int, position: int, exc_info: ExcInfo) -> None:
        """Keep worker ``w``'s error, raised in its action at ``position`` (-1: outside
        any action), and end the run (see :meth:`Transport.fail`)."""
        with self.lock:
            self.errors.append((w, position, exc_info))
        self.cancelled = True
        action = self.actions[w][position] if position >= 0 else None
        if action is not None and action.partition is not None:
            partition = action.partition
        else:
            partition = w if self.workers is None else list(self.workers).index(w)
        where = None
        if action is not None:
            where = f"{action.kind} of micro-batch {action.microbatch} on partition {partition}"
        self.transport.fail(where, exc_info[1])

    def cancel(self) -> None:
        """Stop every worker after its current action; wake every wait."""
        self.cancelled = True
        self.transport.cancel()

    def raise_first(self) -> None:
        """Raise the first error, if any, with its traceback."""
        if not self.errors:
            return
        errors, self.errors = self.errors, []
        if len(errors) > 1:
            # The unit-time column of each action (computed only when errors compete).
            rows = simulate(self.actions, placement=self.workers, lanes=self.lanes)

            def order(error: tuple[int, int, ExcInfo]) -> tuple[int, int]:
                j, position, _ = error
                return (-1 if position < 0 else rows[j].index(self.actions[j][position]), j)

            errors.sort(key=order)
        _, _, (_, exc, tb) = errors[0]
        try:
            raise exc.with_traceback(tb)
        finally:
            del exc, tb, errors


def run(
    description: RunDescription,
    partitions: Sequence[PartitionRun | None],
    transport: Transport,
    pool: WorkerPool,
    syncs: Mapping[int, GradientSync] | None = None,
) -> list[Batch | None]:
    """Run each worker's actions of the run (``description``) and return the last
    partition's output per micro-batch (with its graph) where autograd drives the backward
    pass (``forward()``); a step keeps none (None each), since holding them would keep every
    micro-batch's graph there.

    Args:
        description: the run: its action lists, micro-batches (on the first partition's
            device), the caller's thread state (applied in every worker), whether it is
            threaded, the worker of each partition and the workers' intra-op threads.
        partitions: the partitions, in pipeline order; None for a partition of another
            process, whose actions that process runs.
        transport: carries messages between them.
        pool: the worker threads, one per worker of this process.
        syncs: the gradient sync of each sharded partition of this process (by index).
    """
    actions, inputs, threaded = description.actions, description.batches, description.threaded
    workers, state = description.workers, description.state
    assert state is not None  # captured when the run was described
    intra_op_threads = description.intra_op_threads
    outputs: list[Batch | None] = [None] * len({action.microbatch for action in actions[0]})
    local_run = all(partition is not None for partition in partitions)
    turns = Turns.of(transport)
    one_turn = threaded and local_run and turns.one_turn(actions)
    if one_turn:
        # Every action is short: the run is one turn, in this thread (no worker to wake),
        # unless an action blocks (see _Executor.run_one_turn).
        threaded = False
    decode = description.decode
    lanes = None if decode is None else decode.lanes
    failure = FailureChannel(transport, actions, workers, lanes)
    # Workers divide the caller's intra-op threads; a run in the calling thread keeps them.
    share = ThreadShare(intra_op_threads, torch.get_num_threads()) if threaded else NO_SHARE
    where = list(range(len(partitions))) if workers is None else list(workers)
    executor = _Executor(
        partitions, transport, turns, inputs, outputs, failure, share, where, decode, syncs or {}
    )  # fmt: skip
    local = sorted({where[j] for j, partition in enumerate(partitions) if partition is not None})
    try:
        if threaded:
            pool.run_jobs(
                [partial(executor.run, j, actions[j], state) for j in local],
                # Not raised by an action.
                lambda k, exc_info: failure.fail(local[k], -1, exc_info),
                failure.cancel,
            )
        elif one_turn:
            with state.apply():
                pool.run_here(partial(executor.run_one_turn, actions, state))
        elif local_run:
            with state.apply():
                executor.run_serially(actions)
        else:
            # The one worker of this process; the others' actions run elsewhere.
            (w,) = local
            executor.run(w, actions[w], state)
        failure.raise_first()
    finally:
        transport.reset()
    return outputs


def _stopped(message: Message) -> bool:
    """Whether ``message`` carries a stopped lane's marker (one value, not a tensor)."""
    return message.atomic and not message.present[0] and isinstance(message.others[0], Stopped)


class _Watch:
    """What the calling thread of a one-turn run shows its watcher (see
    :meth:`_Executor.run_one_turn`), under ``lock``."""

    def __init__(self, workers: int, patience: float) -> None:
        #: How long an action runs before the workers take over.
        self.patience = patience
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        #: The worker whose action the calling thread runs (None: between actions), and
        #: since when.
        self.current: int | None = None
        self.since = 0.0
        #: Each worker's next position in its list.
        self.positions = [0] * workers
        #: Whether the workers took over; whether the calling thread is done.
        self.handed = False
        self.done = False


def _needs_device(partition: PartitionRun | None) -> bool:
    """Whether the partition's work needs its device and compute stream made current (on
    CUDA; not on the CPU, nor for a partition of another process)."""
    return partition is not None and (partition.device.type == "cuda" or is_cuda(partition.stream))


def _on_device(partition: PartitionRun) -> AbstractContextManager[object]:
    """Make the partition's device and compute stream current (nothing to do on the CPU)."""
    if not _needs_device(partition):
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(use_device(partition.device))
    stack.enter_context(use_stream(partition.stream))
    return stack


class _Computing:
    """Around partition ``j``'s computation of an action of ``kind``: its share of the
    cores, and its time told to the turns (see :meth:`_Executor.computing`)."""

    __slots__ = ("j", "kind", "share", "start", "turns")

    def __init__(
        self, turns: Turns, j: int, kind: str, share: AbstractContextManager[object]
    ) -> None:
        self.turns, self.j, self.kind, self.share = turns, j, kind, share

    def __enter__(self) -> None:
        self.share.__enter__()
        self.start = time.perf_counter()

    def __exit__(
        self,
        error_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        seconds = time.perf_counter() - self.start
        self.share.__exit__(error_type, error, traceback)
        if error_type is None:
            self.turns.took(self.j, self.kind, seconds)


class _Executor:
    """How each action runs: messages in, the partition's work, messages out."""

    def __init__(
        self,
        partitions: Sequence[PartitionRun | None],
        transport: Transport,
        turns: Turns,
        inputs: Sequence[Batch],
        outputs: list[Batch | None],
        failure: FailureChannel,
        share: ThreadShare = NO_SHARE,
        workers: Sequence[int] | None = None,
        decode: DecodeRun | None = None,
        syncs: Mapping[int, GradientSync] | None = None,
    ) -> None:
        self.partitions = partitions
        #: FSDP's gradient reduction of each sharded partition (see _gradient_sync).
        self.syncs = syncs or {}
        #: What a decode run adds (None: a forward or a step).
        self.decode = decode
        self.lanes = None if decode is None else decode.lanes
        #: The worker of each partition.
        self.workers = list(range(len(partitions))) if workers is None else list(workers)
        #: The messages between partitions of one worker (each read by the thread that wrote it).
        self.mailbox: dict[MessageKey, Message] = {}
        self.transport = transport
        self.turns = turns
        self.inputs = inputs
        self.outputs = outputs
        self.failure = failure
        self.last = len(partitions) - 1
        self.share = share

    def partition(self, j: int) -> PartitionRun:
        partition = self.partitions[j]
        assert partition is not None, f"partition {j} runs in another process"
        return partition

    def run(self, w: int, actions: Sequence[Action], state: ThreadState, start: int = 0) -> None:
        """Run worker ``w``'s actions in order (from position ``start``) on its thread, under
        the caller's ``state``."""
        failure = self.failure
        partition = self.partition(self.workers.index(w))
        own = [self.partition(j).partition for j, v in enumerate(self.workers) if v == w]
        share = self.share.worker(partition.device, own, not partition.autograd_backward)
        with _on_device(partition), state.apply(), share:
            try:
                for position in range(start, len(actions)):
                    action = actions[position]
                    if failure.cancelled:
                        return
                    try:
                        j = cast(int, action.partition)
                        self.turns.take_turn(j, action.kind)
                        if self.partition(j).device == partition.device:
                            self.act(j, action)
                        else:
                            with _on_device(self.partition(j)):
                                self.act(j, action)
                    except Cancelled:
                        return
                    except BaseException:
                        failure.fail(w, position, cast(ExcInfo, sys.exc_info()))
                        return
            finally:
                self.turns.end_turn()

    def run_serially(self, actions: Sequence[Sequence[Action]]) -> None:
        """Run every action in the calling thread, in :func:`serial_order`."""
        # Where a partition needs its device and stream made current (not on the CPU).
        current = [_needs_device(partition) for partition in self.partitions]
        for action in serial_order(actions, self.workers, self.lanes):
            j = cast(int, action.partition)
            if current[j]:
                with _on_device(self.partition(j)):
                    self.act(j, action)
            else:
                self.act(j, action)

    def run_one_turn(
        self, actions: Sequence[Sequence[Action]], state: ThreadState, jobs: Jobs
    ) -> None:
        """Run every action in the calling thread, in :func:`serial_order`, unless one
        blocks: then the workers take over.

        The serial order assumes that an action needs only what earlier ones produced. A
        layer that waits for another partition's layer (for a later micro-batch, say)
        would wait there forever. So a watcher on one worker's thread, asleep meanwhile,
        looks at the calling thread's action every :attr:`Turns.hand_over_after`; once
        one has run that long, every other worker's list goes on from where it stands on its own
        thread (taking turns, as in a threaded run), and the calling thread, once its
        action returns, goes on with the rest of that worker's list. Each worker's list
        still runs in order, so the results are those of the serial order.
        """
        patience = self.turns.hand_over_after
        if patience is None:
            self.run_serially(actions)
            return
        watch = _Watch(len(actions), patience)
        order = serial_order(actions, self.workers, self.lanes)
        jobs.start(0, partial(self._watch, watch, actions, state, jobs), self._lost)
        blocked: int | None = None
        try:
            for action in order:
                j = cast(int, action.partition)
                w = self.workers[j]
                with watch.lock:  # the watcher hands over only during an action
                    watch.current, watch.since = w, time.perf_counter()
                self.act(j, action)
                with watch.lock:
                    watch.positions[w] += 1
                    watch.current = None
                    if watch.handed:
                        blocked = w
                        break
        except BaseException:
            with watch.lock:
                handed, watch.done = watch.handed, True
                watch.changed.notify()
            if not handed:
                raise
            w = cast(int, watch.current)
            self.failure.fail(w, watch.positions[w], cast(ExcInfo, sys.exc_info()))
            return
        with watch.lock:
            watch.done = True
            watch.changed.notify()
        if blocked is not None:
            self.run(blocked, actions[blocked], state, start=watch.positions[blocked])

    def _watch(
        self, watch: _Watch, actions: Sequence[Sequence[Action]], state: ThreadState, jobs: Jobs
    ) -> None:
        """The watcher of :meth:`run_one_turn`, on worker 0's thread."""
        with watch.lock:
            while True:
                if watch.done:
                    return
                if watch.current is not None:
                    waited = time.perf_counter() - watch.since
                    if waited >= watch.patience:
                        break
                    watch.changed.wait(watch.patience - waited)
                else:
                    watch.changed.wait(watch.patience)
            watch.handed = True
            blocked, starts = watch.current, list(watch.positions)
        mine = None
        for w, position in enumerate(starts):
            if w == blocked or position >= len(actions[w]):
                continue
            if w == 0:
                mine = position
            else:
                run = partial(self.run, w, actions[w], state, position)
                jobs.start(w, run, partial(self.failure.fail, w, -1))
        if mine is not None:
            self.run(0, actions[0], state, start=mine)

    def _lost(self, exc_info: ExcInfo) -> None:
        """The watcher raised (not an action: a worker's thread failed to start)."""
        self.failure.fail(0, -1, exc_info)

    def act(self, j: int, action: Action) -> None:
        try:
            if action.kind is Phase.FORWARD:
                self.forward(j, action.microbatch)
            elif action.kind is Phase.WEIGHT_GRADIENT:
                with self.computing(j, action.kind), self.synced(j, action.microbatch, action.kind):
                    self.partition(j).backward_weight(action.microbatch)
                self.reduced(j, action.microbatch, action.kind)
            else:
                self.backward(j, action.microbatch, split=action.kind is Phase.INPUT_GRADIENT)
        except Cancelled:
            raise
        except Exception as error:
            # Where it happened, as a note: the type and the traceback stay the error's own.
            where = f"(in {action.kind} of micro-batch {action.microbatch} on partition {j})"
            add_note(error, where)
            raise

    def synced(self, j: int, i: int, kind: Phase) -> AbstractContextManager[object]:
        """Around a sharded partition ``j``'s backward task: its gradients accumulate."""
        sync = self.syncs.get(j)
        return nullcontext() if sync is None else sync.backward(i, kind)

    def reduced(self, j: int, i: int, kind: Phase) -> None:
        """After partition ``j``'s backward task of ``kind`` on micro-batch ``i`` and its sends:
        FSDP's gradient reduction, if it was the partition's last (see ``_gradient_sync``)."""
        sync, tracer = self.syncs.get(j), self.partition(j).tracer
        if sync is not None and sync.reduces_after(i, kind):
            with nullcontext() if tracer is None else tracer.reducing(j):
                sync.reduce()

    def computing(self, j: int, kind: str) -> _Computing:
        """Around partition ``j``'s computation of an action of ``kind`` (its messages
        received, none sent yet): its share of the cores, and its time told to the turns,
        which decide from it whether the action takes turns."""
        return _Computing(self.turns, j, kind, self.share.computing(self.partition(j).device))

    def forward(self, j: int, i: int) -> None:
        partition, decode = self.partition(j), self.decode
        if j == 0:
            if decode is None or i < decode.lanes:
                batch = self.inputs[i]
            else:  # a decode run's next round: made from the lane's last output
                message = self.receive(MessageKey("feedback", i - decode.lanes, self.last, 0))
                if _stopped(message):
                    self.pass_stopped(j, i)
                    return
                batch = Batch(message.value(message.values()))
        else:
            message = self.receive(MessageKey("activations", i, j - 1, j))
            if decode is not None and _stopped(message):
                self.pass_stopped(j, i)
                return
            values = partition.accept(message.values(), message.requires_grad)
            batch = Batch(message.value(values))
        skips: dict[SkipKey, Tensor | None] = {}
        for source, keys in partition.pops.items():
            message = self.receive(MessageKey("skips", i, source, j))
            values = partition.accept(message.values(), message.requires_grad)
            skips.update(zip(keys, cast(list[Tensor | None], values), strict=True))
        with self.computing(j, Phase.FORWARD):
            if decode is None:
                output, stashed, needs_grad = partition.forward(i, batch, skips)
            else:
                with decode.store.lane(i % decode.lanes):
                    output, stashed, needs_grad = partition.forward(i, batch, skips)
        if j == self.last:
            if decode is not None:
                self.feed_back(i, decode.next_input(i, output.value))
            # A step's output is not returned (its loss is kept, detached): holding it would
            # keep the graph, and with it what the split backward's W does not need.
            elif partition.autograd_backward:
                self.outputs[i] = output
        else:
            self.send(
                MessageKey("activations", i, j, j + 1),
                output.values,
                atomic=output.atomic,
                needs_grad=needs_grad,
                container=output.container,
            )
        for target, keys in partition.stashes.items():
            values = [stashed[key] for key in keys]
            self.send(MessageKey("skips", i, j, target), values, needs_grad=needs_grad)

    def pass_stopped(self, j: int, i: int) -> None:
        """Micro-batch ``i`` of a decode run is a stopped lane's: partition ``j`` passes
        the marker on, computing nothing."""
        partition = self.partition(j)
        for source in partition.pops:
            self.receive(MessageKey("skips", i, source, j))
        if j == self.last:
            self.feed_back(i, Stopped())
            return
        self.send(MessageKey("activations", i, j, j + 1), [Stopped()], atomic=True)
        for target in partition.stashes:
            self.send(MessageKey("skips", i, j, target), [Stopped()])

    def feed_back(self, i: int, next_input: Batch | Stopped) -> None:
        """Send the lane of micro-batch ``i`` its next round's input (none after the last
        round)."""
        decode = cast(DecodeRun, self.decode)
        if i + decode.lanes >= decode.lanes * decode.rounds:
            return
        key = MessageKey("feedback", i, self.last, 0)
        if isinstance(next_input, Stopped):
            self.send(key, [next_input], atomic=True)
        else:
            self.send(key, next_input.values, atomic=next_input.atomic)

    def backward(self, j: int, i: int, split: bool = False) -> None:
        """The backward pass of micro-batch ``i`` on partition ``j``, or only its input
        gradient if ``split``."""
        partition = self.partition(j)
        grads: list[Tensor | None] = []
        if j != self.last:
            message = self.receive(MessageKey("gradients", i, j + 1, j))
            grads = cast(list[Tensor | None], message.values())
        skip_grads: dict[SkipKey, Tensor | None] = {}
        for target, keys in partition.stashes.items():
            message = self.receive(MessageKey("skip-gradients", i, target, j))
            skip_grads.update(zip(keys, cast(list[Tensor | None], message.values()), strict=True))
        kind = Phase.INPUT_GRADIENT if split else Phase.BACKWARD
        with self.computing(j, kind), self.synced(j, i, kind):
            if split:
                input_grads, popped = partition.backward_input(i, grads, skip_grads)
            else:
                input_grads, popped = partition.backward(i, grads, skip_grads)
        if j != 0:
            self.send(MessageKey("gradients", i, j, j - 1), input_grads)
        for source, keys in partition.pops.items():
            values = [popped.get(key) for key in keys]
            self.send(MessageKey("skip-gradients", i, j, source), values)
        self.reduced(j, i, kind)

    def send(
        self,
        key: MessageKey,
        values: Sequence[object],
        *,
        atomic: bool = False,
        needs_grad: bool = False,
        container: Container = tuple,
    ) -> None:
        """Send a message (see :func:`outgoing`): into the mailbox between partitions of
        one worker (one device, one compute stream: nothing to wait for), else through the
        transport. Its tensors keep their graph where autograd drives the backward pass
        (``forward()``): each partition of a step starts its own."""
        detach = not self.partition(key.source).autograd_backward
        message = outgoing(
            values, atomic=atomic, needs_grad=needs_grad, detach=detach, container=container
        )
        if self.workers[key.source] != self.workers[key.target]:
            self.transport.send(key, message)
        else:
            self.mailbox[key] = message

    def receive(self, key: MessageKey) -> Message:
        """The message ``key``: from the mailbox between partitions of one worker (sent
        earlier in this worker's list, as :func:`check_actions` ensures), else from the
        transport."""
        if self.workers[key.source] != self.workers[key.target]:
            return self.transport.receive(key)
        return self.mailbox.pop(key)
