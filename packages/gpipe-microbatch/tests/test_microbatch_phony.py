"""Tests of phony tensors: empty, cached per device and per ``requires_grad``."""

from __future__ import annotations

import pytest
import torch

from gpipe_microbatch import get_phony

CPU = torch.device("cpu")


# -- get_phony ----------------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
def test_phony_is_empty_and_cached(requires_grad: bool) -> None:
    phony = get_phony(CPU, requires_grad=requires_grad)
    assert phony.numel() == 0
    assert phony.shape == (0,)
    assert phony.device == CPU
    assert phony.requires_grad is requires_grad
    assert get_phony(CPU, requires_grad=requires_grad) is phony
    assert get_phony(torch.device("cpu"), requires_grad=requires_grad) is phony


def test_phony_cache_is_per_requires_grad() -> None:
    assert get_phony(CPU, requires_grad=True) is not get_phony(CPU, requires_grad=False)


def test_phony_cache_is_per_device() -> None:
    meta = get_phony(torch.device("meta"), requires_grad=False)
    assert meta.device.type == "meta"
    assert meta is not get_phony(CPU, requires_grad=False)
    assert meta is get_phony(torch.device("meta"), requires_grad=False)
