"""The wire codec of the transport across processes: how a message is laid out in the
pieces it travels in, and read back.

**Channels.** Between two ranks, every message of a run starts with a header (what the
message is, its tensors' dtypes and shapes), followed in the same piece by its tensors when
they fit, in one ordered channel (the pipeline's tag); if they do not fit, the rest of the
metadata and one payload (the tensor itself, or the tensors packed into one buffer) follow
in a second channel (the next tag). On the strict payload channel (see
:mod:`gpipe_core.transport._payloads`: on gloo when asked, or on NCCL), the header never carries
them: each tensor follows as a payload of its exact size. A receiver thread per peer reads
the headers in order and files each message under its key (:class:`MessageKey`); a
partition waits for its key in that mailbox. So the order in which partitions send never
has to match the order in which others receive, shapes may change from one run to the
next, and every wait is a wait on a condition that a timeout, a cancellation or a failure
ends.

**Buffers ahead.** gloo moves a message only once its receive is posted (the receiver
tells the sender it is ready): a receive posted when the previous message is done costs a
round trip between the processes per message, however many are queued. So each receiver
thread keeps :data:`HEADERS_AHEAD` receives posted while a run lasts, and a burst of
messages streams; only a payload that did not fit waits for its header. gloo accepts a
message shorter than the buffer posted for it, and the buffers grow with the messages
(:class:`Capacity`, up to :data:`INLINE_LIMIT`): once a message of some size has passed,
the next ones of that size (the activations and gradients of the following micro-batches)
travel in one piece, with no round trip.

This module knows nothing of runs, ranks or mailboxes: it lays out and reads back one
message, and says which tensors can cross ranks.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._dtensor import is_dtensor
from ._transport import MessageKey

__all__ = [
    "HEADERS_AHEAD",
    "HEADER_BYTES",
    "INLINE_LIMIT",
    "LAYOUTS",
    "Capacity",
    "as_bytes",
    "check_strided",
    "describe",
    "message",
    "read",
    "whole",
]

#: Bytes of the smallest buffer a receiver posts for a message: the header (the length and
#: layout, the pickled metadata) and, when they fit, the tensors.
HEADER_BYTES = 4096
#: The largest buffer a receiver posts for a message (see :class:`Capacity`).
INLINE_LIMIT = 1 << 20
PREFIX = 8  # the metadata's length (4 bytes, little-endian), the layout, 3 bytes of padding
#: How a message's tensors travel: none, in the header, as one payload of the tensor
#: itself, packed into one payload, or one payload per tensor on the strict payload channel
#: (see :mod:`gpipe_core.transport._payloads`) (the header's fifth byte).
LAYOUTS = ("none", "inline", "single", "packed", "channel")
ALIGN = 16
#: Header receives each receiver thread keeps posted during a run (see "Headers ahead").
HEADERS_AHEAD = 8

Meta = tuple[Any, ...]


def aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def as_bytes(tensor: Tensor) -> Tensor:
    """``tensor``'s data as a flat uint8 tensor (a view of a contiguous CPU copy)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


Specs = Sequence[tuple[torch.dtype, tuple[int, ...]]]


