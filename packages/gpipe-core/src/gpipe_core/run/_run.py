"""A run of the pipeline, assembled in one place: :func:`run_forward` and :func:`run_step`
parse and check the call's inputs (sharing the plan across ranks), describe the run and
execute it on this process.

This module owns what happens on this process between a call of ``GPipe.forward`` or
``GPipe.step`` (inside the run's session, which the caller opens) and its outputs or losses:
the run's description (:func:`describe`:
:class:`~gpipe_core.run._description.RunDescription`), a
:class:`~gpipe_core.run._partition_run.PartitionRun` per partition of this process, the copy
streams of each partition (kept across runs), the deferred batch norms' mini-batch, and a
cancelled run (another rank failed) raised as such. It knows the pipeline only through
:class:`Pipeline` and where its partitions run through :class:`Topology`, and must not know
which transport carries the messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from gpipe_bn import mini_batch
from gpipe_checkpoint import is_checkpointing, is_recomputing
from gpipe_microbatch import Batch, ThreadState, gather
from gpipe_skip import SkipLayout

from .._stream import AbstractStream, current_stream, new_stream
from ..schedule._decode import decode_actions
from ..schedule._schedules import Schedule, step_actions
from ..trace._tracing import Tracer, tracer_for
from ..transport._agreement import Fields
from ..transport._transport import Cancelled, Plan, Transport
from ._description import RunDescription
from ._draws import SelfCheckpointing, draws_nothing
from ._gradient_sync import GradientSync
from ._inputs import CountMean, RunInputs, forward_inputs, step_inputs
from ._lanes import DecodeRun, Feedback
from ._losses import Losses, Reduction
from ._partition_run import PartitionRun, nested
from ._runner import run
from ._worker import WorkerPool

__all__ = [
    "Pipeline",
    "Runtime",
    "Topology",
    "describe",
    "execute",
    "gather_output",
    "run_decode",
    "run_forward",
    "run_step",
]


class Topology(Protocol):
    """Where a pipeline's partitions run (:class:`~gpipe_core._placement.Placement` is one):
    what a run asks of it."""

    @property
    def devices(self) -> list[torch.device]:
        """The device of each partition."""

    @property
    def local(self) -> list[bool]:
        """Whether each partition runs in this process."""

    @property
    def workers(self) -> list[int] | None:
        """The worker of each partition (None: partition ``j`` on worker ``j``)."""

    def is_local(self, j: int) -> bool:
        """Whether partition ``j`` runs in this process."""

    def threaded(self, nested: bool) -> bool:
        """Whether the run gives each local partition its worker thread."""

    def transport(self) -> Transport:
        """What carries the run's messages."""

    def share_plan(self, plan: Plan | None, fields: Fields) -> Plan:
        """The run's plan, from the first partition's rank to every rank."""


class Pipeline(Protocol):
    """What a run asks of the pipeline it runs (:class:`~gpipe_core._build.Configuration`
    is one)."""

    @property
    def chunks(self) -> int:
        """How many micro-batches a mini-batch is split into."""

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode."""

    @property
    def intra_op_threads(self) -> int | None:
        """How the workers on the CPU share the caller's intra-op threads."""

    @property
    def unpacks(self) -> bool:
        """Whether a tuple between partitions is the next layer's positional arguments."""

    @property
    def skip_layout(self) -> SkipLayout:
        """The skip connections."""

    @property
    def deferred_batch_norm(self) -> bool:
        """Whether the layers hold deferred batch norms."""

    @property
    def partitions(self) -> list[nn.Sequential]:
        """The partitions (another process's are empty)."""

    @property
    def self_checkpointing(self) -> SelfCheckpointing:
        """Which partitions checkpoint themselves, as the runs learn it."""

    @property
    def placement(self) -> Topology:
        """Where the partitions run."""


@dataclass(frozen=True)
class Runtime:
    """What every run of a pipeline runs with: the ``pipeline``, its ``module`` (whose
    mode, trace and deferred batch norms the run follows), its worker ``pool`` and the
    copy streams of each partition (kept across runs)."""

    pipeline: Pipeline
    module: nn.Module
    pool: WorkerPool
    copy_streams: list[list[AbstractStream]]


