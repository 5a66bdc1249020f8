"""Data parallelism around a pipeline: its replicas average their gradients once per step.

With ``GPipe(..., data_group=group)``, each process's partitions have replicas in the other
processes of ``group``, which train on other data. After each step, :class:`Replicas`
averages this process's gradients over them: one ``all_reduce`` per dtype, whose first
buffer also counts the replicas that failed (then no gradient changes, and every replica
raises).

This module knows nothing of partitions or schedules: it averages the gradients of the
parameters it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .._dtensor import gradient_like, local_part
from .._errors import add_note
from ._collective import wait_collective

__all__ = ["Replicas"]


class Replicas:
    """The data-parallel replicas of a pipeline's partitions in this process.

    Args:
        group: the process group of the replicas whose gradients are averaged here (None:
            none; the steps are unchanged).
        timeout: the seconds the average may wait for the other replicas (None: no
            bound).
        counted: the process groups over which :meth:`mean` takes its mean, one after the
            other (default: ``group``'s alone). On a mesh, every data-parallel dimension's,
            also those whose gradients FSDP reduces itself (``"dp_shard"``).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        timeout: float | None,
        counted: Sequence[dist.ProcessGroup] | None = None,
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.counted = tuple(counted) if counted is not None else (group,) if group else ()

    @contextmanager
    def averaging(self, parameters: Callable[[], Iterable[nn.Parameter]]) -> Iterator[None]:
        """Average the gradients of ``parameters()`` after the ``with`` block (a step); if
        the block raises, tell the replicas, which then raise too.

        Raises:
            RuntimeError: another replica failed in this step (no gradient is averaged).
            TimeoutError: the replicas did not all end the step within the timeout.
        """
        if self.group is None:
            yield
            return
        try:
            yield
        except BaseException as error:
            try:
                self.average(parameters(), failed=True)
            except Exception as also:
                add_note(error, f"(telling the data-parallel replicas failed too: {also})")
            raise
        self.average(parameters(), failed=False)

    def mean_on(self, devices: Sequence[torch.device]) -> Callable[[float | None], float]:
        """:meth:`mean` on the last partition's device (of ``devices``, each partition's)."""
        return functools.partial(self.mean, device=devices[-1] if devices else torch.device("cpu"))

    def mean(self, value: float | None, device: torch.device) -> float:
        """The mean of ``value`` over the replicas (``value`` itself without them), by one
        ``all_reduce`` on ``device`` per counted group (the sum and the failures over the
        first, then over the next); None: this replica failed before it had a value, and
        tells the others.

        Raises:
            RuntimeError: another replica failed before it had its value.
            TimeoutError: the replicas did not all take part within the timeout.
        """
        if not self.counted:
            return 0.0 if value is None else value
        flat = torch.tensor(
            [0.0 if value is None else value, 1.0 if value is None else 0.0],
            dtype=torch.float64, device=device,
        )  # fmt: skip
        size = 1
        for group in self.counted:
            work = dist.all_reduce(flat, group=group, async_op=True)
            wait_collective(
                work, self.timeout, "the data-parallel replicas did not all begin the step"
            )
            size *= group.size()
        total, failures = flat.tolist()
        if value is None:
            return 0.0  # this replica raises its own error
        if failures:
            raise RuntimeError(
                f"{int(failures)} data-parallel replica(s) failed before the step's losses"
            )
        return float(total) / size

    def average(self, parameters: Iterable[nn.Parameter], *, failed: bool) -> None:
        """Average the gradients of ``parameters`` over the replicas (``failed``: this
        replica failed, and contributes only that)."""
        group = self.group
        assert group is not None
        parameters = [p for p in parameters if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in parameters:
            by_dtype.setdefault(p.dtype, []).append(p)
        if not by_dtype:
            by_dtype[torch.float32] = []
        flats: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        for dtype, group_parameters in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            grads = [
                torch.zeros_like(local_part(p)) if failed or p.grad is None else local_part(p.grad)
                for p in group_parameters
            ]
            flat = torch.cat(
                [grad.reshape(-1) for grad in grads]
                + [torch.zeros(1, dtype=dtype, device=grads[0].device if grads else "cpu")]
            )
            if not flats:
                flat[-1] = 1.0 if failed else 0.0
            flats.append((flat, group_parameters))
        works = [dist.all_reduce(flat, group=group, async_op=True) for flat, _ in flats]
        for work in works:
            wait_collective(
                work, self.timeout, "the data-parallel replicas did not all end the step"
            )
        failures = int(flats[0][0][-1].item())
        if failures:
            if failed:
                return  # this replica raises its own error
            raise RuntimeError(
                f"{failures} data-parallel replica(s) failed in this step; the gradients were "
                "not averaged (zero them before the next step)"
            )
        size = group.size()
        for flat, group_parameters in flats:
            offset = 0
            for p in group_parameters:
                shard = local_part(p)
                count = shard.numel()
                averaged = flat[offset : offset + count].view_as(shard) / size
                if p.grad is None:
                    p.grad = gradient_like(p, averaged)
                else:
                    local_part(p.grad).copy_(averaged)
                offset += count
