"""Skip trackers: where stashed tensors wait until a later layer pops them.

A skippable layer hands its stashes and pops to the *current tracker* of its thread. By
default that is a per-thread tracker, so that skippable layers called in order in one
thread (a plain :class:`torch.nn.Sequential`, a profiler timing layer by layer) just work.
A pipeline installs a tracker of its own around each partition with
:func:`use_skip_tracker`, or runs the partition through :func:`run_partition`, which turns
it into a function of its input and its incoming skips.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from ._namespace import SkipKey

__all__ = [
    "SkipTracker",
    "current_skip_tracker",
    "run_partition",
    "use_skip_tracker",
]


class SkipTracker:
    """Stashed skip tensors (or ``None``), keyed by ``(namespace, name)``.

    A stash under a key that is already stashed replaces the old tensor, so an exception
    between a stash and its pop leaves nothing behind that could grow; a pop removes the
    tensor, so the tracker holds a tensor no longer than needed.

    Args:
        skips: skips stashed before the first layer runs (the skips a partition receives
            from earlier partitions).

    Keyword Args:
        history: record every stash in :attr:`history` (for a tracker that lives for one
            run of a function, as a pipeline's does).

    Example:
        >>> import torch
        >>> from gpipe_skip import DEFAULT_NAMESPACE
        >>> tracker = SkipTracker()
        >>> tracker.stash((DEFAULT_NAMESPACE, "skip"), torch.ones(1))
        >>> tracker.pop((DEFAULT_NAMESPACE, "skip"))
        tensor([1.])
        >>> len(tracker)
        0
    """

    __slots__ = ("_skips", "history")

    def __init__(
        self, skips: Mapping[SkipKey, Tensor | None] | None = None, *, history: bool = False
    ) -> None:
        self._skips: dict[SkipKey, Tensor | None] = dict(skips) if skips else {}
        #: With ``history=True``, every stash made into this tracker, in order, as the pair
        #: of its key and whether it stashed a tensor rather than None (else None: a
        #: long-lived tracker keeps nothing). Two runs of one function that stash alike
        #: have equal histories; a recomputation checks its own against the first run's.
        self.history: list[tuple[SkipKey, bool]] | None = [] if history else None

    def stash(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Keep ``tensor`` under ``key`` until it is popped."""
        self._skips[key] = tensor
        if self.history is not None:
            self.history.append((key, tensor is not None))

    def pop(self, key: SkipKey) -> Tensor | None:
        """Remove and return the tensor stashed under ``key``.

        Raises:
            LookupError: nothing is stashed under ``key``.
        """
        try:
            return self._skips.pop(key)
        except KeyError:
            namespace, name = key
            raise LookupError(
                f"no skip tensor is stashed under {name!r} in {namespace!r}: a layer must "
                f"stash it before it is popped (stashed: {self._names()})"
            ) from None

    def _names(self) -> list[str]:
        return [name for _, name in self._skips]

    def stashed(self) -> dict[SkipKey, Tensor | None]:
        """What is stashed and not popped yet, in stash order (a new dict)."""
        return dict(self._skips)

    def clear(self) -> None:
        """Forget everything stashed."""
        self._skips.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._skips

    def __len__(self) -> int:
        return len(self._skips)

    def __iter__(self) -> Iterator[SkipKey]:
        return iter(list(self._skips))

    def __repr__(self) -> str:
        return f"SkipTracker(stashed={self._names()})"


class _Local(threading.local):
    def __init__(self) -> None:
        self.default = SkipTracker()
        self.current: SkipTracker | None = None


_local = _Local()


def current_skip_tracker() -> SkipTracker:
    """The tracker of the calling thread: the one installed by :func:`use_skip_tracker`,
    else the thread's default tracker.

    Example:
        >>> with use_skip_tracker(SkipTracker()) as tracker:
        ...     current_skip_tracker() is tracker
        True
    """
    current = _local.current
    return _local.default if current is None else current


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Generator[SkipTracker, None, None]:
    """Make ``tracker`` the calling thread's current tracker inside the ``with`` block.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gpipe_skip import pop, skippable, stash
        >>> @skippable(stash=["x"])
        ... class Keep(nn.Module):
        ...     def forward(self, x):
        ...         yield stash("x", x)
        ...         return x + 1
        >>> with use_skip_tracker(SkipTracker()) as tracker:
        ...     _ = Keep()(torch.zeros(1))
        >>> [name for _, name in tracker]
        ['x']
    """
    if not isinstance(tracker, SkipTracker):
        raise TypeError(f"tracker must be a SkipTracker (tracker: {type(tracker).__name__})")
    previous = _local.current
    _local.current = tracker
    try:
        yield tracker
    finally:
        _local.current = previous


def run_partition(
    partition: Callable[[Any], Any],
    input: object,
    skips: Mapping[SkipKey, Tensor | None] | None = None,
) -> tuple[Any, dict[SkipKey, Tensor | None]]:
    """Run ``partition(input)`` as a function of its input and its incoming skips.

    The partition's pops are served from ``skips`` (skips stashed by earlier partitions)
    or from stashes made by its own earlier layers, which involve no copy. What its layers
    stash and no later layer of the partition pops is returned, for later partitions.

    Args:
        partition: a callable, typically an :class:`torch.nn.Sequential` slice of a model.
        input: the partition's input.
        skips: the skip tensors (or ``None``) this partition pops but does not stash.

    Returns:
        ``(output, skips_out)``: the partition's output and the skips it leaves stashed.
        (:class:`SkipTracker` and :func:`use_skip_tracker` give more: every stash made.)

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gpipe_skip import DEFAULT_NAMESPACE, pop, skippable, stash
        >>> @skippable(pop=["x"])
        ... class Add(nn.Module):
        ...     def forward(self, input):
        ...         x = yield pop("x")
        ...         return input + x
        >>> output, out = run_partition(
        ...     nn.Sequential(Add()), torch.ones(1), {(DEFAULT_NAMESPACE, "x"): torch.ones(1)}
        ... )
        >>> output, out
        (tensor([2.]), {})
    """
    tracker = SkipTracker(skips)
    with use_skip_tracker(tracker):
        output = partition(input)
    return output, tracker.stashed()
