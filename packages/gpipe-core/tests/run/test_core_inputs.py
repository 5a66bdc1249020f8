"""Inputs and outputs of any kind, compared with the plain model.

Several positional inputs for the first layer, a NoChunk tensor, values that are not
tensors (a float, a string, None or a dict) crossing every partition boundary, and outputs
that are not tensors, on ``forward()`` and on both schedules of ``step()``, in every
checkpoint mode, with and without a skip connection across partitions, for both calling
conventions (``nn.Sequential``: one value from layer to layer; ``PipeSequential``: tuples
unpacked). Hypothesis draws the models; the layers refuse the wrong calling convention,
so that a convention lost at a partition boundary fails the comparison.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.models import MODES
from core_support.strategies import compositions
from gpipe_core import GPipe, NoChunk, PipeSequential
from gpipe_core._stream import CPUStream
from gpipe_core.transport._transport import LocalTransport, MessageKey, outgoing
from gpipe_skip import current_skip_tracker, pop, skippable, stash

RUNS = ("forward", "gpipe", "1f1b")
# How the model is called: several positional arguments ("args") or one tuple ("tuple"),
# of an nn.Sequential or of a PipeSequential ("pipe-").
CONVENTIONS = ("args", "tuple", "pipe-args", "pipe-tuple")
WIDTH = 3


def received(args: tuple[Any, ...], pipe: bool, count: int) -> tuple[Any, ...]:
    """The ``count`` values a layer got: unpacked under PipeSequential, else one tuple.

    Raises ``TypeError`` for the other convention, so that a wrong call is a failure.
    """
    if pipe:
        if len(args) != count:
            raise TypeError(f"expected {count} positional arguments, got {len(args)}")
        return args
    if len(args) != 1 or not isinstance(args[0], tuple) or len(args[0]) != count:
        raise TypeError(f"expected one tuple of {count} values, got {args!r:.80}")
    return args[0]


class Enter(nn.Module):
    """The first layer: ``(x, mask, scale, tag, options)`` as arguments or as one tuple."""

    def __init__(self, arguments: bool) -> None:
        super().__init__()
        self.arguments = arguments
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, *args: Any) -> tuple[Any, ...]:
        x, mask, scale, tag, options = received(args, self.arguments, 5)
        assert isinstance(mask, torch.Tensor) and mask.shape == (WIDTH,), "the mask is whole"
        assert isinstance(scale, float) and isinstance(tag, str)
        return torch.tanh(self.linear(x)) * mask * scale, scale, tag, options


class Middle(nn.Module):
    def __init__(self, pipe: bool) -> None:
        super().__init__()
        self.pipe = pipe
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, *args: Any) -> tuple[Any, ...]:
        h, scale, tag, options = received(args, self.pipe, 4)
        return torch.tanh(self.linear(h)) * scale + h, scale, tag, options


@skippable(stash=["h"])
class Save(nn.Module):
    def __init__(self, pipe: bool) -> None:
        super().__init__()
        self.pipe = pipe
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, *args: Any) -> Any:
        h, *rest = received(args, self.pipe, 4)
        yield stash("h", h)
        return (torch.tanh(self.linear(h)), *rest)


@skippable(pop=["h"])
class Load(nn.Module):
    def __init__(self, pipe: bool) -> None:
        super().__init__()
        self.pipe = pipe

    def forward(self, *args: Any) -> Any:
        h, *rest = received(args, self.pipe, 4)
        skip = yield pop("h")
        return (h * 0.5 + skip, *rest)


class Head(nn.Module):
    """The last layer: a tensor, and values that are not tensors (one of them the number
    of samples it saw, so that each micro-batch's entry is its own)."""

    def __init__(self, pipe: bool) -> None:
        super().__init__()
        self.pipe = pipe
        self.linear = nn.Linear(WIDTH, 2)

    def forward(self, *args: Any) -> tuple[Any, ...]:
        h, _, tag, options = received(args, self.pipe, 4)
        return self.linear(h), len(h), tag, options


def build(convention: str, middle: int, skip: tuple[int, int] | None, seed: int) -> nn.Sequential:
    """Enter, ``middle`` Middle layers (with Save and Load at the positions of ``skip``),
    and Head; a PipeSequential for the ``pipe-`` conventions."""
    pipe = convention.startswith("pipe-")
    torch.manual_seed(seed)
    layers: list[nn.Module] = [Middle(pipe) for _ in range(middle)]
    if skip is not None:
        save, load = skip
        layers.insert(load, Load(pipe))
        layers.insert(save, Save(pipe))
    arguments = convention.endswith("args")
    kind = PipeSequential if pipe else nn.Sequential
    return kind(Enter(arguments), *layers, Head(pipe)).double()


def run_plain(plain: nn.Sequential, convention: str, args: tuple[Any, ...]) -> Any:
    """The plain model on ``args``: as one tuple, or as the first layer's arguments."""
    if convention.endswith("tuple"):
        return plain(args)
    if convention == "pipe-args":
        return plain(*args)
    # nn.Sequential with several arguments: the first layer gets them, then one value.
    layers = list(plain)
    output = layers[0](*args)
    for layer in layers[1:]:
        output = layer(output)
    return output


def loss_fn(output: tuple[Any, ...], target: tuple[Any, ...]) -> torch.Tensor:
    """A weighted mean squared error; the weight is a NoChunk tensor of the target."""
    out, samples, _, _ = output
    y, weight = target
    assert samples == len(out) == len(y), "each micro-batch's own count"
    return ((out - y).square() * weight).mean()


@dataclass(frozen=True)
class Spec:
    convention: str
    middle: int
    skip: tuple[int, int] | None
    balance: tuple[int, ...]
    chunks: int
    batch: int
    checkpoint: str
    run: str
    x_requires_grad: bool
    mask_requires_grad: bool
    options: dict[str, int] | None
    seed: int


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    middle = draw(st.integers(0, 3))
    skip = None
    if draw(st.booleans()):
        # Save before the Middle layer at ``save``, Load before the one at ``load``.
        save = draw(st.integers(0, middle))
        skip = (save, draw(st.integers(save, middle)))
    layers = 2 + middle + (2 if skip else 0)
    parts = draw(st.integers(1, min(4, layers)))
    return Spec(
        convention=draw(st.sampled_from(CONVENTIONS)),
        middle=middle,
        skip=skip,
        balance=tuple(draw(st.sampled_from(compositions(layers, parts)))),
        chunks=draw(st.integers(1, 4)),
        batch=draw(st.integers(1, 7)),
        checkpoint=draw(st.sampled_from(MODES)),
        run=draw(st.sampled_from(RUNS)),
        x_requires_grad=draw(st.booleans()),
        mask_requires_grad=draw(st.booleans()),
        options=draw(st.sampled_from([None, {"k": 1}])),
        seed=draw(st.integers(0, 2**16)),
    )


def params_grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in module.parameters()]


