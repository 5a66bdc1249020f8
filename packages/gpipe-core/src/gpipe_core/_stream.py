"""Streams, with a CPU fallback: the stream abstraction of the pipeline's partitions and copies.

CUDA work is ordered by streams. On CPU there are none: :data:`CPUStream` stands in for
them and every operation on it is a no-op, so the pipeline can treat both alike. Devices
as users name them (``Device``, ``normalize_device``, ``use_device``) are
gpipe_microbatch's, shared with gpipe-balance; this module knows nothing of partitions,
messages or schedules.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch

__all__ = [
    "AbstractStream",
    "CPUStream",
    "CPUStreamType",
    "current_stream",
    "get_device",
    "is_cuda",
    "new_stream",
    "record_stream",
    "use_stream",
    "wait_stream",
]


class CPUStreamType:
    """The type of :data:`CPUStream`: a placeholder for a stream on a device without any."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CPUStream"

    def __reduce__(self) -> str:
        # Copies and pickles give back the one CPUStream.
        return "CPUStream"


#: The stream of every non-CUDA device.
CPUStream = CPUStreamType()

#: A CUDA stream or :data:`CPUStream`.
AbstractStream = torch.cuda.Stream | CPUStreamType


def is_cuda(stream: AbstractStream) -> bool:
    """Whether ``stream`` is a CUDA stream."""
    return isinstance(stream, torch.cuda.Stream)


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream on ``device`` (:data:`CPUStream` for a non-CUDA device)."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> AbstractStream:
    """The current stream of ``device``."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def get_device(stream: AbstractStream) -> torch.device:
    """The device of ``stream`` (CPU for :data:`CPUStream`)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream.device
    return torch.device("cpu")


@contextmanager
def use_stream(stream: AbstractStream) -> Generator[None, None, None]:
    """Make ``stream`` the current stream of its device; a no-op for :data:`CPUStream`."""
    if not isinstance(stream, torch.cuda.Stream):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Make ``source`` wait until the work queued on ``target`` so far is done.

    A no-op unless both are CUDA streams; a CUDA stream never has to wait for CPU work,
    which is complete when it returns.
    """
    if isinstance(source, torch.cuda.Stream) and isinstance(target, torch.cuda.Stream):
        source.wait_stream(target)


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tell the CUDA caching allocator that ``tensor`` is in use on ``stream``.

    Its memory is then not reused before the work queued on ``stream`` is done. A no-op
    for :data:`CPUStream` and for tensors not on CUDA.
    """
    if not isinstance(stream, torch.cuda.Stream) or not tensor.is_cuda:
        return
    # The allocator tracks the storage, so an empty view of it is enough and avoids
    # surprises with tensors that are views of larger storages.
    tensor = tensor.new_empty([0]).set_(tensor.untyped_storage())
    tensor.record_stream(stream)
