"""The public names of gpipe_bn: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import gpipe_bn

NAMES = [
    "DeferredBatchNorm",
    "__version__",
    "convert_deferred_batch_norm",
    "convert_plain_batch_norm",
    "mini_batch",
]


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_bn, NAMES, [])
