"""Re-entering a GPipe module from inside its own run is refused at once, never a hang.

A layer or a hook of the module that calls the module again (its forward pass or its
step) runs on one of the module's workers, which would then wait for the workers, that is
for itself. Each case must raise a clear error within its timeout, and leave the model
usable.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from core_support.models import MODES
from core_support.turns import measured_short
from gpipe_core import GPipe

TIMEOUT = 60.0


def within_timeout(function: Callable[[], Any]) -> BaseException | None:
    """Run ``function`` in a thread; fail the test if it does not end in time."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            function()
        except BaseException as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "re-entering the module hangs"
    return outcome[0]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))


def assert_still_usable(pipe: GPipe, plain: nn.Module) -> None:
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), plain(x))
    y = torch.randn(6, 2)
    losses = pipe.step(x, y, nn.MSELoss())
    torch.testing.assert_close(losses.reduced(), nn.MSELoss()(plain(x), y))


def in_one_turn(pipe: GPipe, one_turn: bool) -> None:
    """Make every run of ``pipe`` one turn (its actions measured short: the calling
    thread runs them all, where a hook calling the module runs in the thread that holds
    the run), or leave the first run to the workers."""
    if one_turn:
        measured_short(pipe)


@pytest.mark.parametrize("one_turn", [False, True])
@pytest.mark.parametrize("checkpoint", MODES)
def test_forward_hook_calling_its_own_module(checkpoint: str, one_turn: bool) -> None:
    plain = model()
    pipe = GPipe(copy.deepcopy(plain), [2, 2], chunks=3, checkpoint=checkpoint)
    in_one_turn(pipe, one_turn)
    x = torch.randn(6, 4)

    def hook(*_: Any) -> None:
        pipe(x)

    handle = pipe[2].register_forward_hook(hook)
    error = within_timeout(lambda: pipe(x))
    assert isinstance(error, RuntimeError)
    assert "called from inside its own run" in str(error)
    assert ("gpipe-worker" in str(error)) is not one_turn
    assert one_turn or "gpipe-worker-1" in str(error)
    handle.remove()
    assert_still_usable(pipe, plain)


def test_step_called_from_a_forward_hook() -> None:
    plain = model()
    pipe = GPipe(copy.deepcopy(plain), [2, 2], chunks=3, checkpoint="never")
    x, y = torch.randn(6, 4), torch.randn(6, 2)

    def hook(*_: Any) -> None:
        pipe.step(x, y, nn.MSELoss())

    handle = pipe[0].register_forward_hook(hook)
    error = within_timeout(lambda: pipe(x))
    assert isinstance(error, RuntimeError)
    assert "called from inside its own run" in str(error)
    handle.remove()
    assert_still_usable(pipe, plain)


@pytest.mark.parametrize("one_turn", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_backward_of_the_module_from_a_gradient_hook_during_a_step(
    schedule: str, one_turn: bool
) -> None:
    plain = model()
    pipe = GPipe(copy.deepcopy(plain), [2, 2], chunks=3)
    in_one_turn(pipe, one_turn)
    x, y = torch.randn(6, 4), torch.randn(6, 2)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        pipe(x).sum().backward()
        return grad

    handle = pipe[3].weight.register_hook(hook)
    error = within_timeout(lambda: pipe.step(x, y, nn.MSELoss(), schedule=schedule))
    assert isinstance(error, RuntimeError)
    assert "called from inside its own run" in str(error)
    handle.remove()
    pipe.zero_grad()
    assert_still_usable(pipe, plain)


def test_another_module_inside_a_hook_still_runs() -> None:
    # Only the module itself is refused: a hook may run another GPipe module.
    plain = model()
    pipe = GPipe(copy.deepcopy(plain), [2, 2], chunks=3)
    other = GPipe(model(), [2, 2], chunks=2)
    seen: list[torch.Tensor] = []
    x = torch.randn(6, 4)

    def hook(*_: Any) -> None:
        with torch.no_grad():
            seen.append(other(x))

    handle = pipe[2].register_forward_hook(hook)
    assert within_timeout(lambda: pipe(x)) is None
    handle.remove()
    assert len(seen) == 3  # once per micro-batch
    torch.testing.assert_close(seen[0], plain(x))
