"""The decode run (``GPipe.decode``): lanes with a cache each, round after round, equal to
the plain model run lane by lane with the same cache, for any balance, number of lanes,
placement and way of running (one turn, or the workers at once); lanes that stop at
different rounds; errors that leave the pipeline usable.

The model is a plain ``nn.Sequential`` of the docs' kind: :class:`Cached` layers keep every
input they have seen in their lane's state (:func:`gpipe_core.lane_state`) and mix the
current one with the mean of the past, as an attention layer's cache does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.strategies import compositions
from core_support.turns import measured_long, measured_short
from gpipe_core import DecodeSchedule, GPipe, Lanes, lane_state

WIDTH = 3


class Cached(nn.Module):
    """Mixes its input with the mean of every input its lane has seen (the cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = lane_state(self)
        assert state is not None, "a Cached layer runs in a lane"
        past = state.get("cache")
        cache = x[:, None] if past is None else torch.cat([past, x[:, None]], dim=1)
        state["cache"] = cache
        return x + self.mix(cache.mean(dim=1))


def model(layers: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    kinds = [Cached() if k % 2 == 0 else nn.Tanh() for k in range(layers)]
    return nn.Sequential(*kinds)


class Feedback:
    """Each lane's next input is its output scaled, until the lane's round ``stops[lane]``;
    records every output by lane and round."""

    def __init__(self, stops: list[int]) -> None:
        self.stops = stops
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, lane: int, round: int, output: torch.Tensor) -> torch.Tensor | None:
        self.outputs[lane, round] = output.clone()
        return None if round + 1 >= self.stops[lane] else output * 0.5


def plain_outputs(
    plain: nn.Sequential, x: torch.Tensor, lanes: int, rounds: int, stops: list[int]
) -> dict[tuple[int, int], torch.Tensor]:
    """The plain model run lane by lane, round by round, as a decode run does."""
    feedback, store = Feedback(stops), Lanes()
    for lane, value in enumerate(x.chunk(lanes)):
        inputs: torch.Tensor | None = value
        for round in range(rounds):
            if inputs is None:
                break
            with store.lane(lane), torch.no_grad():
                output = plain(inputs)
            inputs = feedback(lane, round, output)
    return feedback.outputs


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(2, 6),
    chunks=st.integers(1, 4),
    rounds=st.integers(1, 5),
    parts=st.integers(1, 4),
    way=st.sampled_from(["one turn", "workers"]),
    data=st.data(),
)
def test_decode_matches_the_plain_model_lane_by_lane(
    layers: int, chunks: int, rounds: int, parts: int, way: str, data: st.DataObject
) -> None:
    parts = min(parts, layers)
    balance = data.draw(st.sampled_from(compositions(layers, parts)))
    stops = data.draw(st.lists(st.integers(1, rounds), min_size=chunks, max_size=chunks))
    plain = model(layers, seed=layers)
    pipe = GPipe(copy.deepcopy(plain), balance, chunks=chunks)
    (measured_short if way == "one turn" else measured_long)(pipe)
    x = torch.randn(2 * chunks, WIDTH, dtype=torch.float64)
    feedback = Feedback(stops)
    pipe.decode(x, feedback=feedback, rounds=rounds)
    expected = plain_outputs(plain, x, chunks, rounds, stops)
    assert feedback.outputs.keys() == expected.keys()
    for key, output in expected.items():
        torch.testing.assert_close(feedback.outputs[key], output, rtol=0, atol=0)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_decode_with_several_partitions_per_worker(placement: str) -> None:
    plain = model(4, seed=1)
    pipe = GPipe(
        copy.deepcopy(plain), [1, 1, 1, 1], chunks=3, devices=["cpu", "cpu"], placement=placement
    )
    x = torch.randn(6, WIDTH, dtype=torch.float64)
    feedback = Feedback([4, 2, 3])
    pipe.decode(x, feedback=feedback, rounds=4)
    expected = plain_outputs(plain, x, 3, 4, [4, 2, 3])
    assert feedback.outputs.keys() == expected.keys()
    for key, output in expected.items():
        torch.testing.assert_close(feedback.outputs[key], output, rtol=0, atol=0)


