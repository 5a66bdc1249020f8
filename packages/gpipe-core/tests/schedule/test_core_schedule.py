"""Schedules as data: their action lists, checks, simulation, grids and errors.

No model runs here except at the end, where a custom schedule drives ``GPipe.step``.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.models import MODES
from gpipe_core import (
    Action,
    GPipe,
    GPipeSchedule,
    OneFOneBSchedule,
    Schedule,
    ScheduleError,
    check_actions,
    get_schedule,
    place_partitions,
    schedules,
    simulate,
)

NAMES = ("gpipe", "1f1b")


def F(i: int) -> Action:
    return Action("forward", i)


def B(i: int) -> Action:
    return Action("backward", i)


def in_flight_peak(actions: list[Action]) -> int:
    """The most micro-batches whose forward pass ran and backward pass did not, at once."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "forward" else -1
        peak = max(peak, live)
    return peak


sizes = st.tuples(st.integers(1, 12), st.integers(1, 6))


@settings(max_examples=60, deadline=None)
@given(sizes=sizes, name=st.sampled_from(NAMES))
def test_action_lists_are_valid(sizes: tuple[int, int], name: str) -> None:
    m, n = sizes
    schedule = get_schedule(name)
    lists = schedule.actions(m, n)
    assert len(lists) == n
    check_actions(lists, m)
    expected = {F(i) for i in range(m)} | {B(i) for i in range(m)}
    for actions in lists:
        assert len(actions) == 2 * m
        assert set(actions) == expected
        for i in range(m):
            assert actions.index(F(i)) < actions.index(B(i))
        # Forward passes run in micro-batch order on every partition.
        assert [a.microbatch for a in actions if a.kind == "forward"] == list(range(m))


@settings(max_examples=60, deadline=None)
@given(sizes=sizes)
def test_one_f_one_b_bounds_the_micro_batches_in_flight(sizes: tuple[int, int]) -> None:
    m, n = sizes
    for j, actions in enumerate(OneFOneBSchedule().actions(m, n)):
        assert in_flight_peak(actions) == min(n - j, m)
    for actions in GPipeSchedule().actions(m, n):
        assert in_flight_peak(actions) == m


@settings(max_examples=60, deadline=None)
@given(sizes=sizes, name=st.sampled_from(NAMES))
def test_simulated_time_is_fill_drain_time(sizes: tuple[int, int], name: str) -> None:
    m, n = sizes
    rows = simulate(get_schedule(name).actions(m, n))
    assert len(rows) == n
    assert {len(row) for row in rows} == {2 * (m + n - 1)}
    for row, actions in zip(rows, get_schedule(name).actions(m, n)):
        assert [a for a in row if a is not None] == actions
    # Nothing runs before what it depends on has finished in an earlier unit.
    when = {(j, a): t for j, row in enumerate(rows) for t, a in enumerate(row) if a is not None}
    for (j, action), t in when.items():
        i = action.microbatch
        if action.kind == "forward" and j > 0:
            assert when[(j - 1, F(i))] < t
        if action.kind == "backward":
            assert when[(j, F(i))] < t
            if j < n - 1:
                assert when[(j + 1, B(i))] < t


@settings(max_examples=40, deadline=None)
@given(sizes=sizes, name=st.sampled_from(NAMES))
def test_forward_only_keeps_the_order(sizes: tuple[int, int], name: str) -> None:
    m, n = sizes
    schedule = get_schedule(name)
    full = schedule.actions(m, n)
    forward = schedule.forward_only(m, n)
    assert forward == [[a for a in actions if a.kind == "forward"] for actions in full]
    check_actions(forward, m, backward=False)
    with pytest.raises(ScheduleError):
        check_actions(forward, m)


def test_grids_of_a_small_case() -> None:
    assert get_schedule("gpipe").grid(3, 2) == (
        "p0: F0 F1 F2 .  .  B2 B1 B0\np1: .  F0 F1 F2 B2 B1 B0 ."
    )
    assert get_schedule("1f1b").grid(3, 2) == (
        "p0: F0 F1 .  B0 F2 B1 .  B2\np1: .  F0 B0 F1 B1 F2 B2 ."
    )
    # Two-digit micro-batches widen every column.
    assert GPipeSchedule().grid(11, 1).split()[:3] == ["p0:", "F0", "F1"]
    assert "F10 B10" in GPipeSchedule().grid(11, 1)


