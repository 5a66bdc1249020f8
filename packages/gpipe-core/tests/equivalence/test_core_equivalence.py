"""GPipe computes what the plain nn.Sequential computes: outputs and every gradient.

The core promise is checked as a property over random models, balances, chunk counts,
batch sizes and checkpoint modes, then on the shapes a property would rarely draw: tuples
at partition boundaries, integer tensors passing through, inputs without grad, eval
mode and ``torch.no_grad()``.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES
from core_support.strategies import compositions
from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipe
from gpipe_skip import pop, skippable, stash

KINDS = ("linear", "relu", "tanh", "layernorm", "identity", "relu_inplace")


@dataclass(frozen=True)
class Spec:
    in_width: int
    layers: tuple[tuple[str, int], ...]  # (kind, output width of a linear layer)
    balance: tuple[int, ...]
    chunks: int
    batch: int
    checkpoint: str
    input_requires_grad: bool
    seed: int


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    depth = draw(st.integers(1, 6))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=depth, max_size=depth))
    widths = draw(st.lists(st.integers(1, 6), min_size=depth, max_size=depth))
    parts = draw(st.integers(1, min(4, depth)))
    # A random composition of ``depth`` into ``parts`` positive parts.
    cuts = sorted(
        draw(st.sets(st.integers(1, depth - 1), min_size=parts - 1, max_size=parts - 1))
        if parts > 1
        else set()
    )
    bounds = [0, *cuts, depth]
    balance = tuple(b - a for a, b in itertools.pairwise(bounds))
    return Spec(
        in_width=draw(st.integers(1, 6)),
        layers=tuple(zip(kinds, widths)),
        balance=balance,
        chunks=draw(st.integers(1, 6)),
        batch=draw(st.integers(1, 12)),
        checkpoint=draw(st.sampled_from(MODES)),
        input_requires_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build(spec: Spec) -> nn.Sequential:
    """The model of ``spec``, in float64 so that the comparison can be tight."""
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = []
    width = spec.in_width
    # In place is safe (in the plain model too) only on the fresh output of a layer that
    # does not save its output for backward: not on the user's input, not after a ReLU.
    last = "input"  # the last layer that made a new tensor
    for kind, out_width in spec.layers:
        if kind == "linear":
            layers.append(nn.Linear(width, out_width))
            width = out_width
        elif kind == "relu":
            layers.append(nn.ReLU())
        elif kind == "tanh":
            layers.append(nn.Tanh())
        elif kind == "layernorm":
            layers.append(nn.LayerNorm(width))
        elif kind == "identity":
            layers.append(nn.Identity())
        elif kind == "relu_inplace":
            in_place = last in ("linear", "layernorm")
            layers.append(nn.ReLU(inplace=in_place))
            kind = "relu_inplace" if in_place else "relu"
        if kind != "identity":
            last = kind
    return nn.Sequential(*layers).double()


def assert_same_run(spec: Spec) -> None:
    model = build(spec)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, list(spec.balance), chunks=spec.chunks, checkpoint=spec.checkpoint)

    torch.manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, spec.in_width, dtype=torch.float64)
    assert_matches_plain(
        pipe, plain, x, input_requires_grad=spec.input_requires_grad, weighted=True
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(spec=specs())
def test_equivalence_with_plain_sequential(spec: Spec) -> None:
    assert_same_run(spec)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(
    ("balance", "chunks", "batch"),
    [
        ([1, 1, 1, 1], 6, 3),  # fewer samples than chunks: 3 micro-batches of 1
        ([2, 2], 4, 10),  # uneven: 3, 3, 3, 1
        ([3, 1], 5, 12),  # uneven: torch.chunk gives 3, 3, 3, 3
        ([4], 3, 7),  # one partition runs in the calling thread
        ([1, 3], 1, 5),  # one micro-batch
    ],
)
def test_equivalence_fixed_cases(
    balance: list[int],
    chunks: int,
    batch: int,
    checkpoint: str,
) -> None:
    spec = Spec(
        in_width=3,
        layers=(("linear", 5), ("tanh", 0), ("linear", 4), ("relu_inplace", 0)),
        balance=tuple(balance),
        chunks=chunks,
        batch=batch,
        checkpoint=checkpoint,
        input_requires_grad=True,
        seed=7,
    )
    assert_same_run(spec)


# -- random draws that depend on the input --------------------------------------------------


class RowDropout(nn.Module):
    """Dropout of the rows whose first feature is positive, others kept as they are: a
    micro-batch without such rows draws nothing. Records the masks of its first passes
    (in micro-batch order) or applies given masks in order."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[torch.Tensor] = []
        self.given: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.given is not None:
            return x * self.given.pop(0)
        mask = torch.ones_like(x)
        rows = x[:, 0] > 0
        if bool(rows.any()):
            mask[rows] = (torch.rand_like(x[rows]) >= 0.5).to(x.dtype) * 2
        if not is_recomputing():
            self.drawn.append(mask)
        return x * mask


