"""One run of a pipeline, described once: what :class:`~gpipe_core.GPipe` hands the runner.

A :class:`RunDescription` is built once per run, by :meth:`GPipe.forward
<gpipe_core.GPipe.forward>` or :meth:`GPipe.step <gpipe_core.GPipe.step>` from their
inputs (:class:`~gpipe_core.run._inputs.RunInputs`) and the pipeline's configuration, and
read by every partition's run (:class:`~gpipe_core.run._partition_run.PartitionRun`) and the
runner (:func:`~gpipe_core.run._runner.run`). Nothing in it changes during the run.

It must not know how the run goes: it is data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gpipe_microbatch import Batch, ThreadState
from gpipe_skip import SkipLayout

from ..schedule._action import Action
from ..trace._tracing import Tracer
from ._draws import SelfCheckpointing
from ._lanes import DecodeRun
from ._losses import LossSpec

__all__ = ["RunDescription"]


@dataclass(frozen=True)
class RunDescription:
    """One run of ``microbatches`` micro-batches over the partitions.

    Attributes:
        batches: the micro-batches, on the first partition's device (none where the first
            partition runs in another process).
        actions: each worker's action list, every action naming its partition.
        microbatches: how many micro-batches the run has.
        grad: whether the run records autograd history (grad mode on).
        checkpoint_stop: micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed.
        autograd_backward: who drives the backward pass: autograd, through the partitions'
            graphs hanging off their inputs (``GPipe.forward``), or each partition's run,
            from leaves cut from its inputs (``GPipe.step``).
        loss: the losses, computed on the last partition (a step's, on its rank).
        unpack_input: a tuple input is the first layer's positional arguments.
        input_keywords: the names of the first layer's keyword arguments, the last values
            of the input tuple.
        unpacks: a tuple passed between partitions is the next layer's positional arguments
            (a :class:`~gpipe_core.PipeSequential`'s convention).
        skip_layout: the skip connections of the pipeline (None without any).
        workers: the worker of each partition (None: partition ``j`` on worker ``j``).
        threaded: run each partition of this process on its worker; otherwise in the
            calling thread (whose state is ``state``): every partition serially, or the one
            partition of this process.
        intra_op_threads: GPipe's ``intra_op_threads``: how the workers on the CPU share
            the caller's intra-op threads (see :mod:`gpipe_core.run._threads`).
        state: the caller's thread state, applied in every worker.
        tracer: labels and times the partitions' tasks, if the run is traced.
        partitions: the partitions' layers, in pipeline order (None for another process's).
        devices: the device of each partition.
        deferred_batch_norm: the layers hold deferred batch norms, which update their
            running statistics once per run.
        drawless: whether each partition cannot draw random numbers, by its layers
            (:func:`~gpipe_core.run._draws.draws_nothing`; False for another process's).
        replays: whether a recomputation may replay random draws in the run: gpipe
            checkpoints, or a partition that may draw checkpoints itself (or is not known
            not to): then forward passes and backward tasks that may draw take turns.
        self_checkpointing: what the pipeline learns of its partitions checkpointing
            themselves (the run learns its ``pending`` ones).
        decode: what a decode run adds: its lanes, rounds and feedback (None: a forward
            or a step).
    """

    batches: Sequence[Batch]
    actions: Sequence[Sequence[Action]]
    microbatches: int
    grad: bool
    checkpoint_stop: int
    autograd_backward: bool
    loss: LossSpec | None = None
    unpack_input: bool = False
    input_keywords: tuple[str, ...] = ()
    unpacks: bool = False
    skip_layout: SkipLayout | None = None
    workers: Sequence[int] | None = None
    threaded: bool = True
    intra_op_threads: int | None = None
    state: ThreadState | None = None
    tracer: Tracer | None = None
    partitions: Sequence[nn.Sequential | None] = ()
    devices: Sequence[torch.device] = ()
    deferred_batch_norm: bool = False
    drawless: Sequence[bool] = ()
    replays: bool = False
    self_checkpointing: SelfCheckpointing | None = None
    decode: DecodeRun | None = None

    def unpack(self, j: int) -> bool:
        """Whether partition ``j`` takes a tuple as its first layer's positional arguments."""
        return self.unpack_input if j == 0 else self.unpacks

    def keywords(self, j: int) -> tuple[str, ...]:
        """The names of partition ``j``'s keyword inputs (the first partition's)."""
        return self.input_keywords if j == 0 else ()

    def loss_of(self, j: int) -> LossSpec | None:
        """The losses partition ``j`` computes (the last partition's)."""
        return self.loss if j == len(self.partitions) - 1 else None
