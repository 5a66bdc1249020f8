"""A partition's run: the partition on its device, running one micro-batch at a time.

A :class:`PartitionRun` does, for micro-batch ``i``: the forward pass (checkpointed or not),
the loss on the last partition, the recomputation and the backward pass; and it keeps what
they need in between (inputs, outputs, the checkpoint with its generator states, the
skips). Both ``GPipe.forward`` and ``GPipe.step`` run their partitions through it; they
differ in one parameter, who drives the backward pass:

* **autograd** (``GPipe.forward``): the partition's graph hangs off its input, which carries
  the previous partition's graph, so the output's graph reaches the caller's input and every
  parameter; ``loss.backward()`` runs every partition's backward pass. A checkpointed
  micro-batch is recomputed by autograd right before its backward pass, and phony edges
  (:func:`~gpipe_core.run._dependency.fork`,
  :func:`~gpipe_core.run._dependency.join`) make partition
  ``j`` finish the backward pass of micro-batch ``i`` before that of ``i - 1``, so that
  each recomputation runs right before its own backward pass.
* **the partition run** (``GPipe.step``): the partition's graph starts at leaves cut from what it
  receives, and its backward pass (:meth:`PartitionRun.backward`) differentiates its own
  outputs with the gradients the next partition sent back (or the loss), returning its
  inputs' gradients. A checkpointed micro-batch is recomputed where the schedule puts its
  backward pass. Backward passes of different partitions run at the same time, on the CPU
  as well.

Checkpointing is :class:`gpipe_checkpoint.Checkpointing` in both cases, placed by autograd
or by the partition run.

It must not know where its inputs come from or where its outputs go (the runner and the
transport decide), nor the schedule's order: it runs what it is asked, one micro-batch at a
time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from typing import Any, TypeVar

import torch
from torch import Tensor

from gpipe_checkpoint import (
    Checkpointing,
    RNGStates,
    device_rng_lock,
    is_differentiable,
    replay_rng_states,
    rng_moved,
    run_backward,
)
from gpipe_microbatch import Batch, check_output
from gpipe_skip import SkipKey

from .._sequential import call_partition
from .._stream import AbstractStream
from ..trace._timeline import Phase
from ._dependency import fork, join
from ._description import RunDescription
from ._draws import calls_plainly
from ._skips import SkipCall
from ._split_backward import SplitBackward, WeightGradient, checkpoints_itself

__all__ = ["PartitionRun", "clone", "nested"]

_T = TypeVar("_T")
_Function = Callable[[Any], object]


class _LockDepth(threading.local):
    """How many generator locks the current thread holds through a partition."""

    depth = 0


_held = _LockDepth()


def nested() -> bool:
    """Whether the calling thread runs inside a partition that holds a generator lock (a
    pipeline nested in a partition): such a pipeline must run in this thread."""
    return _held.depth > 0


def clone(batch: Batch) -> Batch:
    """A batch of copies of ``batch``'s tensors (for a partition that modifies its input)."""
    return batch.with_tensors(tensor.clone() for tensor in batch)


class _InFlight:
    """What a partition keeps of a micro-batch between its forward and backward pass."""

    __slots__ = ("call", "chk", "inputs", "loss", "outputs")

    def __init__(self, inputs: Batch, call: SkipCall | None, chk: Checkpointing | None) -> None:
        #: The flat input: leaves (views of the mini-batch on the first partition).
        self.inputs = inputs
        #: How the partition runs when it has skippable layers.
        self.call = call
        #: The checkpoint of a checkpointed micro-batch, until it is recomputed.
        self.chk = chk
        #: The flat output with its autograd graph (None while checkpointed).
        self.outputs: tuple[Tensor, ...] | None = None
        #: The loss to differentiate (seeded with its scale), on the last partition.
        self.loss: Tensor | None = None


