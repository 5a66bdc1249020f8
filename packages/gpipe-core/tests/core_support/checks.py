"""GPipe against the plain model: the same outputs and the same gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_core import GPipe


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an output: the tensor itself, or those of a tuple."""
    return list(value) if isinstance(value, tuple) else [value]


def _sum(output: Any) -> torch.Tensor:
    return output.sum()


def assert_matches_plain(
    pipe: GPipe,
    plain: nn.Module,
    x: Any,
    *,
    input_requires_grad: bool = True,
    feed: Callable[[torch.Tensor], Any] | None = None,
    loss: Callable[[Any], torch.Tensor] = _sum,
    weighted: bool = False,
    device: torch.device | str | None = None,
) -> tuple[Any, Any]:
    """Run ``pipe`` and ``plain`` on clones of ``x``, backward both, compare everything.

    Clears the parameters' grads first, so that only this run's are compared. Then checks:
    the outputs (and their ``requires_grad``), the grads of the inputs, and the grad of
    every parameter, which must exist. Returns ``(output, expected)`` for further checks.

    ``feed`` builds the model input from the cloned tensor (``(labels, x)`` for instance);
    ``loss`` maps an output to the scalar to backward (the sum by default); ``weighted``
    backwards the sum of the output times a random weight drawn after the forward pass;
    ``device`` is where both clones of ``x`` go (the plain model must be there too).
    """
    for module in (pipe, plain):
        for p in module.parameters():
            p.grad = None

    x = x.detach() if device is None else x.detach().to(device)
    x_plain = x.clone().requires_grad_(input_requires_grad)
    x_pipe = x.clone().requires_grad_(input_requires_grad)
    expected = plain(feed(x_plain) if feed else x_plain)
    output = pipe(feed(x_pipe) if feed else x_pipe)

    assert type(output) is type(expected)
    got, want = _tensors(output), _tensors(expected)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.to(w.device), w)
        assert g.requires_grad == w.requires_grad
    if not any(w.requires_grad for w in want):
        return output, expected  # a model without parameters, on an input without grad

    if weighted:
        weight = torch.randn_like(expected)
        (expected * weight).sum().backward()
        (output * weight.to(output.device)).sum().backward()
    else:
        loss(expected).backward()
        loss(output).backward()

    if input_requires_grad:
        assert x_pipe.grad is not None
        torch.testing.assert_close(x_pipe.grad.to(x_plain.device), x_plain.grad)
    else:
        assert x_pipe.grad is None and x_plain.grad is None
    pipe_params = list(pipe.named_parameters())
    plain_params = list(plain.parameters())
    assert len(pipe_params) == len(plain_params)
    for (name, p_pipe), p_plain in zip(pipe_params, plain_params):
        assert p_pipe.grad is not None, name
        assert p_pipe.grad.device == p_pipe.device, name
        torch.testing.assert_close(p_pipe.grad.to(p_plain.device), p_plain.grad, msg=name)
    return output, expected
