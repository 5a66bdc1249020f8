"""Micro-batches and the building blocks a pipeline is made of.

Most users never import this package: :class:`~gpipe_core.GPipe` uses it. It is public for
whoever writes a pipeline or a transport of their own, and these are its building blocks:

* Micro-batches: :class:`Batch`, :func:`scatter` and :func:`gather` split a mini-batch
  into micro-batches and put them back together; :class:`NoChunk` marks a tensor every
  micro-batch gets whole; :func:`check`, :func:`check_output` and :func:`check_chunks`
  check what a user passes and what a layer returns; :func:`make_tuple` puts a tuple of
  any type (a namedtuple) back together from its values.
* The checks of a split: :func:`check_module`, :func:`check_balance` and
  :exc:`BalanceError`, shared by the balancing tools and the pipeline.
* Devices and streams with a CPU fallback: :data:`Device` and :func:`normalize_device`;
  :data:`CPUStream` stands in for the streams of a device without any, so
  :func:`new_stream`, :func:`current_stream`, :func:`use_device`, :func:`use_stream`,
  :func:`wait_stream`, :func:`record_stream`, :func:`get_device` and :func:`is_cuda` work
  on every device.
* Moving a micro-batch between devices: :func:`copy` (a differentiable device copy) and
  :func:`wait` (a stream wait that backward makes in reverse).
* Ordering in autograd: :func:`get_phony` gives an empty tensor that carries an edge;
  :func:`fork` splits one off a tensor and :func:`join` makes another tensor's backward
  run first.
* :class:`ThreadState`: grad mode, autocast and saved-tensor hooks carried into worker
  threads.

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
from ._balance import BalanceError, check_balance, check_module
from ._batch import (
    Batch,
    NoChunk,
    TensorOrTensors,
    check,
    check_chunks,
    check_output,
    gather,
    make_tuple,
    scatter,
)
from ._dependency import fork, join
from ._phony import get_phony
from ._stream import (
    AbstractStream,
    CPUStream,
    CPUStreamType,
    Device,
    current_stream,
    get_device,
    is_cuda,
    new_stream,
    normalize_device,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)
from ._threadstate import ThreadState
from ._transfer import copy, wait

__all__ = [
    "AbstractStream",
    "BalanceError",
    "Batch",
    "CPUStream",
    "CPUStreamType",
    "Device",
    "NoChunk",
    "TensorOrTensors",
    "ThreadState",
    "__version__",
    "check",
    "check_balance",
    "check_chunks",
    "check_module",
    "check_output",
    "copy",
    "current_stream",
    "fork",
    "gather",
    "get_device",
    "get_phony",
    "is_cuda",
    "join",
    "make_tuple",
    "new_stream",
    "normalize_device",
    "record_stream",
    "scatter",
    "use_device",
    "use_stream",
    "wait",
    "wait_stream",
]
