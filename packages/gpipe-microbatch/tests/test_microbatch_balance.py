"""Tests of the checks of a split: check_module, check_balance and BalanceError."""

from __future__ import annotations

import pickle
import re

import pytest
from torch import nn

from gpipe_microbatch import BalanceError, check_balance, check_module


def test_balance_error_is_a_value_error() -> None:
    assert issubclass(BalanceError, ValueError)
    error = pickle.loads(pickle.dumps(BalanceError("balance must ...")))
    assert type(error) is BalanceError
    assert str(error) == "balance must ..."


@pytest.mark.parametrize(
    ("balance", "layers", "expected"),
    [([3], 3, [3]), ((1, 2), 3, [1, 2]), (iter([1, 1, 1]), 3, [1, 1, 1]), (range(1, 3), 3, [1, 2])],
)
def test_check_balance_returns_the_counts(
    balance: object, layers: int, expected: list[int]
) -> None:
    assert check_balance(balance, layers) == expected


@pytest.mark.parametrize(
    ("balance", "layers", "message"),
    [
        ([2, 1], 4, "balance must sum to the number of layers (balance: [2, 1], layers: 4)"),
        ([], 0, "balance must have at least one partition (balance: [])"),
        ([2, 0], 2, "balance must contain only positive integers (balance: [2, 0])"),
        ([1, -1, 2], 2, "balance must contain only positive integers (balance: [1, -1, 2])"),
        ([1.0, 1], 2, "balance must contain only positive integers (balance: [1.0, 1])"),
        ([True, 1], 2, "balance must contain only positive integers (balance: [True, 1])"),
        (3, 3, "balance must be a list of layer counts (balance: 3)"),
        ("21", 3, "balance must be a list of layer counts (balance: '21')"),
        (None, 3, "balance must be a list of layer counts (balance: None)"),
    ],
)
def test_check_balance_refuses(balance: object, layers: int, message: str) -> None:
    with pytest.raises(BalanceError, match=f"^{re.escape(message)}$"):
        check_balance(balance, layers)


def test_check_module_returns_a_sequential() -> None:
    module = nn.Sequential(nn.Linear(2, 2))
    assert check_module(module) is module


@pytest.mark.parametrize(
    ("module", "seen"),
    [
        (nn.Linear(2, 2), "Linear"),
        (nn.ModuleList([nn.ReLU()]), "ModuleList"),
        ([nn.ReLU()], "list"),
    ],
)
def test_check_module_refuses(module: object, seen: str) -> None:
    message = f"module must be nn.Sequential to be partitioned (module: {seen}); "
    with pytest.raises(TypeError, match=f"^{re.escape(message)}") as caught:
        check_module(module)
    # It says what to do, and where to read how.
    assert "write the model as a sequence of its layers" in str(caught.value)
    assert "guide's 'Models that are not a sequence'" in str(caught.value)


def test_check_module_points_a_hugging_face_model_to_gpipe_transformers() -> None:
    # A class as transformers defines one (its module under transformers.), without
    # needing transformers installed.
    model_class = type("GPT2LMHeadModel", (nn.Module,), {})
    model_class.__module__ = "transformers.models.gpt2.modeling_gpt2"
    with pytest.raises(TypeError) as caught:
        check_module(model_class())
    message = str(caught.value)
    assert message.startswith(
        "module must be nn.Sequential to be partitioned (module: GPT2LMHeadModel, a Hugging Face"
    )
    assert "gpipe.transformers.pipeline(model, balance=..., chunks=...)" in message
