"""GPipe.step gives the losses and gradients of ``loss_fn(plain(input), target).backward()``.

Random models, balances, chunk counts, checkpoint modes, schedules and loss reductions are
drawn by Hypothesis and compared in float64 with the plain ``nn.Sequential``; then tuples
and integer tensors between partitions, accumulation over steps, deferred batch norm, skip
connections (U-Net, a ``None`` skip, a long skip), dropout under checkpointing, a GPipe
nested in a partition, and models with layers under ``torch.utils.checkpoint``, batch norms
and hooks on activations on every schedule (the zero-bubble ones included).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from core_support.models import (
    MODES,
    PLANS,
    MaybePop,
    MaybeStash,
    TrainableScale,
    placed,
    unet_layers,
)
from core_support.strategies import compositions
from core_support.turns import measured_short
from gpipe_bn import DeferredBatchNorm
from gpipe_core import GPipe, Losses
from gpipe_skip import current_skip_tracker, pop, skippable, stash

SCHEDULES = ("gpipe", "1f1b")
WIDTH = 4
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def mse_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def mse_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().sum()


# (loss_fn, the reduction argument given to step)
LOSSES: dict[str, tuple[Callable[[Any, Any], torch.Tensor], str | None]] = {
    "MSELoss()": (nn.MSELoss(), None),
    "MSELoss(sum)": (nn.MSELoss(reduction="sum"), None),
    "function mean": (mse_mean, "mean"),
    "function sum": (mse_sum, "sum"),
}
RANDOM_LOSSES = tuple(LOSSES)


def zero_grads(*modules: nn.Module) -> None:
    for module in modules:
        for p in module.parameters():
            p.grad = None


def assert_same_grads(pipe: nn.Module, plain: nn.Module) -> None:
    pipe_params = list(pipe.named_parameters())
    plain_params = list(plain.parameters())
    assert len(pipe_params) == len(plain_params)
    for (name, p), q in zip(pipe_params, plain_params, strict=True):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def assert_step_matches(
    pipe: GPipe,
    plain: nn.Module,
    x: Any,
    y: Any,
    loss: str = "MSELoss()",
    *,
    schedule: str = "gpipe",
    input_requires_grad: bool = True,
) -> Losses:
    """Step ``pipe`` and backward ``plain`` on clones of ``x``; compare losses and grads."""
    zero_grads(pipe, plain)
    loss_fn, reduction = LOSSES[loss]

    def clone(value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(clone(v) for v in value)
        copied = value.detach().clone()
        return copied.requires_grad_(input_requires_grad and copied.is_floating_point())

    x_pipe, x_plain = clone(x), clone(x)
    losses = pipe.step(x_pipe, y, loss_fn, schedule=schedule, reduction=reduction)  # type: ignore[arg-type]
    expected = loss_fn(plain(x_plain), y)
    expected.backward()

    assert isinstance(losses, Losses)
    assert losses.reduction == (reduction or loss_fn.reduction)  # type: ignore[union-attr]
    assert sum(losses.sizes) == len(x[0] if isinstance(x, tuple) else x)
    assert all(not loss.requires_grad and loss.dim() == 0 for loss in losses)
    torch.testing.assert_close(losses.reduced(), expected.detach())
    assert_same_grads(pipe, plain)
    for got, want in zip(
        x_pipe if isinstance(x_pipe, tuple) else (x_pipe,),
        x_plain if isinstance(x_plain, tuple) else (x_plain,),
        strict=True,
    ):
        if want.grad is None:
            assert got.grad is None
        else:
            assert got.grad is not None
            torch.testing.assert_close(got.grad, want.grad)
    return losses


# -- random sequential models ------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    layers: tuple[str, ...]
    balance: tuple[int, ...]
    chunks: int
    batch: int
    checkpoint: str
    schedule: str
    loss: str
    input_requires_grad: bool
    seed: int


def build(layers: tuple[str, ...], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    made: list[nn.Module] = []
    for kind in layers:
        if kind == "linear":
            made.append(nn.Linear(WIDTH, WIDTH))
        elif kind == "tanh":
            made.append(nn.Tanh())
        elif kind == "relu":
            made.append(nn.ReLU())
        elif kind == "relu_":
            made.append(nn.ReLU(inplace=True))
        else:
            made.append(nn.LayerNorm(WIDTH))
    made.append(nn.Linear(WIDTH, 2))
    return nn.Sequential(*made).double()


@st.composite
def layer_kinds(draw: st.DrawFn) -> tuple[str, ...]:
    count = draw(st.integers(1, 6))
    kinds: list[str] = []
    for _ in range(count):
        kind = draw(st.sampled_from(["linear", "tanh", "relu", "layernorm", "relu_"]))
        if kind == "relu_":
            # In place after a linear layer: the linear's output is not needed for backward.
            kinds += ["linear", "relu_"]
        else:
            kinds.append(kind)
    return tuple(kinds)


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    layers = draw(layer_kinds())
    total = len(layers) + 1
    parts = draw(st.integers(1, min(4, total)))
    return Spec(
        layers=layers,
        balance=tuple(draw(st.sampled_from(compositions(total, parts)))),
        chunks=draw(st.integers(1, 6)),
        batch=draw(st.integers(1, 12)),
        checkpoint=draw(st.sampled_from(MODES)),
        schedule=draw(st.sampled_from(SCHEDULES)),
        loss=draw(st.sampled_from(RANDOM_LOSSES)),
        input_requires_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@SETTINGS
@given(spec=specs())
def test_random_models_match_plain(spec: Spec) -> None:
    model = build(spec.layers, spec.seed)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, list(spec.balance), chunks=spec.chunks, checkpoint=spec.checkpoint)
    x = torch.randn(spec.batch, WIDTH, dtype=torch.float64)
    y = torch.randn(spec.batch, 2, dtype=torch.float64)
    losses = assert_step_matches(
        pipe,
        plain,
        x,
        y,
        spec.loss,
        schedule=spec.schedule,
        input_requires_grad=spec.input_requires_grad,
    )
    # Each loss is its micro-batch's.
    loss_fn = LOSSES[spec.loss][0]
    with torch.no_grad():
        parts = zip(x.split(losses.sizes), y.split(losses.sizes), strict=True)
        for loss, (xi, yi) in zip(losses, parts, strict=True):
            torch.testing.assert_close(loss, loss_fn(plain(xi), yi))


def in_one_turn(pipe: GPipe) -> set[int]:
    """Make ``pipe``'s runs one turn (every action measured short: the calling thread runs
    them all, ``LocalTransport.one_turn``); the threads that run its last layer's forward
    passes are added to the set returned."""
    measured_short(pipe)
    threads: set[int] = set()
    last = pipe[len(pipe) - 1]
    last.register_forward_pre_hook(lambda *_: threads.add(threading.get_ident()))
    return threads


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs())
def test_random_models_match_plain_in_one_turn(spec: Spec) -> None:
    """The same, the run one turn: every action measured short, the calling thread runs
    them all (``LocalTransport.one_turn``)."""
    model = build(spec.layers, spec.seed)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, list(spec.balance), chunks=spec.chunks, checkpoint=spec.checkpoint)
    threads = in_one_turn(pipe)
    x = torch.randn(spec.batch, WIDTH, dtype=torch.float64)
    y = torch.randn(spec.batch, 2, dtype=torch.float64)
    assert_step_matches(
        pipe,
        plain,
        x,
        y,
        spec.loss,
        schedule=spec.schedule,
        input_requires_grad=spec.input_requires_grad,
    )
    assert threads == {threading.get_ident()}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_in_place_first_layer_of_every_partition(checkpoint: str, schedule: str) -> None:
    layers = ("linear", "relu_", "linear", "relu_", "linear", "relu_")
    model = build(layers, 0)
    plain = copy.deepcopy(model)
    # Each partition starts with an in-place ReLU modifying what it received.
    pipe = GPipe(model, [1, 2, 2, 2], chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    y = torch.randn(7, 2, dtype=torch.float64)
    assert_step_matches(pipe, plain, x, y, schedule=schedule)


@pytest.mark.parametrize("input_requires_grad", [False, True])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_in_place_first_layer_on_the_step_input(
    checkpoint: str, schedule: str, chunks: int, input_requires_grad: bool
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True), nn.Linear(WIDTH, 2)
    ).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 3], chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    for _ in range(2):  # the second step learns afresh
        zero_grads(pipe, plain)
        x_pipe = x.clone().requires_grad_(input_requires_grad)
        x_plain = x.clone().requires_grad_(input_requires_grad)
        # ``x * 1`` is not a leaf: the plain model may modify it in place too.
        losses = pipe.step(x_pipe * 1, y, nn.MSELoss(), schedule=schedule)
        expected = nn.MSELoss()(plain(x_plain * 1), y)
        expected.backward()
        torch.testing.assert_close(losses.reduced(), expected.detach())
        assert_same_grads(pipe, plain)
        if input_requires_grad:
            torch.testing.assert_close(x_pipe.grad, x_plain.grad)


def test_gradients_accumulate_over_steps() -> None:
    model = build(("linear", "tanh", "linear"), 1)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2], chunks=3)
    data = [
        (torch.randn(6, WIDTH, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64))
        for _ in range(2)
    ]
    for (x, y), schedule in zip(data, SCHEDULES, strict=True):
        pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        nn.MSELoss()(plain(x), y).backward()
    assert_same_grads(pipe, plain)
    # Not just doubled: the second step added its own gradient.
    zero_grads(plain)
    nn.MSELoss()(plain(data[0][0]), data[0][1]).backward()
    first = [p.grad.clone() for p in plain.parameters()]  # type: ignore[union-attr]
    assert any(
        not torch.allclose(p.grad, g)  # type: ignore[arg-type]
        for p, g in zip(pipe.parameters(), first, strict=True)
    )


def test_input_grad_accumulates_like_plain() -> None:
    model = build(("linear", "tanh"), 2)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 2], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    x_pipe, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    # The input goes through another op first: its grad reaches the caller's graph.
    for _ in range(2):
        pipe.step(x_pipe * 2, y, nn.MSELoss())
        nn.MSELoss()(plain(x_plain * 2), y).backward()
    torch.testing.assert_close(x_pipe.grad, x_plain.grad)


def test_target_requiring_grad_gets_its_gradient() -> None:
    model = build(("linear",), 3)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1], chunks=3)
    x = torch.randn(6, WIDTH, dtype=torch.float64)
    y_pipe = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    y_plain = y_pipe.detach().clone().requires_grad_()
    pipe.step(x, y_pipe, nn.MSELoss(), schedule="1f1b")
    nn.MSELoss()(plain(x), y_plain).backward()
    torch.testing.assert_close(y_pipe.grad, y_plain.grad)


# -- tuples and integer tensors ----------------------------------------------------------


class PairLinear(nn.Module):
    """``(x, ids) -> (tanh(linear(x)) + ids / 10, ids)``: integer ids pass through."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, ids = pair
        assert not ids.is_floating_point()
        return torch.tanh(self.linear(x)) + ids.unsqueeze(1) / 10, ids


