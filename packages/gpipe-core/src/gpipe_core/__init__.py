"""The GPipe module: partitions on devices, worker threads and the fill-drain schedule.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe_core import GPipe
    >>> model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), balance=[1, 1], chunks=2)
    >>> model(torch.randn(6, 4)).shape
    torch.Size([6, 4])
"""

from gpipe_microbatch import BalanceError, NoChunk, deprecated_aliases

from .__about__ import __version__
from ._arguments import CheckpointMode
from ._errors import RemotePartitionError, RemoteStageError
from ._gpipe import GPipe
from ._materialize import Init
from ._partition import WithDevice
from ._sequential import PipeSequential
from .run._lanes import Lanes, lane_state
from .run._losses import BatchMean, Losses
from .schedule._action import Action, Phase
from .schedule._check import ScheduleError, check_actions
from .schedule._decode import DecodeSchedule
from .schedule._placement import place_partitions
from .schedule._schedules import (
    GPipeSchedule,
    InterleavedOneFOneBSchedule,
    OneFOneBSchedule,
    Schedule,
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
    clock_cycles,
    get_schedule,
    schedules,
)
from .schedule._simulate import simulate
from .trace._timeline import (
    PartitionSummary,
    TaskEvent,
    Timeline,
    TimelineSummary,
    task_label,
    theoretical_bubble,
)
from .transport._agreement import RanksDisagree

__all__ = [
    "Action",
    "BalanceError",
    "BatchMean",
    "CheckpointMode",
    "DecodeSchedule",
    "GPipe",
    "GPipeSchedule",
    "Init",
    "InterleavedOneFOneBSchedule",
    "Lanes",
    "Losses",
    "NoChunk",
    "OneFOneBSchedule",
    "PartitionSummary",
    "Phase",
    "PipeSequential",
    "RanksDisagree",
    "RemotePartitionError",
    "RemoteStageError",
    "Schedule",
    "ScheduleError",
    "TaskEvent",
    "Timeline",
    "TimelineSummary",
    "WithDevice",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
    "__version__",
    "check_actions",
    "clock_cycles",
    "get_schedule",
    "lane_state",
    "place_partitions",
    "schedules",
    "simulate",
    "task_label",
    "theoretical_bubble",
]

#: Old names, kept as deprecated aliases of the new ones; not in ``__all__``.
_RENAMED = {"Interleaved1F1BSchedule": "InterleavedOneFOneBSchedule"}


__getattr__ = deprecated_aliases(__name__, _RENAMED, globals())
