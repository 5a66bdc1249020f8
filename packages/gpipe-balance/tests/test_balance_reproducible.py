"""Reproducible automatic balance (issue 14 item 5): a minimum number of measured passes
whatever the timeout, a warning when they run past it, and the median of the passes."""

from __future__ import annotations

import time
import types
import warnings

import pytest
import torch
from torch import Tensor, nn

import gpipe_balance._profile as profile_module
from gpipe_balance import balance_by_time, profile_times


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A fake clock for profile_times: layers advance it instead of sleeping."""
    now = [0.0]
    monkeypatch.setattr(profile_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def probe(
    clock: list[float], seconds: dict[int, float] | None = None
) -> tuple[nn.Module, list[int]]:
    """A layer that advances ``clock`` by ``seconds[call]`` (1 s by default) on every call,
    and the list holding its number of calls.

    The clock and the counter are closed over, not attributes: profiling runs deep copies
    of the layers, which must share them with the test.
    """
    calls = [0]
    table = dict(seconds or {})

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            calls[0] += 1
            clock[0] += table.get(calls[0], 1.0)
            return x + 1

    return Probe(), calls


@pytest.mark.parametrize("profiler", ["profile_times", "balance_by_time"])
def test_the_minimum_passes_run_with_a_zero_timeout(clock: list[float], profiler: str) -> None:
    layer, calls = probe(clock)
    model = nn.Sequential(layer, nn.Identity())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a zero timeout asks for the minimum: no warning
        if profiler == "profile_times":
            profile_times(model, torch.randn(2, 2), timeout=0)
        else:
            balance_by_time(2, model, torch.randn(2, 2), timeout=0)
    assert calls == [1 + 5]  # the warm-up pass and 5 measured passes


def test_passes_sets_the_minimum(clock: list[float]) -> None:
    layer, calls = probe(clock)
    profile_times(nn.Sequential(layer), torch.randn(2, 2), timeout=0, passes=9)
    assert calls == [1 + 9]
    layer, calls = probe(clock)
    balance_by_time(1, nn.Sequential(layer), torch.randn(2, 2), timeout=0, passes=1)
    assert calls == [1 + 1]


def test_passes_go_on_until_the_timeout(clock: list[float]) -> None:
    layer, calls = probe(clock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile_times(nn.Sequential(layer), torch.randn(2, 2), timeout=10.0)
    assert calls == [10]  # 1 s each: passes start until 10 s have passed


@pytest.mark.parametrize("profiler", ["profile_times", "balance_by_time"])
def test_warning_when_the_minimum_passes_outlast_the_timeout(
    clock: list[float], profiler: str
) -> None:
    layer, calls = probe(clock)
    model = nn.Sequential(layer)
    with pytest.warns(UserWarning, match=r"ran past the timeout") as record:
        if profiler == "profile_times":
            profile_times(model, torch.randn(2, 2), timeout=3.0)
        else:
            balance_by_time(1, model, torch.randn(2, 2), timeout=3.0)
    assert calls == [6]  # the minimum passes all ran, past the timeout
    assert len(record) == 1
    message = str(record[0].message)
    assert "timeout: 3 s" in message
    assert "passes: 5" in message
    assert "took 6 s" in message
    # The warning points at the caller's line, not at gpipe_balance.
    assert record[0].filename == __file__


@pytest.mark.parametrize("timeout", [0.0, 6.0, 6.5, 100.0])
def test_no_warning_when_the_minimum_passes_fit(clock: list[float], timeout: float) -> None:
    # The warm-up pass and the 5 minimum passes take 6 s: they fit in a timeout of 6 s or
    # more, and a zero timeout asks for them only.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile_times(nn.Sequential(probe(clock)[0]), torch.randn(2, 2), timeout=timeout)


def test_one_slow_pass_does_not_change_the_times(clock: list[float]) -> None:
    # The 3rd call (the 2nd measured pass) is 1000 times slower, as if the machine stalled.
    steady = nn.Sequential(probe(clock)[0], probe(clock)[0])
    steady_times = profile_times(steady, torch.randn(2, 2), timeout=0)
    hiccup = nn.Sequential(probe(clock)[0], probe(clock, {3: 1000.0})[0])
    assert profile_times(hiccup, torch.randn(2, 2), timeout=0) == steady_times == [1.0, 1.0]
    # Two slow passes of five are still outvoted.
    hiccups = nn.Sequential(probe(clock, {2: 50.0, 6: 70.0})[0], probe(clock)[0])
    assert profile_times(hiccups, torch.randn(2, 2), timeout=0) == [1.0, 1.0]


def test_one_slow_pass_does_not_change_the_balance(clock: list[float]) -> None:
    def model(stall: float) -> nn.Sequential:
        # Layer 0 takes ``stall`` on its 3rd call (the 2nd measured pass); layer 2 is heavy.
        costs = [{3: stall}, {}, dict.fromkeys(range(1, 7), 4.0), {}, {}]
        return nn.Sequential(*[probe(clock, seconds)[0] for seconds in costs])

    assert balance_by_time(3, model(1.0), torch.randn(2, 2), timeout=0) == [2, 1, 2]
    # With the mean, layer 0 would cost 100.8 s and get a partition of its own.
    assert balance_by_time(3, model(500.0), torch.randn(2, 2), timeout=0) == [2, 1, 2]


def test_passes_is_checked() -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.randn(2, 2)
    for bad in [0, -1, 2.5, True, "5", None]:
        with pytest.raises(
            ValueError, match=rf"passes must be a positive integer \(passes: {bad!r}"
        ):
            profile_times(model, x, timeout=0, passes=bad)  # type: ignore[arg-type]
        with pytest.raises(
            ValueError, match=rf"passes must be a positive integer \(passes: {bad!r}"
        ):
            balance_by_time(1, model, x, timeout=0, passes=bad)  # type: ignore[arg-type]


class Sleep(nn.Module):
    """A layer that really takes ``seconds`` (a sleep), forward only."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return x + 1


def test_balance_is_the_same_in_several_runs() -> None:
    # Real time on the real clock: layers of clearly different costs give one balance, run
    # after run. The only split with a largest partition near 8 ms is [3, 1, 1] (6, 6 and
    # 8 ms); the next best has 10 ms, far beyond the noise that the median leaves.
    model = nn.Sequential(*[Sleep(ms / 1000) for ms in (0, 2, 4, 6, 8)])
    sample = torch.randn(2, 2)
    balances = [balance_by_time(3, model, sample, timeout=0) for _ in range(3)]
    assert balances == [[3, 1, 1]] * 3


@pytest.mark.parametrize("profiler", ["profile_times", "balance_by_time"])
def test_the_default_timeout_never_warns(clock: list[float], profiler: str) -> None:
    # The minimum passes take 6 s, far past the default's 1 s: the default is a budget the
    # caller did not choose, so no warning (issue 24: the docs' examples warned on a CPU).
    layer, calls = probe(clock)
    model = nn.Sequential(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if profiler == "profile_times":
            profile_times(model, torch.randn(2, 2))
        else:
            balance_by_time(1, model, torch.randn(2, 2))
    assert calls == [6]


def test_the_default_timeout_measures_for_one_second(clock: list[float]) -> None:
    layer, calls = probe(clock, dict.fromkeys(range(1, 100), 0.125))
    profile_times(nn.Sequential(layer), torch.randn(2, 2))
    assert calls == [8]  # 0.125 s each: passes start until 1 s has passed
