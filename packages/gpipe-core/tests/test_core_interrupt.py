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
