"""The backward pass split into the input gradient and the weight gradient.

``input_gradient`` then the ``WeightGradient`` it returns give what one backward pass gives
(hypothesis over random graphs: layers of their own, tied weights, branches of parameters
only, outputs of parameters only, custom functions with and without parameters (tied to
another layer's too), in-place operations, hooks that change an activation's or a
parameter's gradient, layers under a non-reentrant ``torch.utils.checkpoint``, hooks and
``retain_grad()`` on activations, inputs with and without gradients), and the weight
gradient does not run the input path again: a custom function's backward on it is called
once per micro-batch, in a step as well; each hook on an activation runs once, and a
checkpointed region is recomputed once, as in one backward pass.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from core_support.models import count_and_retain
from gpipe_core import GPipe
from gpipe_core.run._split_backward import SplitBackward, WeightGradient

WIDTH = 3


class Counted(torch.autograd.Function):
    """The identity, counting its backward calls (in ``Counted.calls``)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        Counted.calls += 1
        return grad


class CustomLinear(torch.autograd.Function):
    """``x @ w.T`` as a custom function (its backward returns both gradients at once)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        CustomLinear.calls += 1
        x, w = ctx.saved_tensors
        return grad @ w, grad.T @ x


class Block(nn.Module):
    """One of the graphs' pieces (see :data:`KINDS`), ``shared`` holding a tied weight."""

    def __init__(self, kind: str, shared: nn.Linear) -> None:
        super().__init__()
        self.kind = kind
        self.linear = shared if kind in ("tied", "custom-tied") else nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.randn(WIDTH))
        #: The forward passes of a checkpointed region; the calls of the hook on an
        #: activation, and the activations that retain their gradient.
        self.calls = 0
        self.hooked = 0
        self.kept: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        kind = self.kind
        if kind in ("linear", "tied"):
            return torch.tanh(self.linear(x))
        if kind == "branch":  # a branch of parameters only joins the input path
            return x * self.scale.square() + self.linear.bias.exp()
        if kind == "counted":
            return Counted.apply(x)  # type: ignore[no-any-return]
        if kind in ("custom", "custom-tied", "custom-hooked"):
            return CustomLinear.apply(x, self.linear.weight)  # type: ignore[no-any-return]
        if kind == "hooked":  # a hook on an activation changes its gradient
            y = self.linear(x)
            if y.requires_grad:
                y.register_hook(lambda grad: grad * 2)
            return torch.tanh(y)
        if kind == "in-place":
            y = self.linear(x)
            y.mul_(self.scale)
            return y
        if kind == "checkpointed":  # the parameters' side has an operation of its own

            def region(t: Tensor) -> Tensor:
                self.calls += 1
                return torch.tanh(self.linear(t)) * self.scale.square()

            return torch_checkpoint(region, x, use_reentrant=False)  # type: ignore[no-any-return]
        if kind == "retained":  # a hook that counts, and retain_grad(), on an activation
            y = self.linear(x)
            count_and_retain(y, self.count, self.kept)
            return torch.tanh(y)
        raise AssertionError(kind)

    def count(self, grad: Tensor) -> None:
        self.hooked += 1


KINDS = (
    "linear",
    "tied",
    "branch",
    "counted",
    "custom",
    "custom-tied",
    "custom-hooked",
    "in-place",
    "hooked",
    "checkpointed",
    "retained",
)


def hook_parameters(blocks: nn.Module) -> None:
    """A hook that changes the gradient of each ``custom-hooked`` block's weight (hooks
    are not copied with their tensor)."""
    for block in blocks.modules():
        if isinstance(block, Block) and block.kind == "custom-hooked":
            block.linear.weight.register_hook(lambda grad: grad * 3)


def graph(kinds: list[str], seed: int) -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(seed)
    shared = nn.Linear(WIDTH, WIDTH)
    return shared, nn.ModuleList(Block(kind, shared) for kind in kinds).double()


def input_gradient(
    roots: list[Tensor], seeds: list[Tensor], wanted: list[Tensor]
) -> tuple[list[Tensor | None], WeightGradient]:
    return SplitBackward(roots, seeds, wanted).input_gradient()


