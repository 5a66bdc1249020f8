"""Tests of Copy, Wait, copy and wait."""

from __future__ import annotations

import pytest
import torch

from gpipe_core._stream import CPUStream, new_stream, use_stream
from gpipe_core.transport._transfer import Copy, Wait, copy, wait
from gpipe_microbatch import Batch

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_copy_gradcheck_on_cpu_streams() -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def function(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return Copy.apply(CPUStream, CPUStream, a, b)  # type: ignore[no-any-return]

    assert torch.autograd.gradcheck(function, (x, y))
    assert torch.autograd.gradgradcheck(lambda a: Copy.apply(CPUStream, CPUStream, a)[0], (x,))


def test_wait_gradcheck_on_cpu_streams() -> None:
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: Wait.apply(CPUStream, CPUStream, a)[0], (x,))


def test_copy_values_and_gradient() -> None:
    x = torch.randn(4, requires_grad=True)
    (y,) = Copy.apply(CPUStream, CPUStream, x)
    assert torch.equal(y, x)
    assert y.requires_grad
    assert y.grad_fn is not None
    (y * torch.arange(4.0)).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.arange(4.0))


def test_copy_function_replaces_in_place_and_is_differentiable() -> None:
    a = torch.randn(3, requires_grad=True)
    b = torch.arange(3)
    batch = Batch((a, b))
    copy(batch, CPUStream, CPUStream)
    assert not batch.atomic
    assert torch.equal(batch[0], a)
    assert torch.equal(batch[1], b)
    assert batch[1].dtype == torch.int64
    (batch[0] * 3).sum().backward()
    assert a.grad is not None
    assert torch.equal(a.grad, torch.full((3,), 3.0))


def test_copy_function_without_grad() -> None:
    a = torch.randn(3)
    batch = Batch(a)
    copy(batch, CPUStream, CPUStream)
    assert batch.atomic
    assert torch.equal(batch.tensor, a)
    assert batch.tensor.grad_fn is None

    b = torch.randn(3, requires_grad=True)
    batch = Batch(b)
    with torch.no_grad():
        copy(batch, CPUStream, CPUStream)
    assert batch.tensor.grad_fn is None


def test_wait_function_is_a_no_op_on_cpu_streams() -> None:
    a = torch.randn(3, requires_grad=True)
    batch = Batch(a)
    wait(batch, CPUStream, CPUStream)
    assert batch.tensor is a


# -- CUDA --------------------------------------------------------------------------------


@cuda
@needs_cuda
def test_copy_between_cpu_and_cuda() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = new_stream(device)
    x = torch.randn(8, 4, requires_grad=True)
    (y,) = Copy.apply(CPUStream, stream, x)
    torch.cuda.current_stream(device).wait_stream(stream)
    assert y.device == device
    assert torch.equal(y.cpu(), x.detach())
    (y * 2).sum().backward()
    assert x.grad is not None
    assert x.grad.device == torch.device("cpu")
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


@cuda
@needs_cuda
def test_copy_between_two_cuda_streams() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    prev_stream, next_stream = new_stream(device), new_stream(device)
    with use_stream(prev_stream):
        x = torch.randn(16, device=device, requires_grad=True)
    prev_stream.synchronize()
    batch = Batch(x)
    copy(batch, prev_stream, next_stream)
    wait(batch, next_stream, torch.cuda.current_stream(device))
    y = batch.tensor
    assert y.device == device
    assert y.grad_fn is not None
    (y * 3).sum().backward()
    torch.cuda.synchronize(device)
    assert torch.equal(y.detach(), x.detach())
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


@cuda
@needs_cuda
def test_copy_gradcheck_between_cuda_streams() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    prev_stream, next_stream = new_stream(device), new_stream(device)
    x = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)
    torch.cuda.synchronize(device)

    def function(a: torch.Tensor) -> torch.Tensor:
        (out,) = Copy.apply(prev_stream, next_stream, a)
        torch.cuda.current_stream(device).wait_stream(next_stream)
        return out  # type: ignore[no-any-return]

    assert torch.autograd.gradcheck(function, (x,))


@cuda
@needs_cuda
def test_wait_orders_streams_and_passes_gradient() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    prev_stream, next_stream = new_stream(device), new_stream(device)
    x = torch.zeros(1 << 20, device=device, requires_grad=True)
    torch.cuda.synchronize(device)
    with use_stream(prev_stream), torch.no_grad():
        torch.cuda._sleep(100_000_000)
        x.fill_(1.0)
    batch = Batch(x)
    wait(batch, prev_stream, next_stream)
    assert batch.tensor is not x
    with use_stream(next_stream):
        y = batch.tensor.clone()
    torch.cuda.synchronize(device)
    assert bool((y == 1.0).all())
    y.sum().backward()
    torch.cuda.synchronize(device)
    assert x.grad is not None
    assert bool((x.grad == 1.0).all())
