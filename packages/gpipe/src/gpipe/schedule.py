"""Pipeline schedules for :meth:`GPipe.step <gpipe_core.GPipe.step>`, as action lists.

The names are those of :mod:`gpipe_core` (and :class:`~gpipe_core.Losses`),
re-exported.

Example:
    >>> from gpipe.schedule import get_schedule
    >>> print(get_schedule("gpipe").grid(microbatches=2, partitions=2))
    p0: F0 F1 .  .  B1 B0
    p1: .  F0 F1 B1 B0 .
"""

from gpipe_core import (
    Action,
    DecodeSchedule,
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
from gpipe_microbatch import deprecated_aliases

__all__ = [
    "Action",
    "DecodeSchedule",
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


__getattr__ = deprecated_aliases(__name__, _RENAMED, globals())
