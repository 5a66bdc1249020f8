"""Tests of ThreadState: grad mode, inference mode and autocast carried into another thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from gpipe_microbatch import ThreadState


def _in_thread(function: Callable[[], Any]) -> Any:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = function()
        except BaseException as error:  # pragma: no cover - reported below
            result["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _probe() -> dict[str, Any]:
    layer = torch.nn.Linear(4, 4)
    return {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "dtype": torch.get_autocast_dtype("cpu"),
        "linear_dtype": layer(torch.randn(2, 4)).dtype,
    }


def test_capture_default_state() -> None:
    state = ThreadState.capture()
    assert state.grad_enabled
    assert not state.inference_mode
    assert not any(enabled for _, enabled, _ in state.autocast)


def test_no_grad_is_carried_into_a_thread() -> None:
    with torch.no_grad():
        state = ThreadState.capture()
    assert not state.grad_enabled

    def work() -> dict[str, Any]:
        with state.apply():
            return _probe()

    assert _in_thread(_probe)["grad"]  # a fresh thread has grad enabled
    assert not _in_thread(work)["grad"]


def test_grad_enabled_is_carried_out_of_no_grad() -> None:
    state = ThreadState.capture()
    with torch.no_grad(), state.apply():
        assert torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_inference_mode_is_carried_into_a_thread() -> None:
    with torch.inference_mode():
        state = ThreadState.capture()
    assert state.inference_mode

    def work() -> tuple[bool, bool, bool]:
        with state.apply():
            x = torch.ones(2)
            return torch.is_inference_mode_enabled(), torch.is_grad_enabled(), x.is_inference()

    assert _in_thread(lambda: torch.is_inference_mode_enabled()) is False
    assert _in_thread(work) == (True, False, True)


def test_inference_mode_off_is_applied_inside_inference_mode() -> None:
    state = ThreadState.capture()
    with torch.inference_mode(), state.apply():
        assert not torch.is_inference_mode_enabled()
        assert not torch.ones(1).is_inference()
    assert torch.is_grad_enabled()


def test_autocast_is_carried_into_a_thread() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = ThreadState.capture()
    assert ("cpu", True, torch.bfloat16) in state.autocast

    plain = _in_thread(_probe)
    assert not plain["autocast"]
    assert plain["linear_dtype"] == torch.float32

    def work() -> dict[str, Any]:
        with state.apply():
            return _probe()

    applied = _in_thread(work)
    assert applied["autocast"]
    assert applied["dtype"] == torch.bfloat16
    assert applied["linear_dtype"] == torch.bfloat16
    assert applied["grad"]


def test_autocast_dtype_float16_is_carried() -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        state = ThreadState.capture()

    def work() -> torch.dtype:
        with state.apply():
            return torch.get_autocast_dtype("cpu")

    assert _in_thread(work) == torch.float16


def test_apply_restores_the_state_afterwards() -> None:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = ThreadState.capture()

    def work() -> tuple[bool, bool, bool, bool]:
        with state.apply():
            inside = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
        return (*inside, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))

    assert _in_thread(work) == (False, True, True, False)


def test_disabled_autocast_is_applied_as_disabled() -> None:
    state = ThreadState.capture()
    with torch.autocast("cpu", dtype=torch.bfloat16), state.apply():
        assert not torch.is_autocast_enabled("cpu")
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


def test_thread_state_is_frozen_and_comparable() -> None:
    a = ThreadState.capture()
    b = ThreadState.capture()
    assert a == b
    with torch.no_grad():
        assert ThreadState.capture() != a


def test_saved_tensors_hooks_are_carried_into_a_thread() -> None:
    packed: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        state = ThreadState.capture()
    assert state.saved_tensors_hooks is not None

    def work() -> torch.Tensor:
        with state.apply():
            x = torch.randn(3, 5, requires_grad=True)
            y = (x * x).sum()
        # The hooks end with the block; nothing packed after it.
        (x * 2).exp()
        return y

    y = _in_thread(work)
    assert packed == [(3, 5), (3, 5)]  # x * x saves both operands
    y.backward()


def test_saved_tensors_hooks_are_not_pushed_twice() -> None:
    calls: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        state = ThreadState.capture()
        with state.apply():
            assert state.saved_tensors_hooks == ThreadState.capture().saved_tensors_hooks
            torch.randn(2, requires_grad=True).exp()
    assert calls == [1]


def test_state_without_hooks_leaves_the_body_hooks() -> None:
    state = ThreadState.capture()
    assert state.saved_tensors_hooks is None
    calls: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), state.apply():
        torch.randn(2, requires_grad=True).exp()
    assert calls == [1]
