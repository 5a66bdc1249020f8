"""Random draws replayed exactly, whoever recomputes: dropout in layers under torch's
checkpoint (reentrant or not) and in layers without, under gpipe's checkpointing or none, on
every schedule and placement, through ``step()`` and through ``forward()`` and autograd's
backward pass.

Each :class:`~core_support.models.Redraws` layer records the dropout mask of each sample at
every pass: a recomputation (gpipe's or torch's, in the backward pass) must draw its first
pass's masks. The plain model, given those first masks, must then compute the pipeline's
loss and gradients: the gradients are those of the loss returned. Every action counts as
long, so that the workers compute at the same time (tiny layers would take turns).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.models import (
    MODES,
    PLANS,
    REDRAWS,
    assert_replayed,
    placed,
    redrawn,
    redraws_model,
    replay_into,
)
from core_support.strategies import compositions
from core_support.turns import measured_long
from gpipe_core import GPipe

WIDTH = 4
BATCH = 8


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    hows = draw(st.lists(st.sampled_from(REDRAWS), min_size=3, max_size=5))
    schedule, placement = draw(st.sampled_from(PLANS))
    return {
        "hows": hows,
        "schedule": schedule,
        "placement": placement,
        "balance": draw(st.sampled_from(compositions(len(hows) + 1, 4))),
        # Interleaved 1F1B on two partitions per worker wants an even count, or at most 2.
        "chunks": draw(st.sampled_from([1, 2, 4])),
        "checkpoint": draw(st.sampled_from(MODES)),
        "seed": draw(st.integers(0, 2**16)),
    }


def assert_grads_equal(pipe: nn.Module, plain: nn.Module) -> None:
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def check(model: nn.Module, hows: list[str | None], checkpoint: str) -> None:
    """The recomputations drew their first passes' masks, and dropout did draw."""
    recomputed = assert_replayed(model)
    if checkpoint == "always" or any(hows):
        assert recomputed > 0
    masks = [m for layer in redrawn(model) for ms in layer.masks.values() for m in ms]
    assert any(not bool(m.all()) for m in masks)


def step_matches_replay(
    pipe: GPipe, model: nn.Module, plain: nn.Module, schedule: str, checkpoint: str
) -> None:
    """One step of ``pipe`` (over ``model``) on new data, the workers overlapping: its
    recomputations drew their first masks, and ``plain`` given those masks computes its
    loss and gradients (then every gradient is cleared)."""
    x = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    y = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    measured_long(pipe)  # the workers overlap, as with larger layers
    losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    check(model, [layer.how for layer in redrawn(model)], checkpoint)
    replay_into(plain, model)
    loss = nn.MSELoss()(plain(x), y)
    loss.backward()
    torch.testing.assert_close(losses.reduced(), loss.detach())
    assert_grads_equal(pipe, plain)
    for p in [*pipe.parameters(), *plain.parameters()]:
        p.grad = None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), switched=st.integers(0, 4))
def test_step_replays_every_draw(case: dict, switched: int) -> None:
    """Three steps; before the second, Redraws layer ``switched`` (if there is one) starts
    or stops checkpointing itself, which the pipeline has not seen."""
    hows = case["hows"]
    model = redraws_model(WIDTH, hows, case["seed"])
    plain = copy.deepcopy(model)
    pipe = GPipe(
        model,
        case["balance"],
        chunks=case["chunks"],
        checkpoint=case["checkpoint"],
        **placed(case["placement"]),
    )
    for step in range(3):
        if step == 1 and switched < len(hows):
            for layers in (model, plain):
                layer = redrawn(layers)[switched]
                layer.how = None if layer.how else "non-reentrant"
        step_matches_replay(pipe, model, plain, case["schedule"], case["checkpoint"])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_forward_and_backward_replay_every_draw(case: dict) -> None:
    hows = case["hows"]
    model = redraws_model(WIDTH, hows, case["seed"])
    plain = copy.deepcopy(model)
    pipe = GPipe(model, case["balance"], chunks=case["chunks"], checkpoint=case["checkpoint"])
    for _ in range(2):
        x = torch.randn(BATCH, WIDTH, dtype=torch.float64)
        measured_long(pipe)
        output = pipe(x)
        output.square().sum().backward()
        check(model, hows, case["checkpoint"])
        replay_into(plain, model)
        expected = plain(x)
        expected.square().sum().backward()
        torch.testing.assert_close(output.detach(), expected.detach())
        assert_grads_equal(pipe, plain)
        for p in [*pipe.parameters(), *plain.parameters()]:
            p.grad = None


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_a_layer_that_starts_checkpointing_itself_is_seen(how: str) -> None:
    """The first steps teach the pipeline that no layer checkpoints itself; then one layer
    starts (its switch, an attribute, changes): its recomputations still draw its first
    passes' masks."""
    model = redraws_model(WIDTH, [None] * 7, seed=0)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2, 2], chunks=4, checkpoint="never")
    for step in range(6):
        if step == 2:
            for layers in (model, plain):
                redrawn(layers)[3].how = how
        step_matches_replay(pipe, model, plain, "1f1b", "never")
        assert assert_replayed(model) > 0 or step < 2