@dataclass(frozen=True)
class DrawSpec:
    layers: tuple[str, ...]
    balance: tuple[int, ...]
    chunks: int
    batch: int
    checkpoint: str
    path: str  # forward(), or step() with a schedule
    seed: int


@st.composite
def draw_specs(draw: st.DrawFn) -> DrawSpec:
    depth = draw(st.integers(1, 5))
    layers = tuple(draw(st.lists(st.sampled_from(["linear", "tanh", "rows"]), min_size=depth,
                                 max_size=depth)))  # fmt: skip
    parts = draw(st.integers(1, min(3, depth)))
    return DrawSpec(
        layers=layers,
        balance=tuple(draw(st.sampled_from(compositions(depth, parts)))),
        chunks=draw(st.integers(1, 5)),
        batch=draw(st.integers(1, 10)),
        checkpoint=draw(st.sampled_from(MODES)),
        path=draw(st.sampled_from(["forward", "gpipe", "1f1b"])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=draw_specs())
def test_draws_that_depend_on_the_input_are_replayed(spec: DrawSpec) -> None:
    # The plain model, run micro-batch by micro-batch with the masks the pipeline drew in
    # its forward passes, gives the pipeline's gradients: each recomputation replayed the
    # draws of its own first pass, whichever micro-batches drew.
    torch.manual_seed(spec.seed)
    width = 3
    kinds = {"linear": lambda: nn.Linear(width, width), "tanh": nn.Tanh, "rows": RowDropout}
    model = nn.Sequential(*(kinds[kind]() for kind in spec.layers)).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, list(spec.balance), chunks=spec.chunks, checkpoint=spec.checkpoint)
    x = torch.randn(spec.batch, width, dtype=torch.float64)
    weight = torch.randn(spec.batch, width, dtype=torch.float64)
    x_pipe = x.clone().requires_grad_()
    if spec.path == "forward":
        (pipe(x_pipe) * weight).sum().backward()
    else:
        pipe.step(x_pipe, weight, lambda out, w: (out * w).sum(), schedule=spec.path,
                  reduction="sum")  # fmt: skip
    for mine, theirs in zip(plain, pipe, strict=True):
        if isinstance(mine, RowDropout):
            assert isinstance(theirs, RowDropout)
            mine.given = list(theirs.drawn)
    x_plain = x.clone().requires_grad_()
    for micro, w in zip(x_plain.chunk(spec.chunks), weight.chunk(spec.chunks), strict=True):
        (plain(micro) * w).sum().backward()
    torch.testing.assert_close(x_pipe.grad, x_plain.grad)
    for mine, theirs in zip(plain.parameters(), pipe.parameters(), strict=True):
        torch.testing.assert_close(theirs.grad, mine.grad)


def test_module_is_not_copied_so_plain_and_pipe_share_layers() -> None:
    # The equivalence tests compare against a deepcopy; this checks that GPipe uses (and
    # trains) the very layers it was given.
    torch.manual_seed(0)
    layers = [nn.Linear(3, 3), nn.Linear(3, 2)]
    pipe = GPipe(nn.Sequential(*layers), [1, 1], chunks=2)
    pipe(torch.randn(4, 3)).sum().backward()
    assert all(layer.weight.grad is not None for layer in layers)