def check(spec: Spec) -> None:
    model = build(spec.convention, spec.middle, spec.skip, spec.seed)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, list(spec.balance), chunks=spec.chunks, checkpoint=spec.checkpoint)
    torch.manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, WIDTH, dtype=torch.float64)
    mask = torch.rand(WIDTH, dtype=torch.float64) + 0.5
    y = torch.randn(spec.batch, 2, dtype=torch.float64)
    weight = torch.rand(2, dtype=torch.float64)
    sizes = [len(piece) for piece in x.chunk(spec.chunks)]

    def leaves() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            x.clone().requires_grad_(spec.x_requires_grad),
            mask.clone().requires_grad_(spec.mask_requires_grad),
        )

    (x_pipe, mask_pipe), (x_plain, mask_plain) = leaves(), leaves()
    pipe_args = (x_pipe, NoChunk(mask_pipe), 2.0, "tag", spec.options)
    plain_args = (x_plain, mask_plain, 2.0, "tag", spec.options)
    unpack = spec.convention.endswith("args")

    expected = run_plain(plain, spec.convention, plain_args)
    if spec.run == "forward":
        output = pipe(*pipe_args) if unpack else pipe(pipe_args)
        out, samples, tags, options = output
        assert samples == sizes  # one entry per micro-batch, each its own
        assert tags == ["tag"] * len(sizes)
        assert options == [spec.options] * len(sizes)
        torch.testing.assert_close(out, expected[0])
        assert out.requires_grad == expected[0].requires_grad
        torch.manual_seed(spec.seed + 2)
        seed = torch.randn_like(out)
        (out * seed).sum().backward()
        (expected[0] * seed).sum().backward()
    else:
        # One convention for both: the positional arguments are the first layer's.
        target = (y, NoChunk(weight))
        step_args = pipe_args if unpack else (pipe_args,)
        losses = pipe.step(*step_args, target=target, loss_fn=loss_fn, schedule=spec.run)
        expected_loss = loss_fn((expected[0], spec.batch, "tag", None), (y, weight))
        expected_loss.backward()
        assert list(losses.sizes) == sizes
        torch.testing.assert_close(losses.reduced(), expected_loss.detach())

    for name, got, want in zip(
        [name for name, _ in pipe.named_parameters()],
        params_grads(pipe),
        params_grads(plain),
        strict=True,
    ):
        assert got is not None and want is not None, name
        torch.testing.assert_close(got, want, msg=name)
    for got, want in ((x_pipe, x_plain), (mask_pipe, mask_plain)):
        if want.requires_grad:
            assert got.grad is not None
            torch.testing.assert_close(got.grad, want.grad)
        else:
            assert got.grad is None
    assert len(current_skip_tracker()) == 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs())
