"""Tests of check, check_chunks and check_output."""

from __future__ import annotations

import re

import pytest
import torch

from gpipe_microbatch import NoChunk, check, check_chunks, check_output

# -- check ------------------------------------------------------------------------------------


def test_check_returns_tensor_itself() -> None:
    x = torch.zeros(2)
    assert check(x) is x


def test_check_returns_tuple_itself() -> None:
    value = (torch.zeros(2), torch.ones(3, dtype=torch.long))
    assert check(value) is value


@pytest.mark.parametrize(
    ("value", "type_name"),
    [([torch.zeros(1)], "list"), (None, "NoneType"), (3, "int"), ({"a": torch.zeros(1)}, "dict")],
)
def test_check_names_the_type(value: object, type_name: str) -> None:
    with pytest.raises(TypeError) as info:
        check(value)
    assert str(info.value) == (f"input must be a tensor or a tuple of tensors (input: {type_name})")


def test_check_names_the_bad_tuple_element() -> None:
    with pytest.raises(TypeError) as info:
        check((torch.zeros(1), torch.zeros(1), 1.5))
    assert str(info.value) == "input must be a tensor or a tuple of tensors (input[2]: float)"


def test_check_empty_tuple() -> None:
    with pytest.raises(TypeError, match=r"\(input: empty tuple\)"):
        check(())


def test_check_uses_what() -> None:
    with pytest.raises(TypeError) as info:
        check([1], "output of partition 1")
    assert str(info.value) == (
        "output of partition 1 must be a tensor or a tuple of tensors (output of partition 1: list)"
    )


# -- check_chunks -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True, None])
def test_check_chunks_names_the_value(bad: object) -> None:
    with pytest.raises(
        ValueError, match=rf"chunks must be a positive integer \(chunks: {re.escape(repr(bad))}\)"
    ):
        check_chunks(bad)


def test_check_chunks_returns_a_positive_integer() -> None:
    assert check_chunks(3) == 3


# -- check_output -----------------------------------------------------------------------------


def test_check_output_accepts_values_beside_a_tensor() -> None:
    x = torch.zeros(1)
    for value in (x, (x,), (x, 1, "a", None, [1, 2], {"k": (3,)})):
        assert check_output(value) is value


MUST = "must be a tensor, or a tuple or mapping holding a tensor"


NESTED = "holds a tensor inside another value"


NOCHUNK = "holds a NoChunk, which marks inputs only"


@pytest.mark.parametrize(
    ("value", "message", "seen"),
    [
        (None, MUST, "out: NoneType"),
        ((1, "a"), MUST, "out[0]: int, out[1]: str"),
        ((), MUST, "out: empty tuple"),
        ([torch.zeros(1)], MUST, "out: list holding a tensor"),
        ((torch.zeros(1), [torch.zeros(1)]), NESTED, "out[1]: list holding a tensor"),
        ((torch.zeros(1), NoChunk(torch.zeros(1))), NOCHUNK, "out[1]: NoChunk"),
    ],
)
def test_check_output_refuses(value: object, message: str, seen: str) -> None:
    pattern = re.escape(f"out {message}") + ".*" + re.escape(f"({seen})")
    with pytest.raises(TypeError, match=pattern):
        check_output(value, "out")
