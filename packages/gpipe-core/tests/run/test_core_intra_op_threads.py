"""Intra-op threads of the workers (issue 24): the caller's divided among the workers on the
CPU that compute at once, an integer for every worker, or 0 for torch's setting."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from gpipe_core import GPipe

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
    # Micro-batch 1 on partition 0 and micro-batch 0 on partition 1 meet at the barrier, so
    # both are computing: the one that started second got half of the caller's threads.
    seen: list[tuple[str, int]] = []
    met: list[int] = []
    barrier = threading.Barrier(2)

    class Meet(nn.Module):
        def __init__(self, microbatch: int) -> None:
            super().__init__()
            self.microbatch = microbatch
            self.calls = 0

        def forward(self, x: Tensor) -> Tensor:
            if self.calls == self.microbatch:
                met.append(torch.get_num_threads())
                barrier.wait(timeout=10)
            self.calls += 1
            return x

    model = GPipe(
        nn.Sequential(Meet(1), Record(seen), Meet(0), Record(seen)),
        [2, 2],
        chunks=2,
        checkpoint="never",
    )
    model(torch.randn(4, 2))
    assert sorted(met) == [CALLER // 2, CALLER]
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