def test_named_schedules() -> None:
    assert schedules() == ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv"]
    assert isinstance(get_schedule("gpipe"), GPipeSchedule)
    assert isinstance(get_schedule("1f1b"), OneFOneBSchedule)
    custom = OneFOneBSchedule()
    assert get_schedule(custom) is custom
    assert repr(custom) == "OneFOneBSchedule()"
    assert str(B(3)) == "B3" and repr(F(0)) == "Action('forward', 0)"


def test_unknown_name_and_wrong_type() -> None:
    with pytest.raises(
        ValueError, match=r"schedule must be one of \['1f1b', 'gpipe', .*'zbv'\].*'zb'"
    ):
        get_schedule("zb")
    with pytest.raises(TypeError, match=r"schedule must be .*\(schedule: int\)"):
        get_schedule(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not a class; call it \(schedule: GPipeSchedule\)"):
        get_schedule(GPipeSchedule)  # type: ignore[arg-type]  # the class, not an instance


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("m", "n", "argument"),
    [
        (0, 2, "microbatches"),
        (2, 0, "partitions"),
        (-1, 1, "microbatches"),
        (True, 2, "microbatches"),
        (2.0, 2, "microbatches"),
    ],
)
def test_bad_sizes(name: str, m: object, n: object, argument: str) -> None:
    with pytest.raises(ValueError, match=rf"{argument} must be a positive integer \({argument}: "):
        get_schedule(name).actions(m, n)  # type: ignore[arg-type]


def test_missing_action() -> None:
    with pytest.raises(ScheduleError, match=r"partition 1 .*missing: \['B1'\]"):
        check_actions([[F(0), F(1), B(1), B(0)], [F(0), F(1), B(0)]], 2)


def test_repeated_action() -> None:
    with pytest.raises(ScheduleError, match=r"partition 0 .*repeated: \['F0'\]"):
        check_actions([[F(0), F(0), B(0)]], 1)


def test_unexpected_action() -> None:
    with pytest.raises(ScheduleError, match=r"unexpected or repeated: \['F2'\]"):
        check_actions([[F(0), F(1), F(2), B(0), B(1)]], 2)


def test_backward_before_forward() -> None:
    with pytest.raises(ScheduleError, match=r"partition 1 runs B0 before F0"):
        check_actions([[F(0), B(0)], [B(0), F(0)]], 1)


def test_deadlock() -> None:
    # Partition 0 waits for B1 from partition 1 before it sends F1; partition 1 needs F1
    # before it can run B1. Each list alone is a valid order.
    lists = [[F(0), B(1), F(1), B(0)], [F(0), F(1), B(1), B(0)]]
    with pytest.raises(ScheduleError, match=r"partition 0 runs B1 before F1"):
        check_actions(lists, 2)
    # Same with forward passes in a crossing order: p1 wants F1 first, p0 sends F1 only
    # after B0, which waits for p1's B0, which needs p1's F0, after F1.
    lists = [[F(0), B(0), F(1), B(1)], [F(1), F(0), B(0), B(1)]]
    with pytest.raises(ScheduleError, match=r"deadlock.*'p0': 'B0'.*'p1': 'F1'"):
        check_actions(lists, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(lists)


def test_schedule_error_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


class ReverseBackward(Schedule):
    """Every forward pass, then every backward pass in forward order (not GPipe's reverse)."""

    name = "reverse-backward"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        order = [F(i) for i in range(microbatches)] + [B(i) for i in range(microbatches)]
        return [list(order) for _ in range(partitions)]


class Broken(Schedule):
    name = "broken"

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        return [[F(i) for i in range(microbatches)] for _ in range(partitions)]


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2)
    ).double()


