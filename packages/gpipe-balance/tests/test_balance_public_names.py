"""The public names of gpipe_balance: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import gpipe_balance
import gpipe_microbatch

NAMES = [
    "BalanceError",
    "__version__",
    "balance_by_size",
    "balance_by_time",
    "block_costs",
    "profile_sizes",
    "profile_times",
    "solve",
]


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_balance, NAMES, [])


def test_balance_error_is_the_one_of_gpipe_microbatch() -> None:
    # So that GPipe (which checks balances with gpipe_microbatch) and the balancing tools
    # raise one class, caught by one except clause.
    assert gpipe_balance.BalanceError is gpipe_microbatch.BalanceError


def test_device_is_public_in_gpipe_microbatch_only() -> None:
    assert not hasattr(gpipe_balance, "Device")
    assert hasattr(gpipe_microbatch, "Device")
