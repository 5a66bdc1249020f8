"""An exception inside a partition reaches the caller as it was, and the module survives it."""

from __future__ import annotations

import copy
import gc
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES
from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipe


class Boom(Exception):
    """A custom exception type, so that a wrapped or replaced one is noticed."""


def explode(where: str) -> None:
    raise Boom(f"boom in {where}")


class Explode(nn.Module):
    """Raises :class:`Boom` on its ``on_call``-th forward (counted from 1) while armed."""

    def __init__(self, on_call: int = 1, *, only_recompute: bool = False) -> None:
        super().__init__()
        self.on_call = on_call
        self.only_recompute = only_recompute
        self.armed = True
        self.calls = 0
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.only_recompute and not is_recomputing():
            return x * 1.5
        with self.lock:
            self.calls += 1
            fire = self.armed and self.calls == self.on_call
        if fire:
            explode("forward")
        return x * 1.5

    def __deepcopy__(self, memo: dict[int, Any]) -> Explode:
        twin = Explode(self.on_call, only_recompute=self.only_recompute)
        twin.armed = False
        return twin


class FailBackward(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if FailBackward.armed:
            explode("backward")
        return grad * 2


class FailingBackwardLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailBackward.apply(x)


class Nap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return x


def frames(excinfo: pytest.ExceptionInfo[BaseException]) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(excinfo.tb)]


@pytest.fixture
def assert_runs_like_plain() -> Callable[..., None]:
    def check(pipe: GPipe, plain: nn.Sequential, batch: int = 8) -> None:
        """One more forward and backward on the same GPipe: the results of the plain model."""
        assert_matches_plain(pipe, plain, torch.randn(batch, 4, dtype=torch.float64))

    return check


def model_with(layer: nn.Module, position: int, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 4) for _ in range(depth)]
    layers.insert(position, layer)
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(
    ("position", "balance", "on_call"),
    [
        (0, [1, 2, 2], 1),  # first partition, first micro-batch
        (2, [1, 2, 2], 3),  # middle partition, last micro-batch
        (4, [1, 2, 2], 2),  # last partition
        (2, [5], 2),  # one partition: runs in the calling thread
    ],
)
def test_exception_in_forward(
    position: int,
    balance: list[int],
    on_call: int,
    checkpoint: str,
    assert_runs_like_plain: Callable[..., None],
) -> None:
    bomb = Explode(on_call)
    model = model_with(bomb, position)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)

    with pytest.raises(Boom, match="boom in forward") as excinfo:
        pipe(torch.randn(6, 4, dtype=torch.float64))
    assert type(excinfo.value) is Boom
    assert "explode" in frames(excinfo)
    assert "forward" in frames(excinfo)

    bomb.armed = False
    assert_runs_like_plain(pipe, plain)
    assert_runs_like_plain(pipe, plain, batch=5)


@pytest.mark.parametrize("checkpoint", MODES)
def test_exception_while_other_partitions_are_busy(
    checkpoint: str, assert_runs_like_plain: Callable[..., None]
) -> None:
    # Partition 1 fails on micro-batch 1 (clock 2) while partitions 0 and 2 are working
    # on micro-batches 2 and 0 in the same clock, and still busy when it fails.
    torch.manual_seed(0)
    bomb = Explode(on_call=2)
    model = nn.Sequential(
        nn.Linear(4, 4), Nap(), bomb, nn.Linear(4, 4), Nap(), nn.Linear(4, 4)
    ).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2], chunks=4, checkpoint=checkpoint)
    for _ in range(2):
        bomb.calls = 0
        bomb.armed = True
        with pytest.raises(Boom) as excinfo:
            pipe(torch.randn(8, 4, dtype=torch.float64))
        assert "explode" in frames(excinfo)
        bomb.armed = False
        assert_runs_like_plain(pipe, plain)


def test_exceptions_in_two_partitions_of_one_clock(
    assert_runs_like_plain: Callable[..., None],
) -> None:
    # Both fail in the same clock; the caller gets one of them, as it was, and the pool
    # is left clean for the next run.
    torch.manual_seed(0)
    first, second = Explode(on_call=2), Explode(on_call=1)
    model = nn.Sequential(nn.Linear(4, 4), first, second, nn.Linear(4, 4)).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2], chunks=3)
    with pytest.raises(Boom):
        pipe(torch.randn(6, 4, dtype=torch.float64))
    first.armed = second.armed = False
    assert_runs_like_plain(pipe, plain)


class KeyboardLike(BaseException):
    pass


def test_base_exception_in_a_partition_is_carried(
    assert_runs_like_plain: Callable[..., None],
) -> None:
    class Interrupt(nn.Module):
        armed = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                raise KeyboardLike("stop")
            return x

    layer = Interrupt()
    model = nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(4, 4)).double()
    plain = copy.deepcopy(model)
    plain[1].armed = False
    pipe = GPipe(model, [1, 1, 1], chunks=2)
    with pytest.raises(KeyboardLike, match="stop"):
        pipe(torch.randn(4, 4, dtype=torch.float64))
    layer.armed = False
    assert_runs_like_plain(pipe, plain)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[1, 2, 2], [5]])
