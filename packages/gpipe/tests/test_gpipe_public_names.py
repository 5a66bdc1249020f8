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
import gpipe.transformers
import gpipe_balance
import gpipe_bn
import gpipe_core
import gpipe_skip
import gpipe_transformers

NAMES = [
    "BalanceError",
    "BatchMean",
    "GPipe",
    "Lanes",
    "NoChunk",
    "PipeSequential",
    "RanksDisagree",
    "RemotePartitionError",
    "RemoteStageError",
    "WithDevice",
    "__version__",
    "balance",
    "bn",
    "is_checkpointing",
    "is_recomputing",
    "lane_state",
    "schedule",
    "skip",
    "timeline",
]

#: The facade modules gpipe.<name>: user API. The command line and the demo are private.
#: gpipe.transformers is imported when first used, and is not in __all__ (so that
#: ``from gpipe import *`` needs no transformers).
SUBMODULES = ["balance", "bn", "schedule", "skip", "timeline", "transformers"]

#: The facade modules that re-export a distribution: every public name of it but those listed.
REEXPORTS = {
    "balance": (gpipe_balance, {"__version__"}),
    "bn": (gpipe_bn, {"__version__"}),
    # The skip machinery that only pipelines use (keys, commands, the current tracker) stays
    # in gpipe_skip.
    "skip": (
        gpipe_skip,
        {"DEFAULT_NAMESPACE", "Pop", "SkipKey", "Stash", "__version__", "current_skip_tracker"},
    ),
    "transformers": (gpipe_transformers, {"__version__"}),
}

#: The facade modules over gpipe-core, which keeps them among other names.
CORE_NAMES = {
    "schedule": [
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


@pytest.mark.parametrize("name", sorted(REEXPORTS))
def test_facade_modules_reexport_a_distribution(name: str) -> None:
    module = getattr(gpipe, name)
    package, kept_out = REEXPORTS[name]
    assert sorted(module.__all__) == sorted(set(package.__all__) - kept_out)
    for attribute in module.__all__:
        assert getattr(module, attribute) is getattr(package, attribute), attribute


@pytest.mark.parametrize("name", sorted(CORE_NAMES))
def test_facade_modules_over_gpipe_core(name: str) -> None:
    module = getattr(gpipe, name)
    assert sorted(module.__all__) == CORE_NAMES[name]
    for attribute in module.__all__:
        assert getattr(module, attribute) is getattr(gpipe_core, attribute), attribute


def test_every_facade_module_is_pinned() -> None:
    assert sorted([*REEXPORTS, *CORE_NAMES]) == SUBMODULES


#: Old names of the facade modules over gpipe-core, kept as deprecated aliases.
RENAMED = {"schedule": {"Interleaved1F1BSchedule": "InterleavedOneFOneBSchedule"}}


@pytest.mark.parametrize("name", sorted(RENAMED))
def test_old_names_warn_and_are_the_new_objects(name: str) -> None:
    module = getattr(gpipe, name)
    for old, new in RENAMED[name].items():
        assert old not in module.__all__
        with pytest.warns(DeprecationWarning, match=f"gpipe.{name}.{old} is deprecated"):
            value = getattr(module, old)
        assert value is getattr(gpipe_core, new)
