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
half each. At the end of the run every worker sets the caller's count back. An integer
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

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

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
    def worker(self, device: torch.device) -> Iterator[None]:
        """Around a worker's part of the run: a fixed count for it, and the caller's after."""
        if not (self.active and device.type == "cpu"):
            yield
            return
        if self.setting is not None:
            torch.set_num_threads(self.setting)
        try:
            yield
        finally:
            torch.set_num_threads(self.caller)

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
