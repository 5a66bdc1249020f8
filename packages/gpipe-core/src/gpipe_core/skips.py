"""Skip connections in the pipeline, as explicit inputs and outputs of partitions.

A partition with skippable layers runs as a function of its input and the skips it pops
from earlier partitions, returning its output and the skips it stashes for later
partitions (:func:`gpipe_skip.run_partition`). Both sides travel in one flat batch: the
partition's tensors first, then the skip tensors. Under checkpointing the checkpointed
function is that flat function, so the recomputation stashes again for its own backward,
and the gradient of every skip tensor flows through autograd like any other.

A skip stashed by partition ``j`` and popped by partition ``k`` for micro-batch ``i`` is
sent from ``j``'s device straight to ``k``'s on the copy streams ``copy_streams[j][i]``
and ``copy_streams[k][i]``: once, and never through the partitions in between. Nothing
outlives the pipeline run but the autograd graph, so a skip tensor is freed once it has
been popped and its gradient has flowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gpipe_microbatch import AbstractStream, Batch, TensorOrTensors, check, wait
from gpipe_skip import SkipKey, SkipLayout, run_partition

from .tracing import Tracer, move

__all__ = ["PipelineSkips", "SkipCall", "send_skips"]

# How a partition's flat output splits: whether its output is one tensor, how many tensors
# it has, and which outgoing skips are tensors (the others are None).
_Structure = tuple[bool, int, tuple[SkipKey, ...]]


class SkipCall:
    """Partition ``j`` on micro-batch ``i`` as a function of one flat tuple of tensors.

    The flat input is the partition's input tensors followed by the incoming skips that
    are tensors; the flat output is the partition's output tensors followed by the
    outgoing skips that are tensors. ``None`` skips are known to the call, not carried.
    """

    def __init__(
        self,
        partition: nn.Sequential,
        what: str,
        batch: Batch,
        skips_in: dict[SkipKey, Tensor | None],
        provides: Sequence[SkipKey],
    ) -> None:
        self.partition = partition
        self.what = what
        self.atomic = batch.atomic
        self.inputs = len(batch)
        self.in_keys = tuple(key for key, value in skips_in.items() if value is not None)
        self.none_in = tuple(key for key, value in skips_in.items() if value is None)
        self.provides = tuple(provides)
        self.structure: _Structure | None = None

    def flat_input(self, batch: Batch, skips_in: dict[SkipKey, Tensor | None]) -> Batch:
        """The flat batch this call takes."""
        skips = (value for value in skips_in.values() if value is not None)
        return Batch((*batch, *skips))

    def __call__(self, flat: TensorOrTensors) -> tuple[Tensor, ...]:
        tensors = (flat,) if isinstance(flat, Tensor) else flat
        input = tensors[0] if self.atomic else tuple(tensors[: self.inputs])
        skips: dict[SkipKey, Tensor | None] = dict(
            zip(self.in_keys, tensors[self.inputs :], strict=True)
        )
        skips.update(dict.fromkeys(self.none_in))
        output, stashed = run_partition(self.partition, input, skips)
        output = check(output, self.what)
        outputs = (output,) if isinstance(output, Tensor) else output
        values = [stashed[key] for key in self.provides]
        present = tuple(
            key for key, value in zip(self.provides, values, strict=True) if value is not None
        )
        structure = (isinstance(output, Tensor), len(outputs), present)
        if self.structure is None:
            self.structure = structure
        elif structure != self.structure:
            raise RuntimeError(
                f"the recomputation of {self.what} differs from its first run: a conditional "
                "skip stashed None in one run and a tensor in the other, or the output "
                "changed shape (first run stashed: "
                f"{[name for _, name in self.structure[2]]}, recomputation stashed: "
                f"{[name for _, name in present]})"
            )
        return (*outputs, *(value for value in values if value is not None))

    def split(self, flat: Batch) -> tuple[Batch, dict[SkipKey, Tensor | None]]:
        """Split a flat output into the partition's output and its outgoing skips."""
        assert self.structure is not None, "the partition has not run"
        atomic, count, present = self.structure
        tensors = flat.tensors
        output = Batch(tensors[0] if atomic else tensors[:count])
        skips: dict[SkipKey, Tensor | None] = dict.fromkeys(self.provides)
        skips.update(zip(present, tensors[count:], strict=True))
        return output, skips


