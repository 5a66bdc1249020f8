"""The GPipe module: partitions on devices, worker threads and the fill-drain schedule.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe_core import GPipe
    >>> model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), balance=[1, 1], chunks=2)
    >>> model(torch.randn(6, 4)).shape
    torch.Size([6, 4])
"""

from .__about__ import __version__
from .gpipe import CheckpointMode, GPipe
from .partition import BalanceError, Device
from .pipeline import clock_cycles
from .timeline import (
    PartitionSummary,
    Phase,
    TaskEvent,
    Timeline,
    TimelineSummary,
    task_label,
    theoretical_bubble,
)

__all__ = [
    "BalanceError",
    "CheckpointMode",
    "Device",
    "GPipe",
    "PartitionSummary",
    "Phase",
    "TaskEvent",
    "Timeline",
    "TimelineSummary",
    "__version__",
    "clock_cycles",
    "task_label",
    "theoretical_bubble",
]
