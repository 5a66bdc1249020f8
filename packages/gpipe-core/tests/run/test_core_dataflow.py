"""Workers run their partition's micro-batches as inputs arrive, not clock by clock."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.turns import measured_short
from gpipe_core import GPipe


class Signal(nn.Module):
    """Sets ``event`` on its ``on_call``-th forward (counted from 1)."""

    def __init__(self, event: threading.Event, on_call: int) -> None:
        super().__init__()
        self.event = event
        self.on_call = on_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.on_call:
            self.event.set()
        return x


class WaitFor(nn.Module):
    """Waits (up to a minute) for ``event`` on its first forward; records whether it came."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__()
        self.event = event
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.seen:
            self.seen.append(self.event.wait(timeout=60))
        return x


# Without checkpointing only, and partition 0 without a backward pass (no parameters, an
# input that needs no gradient): forward passes on one device that a backward pass may
# replay (gpipe's checkpointing, or torch's checkpoint inside a layer) take turns with its
# generator lock (whether a partition draws random numbers may depend on its input), so
# partition 0 could not run while partition 1 waits inside a forward pass.
@pytest.mark.parametrize("checkpoint", ["never"])
def test_a_partition_runs_ahead_of_a_busy_next_partition(checkpoint: str) -> None:
    # Partition 1 holds micro-batch 0 until partition 0 has run micro-batch 3: in clock
    # order partition 0 would wait for partition 1 at every clock and never get there.
    torch.manual_seed(0)
    event = threading.Event()
    last = nn.Linear(4, 4).double()
    plain = nn.Sequential(nn.Identity(), nn.Identity(), nn.Identity(), copy.deepcopy(last))
    waiter = WaitFor(event)
    model = nn.Sequential(nn.Identity(), Signal(event, on_call=4), waiter, last)
    pipe = GPipe(model, [2, 2], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 4, dtype=torch.float64)
    assert_matches_plain(pipe, plain, x, input_requires_grad=False)
    assert waiter.seen == [True]


def test_first_error_is_the_one_of_the_earliest_clock() -> None:
    # Partition 0 fails on micro-batch 2 (clock 2) only once partition 1 has failed on
    # micro-batch 0 (clock 1): the caller gets partition 1's error.
    event = threading.Event()

    class Late(nn.Module):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 3:
                event.wait(timeout=60)
                raise ValueError("late")
            return x

    class Early(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            event.set()
            raise KeyError("early")

    pipe = GPipe(nn.Sequential(Late(), Early()), [1, 1], chunks=4, checkpoint="never")
    with pytest.raises(KeyError, match="early"):
        pipe(torch.randn(8, 4))


class SignalEachStep(nn.Module):
    """Sets ``events[s]`` on the last micro-batch's forward pass of step ``s``."""

    def __init__(self, events: list[threading.Event], chunks: int) -> None:
        super().__init__()
        self.events, self.chunks, self.calls = events, chunks, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step, i = divmod(self.calls, self.chunks)
        self.calls += 1
        if i == self.chunks - 1:
            self.events[step].set()
        return x


class WaitEachStep(nn.Module):
    """Waits (up to a minute) for ``events[s]`` on the first micro-batch's forward pass of
    step ``s``; records whether it came."""

    def __init__(self, events: list[threading.Event], chunks: int) -> None:
        super().__init__()
        self.events, self.chunks, self.calls = events, chunks, 0
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step, i = divmod(self.calls, self.chunks)
        self.calls += 1
        if i == 0:
            self.seen.append(self.events[step].wait(timeout=60))
        return x


@pytest.mark.parametrize("call", ["step", "forward"])
def test_a_layer_waiting_for_another_partition_in_one_turn(call: str) -> None:
    """Every action measured short makes a run one turn (the calling thread runs all of
    them in serial order, where partition 1's first forward pass comes before partition
    0's last): the waiting layer blocks the calling thread, and the workers take over the
    other actions, so every run finishes, each with the layer's wait met (GPipe's
    schedule: partition 0 runs every forward pass before its backward passes)."""
    torch.manual_seed(0)
    steps, chunks = 20, 4
    events = [threading.Event() for _ in range(steps)]
    # Partition 0 without a backward pass, as in the test above.
    first, last = nn.Identity(), nn.Linear(4, 4).double()
    plain = nn.Sequential(nn.Identity(), nn.Identity(), nn.Identity(), copy.deepcopy(last))
    waiter = WaitEachStep(events, chunks)
    model = nn.Sequential(first, SignalEachStep(events, chunks), waiter, last)
    pipe = GPipe(model, [2, 2], chunks=chunks, checkpoint="never")
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    threads: list[int] = []
    first.register_forward_pre_hook(lambda *_: threads.append(threading.get_ident()))
    for _ in range(steps):
        measured_short(pipe, hand_over=True)  # one turn, every time: in this thread first
        threads.clear()
        for p in [*pipe.parameters(), *plain.parameters()]:
            p.grad = None
        if call == "step":
            losses = pipe.step(x, y, nn.MSELoss(), schedule="gpipe")
        else:
            losses = nn.MSELoss()(pipe(x), y)
            losses.backward()
        expected = nn.MSELoss()(plain(x), y)
        expected.backward()
        got = losses.reduced() if call == "step" else losses.detach()  # type: ignore[union-attr]
        torch.testing.assert_close(got, expected.detach())
        for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        assert threads[0] == threading.get_ident()
    assert waiter.seen == [True] * steps