class Widen(nn.Module):
    """``(x, ids) -> (x, x * 2, ids + 1)``: a partition boundary with three tensors."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, ids = pair
        return x, x * 2, ids + 1


class Narrow(nn.Module):
    def forward(self, triple: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b, ids = triple
        return a * b, ids


def pair_loss(output: tuple[torch.Tensor, ...], target: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, ids = output
    y, weight = target
    return ((x - y).square().sum(1) * weight + ids.to(x.dtype)).mean()


LOSSES["pair"] = (pair_loss, "mean")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[1, 1, 1, 1], [2, 2], [1, 3], [4]])
def test_tuples_and_integer_tensors(balance: list[int], checkpoint: str, schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(PairLinear(), Widen(), Narrow(), PairLinear()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    x = (torch.randn(7, WIDTH, dtype=torch.float64), torch.arange(7))
    y = (torch.randn(7, WIDTH, dtype=torch.float64), torch.rand(7, dtype=torch.float64))
    assert_step_matches(pipe, plain, x, y, "pair", schedule=schedule)


# -- deferred batch norm -----------------------------------------------------------------


def bn_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, WIDTH),
        nn.Tanh(),
        nn.BatchNorm1d(WIDTH, momentum=0.3),
        nn.Linear(WIDTH, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, 2),
    ).double()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chunks=st.integers(1, 4),
    per_chunk=st.integers(2, 3),
    balance=st.sampled_from([[6], [3, 3], [2, 1, 3], [1, 2, 2, 1]]),
    checkpoint=st.sampled_from(MODES),
    schedule=st.sampled_from(SCHEDULES),
    seed=st.integers(0, 2**16),
)
def test_deferred_batch_norm(
    chunks: int, per_chunk: int, balance: list[int], checkpoint: str, schedule: str, seed: int
) -> None:
    model = bn_model(seed)
    whole = copy.deepcopy(model)  # running statistics: the whole mini-batch at once
    per_micro = copy.deepcopy(model)  # gradients: each micro-batch normalized on its own
    pipe = GPipe(model, balance, chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True)
    batch = chunks * per_chunk
    for _ in range(2):
        x = torch.randn(batch, 3, dtype=torch.float64) * 3 + 1
        y = torch.randn(batch, 2, dtype=torch.float64)
        zero_grads(pipe, per_micro)
        losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        with torch.no_grad():
            whole(x)
        expected = []
        for xi, yi in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            loss = nn.MSELoss()(per_micro(xi), yi)
            (loss * len(xi) / batch).backward()
            expected.append(loss.detach())
        torch.testing.assert_close(list(losses), expected)
        assert_same_grads(pipe, per_micro)
        norms = [m for m in pipe.modules() if isinstance(m, DeferredBatchNorm)]
        assert len(norms) == 1
        reference = whole[2]
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(norms[0], name), getattr(reference, name))
        assert int(norms[0].num_batches_tracked) == int(reference.num_batches_tracked)


# -- skips ---------------------------------------------------------------------------------


@skippable(stash=["long"])
class LongStash(nn.Module):
    def forward(self, x):
        yield stash("long", x)
        return x


@skippable(pop=["long"])
class LongPop(nn.Module):
    def forward(self, x):
        return x - (yield pop("long"))


def unet(depth: int, active: bool, seed: int) -> nn.Sequential:
    """A long skip around a ``None``-able skip around ``depth`` encoder/decoder pairs."""
    torch.manual_seed(seed)
    return nn.Sequential(
        LongStash(),
        MaybeStash(active),
        *unet_layers(depth, WIDTH),
        MaybePop(),
        LongPop(),
        nn.Linear(WIDTH, 2),
    ).double()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_skips_match_plain(data: st.DataObject) -> None:
    depth = data.draw(st.integers(1, 2), label="depth")
    layers = 2 * depth + 6
    parts = data.draw(st.integers(1, 5), label="partitions")
    balance = data.draw(st.sampled_from(compositions(layers, parts)), label="balance")
    chunks = data.draw(st.integers(1, 4), label="chunks")
    batch = data.draw(st.integers(1, 8), label="batch")
    checkpoint = data.draw(st.sampled_from(MODES), label="checkpoint")
    schedule = data.draw(st.sampled_from(SCHEDULES), label="schedule")
    active = data.draw(st.booleans(), label="active")
    input_requires_grad = data.draw(st.booleans(), label="input_requires_grad")
    model = unet(depth, active, data.draw(st.integers(0, 2**16), label="seed"))
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=chunks, checkpoint=checkpoint)
    one_turn = data.draw(st.booleans(), label="one turn")
    threads = in_one_turn(pipe) if one_turn else None
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    y = torch.randn(batch, 2, dtype=torch.float64)
    assert_step_matches(
        pipe, plain, x, y, schedule=schedule, input_requires_grad=input_requires_grad
    )
    assert len(current_skip_tracker()) == 0
    assert threads is None or threads == {threading.get_ident()}


@pytest.mark.parametrize("active", [True, False])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_long_skip_over_five_partitions(checkpoint: str, schedule: str, active: bool) -> None:
    # LongStash alone on partition 0, LongPop on partition 4: the skip crosses 4 boundaries.
    model = unet(1, active, 0)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 2, 2, 1, 2], chunks=4, checkpoint=checkpoint)
    routes = {route.key[1]: route for route in pipe.skip_layout.routes}
    assert (routes["long"].stash_partition, routes["long"].pop_partition) == (0, 4)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    assert_step_matches(pipe, plain, x, y, "MSELoss(sum)", schedule=schedule)


# -- dropout under checkpointing, nested pipelines -----------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropout_recomputation_replays_the_draws(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5), nn.Linear(WIDTH, WIDTH), nn.Tanh()
    ).double()
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = torch.randn(8, WIDTH, dtype=torch.float64)
    grads = {}
    for checkpoint in ("always", "never"):
        pipe = GPipe(copy.deepcopy(model), [2, 2], chunks=4, checkpoint=checkpoint)
        torch.manual_seed(1)
        losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        grads[checkpoint] = (losses.reduced(), [p.grad for p in pipe.parameters()])
    torch.testing.assert_close(grads["always"], grads["never"])
    # Dropout did draw: without it the gradients differ.
    pipe = GPipe(copy.deepcopy(model).eval(), [2, 2], chunks=4)
    pipe.train()
    pipe[1].eval()  # the dropout
    pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    first = next(iter(pipe.parameters()))
    assert first.grad is not None
    assert not torch.allclose(first.grad, grads["never"][1][0])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_nested_pipeline_in_a_partition(checkpoint: str, schedule: str) -> None:
    torch.manual_seed(0)
    inner_layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), TrainableScale()).double()
    outer_first = nn.Linear(WIDTH, WIDTH).double()
    outer_last = nn.Linear(WIDTH, 2).double()
    plain = nn.Sequential(
        copy.deepcopy(outer_first), copy.deepcopy(inner_layers), copy.deepcopy(outer_last)
    )
    inner = GPipe(inner_layers, [2, 1], chunks=2, checkpoint=checkpoint)
    pipe = GPipe(
        nn.Sequential(outer_first, inner, outer_last), [1, 2], chunks=3, checkpoint=checkpoint
    )
    x = torch.randn(9, WIDTH, dtype=torch.float64)
    y = torch.randn(9, 2, dtype=torch.float64)
    assert_step_matches(pipe, plain, x, y, schedule=schedule)


# -- skips and deferred batch norm together --------------------------------------------------


def unet_with_batch_norm(seed: int) -> nn.Sequential:
    """A long skip around a U-Net whose first layers normalize with a batch norm.

    The batch norm sees ``linear(x)``: its statistics do not depend on the split.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        LongStash(),
        nn.Linear(WIDTH, WIDTH),
        nn.BatchNorm1d(WIDTH, momentum=0.2),
        *unet_layers(2, WIDTH, bottleneck=nn.Tanh()),
        LongPop(),
        nn.Linear(WIDTH, 2),
    ).double()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    balance=st.sampled_from(compositions(10, 3) + compositions(10, 5)),
    chunks=st.integers(1, 4),
    checkpoint=st.sampled_from(MODES),
    schedule=st.sampled_from(SCHEDULES),
    seed=st.integers(0, 2**16),
)
def test_skips_with_deferred_batch_norm(
    balance: list[int], chunks: int, checkpoint: str, schedule: str, seed: int
) -> None:
    model = unet_with_batch_norm(seed)
    whole, per_micro = copy.deepcopy(model), copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True)
    batch = 2 * chunks
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    y = torch.randn(batch, 2, dtype=torch.float64)
    losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    with torch.no_grad():
        whole(x)
    for xi, yi in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
        (nn.MSELoss()(per_micro(xi), yi) * len(xi) / batch).backward()
    assert len(losses) == chunks
    assert_same_grads(pipe, per_micro)
    (norm,) = [m for m in pipe.modules() if isinstance(m, DeferredBatchNorm)]
    torch.testing.assert_close(norm.running_mean, whole[2].running_mean)
    torch.testing.assert_close(norm.running_var, whole[2].running_var)
    assert int(norm.num_batches_tracked) == 1
    assert len(current_skip_tracker()) == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_deferred_batch_norm_without_grad_counts_one_mini_batch(schedule: str) -> None:
    model = bn_model(0)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [3, 3], chunks=4, checkpoint="always", deferred_batch_norm=True)
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    with torch.no_grad():
        pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        plain(x)
    (norm,) = [m for m in pipe.modules() if isinstance(m, DeferredBatchNorm)]
    torch.testing.assert_close(norm.running_mean, plain[2].running_mean)
    torch.testing.assert_close(norm.running_var, plain[2].running_var)
    assert int(norm.num_batches_tracked) == 1
    assert all(p.grad is None for p in pipe.parameters())