def test_inputs_of_any_kind_match_the_plain_model(spec: Spec) -> None:
    check(spec)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_every_mode_and_convention_with_a_skip_across_partitions(
    convention: str, checkpoint: str, run: str
) -> None:
    # Enter | Save Middle | Middle Load | Head: the skip crosses a boundary and so do the
    # values that are not tensors, at each of the three boundaries.
    spec = Spec(
        convention=convention, middle=2, skip=(0, 2), balance=(1, 2, 2, 1), chunks=3, batch=7,
        checkpoint=checkpoint, run=run, x_requires_grad=True, mask_requires_grad=True,
        options={"k": 1}, seed=0,
    )  # fmt: skip
    check(spec)


def test_the_comparison_can_fail() -> None:
    # A GPipe that loses the PipeSequential convention at a boundary fails loudly.
    model = build("pipe-args", 1, None, 0)
    pipe = GPipe(model, [1, 2], chunks=2)
    pipe._config.unpacks = False
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    with pytest.raises(TypeError, match="expected 4 positional arguments, got 1"):
        pipe(x, NoChunk(torch.ones(WIDTH, dtype=torch.float64)), 2.0, "tag", None)
    # A model returning the same value for every micro-batch is told apart from one that
    # counts each: the list has one entry per micro-batch.
    pipe = GPipe(build("args", 1, None, 0), [1, 2], chunks=2)
    output = pipe(x, NoChunk(torch.ones(WIDTH, dtype=torch.float64)), 2.0, "tag", None)
    assert output[1] == [2, 2] and output[1] != 4


# -- the calling conventions ---------------------------------------------------------------