class PartitionRun:
    """Partition ``index`` of ``run`` (:class:`~gpipe_core.run._description.RunDescription`),
    its layers on their device, computing on ``stream``: what the run says of it (its
    micro-batches, checkpointing, who drives the backward pass, its calling convention
    (:func:`~gpipe_core._sequential.call_partition`), the losses on the last partition, the
    skips, the tracer) it keeps for the run.
    """

    def __init__(self, index: int, run: RunDescription, stream: AbstractStream) -> None:
        partition, device = run.partitions[index], run.devices[index]
        assert partition is not None  # another process's partition has no run here
        checkpoint_stop = run.checkpoint_stop
        self.index = index
        self.unpack = run.unpack(index)
        self.keywords = run.keywords(index)
        self.partition = partition
        self.device = device
        self.stream = stream
        self.microbatches = run.microbatches
        self.checkpoint_stop = checkpoint_stop
        #: The lock of the device's generator, held by the forward passes and backward
        #: tasks of a run that may replay draws (see _guarded).
        self.rng_lock = device_rng_lock(device) if run.replays else None
        #: Whether the partition's layers cannot draw random numbers (see _draws): then
        #: its forward passes take no lock and are never replayed.
        self.draws_nothing = run.replays and run.drawless[index]
        #: Where the run learns whether the partition checkpoints itself (see forward).
        learning = run.self_checkpointing
        self.learning = learning if learning is not None and index in learning.pending else None
        #: The micro-batches whose forward pass held the generator lock: their backward
        #: tasks hold it too (see _guarded_backward).
        self.locked: set[int] = set()
        self.autograd_backward = run.autograd_backward
        self.grad = run.grad
        self.loss = run.loss_of(index)
        self.tracer = run.tracer
        self.what = f"output of partition {index}"
        # Learned from the first micro-batches of the run (see _call).
        #: Whether the partition modifies its input in place (None: not known yet).
        self.modifies_input: bool | None = None
        self.in_flight: dict[int, _InFlight] = {}
        #: The weight gradient of each micro-batch, after its input gradient.
        self.deferred: dict[int, WeightGradient] = {}
        # The phony forked off the previous micro-batch's output (autograd backward), and
        # whether to order the micro-batches' backward passes so: recomputations need it
        # (each runs right before its own backward pass), and CUDA streams; on the CPU
        # without checkpointing, autograd's own order serves and saves two nodes per task.
        self.phony: Tensor | None = None
        self.ordered = checkpoint_stop > 0 or device.type == "cuda"
        # The skips the partition pops, by the partition that stashes them, and those it stashes,
        # by the partition that pops them.
        layout = run.skip_layout
        self.layout = layout if layout is not None and not layout.empty else None
        self.pops: dict[int, list[SkipKey]] = {}
        self.stashes: dict[int, list[SkipKey]] = {}
        self.skippable = self.layout is not None and self.layout.has_skippables(index)
        if self.layout is not None:
            for route in self.layout.requires(index):
                self.pops.setdefault(route.stash_partition, []).append(route.key)
            for route in self.layout.provides(index):
                self.stashes.setdefault(route.pop_partition, []).append(route.key)

    @cached_property
    def parameters(self) -> tuple[Tensor, ...]:
        """The partition's parameters that require grad."""
        return tuple(p for p in self.partition.parameters() if p.requires_grad)

    @property
    def trainable(self) -> bool:
        """Whether the partition has parameters to train: a checkpointed output needs
        gradients then, even where its input needs none."""
        return bool(self.parameters)

    def record(self, phase: Phase, i: int, backward: bool, function: Callable[[], _T]) -> _T:
        """Run ``function`` as the partition's task ``phase`` on micro-batch ``i``, traced."""
        if self.tracer is None:
            return function()
        return self.tracer.task(phase, i, self.index, self.device, self.stream, backward, function)

    # -- what a run learns about the partition -------------------------------------------

    def _guarded(
        self, i: int, compute: Callable[[], _T], chk: Checkpointing | None, batch: Batch
    ) -> _T:
        """Run ``compute``, the forward pass of micro-batch ``i`` on ``batch``, under the
        device's generator lock in a run that may replay random draws (gpipe checkpoints,
        or a partition checkpoints itself or is not known not to: ``run.replays``).

        Partitions on one device share a generator. A recomputation replays its first
        pass's draws from the generator's state when that pass started: gpipe's does, and
        torch's checkpoint inside a layer (a model's own gradient checkpointing) sets that
        state during the backward pass. Draws of another worker meanwhile would interleave
        or be lost. So every forward pass that may draw holds the device's generator lock
        (whether a layer draws may depend on its input), and so do its micro-batch's
        backward tasks (:meth:`_guarded_backward`). A micro-batch checkpointed by gpipe
        whose forward pass drew nothing (the state did not move under the lock) is
        recomputed without restoring the generator (:func:`_no_replay`), which would drop
        other workers' draws. A partition whose layers cannot draw
        (:mod:`gpipe_core.run._draws`) takes no lock and is never replayed.
        """
        if self.rng_lock is None:
            return compute()
        if self.checkpoint_stop == 0 and not (
            self.trainable or any(tensor.requires_grad for tensor in batch)
        ):
            # Only torch's checkpoint could replay draws here, in a backward pass through
            # the partition, and none will run.
            return compute()
        if self.draws_nothing and calls_plainly(batch.tensors, batch.others):
            result = compute()
            if chk is not None:
                chk.replay = _no_replay
            return result
        if self.grad and not self.autograd_backward:
            self.locked.add(i)
        with self.rng_lock:
            _held.depth += 1
            try:
                result = compute()
                # The state the checkpoint phase started from, against the state now.
                if (
                    chk is not None
                    and chk.saved is not None
                    and not rng_moved(self.device, chk.saved[0])
                ):
                    chk.replay = _no_replay
                return result
            finally:
                _held.depth -= 1

    def _guarded_backward(self, i: int, compute: Callable[[], _T], last: bool) -> _T:
        """Run ``compute``, a backward task of micro-batch ``i`` (``last``: its last), under
        the generator lock where its forward pass held it (see :meth:`_guarded`)."""
        if i not in self.locked:
            return compute()
        if last:
            self.locked.discard(i)
        assert self.rng_lock is not None
        with self.rng_lock:
            _held.depth += 1
            try:
                return compute()
            finally:
                _held.depth -= 1

    def _call(self, function: _Function, batch: Batch) -> Batch:
        """Call ``function`` on ``batch`` without checkpointing.

        A partition may modify its input in place (it starts with
        ``nn.ReLU(inplace=True)``, say). When the input shares its version counter with
        other tensors of the run (views of the mini-batch, the aliases that order backward
        between micro-batches, or the sending partition's output), the partition gets a copy
        and is watched, until it is seen not modifying its input.
        """
        shared = not self.autograd_backward or self.microbatches > 1
        if not shared or self.modifies_input is False or not torch.is_grad_enabled():
            return batch.call(function, self.what)
        copies = clone(batch)
        versions = [tensor._version for tensor in copies]
        output = copies.call(function, self.what)
        self.modifies_input = any(
            tensor._version != version for tensor, version in zip(copies, versions, strict=True)
        )
        return output

    # -- forward -------------------------------------------------------------------------

    def accept(self, values: Sequence[object], requires_grad: Sequence[bool]) -> list[object]:
        """What the partition computes from: received ``values`` (with a ``requires_grad``
        flag per tensor), their tensors cut into leaves when the partition drives its own
        backward pass; values that are not tensors (None included) as they are."""
        if self.autograd_backward:
            return list(values)
        flags = iter(requires_grad)
        leaves: list[object] = []
        for value in values:
            if not isinstance(value, Tensor):
                leaves.append(value)
                continue
            needs = next(flags) and self.grad and is_differentiable(value)
            leaves.append(value.detach().requires_grad_(needs))
        return leaves

    def forward(
        self, i: int, batch: Batch, skips: dict[SkipKey, Tensor | None]
    ) -> tuple[Batch, dict[SkipKey, Tensor | None], bool]:
        """The forward pass of micro-batch ``i`` (and its loss on the last partition).

        Args:
            i: the micro-batch.
            batch: its input (see :meth:`accept`).
            skips: the skips the partition pops, by key.

        Returns:
            The output, the skips the partition stashes (by key), and whether their
            recomputation will need gradients (a checkpointed output has no autograd
            history yet).
        """
        call: SkipCall | None = None
        if self.skippable:
            assert self.layout is not None
            provides = [route.key for route in self.layout.provides(self.index)]
            call = SkipCall(
                self.partition, self.what, batch, skips, provides, self.unpack, self.keywords
            )
            batch = call.flat_input(batch, skips)
        checkpointed = i < self.checkpoint_stop
        tracer = self.tracer
        if self.autograd_backward and self.grad:
            if self.phony is not None and not checkpointed:
                # A checkpointed micro-batch joins the phony itself, saving a node.
                index = batch.find_tensor_idx()
                batch.replace(index, join(batch[index], self.phony))
            if tracer is not None:
                tracer.input(batch, i, self.index, self.device, self.stream, self.trainable)
        function: _Function
        if call is not None:
            function = call  # it checks the partition's output itself
        else:
            partition, what, unpack, keywords = (
                self.partition, self.what, self.unpack, self.keywords
            )  # fmt: skip

            def function(input: Any) -> object:
                return check_output(call_partition(partition, input, unpack, keywords), what)

        chk: Checkpointing | None = None
        compute: Callable[[], Batch]
        if checkpointed:
            checkpointed_function: _Function = function
            if tracer is not None and self.autograd_backward:
                checkpointed_function = tracer.recomputed(
                    function, i, self.index, self.device, self.stream
                )
            chk = Checkpointing(
                checkpointed_function,
                batch,
                copy_input=self.modifies_input is not False,
                requires_grad=self.trainable,
                replay=_Replayed,
                # Autograd sees them (torch.autograd.grad, backward(inputs=...)).
                parameters=self.parameters if self.autograd_backward else None,
            )
            checkpointing = chk
            if self.autograd_backward:
                phony = self.phony

                def compute() -> Batch:
                    return checkpointing.checkpoint(phony)
            else:

                def compute() -> Batch:
                    return checkpointing.checkpoint(detached=True)
        else:

            def compute() -> Batch:
                return self._call(function, batch)

        try:
            output = self._guarded(
                i, lambda: self.record(Phase.FORWARD, i, False, compute), chk, batch
            )
        except RuntimeError as error:
            if self.autograd_backward or "leaf Variable that requires grad" not in str(error):
                raise
            # As the forward pass refuses it: the partition's input is a leaf of its own graph.
            raise RuntimeError(
                f"partition {self.index} modified its input in place (micro-batch {i}), "
                "which a step cannot differentiate: each partition's input is a leaf of "
                "its own graph; make the layer out-of-place (nn.ReLU(inplace=False))"
            ) from error
        if chk is not None and (self.modifies_input is None or chk.input_modified):
            self.modifies_input = chk.input_modified
        if self.learning is not None and any(t.requires_grad for t in output.tensors):
            # The first forward pass with a graph: does a layer checkpoint itself?
            self.learning.learn(self.index, checkpoints_itself(output.tensors, batch.tensors))
            self.learning = None
        if self.autograd_backward:
            self._link(i, output, chk)
        elif self.grad:
            entry = _InFlight(batch, call, chk)
            if chk is None:
                entry.outputs = output.tensors
            self.in_flight[i] = entry
        main, stashed = call.split(output) if call is not None else (output, {})
        if self.loss is not None and chk is None:
            # A checkpointed micro-batch's loss is computed once, after its recomputation.
            loss = self.record(Phase.LOSS, i, False, lambda: self._loss(i, main))
            if self.grad:
                self.in_flight[i].loss = loss
        # A checkpointed output has no autograd history; its recomputation will need
        # gradients where an input does, or the partition has parameters to train.
        needs_grad = (
            chk is not None
            and not self.autograd_backward
            and (self.trainable or any(tensor.requires_grad for tensor in batch))
        )
        return main, stashed, needs_grad

    def _loss(self, i: int, main: Batch) -> Tensor:
        assert self.loss is not None
        return self.loss(i, main)

    def _link(self, i: int, output: Batch, chk: Checkpointing | None) -> None:
        """Wire micro-batch ``i``'s output into the graph autograd runs backward."""
        if not self.grad:
            return
        if chk is not None:
            forked = chk.recompute_in_backward(output)
        elif self.tracer is not None:
            # A checkpointed micro-batch's backward starts where its recomputation ends.
            self.tracer.output(output, i, self.index, self.stream)
        if i == self.microbatches - 1 or not self.ordered:
            self.phony = None
            return
        if chk is not None:
            self.phony = forked
            return
        index = output.find_tensor_idx()
        tensor, self.phony = fork(output[index])
        output.replace(index, tensor)

    # -- backward (driven by the partition run) ----------------------------------------------

    def backward(
        self, i: int, grads: Sequence[Tensor | None], skip_grads: dict[SkipKey, Tensor | None]
    ) -> tuple[list[Tensor | None], dict[SkipKey, Tensor | None]]:
        """The backward pass of micro-batch ``i``, after its recomputation if checkpointed.

        Args:
            i: the micro-batch.
            grads: the gradients of the partition's output (none on the last partition).
            skip_grads: the gradients of the skips it stashed, by key.

        Returns:
            The gradients of the partition's input, and of the skips it popped (by key).
        """
        return self._guarded_backward(i, lambda: self._backward(i, grads, skip_grads), True)

    def _backward(
        self, i: int, grads: Sequence[Tensor | None], skip_grads: dict[SkipKey, Tensor | None]
    ) -> tuple[list[Tensor | None], dict[SkipKey, Tensor | None]]:
        entry = self.in_flight.pop(i)
        if entry.chk is not None:
            self._recompute(i, entry)
        roots, seeds = self._roots(i, entry, grads, skip_grads)

        def compute() -> None:
            if roots:
                run_backward(roots, seeds)

        self.record(Phase.BACKWARD, i, True, compute)
        entry.outputs = entry.loss = entry.chk = None
        return self._input_gradients(entry)

    # -- the backward pass split in two: input gradient, then weight gradient ------------

    def backward_input(
        self, i: int, grads: Sequence[Tensor | None], skip_grads: dict[SkipKey, Tensor | None]
    ) -> tuple[list[Tensor | None], dict[SkipKey, Tensor | None]]:
        """The input gradient of micro-batch ``i`` (after its recomputation if checkpointed):
        the gradients of the partition's input and popped skips, as :meth:`backward`
        returns them, keeping what :meth:`backward_weight` needs.

        Autograd runs the paths from the outputs to the inputs only, capturing the
        gradients where the parameters' paths leave them (see
        :mod:`gpipe_core.run._split_backward`); the weight gradient starts there. A partition
        whose backward cannot be split (compiled whole, or with a reentrant checkpoint)
        runs it whole here, traced as a backward task, and its weight gradient is empty.
        """
        return self._guarded_backward(i, lambda: self._backward_input(i, grads, skip_grads), False)

    def _backward_input(
        self, i: int, grads: Sequence[Tensor | None], skip_grads: dict[SkipKey, Tensor | None]
    ) -> tuple[list[Tensor | None], dict[SkipKey, Tensor | None]]:
        entry = self.in_flight.pop(i)
        if entry.chk is not None:
            self._recompute(i, entry)
            entry.chk = None
        roots, seeds = self._roots(i, entry, grads, skip_grads)
        inputs = entry.inputs.tensors
        # The first partition's inputs are views of the step's leaves: their gradients are
        # passed on to those leaves.
        wanted = [tensor for tensor in inputs if tensor.requires_grad]

        split = SplitBackward(roots, seeds, wanted)
        if split.whole:
            # Nothing can wait (a compiled partition, a reentrant checkpoint): the whole
            # backward pass now.
            self.record(Phase.BACKWARD, i, True, lambda: run_backward(roots, seeds))
            self.deferred[i] = WeightGradient([])
        else:

            def compute() -> WeightGradient:
                found, weight = split.input_gradient()
                views = [(view, grad) for view, grad in zip(wanted, found, strict=True)
                         if grad is not None and not view.is_leaf]  # fmt: skip
                for tensor, grad in zip(wanted, found, strict=True):
                    if grad is not None and tensor.is_leaf:
                        tensor.grad = grad if tensor.grad is None else tensor.grad + grad
                if views:
                    torch.autograd.backward([v for v, _ in views], [g for _, g in views])
                return weight

            self.deferred[i] = self.record(Phase.INPUT_GRADIENT, i, True, compute)
        entry.outputs = entry.loss = None
        return self._input_gradients(entry)

    def backward_weight(self, i: int) -> None:
        """The weight gradient of micro-batch ``i``, after its :meth:`backward_input`:
        accumulated into the parameters' ``.grad``; the graph is freed."""
        weight = self.deferred.pop(i)
        self._guarded_backward(i, lambda: self.record(Phase.WEIGHT_GRADIENT, i, True, weight), True)

    def _roots(
        self,
        i: int,
        entry: _InFlight,
        grads: Sequence[Tensor | None],
        skip_grads: dict[SkipKey, Tensor | None],
    ) -> tuple[list[Tensor], list[Tensor]]:
        """What micro-batch ``i``'s backward pass differentiates, and with which gradients:
        the loss (seeded with its scale, :meth:`~gpipe_core.run._losses.LossSpec.seed`) and
        the outputs (the skips stashed included) that received a gradient."""
        gradients = list(grads)
        if entry.call is not None:
            assert entry.call.structure is not None
            gradients.extend(skip_grads.get(key) for key in entry.call.structure[2])
        roots: list[Tensor] = []
        seeds: list[Tensor] = []
        if entry.loss is not None and entry.loss.requires_grad:
            assert self.loss is not None
            roots.append(entry.loss)
            seeds.append(self.loss.seed(i, entry.loss))
        for tensor, gradient in zip(entry.outputs or (), gradients, strict=False):
            if gradient is not None and tensor.requires_grad:
                roots.append(tensor)
                seeds.append(gradient)
        return roots, seeds

    def _input_gradients(
        self, entry: _InFlight
    ) -> tuple[list[Tensor | None], dict[SkipKey, Tensor | None]]:
        """After a backward pass: the gradients of the partition's input, and of the skips
        it popped (by key)."""
        inputs, call = entry.inputs.tensors, entry.call
        count = call.inputs if call is not None else len(inputs)
        input_grads = [_grad(tensor) for tensor in inputs[:count]]
        popped: dict[SkipKey, Tensor | None] = {}
        if call is not None:
            by_key = dict(zip(call.in_keys, inputs[count:], strict=True))
            for keys in self.pops.values():
                popped.update((key, _grad(by_key[key]) if key in by_key else None) for key in keys)
        return input_grads, popped

    def _recompute(self, i: int, entry: _InFlight) -> None:
        chk = entry.chk
        assert chk is not None
        output = self.record(Phase.RECOMPUTE, i, True, chk.recompute)
        entry.outputs = output.tensors
        if self.loss is not None:
            # The loss of a checkpointed micro-batch, once: its forward pass skipped it.
            main = entry.call.split(output)[0] if entry.call is not None else output
            entry.loss = self.record(Phase.LOSS, i, False, lambda: self._loss(i, main))


def _no_replay(device: torch.device, states: RNGStates) -> AbstractContextManager[object]:
    """What the recomputation of a micro-batch that drew nothing replays: nothing."""
    return nullcontext()


class _Replayed:
    """:func:`~gpipe_checkpoint.replay_rng_states`, counted as a generator lock held by a
    partition (so that a pipeline nested in the partition runs serially)."""

    __slots__ = ("replay",)

    def __init__(self, device: torch.device, states: RNGStates) -> None:
        self.replay = replay_rng_states(device, states)

    def __enter__(self) -> None:
        self.replay.__enter__()
        _held.depth += 1

    def __exit__(self, *exc_info: object) -> None:
        _held.depth -= 1
        self.replay.__exit__(None, None, None)


def _grad(tensor: Tensor) -> Tensor | None:
    """The gradient a leaf of the partition received (the first partition's inputs are views of
    the step's input, whose gradient the step hands back itself)."""
    return tensor.grad if tensor.is_leaf and tensor.requires_grad else None