def test_exception_in_backward(
    balance: list[int], checkpoint: str, assert_runs_like_plain: Callable[..., None]
) -> None:
    model = model_with(FailingBackwardLayer(), 2)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    FailBackward.armed = True
    try:
        output = pipe(torch.randn(6, 4, dtype=torch.float64, requires_grad=True))
        with pytest.raises(Boom, match="boom in backward") as excinfo:
            output.sum().backward()
        assert type(excinfo.value) is Boom
        assert "explode" in frames(excinfo)
    finally:
        FailBackward.armed = False
    assert_runs_like_plain(pipe, plain)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("balance", [[1, 2, 2], [2, 3], [5]])
def test_exception_in_recomputation(
    balance: list[int], checkpoint: str, assert_runs_like_plain: Callable[..., None]
) -> None:
    bomb = Explode(on_call=1, only_recompute=True)
    model = model_with(bomb, 1)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)

    # The forward pass is fine: the layer raises only when recomputed.
    output = pipe(torch.randn(6, 4, dtype=torch.float64, requires_grad=True))
    assert bomb.calls == 0
    with pytest.raises(Boom, match="boom in forward") as excinfo:
        output.sum().backward()
    assert type(excinfo.value) is Boom
    assert "explode" in frames(excinfo)
    assert bomb.calls == 1

    bomb.armed = False
    assert_runs_like_plain(pipe, plain)


def test_exception_in_forward_then_in_backward_then_fine(
    assert_runs_like_plain: Callable[..., None],
) -> None:
    bomb = Explode(on_call=2)
    model = model_with(bomb, 3)
    model.insert(1, FailingBackwardLayer())
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2], chunks=4, checkpoint="except_last")
    with pytest.raises(Boom):
        pipe(torch.randn(8, 4, dtype=torch.float64))
    bomb.armed = False
    FailBackward.armed = True
    try:
        output = pipe(torch.randn(8, 4, dtype=torch.float64))
        with pytest.raises(Boom):
            output.sum().backward()
    finally:
        FailBackward.armed = False
    assert_runs_like_plain(pipe, plain)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_exception_next_to_dropout_releases_the_generator(checkpoint: str) -> None:
    # Partitions that draw random numbers hold a generator lock while they compute; an
    # exception must release it, or the next run would hang.
    bomb = Explode(on_call=2)
    model = nn.Sequential(nn.Dropout(0.5), bomb, nn.Dropout(0.5), nn.Identity())
    pipe = GPipe(model, [2, 2], chunks=3, checkpoint=checkpoint)
    for _ in range(3):
        bomb.calls = 0
        with pytest.raises(Boom):
            pipe(torch.rand(6, 8))
    bomb.armed = False
    x = (torch.rand(6, 8, dtype=torch.float64) + 0.5).requires_grad_()
    output = pipe(x)
    output.sum().backward()
    # Explode scales by 1.5; dropout masks must be those of the forward pass.
    torch.testing.assert_close(x.grad, output.detach() / x.detach())


# -- what a failed run leaves behind ----------------------------------------------------------


class Watched(nn.Module):
    """Scales its input, keeping a weak reference to each output (an activation)."""

    def __init__(self, refs: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__()
        self.refs = refs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.5
        self.refs.append(weakref.ref(y))
        return y


def run_and_fail(pipe: GPipe, path: str, where: str, refs: list[weakref.ref[Any]]) -> None:
    """A run of ``pipe`` that raises :class:`Boom` (in a layer or the loss); the input's and
    target's weak references go to ``refs``. Holds no reference to them afterwards."""
    x = torch.randn(8, 4, requires_grad=True)
    y = torch.randn(8, 4)
    refs += [weakref.ref(x), weakref.ref(y)]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if where == "loss":
            explode("loss")
        return (output - target).pow(2).sum()

    try:
        if path == "forward":
            pipe(x)
        else:
            pipe.step(x, y, loss_fn, schedule=path)
    except Boom:
        pass  # not bound to a name: nothing here holds the error
    else:
        raise AssertionError("the run did not fail")


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(
    ("path", "where"),
    [("forward", "layer"), ("gpipe", "layer"), ("gpipe", "loss"), ("1f1b", "loss")],
)
def test_a_failed_run_frees_its_tensors_at_once(path: str, where: str, checkpoint: str) -> None:
    # With the cycle collector off, only reference counts free the input and the
    # activations: the error must not sit in a reference cycle that holds them.
    refs: list[weakref.ref[Any]] = []
    layers: list[nn.Module] = [nn.Linear(4, 4), Watched(refs), nn.Linear(4, 4), Watched(refs)]
    if where == "layer":
        layers.append(Explode(on_call=2))
    pipe = GPipe(nn.Sequential(*layers), [2, len(layers) - 2], chunks=4, checkpoint=checkpoint)
    gc.collect()
    gc.disable()
    try:
        run_and_fail(pipe, path, where, refs)
        alive = [k for k, ref in enumerate(refs) if ref() is not None]
    finally:
        gc.enable()
    assert len(refs) > 4  # the input, the target, and activations of several micro-batches
    assert alive == []
