"""Intra-op threads of the workers (issue 24): the caller's divided among the workers on the
CPU that compute at once, an integer for every worker, or 0 for torch's setting."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn

from gpipe_core import GPipe
from gpipe_core.run._threads import ThreadShare

pytestmark = pytest.mark.skipif(
    not torch.backends.openmp.is_available(),
    reason="torch without OpenMP shares one intra-op pool among its threads: nothing divided",
)

CALLER = 4  # more threads than cores is allowed: only the counts are looked at


@pytest.fixture(autouse=True)
def caller_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(CALLER)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Record(nn.Module):
    """Records the intra-op threads of the thread that runs its forward (and backward)."""

    def __init__(self, seen: list[tuple[str, int]]) -> None:
        super().__init__()
        self.seen = seen
        self.linear = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        return self.linear(x)


def after_run_in_new_thread() -> int:
    """The count a thread started now begins with (what the end of the run set back)."""
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return got[0]


def test_a_worker_alone_uses_every_thread_of_the_caller() -> None:
    # One micro-batch: the two workers never compute at once.
    seen: list[tuple[str, int]] = []
    model = GPipe(nn.Sequential(Record(seen), Record(seen)), [1, 1], chunks=1)
    model.step(torch.randn(4, 2), torch.randn(4, 2), nn.MSELoss())
    assert [name for name, _ in seen] == ["gpipe-worker-0", "gpipe-worker-1"]
    assert [count for _, count in seen] == [CALLER, CALLER]
    assert torch.get_num_threads() == CALLER
    assert after_run_in_new_thread() == CALLER


def test_workers_computing_at_once_divide_the_threads() -> None:
    # Micro-batch 1 on partition 0 and micro-batch 0 on partition 1 meet at a barrier, so
    # both are computing; the layer after it (before a second barrier, so that neither has
    # ended) runs with half of the caller's threads in both, whichever started first.
    met: list[int] = []
    barriers = [threading.Barrier(2), threading.Barrier(2)]

    class Meet(nn.Module):
        def __init__(self, microbatch: int, barrier: int, record: bool) -> None:
            super().__init__()
            self.microbatch, self.barrier, self.record = microbatch, barrier, record
            self.calls = 0

        def forward(self, x: Tensor) -> Tensor:
            if self.calls == self.microbatch:
                if self.record:
                    met.append(torch.get_num_threads())
                barriers[self.barrier].wait(timeout=10)
            self.calls += 1
            return x

    model = GPipe(
        nn.Sequential(Meet(1, 0, False), Meet(1, 1, True), Meet(0, 0, False), Meet(0, 1, True)),
        [2, 2],
        chunks=2,
        checkpoint="never",
    )
    model(torch.randn(4, 2))
    assert met == [CALLER // 2, CALLER // 2]
    assert torch.get_num_threads() == CALLER
    assert after_run_in_new_thread() == CALLER


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_integer_is_every_workers_count(schedule: str) -> None:
    seen: list[tuple[str, int]] = []
    model = GPipe(nn.Sequential(Record(seen), Record(seen)), [1, 1], chunks=4, intra_op_threads=1)
    assert model.intra_op_threads == 1
    model.step(torch.randn(8, 2), torch.randn(8, 2), nn.MSELoss(), schedule=schedule)
    assert {count for _, count in seen} == {1}
    assert torch.get_num_threads() == CALLER
    assert after_run_in_new_thread() == CALLER


def test_zero_leaves_the_workers_at_torch_setting() -> None:
    seen: list[tuple[str, int]] = []
    model = GPipe(nn.Sequential(Record(seen), Record(seen)), [1, 1], chunks=4, intra_op_threads=0)
    model(torch.randn(8, 2))
    # A worker keeps the count it started with: torch's setting when it first computed.
    assert {count for _, count in seen} == {CALLER}


def test_the_caller_thread_keeps_its_count_in_a_serial_run() -> None:
    # One partition runs in the calling thread: nothing to divide.
    seen: list[tuple[str, int]] = []
    model = GPipe(nn.Sequential(Record(seen)), [1], chunks=2)
    model.step(torch.randn(4, 2), torch.randn(4, 2), nn.MSELoss())
    assert {count for _, count in seen} == {CALLER}
    assert {name for name, _ in seen} == {threading.current_thread().name}


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            -1,
            ValueError,
            r"intra_op_threads must be None, 0 or a positive integer \(intra_op_threads: -1\)",
        ),
        (1.5, TypeError, r"intra_op_threads must be None or an integer \(intra_op_threads: 1.5\)"),
        (
            True,
            TypeError,
            r"intra_op_threads must be None or an integer \(intra_op_threads: True\)",
        ),
    ],
)
def test_bad_values_are_refused(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        GPipe(nn.Sequential(nn.Linear(2, 2)), [1], intra_op_threads=value)  # type: ignore[arg-type]


class _Counted(torch.autograd.Function):
    """The identity, recording the intra-op threads of its forward and backward passes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seen: list[tuple[str, int]], name: str) -> Tensor:
        ctx.seen, ctx.name = seen, name
        seen.append((f"forward {name}", torch.get_num_threads()))
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.seen.append((f"backward {ctx.name}", torch.get_num_threads()))
        return grad, None, None


