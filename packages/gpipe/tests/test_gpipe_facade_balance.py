"""gpipe.balance: the same objects as gpipe_balance, and balancing a model for GPipe."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import gpipe
import gpipe.balance
import gpipe_balance
import gpipe_core


def test_every_name_is_the_same_object() -> None:
    assert gpipe.balance.__all__
    for name in gpipe.balance.__all__:
        assert getattr(gpipe.balance, name) is getattr(gpipe_balance, name), name


def test_every_public_name_is_reexported() -> None:
    public = set(gpipe_balance.__all__) - {"__version__", "Device"}
    assert public <= set(gpipe.balance.__all__)


def test_one_balance_error_everywhere() -> None:
    assert gpipe.BalanceError is gpipe_balance.BalanceError
    assert gpipe_core.BalanceError is gpipe_balance.BalanceError
    assert gpipe.balance.BalanceError is gpipe_balance.BalanceError
    with pytest.raises(gpipe_balance.BalanceError):
        gpipe.GPipe(nn.Sequential(nn.Linear(2, 2)), balance=[2])


def test_balance_is_reachable_from_the_package() -> None:
    import importlib

    package = importlib.import_module("gpipe")
    assert package.balance is gpipe.balance


def test_facade_lists_names_explicitly() -> None:
    assert gpipe.balance.__file__ is not None
    tree = ast.parse(Path(gpipe.balance.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert all(alias.name != "*" for alias in node.names), ast.unparse(node)


@pytest.mark.parametrize("by", ["time", "size"])
def test_balanced_gpipe_matches_the_plain_model(by: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    x = torch.randn(16, 8)
    expected = model(x)
    if by == "time":
        balance = gpipe.balance.balance_by_time(3, model, x, timeout=0)
    else:
        balance = gpipe.balance.balance_by_size(3, model, x, chunks=4)
    assert len(balance) == 3 and sum(balance) == len(model)
    pipe = gpipe.GPipe(model, balance, chunks=4)
    torch.testing.assert_close(pipe(x.to(pipe.devices[0])).cpu(), expected)
