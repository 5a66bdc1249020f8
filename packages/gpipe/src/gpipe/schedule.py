"""Pipeline schedules for :meth:`GPipe.step <gpipe_core.GPipe.step>`, as action lists.

The names are those of :mod:`gpipe_core` (and :class:`~gpipe_core.Losses`),
re-exported.

Example:
    >>> from gpipe.schedule import get_schedule
    >>> print(get_schedule("gpipe").grid(microbatches=2, partitions=2))
    p0: F0 F1 .  .  B1 B0
    p1: .  F0 F1 B1 B0 .
"""

import warnings

from gpipe_core import (
    Action,
    GPipeSchedule,
    InterleavedOneFOneBSchedule,
    Losses,
    OneFOneBSchedule,
    Schedule,
    ScheduleError,
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
    check_actions,
    get_schedule,
    place_partitions,
    schedules,
    simulate,
)

__all__ = [
    "Action",
    "GPipeSchedule",
    "InterleavedOneFOneBSchedule",
    "Losses",
    "OneFOneBSchedule",
    "Schedule",
    "ScheduleError",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
    "check_actions",
    "get_schedule",
    "place_partitions",
    "schedules",
    "simulate",
]

#: Old names, kept as deprecated aliases of the new ones; not in ``__all__``.
_RENAMED = {"Interleaved1F1BSchedule": "InterleavedOneFOneBSchedule"}


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"{__name__}.{name} is deprecated, use {__name__}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
