"""Checks that several distributed test modules share (on the tests' path through the
``pythonpath`` option of pytest's configuration): the ranks' numbers against the plain
model's, and the errors ranks that disagree raise."""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import torch
from torch import nn

#: Every error here comes at once, well within the ranks' timeout (30 s): a wait for the
#: timeout would take longer than this.
PROMPT = 20.0


def plain_name(name: str) -> str:
    """A parameter's name on a rank's pipeline: the plain module's (``<layer>.<rest>``)."""
    assert not name.startswith("partitions."), name
    return name


def expected_steps(
    cases: ModuleType,
    layers: tuple[str, ...],
    seed: int,
    batches: list[int],
    chunks: int,
) -> tuple[list[dict[str, Any]], nn.Module]:
    """The plain model's losses and gradients per step (each micro-batch's loss scaled by
    its share of the batch, as a step does), and the model whose running statistics saw
    each whole batch."""
    per_micro = cases.build(layers, seed)
    whole = copy.deepcopy(per_micro)
    steps = []
    for k, batch in enumerate(batches):
        x, y = cases.data(seed + k, batch)
        x.requires_grad_(True)
        for p in per_micro.parameters():
            p.grad = None
        losses = []
        for xi, yi in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            loss = nn.MSELoss()(per_micro(xi), yi)
            (loss * len(xi) / batch).backward()
            losses.append(loss.item())
        with torch.no_grad():
            whole(x)
        steps.append(
            {
                "losses": losses,
                "grads": {name: p.grad.clone() for name, p in per_micro.named_parameters()},
                "input_grad": x.grad.clone(),
                "whole_loss": nn.MSELoss()(whole.eval()(x), y).item()
                if "bn" not in layers
                else None,
            }
        )
        whole.train()
    return steps, whole


def check_steps(cases: ModuleType, results: list[dict[str, Any]], **spec: Any) -> None:
    """Every rank's losses, the gradients of each rank's parameters and the first rank's
    input gradient equal the plain model's."""
    layers, seed, batches, chunks = spec["layers"], spec["seed"], spec["batches"], spec["chunks"]
    expected, whole = expected_steps(cases, layers, seed, batches, chunks)
    for k, want in enumerate(expected):
        grads: dict[str, torch.Tensor | None] = {}
        for rank, result in enumerate(results):
            got = result["steps"][k]
            torch.testing.assert_close(got["losses"], want["losses"], msg=f"rank {rank}")
            if want["whole_loss"] is not None:
                torch.testing.assert_close(got["reduced"], want["whole_loss"])
            for name, grad in got["grads"].items():
                assert plain_name(name) not in grads, f"{name} on two ranks"
                grads[plain_name(name)] = grad
        assert grads.keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            assert grads[name] is not None, name
            torch.testing.assert_close(grads[name], grad, msg=name)
        torch.testing.assert_close(results[0]["steps"][k]["input_grad"], want["input_grad"])
    # Buffers (running statistics) of each rank's layers, under the plain keys.
    state = whole.state_dict()
    for result in results:
        for key, value in result["buffers"].items():
            if "running" in key or "num_batches" in key:
                torch.testing.assert_close(value, state[key], msg=key)


def check_alike(cases: ModuleType, results: list[dict[str, Any]], seed: int = 9) -> None:
    """The step after the failure: the plain model's loss and gradients on every rank."""
    model = cases.build(cases.AGREE_LAYERS, seed)
    x, y = cases.data(seed, 4)
    per_micro = [
        nn.MSELoss()(model(xi), yi) * len(xi) / 4 for xi, yi in zip(x.chunk(2), y.chunk(2))
    ]
    torch.autograd.backward(per_micro)
    expected = {name: p.grad for name, p in model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        torch.testing.assert_close(result["reduced"], sum(loss.item() for loss in per_micro))
        grads.update(result["grads"])  # the plain module's names
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def same_value_error(results: list[dict[str, Any]], message: str) -> None:
    """Every rank raised the same ValueError, ``message``, at once."""
    for rank, result in enumerate(results):
        error = result["error"]
        assert error.get("is_value_error"), (rank, error)
        assert error["type"] == "RanksDisagree", (rank, error)
        assert error["message"] == message, (rank, error["message"])
        assert result["seconds"] < PROMPT, (rank, result["seconds"])
