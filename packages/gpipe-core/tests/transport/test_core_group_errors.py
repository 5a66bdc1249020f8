"""Bad ``group``, ``data_group`` and ``timeout`` arguments get clear errors, before the
module is changed.

The process group here is a gloo group of one process (this one), made for each test and
destroyed after it; the tests that run ranks in processes of their own are in
``test_core_distributed.py``.
"""

from __future__ import annotations

import copy
import datetime
import io
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpipe_core import GPipe
from gpipe_core._placement import MAX_TIMEOUT


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _init_world() -> None:
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


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    """torch.distributed initialized with a gloo group of this process alone."""
    assert not dist.is_initialized(), "an earlier test left torch.distributed initialized"
    _init_world()
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
        ("60", TypeError, r"timeout must be seconds, a timedelta or None.*\(timeout: '60'\)"),
        (True, TypeError, r"timeout must be seconds, a timedelta or None.*\(timeout: True\)"),
        (float("inf"), ValueError, r"timeout must be a finite number.*None for no bound"),
        (float("nan"), ValueError, r"timeout must be positive \(timeout: nan\)"),
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
    model = _model()
    with monkeypatch.context() as patched:
        patched.setattr(
            dist, "get_backend", lambda group=None: "nccl" if group is world else real(group)
        )
        with pytest.raises(
            ValueError,
            match=r"data_group uses NCCL.*\(data_group backend: 'nccl', devices of this rank: "
            r"\['cpu', 'cpu'\]\)",
        ):
            GPipe(model, [1, 2], data_group=world, deferred_batch_norm=True)
    assert type(model[1]) is nn.BatchNorm1d  # not converted to a deferred batch norm
    pipe = GPipe(model, [1, 2], data_group=world)  # the same module, gloo: accepted
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    assert len(pipe.step(x, y, nn.MSELoss())) == 1


@pytest.mark.parametrize(
    ("timeout", "seconds"),
    [(None, None), (1e10, MAX_TIMEOUT), (datetime.timedelta(days=1), 86400.0)],
)
def test_timeouts_without_a_bound_or_past_the_limit_step(
    world: dist.ProcessGroup, timeout: object, seconds: float | None
) -> None:
    """None means no bound; a timeout past what the waits accept is clamped to it."""
    pipe = GPipe(_model(), [1, 2], chunks=2, group=world, timeout=timeout)  # type: ignore[arg-type]
    assert pipe._placement.timeout == seconds
    losses = pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss(), schedule="1f1b")
    assert len(losses) == 2 and all(torch.isfinite(loss) for loss in losses)


def test_a_pipeline_across_processes_cannot_be_copied(world: dist.ProcessGroup) -> None:
    pipe = GPipe(_model(), [1, 2], group=world)
    message = r"GPipe across processes cannot be copied.*ranks: \[0\].*unwrap\(\).*state_dict"
    with pytest.raises(TypeError, match=message):
        copy.deepcopy(pipe)
    with pytest.raises(TypeError, match=message):
        torch.save(pipe, io.BytesIO())
    plain = copy.deepcopy(pipe.unwrap())  # the way out the message names
    x = torch.randn(3, 4)
    pipe.eval()
    torch.testing.assert_close(plain.eval()(x), pipe(x))


def test_torchrun_without_init_process_group_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpipe_core._placement as module

    monkeypatch.setattr(module, "_warned_without_process_group", False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(
        UserWarning, match=r"one of 2 \(WORLD_SIZE=2\).*init_process_group.*group="
    ) as caught:
        GPipe(_model(), [1, 2])
    assert caught[0].filename == __file__  # the user's call, not gpipe's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GPipe(_model(), [1, 2])  # once per process


def test_no_warning_when_initialized_or_alone(
    monkeypatch: pytest.MonkeyPatch, world: dist.ProcessGroup
) -> None:
    """Under the user's own data parallelism (initialized, group=None), and in a process
    that is alone, building a pipeline in one process is what was asked."""
    import gpipe_core._placement as module

    monkeypatch.setattr(module, "_warned_without_process_group", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setenv("WORLD_SIZE", "2")
        GPipe(_model(), [1, 2])  # torch.distributed is initialized: the user's choice
        dist.destroy_process_group()
        try:
            monkeypatch.setenv("WORLD_SIZE", "1")
            GPipe(_model(), [1, 2])
        finally:
            _init_world()


_WITHOUT_INIT = """
import warnings, torch
from torch import nn
import torch.distributed as dist
from gpipe_core import GPipe
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = GPipe(model, [1, 1], group=dist.group.WORLD)  # WORLD is None: not initialized
print(pipe.partition_ranks, "|", " ".join(str(w.message) for w in caught))
"""


def test_two_torchrun_processes_without_init_process_group_each_warn() -> None:
    """Two processes with torchrun's environment (RANK, WORLD_SIZE=2, a rendezvous) that
    forget init_process_group: each builds the whole pipeline alone, and says so."""
    base = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _WITHOUT_INIT],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    for (out, err), process in zip(outputs, processes):
        assert process.returncode == 0, err
        ranks, _, message = out.strip().partition(" | ")
        assert ranks == "[0, 0]"  # every partition in this process
        assert "one of 2 (WORLD_SIZE=2)" in message and "init_process_group()" in message