def describe(
    pipeline: Pipeline,
    given: RunInputs,
    *,
    training: bool,
    grad: bool,
    autograd_backward: bool,
    tracer: Tracer | None,
    decode: DecodeRun | None = None,
) -> RunDescription:
    """The run of ``given`` (a forward's or a step's inputs) over ``pipeline``, in
    ``training`` mode with ``grad`` mode (autograd history recorded), whose backward pass
    autograd drives (``autograd_backward``: a forward) or the partitions' runs (a step).

    A pipeline nested in a checkpointed partition runs in the calling thread: the outer
    recomputation must replay its random draws in the same order, and its workers would
    wait forever for a generator lock the calling thread holds.

    A ``decode`` run (a forward without autograd history) runs each of the micro-batches,
    its lanes, ``decode.rounds`` times, in the :class:`~gpipe_core.DecodeSchedule`.
    """
    m, placement, partitions = len(given.sizes), pipeline.placement, pipeline.partitions
    backward = grad and not autograd_backward
    if decode is None:
        actions = step_actions(given.schedule, m, len(partitions), backward, placement.workers)
    else:
        workers = None if placement.workers is None else tuple(placement.workers)
        actions = decode_actions(m, decode.rounds, len(partitions), workers)
        m *= decode.rounds
    with torch.set_grad_enabled(grad):
        state = ThreadState.capture()
    # In eval mode a forward's output still has a graph (when grad mode is on); nothing is
    # checkpointed.
    stops = {"always": m, "except_last": m - 1, "never": 0}
    checkpoint_stop = stops[pipeline.checkpoint] if training and grad else 0
    local = [p if placement.local[j] else None for j, p in enumerate(partitions)]
    # Only a run that records autograd history has a backward pass that may replay.
    drawless = [grad and p is not None and draws_nothing(p) for p in local]
    learned = pipeline.self_checkpointing
    replays = checkpoint_stop > 0 or (grad and learned.may_replay(local, drawless))
    return RunDescription(
        given.batches, actions, m, grad,
        checkpoint_stop=checkpoint_stop,
        autograd_backward=autograd_backward,
        loss=given.loss,
        unpack_input=given.unpack,
        input_keywords=given.keywords,
        unpacks=pipeline.unpacks,
        skip_layout=pipeline.skip_layout,
        workers=placement.workers,
        threaded=placement.threaded(nested() or is_checkpointing() or is_recomputing()),
        intra_op_threads=pipeline.intra_op_threads,
        state=state,
        tracer=tracer,
        partitions=local,
        devices=placement.devices,
        deferred_batch_norm=pipeline.deferred_batch_norm,
        drawless=drawless,
        replays=replays,
        self_checkpointing=learned if grad else None,
        decode=decode,
    )  # fmt: skip


def run_forward(runtime: Runtime, inputs: tuple[Any, ...], keywords: Mapping[str, Any]) -> object:
    """``module(*inputs, **keywords)`` (``GPipe.forward``) run over the ``runtime``'s
    pipeline: the output, gathered on the last partition's process (None on the others)."""
    pipeline, module = runtime.pipeline, runtime.module
    placement, n = pipeline.placement, len(pipeline.partitions)
    given = forward_inputs(
        inputs, keywords, pipeline.chunks, placement.devices, placement.share_plan,
        training=module.training, first=placement.is_local(0),
    )  # fmt: skip
    if not n:
        return given.output  # an empty nn.Sequential is the identity
    grad = torch.is_grad_enabled()
    outputs = _run(runtime, given, grad, autograd_backward=True)
    # The output is on the last partition's rank.
    return gather_output(outputs, n - 1) if placement.is_local(-1) else None


def run_step(
    runtime: Runtime,
    inputs: tuple[Any, ...],
    keywords: Mapping[str, Any],
    target: object,
    loss_fn: object,
    schedule: str | Schedule,
    reduction: Reduction | None,
    count_mean: CountMean,
) -> Losses | None:
    """``module.step(...)`` run over the ``runtime``'s pipeline, its backward passes
    included: the losses on the last partition's process (None on the others)."""
    pipeline, module = runtime.pipeline, runtime.module
    placement = pipeline.placement
    given = step_inputs(
        inputs, keywords, target, loss_fn, schedule, reduction,
        chunks=pipeline.chunks, devices=placement.devices, share=placement.share_plan,
        training=module.training, ends=(placement.is_local(0), placement.is_local(-1)),
        count_mean=count_mean,
    )  # fmt: skip
    if not pipeline.partitions:
        given.identity()
    else:
        grad = torch.is_grad_enabled()  # in eval mode too, as autograd does
        _run(runtime, given, grad, autograd_backward=False)
    return given.end()


