"""The public names of gpipe_microbatch: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import gpipe_microbatch

NAMES = [
    "AbstractStream",
    "BalanceError",
    "Batch",
    "CPUStream",
    "CPUStreamType",
    "Device",
    "NoChunk",
    "TensorOrTensors",
    "ThreadState",
    "__version__",
    "check",
    "check_balance",
    "check_chunks",
    "check_module",
    "check_output",
    "copy",
    "current_stream",
    "fork",
    "gather",
    "get_device",
    "get_phony",
    "is_cuda",
    "join",
    "make_tuple",
    "new_stream",
    "normalize_device",
    "record_stream",
    "scatter",
    "use_device",
    "use_stream",
    "wait",
    "wait_stream",
]


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_microbatch, NAMES, [])
