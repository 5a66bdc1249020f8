"""A differentiable device copy and a stream wait, each ordered by explicit streams.

Both are autograd functions, so the gradient makes the same trip back: a copy to the next
device is a copy to the previous device in backward, on the same pair of streams. The
transport calls them; this module knows nothing of messages, partitions or schedules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpipe_microbatch import Batch, use_device

from .._stream import (
    AbstractStream,
    current_stream,
    get_device,
    is_cuda,
    record_stream,
    use_stream,
    wait_stream,
)

__all__ = ["Copy", "Wait", "copy", "wait"]


def _copy_tensors(
    tensors: tuple[Tensor | None, ...], source: AbstractStream, target: AbstractStream
) -> tuple[Tensor | None, ...]:
    """Copy ``tensors`` to ``target``'s device with both streams current."""
    device = get_device(target)
    # The copies are queued on ``target``; the results are used on whatever stream is
    # current on the target device when the caller goes on.
    consumer = current_stream(device)
    out: list[Tensor | None] = []
    with use_device(device), use_stream(source), use_stream(target):
        for tensor in tensors:
            if tensor is None:
                out.append(None)
                continue
            copied = tensor.to(device, non_blocking=True)
            # ``tensor`` is read on ``source``, not where it was allocated.
            record_stream(tensor, source)
            # ``copied`` was allocated on ``target`` and will be used on ``consumer``.
            record_stream(copied, consumer)
            out.append(copied)
    return tuple(out)


class Copy(torch.autograd.Function):
    """Copy tensors from ``prev_stream``'s device to ``next_stream``'s device.

    Called as ``Copy.apply(prev_stream, next_stream, *tensors)``.
    """

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor
    ) -> tuple[Tensor | None, ...]:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        return _copy_tensors(input, prev_stream, next_stream)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor | None) -> tuple[Any, ...]:
        grad_input = _copy_tensors(grad_output, ctx.next_stream, ctx.prev_stream)
        return (None, None, *grad_input)


class Wait(torch.autograd.Function):
    """Make ``next_stream`` wait for ``prev_stream``; in backward, the other way round.

    Called as ``Wait.apply(prev_stream, next_stream, *tensors)``; the tensors pass through.
    """

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        wait_stream(next_stream, prev_stream)
        return tuple(tensor.detach() for tensor in input)

    @staticmethod
    def backward(ctx: Any, *grad_input: Tensor | None) -> tuple[Any, ...]:
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None, *grad_input)


def _needs_autograd(batch: Batch) -> bool:
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in batch)


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Copy ``batch`` in place to ``next_stream``'s device, differentiably.

    The copy is queued on ``next_stream`` while ``prev_stream`` is current on the source
    device; in backward the gradient is copied back on the same pair of streams.

    Args:
        batch: the micro-batch to copy; its tensors are replaced by their copies.
        prev_stream: the stream the tensors of ``batch`` were produced on.
        next_stream: a stream of the target device (:data:`CPUStream` for the CPU).

    Example:
        >>> from gpipe_core._stream import CPUStream
        >>> batch = Batch(torch.ones(2, requires_grad=True))
        >>> copy(batch, CPUStream, CPUStream)
        >>> batch.tensor.device, batch.tensor.requires_grad
        (device(type='cpu'), True)
    """
    if _needs_autograd(batch):
        tensors = Copy.apply(prev_stream, next_stream, *batch)  # type: ignore[no-untyped-call]
    else:
        tensors = _copy_tensors(tuple(batch), prev_stream, next_stream)
    for index, tensor in enumerate(tensors):
        batch.replace(index, tensor)


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Make ``next_stream`` wait for ``prev_stream`` before it uses ``batch`` (in place).

    A no-op unless both are CUDA streams.
    """
    if not (is_cuda(prev_stream) and is_cuda(next_stream)):
        return
    if _needs_autograd(batch):
        tensors = Wait.apply(prev_stream, next_stream, *batch)  # type: ignore[no-untyped-call]
        for index, tensor in enumerate(tensors):
            batch.replace(index, tensor)
    else:
        wait_stream(next_stream, prev_stream)
