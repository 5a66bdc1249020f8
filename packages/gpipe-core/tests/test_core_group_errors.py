"""Bad ``group``, ``data_group`` and ``timeout`` arguments get clear errors, before the
module is changed.

The process group here is a gloo group of one process (this one), made for each test and
destroyed after it; the tests that run ranks in processes of their own are in
``test_core_distributed.py``.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpipe_core import GPipe


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    """torch.distributed initialized with a gloo group of this process alone."""
    assert not dist.is_initialized(), "an earlier test left torch.distributed initialized"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        yield group
    finally:
        dist.destroy_process_group()


def test_group_before_torch_distributed_is_initialized() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"group needs torch.distributed to be initialized"):
        GPipe(_model(), [1, 2], group="world")  # type: ignore[arg-type]


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("name", ["group", "data_group"])
def test_a_group_that_is_not_a_process_group(name: str) -> None:
    with pytest.raises(
        TypeError, match=rf"{name} must be a torch.distributed process group.*'world'"
    ):
        GPipe(_model(), [1, 2], **{name: "world"})  # type: ignore[arg-type]


def test_group_needs_balance(world: dist.ProcessGroup) -> None:
    with pytest.raises(TypeError, match=r"balance must be given with group \(balance: None\)"):
        GPipe(_model(), group=world)


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (0, ValueError, r"timeout must be positive \(timeout: 0\)"),
        (datetime.timedelta(seconds=-1), ValueError, r"timeout must be positive"),
        ("60", TypeError, r"timeout must be seconds or a timedelta \(timeout: '60'\)"),
        (True, TypeError, r"timeout must be seconds or a timedelta \(timeout: True\)"),
    ],
)
def test_bad_timeouts(
    world: dist.ProcessGroup, timeout: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        GPipe(_model(), [1, 2], group=world, timeout=timeout)  # type: ignore[arg-type]


def test_timeout_without_a_group() -> None:
    with pytest.raises(ValueError, match=r"timeout .* needs group \(timeout: 5\)"):
        GPipe(_model(), [1, 2], timeout=5)


def test_a_nccl_data_group_for_partitions_on_the_cpu(
    world: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL averages CUDA tensors only: refused at construction (this CPU build has no
    NCCL, so the group's backend is made to read ``'nccl'``), with the module unchanged."""
    real = dist.get_backend
    monkeypatch.setattr(
        dist, "get_backend", lambda group=None: "nccl" if group is world else real(group)
    )
    model = _model()
    with pytest.raises(
        ValueError,
        match=r"data_group uses NCCL.*\(data_group backend: 'nccl', devices of this rank: "
        r"\['cpu', 'cpu'\]\)",
    ):
        GPipe(model, [1, 2], data_group=world, deferred_batch_norm=True)
    assert type(model[1]) is nn.BatchNorm1d  # not converted to a deferred batch norm
    monkeypatch.undo()
    pipe = GPipe(model, [1, 2], data_group=world)  # the same module, gloo: accepted
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    assert len(pipe.step(x, y, nn.MSELoss())) == 1
