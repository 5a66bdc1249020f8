"""Tests of the stream abstraction: the CPU fallback here, CUDA streams under ``cuda``.

``use_device`` is gpipe_microbatch's; it is used here beside ``use_stream``, as partition runs
use it.
"""

from __future__ import annotations

import pytest
import torch

from gpipe_core._stream import (
    CPUStream,
    CPUStreamType,
    current_stream,
    get_device,
    is_cuda,
    new_stream,
    record_stream,
    use_stream,
    wait_stream,
)
from gpipe_microbatch import use_device

CPU = torch.device("cpu")

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("factory", [new_stream, current_stream])
def test_cpu_streams_are_cpu_stream(factory: object) -> None:
    stream = factory(CPU)  # type: ignore[operator]
    assert stream is CPUStream
    assert isinstance(stream, CPUStreamType)


def test_cpu_stream_for_meta_device() -> None:
    assert new_stream(torch.device("meta")) is CPUStream


def test_cpu_stream_properties() -> None:
    assert not is_cuda(CPUStream)
    assert get_device(CPUStream) == CPU
    assert repr(CPUStream) == "CPUStream"


def test_use_device_and_use_stream_are_no_ops_on_cpu() -> None:
    grad = torch.is_grad_enabled()
    with use_device(CPU), use_stream(CPUStream):
        x = torch.ones(2) + 1
        assert torch.is_grad_enabled() == grad
    assert x.tolist() == [2.0, 2.0]


def test_use_stream_propagates_exceptions() -> None:
    with pytest.raises(KeyError), use_stream(CPUStream):
        raise KeyError("x")
    with pytest.raises(KeyError), use_device(CPU):
        raise KeyError("x")


def test_wait_stream_and_record_stream_are_no_ops_on_cpu() -> None:
    x = torch.ones(3)
    assert wait_stream(CPUStream, CPUStream) is None
    assert record_stream(x, CPUStream) is None
    assert x.tolist() == [1.0, 1.0, 1.0]


# -- CUDA --------------------------------------------------------------------------------


@cuda
@needs_cuda
def test_cuda_streams() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = new_stream(device)
    assert isinstance(stream, torch.cuda.Stream)
    assert is_cuda(stream)
    assert get_device(stream) == device
    assert stream != torch.cuda.default_stream(device)
    assert current_stream(device) == torch.cuda.current_stream(device)


@cuda
@needs_cuda
def test_use_stream_makes_stream_current() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = new_stream(device)
    with use_stream(stream):
        assert current_stream(device) == stream
    assert current_stream(device) == torch.cuda.default_stream(device)


@cuda
@needs_cuda
def test_wait_stream_orders_work() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    producer = new_stream(device)
    consumer = new_stream(device)
    x = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize(device)
    with use_stream(producer):
        torch.cuda._sleep(100_000_000)
        x.fill_(1.0)
    wait_stream(consumer, producer)
    with use_stream(consumer):
        y = x.clone()
    torch.cuda.synchronize(device)
    assert bool((y == 1.0).all())


@cuda
@needs_cuda
def test_wait_stream_between_cpu_and_cuda_is_a_no_op() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = new_stream(device)
    wait_stream(stream, CPUStream)
    wait_stream(CPUStream, stream)


@cuda
@needs_cuda
def test_record_stream_keeps_memory_from_reuse() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = new_stream(device)
    torch.cuda.synchronize(device)
    with use_stream(stream):
        torch.cuda._sleep(200_000_000)  # the stream stays busy for a while
    tensor = torch.empty(1 << 20, device=device)
    pointer = tensor.data_ptr()
    record_stream(tensor[1:], stream)  # a view: the whole storage is recorded
    del tensor
    other = torch.empty(1 << 20, device=device)
    # The block is still in use on ``stream``, so the allocator gives another one.
    assert other.data_ptr() != pointer
    torch.cuda.synchronize(device)


@cuda
@needs_cuda
def test_record_stream_ignores_cpu_tensors() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    record_stream(torch.zeros(2), new_stream(device))


def test_cpu_stream_survives_copy_and_pickle_as_the_same_object() -> None:
    import copy
    import pickle

    from gpipe_core._stream import CPUStream, is_cuda

    for clone in (copy.copy(CPUStream), copy.deepcopy(CPUStream)):
        assert clone is CPUStream
    restored = pickle.loads(pickle.dumps(CPUStream))
    assert restored is CPUStream
    assert not is_cuda(restored)
