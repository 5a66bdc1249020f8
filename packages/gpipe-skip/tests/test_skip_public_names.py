"""The public names of gpipe_skip: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import gpipe_skip

NAMES = [
    "DEFAULT_NAMESPACE",
    "Namespace",
    "Pop",
    "SkipKey",
    "SkipLayout",
    "SkipRoute",
    "SkipTracker",
    "Skippable",
    "Stash",
    "__version__",
    "current_skip_tracker",
    "inspect_skip_layout",
    "pop",
    "run_partition",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_skip, NAMES, [])