class Counted(nn.Module):
    def __init__(self, seen: list[tuple[str, int]], name: str) -> None:
        super().__init__()
        self.seen, self.name = seen, name

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, _Counted.apply(x, self.seen, self.name))


class _Call(torch.autograd.Function):
    """The identity, calling ``on_backward`` in its backward pass."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, on_backward: Callable[[], None]) -> Tensor:
        ctx.on_backward = on_backward
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.on_backward()
        return grad, None


class Call(nn.Module):
    def __init__(self, on_forward: Callable[[], None], on_backward: Callable[[], None]) -> None:
        super().__init__()
        self.on_forward, self.on_backward = on_forward, on_backward

    def forward(self, x: Tensor) -> Tensor:
        self.on_forward()
        return cast(Tensor, _Call.apply(x, self.on_backward))


def test_a_computation_takes_its_share_again_between_layers() -> None:
    # A worker computes alone, another starts (in layer "start"), and ends (in the backward
    # pass of layer "end"): the layers after each change see the share of that moment, in
    # the forward and the backward pass, not the count the computation started with.
    share = ThreadShare(None, caller=CALLER)
    cpu = torch.device("cpu")
    seen: list[tuple[str, int]] = []
    started, release = threading.Event(), threading.Event()

    def other_worker() -> None:
        with share.computing(cpu):
            started.set()
            release.wait(timeout=10)

    other = threading.Thread(target=other_worker)

    def start() -> None:
        other.start()
        assert started.wait(timeout=10)

    def end() -> None:
        release.set()
        other.join(timeout=10)

    def nothing() -> None:
        pass

    layers = nn.Sequential(
        Counted(seen, "a"), Call(start, nothing), Counted(seen, "b"),
        Call(nothing, end), Counted(seen, "c"),
    )  # fmt: skip
    x = torch.ones(2, requires_grad=True)
    try:
        with share.worker(cpu, [layers], backward=True):
            with share.computing(cpu):
                output = layers(x)
            with share.computing(cpu):
                output.sum().backward()
            assert all(layer._forward_pre_hooks for layer in layers)  # in the run only
    finally:
        end()
    assert seen == [
        ("forward a", CALLER),
        ("forward b", CALLER // 2),
        ("forward c", CALLER // 2),
        ("backward c", CALLER // 2),
        ("backward b", CALLER),
        ("backward a", CALLER),
    ]
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
    assert torch.get_num_threads() == CALLER


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_run_leaves_no_hook_on_the_layers(schedule: str) -> None:
    seen: list[tuple[str, int]] = []
    layers = [Record(seen), Record(seen), Record(seen)]
    model = GPipe(nn.Sequential(*layers), [2, 1], chunks=4)
    model.step(torch.randn(8, 2), torch.randn(8, 2), nn.MSELoss(), schedule=schedule)
    model(torch.randn(8, 2)).sum().backward()
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
    assert {count for _, count in seen} <= {CALLER, CALLER // 2}
