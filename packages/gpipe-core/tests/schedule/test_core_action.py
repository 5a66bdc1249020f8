"""Actions and their kinds: one enum (Phase) with the timeline, the short names still
accepted, and the printed form read back by Action.parse."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpipe_core import (
    Action,
    GPipeSchedule,
    Phase,
    get_schedule,
    place_partitions,
    schedules,
    simulate,
    theoretical_bubble,
)

ACTION_KINDS = [Phase.FORWARD, Phase.BACKWARD, Phase.INPUT_GRADIENT, Phase.WEIGHT_GRADIENT]
SHORT_NAMES = ["forward", "backward", "input", "weight"]

actions = st.builds(
    Action,
    st.sampled_from(ACTION_KINDS + SHORT_NAMES + [k.value for k in ACTION_KINDS]),
    st.integers(0, 10**6),
    st.none() | st.integers(0, 10**6),
)


# -- the enum -------------------------------------------------------------------------------


def test_the_action_kinds_are_phases_with_letters() -> None:
    assert [p for p in Phase if p.is_action] == ACTION_KINDS
    assert [p.letter for p in ACTION_KINDS] == ["F", "B", "I", "W"]
    assert [p.letter for p in Phase if not p.is_action] == ["", "", ""]
    # The values a timeline prints are unchanged.
    assert [p.value for p in ACTION_KINDS] == [
        "forward",
        "backward",
        "input-gradient",
        "weight-gradient",
    ]


def test_the_short_names_are_aliases() -> None:
    assert Phase("input") is Phase.INPUT_GRADIENT
    assert Phase("weight") is Phase.WEIGHT_GRADIENT
    assert Phase("input-gradient") is Phase.INPUT_GRADIENT
    assert Phase("forward") is Phase.FORWARD
    assert Phase.FORWARD == "forward" and str(Phase.WEIGHT_GRADIENT) == "weight-gradient"
    with pytest.raises(ValueError):
        Phase("F")
    with pytest.raises(ValueError):
        Phase("sideways")


@pytest.mark.parametrize(
    ("given", "member"),
    [
        ("forward", Phase.FORWARD),
        ("backward", Phase.BACKWARD),
        ("input", Phase.INPUT_GRADIENT),
        ("weight", Phase.WEIGHT_GRADIENT),
        ("input-gradient", Phase.INPUT_GRADIENT),
        ("weight-gradient", Phase.WEIGHT_GRADIENT),
        (Phase.INPUT_GRADIENT, Phase.INPUT_GRADIENT),
    ],
)
def test_action_takes_a_short_name_a_value_or_a_member(given: str, member: Phase) -> None:
    action = Action(given, 2, 1)
    assert action.kind is member
    assert action == Action(member, 2, 1)
    assert hash(action) == hash(Action(member, 2, 1))


def test_str_and_repr_are_unchanged() -> None:
    assert [str(Action(kind, 3)) for kind in SHORT_NAMES] == ["F3", "B3", "I3", "W3"]
    assert str(Action("input", 1, 2)) == "2I1"
    assert repr(Action(Phase.WEIGHT_GRADIENT, 0)) == "Action('weight', 0)"
    assert repr(Action("input-gradient", 1, 2)) == "Action('input', 1, 2)"


@pytest.mark.parametrize("kind", ["recompute", "copy", "loss", Phase.COPY, "F", "sideways", 3])
def test_action_refuses_other_kinds(kind: object) -> None:
    with pytest.raises(ValueError, match=r"an action's kind must be one of .*kind: "):
        Action(kind, 0)  # type: ignore[arg-type]


def test_actions_replace_and_pickle() -> None:
    action = Action("input", 4, 1)
    moved = dataclasses.replace(action, partition=None)
    assert moved == Action(Phase.INPUT_GRADIENT, 4) and moved.kind is Phase.INPUT_GRADIENT
    assert pickle.loads(pickle.dumps(action)) == action
    with pytest.raises(dataclasses.FrozenInstanceError):
        action.microbatch = 5  # type: ignore[misc]


@pytest.mark.parametrize("name", schedules())
def test_the_built_in_schedules_hold_members(name: str) -> None:
    placement = {"interleaved-1f1b": "loop", "zbv": "v"}.get(name)
    where = place_partitions(placement, 4, 2) if placement else None
    for row in get_schedule(name).worker_actions(4, 4, where):
        assert all(type(a.kind) is Phase and a.kind.is_action for a in row)


# -- parse ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("F3", Action("forward", 3)),
        ("2B0", Action("backward", 0, 2)),
        ("1I2", Action("input", 2, 1)),
        ("W0", Action("weight", 0)),
        ("0F10", Action("forward", 10, 0)),
        ("12W345", Action("weight", 345, 12)),
    ],
)
def test_parse_reads_what_str_prints(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text


@given(actions)
def test_parse_inverts_str(action: Action) -> None:
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    "text",
    ["", "F", "3", "3F", "X3", "f3", "F-1", "-1F0", " F3", "F3 ", "2 F3", "F03", "02F3", "R0",
     "F3F", "FB3", "F\uff13", "F3.0"],
)  # fmt: skip
def test_parse_names_the_text_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match=r"an action must read as printed") as raised:
        Action.parse(text)
    assert f"(text: {text!r})" in str(raised.value)


def test_parse_refuses_what_is_not_text() -> None:
    with pytest.raises(ValueError, match=r"\(text: 3\)"):
        Action.parse(3)  # type: ignore[arg-type]


# -- durations and the bubble ---------------------------------------------------------------


def test_durations_take_members_and_values_too() -> None:
    lists = get_schedule("zb-h1").actions(3, 2)
    short = simulate(lists, {"forward": 2, "input": 3, "weight": 1})
    assert simulate(lists, {Phase.FORWARD: 2, "input-gradient": 3, Phase.WEIGHT_GRADIENT: 1}) == (
        short
    )
    with pytest.raises(ValueError, match=r"durations must map action kinds"):
        simulate(lists, {"recompute": 1})


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16, 33])
def test_theoretical_bubble_is_the_fill_drain_schedules(n: int, m: int) -> None:
    assert theoretical_bubble(n, m) == GPipeSchedule().bubble(m, n) == (n - 1) / (m + n - 1)


def test_theoretical_bubble_refuses_sizes_that_are_not_positive() -> None:
    with pytest.raises(ValueError, match=r"microbatches must be a positive integer"):
        theoretical_bubble(2, 0)


# -- worker_count ---------------------------------------------------------------------------


def test_worker_count_and_its_former_name() -> None:
    assert place_partitions("loop", 4, worker_count=2) == place_partitions("loop", 4, workers=2)
    assert place_partitions("v", 4, 2) == [0, 1, 1, 0]
    schedule = get_schedule("interleaved-1f1b")
    assert schedule.grid(2, 4, placement="loop", worker_count=2) == schedule.grid(
        2, 4, placement="loop", workers=2
    )
    assert schedule.bubble(4, 4, placement="loop", worker_count=2) == schedule.bubble(
        4, 4, placement="loop", workers=2
    )
    with pytest.raises(TypeError, match=r"give the number of workers once"):
        place_partitions("loop", 4, 2, workers=2)