# -- torch checkpoints, batch norm and hooks on activations, under every schedule ---------


class TorchCheckpointed(nn.Module):
    """A linear layer, a batch norm (cumulative running statistics: ``momentum=None``) and
    an operation on a parameter alone, under a non-reentrant ``torch.utils.checkpoint``;
    ``calls`` counts the region's forward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH, momentum=None)
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def region(t: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return torch.tanh(self.norm(self.linear(t))) * self.scale.square()

        return cast(torch.Tensor, torch_checkpoint(region, x, use_reentrant=False))


class Hooked(nn.Module):
    """A linear layer whose output has a hook (counting its calls in ``calls``) and
    retains its gradient (those outputs are in ``kept``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(self.count)
            y.retain_grad()
            self.kept.append(y)
        return y

    def count(self, grad: torch.Tensor) -> None:
        self.calls += 1


def fingerprint(grad: torch.Tensor) -> float:
    """A number that tells gradients apart: their elements weighted unevenly."""
    weights = torch.linspace(0.3, 1.7, grad.numel(), dtype=grad.dtype) ** 3
    return float((grad.flatten() * weights).sum())


def build_observed(layers: tuple[str, ...], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    made: list[nn.Module] = []
    for kind in layers:
        if kind == "torch_checkpoint":
            made.append(TorchCheckpointed())
        elif kind == "batchnorm":
            made.append(nn.BatchNorm1d(WIDTH, momentum=None))
        elif kind == "hooked":
            made.append(Hooked())
        elif kind == "linear":
            made.append(nn.Linear(WIDTH, WIDTH))
        else:
            made.append(nn.Tanh())
    made.append(nn.Linear(WIDTH, 2))
    return nn.Sequential(*made).double()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_checkpoints_batch_norm_and_hooks_match_plain_on_every_schedule(
    data: st.DataObject,
) -> None:
    """Random models with layers under ``torch.utils.checkpoint`` (a batch norm inside),
    batch norms and hooks on activations, on every schedule: the losses, gradients and
    running statistics of the plain model run on each micro-batch (once more without
    gradients for those the pipeline checkpoints, as its checkpoint's forward pass), the
    region's forward passes and the hooks' calls counted alike, the retained gradients
    the same. A split schedule recomputes a region once per micro-batch and calls each
    hook once, as one backward pass does."""
    kinds = ["torch_checkpoint", "batchnorm", "hooked", "linear", "tanh"]
    layers = tuple(data.draw(st.lists(st.sampled_from(kinds), min_size=3, max_size=6)))
    name, placement = data.draw(st.sampled_from(PLANS), label="plan")
    total = len(layers) + 1
    parts = 4 if placement else data.draw(st.integers(1, min(4, total)), label="partitions")
    balance = data.draw(st.sampled_from(compositions(total, parts)), label="balance")
    chunks = data.draw(st.sampled_from([1, 2, 4]), label="chunks")
    checkpoint = data.draw(st.sampled_from(MODES), label="checkpoint")
    plain = build_observed(layers, data.draw(st.integers(0, 2**16), label="seed"))
    model = copy.deepcopy(plain)
    pipe = GPipe(model, balance, chunks=chunks, checkpoint=checkpoint, **placed(placement))  # type: ignore[arg-type]
    if data.draw(st.booleans(), label="one turn"):
        measured_short(pipe)
    batch = chunks * data.draw(st.integers(2, 3), label="per micro-batch")
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    y = torch.randn(batch, 2, dtype=torch.float64)
    x_pipe, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    losses = pipe.step(x_pipe, y, nn.MSELoss(), schedule=name)
    stop = {"always": len(losses), "except_last": len(losses) - 1, "never": 0}[checkpoint]
    parts_x = x_plain.split(losses.sizes)
    for i, (xi, yi) in enumerate(zip(parts_x, y.split(losses.sizes), strict=True)):
        if i < stop:
            with torch.no_grad():
                plain(xi)
        loss = nn.MSELoss()(plain(xi), yi)
        (loss * len(xi) / batch).backward()
        torch.testing.assert_close(losses[i], loss.detach())
    assert_same_grads(pipe, plain)
    torch.testing.assert_close(x_pipe.grad, x_plain.grad)
    for got, want in zip(model.modules(), plain.modules(), strict=True):
        if isinstance(got, nn.BatchNorm1d):
            assert int(got.num_batches_tracked) == int(want.num_batches_tracked)
            torch.testing.assert_close(got.running_mean, want.running_mean)
            torch.testing.assert_close(got.running_var, want.running_var)
        if isinstance(got, TorchCheckpointed | Hooked):
            assert got.calls == want.calls
        if isinstance(got, Hooked):
            # Each micro-batch's output, in the order the schedule ran them: the same
            # gradients, as sets (ordered by a weighted sum: the outputs may be all alike
            # after a batch norm of two samples, and a batch norm's gradients sum to 0).
            assert len(got.kept) == len(want.kept) == len(losses)
            grads = [
                sorted((t.grad for t in kept if t.grad is not None), key=fingerprint)
                for kept in (got.kept, want.kept)
            ]
            assert len(grads[0]) == len(grads[1]) == len(losses)
            for mine, theirs in zip(*grads, strict=True):
                torch.testing.assert_close(mine, theirs)
