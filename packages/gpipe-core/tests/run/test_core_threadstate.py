"""Autocast and grad mode reach every partition's worker, and the recomputation too."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from core_support.models import MODES
from gpipe_checkpoint import is_checkpointing, is_recomputing
from gpipe_core import GPipe


@dataclass(frozen=True)
class Seen:
    key: int
    thread: str
    dtype: torch.dtype
    autocast: bool
    grad: bool
    recomputing: bool
    checkpointing: bool


class Probe(nn.Module):
    """Records what the layer before it produced and the thread-local state it runs under."""

    def __init__(self, key: int, log: list[Seen], lock: threading.Lock) -> None:
        super().__init__()
        self.key = key
        self.log = log
        self.lock = lock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = Seen(
            key=self.key,
            thread=threading.current_thread().name,
            dtype=x.dtype,
            autocast=torch.is_autocast_enabled("cpu"),
            grad=torch.is_grad_enabled(),
            recomputing=is_recomputing(),
            checkpointing=is_checkpointing(),
        )
        with self.lock:
            self.log.append(seen)
        return x


def probed_pipe(partitions: int, chunks: int, checkpoint: str) -> tuple[GPipe, list[Seen]]:
    torch.manual_seed(0)
    log: list[Seen] = []
    lock = threading.Lock()
    layers: list[nn.Module] = []
    for j in range(partitions):
        layers += [nn.Linear(4, 4), Probe(j, log, lock)]
    pipe = GPipe(nn.Sequential(*layers), [2] * partitions, chunks=chunks, checkpoint=checkpoint)
    return pipe, log


@pytest.mark.parametrize("checkpoint", MODES)
def test_autocast_reaches_every_partition_and_the_recomputation(checkpoint: str) -> None:
    partitions, chunks = 3, 3
    pipe, log = probed_pipe(partitions, chunks, checkpoint)
    x = torch.randn(6, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = pipe(x)
    assert output.dtype == torch.bfloat16

    forward = list(log)
    assert len(forward) == partitions * chunks
    assert {seen.key for seen in forward} == set(range(partitions))
    # Every partition ran on its worker, under autocast, and its Linear ran in bf16.
    for seen in forward:
        assert seen.thread == f"gpipe-worker-{seen.key}"
        assert seen.autocast, seen
        assert seen.dtype == torch.bfloat16, seen
        # The checkpoint phase runs without grad; the others with.
        assert seen.grad != seen.checkpointing, seen
    log.clear()

    # Backward runs outside the autocast block: recomputation must restore it.
    output.float().sum().backward()
    recomputed = list(log)
    expected = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    assert len(recomputed) == partitions * expected
    for seen in recomputed:
        assert seen.recomputing and seen.grad
        assert seen.autocast, seen
        assert seen.dtype == torch.bfloat16, seen
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_autocast_output_matches_plain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 1, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(x)
        output = pipe(x)
    assert output.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(output, expected)


def test_autocast_does_not_leak_into_later_runs() -> None:
    pipe, log = probed_pipe(2, 2, "except_last")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe(torch.randn(4, 4))
    log.clear()
    output = pipe(torch.randn(4, 4))
    assert output.dtype == torch.float32
    assert log and all(not seen.autocast and seen.dtype == torch.float32 for seen in log)


@pytest.mark.parametrize("checkpoint", MODES)
def test_no_grad_reaches_every_partition(checkpoint: str) -> None:
    pipe, log = probed_pipe(3, 4, checkpoint)
    x = torch.randn(8, 4, requires_grad=True)
    with torch.no_grad():
        output = pipe(x)
    assert not output.requires_grad
    assert output.grad_fn is None
    assert len(log) == 3 * 4
    assert all(not seen.grad and not seen.checkpointing for seen in log)
    assert {seen.thread for seen in log} == {f"gpipe-worker-{j}" for j in range(3)}

    # ... and does not leak into the next run.
    log.clear()
    output = pipe(x)
    assert output.requires_grad
    assert len(log) == 3 * 4
    assert all(seen.grad != seen.checkpointing for seen in log)
    # Micro-batches that are not checkpointed run with grad.
    plain_runs = {"always": 0, "except_last": 3, "never": 12}[checkpoint]
    assert sum(seen.grad for seen in log) == plain_runs


def test_enable_grad_inside_no_grad_is_carried() -> None:
    pipe, log = probed_pipe(2, 2, "never")
    x = torch.randn(4, 4, requires_grad=True)
    with torch.no_grad(), torch.enable_grad():
        output = pipe(x)
    assert output.requires_grad
    assert all(seen.grad for seen in log)
