"""The public names of the gpipe facade: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

import gpipe
import gpipe.balance
import gpipe.bn
import gpipe.schedule
import gpipe.skip
import gpipe.timeline

NAMES = [
    "BalanceError",
    "GPipe",
    "__version__",
    "balance",
    "bn",
    "is_checkpointing",
    "is_recomputing",
    "schedule",
    "skip",
    "timeline",
]

#: The facade modules gpipe.<name>: user API. The command line and the demo are private.
SUBMODULES = ["balance", "bn", "schedule", "skip", "timeline"]

#: The names of each facade module.
SUBMODULE_NAMES = {
    "balance": [
        "BalanceError",
        "balance_by_size",
        "balance_by_time",
        "block_costs",
        "profile_sizes",
        "profile_times",
        "solve",
    ],
    "bn": ["DeferredBatchNorm", "convert_deferred_batch_norm", "mini_batch"],
    "schedule": [
        "Action",
        "GPipeSchedule",
        "Losses",
        "OneFOneBSchedule",
        "Schedule",
        "ScheduleError",
        "check_actions",
        "get_schedule",
        "schedules",
        "simulate",
    ],
    "skip": [
        "Namespace",
        "SkipLayout",
        "SkipRoute",
        "SkipTracker",
        "Skippable",
        "inspect_skip_layout",
        "pop",
        "run_partition",
        "skippable",
        "stash",
        "use_skip_tracker",
        "verify_skippables",
    ],
    "timeline": [
        "PartitionSummary",
        "Phase",
        "TaskEvent",
        "Timeline",
        "TimelineSummary",
        "task_label",
        "theoretical_bubble",
    ],
}


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    public_names(gpipe, NAMES, SUBMODULES)


@pytest.mark.parametrize("name", SUBMODULES)
def test_facade_module_names(name: str) -> None:
    module = getattr(gpipe, name)
    assert sorted(module.__all__) == SUBMODULE_NAMES[name]
    for attribute in module.__all__:
        assert getattr(module, attribute, None) is not None, f"gpipe.{name}.{attribute}"
