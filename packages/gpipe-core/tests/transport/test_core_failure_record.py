"""What crosses ranks when one fails, and how a message is laid out on the wire: the public
error (``RemotePartitionError``, also ``RemoteStageError``), the one failure record
(``_errors.Failure``), the one message builder (``outgoing``) and the wire codec
(``transport._wire``), each without a process group."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch

import gpipe_core
from gpipe_core._errors import Failure, RemotePartitionError, RemoteStageError
from gpipe_core.transport import _wire
from gpipe_core.transport._transport import MessageKey, outgoing


def test_remote_stage_error_is_the_former_name_of_remote_partition_error() -> None:
    assert RemoteStageError is RemotePartitionError
    assert gpipe_core.RemoteStageError is gpipe_core.RemotePartitionError is RemotePartitionError
    # Tracebacks and pickle name it where users import it.
    assert RemotePartitionError.__module__ == "gpipe_core"
    assert pickle.loads(pickle.dumps(RemotePartitionError)) is RemotePartitionError
    with pytest.raises(RemoteStageError, match="rank 1 of the pipeline failed in its run"):
        raise RemotePartitionError(1, "its run", "ValueError: x", "")


def failed(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:
        return caught


def test_a_failure_crosses_ranks_naming_its_rank_and_partition() -> None:
    where = "backward of micro-batch 2 on partition 3"
    failure = Failure.of(1, where, failed(ValueError("bad shape")))
    assert failure.summary == "ValueError: bad shape" and not failure.disagrees
    assert "Traceback" in failure.text and "bad shape" in failure.text
    # As the wire carries it: pickled on one rank, read back on another.
    received = pickle.loads(pickle.dumps(failure))
    assert received == failure
    error = received.error()
    assert isinstance(error, RemotePartitionError)
    assert (error.rank, error.where) == (1, where)
    assert str(error) == f"rank 1 of the pipeline failed in {where}: ValueError: bad shape"
    assert error.remote_traceback == failure.text


def test_a_failure_that_cannot_be_printed_still_travels() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    failure = Failure.of(0, "its run", failed(Unprintable()), disagrees=True)
    assert failure.summary.startswith("Unprintable: <the message could not be printed")
    assert failure.disagrees and "rank 0" in str(failure.error())


@pytest.mark.parametrize("detach", [False, True])
def test_one_builder_makes_every_message(detach: bool) -> None:
    a = torch.randn(2, requires_grad=True) * 2
    message = outgoing([a, None, "x"], needs_grad=True, detach=detach)
    assert message.present == (True, False, False) and message.others == (None, "x")
    assert message.requires_grad == (True,)
    assert message.tensors[0].requires_grad is not detach
    detached = message.detached()
    assert not detached.tensors[0].requires_grad
    assert detached.detached() is detached  # nothing left to detach
    one = outgoing([a], atomic=True, detach=True)
    assert one.atomic and one.value(one.values()) is one.tensors.value


def receiving(parts: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """A receiver of the pieces after the header, in order, as the payload tag gives them."""
    pieces = iter(parts[1:])

    def extra(tensor: torch.Tensor) -> None:
        tensor.copy_(next(pieces).view(torch.uint8).reshape(-1))

    return extra


@pytest.mark.parametrize(
    ("sizes", "capacity", "layout"),
    [
        ([], _wire.HEADER_BYTES, "none"),
        ([(3,), (2, 2)], _wire.HEADER_BYTES, "inline"),
        ([(2000,)], _wire.HEADER_BYTES, "single"),
        ([(600,), (700,)], _wire.HEADER_BYTES, "packed"),
    ],
)
def test_the_wire_reads_back_what_it_lays_out(
    sizes: list[tuple[int, ...]], capacity: int, layout: str
) -> None:
    tensors = [torch.randn(size) for size in sizes]
    specs = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
    encoded = pickle.dumps((7, ("data", "meta"), specs))
    data = [_wire.as_bytes(tensor) for tensor in tensors]
    parts = _wire.message(encoded, data, capacity)
    assert _wire.LAYOUTS[int(parts[0][4])] == layout
    # The receiver's buffer: the size posted for it, the header's bytes at its start.
    raw = bytearray(capacity)
    header = torch.frombuffer(raw, dtype=torch.uint8)
    header[: len(parts[0])] = parts[0]
    seen: list[object] = []
    counted = _wire.Capacity(0)

    def channel(specs: object) -> list[torch.Tensor]:
        raise AssertionError("no strict channel here")

    sent, received = _wire.read(raw, header, receiving(parts), channel, counted, seen.append)
    assert sent == (7, ("data", "meta"), specs) and seen == [sent]
    assert len(received) == len(tensors)
    for got, expected in zip(received, tensors, strict=True):
        assert torch.equal(got, expected)


def test_a_sparse_tensor_cannot_cross_ranks() -> None:
    key = MessageKey("activations", 2, 0, 1)
    with pytest.raises(TypeError, match="the activations of micro-batch 2 from partition 0"):
        _wire.check_strided(key, [torch.eye(2).to_sparse()])