@pytest.mark.parametrize("checkpoint", MODES)
def test_custom_schedule_runs_through_step(checkpoint: str) -> None:
    plain = model()
    pipe = GPipe(copy.deepcopy(plain), [2, 2, 1], chunks=4, checkpoint=checkpoint)
    x = torch.randn(10, 3, dtype=torch.float64)
    y = torch.randn(10, 2, dtype=torch.float64)
    schedule = ReverseBackward()
    assert schedule.grid(2, 2) == "p0: F0 F1 .  .  B0 B1\np1: .  F0 F1 B0 B1 ."

    losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    expected = nn.MSELoss()(plain(x), y)
    expected.backward()
    torch.testing.assert_close(losses.reduced(), expected.detach())
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad)


def test_broken_custom_schedule_is_refused_before_running() -> None:
    pipe = GPipe(model(), [2, 3], chunks=2)
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(ScheduleError, match=r"partition 0 .*missing: \['B0', 'B1'\]"):
        pipe.step(x, y, nn.MSELoss(), schedule=Broken())
    assert all(p.grad is None for p in pipe.parameters())
    # The model still works.
    pipe.step(x, y, nn.MSELoss())
    assert all(p.grad is not None for p in pipe.parameters())


class Listed(Schedule):
    """A schedule made of given action lists."""

    name = "listed"

    def __init__(self, lists: list[list[Action]]) -> None:
        self.lists = lists

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        assert (microbatches, partitions) == (len(self.lists[0]) // 2, len(self.lists))
        return [list(actions) for actions in self.lists]


def random_lists(rng: random.Random, m: int, n: int) -> list[list[Action]] | None:
    """Random orders for each partition, each backward after its forward; None: deadlock."""
    lists = []
    for _ in range(n):
        forwards = rng.sample(range(m), m)
        order: list[Action] = []
        ready: list[int] = []
        while forwards or ready:
            if ready and (not forwards or rng.random() < 0.5):
                order.append(B(ready.pop(rng.randrange(len(ready)))))
            else:
                i = forwards.pop(0)
                order.append(F(i))
                ready.append(i)
        lists.append(order)
    try:
        check_actions(lists, m)
    except ScheduleError:
        return None
    return lists


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 5),
    n=st.integers(1, 4),
    checkpoint=st.sampled_from(MODES),
    rng=st.randoms(use_true_random=False),
)
def test_any_valid_action_lists_run_through_step(
    m: int, n: int, checkpoint: str, rng: random.Random
) -> None:
    for _ in range(1000):
        lists = random_lists(rng, m, n)
        if lists is not None:
            break
    else:
        lists = GPipeSchedule().actions(m, n)
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(3, 3) if k % 2 == 0 else nn.Tanh() for k in range(2 * n)]
    plain = nn.Sequential(*layers).double()
    pipe = GPipe(copy.deepcopy(plain), [2] * n, chunks=m, checkpoint=checkpoint)
    x = torch.randn(2 * m, 3, dtype=torch.float64)
    y = torch.randn(2 * m, 3, dtype=torch.float64)
    losses = pipe.step(x, y, nn.MSELoss(reduction="sum"), schedule=Listed(lists))
    expected = nn.MSELoss(reduction="sum")(plain(x), y)
    expected.backward()
    torch.testing.assert_close(losses.reduced(), expected.detach())
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize(
    ("name", "placement"),
    [("gpipe", None), ("1f1b", None), ("interleaved-1f1b", "loop"), ("zbv", "v")],
)
def test_serial_order_runs_simulate_column_by_column(name: str, placement: str | None) -> None:
    """A run in one thread takes the actions column by column of the simulation, the
    workers in order; the order is cached for the built-in (tuple) lists and computed
    alike for lists."""
    from gpipe_core.run._order import serial_order
    from gpipe_core.schedule._schedules import step_actions

    m, n, workers = 4, 4, 2
    where = place_partitions(placement, n, workers) if placement else list(range(n))
    lists = step_actions(get_schedule(name), m, n, True, where)
    rows = simulate(lists, placement=where)
    expected = [
        row[column]
        for column in range(max(len(row) for row in rows))
        for row in rows
        if column < len(row) and row[column] is not None
    ]
    assert list(serial_order(lists, where)) == expected
    assert serial_order(lists, where) is serial_order(lists, tuple(where))  # cached
    as_lists = [list(row) for row in lists]
    assert list(serial_order(as_lists, where)) == expected
    assert len(expected) == sum(len(row) for row in lists)
