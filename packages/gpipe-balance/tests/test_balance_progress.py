"""The progress bar: on only at a terminal by default, after a delay, with or without tqdm."""

from __future__ import annotations

import io
import sys
import types

import pytest
import torch
from torch import nn

import gpipe_balance._profile as profile_module
from gpipe_balance import profile_sizes
from gpipe_balance._progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_by_default_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress("work", 3, unit="layer", delay=0, stream=out) as bar:
        assert not bar.enabled
        bar.update(3)
    assert out.getvalue() == ""


def test_on_by_default_at_a_terminal() -> None:
    out = Terminal()
    with Progress("work", 3, unit="layer", delay=0, stream=out) as bar:
        assert bar.enabled
        bar.update(2)
    assert "work" in out.getvalue()


def test_not_drawn_before_the_delay() -> None:
    out = Terminal()
    with Progress("work", 3, unit="layer", delay=3600, stream=out) as bar:
        bar.update(3)
    assert out.getvalue() == ""


def test_forced_off_at_a_terminal() -> None:
    out = Terminal()
    with Progress("work", 3, unit="layer", enabled=False, delay=0, stream=out) as bar:
        bar.update(3)
    assert out.getvalue() == ""


def test_fallback_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    out = io.StringIO()
    with Progress("work", 4, unit="layer", enabled=True, delay=0, stream=out) as bar:
        bar.update(1)
        bar.update(9)  # clamped to the total
    assert out.getvalue() == "\rwork: 1/4 layer\rwork: 4/4 layer\n"
    out = io.StringIO()
    with Progress("time", 1.0, unit="s", enabled=True, delay=0, stream=out) as bar:
        bar.update(0.25)
    assert out.getvalue() == "\rtime: 0.2/1.0 s\n"


def test_with_tqdm() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    with Progress("work", 4, unit="layer", enabled=True, delay=0, stream=out) as bar:
        bar.update(2)
        bar.update(4)
    assert "work" in out.getvalue() and "4/4" in out.getvalue()


def test_profilers_pass_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool | None] = []
    original = profile_module.Progress

    def spy(*args: object, **kwargs: object) -> Progress:
        seen.append(kwargs["enabled"])  # type: ignore[arg-type]
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profile_module, "Progress", spy)
    model = nn.Sequential(nn.Linear(2, 2))
    profile_sizes(model, torch.randn(2, 2))
    profile_sizes(model, torch.randn(2, 2), progress=True)
    profile_module.profile_times(model, torch.randn(2, 2), timeout=0, progress=False)
    assert seen == [None, True, False]


@pytest.mark.parametrize(
    ("seconds_per_layer", "timeout"),
    [(1.0, 1.0), (0.1, 10.0), (0.5, 0.0)],
    ids=["slow passes", "long timeout", "no timeout"],
)
@pytest.mark.filterwarnings("ignore:profiling ran past the timeout")
def test_time_bar_is_full_only_at_the_end(
    monkeypatch: pytest.MonkeyPatch, seconds_per_layer: float, timeout: float
) -> None:
    # A fake clock: every layer takes seconds_per_layer, whatever the machine does.
    clock = [0.0]
    monkeypatch.setattr(
        profile_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0])
    )

    class Tick(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock[0] += seconds_per_layer
            return x + 1

    fractions: list[float] = []

    class Spy(Progress):
        def update(self, position: float) -> None:
            super().update(position)
            fractions.append(self.position / self.total if self.total else 1.0)

    monkeypatch.setattr(profile_module, "Progress", Spy)
    profile_module.profile_times(
        nn.Sequential(Tick(), Tick(), Tick()), torch.randn(2, 2), timeout=timeout, progress=False
    )
    # The warm-up pass and at least 5 measured passes, until the timeout: the bar moves
    # forward and is full only when profiling is done, however long the passes take.
    assert len(fractions) >= 6
    assert fractions[0] < 0.5
    assert fractions == sorted(fractions)
    assert fractions[-1] == 1
    assert all(fraction < 1 for fraction in fractions[:-1])
