"""What a training step (:meth:`GPipe.step <gpipe_core.GPipe.step>`) handles around its
run: the input and target cut from the caller's graph, the target split as the input was
and moved to the last partition's device, each micro-batch's loss and its scale for the
reduction, and the :class:`~gpipe_core.Losses` returned; the step of an empty pipeline too
(the losses of the input itself).

This module must not know partitions, schedules or transports: the run that computes the
losses is the module's to make, and where the first and last partitions run it is told.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from gpipe_microbatch import Batch, scatter

from ._inputs import Leaves, StepArguments, batch_sizes, to_device
from ._losses import Losses, LossFunction, Reduction
from ._partition_run import LossSpec

__all__ = ["StepLeaves"]


class StepLeaves:
    """A step's input and target on this process, cut from the caller's graph: the input on
    the first partition's rank (``first``), the target on the last partition's (see
    :meth:`losses`); the gradients they get in the step go to the caller's graph at
    :meth:`end`.
    """

    def __init__(self, arguments: StepArguments, backward: bool, *, first: bool) -> None:
        self.backward = backward
        self._input = Leaves(arguments.input, backward) if first else None
        self._target: Leaves | None = None
        self._losses: LossSpec | None = None

    @property
    def input(self) -> object:
        """The input the micro-batches are cut from (None off the first partition's rank)."""
        return self._input.value if self._input else None

    def losses(
        self,
        target: object,
        sizes: Sequence[int],
        chunks: int,
        device: torch.device | None,
        loss_fn: LossFunction,
        reduction: Reduction,
    ) -> LossSpec:
        """The losses of the last partition: ``target`` split into micro-batches of the
        input's ``sizes`` and moved to ``device``, each micro-batch's loss scaled for
        ``reduction``.

        Raises:
            ValueError: ``target``'s batch size differs from the input's.
        """
        self._target = Leaves(target, self.backward)
        targets = scatter(self._target.value, chunks, what="target")
        target_sizes = batch_sizes(self._target.value, targets)
        if list(sizes) != target_sizes:
            raise ValueError(
                "target must have the input's batch size "
                f"(input: {sum(sizes)}, target: {sum(target_sizes)})"
            )
        if device is not None:
            targets = [
                batch if all(t.device == device for t in batch) else to_device(batch, device)
                for batch in targets
            ]
        total = sum(sizes)
        scales = [size / total if reduction == "mean" and total else 1.0 for size in sizes]
        self._losses = LossSpec(loss_fn, targets, scales, self.backward)
        return self._losses

    def identity(self, batches: Sequence[Batch]) -> None:
        """The step of an empty pipeline, the identity: the losses of the input itself."""
        losses = self._losses
        assert losses is not None and self._input is not None and self._target is not None
        with torch.set_grad_enabled(self.backward):
            for i, batch in enumerate(batches):
                loss = losses(i, batch)
                if self.backward:
                    torch.autograd.backward(loss, losses.seed(i, loss))

    def end(self, sizes: Sequence[int], reduction: Reduction) -> Losses | None:
        """Hand the gradients of the input and target to the caller's graph; the losses
        (on the last partition's rank; None elsewhere)."""
        if self._input is not None:
            self._input.backward()
        if self._target is not None:
            self._target.backward()
        if self._losses is None:
            return None
        return Losses(cast(list[torch.Tensor], self._losses.losses), sizes, reduction)
