"""Intra-op threads of the workers: the CPU's cores divided among the partitions computing at once.

torch computes one operator with several threads (its intra-op pool, ``torch.get_num_threads()``,
by default one per core). Left alone, each worker of a pipeline would use all of them, and
``n`` workers computing at once would run ``n`` times as many threads as there are cores: on
the CPU they then get in each other's way, and a pipeline can be slower than the plain model.

So by default (GPipe's ``intra_op_threads=None``) each worker on the CPU, as it starts a
computation (the forward or backward pass of one micro-batch), sets its own intra-op threads
to the caller's count (``torch.get_num_threads()`` in the thread that runs the module) divided
by the number of workers on the CPU computing at that moment, itself included (at least one):
a worker alone, as at the start and the end of a schedule, uses every core; two at once use
half each. A worker takes its share again at each boundary between layers of its partitions
(before a layer's forward pass and, where the worker runs the backward pass, before its backward
pass): one that started alone gives threads up as soon as another starts, and takes them back
when the other ends, rather than holding the count it started with through a long computation.
At the end of the run every worker sets the caller's count back. An integer
``intra_op_threads`` is the count of every worker on the CPU for the whole run instead, and
``0`` leaves the workers at torch's setting (each with the whole pool).

This relies on how torch's OpenMP builds (the Linux, Windows and macOS wheels) keep the count:
``torch.set_num_threads`` sets the OpenMP and MKL counts of the *calling* thread (the other
threads keep theirs) and the count that threads started later begin with, which the end of the
run sets back to the caller's. Where torch has no OpenMP (its own pool, shared by every thread
of the process), nothing is divided: setting the count there would change it for all threads.

It must not know what the workers compute or in which order: it is told when a worker starts
and ends a computation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ThreadShare", "check_intra_op_threads"]


def check_intra_op_threads(value: object) -> int | None:
    """``value`` as GPipe's ``intra_op_threads``: None, or an integer ``>= 0``.

    Raises:
        TypeError: not None or an integer.
        ValueError: a negative integer.
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"intra_op_threads must be None or an integer (intra_op_threads: {value!r})"
        )
    if value < 0:
        raise ValueError(
            f"intra_op_threads must be None, 0 or a positive integer (intra_op_threads: {value})"
        )
    return value


def per_thread_counts() -> bool:
    """Whether each thread has its own intra-op count (torch built with OpenMP)."""
    return bool(torch.backends.openmp.is_available())  # type: ignore[no-untyped-call]


class ThreadShare:
    """The intra-op threads of the workers of one run (see the module's docstring).

    Args:
        setting: GPipe's ``intra_op_threads``.
        caller: the intra-op threads of the thread that runs the module.

    Example:
        >>> share = ThreadShare(None, caller=4)
        >>> cpu = torch.device("cpu")
        >>> with share.computing(cpu):
        ...     with share.computing(cpu):  # as another worker would, at the same time
        ...         share.busy, share.count()
        (2, 2)
    """

    def __init__(self, setting: int | None, caller: int) -> None:
        self.setting = setting
        self.caller = caller
        self.active = setting != 0 and per_thread_counts()
        # Whether a computation sets its share: with the default, and threads to divide.
        self.divides = self.active and setting is None and caller > 1
        # One entry per worker on the CPU computing now: list.append and list.pop are
        # atomic, so counting takes no lock (a lock the workers contend for costs a wake).
        self._computing: list[None] = []

    @property
    def busy(self) -> int:
        """How many workers on the CPU compute now."""
        return len(self._computing)

    def count(self) -> int:
        """The intra-op threads of a worker starting a computation now (``busy`` counted)."""
        return max(1, self.caller // max(1, self.busy))

    @contextmanager
    def worker(
        self, device: torch.device, partitions: Sequence[nn.Module] = (), backward: bool = False
    ) -> Iterator[None]:
        """Around a worker's part of the run: a fixed count for it, or by default its share
        taken again at each boundary between the layers of its ``partitions`` (before their
        forward passes and, with ``backward``, their backward passes, which the worker runs);
        the caller's count after."""
        if not (self.active and device.type == "cpu"):
            yield
            return
        if self.setting is not None:
            torch.set_num_threads(self.setting)
        handles = self._boundaries(partitions, backward) if self.divides else []
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            torch.set_num_threads(self.caller)

    def reshare(self) -> None:
        """At a boundary between layers of a computation: the share of the workers computing
        now (a worker that started alone gives threads up when another has started)."""
        if self._computing:  # run in a worker's computation, so itself counted
            count = self.count()
            if torch.get_num_threads() != count:
                torch.set_num_threads(count)

    def _boundaries(self, partitions: Sequence[nn.Module], backward: bool) -> list[RemovableHandle]:
        """Hooks that call :meth:`reshare` before each layer's forward pass (and backward
        pass): removed at the end of the run, so the layers are left as they were."""
        reshare = self.reshare

        def before_forward(_module: nn.Module, _input: object) -> None:
            reshare()

        def before_backward(_gradient: Tensor) -> None:
            reshare()

        def after_forward(_module: nn.Module, _input: object, output: object) -> None:
            # The gradient of a layer's output arrives right before its backward pass.
            if isinstance(output, (tuple, list)):
                output = next((o for o in output if isinstance(o, Tensor)), None)
            if isinstance(output, Tensor) and output.requires_grad and torch.is_grad_enabled():
                output.register_hook(before_backward)  # type: ignore[no-untyped-call]

        handles: list[RemovableHandle] = []
        for partition in partitions:
            for layer in partition.children():
                if isinstance(layer, torch.jit.ScriptModule):
                    continue  # hooks of scripted modules are compiled with them
                handles.append(layer.register_forward_pre_hook(before_forward))
                if backward:
                    handles.append(layer.register_forward_hook(after_forward))
        return handles

    def computing(self, device: torch.device) -> AbstractContextManager[object]:
        """Around one computation of a worker: its share of the cores, by default (nothing
        to do with one thread to share, or off the CPU). Cheap: it runs around every task."""
        return self if self.divides and device.type == "cpu" else _NOTHING

    def __enter__(self) -> None:
        self._computing.append(None)
        torch.set_num_threads(self.count())

    def __exit__(self, *_: object) -> None:
        self._computing.pop()


_NOTHING = nullcontext()


#: The share of a run whose partitions run in the calling thread: nothing to divide.
NO_SHARE = ThreadShare(0, 1)
