"""An interrupt in the caller while it waits for the workers leaves nothing hanging.

An asynchronous exception (``KeyboardInterrupt`` from a signal, or one set with
``PyThreadState_SetAsyncExc`` as timeout helpers do) may land at any bytecode of the caller,
also right after a worker's report arrived. The forward pass must raise it, stop the
workers, and leave the model usable, whenever it lands.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch
from torch import nn

from gpipe_core import GPipe


class Interrupt(BaseException):
    pass


class Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return x


def _interrupt(thread: threading.Thread) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(Interrupt)
    )


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.15])
def test_interrupted_forward_ends_and_the_model_still_works(delay: float) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Slow(), nn.Linear(4, 4), Slow(), nn.Linear(4, 2))
    pipe = GPipe(model, [2, 2, 1], chunks=8)
    x = torch.randn(16, 4)
    expected = model(x)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            # Several passes, so that the interrupt lands in any part of one.
            for _ in range(5):
                pipe(x)
        except Interrupt as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    time.sleep(delay)
    _interrupt(thread)
    thread.join(30)
    assert not thread.is_alive(), "the interrupted forward pass hangs"
    assert outcome  # raised the interrupt, or finished before it landed
    torch.testing.assert_close(pipe(x), expected)


def test_interrupt_while_the_workers_start(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = GPipe(model, [1, 1, 1], chunks=4)
    x = torch.randn(8, 4)
    real_start = threading.Thread.start
    starts: list[str] = []

    def start(self: threading.Thread) -> None:
        starts.append(self.name)
        if len(starts) == 2:  # the second worker: interrupted before it starts
            raise Interrupt
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(Interrupt):
        pipe(x)
    monkeypatch.setattr(threading.Thread, "start", real_start)

    # The next call starts what did not start, once: every partition has one worker.
    result: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: result.append(pipe(x)), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a partition was left without a worker"
    torch.testing.assert_close(result[0], model(x))
