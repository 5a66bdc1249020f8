"""gpipe_core's public surface: the names it exports, where they are defined, no public modules.

A change to this list is a change to the public API: it goes into the changelog.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import gpipe_core

PUBLIC_NAMES = [
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

#: Old names, kept as deprecated aliases of the new ones: not public names any more.
RENAMED = {"Interleaved1F1BSchedule": "InterleavedOneFOneBSchedule"}

# Names that are the very objects of a sibling distribution, re-exported.
REEXPORTED = {"BalanceError", "NoChunk"}


def _classes_and_functions() -> list[tuple[str, object]]:
    return [
        (name, value)
        for name in gpipe_core.__all__
        if inspect.isclass(value := getattr(gpipe_core, name)) or inspect.isfunction(value)
    ]


def test_the_public_names_are_pinned() -> None:
    assert sorted(gpipe_core.__all__) == PUBLIC_NAMES
    assert len(set(gpipe_core.__all__)) == len(gpipe_core.__all__)


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_old_names_warn_and_are_the_new_objects(old: str, new: str) -> None:
    assert old not in gpipe_core.__all__
    with pytest.warns(DeprecationWarning, match=f"gpipe_core.{old} is deprecated"):
        value = getattr(gpipe_core, old)
    assert value is getattr(gpipe_core, new)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        gpipe_core.NoSuchName  # noqa: B018


def test_every_public_name_resolves() -> None:
    for name in gpipe_core.__all__:
        assert hasattr(gpipe_core, name), name
    version = gpipe_core.__version__
    assert isinstance(version, str) and version.count(".") >= 2


def test_classes_and_functions_are_defined_in_gpipe_core() -> None:
    checked = _classes_and_functions()
    assert {name for name, _ in checked} >= {"GPipe", "Timeline", "simulate", "BalanceError"}
    for name, value in checked:
        module = value.__module__  # type: ignore[attr-defined]
        if name in REEXPORTED:
            # The sibling's own object, public there under the same name.
            owner = importlib.import_module(module.split(".")[0])
            assert owner.__name__ != "gpipe_core", name
            assert getattr(owner, name) is value, name
            continue
        # gpipe_core itself or one of its private modules, never a public submodule.
        assert module == "gpipe_core" or _is_private(module), (name, module)
        # What pickle and tracebacks use to find it again.
        qualname = value.__qualname__  # type: ignore[attr-defined]
        assert getattr(importlib.import_module(module), qualname) is value, name


def test_public_objects_pickle_by_reference() -> None:
    for name, value in _classes_and_functions():
        assert pickle.loads(pickle.dumps(value)) is value, name


#: The subpackages that lay gpipe-core out as its data flow: namespaces of private modules,
#: with nothing of their own for users to import.
LAYERS = {"run", "schedule", "trace", "transport"}


def _is_private(module: str) -> bool:
    """Whether a module below gpipe_core is private: a part of its path starts with ``_``."""
    parts = module.split(".")
    return parts[0] == "gpipe_core" and any(part.startswith("_") for part in parts[1:])


def test_the_package_has_no_public_submodules() -> None:
    modules = [info.name for info in pkgutil.walk_packages(gpipe_core.__path__, "gpipe_core.")]
    assert modules, "no modules found: the package path is wrong"
    layers = {name for name in modules if not _is_private(name)}
    assert layers == {f"gpipe_core.{layer}" for layer in LAYERS}
    for layer in sorted(layers):
        # Only a docstring: every name users import is in gpipe_core's own namespace.
        names = [n for n in vars(importlib.import_module(layer)) if not n.startswith("_")]
        assert names == [], (layer, names)