def outputs(blocks: nn.ModuleList, x: Tensor, extra: bool) -> list[Tensor]:
    """The main output (if it has a graph: a step differentiates no other), and one of
    parameters only beside it."""
    for block in blocks:
        x = block(x)
    main = [x] if x.requires_grad else []
    return [*main, blocks[0].scale.sin().sum()] if extra else main


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
    extra=st.booleans(),
    needs_input=st.booleans(),
)
def test_input_then_weight_gradient_equals_one_backward_pass(
    kinds: list[str], seed: int, extra: bool, needs_input: bool
) -> None:
    shared, blocks = graph(kinds, seed)
    model = nn.ModuleList([shared, blocks])
    twin = copy.deepcopy(model)
    hook_parameters(model)
    hook_parameters(twin)
    x = torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=needs_input)
    x_full = x.detach().clone().requires_grad_(needs_input)
    roots = outputs(twin[1], x_full, extra)
    seeds = [torch.randn_like(root) for root in roots]
    # One backward pass.
    if roots:
        torch.autograd.backward(roots, seeds)
    # Split.
    roots = outputs(blocks, x, extra)
    wanted = [x] if needs_input else []
    found, weight = input_gradient(roots, seeds, wanted)
    assert all(p.grad is None for p in model.parameters())  # nothing of W at I
    weight()
    if needs_input:
        torch.testing.assert_close(found[0], x_full.grad)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    # Each region recomputed once, each hook on an activation called once, each retained
    # gradient the one of one backward pass.
    for got, want in zip(blocks, twin[1], strict=True):
        assert (got.calls, got.hooked, len(got.kept)) == (want.calls, want.hooked, len(want.kept))
        for a, b in zip(got.kept, want.kept, strict=True):
            torch.testing.assert_close(a.grad, b.grad)


def test_the_weight_gradient_does_not_run_the_input_path_again() -> None:
    _, blocks = graph(["linear", "counted", "linear", "counted", "tied"], 0)
    x = torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=True)
    Counted.calls = 0
    found, weight = input_gradient([outputs(blocks, x, False)[0].sum()], [torch.ones(())], [x])
    assert Counted.calls == 2  # at I, once each
    weight()
    assert Counted.calls == 2  # not again at W
    assert found[0] is not None
    assert all(blocks[k].linear.weight.grad is not None for k in (0, 2, 4))


def test_a_custom_function_with_parameters_runs_once_at_the_input_gradient() -> None:
    _, blocks = graph(["linear", "custom", "linear"], 0)
    x = torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=True)
    CustomLinear.calls = 0
    _, weight = input_gradient([outputs(blocks, x, False)[0].sum()], [torch.ones(())], [x])
    assert CustomLinear.calls == 1
    weight()
    assert CustomLinear.calls == 1
    assert blocks[1].linear.weight.grad is not None


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize(("schedule", "placement"), [("zb-h1", "loop"), ("zbv", "v")])
def test_a_step_runs_the_input_path_once_per_micro_batch(
    schedule: str, placement: str, checkpoint: str
) -> None:
    """A counted identity between two linear layers in each of four partitions: its
    backward runs once per micro-batch and partition, as in one backward pass (twice if
    W ran the path from the output to the first layer's weight again)."""
    torch.manual_seed(0)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(WIDTH, WIDTH)
            self.second = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: Tensor) -> Tensor:
            return self.second(Counted.apply(torch.tanh(self.first(x))))  # type: ignore[no-any-return]

    plain = nn.Sequential(*(Layer() for _ in range(4))).double()
    pipe = GPipe(copy.deepcopy(plain), [1, 1, 1, 1], chunks=4, checkpoint=checkpoint,
                 devices=["cpu", "cpu"], placement=placement)  # fmt: skip
    x = torch.randn(8, WIDTH, dtype=torch.float64, requires_grad=True)
    y = torch.randn(8, WIDTH, dtype=torch.float64)
    Counted.calls = 0
    pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    assert Counted.calls == 4 * 4
    x_plain = x.detach().clone().requires_grad_()
    nn.MSELoss()(plain(x_plain), y).backward()
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(x.grad, x_plain.grad)
