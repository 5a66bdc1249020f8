"""Lanes: state a layer keeps per micro-batch across the rounds of a decode run.

A decode run (:meth:`GPipe.decode <gpipe_core.GPipe.decode>`) splits its first input into
``chunks`` micro-batches, its *lanes*, and runs each lane through the partitions round after
round: the last partition's output of one round makes the lane's input of the next (its
*feedback*). A layer that extends a cache from round to round (the keys and values of an
attention layer, say) keeps it in :func:`lane_state`, a dict per layer and lane that lives
as long as the run: each partition holds the state of its own layers, on its process.

This module owns the lanes' store (:class:`Lanes`), the lane a thread computes
(:func:`lane_state`), what a decode run adds to a forward run (:class:`DecodeRun`) and the
marker of a lane that has stopped (:class:`Stopped`). It must not know partitions' layers or
transports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpipe_microbatch import Batch

from .._errors import add_note
from ._inputs import first_call

__all__ = ["DecodeRun", "Feedback", "Lanes", "Stopped", "lane_state"]

#: What a decode run's feedback is: ``feedback(lane, round, output)``, called on the last
#: partition's process with the lane's output of that round, returns the lane's input of
#: the next round (a tensor, a tuple of positional inputs or a dict of keyword inputs, in
#: the first round's form) or None once the lane has stopped.
Feedback = Callable[[int, int, Any], Any]


class _Current(threading.local):
    """The store and lane the calling thread computes (None outside a lane)."""

    lanes: Lanes | None = None
    lane: int = 0


_CURRENT = _Current()


class Lanes:
    """The state of each layer in each lane: what :func:`lane_state` returns.

    A decode run makes one for its lanes and drops it when it ends. A plain module run with
    the same layers (to compare with a pipeline, say) uses one too, entering each lane
    with :meth:`lane` around the lane's calls.

    Example:
        >>> lanes = Lanes()
        >>> with lanes.lane(1):
        ...     lane_state("layer")["seen"] = 3
        >>> with lanes.lane(1):
        ...     lane_state("layer")
        {'seen': 3}
        >>> lane_state("layer") is None  # outside any lane
        True
    """

    def __init__(self) -> None:
        self._states: dict[tuple[int, int], dict[str, Any]] = {}
        #: The owners, kept alive while their state is (the keys hold their ids).
        self._owners: dict[int, object] = {}
        self._lock = threading.Lock()

    @contextmanager
    def lane(self, lane: int) -> Iterator[None]:
        """Within the block, :func:`lane_state` in this thread is lane ``lane``'s."""
        current = _CURRENT
        before = current.lanes, current.lane
        current.lanes, current.lane = self, lane
        try:
            yield
        finally:
            current.lanes, current.lane = before

    def state(self, owner: object, lane: int) -> dict[str, Any]:
        """The state of ``owner`` in ``lane``, made empty the first time."""
        key = (id(owner), lane)
        with self._lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = {}
                self._owners[id(owner)] = owner
            return state

    def clear(self) -> None:
        """Drop every lane's state (what a finished run holds)."""
        with self._lock:
            self._states.clear()
            self._owners.clear()


def lane_state(owner: object) -> dict[str, Any] | None:
    """The state ``owner`` (a layer, say) keeps in the lane this thread computes, a dict
    kept across the rounds of a decode run (see :meth:`GPipe.decode
    <gpipe_core.GPipe.decode>`); None outside any lane (a forward, a step). The lanes
    keep ``owner`` alive as long as its state.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Running(nn.Module):  # the sum of a lane's inputs so far
        ...     def forward(self, x):
        ...         state = lane_state(self)
        ...         if state is None:
        ...             return x
        ...         state["sum"] = state.get("sum", 0) + x
        ...         return state["sum"]
        >>> layer, lanes = Running(), Lanes()
        >>> with lanes.lane(0):
        ...     _ = layer(torch.ones(1))
        ...     layer(torch.ones(1))
        tensor([2.])
    """
    lanes = _CURRENT.lanes
    return None if lanes is None else lanes.state(owner, _CURRENT.lane)


class Stopped:
    """What a stopped lane's messages carry instead of its activations: the partitions pass
    it on without computing."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Stopped()"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Stopped, ())


@dataclass
class DecodeRun:
    """What a decode run adds to a forward run of ``lanes`` micro-batches, ``rounds`` times:
    micro-batch ``k`` of the run is lane ``k % lanes`` in round ``k // lanes``.

    Attributes:
        lanes: how many lanes (the first round's micro-batches).
        rounds: how many rounds.
        feedback: makes a lane's next input from its output (see :data:`Feedback`).
        keywords: the first round's keyword names, which every round's input has.
        positional: how many positional inputs the first round has (None where this
            process does not know: the first partition's rank checks what it receives).
        store: the lanes' states.
    """

    lanes: int
    rounds: int
    feedback: Feedback
    keywords: tuple[str, ...]
    positional: int | None
    store: Lanes = field(default_factory=Lanes)

    def next_input(self, k: int, output: object) -> Batch | Stopped:
        """Lane ``k % lanes``'s input of the round after micro-batch ``k``'s, from its
        output (the feedback's value, checked against the first round's form). A stopped
        lane's later rounds never reach the feedback: they carry :class:`Stopped`."""
        lane, round = k % self.lanes, k // self.lanes
        try:
            value = self.feedback(lane, round, output)
        except Exception as error:
            add_note(error, f"(in the feedback of lane {lane}, round {round})")
            raise
        if value is None:
            return Stopped()
        return Batch(self._call_value(value, lane, round))

    def _call_value(self, value: object, lane: int, round: int) -> object:
        if isinstance(value, Mapping):
            args: tuple[Any, ...] = ()
            keywords: dict[str, Any] = dict(value)
        elif isinstance(value, tuple) and type(value) is tuple:
            args, keywords = value, {}
        else:
            args, keywords = (value,), {}
        known = self.positional is not None
        if known and (tuple(keywords) != self.keywords or len(args) != self.positional):
            raise TypeError(
                f"the feedback of lane {lane}, round {round} must return the next input "
                f"in the first round's form: {self.positional} positional inputs and the "
                f"keywords {list(self.keywords)}, in that order, or None once the lane has "
                f"stopped (returned: {len(args)} positional inputs and the keywords "
                f"{list(keywords)})"
            )
        return first_call(args, keywords).value
