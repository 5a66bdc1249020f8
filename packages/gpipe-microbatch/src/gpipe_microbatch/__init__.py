"""Micro-batches and the low-level pieces a pipeline needs.

* :class:`Batch`, :func:`scatter`, :func:`gather` and :func:`check`: mini-batches split
  into micro-batches and put back together.
* Streams with a CPU fallback: :data:`CPUStream`, :func:`new_stream`, :func:`use_stream` ...
* :class:`Copy` and :class:`Wait`: a differentiable device copy and a stream wait.
* :class:`ThreadState`: grad mode and autocast carried into worker threads.
* :func:`get_phony`, :func:`fork`, :func:`join`, :func:`depend`: ordering edges in autograd.

Example:
    >>> import torch
    >>> from gpipe_microbatch import gather, scatter
    >>> batches = scatter(torch.arange(10.0), chunks=4)
    >>> [len(b.tensor) for b in batches]
    [3, 3, 3, 1]
    >>> gather(batches).shape
    torch.Size([10])
"""

from .__about__ import __version__
from .batch import Batch, TensorOrTensors, check, check_chunks, gather, scatter
from .dependency import Fork, Join, depend, fork, join
from .phony import get_phony
from .stream import (
    AbstractStream,
    CPUStream,
    CPUStreamType,
    Device,
    current_stream,
    default_stream,
    get_device,
    is_cuda,
    new_stream,
    normalize_device,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)
from .threadstate import ThreadState
from .transfer import Copy, Wait, copy, wait

__all__ = [
    "AbstractStream",
    "Batch",
    "CPUStream",
    "CPUStreamType",
    "Copy",
    "Device",
    "Fork",
    "Join",
    "TensorOrTensors",
    "ThreadState",
    "Wait",
    "__version__",
    "check",
    "check_chunks",
    "copy",
    "current_stream",
    "default_stream",
    "depend",
    "fork",
    "gather",
    "get_device",
    "get_phony",
    "is_cuda",
    "join",
    "new_stream",
    "normalize_device",
    "record_stream",
    "scatter",
    "use_device",
    "use_stream",
    "wait",
    "wait_stream",
]
