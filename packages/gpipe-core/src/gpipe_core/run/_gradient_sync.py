"""FSDP2's gradient reduction once per step: a partition sharded with
:func:`torch.distributed.fsdp.fully_shard` (``GPipe(..., mesh=mesh)`` with ``"dp_shard"``)
reduce-scatters its gradients once per step, after its last micro-batch's backward pass.

FSDP reduces a unit's gradients at the end of every backward pass through it. A step runs
one backward pass per micro-batch, so around each, :class:`GradientSync` turns that off:
FSDP keeps the unsharded gradients and adds the next micro-batch's to them, without any
collective. After the partition's last backward task of the step, once that task has sent
its gradient to the partition before it (so that the reduction keeps no other partition
waiting, as ``torch.distributed.pipelining`` reduces after its last send), the runner has
FSDP reduce-scatter their sum (over ``"dp_shard"``, and all-reduce over ``"dp_replicate"``
with HSDP) once, and wait for it (:meth:`GradientSync.reduce`). Between micro-batches the
gathered parameters are freed after each backward pass when they are freed after each
forward pass (``reshard_after_forward=True``), else kept until the reduction; a
checkpointed micro-batch's recomputation keeps what it gathers for the backward pass that
follows.

A backward pass split in two (the zero-bubble schedules' input and weight gradients, ``I``
and ``W``) runs FSDP's backward hooks in the input gradient, before the weight gradient
exists, and the weight gradient runs outside FSDP's hooks. Then every ``I`` and ``W`` runs
without reduction too, the partition's parameters stay gathered for the whole step (a
weight gradient may read them), and the reduction comes after its last ``W``. Either way it
runs through FSDP's own post-backward, reaching into FSDP's private state as
``torch.distributed.pipelining``'s stage does for the same reason.

A run that fails or is cancelled leaves FSDP holding the unsharded gradients of the
micro-batches whose backward passes ended: :meth:`GradientSync.abandon` drops them (the
step's gradients never reach ``.grad``), so the next step is the plain model's: FSDP's
``reset_iter_state``, and the unsharded gradients it keeps, from FSDP's private state too.

This module knows nothing of meshes or transports: it reads a partition's action lists and
sets FSDP's flags on it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..schedule._action import Action, Phase

__all__ = ["GradientSync"]

_BACKWARD_KINDS = (Phase.BACKWARD, Phase.INPUT_GRADIENT, Phase.WEIGHT_GRADIENT)


class GradientSync:
    """When partition ``index`` (``module``, sharded with ``fully_shard``) reduces its
    gradients in a run of ``actions`` (each worker's list)."""

    def __init__(self, index: int, module: Any, actions: Sequence[Sequence[Action]]) -> None:
        #: The partition, an ``FSDPModule``.
        self.module = module
        #: The kind and micro-batch of the partition's last backward task in the run.
        self.last: tuple[Phase, int] | None = None
        #: Whether the run splits the partition's backward passes (``I`` and ``W``).
        self.split = False
        for row in actions:
            for action in row:
                if action.partition == index and action.kind in _BACKWARD_KINDS:
                    self.last = (action.kind, action.microbatch)
                    self.split = self.split or action.kind is not Phase.BACKWARD
        #: Whether the pipeline frees the gathered parameters after each forward pass (see
        #: :func:`~gpipe_core._mesh.shard_partitions`).
        self.reshards = bool(vars(module).get("_gpipe_reshard_after_forward", True))
        #: The FSDP units in the partition (itself, and any the user made inside it), found
        #: once: FSDP's setters walk every submodule on each call, several times a task.
        fsdp = sys.modules["torch.distributed.fsdp"]
        self.units = [unit for unit in module.modules() if isinstance(unit, fsdp.FSDPModule)]
        #: Whether the units free the gathered parameters after a forward pass now.
        self.after_forward = self.reshards and not self.split
        # Split: gathered from the first forward pass to the reduction.
        self._set("set_reshard_after_forward", self.after_forward)

    def _set(self, setter: str, value: bool) -> None:
        """Call FSDP's ``setter`` with ``value`` on each unit (not recursing: each is one)."""
        for unit in self.units:
            getattr(unit, setter)(value, recurse=False)

    def _reshard_after_forward(self, value: bool) -> None:
        if value != self.after_forward:
            self._set("set_reshard_after_forward", value)
            self.after_forward = value

    @staticmethod
    def of(
        index: int, module: nn.Module, actions: Sequence[Sequence[Action]]
    ) -> GradientSync | None:
        """The gradient sync of partition ``index`` if ``module`` is sharded, else None."""
        # Without FSDP imported no module is sharded: a pipeline without a mesh does not
        # import it.
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is None or not isinstance(module, fsdp.FSDPModule):
            return None
        return GradientSync(index, module, actions)

    @contextmanager
    def backward(self, i: int, kind: Phase) -> Iterator[None]:
        """Around micro-batch ``i``'s backward task of ``kind`` (``B``, ``I`` or ``W``): its
        gradients accumulated, not reduced (:meth:`reduce` comes after the partition's last
        task of the run, once its messages are sent: :meth:`reduces_after`)."""
        self._set("set_requires_gradient_sync", False)
        self.module.set_is_last_backward(False)
        # Freed after every backward pass where they are after every forward pass.
        self._set("set_reshard_after_backward", self.reshards and not self.split)
        self._reshard_after_forward(False)  # a recomputation keeps them for its backward
        try:
            yield
        finally:
            self._reshard_after_forward(self.reshards and not self.split)

    def reduces_after(self, i: int, kind: Phase) -> bool:
        """Whether :meth:`reduce` comes after micro-batch ``i``'s backward task of ``kind``:
        the partition's last in the run. It comes once the task's messages are sent, so that
        the partitions waiting for them wait no longer (as ``torch.distributed.pipelining``
        reduces after its last send)."""
        return (kind, i) == self.last

    def abandon(self) -> None:
        """After a run that failed or was cancelled: drop what FSDP holds of the run (the
        unsharded gradients not reduced yet, its per-iteration state) and free the gathered
        parameters (FSDP's ``reset_iter_state``), so that the next step starts afresh."""
        module = self.module
        module.reset_iter_state()
        # reset_iter_state leaves the unsharded gradients: dropped here.
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param._unsharded_param.grad = None
        self._set("set_reshard_after_forward", self.reshards)
        self.after_forward = self.reshards

    def reduce(self) -> None:
        """Reduce-scatter what the step's backward tasks accumulated, then free the gathered
        parameters, through FSDP's post-backward and its end-of-backward callback (which
        waits for the reduction), as a backward pass through FSDP's hooks would end."""
        module = self.module
        self._set("set_requires_gradient_sync", True)
        module.set_is_last_backward(True)
        self._set("set_reshard_after_backward", True)
        state = module._get_fsdp_state()
        for group in state._fsdp_param_groups:
            group.post_backward()
        state._root_post_backward_final_callback()
        self._set("set_reshard_after_forward", self.reshards)
        self.after_forward = self.reshards
