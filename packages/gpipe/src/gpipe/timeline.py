"""Timelines of pipeline runs: ``with model.trace() as timeline``, Chrome traces and plots.

The names are those of :mod:`gpipe_core`, re-exported.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe import GPipe
    >>> model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2)
    >>> with model.trace() as timeline:
    ...     model(torch.randn(4, 4)).sum().backward()
    >>> timeline.summary().theoretical_bubble
    0.3333333333333333
"""

from gpipe_core import (
    PartitionSummary,
    Phase,
    TaskEvent,
    Timeline,
    TimelineSummary,
    task_label,
    theoretical_bubble,
)

__all__ = [
    "PartitionSummary",
    "Phase",
    "TaskEvent",
    "Timeline",
    "TimelineSummary",
    "task_label",
    "theoretical_bubble",
]