def run_decode(
    runtime: Runtime,
    inputs: tuple[Any, ...],
    keywords: Mapping[str, Any],
    feedback: Feedback,
    rounds: int,
    agree: Fields,
) -> None:
    """``module.decode(...)`` run over the ``runtime``'s pipeline: the first round's input
    split into lanes, each lane run ``rounds`` times, its next input made by ``feedback``
    on the last partition's process (see :mod:`gpipe_core.run._lanes`); the ranks agree
    on the rounds and on ``agree``. The lanes' states are dropped when it returns or
    raises."""
    pipeline, module = runtime.pipeline, runtime.module
    placement = pipeline.placement
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer (rounds: {rounds!r})")
    if not callable(feedback):
        raise TypeError(
            "feedback must be a callable feedback(lane, round, output) returning the lane's "
            f"next input or None (feedback: {type(feedback).__name__})"
        )
    if not pipeline.partitions:
        raise ValueError("an empty pipeline has no partition to decode with")
    given = forward_inputs(
        inputs, keywords, pipeline.chunks, placement.devices, placement.share_plan,
        training=module.training, first=placement.is_local(0), method="decode",
        agree=(("rounds", rounds), *agree),
    )  # fmt: skip
    # The first round's form, where this process read the input (the first partition's).
    positional = None
    if given.batches:
        count = len(given.batches[0].values) if given.unpack else 1
        positional = count - len(given.keywords)
    decode = DecodeRun(len(given.sizes), rounds, feedback, given.keywords, positional)
    try:
        with torch.no_grad():
            _run(runtime, given, False, autograd_backward=True, decode=decode)
    finally:
        decode.store.clear()


def _run(
    runtime: Runtime,
    given: RunInputs,
    grad: bool,
    *,
    autograd_backward: bool,
    decode: DecodeRun | None = None,
) -> list[Batch | None]:
    """Describe the run of ``given`` (a ``decode`` run's, if given) and execute it (the
    trace records it if the module is traced)."""
    pipeline, module = runtime.pipeline, runtime.module
    m = len(given.sizes) * (1 if decode is None else decode.rounds)
    description = describe(
        pipeline, given, training=module.training, grad=grad,
        autograd_backward=autograd_backward, tracer=tracer_for(module, m), decode=decode,
    )  # fmt: skip
    transport = pipeline.placement.transport()
    return execute(description, transport, runtime.pool, runtime.copy_streams, module)


def _copy_streams(
    held: list[list[AbstractStream]], devices: Sequence[torch.device], microbatches: int
) -> list[list[AbstractStream]]:
    """``held``, the copy streams of each partition, with at least ``microbatches`` each."""
    for j, device in enumerate(devices):
        streams = held[j]
        while len(streams) < microbatches:
            streams.append(new_stream(device))
    return held


def execute(
    description: RunDescription,
    transport: Transport,
    pool: WorkerPool,
    copy_streams: list[list[AbstractStream]],
    module: nn.Module,
) -> list[Batch | None]:
    """Run ``description`` on this process's partitions, with the ``transport`` and the
    worker ``pool`` of ``module`` (the pipeline, whose deferred batch norms see the run as
    one mini-batch) and its ``copy_streams``; the outputs as the runner returns them (see
    :func:`~gpipe_core.run._runner.run`).

    Raises:
        Cancelled: another rank failed (its run session raises that rank's error).
    """
    devices = description.devices
    streams = [current_stream(device) for device in devices]
    partitions = [
        None if layers is None else PartitionRun(j, description, streams[j])
        for j, layers in enumerate(description.partitions)
    ]
    # FSDP's gradient reduction once per step, where a step's partition is sharded.
    syncs = {
        j: sync
        for j, run_ in enumerate(partitions)
        if run_ is not None and description.grad and not description.autograd_backward
        and (sync := GradientSync.of(j, run_.partition, description.actions)) is not None
    }  # fmt: skip
    decode = description.decode
    # A decode run's micro-batches share their lane's copy streams.
    held = _copy_streams(
        copy_streams, devices, description.microbatches if decode is None else decode.lanes
    )
    transport.prepare(streams, held, tracer=description.tracer)
    # Deferred batch norms update their running statistics once, after all m
    # micro-batches (m may be less than chunks), and not at all if a micro-batch fails.
    with mini_batch(module) if description.deferred_batch_norm else nullcontext():
        try:
            outputs = run(description, partitions, transport, pool, syncs)
            if transport.cancelled:
                raise Cancelled  # another rank failed: the session raises its error
        except BaseException:
            for sync in syncs.values():
                sync.abandon()
            raise
    return outputs


def gather_output(outputs: Sequence[Batch | None], last: int) -> object:
    """The outputs of partition ``last`` in a forward run, gathered over the micro-batches.

    Raises:
        ValueError: the output has a tensor without a batch dimension to gather.
    """
    batches = cast(list[Batch], outputs)
    for i, output in enumerate(batches):
        for tensor in output:
            if tensor.dim() == 0:
                raise ValueError(
                    f"output of partition {last} must have a batch dimension to gather "
                    f"the micro-batches (micro-batch {i}, shape: {tuple(tensor.shape)})"
                )
    return gather(batches)
