"""Partitions whose layers cannot draw random numbers take no generator lock.

In a run with checkpointing every forward pass holds its device's generator lock, unless
its partition is made only of layers known not to draw (``_draws.draws_nothing``) and the
pass runs plainly (``_draws.calls_plainly``). What it cannot vouch for takes the lock;
these tests pin both sides, and check that a pipeline whose partitions take no lock still
gives the plain model's gradients.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpipe_checkpoint import device_rng_lock
from gpipe_core import GPipe
from gpipe_core.run._draws import calls_plainly, draws_nothing

TIMEOUT = 120.0


class Scaled(nn.Linear):
    """A subclass of a listed layer: its forward is its own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


class Custom(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input


class Subclass(torch.Tensor):
    pass


class Overriding:
    """Not a tensor, but torch functions given it call its ``__torch_function__``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return NotImplemented


def test_listed_layers_draw_nothing() -> None:
    partition = nn.Sequential(
        nn.Conv1d(2, 2, 1),
        nn.BatchNorm1d(2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6, 4),
        nn.LayerNorm(4),
        nn.GELU(),
        nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
    )
    assert draws_nothing(partition)


@pytest.mark.parametrize(
    "layer",
    [
        nn.Dropout(),
        nn.Dropout(0.0),
        nn.AlphaDropout(),
        nn.RReLU(),
        nn.FractionalMaxPool2d(2, output_size=1),
        nn.TransformerEncoderLayer(4, 1),
        nn.MultiheadAttention(4, 1),
        Scaled(4, 4),
        Custom(),
    ],
    ids=lambda layer: type(layer).__name__,
)
def test_a_layer_that_may_draw_or_is_not_listed_takes_the_lock(layer: nn.Module) -> None:
    assert not draws_nothing(nn.Sequential(nn.Linear(4, 4), layer))


@pytest.mark.parametrize(
    "hook",
    [
        lambda m: m.register_forward_hook(lambda *_: None),
        lambda m: m.register_forward_pre_hook(lambda *_: None),
        lambda m: m.register_full_backward_hook(lambda *_: None),
        lambda m: m.register_full_backward_pre_hook(lambda *_: None),
        lambda m: nn.modules.module.register_module_forward_hook(lambda *_: None),
        lambda m: nn.modules.module.register_module_forward_pre_hook(lambda *_: None),
    ],
    ids=["forward", "forward-pre", "backward", "backward-pre", "global", "global-pre"],
)
def test_a_hook_takes_the_lock(hook: Callable[[nn.Module], object]) -> None:
    layer = nn.Linear(4, 4)
    handle = hook(layer)
    try:
        assert not draws_nothing(nn.Sequential(nn.ReLU(), layer))
    finally:
        handle.remove()  # type: ignore[attr-defined]
    assert draws_nothing(nn.Sequential(nn.ReLU(), layer))


def test_a_forward_set_on_the_instance_takes_the_lock() -> None:
    layer = nn.Linear(4, 4)
    layer.forward = lambda input: torch.rand_like(input)  # type: ignore[method-assign]
    assert not draws_nothing(nn.Sequential(layer))


def test_a_forward_patched_on_the_class_takes_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nn.Tanh, "forward", lambda self, input: torch.rand_like(input))
    assert not draws_nothing(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))


def test_parameters_and_buffers_of_a_tensor_subclass_take_the_lock() -> None:
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(torch.ones(4, 4).as_subclass(Subclass))
    assert not draws_nothing(nn.Sequential(layer))
    norm = nn.BatchNorm1d(4)
    norm.running_mean = torch.zeros(4).as_subclass(Subclass)
    assert not draws_nothing(nn.Sequential(norm))


def test_a_pass_runs_plainly_without_modes_hooks_or_subclasses() -> None:
    plain = [torch.ones(2)]
    assert calls_plainly(plain)
    assert not calls_plainly([torch.ones(2).as_subclass(Subclass)])
    assert calls_plainly(plain, [None, 2, 0.5, "mode", True])
    assert not calls_plainly(plain, [Overriding()])
    assert not calls_plainly(plain, [(1, 2)])
    with TorchFunctionMode():
        assert not calls_plainly(plain)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not calls_plainly(plain)
    assert calls_plainly(plain)


def _run_holding_the_lock(fn: Callable[[], object]) -> bool:
    """Run ``fn`` in a thread while this thread holds the CPU generator's lock; whether it
    ended (then it never waited for the lock). The thread always ends and is joined."""
    done = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    lock = device_rng_lock(torch.device("cpu"))
    thread = threading.Thread(target=target, daemon=True)
    with lock:
        thread.start()
        ended = done.wait(TIMEOUT)
    thread.join(TIMEOUT)  # released: a run that waited for the lock ends now
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return ended


@pytest.mark.parametrize("path", ["forward", "step"])
def test_partitions_that_draw_nothing_take_no_lock_and_match_the_plain_model(path: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2))
    pipe = GPipe(copy.deepcopy(plain), [2, 2, 1], chunks=3, checkpoint="always")
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    loss_fn = nn.MSELoss()

    def run() -> None:
        if path == "forward":
            loss_fn(pipe(x), y).backward()
        else:
            pipe.step(x, y, loss_fn)

    # Every worker's forward passes and recomputations run while another thread holds the
    # generator's lock: none of them waits for it.
    assert _run_holding_the_lock(run)
    loss_fn(plain(x), y).backward()
    for a, b in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad)