def positions(start: int, sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where chunks of ``sizes`` bytes go in a buffer from ``start`` on (each aligned),
    and where the last one ends."""
    offsets = []
    end = start
    for size in sizes:
        end = aligned(end)
        offsets.append(end)
        end += size
    return offsets, end


def nbytes(specs: Specs) -> list[int]:
    return [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs]


def pack(buffer: Tensor, offsets: Sequence[int], chunks: Sequence[Tensor]) -> None:
    """Copy ``chunks`` (flat uint8 tensors) into ``buffer`` at ``offsets``."""
    for offset, chunk in zip(offsets, chunks, strict=True):
        buffer[offset : offset + len(chunk)].copy_(chunk)


def unpack(buffer: Tensor, start: int, specs: Specs) -> list[Tensor]:
    """Tensors of ``specs``, views of ``buffer`` placed from ``start`` on."""
    sizes = nbytes(specs)
    offsets, _ = positions(start, sizes)
    return [
        buffer[offset : offset + size].view(dtype).view(shape)
        for offset, size, (dtype, shape) in zip(offsets, sizes, specs, strict=True)
    ]


def whole(length: int, sizes: Sequence[int]) -> int:
    """The bytes of a message in one piece: the header with ``length`` bytes of metadata,
    then tensors of ``sizes`` bytes, each aligned."""
    return positions(PREFIX + length, sizes)[1]


class Capacity:
    """The size of the buffer posted for each message that one rank sends another, which
    the two ends work out alike from the messages before it.

    The receiver posts the buffer of message ``k`` once it has read message
    ``k - HEADERS_AHEAD``: the smallest power of two from :data:`HEADER_BYTES` that holds
    each of the messages up to that one whole (one larger than :data:`INLINE_LIMIT` does not
    count). The sender counts the same messages (all it sent but its last
    ``HEADERS_AHEAD - 1``), so it knows the size of the buffer each message lands in, and
    sends the message in one piece when it fits.

    Args:
        lag: how many of the latest messages counted do not count yet: the sender's
            ``HEADERS_AHEAD - 1``, the receiver's 0.
    """

    __slots__ = ("lag", "largest", "recent", "size")

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.recent: deque[int] = deque()
        self.largest = 0
        #: The size of the next buffer.
        self.size = HEADER_BYTES

    def counted(self, whole: int) -> Capacity:
        """A copy, with a message of ``whole`` bytes counted."""
        copy = Capacity(self.lag)
        copy.recent, copy.largest, copy.size = deque(self.recent), self.largest, self.size
        copy.count(whole)
        return copy

    def count(self, whole: int) -> None:
        """Count a message of ``whole`` bytes in one piece."""
        self.recent.append(whole if whole <= INLINE_LIMIT else 0)
        while len(self.recent) > self.lag:
            self.largest = max(self.largest, self.recent.popleft())
        while self.size < self.largest:
            self.size *= 2


def message(
    encoded: bytes, data: Sequence[Tensor], capacity: int, *, channel: bool = False
) -> list[Tensor]:
    """The parts of a message, to be received into a buffer of ``capacity`` bytes: the
    message in one piece when it fits; else its header (with the metadata ``encoded`` if it
    fits), the metadata if not, then the tensors ``data`` (flat uint8) as one payload: the
    tensor itself, or the tensors packed. With ``channel``, the message's tensors travel
    on the strict payload channel (``data`` is empty): the header says so."""
    sizes = [len(chunk) for chunk in data]
    fits = PREFIX + len(encoded) <= capacity  # the metadata, in the header
    start = PREFIX + len(encoded) if fits else PREFIX
    offsets, end = positions(start, sizes)
    if channel:
        layout = "channel"
    elif not data:
        layout = "none"
    elif fits and end <= capacity:
        layout = "inline"
    elif len(data) == 1:
        layout = "single"
    else:
        layout = "packed"
    raw = bytearray(end if layout == "inline" else start)
    raw[0:4] = len(encoded).to_bytes(4, "little")
    raw[4] = LAYOUTS.index(layout)
    header = torch.frombuffer(raw, dtype=torch.uint8)
    parts = [header]
    if fits:
        raw[PREFIX:start] = encoded
    else:
        parts.append(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    if layout == "inline":
        pack(header, offsets, data)
    elif layout == "single":
        parts.append(data[0])
    elif layout == "packed":
        offsets, total = positions(0, sizes)
        packed = torch.empty(total, dtype=torch.uint8)
        pack(packed, offsets, data)
        parts.append(packed)
    return parts


def read(
    raw: bytearray,
    header: Tensor,
    extra: Callable[[Tensor], None],
    channel: Callable[[Specs], list[Tensor]],
    capacity: Capacity,
    check: Callable[[tuple[Any, ...]], None],
) -> tuple[Any, list[Tensor]]:
    """Read back a message whose header (``raw``, viewed as ``header``) has arrived: its
    metadata, and its tensors. ``extra`` receives into a tensor the next piece that did
    not fit in the header (the metadata, or the payload); ``channel`` receives the tensors
    of ``specs`` on the strict payload channel. The message is counted in ``capacity``
    (the receiver's). ``check`` sees what the sender pickled before any tensor is received
    (and may refuse it).

    Returns:
        What the sender pickled (its run, its metadata, its tensors' specs), and the
        tensors.
    """
    length = int.from_bytes(raw[0:4], "little")
    layout = LAYOUTS[raw[4]]
    if PREFIX + length <= len(raw):
        encoded = bytes(raw[PREFIX : PREFIX + length])
    else:
        buffer = bytearray(length)
        extra(torch.frombuffer(buffer, dtype=torch.uint8))
        encoded = bytes(buffer)
    sent = pickle.loads(encoded)
    check(sent)
    specs = sent[2]
    sizes = nbytes(specs)
    capacity.count(whole(length, [] if layout == "channel" else sizes))
    tensors: list[Tensor] = []
    if layout == "inline":
        tensors = unpack(header, PREFIX + length, specs)
        if 2 * sum(sizes) < len(raw) and len(raw) > HEADER_BYTES:
            # Views would keep the whole buffer, grown for larger messages, alive.
            tensors = [tensor.clone() for tensor in tensors]
    elif layout == "single":
        dtype, shape = specs[0]
        tensor = torch.empty(shape, dtype=dtype)
        extra(tensor.reshape(-1).view(torch.uint8))
        tensors = [tensor]
    elif layout == "packed":
        _, total = positions(0, sizes)
        packed = torch.empty(total, dtype=torch.uint8)
        extra(packed)
        tensors = unpack(packed, 0, specs)
    elif layout == "channel":
        # Every payload a header announces is received, whatever the run's state here:
        # none stays posted on the peer (see "Failures" in _payloads).
        tensors = channel(specs)
    return sent, tensors


def check_strided(key: MessageKey, tensors: Sequence[Tensor]) -> None:
    """Refuse a message to another rank holding a tensor that is not dense (a sparse
    tensor, say), which travels as the bytes of its storage.

    Raises:
        TypeError: such a tensor, named by the partition that sends it and its layout.
    """
    for k, tensor in enumerate(tensors):
        if is_dtensor(tensor):
            raise TypeError(
                f"{describe(key)} hold a DTensor, which cannot be sent to another rank as "
                "it is; return local tensors from the partition (a tensor-parallel layer's "
                "use_local_output=True, or .to_local() / .full_tensor()) "
                f"(tensor {k} of the message: placements {tensor.placements}, shape "  # type: ignore[attr-defined]
                f"{tuple(tensor.shape)})"
            )
        if tensor.layout != torch.strided:
            raise TypeError(
                f"{describe(key)} hold a tensor of layout {tensor.layout}, which cannot be "
                "sent to another rank (only dense, torch.strided tensors cross ranks); make "
                "it dense (.to_dense()) at the end of the partition "
                f"(tensor {k} of the message: layout {tensor.layout}, shape {tuple(tensor.shape)})"
            )


def describe(key: MessageKey) -> str:
    what = {
        "activations": "the activations",
        "gradients": "the gradients",
        "skips": "the skips",
        "skip-gradients": "the skips' gradients",
        "feedback": "the next input",
    }[key.contents]
    return (
        f"{what} of micro-batch {key.microbatch} from partition {key.source} to partition "
        f"{key.target}"
    )
