"""Tests of the fork/join ordering edges (the phony tensors are gpipe_microbatch's)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpipe_core.run._dependency import Fork, Join, fork, join


def order(first: torch.Tensor, then: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``first`` and ``then`` with an edge: ``first``'s producer runs after ``then``'s consumer.

    A phony is forked off ``first`` and joined to ``then``, as a pipeline orders the
    backward passes of two micro-batches.
    """
    first, phony = fork(first)
    return first, join(then, phony)


class Log(torch.autograd.Function):
    """An identity whose backward appends its name to a list."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, name: str, log: list[str]) -> torch.Tensor:  # type: ignore[override]
        ctx.name = name
        ctx.log = log
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        ctx.log.append(ctx.name)
        return grad, None, None


# -- fork / join ------------------------------------------------------------------------


def test_fork_join_values_and_gradient() -> None:
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    x2, phony = fork(x * 2)
    assert phony.numel() == 0
    assert phony.requires_grad
    y2 = join(y * 3, phony)
    assert torch.equal(x2, x.detach() * 2)
    assert torch.equal(y2, y.detach() * 3)
    (x2.sum() + y2.sum()).backward()
    assert x.grad is not None and y.grad is not None
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert torch.equal(y.grad, torch.full((3,), 3.0))


def test_fork_join_create_autograd_nodes() -> None:
    x = torch.randn(2, requires_grad=True)
    y = torch.randn(2, requires_grad=True)
    x2, phony = fork(x)
    y2 = join(y, phony)
    assert type(x2.grad_fn).__name__ == "ForkBackward"
    assert type(y2.grad_fn).__name__ == "JoinBackward"
    # The join's backward feeds the fork's node.
    next_nodes = [node for node, _ in y2.grad_fn.next_functions if node is not None]
    assert x2.grad_fn in next_nodes or phony.grad_fn in next_nodes


def test_fork_join_make_no_edge_without_grad() -> None:
    x = torch.randn(2, requires_grad=True)
    y = torch.randn(2, requires_grad=True)
    with torch.no_grad():
        x2, phony = fork(x)
        y2 = join(y, phony)
    assert x2 is x
    assert not phony.requires_grad
    assert phony.grad_fn is None
    assert y2 is y


def test_fork_join_make_no_edge_for_tensors_without_grad() -> None:
    x = torch.randn(2)
    y = torch.randn(2)
    x2, phony = fork(x)
    assert x2 is x
    assert phony.grad_fn is None
    assert not phony.requires_grad
    assert join(y, phony) is y


def test_join_with_phony_requiring_grad() -> None:
    x = torch.randn(2, requires_grad=True)
    _, phony = fork(x)
    y = torch.randn(2)  # does not require grad itself
    y2 = join(y, phony)
    assert y2.requires_grad
    assert torch.equal(y2, y)


def test_join_backward_runs_the_forked_producer() -> None:
    """With the edge, a backward pass from the joined branch alone reaches the forked one."""
    for with_edge in (False, True):
        log: list[str] = []
        a = torch.randn(2, requires_grad=True)
        b = torch.randn(2, requires_grad=True)
        a1 = Log.apply(a, "a", log)
        b1 = Log.apply(b, "b", log)
        if with_edge:
            a1, b1 = order(a1, b1)
        b1.sum().backward()
        assert b.grad is not None
        if with_edge:
            assert log == ["b", "a"]
            # Only an empty gradient reaches a: the edge carries no value.
            assert a.grad is not None
            assert torch.equal(a.grad, torch.zeros(2))
        else:
            assert log == ["b"]
            assert a.grad is None


def _two_branches(with_edge: bool) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Two independent branches; b's consumer is created in another thread.

    Autograd numbers nodes per thread and runs the ready node with the highest number
    first, so without an edge a's producer (numbered in this busy thread) runs before b's
    consumer (numbered from zero in a fresh thread).
    """
    log: list[str] = []
    a = torch.randn(2, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    for _ in range(64):  # make sure this thread's node numbers are well above zero
        _ = a * 1
    a1 = Log.apply(a, "a producer", log)
    b1 = Log.apply(b, "b producer", log)
    if with_edge:
        a1, b1 = order(a1, b1)

    consumed: dict[str, torch.Tensor] = {}

    def consume() -> None:
        consumed["b"] = Log.apply(b1 * 3, "b consumer", log)

    thread = threading.Thread(target=consume)
    thread.start()
    thread.join()
    loss = (a1 * 2).sum() + consumed["b"].sum()
    loss.backward()
    assert a.grad is not None and b.grad is not None
    return log, a.grad, b.grad


def test_fork_join_orders_backward() -> None:
    log, _, _ = _two_branches(with_edge=True)
    assert sorted(log) == ["a producer", "b consumer", "b producer"]
    # a's producer runs only after b's consumer.
    assert log.index("b consumer") < log.index("a producer")


def test_without_the_edge_the_order_is_different() -> None:
    # The control for test_fork_join_orders_backward: the setup does not give the order by itself.
    log, _, _ = _two_branches(with_edge=False)
    assert log.index("a producer") < log.index("b consumer")


def test_fork_join_change_no_values() -> None:
    torch.manual_seed(0)
    _, grad_a_plain, grad_b_plain = _two_branches(with_edge=False)
    torch.manual_seed(0)
    _, grad_a_edge, grad_b_edge = _two_branches(with_edge=True)
    assert torch.equal(grad_a_plain, grad_a_edge)
    assert torch.equal(grad_b_plain, grad_b_edge)
    assert torch.equal(grad_a_edge, torch.full((2,), 2.0))
    assert torch.equal(grad_b_edge, torch.full((2,), 3.0))


def test_fork_and_join_functions_directly() -> None:
    x = torch.randn(3, requires_grad=True)
    out, phony = Fork.apply(x)
    assert torch.equal(out, x)
    assert phony.numel() == 0
    joined = Join.apply(torch.ones(3, requires_grad=True), phony)
    (out.sum() + joined.sum()).backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.ones(3))