def send_skips(
    batch: Batch,
    source: int,
    target: int,
    source_stream: AbstractStream,
    target_stream: AbstractStream,
    same_device: bool,
    *,
    i: int,
    device: torch.device,
    tracer: Tracer | None,
) -> None:
    """Send micro-batch ``i``'s skip tensors from partition ``source`` to ``target`` (in place).

    The one place where skip tensors cross partitions, by :func:`~gpipe_core.tracing.move`
    as the main path's tensors do: a stream wait when both partitions share a device,
    else a differentiable copy (recorded as a copy into ``target`` while traced).
    """
    move(batch, i, target, source_stream, target_stream, device, same_device, tracer)


class PipelineSkips:
    """The skip tensors of one pipeline run, waiting between their partitions."""

    def __init__(
        self,
        layout: SkipLayout,
        devices: Sequence[torch.device],
        copy_streams: Sequence[Sequence[AbstractStream]],
        compute_streams: Sequence[AbstractStream],
        tracer: Tracer | None = None,
    ) -> None:
        self.layout = layout
        self.tracer = tracer
        self.devices = devices
        self.copy_streams = copy_streams
        self.compute_streams = compute_streams
        # Skips stashed and not yet sent to their partition, by micro-batch.
        self.waiting: dict[int, dict[SkipKey, Tensor | None]] = {}
        # Calls between prepare() and finish(), by (micro-batch, partition).
        self.calls: dict[tuple[int, int], SkipCall] = {}

    def involves(self, j: int) -> bool:
        """Whether partition ``j`` has skippable layers (and runs through a SkipCall)."""
        return self.layout.has_skippables(j)

    def prepare(
        self, i: int, j: int, partition: nn.Sequential, what: str, batch: Batch
    ) -> tuple[SkipCall, Batch]:
        """Bring partition ``j``'s incoming skips for micro-batch ``i`` to its device.

        Returns the call to run and its flat input batch.
        """
        waiting = self.waiting.get(i, {})
        skips_in: dict[SkipKey, Tensor | None] = {}
        by_source: dict[int, list[SkipKey]] = {}
        for route in self.layout.requires(j):
            skips_in[route.key] = waiting.pop(route.key)
            if skips_in[route.key] is not None:
                by_source.setdefault(route.stash_partition, []).append(route.key)
        if not waiting:
            self.waiting.pop(i, None)
        target_stream = self.copy_streams[j][i]
        for source, keys in by_source.items():
            moving = Batch(tuple(skips_in[key] for key in keys))  # type: ignore[misc]
            send_skips(
                moving, source, j, self.copy_streams[source][i], target_stream,
                self.devices[source] == self.devices[j],
                i=i, device=self.devices[j], tracer=self.tracer,
            )  # fmt: skip
            # The partition's compute stream waits for the copies, as for its input.
            wait(moving, target_stream, self.compute_streams[j])
            skips_in.update(zip(keys, moving, strict=True))
        provides = [route.key for route in self.layout.provides(j)]
        call = SkipCall(partition, what, batch, skips_in, provides)
        self.calls[(i, j)] = call
        return call, call.flat_input(batch, skips_in)

    def finish(self, i: int, j: int, flat: Batch) -> Batch:
        """Split partition ``j``'s flat output for micro-batch ``i``; keep its skips."""
        call = self.calls.pop((i, j))
        output, skips = call.split(flat)
        keys = [key for key, value in skips.items() if value is not None]
        if keys:
            leaving = Batch(tuple(skips[key] for key in keys))  # type: ignore[misc]
            # The copies to later partitions wait for this computation.
            wait(leaving, self.compute_streams[j], self.copy_streams[j][i])
            skips.update(zip(keys, leaving, strict=True))
        if skips:
            self.waiting.setdefault(i, {}).update(skips)
        return output
