"""The checkpoint phase's backward calls autograd's engine directly, checks and all."""

from __future__ import annotations

import pytest
import torch

from gpipe_checkpoint import checkpoint, is_recomputing


def test_output_shape_changed_by_recomputation_is_an_error() -> None:
    def grows(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if is_recomputing() else x * 2

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(grows, x)
    with pytest.raises(RuntimeError, match="shape"):
        y.sum().backward()


def test_output_dtype_changed_by_recomputation_is_cast_back() -> None:
    # torch.autograd.backward casts a gradient to its tensor's dtype, as before.
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).double() if is_recomputing() else x * 2

    x = torch.randn(3, requires_grad=True)
    checkpoint(doubled, x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_gradients_through_several_outputs() -> None:
    weight = torch.randn(3, requires_grad=True)

    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * weight, x.sin()

    x = torch.randn(3, requires_grad=True)
    a, b = checkpoint(two, x)
    (a.sum() + 2 * b.sum()).backward()
    assert x.grad is not None and weight.grad is not None
    torch.testing.assert_close(x.grad, weight.detach() + 2 * x.detach().cos())
    torch.testing.assert_close(weight.grad, x.detach())


def test_recompute_forks_a_phony_that_orders_a_later_checkpoint_first() -> None:
    from gpipe_checkpoint import Checkpointing
    from gpipe_microbatch import Batch

    order: list[str] = []

    def tagged(name: str, weight: torch.Tensor) -> object:
        def function(x: torch.Tensor) -> torch.Tensor:
            if is_recomputing():
                order.append(name)
            return x * weight

        return function

    wa, wb = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    b_chk = Checkpointing(tagged("b", wb), Batch(torch.randn(3)))
    b_out = b_chk.checkpoint()
    phony = b_chk.recompute_in_backward(b_out)
    a_chk = Checkpointing(tagged("a", wa), Batch(torch.randn(3)))
    a_out = a_chk.checkpoint(join=phony)
    a_chk.recompute_in_backward(a_out)
    # Only a's output: b is reached through the phony alone, after a's backward.
    a_out.tensor.sum().backward()
    assert order == ["a", "b"]
    assert wa.grad is not None


def test_recompute_without_autograd_forks_a_phony_without_edge() -> None:
    from gpipe_checkpoint import Checkpointing
    from gpipe_microbatch import Batch

    chk = Checkpointing(lambda x: x * 2, Batch(torch.randn(3)), requires_grad=False)
    output = chk.checkpoint()
    phony = chk.recompute_in_backward(output)
    assert phony.numel() == 0 and not phony.requires_grad


def test_engine_calls_match_torch_autograd_with_edges_inputs_and_kept_graphs() -> None:
    """``run_backward`` and ``gradients`` give what torch.autograd.backward and
    torch.autograd.grad give: from tensors and from gradient edges, to chosen inputs,
    keeping the graph when asked (a second call then runs), and through torch's own
    checks for a gradient of another shape."""
    from torch.autograd.graph import get_gradient_edge

    from gpipe_checkpoint import gradients, run_backward

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    h = x @ w + b
    y = h.tanh()
    seed = torch.randn(2, 3)
    # To the input only, keeping the graph; the edge into h's node as another input.
    got = gradients([y], [seed], [x, get_gradient_edge(h)], retain_graph=True)
    want = torch.autograd.grad([y], [x, h], [seed], retain_graph=True)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    # From the edge with the gradient captured there, to the parameters only.
    run_backward([get_gradient_edge(h)], [want[1]], inputs=[w, b], retain_graph=True)
    assert x.grad is None
    torch.testing.assert_close(w.grad, x.t() @ want[1])
    torch.testing.assert_close(b.grad, want[1].sum(0))
    # The graph was kept: a whole backward pass still runs.
    run_backward([y], [seed])
    assert x.grad is not None
    # A gradient of another shape goes through torch's checks, and its error.
    with pytest.raises(RuntimeError, match=r"[Mm]ismatch in shape"):
        run_backward([(x * 2).sum()], [torch.ones(2)])
