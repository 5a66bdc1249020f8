"""Tests of checkpoint() and Checkpointing: values, gradients, random draws, autocast."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpipe_checkpoint import (
    Checkpointing,
    checkpoint,
    is_checkpointing,
    is_recomputing,
)
from gpipe_microbatch import Batch

SETTINGS = settings(max_examples=25, deadline=None)


def _mlp(seed: int, widths: list[int], dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers).double()


def _grads(module: nn.Module) -> list[torch.Tensor]:
    grads = []
    for parameter in module.parameters():
        assert parameter.grad is not None
        grads.append(parameter.grad.clone())
    return grads


# -- values and gradients ------------------------------------------------------------------


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    batch_size=st.integers(1, 5),
    input_requires_grad=st.booleans(),
)
def test_checkpoint_matches_plain_mlp(
    seed: int, widths: list[int], batch_size: int, input_requires_grad: bool
) -> None:
    model = _mlp(seed, widths)
    x = torch.randn(batch_size, widths[0], dtype=torch.float64)
    x.requires_grad_(input_requires_grad)

    expected = model(x)
    expected.square().sum().backward()
    expected_grads = _grads(model)
    expected_x_grad = x.grad
    model.zero_grad(set_to_none=True)
    x.grad = None

    output = checkpoint(model, x)
    assert isinstance(output, torch.Tensor)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    output.square().sum().backward()
    for got, want in zip(_grads(model), expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    if input_requires_grad:
        assert x.grad is not None and expected_x_grad is not None
        torch.testing.assert_close(x.grad, expected_x_grad)
    else:
        assert x.grad is None


@SETTINGS
@given(seed=st.integers(0, 2**16), batch_size=st.integers(1, 5))
def test_checkpoint_tuple_input_and_output(seed: int, batch_size: int) -> None:
    torch.manual_seed(seed)
    a = torch.randn(batch_size, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(batch_size, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def function(value: object) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = value  # type: ignore[misc]
        return (first @ weight).sin() * second, (second @ weight).exp()

    expected = function((a, b))
    (expected[0].sum() + 2 * expected[1].sum()).backward()
    want = [t.grad.clone() for t in (a, b, weight)]  # type: ignore[union-attr]
    for t in (a, b, weight):
        t.grad = None

    output = checkpoint(function, (a, b))
    assert isinstance(output, tuple) and len(output) == 2
    torch.testing.assert_close(output[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(output[1], expected[1], rtol=0, atol=0)
    (output[0].sum() + 2 * output[1].sum()).backward()
    for t, w in zip((a, b, weight), want, strict=True):
        assert t.grad is not None
        torch.testing.assert_close(t.grad, w)


def test_checkpoint_of_non_leaf_input() -> None:
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = checkpoint(torch.sin, x * 2)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()))


def test_checkpoint_output_only_partly_used() -> None:
    a = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: (t * 2, t * 3), a)
    out[0].sum().backward()
    assert a.grad is not None
    assert torch.equal(a.grad, torch.full((3,), 2.0))


def test_backward_from_the_second_output_only() -> None:
    a = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: (t * 2, t * 3), a)
    out[1].sum().backward()
    assert a.grad is not None
    assert torch.equal(a.grad, torch.full((3,), 3.0))


def test_checkpoint_identity_and_passthrough() -> None:
    x = torch.randn(3, requires_grad=True)
    y = checkpoint(lambda t: t, x)
    assert isinstance(y, torch.Tensor)
    (y * 2).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full((3,), 2.0))

    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: (t[0], t[1] * 2), (a, b))
    (out[0] * 3 + out[1]).sum().backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, torch.full((3,), 3.0))
    assert torch.equal(b.grad, torch.full((3,), 2.0))


def test_checkpoint_input_without_grad_still_trains_parameters() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    layer(x).sum().backward()
    want = layer.weight.grad.clone()  # type: ignore[union-attr]
    layer.zero_grad(set_to_none=True)
    y = checkpoint(layer, x)
    assert isinstance(y, torch.Tensor)
    assert y.requires_grad
    y.sum().backward()
    assert layer.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, want)
    assert x.grad is None


def test_checkpoint_integer_input_in_tuple() -> None:
    a = torch.randn(3, requires_grad=True)
    index = torch.tensor([0, 2])
    for value, function in (
        ((a, index), lambda t: t[0][t[1]]),
        ((index, a), lambda t: t[1][t[0]]),
    ):
        a.grad = None
        y = checkpoint(function, value)
        assert isinstance(y, torch.Tensor)
        y.sum().backward()
        assert a.grad is not None
        assert a.grad.tolist() == [1.0, 0.0, 1.0]


def test_checkpoint_integer_outputs_are_not_differentiable() -> None:
    x = torch.randn(5, requires_grad=True)
    out = checkpoint(lambda t: (t * 2, (t > 0).long()), x)
    assert isinstance(out, tuple)
    assert out[0].requires_grad
    assert not out[1].requires_grad
    assert out[1].dtype == torch.int64
    assert torch.equal(out[1], (x.detach() > 0).long())
    out[0].sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full((5,), 2.0))


def test_checkpoint_integer_output_first() -> None:
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = checkpoint(lambda t: ((t > 0).long(), t.exp()), x)
    assert not out[0].requires_grad
    out[1].sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x.detach().exp())


def test_checkpoint_only_integer_output() -> None:
    x = torch.randn(4, requires_grad=True)
    out = checkpoint(lambda t: (t > 0).long(), x)
    assert isinstance(out, torch.Tensor)
    assert not out.requires_grad
    assert torch.equal(out, (x.detach() > 0).long())


def test_checkpoint_under_no_grad_just_calls() -> None:
    calls: list[tuple[bool, bool, bool]] = []

    def function(t: torch.Tensor) -> torch.Tensor:
        calls.append((is_checkpointing(), is_recomputing(), torch.is_grad_enabled()))
        return t * 2

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        y = checkpoint(function, x)
    assert calls == [(False, False, False)]
    assert isinstance(y, torch.Tensor)
    assert y.grad_fn is None
    assert not y.requires_grad
    assert torch.equal(y, x.detach() * 2)


def test_checkpoint_non_tensor_output() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError) as info:
        checkpoint(lambda t: [t], x)  # type: ignore[arg-type, return-value]
    assert str(info.value) == "output must be a tensor or a tuple of tensors (output: list)"
    with pytest.raises(TypeError, match=r"output\[1\]: int"):
        checkpoint(lambda t: (t, 1), x)  # type: ignore[arg-type, return-value]
    with torch.no_grad(), pytest.raises(TypeError, match=r"\(output: NoneType\)"):
        checkpoint(lambda t: None, x)  # type: ignore[arg-type, return-value]
    # The phase flag is put back after the error.
    assert not is_checkpointing()


def test_checkpoint_non_tensor_input() -> None:
    with pytest.raises(TypeError) as info:
        checkpoint(lambda t: t, [torch.zeros(1)])  # type: ignore[arg-type]
    assert str(info.value) == "input must be a tensor or a tuple of tensors (input: list)"


# -- random draws --------------------------------------------------------------------------


def _dropout_block(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))


@SETTINGS
@given(seed=st.integers(0, 2**16))
def test_dropout_mask_is_replayed(seed: int) -> None:
    x = torch.randn(6, 8, requires_grad=True)
    # A dropout right on the input: the gradient is zero exactly where the output is.
    torch.manual_seed(seed)
    y = checkpoint(lambda t: F.dropout(t, 0.5, training=True), x)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad == 0, y.detach() == 0)
    assert torch.equal(x.grad, (y.detach() != 0).float() * 2)


@SETTINGS
@given(seed=st.integers(0, 2**16))
def test_dropout_matches_plain_run_from_same_seed(seed: int) -> None:
    block = _dropout_block(0)
    x = torch.randn(5, 8, requires_grad=True)

    torch.manual_seed(seed)
    expected = block(x)
    expected.sum().backward()
    want = [*_grads(block), x.grad.clone()]  # type: ignore[union-attr]
    block.zero_grad(set_to_none=True)
    x.grad = None

    torch.manual_seed(seed)
    output = checkpoint(block, x)
    assert isinstance(output, torch.Tensor)
    assert torch.equal(output, expected)
    output.sum().backward()
    got = [*_grads(block), x.grad]
    for g, w in zip(got, want, strict=True):
        assert g is not None
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_rng_state_after_backward_is_not_disturbed() -> None:
    block = _dropout_block(1)
    x = torch.randn(5, 8, requires_grad=True)

    def run(use_checkpoint: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(123)
        y = checkpoint(block, x) if use_checkpoint else block(x)
        assert isinstance(y, torch.Tensor)
        between = torch.rand(3)  # draws between forward and backward
        y.sum().backward()
        after = torch.rand(5)
        return between, after

    between_plain, after_plain = run(False)
    between_chk, after_chk = run(True)
    assert torch.equal(between_plain, between_chk)
    assert torch.equal(after_plain, after_chk)


# -- phases --------------------------------------------------------------------------------


def test_phase_flags_inside_checkpoint_and_recompute() -> None:
    calls: list[tuple[bool, bool, bool]] = []

    def function(t: torch.Tensor) -> torch.Tensor:
        calls.append((is_checkpointing(), is_recomputing(), torch.is_grad_enabled()))
        return t.sin()

    assert (is_checkpointing(), is_recomputing()) == (False, False)
    x = torch.randn(3, requires_grad=True)
    y = checkpoint(function, x)
    assert calls == [(True, False, False)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    assert calls == [(True, False, False), (False, True, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)


def test_phase_flags_are_thread_local() -> None:
    seen: list[tuple[str, bool, bool, bool, bool]] = []

    def function(t: torch.Tensor) -> torch.Tensor:
        inner: dict[str, bool] = {}

        def probe() -> None:
            inner["checkpointing"] = is_checkpointing()
            inner["recomputing"] = is_recomputing()

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        phase = "recompute" if is_recomputing() else "checkpoint"
        seen.append(
            (
                phase,
                is_checkpointing(),
                is_recomputing(),
                inner["checkpointing"],
                inner["recomputing"],
            )
        )
        return t * 2

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(function, x)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    assert seen == [
        ("checkpoint", True, False, False, False),
        ("recompute", False, True, False, False),
    ]


# -- autocast -----------------------------------------------------------------------------


def test_autocast_is_reapplied_in_recomputation() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    seen: list[tuple[bool, bool, torch.dtype]] = []

    def function(t: torch.Tensor) -> torch.Tensor:
        out = layer(t)
        seen.append((is_recomputing(), torch.is_autocast_enabled("cpu"), out.dtype))
        return out

    x = torch.randn(3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
    expected.float().sum().backward()
    want = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(function, x)
    assert isinstance(y, torch.Tensor)
    assert y.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    y.float().sum().backward()  # outside the autocast block
    assert seen == [(False, True, torch.bfloat16), (True, True, torch.bfloat16)]
    assert x.grad is not None
    torch.testing.assert_close(x.grad, want)


def test_no_autocast_in_forward_means_none_in_recomputation() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    seen: list[torch.dtype] = []

    def function(t: torch.Tensor) -> torch.Tensor:
        out = layer(t)
        seen.append(out.dtype)
        return out

    x = torch.randn(3, 4, requires_grad=True)
    y = checkpoint(function, x)
    assert isinstance(y, torch.Tensor)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.sum().backward()
    assert seen == [torch.float32, torch.float32]


# -- Checkpointing by hand ------------------------------------------------------------------


def test_checkpointing_by_hand() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    layer(x).sum().backward()
    want_x, want_w = x.grad.clone(), layer.weight.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    layer.zero_grad(set_to_none=True)

    chk = Checkpointing(layer, Batch(x))
    output = chk.checkpoint()
    assert isinstance(output, Batch)
    assert output.atomic
    assert layer.weight.grad is None
    chk.recompute_in_backward(output)
    output.tensor.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(layer.weight.grad, want_w)


def test_checkpointing_by_hand_with_tuples() -> None:
    a = torch.randn(4, requires_grad=True)
    index = torch.arange(4)
    chk = Checkpointing(lambda t: (t[1], t[0] * 3), Batch((a, index)))  # type: ignore[index]
    output = chk.checkpoint()
    assert not output.atomic
    chk.recompute_in_backward(output)
    assert torch.equal(output[0], index)
    output[1].sum().backward()
    assert a.grad is not None
    assert torch.equal(a.grad, torch.full((4,), 3.0))


class _Output(OrderedDict[str, Any]):
    """Made from keywords only, as Hugging Face's ModelOutput."""

    def __init__(self, *, hidden: Any = None, note: Any = None) -> None:
        super().__init__()
        for key, value in (("hidden", hidden), ("note", note)):
            if value is not None:
                self[key] = value