def test_a_stopped_lane_computes_nothing() -> None:
    calls: list[int] = []

    class Counting(Cached):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return super().forward(x)

    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(Counting(), Counting()), [1, 1], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    # Lane 0 stops after its first round, lane 1 after its fifth.
    pipe.decode(x, feedback=Feedback([1, 5]), rounds=5)
    assert len(calls) == 2 * (1 + 5)


def test_the_lanes_states_are_dropped_and_the_pipeline_runs_on() -> None:
    plain = model(4, seed=2)
    pipe = GPipe(copy.deepcopy(plain), [2, 2], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)

    def failing(lane: int, round: int, output: torch.Tensor) -> torch.Tensor:
        if round == 2:
            raise ValueError("the feedback failed")
        return output

    with pytest.raises(ValueError, match="the feedback failed") as info:
        pipe.decode(x, feedback=failing, rounds=4)
    assert "in the feedback of lane" in "".join(getattr(info.value, "__notes__", []))
    # A second decode starts with empty caches: equal to the plain model's from scratch.
    feedback = Feedback([3, 3])
    pipe.decode(x, feedback=feedback, rounds=3)
    expected = plain_outputs(plain, x, 2, 3, [3, 3])
    for key, output in expected.items():
        torch.testing.assert_close(feedback.outputs[key], output, rtol=0, atol=0)


def test_decode_refuses_bad_arguments_before_running() -> None:
    pipe = GPipe(model(2, seed=0), [1, 1], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rounds must be a positive integer \(rounds: 0\)"):
        pipe.decode(x, feedback=Feedback([1, 1]), rounds=0)
    with pytest.raises(TypeError, match=r"feedback must be a callable .*\(feedback: int\)"):
        pipe.decode(x, feedback=3, rounds=2)  # type: ignore[arg-type]


def test_a_feedback_in_another_form_is_refused() -> None:
    pipe = GPipe(model(2, seed=0), [1, 1], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"first round's form: 1 positional inputs"):
        pipe.decode(x, feedback=lambda lane, round, out: {"x": out}, rounds=2)


def test_the_decode_schedule_is_data() -> None:
    schedule = DecodeSchedule()
    lists = schedule.worker_actions(lanes=2, rounds=3, partitions=2)
    assert [str(action) for action in lists[1]] == [f"1F{k}" for k in range(6)]
    # Fewer lanes than partitions: each round waits for the last partition.
    assert schedule.bubble(lanes=1, rounds=4, partitions=3) > schedule.bubble(
        lanes=3, rounds=4, partitions=3
    )
    assert schedule.grid(lanes=3, rounds=2, partitions=3).splitlines()[0] == (
        "p0: F0 F1 F2 F3 F4 F5 .  ."
    )


def test_the_timeline_records_every_lane_and_round() -> None:
    pipe = GPipe(model(4, seed=3), [2, 2], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    with pipe.trace() as timeline:
        pipe.decode(x, feedback=Feedback([3, 2]), rounds=3)
    forwards = {
        (event.partition, event.microbatch) for event in timeline.events if event.phase == "forward"
    }
    # Micro-batch k is lane k % 2 in round k // 2; lane 1 stopped after its second round
    # (micro-batch 3), so micro-batch 5 computed nothing.
    assert forwards == {(j, k) for j in range(2) for k in (0, 1, 2, 3, 4)}


@pytest.mark.parametrize("fails", [False, True])
def test_the_caches_are_freed_when_decode_returns_or_raises(fails: bool) -> None:
    import weakref

    caches: list[weakref.ref[torch.Tensor]] = []

    class Watched(Cached):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            output = super().forward(x)
            state = lane_state(self)
            assert state is not None
            caches.append(weakref.ref(state["cache"]))
            return output

    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(Watched(), nn.Tanh(), Watched()), [2, 1], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)

    def feedback(lane: int, round: int, output: torch.Tensor) -> torch.Tensor:
        if fails and round == 2:
            raise ValueError("stop here")
        return output

    if fails:
        with pytest.raises(ValueError, match="stop here"):
            pipe.decode(x, feedback=feedback, rounds=4)
    else:
        pipe.decode(x, feedback=feedback, rounds=4)
    assert caches and all(ref() is None for ref in caches)
