"""Keyword inputs (issue 36, item 4): ``model(x=..., mask=...)``, ``model(**batch)`` and
``step(**batch, target=..., loss_fn=...)`` call the first layer with keyword arguments,
micro-batched like positional ones (tensors split, ``NoChunk`` and other values whole), in
every checkpoint mode, equal to the plain model in float64."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

from core_support.models import MODES, ToDict, mapping_model
from gpipe_core import GPipe, NoChunk, PipeSequential

WIDTH = 4


def plain_call(model: nn.Sequential, *args: Any, **keywords: Any) -> Any:
    """The plain model, its first layer called with keywords."""
    layers = iter(model)
    value = next(layers)(*args, **keywords)
    for layer in layers:
        value = layer(value)
    return value


def _assert_grads(pipe: nn.Module, plain: nn.Module) -> None:
    for (name, got), want in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12, msg=name)


def _data(batch: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, WIDTH, dtype=torch.double, generator=generator)
    mask = torch.randint(0, 2, (batch, WIDTH), generator=generator).double()  # per sample
    y = torch.randn(batch, WIDTH, dtype=torch.double, generator=generator)
    return x, mask, y


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("how", ["keywords", "positional and keyword", "dict batch"])
def test_keyword_inputs_match_plain(checkpoint: str, how: str) -> None:
    plain = mapping_model(WIDTH, seed=2)
    pipe = GPipe(copy.deepcopy(plain), [1, 2, 2], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    x, mask, y = _data()
    batch = {"x": x, "mask": mask, "scale": 0.5}
    args: tuple[Any, ...] = ()
    keywords: dict[str, Any] = batch
    if how == "positional and keyword":
        args, keywords = (x,), {"mask": mask, "scale": 0.5}

    x.requires_grad_(True)
    out = pipe(*args, **keywords)
    want = plain_call(plain, *args, **keywords)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    got_grad = torch.autograd.grad(out.sum(), x)[0]
    want_grad = torch.autograd.grad(want.sum(), x)[0]
    torch.testing.assert_close(got_grad, want_grad)

    for schedule in ("gpipe", "1f1b"):
        pipe.zero_grad()
        plain.zero_grad()
        x.grad = None
        losses = pipe.step(*args, **keywords, target=y, loss_fn=nn.MSELoss(), schedule=schedule)
        assert list(losses.sizes) == [3, 3, 1]
        expected = nn.functional.mse_loss(plain_call(plain, *args, **keywords), y)
        torch.testing.assert_close(losses.reduced(), expected.detach(), rtol=1e-12, atol=1e-12)
        step_grad = x.grad
        x.grad = None
        expected.backward()
        _assert_grads(pipe, plain)
        torch.testing.assert_close(step_grad, x.grad)


@pytest.mark.timeout(60)
def test_nochunk_and_other_values_are_passed_whole_by_keyword() -> None:
    seen: list[tuple[Any, ...]] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor, *, weight: torch.Tensor, label: str) -> torch.Tensor:
            seen.append((len(x), weight.shape, label))
            return x * weight

    pipe = GPipe(nn.Sequential(Spy(), nn.Identity()), [1, 1], chunks=2)
    weight = torch.tensor([1.0, 2.0])
    out = pipe(torch.ones(4, 2), weight=NoChunk(weight), label="a")
    torch.testing.assert_close(out, torch.ones(4, 2) * weight)
    assert seen == [(2, torch.Size([2]), "a")] * 2


@pytest.mark.timeout(60)
def test_the_steps_own_keywords_are_not_passed_on() -> None:
    class Strict(nn.Module):
        def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

    pipe = GPipe(nn.Sequential(Strict(), nn.Linear(2, 1)), [1, 1], chunks=2)
    x, mask, y = torch.randn(4, 2), torch.ones(4, 2), torch.randn(4, 1)
    losses = pipe.step(x, mask=mask, target=y, loss_fn=nn.MSELoss(), schedule="1f1b")
    assert len(losses) == 2
    # The shorthand for one input takes keywords too.
    assert len(pipe.step(x, y, nn.MSELoss(), mask=mask)) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", MODES)
def test_a_checkpointed_first_partition_with_keywords_recomputes_exactly(checkpoint: str) -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(self.linear(x), 0.5) * mask

    torch.manual_seed(0)
    model = nn.Sequential(Noisy(), nn.Linear(WIDTH, WIDTH)).double()
    reference = GPipe(copy.deepcopy(model), [1, 1], chunks=3, checkpoint="never")
    pipe = GPipe(copy.deepcopy(model), [1, 1], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    x, mask, y = _data()
    for module in (reference, pipe):
        torch.manual_seed(5)
        module.step(x=x, mask=mask, target=y, loss_fn=nn.MSELoss())
    _assert_grads(pipe, reference)


@pytest.mark.timeout(60)
def test_pipe_sequential_takes_keywords() -> None:
    torch.manual_seed(0)
    model = PipeSequential(ToDict(WIDTH), nn.Identity()).double()
    pipe = GPipe(copy.deepcopy(model), [1, 1], chunks=2)
    x, mask, _ = _data(4)
    got, want = pipe(x, mask=mask), model(x, mask=mask)
    torch.testing.assert_close(got["hidden"], want["hidden"])
    assert type(got) is dict and list(got) == list(want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        (
            {"x": torch.zeros(4, 2), "mask": torch.zeros(3, 2)},
            ValueError,
            "mask has batch size 3, not the 4 of the other tensors of the inputs: every tensor "
            "split into micro-batches needs the same batch size; wrap mask in NoChunk(...) if "
            "it must not be split, to pass it whole to every micro-batch "
            "(batch sizes: x: 4, mask: 3)",
        ),
        (  # transformers' usual position ids: one row for every sample
            {"x": torch.zeros(4, 2), "position_ids": torch.arange(2)[None]},
            ValueError,
            "position_ids has batch size 1, not the 4 of the other tensors of the inputs: "
            "every tensor split into micro-batches needs the same batch size; wrap "
            "position_ids in NoChunk(...) if it must not be split",
        ),
        ({"x": torch.zeros(4, 2), "mask": torch.tensor(1.0)}, ValueError, "mask must have a batch"),
        ({"x": [torch.zeros(4, 2)]}, TypeError, "(x: list holding a tensor)"),
        ({"label": "a"}, TypeError, "(label: str)"),
    ],
)
def test_keyword_inputs_are_named_in_errors(
    keywords: dict[str, Any], error: type[Exception], message: str
) -> None:
    pipe = GPipe(nn.Sequential(nn.Identity(), nn.Identity()), [1, 1], chunks=2)
    for run in (
        lambda: pipe(**keywords),
        lambda: pipe.step(**keywords, target=torch.zeros(4, 2), loss_fn=nn.MSELoss()),
    ):
        with pytest.raises(error, match=re.escape(message)):
            run()


def test_a_positional_input_of_another_batch_size_is_named() -> None:
    pipe = GPipe(PipeSequential(nn.Identity(), nn.Identity()), [1, 1], chunks=2)
    x, position_ids = torch.zeros(4, 2), torch.arange(2)[None]
    message = (
        "inputs[1] has batch size 1, not the 4 of the other tensors of the inputs: every "
        "tensor split into micro-batches needs the same batch size; wrap inputs[1] in "
        "NoChunk(...) if it must not be split, to pass it whole to every micro-batch "
        "(batch sizes: inputs[0]: 4, inputs[1]: 1)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe(x, position_ids)
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe.step(x, position_ids, target=torch.zeros(4, 2), loss_fn=nn.MSELoss())


def test_an_empty_pipeline_refuses_keywords() -> None:
    with pytest.raises(TypeError, match=r"takes no keyword inputs \(keywords: \['x'\]\)"):
        GPipe(nn.Sequential(), [], chunks=2)(x=torch.zeros(2))