class Pair(nn.Module):
    """Refuses anything but one tuple of two tensors."""

    def forward(self, *args: Any) -> torch.Tensor:
        if len(args) != 1 or not isinstance(args[0], tuple) or len(args[0]) != 2:
            raise TypeError(f"expected one tuple of two tensors, got {len(args)} arguments")
        return args[0][0] + args[0][1]


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_tuple_argument_is_one_value(chunks: int) -> None:
    pipe = GPipe(nn.Sequential(Pair(), nn.Identity()), [1, 1], chunks=chunks)
    a, b = torch.randn(6, 2), torch.randn(6, 2)
    torch.testing.assert_close(pipe((a, b)), a + b)
    with torch.no_grad():  # no parameters to train
        losses = pipe.step((a, b), a + b, nn.MSELoss())
    assert losses.reduced().item() == 0.0
    with pytest.raises(TypeError, match="got 2 arguments"):
        pipe(a, b)  # two arguments are not one tuple


class Two(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


def test_pipe_sequential_unpacks_across_partitions() -> None:
    model = PipeSequential(Two(), Two(), Two())
    a, b = torch.randn(5, 2), torch.randn(5, 2)
    expected = model(a, b)
    for balance in ([1, 1, 1], [2, 1], [1, 2], [3]):
        pipe = GPipe(copy.deepcopy(model), balance, chunks=2)
        assert all(isinstance(p, PipeSequential) for p in pipe.partitions)
        got = pipe(a, b)
        assert isinstance(got, tuple) and len(got) == 2
        for g, w in zip(got, expected, strict=True):
            torch.testing.assert_close(g, w)
        plain = pipe.unwrap()
        assert type(plain) is PipeSequential
        torch.testing.assert_close(plain(a, b)[0], expected[0])
    # The same layers in an nn.Sequential pass the tuple as one value: Two refuses it.
    pipe = GPipe(nn.Sequential(Two(), Two()), [1, 1], chunks=2)
    assert type(pipe.unwrap()) is nn.Sequential
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        pipe(a, b)


def test_pipe_sequential_alone() -> None:
    a, b = torch.randn(2), torch.randn(2)
    sums = PipeSequential(Two(), Two())(a, b)
    torch.testing.assert_close(sums[0], 2 * a)
    torch.testing.assert_close(sums[1], 2 * b)
    # A single value, a tensor or a list, is passed as one argument.
    assert torch.equal(PipeSequential(nn.Identity())(a), a)
    assert PipeSequential(nn.Identity())([a]) == [a]
    # Without layers: the identity.
    assert PipeSequential()(a) is a
    assert PipeSequential()(a, b) == (a, b)


def test_values_that_are_not_tensors_in_eval_and_no_grad() -> None:
    model = build("args", 1, (0, 1), 3)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 1], chunks=3).eval()
    plain.eval()
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    mask = torch.ones(WIDTH, dtype=torch.float64)
    for context in (torch.no_grad, torch.enable_grad):
        with context():
            out, samples, tags, _ = pipe(x, NoChunk(mask), 1.5, "t", None)
            expected = run_plain(plain, "args", (x, mask, 1.5, "t", None))
        torch.testing.assert_close(out, expected[0])
        assert samples == [2, 2, 1] and tags == ["t"] * 3


def test_one_micro_batch_still_gives_lists() -> None:
    pipe = GPipe(build("args", 0, None, 0), [1, 1], chunks=1)
    x = torch.randn(3, WIDTH, dtype=torch.float64)
    out, samples, tags, options = pipe(x, NoChunk(torch.ones(WIDTH).double()), 1.0, "a", None)
    assert out.shape == (3, 2)
    assert samples == [3] and tags == ["a"] and options == [None]


