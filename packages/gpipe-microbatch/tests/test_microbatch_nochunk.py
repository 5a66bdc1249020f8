"""Tests of NoChunk: the mark of a tensor that every micro-batch gets whole."""

from __future__ import annotations

import re

import pytest
import torch

from gpipe_microbatch import NoChunk


def test_nochunk_holds_its_tensor() -> None:
    mask = torch.ones(3)
    assert NoChunk(mask).tensor is mask
    assert repr(NoChunk(torch.zeros(1))) == "NoChunk(tensor([0.]))"


@pytest.mark.parametrize(("value", "seen"), [([1], "list"), (None, "NoneType"), (2.0, "float")])
def test_nochunk_refuses_what_is_not_a_tensor(value: object, seen: str) -> None:
    with pytest.raises(TypeError, match=re.escape(f"NoChunk wraps a tensor (tensor: {seen})")):
        NoChunk(value)  # type: ignore[arg-type]