# -- tuples at partition boundaries ---------------------------------------------------------


class Split(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.linear(x)
        return x, x * 2


class PassThrough(nn.Module):
    """Returns its input as it is (a tuple stays the same tuple of the same tensors)."""

    def forward(self, pair: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return pair


class Merge(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return self.linear(a) * torch.tanh(b)


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class MaxOfPair(nn.Module):
    """A namedtuple in, what ``torch.max(dim=1)`` returns out."""

    def forward(self, pair: Pair) -> Any:
        stacked = torch.stack([pair.a, pair.b * 2], dim=2)
        return stacked.max(dim=2)


class FromMax(nn.Module):
    """``torch.return_types.max`` in (read by name), a namedtuple out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, result: Any) -> Pair:
        return Pair(self.linear(result.values), result.indices.to(result.values.dtype))


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[1, 1, 1], [2, 1], [1, 2], [3]])
def test_tuple_subclasses_keep_their_type(balance: list[int], checkpoint: str, path: str) -> None:
    # Namedtuples and torch.return_types at the input, between partitions and at the
    # output: layers read their fields by name, and the output has the plain model's type.
    torch.manual_seed(0)
    model = nn.Sequential(MaxOfPair(), FromMax(4), MaxOfPair()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 4, dtype=torch.float64)
    value = Pair(x.clone().requires_grad_(), x.clone() * 0.5)
    plain_value = Pair(x.clone().requires_grad_(), x.clone() * 0.5)
    expected = plain(plain_value)
    if path == "forward":
        output = pipe(value)
        assert type(output) is type(expected)
        torch.testing.assert_close(output.values, expected.values)
        torch.testing.assert_close(output.indices, expected.indices)
        output.values.sum().backward()
    else:
        seen: list[type] = []

        def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
            seen.append(type(out))
            return (out.values * target).sum()

        pipe.step(value, torch.ones(7, 4, dtype=torch.float64), loss_fn, schedule=path,
                  reduction="sum")  # fmt: skip
        assert set(seen) == {type(expected)}
    expected.values.sum().backward()
    torch.testing.assert_close(value.a.grad, plain_value.a.grad)
    for mine, theirs in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, pair: Pair) -> Any:
        yield stash("a", pair.a)
        return Pair(pair.a * 2, pair.b)


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, pair: Pair) -> Any:
        a = yield pop("a")
        return Pair(pair.a + a, pair.b)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[1, 1, 1], [2, 1], [3]])
def test_a_namedtuple_through_skippable_layers(balance: list[int], checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(StashA(), ToPairOf(4), PopA()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    output, _ = assert_matches_plain(
        pipe,
        plain,
        torch.randn(7, 4, dtype=torch.float64),
        feed=lambda x: Pair(x, x * 0.5),
        loss=lambda out: out.a.sum() + out.b.sum(),
    )
    assert type(output) is Pair


class ToPairOf(nn.Module):
    """A namedtuple in and out, its fields read by name."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: Pair) -> Pair:
        return Pair(self.linear(pair.a), torch.tanh(pair.b))


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[1, 1, 1, 1], [1, 2, 1], [2, 2], [1, 3], [4]])
def test_tuple_between_partitions(balance: list[int], checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Split(4), PassThrough(), Merge(4)).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    assert_matches_plain(pipe, plain, torch.randn(7, 4, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_output_of_the_model(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Split(3), PassThrough()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 1], chunks=2, checkpoint=checkpoint)
    output, _ = assert_matches_plain(
        pipe,
        plain,
        torch.randn(5, 3, dtype=torch.float64),
        input_requires_grad=False,
        loss=lambda out: out[0].sum() + 3 * out[1].sum(),
    )
    assert isinstance(output, tuple) and len(output) == 2


class Labelled(nn.Module):
    """(labels, x) -> (labels, linear(x) scaled by the label): integers ride along."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        labels, x = pair
        assert not labels.is_floating_point()
        return labels, self.linear(x) * (labels.unsqueeze(1) + 1).to(x.dtype)


@pytest.mark.parametrize("checkpoint", MODES)
def test_integer_tensor_in_a_tuple_passes_through(checkpoint: str) -> None:
    # The integer tensor comes first, so ordering edges must pick the float one.
    torch.manual_seed(0)
    model = nn.Sequential(Labelled(3), Labelled(3), Labelled(3)).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1, 1], chunks=4, checkpoint=checkpoint)

    labels = torch.arange(10) % 3
    output, _ = assert_matches_plain(
        pipe,
        plain,
        torch.randn(10, 3, dtype=torch.float64),
        feed=lambda x: (labels, x),
        loss=lambda out: out[1].sum(),
    )
    assert isinstance(output, tuple) and len(output) == 2
    assert output[0].dtype == torch.int64
    assert torch.equal(output[0], labels)
    assert not output[0].requires_grad


# -- inputs without grad, eval mode, no_grad -------------------------------------------------


def small_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(4, 6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)
    ).double()


@pytest.mark.parametrize("checkpoint", MODES)
def test_input_without_grad_still_trains_parameters(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 2)).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 2, 1], chunks=3, checkpoint=checkpoint)
    x = torch.randn(9, 4, dtype=torch.float64)
    # The input grads stay None; the parameter grads must exist and match.
    output, _ = assert_matches_plain(
        pipe, plain, x, input_requires_grad=False, loss=lambda out: out.square().sum()
    )
    assert output.requires_grad
    assert x.grad is None


@pytest.mark.parametrize("checkpoint", MODES)
def test_eval_mode_matches_plain(checkpoint: str) -> None:
    model = small_model()
    plain = copy.deepcopy(model).eval()
    pipe = GPipe(model, [2, 2, 2], chunks=4, checkpoint=checkpoint).eval()
    assert not any(layer.training for layer in pipe)
    # Gradients still flow in eval mode (nothing is checkpointed).
    assert_matches_plain(pipe, plain, torch.randn(10, 4, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", MODES)
def test_no_grad_matches_plain(checkpoint: str) -> None:
    model = small_model()
    plain = copy.deepcopy(model).eval()
    pipe = GPipe(model, [2, 2, 2], chunks=4, checkpoint=checkpoint).eval()
    x = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        output = pipe(x)
        expected = plain(x)
    assert not output.requires_grad
    torch.testing.assert_close(output, expected)


def test_train_mode_no_grad_without_dropout_matches_plain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1, 2], chunks=3, checkpoint="always")
    x = torch.randn(8, 4, dtype=torch.float64)
    with torch.no_grad():
        output = pipe(x)
        expected = plain(x)
    assert not output.requires_grad
    torch.testing.assert_close(output, expected)


def test_inference_mode_matches_plain() -> None:
    model = small_model()
    plain = copy.deepcopy(model).eval()
    pipe = GPipe(model, [3, 3], chunks=2).eval()
    x = torch.randn(6, 4, dtype=torch.float64)
    with torch.inference_mode():
        output = pipe(x)
        expected = plain(x)
    assert output.is_inference()
    torch.testing.assert_close(output, expected)


def test_repeated_steps_train_like_plain() -> None:
    # Several optimizer steps: the pipelined model follows the plain one step by step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = model.double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 1], chunks=4, checkpoint="except_last")
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(5):
        x = torch.randn(12, 3, dtype=torch.float64)
        y = torch.randn(12, 1, dtype=torch.float64)
        for opt, net in ((opt_plain, plain), (opt_pipe, pipe)):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for p_pipe, p_plain in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p_pipe, p_plain)


# -- less common ways to use the output -------------------------------------------------------


def pipe_and_plain(checkpoint: str, balance: list[int] | None = None) -> tuple[GPipe, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Identity(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)
    ).double()
    plain = copy.deepcopy(model)
    return GPipe(model, balance or [2, 1, 3], chunks=3, checkpoint=checkpoint), plain


def assert_same_grads(pipe: GPipe, plain: nn.Module) -> None:
    for p_pipe, p_plain in zip(pipe.parameters(), plain.parameters()):
        assert p_pipe.grad is not None
        torch.testing.assert_close(p_pipe.grad, p_plain.grad)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("used", [0, 1])
def test_loss_on_one_element_of_a_tuple_output(used: int, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Split(3), nn.Identity(), PassThrough()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1, 2], chunks=3, checkpoint=checkpoint)
    assert_matches_plain(
        pipe, plain, torch.randn(6, 3, dtype=torch.float64), loss=lambda out: out[used].sum()
    )


class ConstantFirst(nn.Module):
    """x -> (a constant float tensor without grad, linear(x)): the first float needs no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones_like(x).detach(), self.linear(x)


class UseBoth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        constant, h = pair
        return self.linear(h) + constant


@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_whose_first_float_tensor_needs_no_grad(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), ConstantFirst(), PassThrough(), UseBoth()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1, 1, 1], chunks=4, checkpoint=checkpoint)
    assert_matches_plain(pipe, plain, torch.randn(8, 3, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", MODES)
def test_partition_that_returns_its_input(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Identity(), nn.Identity(), nn.Linear(3, 3))
    model = model.double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 2, 1], chunks=2, checkpoint=checkpoint)
    assert_matches_plain(pipe, plain, torch.randn(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", MODES)
def test_input_that_is_not_a_leaf(checkpoint: str) -> None:
    pipe, plain = pipe_and_plain(checkpoint)
    leaf = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    pipe((leaf * 3)[:, :]).sum().backward()
    grad = leaf.grad.clone()
    leaf.grad = None
    plain(leaf * 3).sum().backward()
    torch.testing.assert_close(grad, leaf.grad)
    assert_same_grads(pipe, plain)


@pytest.mark.parametrize("checkpoint", MODES)
def test_two_forward_passes_one_backward(checkpoint: str) -> None:
    pipe, plain = pipe_and_plain(checkpoint)
    a = torch.randn(6, 4, dtype=torch.float64)
    b = torch.randn(5, 4, dtype=torch.float64)
    (pipe(a).sum() + pipe(b).square().sum()).backward()
    (plain(a).sum() + plain(b).square().sum()).backward()
    assert_same_grads(pipe, plain)


@pytest.mark.parametrize("checkpoint", MODES)
def test_backward_twice_with_retain_graph(checkpoint: str) -> None:
    pipe, plain = pipe_and_plain(checkpoint)
    x = torch.randn(6, 4, dtype=torch.float64)
    for net in (pipe, plain):
        loss = net(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_same_grads(pipe, plain)


def test_autograd_grad_without_checkpointing_matches_plain() -> None:
    pipe, plain = pipe_and_plain("never")
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    got = torch.autograd.grad(pipe(x).sum(), [x, *pipe.parameters()])
    want = torch.autograd.grad(plain(x).sum(), [x, *plain.parameters()])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("checkpoint", MODES)
def test_autograd_grad_through_checkpoints_toward_the_input(checkpoint: str) -> None:
    # More of torch.autograd.grad and backward(inputs=...) in test_core_autograd_api.py.
    pipe, plain = pipe_and_plain(checkpoint)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    (got,) = torch.autograd.grad(pipe(x).sum(), x)
    (expected,) = torch.autograd.grad(plain(x).sum(), x)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_parameter_free_model_requires_grad_like_plain(
    checkpoint: str, requires_grad: bool
) -> None:
    model = nn.Sequential(nn.ReLU(), nn.Tanh(), nn.Identity())
    pipe = GPipe(model, [1, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 3, requires_grad=requires_grad)
    output = pipe(x)
    assert output.requires_grad == requires_grad
    torch.testing.assert_close(output, model(x))
    if requires_grad:
        output.sum().backward()
        expected = (1 - torch.tanh(x.detach().relu()) ** 2) * (x.detach() > 0)
        torch.testing.assert_close(x.grad, expected)