class _MaybeB(nn.Module):
    """``{'a': x, 'b': 2x}``, with None for ``'b'`` in a micro-batch whose sum is negative."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
        return {"a": x, "b": x * 2 if x.sum() > 0 else None}


def test_an_output_key_that_is_a_tensor_in_some_micro_batches_only_is_named() -> None:
    pipe = GPipe(nn.Sequential(nn.Identity(), _MaybeB()), [1, 1], chunks=2)
    x = torch.cat([torch.ones(2, 3), -torch.ones(2, 3)])
    message = "(output['b'] of micro-batch 0: Tensor, of micro-batch 1: NoneType)"
    with pytest.raises(TypeError, match=re.escape(message)):
        pipe(x)


def test_errors_leave_the_model_usable() -> None:
    model = build("args", 1, None, 0)
    pipe = GPipe(model, [1, 1, 1], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64, requires_grad=True)
    mask = NoChunk(torch.ones(WIDTH, dtype=torch.float64))
    with pytest.raises(TypeError, match="holds a tensor inside another value"):
        pipe(x, mask, 2.0, "tag", {"bad": x})
    with pytest.raises(TypeError, match="must hold a tensor to split"):
        pipe(mask, 2.0)
    with pytest.raises(ValueError, match="same batch size"):
        pipe.step((x, torch.zeros(3, 1)), x, nn.MSELoss())
    with pytest.raises(TypeError, match=r"1 positional arguments given; target: missing"):
        pipe.step(x, loss_fn=nn.MSELoss())
    with pytest.raises(TypeError, match=r"2 positional arguments given; target: missing, loss_"):
        pipe.step(x, x)
    assert all(p.grad is None for p in pipe.parameters()) and x.grad is None
    out = pipe(x, mask, 2.0, "tag", None)[0]
    out.sum().backward()
    assert x.grad is not None


# -- the transport ---------------------------------------------------------------------------


@pytest.mark.parametrize("keep_graph", [False, True])
def test_the_transport_carries_values_that_are_not_tensors(keep_graph: bool) -> None:
    cpu = torch.device("cpu")
    transport = LocalTransport([cpu, cpu])
    transport.begin()
    transport.prepare([CPUStream, CPUStream], [[CPUStream], [CPUStream]], tracer=None)
    a = torch.randn(2, requires_grad=True)
    b = torch.arange(3)
    options = {"k": [1, 2]}
    key = MessageKey("activations", 0, 0, 1)
    transport.send(key, outgoing((a, None, "x", b, options, 3), detach=not keep_graph))
    message = transport.receive(key)
    assert message.present == (True, False, False, True, False, False)
    assert message.others == (None, "x", options, 3)
    assert message.others[2] is options  # as a Python object, in one process
    assert message.requires_grad == (True, False)
    values = message.values()
    assert values[1:3] == [None, "x"] and values[4:] == [options, 3]
    assert torch.equal(values[0], a) and torch.equal(values[3], b)  # type: ignore[arg-type]
    assert values[0].requires_grad is keep_graph  # type: ignore[union-attr]
    # An atomic message of one tensor, and gradients with None among them.
    transport.send(key, outgoing([a], atomic=True, detach=not keep_graph))
    assert transport.receive(key).atomic
    back = MessageKey("gradients", 0, 1, 0)
    transport.send(back, outgoing([None, torch.ones(2)], detach=not keep_graph))
    message = transport.receive(back)
    assert message.present == (False, True) and message.others == (None,)
    assert message.values()[0] is None
    assert transport.finish(None) == {}


def test_step_takes_several_inputs_as_forward_does() -> None:
    """``step(a, b, target=, loss_fn=)`` calls the first layer as ``model(a, b)`` does."""

    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

    torch.manual_seed(0)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    grads = []
    for form in ("plain", "keywords"):
        torch.manual_seed(1)
        model = nn.Sequential(Masked(), nn.Linear(3, 2)).double()
        if form == "plain":
            nn.MSELoss()(model[1](model[0](x, mask)), y).backward()
        else:
            pipe = GPipe(model, [1, 1], chunks=3)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                pipe.step(x, NoChunk(mask), target=y, loss_fn=nn.MSELoss())
        grads.append([p.grad for p in model.parameters()])
    for got in grads[1:]:
        for g, want in zip(got, grads[0], strict=True):
            torch.testing.assert_close(g, want)
