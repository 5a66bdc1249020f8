"""The forward pass's output works with all of autograd's entry points, as the plain model's.

``torch.autograd.grad`` and ``.backward(inputs=...)`` differentiate only toward what they
are asked for; checkpointed micro-batches must give their share there too (the
checkpointed node takes the partition's parameters as inputs). Second-order gradients
cannot pass through a recomputation cut at its input: they are refused, never wrong.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core_support.models import MODES
from gpipe_core import GPipe


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Dropout(0.3), nn.Linear(4, 2)
    ).double()


def pair(checkpoint: str, chunks: int) -> tuple[GPipe, nn.Sequential]:
    plain = model()
    return GPipe(copy.deepcopy(plain), [2, 2, 1], chunks=chunks, checkpoint=checkpoint), plain


def outputs(pipe: GPipe, plain: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' losses on ``x``, with the same dropout masks."""
    torch.manual_seed(1)
    mine = pipe(x).pow(2).sum()
    torch.manual_seed(1)
    theirs = torch.cat([plain(micro) for micro in x.chunk(pipe.chunks)]).pow(2).sum()
    return mine, theirs


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("checkpoint", MODES)
def test_autograd_grad_toward_the_parameters(checkpoint: str, chunks: int) -> None:
    pipe, plain = pair(checkpoint, chunks)
    x = torch.randn(6, 4, dtype=torch.float64)
    mine, theirs = outputs(pipe, plain, x)
    got = torch.autograd.grad(mine, list(pipe.parameters()))
    expected = torch.autograd.grad(theirs, list(plain.parameters()))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert all(p.grad is None for p in pipe.parameters())  # nothing accumulated


@pytest.mark.parametrize("checkpoint", MODES)
def test_autograd_grad_toward_the_input_and_one_weight(checkpoint: str) -> None:
    pipe, plain = pair(checkpoint, 3)
    x = torch.randn(6, 4, dtype=torch.float64)
    x_mine, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    mine = outputs(pipe, plain, x_mine)[0]
    theirs = outputs(pipe, plain, x_theirs)[1]
    got = torch.autograd.grad(mine, [x_mine, pipe[2].weight])
    expected = torch.autograd.grad(theirs, [x_theirs, plain[2].weight])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("checkpoint", MODES)
def test_backward_with_inputs_fills_only_those(checkpoint: str) -> None:
    pipe, plain = pair(checkpoint, 3)
    x = torch.randn(6, 4, dtype=torch.float64)
    mine, theirs = outputs(pipe, plain, x)
    mine.backward(inputs=[pipe[0].weight, pipe[4].bias])
    theirs.backward(inputs=[plain[0].weight, plain[4].bias])
    torch.testing.assert_close(pipe[0].weight.grad, plain[0].weight.grad)
    torch.testing.assert_close(pipe[4].bias.grad, plain[4].bias.grad)
    assert pipe[0].bias.grad is None and pipe[2].weight.grad is None


@pytest.mark.parametrize("checkpoint", MODES)
def test_retain_graph_twice_accumulates_like_plain(checkpoint: str) -> None:
    pipe, plain = pair(checkpoint, 3)
    x = torch.randn(6, 4, dtype=torch.float64)
    mine, theirs = outputs(pipe, plain, x)
    for _ in range(2):
        mine.backward(retain_graph=True)
        theirs.backward(retain_graph=True)
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_second_order_through_checkpoints_is_refused(checkpoint: str) -> None:
    pipe, _ = pair(checkpoint, 3)
    x = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad(pipe(x).pow(2).sum(), list(pipe.parameters()), create_graph=True)
    # The model is still usable.
    pipe(x).sum().backward()
    assert pipe[0].weight.grad is not None


def test_second_order_without_checkpointing_matches_plain() -> None:
    pipe, plain = pair("never", 3)
    x = torch.randn(6, 4, dtype=torch.float64)
    penalties = []
    for module, loss in zip((pipe, plain), outputs(pipe, plain, x), strict=True):
        grads = torch.autograd.grad(loss, list(module.parameters()), create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        penalties.append(torch.autograd.grad(penalty, list(module.parameters())))
    for g, e in zip(*penalties, strict=True):
        torch.testing.assert_close(g, e)
