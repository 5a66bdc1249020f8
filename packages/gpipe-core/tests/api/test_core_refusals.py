"""Inputs that used to hang, train nothing or fail deep inside torch get clear errors.

Custom schedules returning the wrong number or kind of lists, arguments of the wrong type,
a loss without autograd history, an output without a batch dimension, and an in-place
change of a step's input: each is refused with an error that names what was wrong and the
value seen, and the model works afterwards. Errors raised inside a layer say where.
"""

from __future__ import annotations

import copy
import re
import sys
import threading
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_core import Action, GPipe, GPipeSchedule, Schedule, ScheduleError

TIMEOUT = 60.0


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


class Returns(Schedule):
    """A schedule whose action lists are whatever it is given."""

    name = "returns"

    def __init__(self, lists: Any) -> None:
        self.lists = lists

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        return self.lists(microbatches, partitions)  # type: ignore[no-any-return]


def one_list(m: int, n: int) -> Any:
    return GPipeSchedule().actions(m, n)[:1]


def three_lists(m: int, n: int) -> Any:
    return GPipeSchedule().actions(m, n) * 2


def generators(m: int, n: int) -> Any:
    return [iter(actions) for actions in GPipeSchedule().actions(m, n)]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(
    ("lists", "message"),
    [
        (one_list, r"one per partition \(schedule .* returned 1 lists for 2 partitions\)"),
        (three_lists, r"one per partition \(schedule .* returned 4 lists for 2 partitions\)"),
        (lambda m, n: None, r"one list of actions per partition \(schedule .*: NoneType\)"),
        (generators, r"the action list of partition 0 must be a list of Action"),
        (lambda m, n: [["F0"], ["F0"]], r"list of Action \(schedule .*: list holding \['str'\]"),
    ],
)
def test_custom_schedule_with_bad_lists_is_refused(lists: Any, message: str, train: bool) -> None:
    pipe = GPipe(model(), [2, 1], chunks=2)
    pipe.train(train)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss(), schedule=Returns(lists))
        except BaseException as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the step waits forever"
    assert isinstance(outcome[0], ScheduleError)
    assert outcome[0] is not None
    assert re.search(message, str(outcome[0])), str(outcome[0])
    pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss())  # still usable


def test_deferred_batch_norm_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"deferred_batch_norm must be True or False .*'yes'"):
        GPipe(model(), [2, 1], deferred_batch_norm="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("balance", [{2: 1, 1: 0}, {1, 2}])
def test_balance_without_an_order_is_refused(balance: Any) -> None:
    with pytest.raises(ValueError, match=r"balance must be a list of layer counts"):
        GPipe(model(), balance)


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda output, target: (output - target).pow(2).mean().detach(),
        lambda output, target: torch.tensor(1.0),
        lambda output, target: (output > target).sum(),
    ],
)
def test_a_loss_without_autograd_history_is_refused_with_grad_mode(loss_fn: Any) -> None:
    pipe = GPipe(model(), [2, 1], chunks=2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"loss_fn must return a loss with autograd history"):
        pipe.step(x, y, loss_fn, reduction="mean")
    # In eval mode the step computes gradients too (as autograd does): refused alike.
    pipe.eval()
    with pytest.raises(ValueError, match=r"loss_fn must return a loss with autograd history"):
        pipe.step(x, y, loss_fn, reduction="mean")
    # Without grad mode there is nothing to differentiate: the losses are returned.
    with torch.no_grad():
        assert len(pipe.step(x, y, loss_fn, reduction="mean")) == 2


def test_an_output_without_a_batch_dimension_names_the_partition() -> None:
    class Total(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), Total()), [1, 1], chunks=2)
    with pytest.raises(ValueError, match=r"output of partition 1 must have a batch dimension"):
        pipe(torch.randn(4, 4))


class Boom(Exception):
    pass


class Explodes(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise Boom("no")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
@pytest.mark.parametrize("path", ["forward", "step"])
def test_an_error_in_a_layer_says_where_it_came_from(path: str) -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), Explodes()), [1, 1], chunks=2)
    with pytest.raises(Boom) as excinfo:
        if path == "forward":
            pipe(torch.randn(4, 4))
        else:
            pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    assert type(excinfo.value) is Boom
    notes = getattr(excinfo.value, "__notes__", [])
    assert notes == ["(in forward of micro-batch 0 on partition 1)"]


class HalveLargeRows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        large = x.mean(dim=1) > 1
        if bool(large.any()):
            x[large] *= 0.5
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_refuses_an_in_place_change_of_its_input_as_forward_does(schedule: str) -> None:
    # Micro-batch 0 leaves partition 1's input alone, micro-batch 1 changes it in place:
    # the step's partitions start at leaves of their own graph, which autograd cannot
    # change in place.
    plain = nn.Sequential(nn.Linear(4, 4), HalveLargeRows(), nn.Linear(4, 2))
    with torch.no_grad():
        plain[0].weight.copy_(torch.eye(4))
        plain[0].bias.zero_()
    pipe = GPipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint="never")
    x = torch.cat([torch.zeros(2, 4), torch.full((2, 4), 3.0)])
    with pytest.raises(RuntimeError, match=r"partition 1 modified its input in place"):
        pipe.step(x, torch.randn(4, 2), nn.MSELoss(), schedule=schedule)
    pipe.zero_grad()
    small = torch.zeros(4, 4)
    pipe.step(small, torch.randn(4, 2), nn.MSELoss())  # still usable
