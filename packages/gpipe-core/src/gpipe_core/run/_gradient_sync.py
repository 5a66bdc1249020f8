"""FSDP2's gradient reduction once per step: a partition sharded with
:func:`torch.distributed.fsdp.fully_shard` (``GPipe(..., mesh=mesh)`` with ``"dp_shard"``)
reduce-scatters its gradients in the backward pass of its last micro-batch of a step only.

FSDP reduces a unit's gradients at the end of every backward pass through it. A step runs
one backward pass per micro-batch, so before each, :class:`GradientSync` tells the unit
whether it is the step's last for the partition: before the others, FSDP keeps the
unsharded gradients and adds the next micro-batch's to them, without any collective; before
the last, it reduce-scatters their sum (over ``"dp_shard"``, and all-reduces over
``"dp_replicate"`` with HSDP) once, and waits for it. Between micro-batches the gathered
parameters are freed after each backward pass when they are freed after each forward pass
(``reshard_after_forward=True``), else kept until the last.

A backward pass split in two (the zero-bubble schedules' input and weight gradients) would
let FSDP reduce at the end of the input gradient, before the weight gradient exists: such a
schedule on a sharded partition is refused.

This module knows nothing of meshes or transports: it reads a partition's action lists and
sets FSDP's flags on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from ..schedule._action import Action, Phase

__all__ = ["GradientSync"]


class GradientSync:
    """When partition ``index`` (``module``, sharded with ``fully_shard``) reduces its
    gradients in a run of ``actions`` (each worker's list).

    Raises:
        ValueError: the actions split the partition's backward pass (``I`` and ``W``).
    """

    def __init__(self, index: int, module: nn.Module, actions: Sequence[Sequence[Action]]) -> None:
        self.module = module
        #: The micro-batch of the partition's last backward pass in the run (None: none).
        self.last: int | None = None
        for row in actions:
            for action in row:
                if action.partition != index:
                    continue
                if action.kind in (Phase.INPUT_GRADIENT, Phase.WEIGHT_GRADIENT):
                    raise ValueError(
                        "a schedule that splits the backward pass into input and weight "
                        f"gradients cannot run partition {index}, which is sharded over the "
                        f"mesh's 'dp_shard' (action: {action}): FSDP would reduce its "
                        "gradients before the weight gradients exist; use 'gpipe', '1f1b' or "
                        "'interleaved-1f1b'"
                    )
                if action.kind is Phase.BACKWARD:
                    self.last = action.microbatch

    @staticmethod
    def of(
        index: int, module: nn.Module, actions: Sequence[Sequence[Action]]
    ) -> GradientSync | None:
        """The gradient sync of partition ``index`` if ``module`` is sharded, else None."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule):
            return None
        return GradientSync(index, module, actions)

    @contextmanager
    def backward(self, i: int) -> Iterator[None]:
        """Around micro-batch ``i``'s backward pass: reduce in it only if it is the last.
        A checkpointed micro-batch's recomputation keeps the parameters it gathers for the
        backward pass that follows (one gathering for both)."""
        from torch.distributed.fsdp import FSDPModule

        module = self.module
        assert isinstance(module, FSDPModule)
        last = i == self.last
        reshards = _reshards_after_forward(module)
        module.set_requires_gradient_sync(last)
        module.set_is_last_backward(last)
        # Freed after every backward pass where they are after every forward pass.
        module.set_reshard_after_backward(last or reshards)
        module.set_reshard_after_forward(False)
        try:
            yield
        finally:
            module.set_reshard_after_forward(reshards)


def _reshards_after_forward(module: nn.Module) -> bool:
    """Whether ``module`` (a ``fully_shard`` unit) frees its gathered parameters after the
    forward pass, as the pipeline set it (:func:`~gpipe_core._mesh.shard_partitions`)."""
    return bool(getattr(module, "_gpipe_reshard_after_forward", True))
