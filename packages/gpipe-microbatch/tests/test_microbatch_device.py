"""Tests of devices as users name them: the normal form, and making a device current."""

from __future__ import annotations

import pytest
import torch

from gpipe_microbatch import normalize_device, use_device

CPU = torch.device("cpu")

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cpu", torch.device("cpu")),
        (torch.device("cpu"), torch.device("cpu")),
        # One CPU, as for tensors: torch.randn(1, device="cpu:0").device is the CPU.
        ("cpu:0", torch.device("cpu")),
        (torch.device("cpu", 1), torch.device("cpu")),
        (1, torch.device("cuda", 1)),
        ("cuda:2", torch.device("cuda", 2)),
        ("meta", torch.device("meta")),
    ],
)
def test_normalize_device(device: object, expected: torch.device) -> None:
    assert normalize_device(device) == expected  # type: ignore[arg-type]


def test_normalize_bare_cuda() -> None:
    expected = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cuda")
    )
    assert normalize_device("cuda") == expected


def test_use_device_is_a_no_op_on_cpu() -> None:
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    with use_device(CPU):
        x = torch.ones(2) + 1
        if device is not None:
            assert torch.cuda.current_device() == device
    assert x.tolist() == [2.0, 2.0]


def test_use_device_propagates_exceptions() -> None:
    with pytest.raises(KeyError), use_device(CPU):
        raise KeyError("x")


@cuda
@needs_cuda
def test_use_device_makes_device_current() -> None:
    last = torch.cuda.device_count() - 1
    with use_device(torch.device("cuda", last)):
        assert torch.cuda.current_device() == last
    assert torch.cuda.current_device() == 0 or last == 0
