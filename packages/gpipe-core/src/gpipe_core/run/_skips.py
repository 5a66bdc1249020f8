"""Skip connections in a partition, as explicit inputs and outputs.

A partition with skippable layers runs as a function of its input and the skips it pops
from earlier partitions, returning its output and the skips it stashes for later partitions
(as :func:`gpipe_skip.run_partition` runs it). Both sides travel in one flat batch: the partition's
values first, then the skip tensors. Under checkpointing the checkpointed function is
that flat function, so the recomputation stashes again for its own backward, and the
gradient of every skip tensor flows like any other.

A skip stashed by partition ``j`` and popped by partition ``k`` is sent by the transport from
``j`` straight to ``k`` (see :mod:`gpipe_core.transport._transport`): once per micro-batch, and
never through the partitions in between.

It must not know the transport or the schedule: how a partition's skips arrive is the
runner's.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from gpipe_microbatch import Batch, Container, check_output, make_value
from gpipe_skip import SkipKey, SkipTracker, use_skip_tracker

from .._sequential import call_partition

__all__ = ["SkipCall"]

# How a partition's flat output splits: the container of its output tuple or mapping (None for
# one value), which of its values are tensors, and which outgoing skips are tensors (the
# others are None).
_Structure = tuple[Container | None, tuple[bool, ...], tuple[SkipKey, ...]]


class SkipCall:
    """Partition ``j`` on micro-batch ``i`` as a function of one flat tuple of values.

    The flat input is the partition's input values followed by the incoming skips that
    are tensors; the flat output is the partition's output values followed by the
    outgoing skips that are tensors. ``None`` skips are known to the call, not carried.
    """

    def __init__(
        self,
        partition: nn.Sequential,
        what: str,
        batch: Batch,
        skips_in: dict[SkipKey, Tensor | None],
        provides: Sequence[SkipKey],
        unpack: bool = False,
        keywords: tuple[str, ...] = (),
    ) -> None:
        self.partition = partition
        self.what = what
        self.unpack = unpack
        self.keywords = keywords
        self.atomic = batch.atomic
        self.container = batch.container
        #: How many values the partition's input has, and how many of them are tensors.
        self.values = len(batch.present)
        self.inputs = len(batch)
        self.in_keys = tuple(key for key, value in skips_in.items() if value is not None)
        self.none_in = tuple(key for key, value in skips_in.items() if value is None)
        self.provides = tuple(provides)
        self.structure: _Structure | None = None
        # Every stash of the first run, also those popped inside the partition.
        self.history: tuple[tuple[SkipKey, bool], ...] = ()

    def flat_input(self, batch: Batch, skips_in: dict[SkipKey, Tensor | None]) -> Batch:
        """The flat batch this call takes."""
        skips = (value for value in skips_in.values() if value is not None)
        return Batch((*batch.values, *skips))

    def __call__(self, flat: object) -> tuple[object, ...]:
        values = flat if isinstance(flat, tuple) else (flat,)
        input = values[0] if self.atomic else make_value(self.container, values[: self.values])
        skips: dict[SkipKey, Tensor | None] = dict(
            zip(self.in_keys, values[self.values :], strict=True)
        )
        skips.update(dict.fromkeys(self.none_in))
        tracker = SkipTracker(skips, history=True)
        with use_skip_tracker(tracker):
            called = call_partition(self.partition, input, self.unpack, self.keywords)
            output = check_output(called, self.what)
        stashed = tracker.stashed()
        history = tuple(tracker.history or ())
        taken = Batch(output)
        outputs = taken.values
        skip_values = [stashed[key] for key in self.provides]
        present = tuple(
            key for key, value in zip(self.provides, skip_values, strict=True) if value is not None
        )
        are_tensors = tuple(isinstance(value, Tensor) for value in outputs)
        structure = (None if taken.atomic else taken.container, are_tensors, present)
        if self.structure is None:
            self.structure, self.history = structure, history
        elif structure != self.structure or history != self.history:
            # Within the partition too: the recomputed graph would belong to another
            # function than the one the checkpoint phase ran.
            raise RuntimeError(
                f"the recomputation of {self.what} differs from its first run: a conditional "
                "skip stashed None in one run and a tensor in the other, or the output "
                f"changed shape (first run stashed: {_names(self.history)}, "
                f"recomputation stashed: {_names(history)})"
            )
        return (*outputs, *(value for value in skip_values if value is not None))

    def split(self, flat: Batch) -> tuple[Batch, dict[SkipKey, Tensor | None]]:
        """Split a flat output into the partition's output and its outgoing skips."""
        assert self.structure is not None, "the partition has not run"
        container, are_tensors, present = self.structure
        values = flat.values
        count = len(are_tensors)
        output = Batch(values[0] if container is None else make_value(container, values[:count]))
        skips: dict[SkipKey, Tensor | None] = dict.fromkeys(self.provides)
        skips.update(zip(present, values[count:], strict=True))  # type: ignore[arg-type]
        return output, skips


def _names(history: Sequence[tuple[SkipKey, bool]]) -> list[str]:
    """The names of the skips a run stashed as tensors, in order."""
    return [name for (_, name), tensor in history if tensor]