@pytest.mark.parametrize("detached", [False, True])
def test_checkpointing_by_hand_with_mappings(detached: bool) -> None:
    """A dict in, a ModelOutput-like mapping out: the checkpoint phase's and the
    recomputation's outputs keep its type and keys, and the gradients are the plain ones."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def function(values: Any) -> _Output:
        assert type(values) is dict and values["scale"] == 2.0
        return _Output(hidden=layer(values["x"]) * values["scale"], note="n")

    function({"x": x, "scale": 2.0})["hidden"].sum().backward()
    want_x, want_w = x.grad.clone(), layer.weight.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    layer.zero_grad(set_to_none=True)

    chk = Checkpointing(function, Batch({"x": x, "scale": 2.0}))
    output = chk.checkpoint(detached=detached)
    assert type(output.value) is _Output and list(output.value) == ["hidden", "note"]
    if detached:
        output = chk.recompute()
        assert type(output.value) is _Output and output.value["note"] == "n"
    else:
        chk.recompute_in_backward(output)
    output.value["hidden"].sum().backward()  # type: ignore[index]
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(layer.weight.grad, want_w)


def test_forgetting_recompute_is_a_clear_error() -> None:
    x = torch.randn(3, requires_grad=True)
    chk = Checkpointing(torch.sin, Batch(x))
    output = chk.checkpoint()
    with pytest.raises(RuntimeError, match="without its recomputation"):
        output.tensor.sum().backward()


# -- input modified in place ---------------------------------------------------------------


def test_in_place_change_of_input_is_refused() -> None:
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified its input in place"):
        checkpoint(nn.ReLU(inplace=True), x * 1)


def test_copy_input_allows_in_place_change() -> None:
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    source = x * 1
    chk = Checkpointing(nn.Sequential(nn.ReLU(inplace=True)), Batch(source), copy_input=True)
    output = chk.checkpoint()
    assert chk.input_modified
    chk.recompute_in_backward(output)
    torch.testing.assert_close(output.tensor, x.detach().clamp(min=0))
    output.tensor.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, (x.detach() > 0).double())


# -- errors in recomputation ------------------------------------------------------------------


class Boom(Exception):
    pass


def test_exception_in_recomputation_propagates() -> None:
    def function(t: torch.Tensor) -> torch.Tensor:
        if is_recomputing():
            raise Boom("recomputation failed")
        return t * 2

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(function, x)
    assert isinstance(y, torch.Tensor)
    with pytest.raises(Boom, match="recomputation failed"):
        y.sum().backward()
    assert not is_recomputing()
    assert not is_checkpointing()

    # A fresh checkpoint call works afterwards.
    x.grad = None
    z = checkpoint(torch.sin, x)
    assert isinstance(z, torch.Tensor)
    z.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


def test_exception_in_recomputation_restores_rng_state() -> None:
    def function(t: torch.Tensor) -> torch.Tensor:
        out = F.dropout(t, 0.5, training=True)
        if is_recomputing():
            raise Boom
        return out

    x = torch.randn(8, requires_grad=True)
    torch.manual_seed(7)
    y = checkpoint(function, x)
    assert isinstance(y, torch.Tensor)
    state = torch.get_rng_state()
    with pytest.raises(Boom):
        y.sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


def test_second_backward_with_retained_graph() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = checkpoint(lambda t: F.dropout(t.sin(), 0.5, training=True), x)
    assert isinstance(y, torch.Tensor)
    y.sum().backward(retain_graph=True)
    assert x.grad is not None
    first = x.grad.clone()
    y.sum().backward()
    # The same dropout mask is replayed: the gradient doubles.
    torch.testing.assert_close(x.grad, 2 * first)
    assert torch.equal(first == 0, y.detach() == 0)


def test_checkpoint_gradients_match_finite_differences() -> None:
    # gradcheck itself differentiates with torch.autograd.grad, which checkpointing refuses
    # (see below); compare .backward() gradients with central differences instead.
    weight = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def plain(t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(t[0] @ weight) * t[1].exp()

    out = checkpoint(plain, (x, b))
    assert isinstance(out, torch.Tensor)
    out.sum().backward()
    eps = 1e-6
    for leaf in (x, b):
        assert leaf.grad is not None
        numeric = torch.zeros_like(leaf)
        for index in range(leaf.numel()):
            with torch.no_grad():
                flat = leaf.view(-1)
                flat[index] += eps
                high = plain((x, b)).sum()
                flat[index] -= 2 * eps
                low = plain((x, b)).sum()
                flat[index] += eps
            numeric.view(-1)[index] = (high - low) / (2 * eps)
        torch.testing.assert_close(leaf.grad, numeric, atol=1e-6, rtol=1e-5)


def test_parameter_free_module_output_requires_grad_only_with_input() -> None:
    x = torch.randn(3)
    y = checkpoint(nn.Tanh(), x)
    assert isinstance(y, torch.Tensor)
    assert not y.requires_grad
    assert torch.equal(y, torch.tanh(x))
    x.requires_grad_()
    z = checkpoint(nn.Tanh(), x)
    assert isinstance(z, torch.Tensor)
    assert z.requires_grad


def test_autograd_grad_through_a_checkpointed_module_is_exact() -> None:
    # A module's parameters are inputs of the checkpointed node: torch.autograd.grad and
    # backward(inputs=...) get their gradients as from the module itself, .grad untouched.
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(4, 3, requires_grad=True)
    y = checkpoint(layer, x)
    assert isinstance(y, torch.Tensor)
    got = torch.autograd.grad(y.pow(2).sum(), [x, layer[0].weight, layer[2].bias])
    expected = torch.autograd.grad(layer(x).pow(2).sum(), [x, layer[0].weight, layer[2].bias])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert all(p.grad is None for p in layer.parameters())
    checkpoint(layer, x).sum().backward(inputs=[layer[2].weight])  # type: ignore[union-attr]
    assert layer[2].weight.grad is not None and layer[0].weight.grad is None


def test_autograd_grad_through_a_function_is_refused_with_a_clear_error() -> None:
    # A plain function's tensors are unknown: the recomputed graph can only accumulate into
    # .grad, which torch.autograd.grad must never touch; refuse it, as PyTorch's reentrant
    # checkpoint does.
    weight = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    y = checkpoint(lambda t: t * weight, x)
    assert isinstance(y, torch.Tensor)
    with pytest.raises(RuntimeError, match=r"torch\.autograd\.grad\(\)"):
        torch.autograd.grad(y.sum(), x)
    assert weight.grad is None
    # It still trains through .backward() afterwards.
    y = checkpoint(lambda t: t * weight, x)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    torch.testing.assert_close(weight.grad, x.detach().sum(0))


def test_second_order_gradients_are_refused() -> None:
    layer = nn.Linear(3, 2)
    y = checkpoint(layer, torch.randn(4, 3))
    assert isinstance(y, torch.Tensor)
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad(y.pow(2).sum(), list(layer.parameters()), create_graph=True)


def test_a_tuple_subclass_output_keeps_its_type_through_both_phases() -> None:
    # torch.max(dim=...) returns torch.return_types.max: the checkpoint phase's output and
    # the recomputed one are of that type, as the function's own output.
    x = torch.randn(3, 4, requires_grad=True)
    for detached in (False, True):
        chk = Checkpointing(lambda t: (t * 2).max(dim=1), Batch(x))
        output = chk.checkpoint(detached=detached)
        assert type(output.value) is type(x.max(dim=1))
        if detached:
            assert type(chk.recompute().value) is type(x.max(dim=1))


def test_a_hook_registered_in_the_checkpoint_phase_is_refused_with_what_to_do() -> None:
    def hooked(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.register_hook(lambda grad: grad)
        return h.sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"checkpoint phase.*is_checkpointing\(\)") as caught:
        checkpoint(hooked, x)
    assert "checkpoint='never'" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)
