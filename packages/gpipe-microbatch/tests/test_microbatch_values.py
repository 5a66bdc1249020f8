"""Tests of the forms of value: a tuple of any type made back from its values."""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpipe_microbatch import make_tuple


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


def test_make_tuple_builds_each_kind_of_tuple() -> None:
    assert make_tuple(Pair, [torch.zeros(1), "b"]).label == "b"
    container = type(torch.zeros(2, 2).max(dim=1))
    assert make_tuple(container, (torch.zeros(2), torch.ones(2))).values.tolist() == [0.0, 0.0]
    assert make_tuple(tuple, iter([1, 2])) == (1, 2)
