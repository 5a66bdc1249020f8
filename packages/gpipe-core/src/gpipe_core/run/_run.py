"""A run executed on this process: the partitions' runs made from its description, the
transport prepared, the runner called.

This module owns what happens on this process between a run's description
(:class:`~gpipe_core.run._description.RunDescription`) and its outputs: a
:class:`~gpipe_core.run._partition_run.PartitionRun` per partition of this process, the
copy streams of each partition (kept across runs), the deferred batch norms' mini-batch, and
a cancelled run (another rank failed) raised as such. It must not know how the description
was made, nor which transport carries the messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import cast

import torch
from torch import nn

from gpipe_bn import mini_batch
from gpipe_microbatch import Batch, gather

from .._stream import AbstractStream, current_stream, new_stream
from ..transport._transport import Cancelled, Transport
from ._description import RunDescription
from ._partition_run import PartitionRun
from ._runner import run
from ._worker import WorkerPool

__all__ = ["execute", "gather_output"]


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
    held = _copy_streams(copy_streams, devices, description.microbatches)
    transport.prepare(streams, held, tracer=description.tracer)
    # Deferred batch norms update their running statistics once, after all m
    # micro-batches (m may be less than chunks), and not at all if a micro-batch fails.
    with mini_batch(module) if description.deferred_batch_norm else nullcontext():
        outputs = run(description, partitions, transport, pool)
        if transport.cancelled:
            raise Cancelled  # another rank failed: the session raises its error
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
