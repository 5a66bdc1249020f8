"""The public names of gpipe_microbatch: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import gpipe_microbatch

NAMES = [
    "BalanceError",
    "Batch",
    "Device",
    "Kind",
    "MappingKind",
    "NoChunk",
    "TensorOrTensors",
    "ThreadState",
    "__version__",
    "check",
    "check_balance",
    "check_chunks",
    "check_module",
    "check_output",
    "gather",
    "get_phony",
    "labels",
    "make_tuple",
    "make_value",
    "mapping_kind",
    "normalize_device",
    "scatter",
    "use_device",
    "values_of",
    "with_values",
]


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_microbatch, NAMES, [])


def test_streams_copies_and_ordering_are_not_here() -> None:
    # They moved to gpipe-core, their only user, before any release: no alias is kept.
    for name in ["AbstractStream", "CPUStream", "copy", "fork", "join", "new_stream", "wait"]:
        assert not hasattr(gpipe_microbatch, name), name
