"""The causal LM's keywords in a pipeline: those of its loss (``num_items_in_batch``,
``shift_labels``) and of its head (``logits_to_keep``) give the model's numbers, in
float64; every other keyword of its forward that a pipeline does not honour is refused by
name before anything runs."""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
from torch.nn import functional as F

from gpipe_transformers import pipeline
from hf_support.models import FAMILIES, VOCAB, batch, largest_grad_difference, model

TOLERANCE = 1e-10


def _logits(
    plain: torch.nn.Module, data: dict[str, torch.Tensor], **keywords: object
) -> torch.Tensor:
    out = plain(input_ids=data["input_ids"], attention_mask=data["attention_mask"], **keywords)
    return out.logits  # type: ignore[no-any-return]


def _summed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross entropy of ``logits`` against ``targets`` (already shifted), summed over
    the targets that are not -100."""
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )


def _shift_labels(data: dict[str, torch.Tensor], seed: int = 5) -> torch.Tensor:
    """Targets of each position that are not the next label: another sequence, some -100."""
    generator = torch.Generator().manual_seed(seed)
    labels = data["labels"]
    shifted = torch.randint(3, VOCAB, labels.shape, generator=generator)
    return shifted.masked_fill(torch.rand(labels.shape, generator=generator) < 0.3, -100)


@pytest.mark.parametrize("shift", [False, True], ids=["labels", "shift_labels"])
@pytest.mark.parametrize("items", [None, 100, "tensor"], ids=["no-items", "int", "0-dim"])
def test_the_losss_keywords_give_the_models_loss_and_gradients(
    items: int | str | None, shift: bool
) -> None:
    built = model("llama")
    plain = copy.deepcopy(built)
    data = batch(0, size=6)
    keywords: dict[str, object] = {}
    if items is not None:
        keywords["num_items_in_batch"] = torch.tensor(100) if items == "tensor" else items
    logits = _logits(plain, data)
    if shift:
        keywords["shift_labels"] = targets = _shift_labels(data)
    else:
        targets = data["labels"][:, 1:]
        logits = logits[:, :-1]
    total = _summed(logits, targets)
    loss = total / (100 if items is not None else (targets != -100).sum())
    loss.backward()
    with torch.no_grad():  # transformers' own loss (in float32) is the one built here
        own = plain(**data, **keywords).loss
    assert abs(own.item() - loss.item()) < 1e-5
    pipe = pipeline(built, balance=[2, 2], chunks=3)
    losses = pipe.step(**data, **keywords, schedule="1f1b")  # type: ignore[arg-type]
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain) < TOLERANCE


def test_num_items_in_batch_that_is_no_count_is_refused() -> None:
    pipe = pipeline(model("llama"), balance=[2, 2])
    data = batch(0)
    for items, needle in (
        (torch.ones(2), "num_items_in_batch must be an int or a 0-dimensional tensor"),
        (0, "num_items_in_batch must be positive"),
    ):
        with pytest.raises((TypeError, ValueError), match=re.escape(needle)):
            pipe.step(**data, num_items_in_batch=items)
    with pytest.raises(TypeError, match=r"num_items_in_batch .*labels"):
        pipe.step(input_ids=data["input_ids"], num_items_in_batch=10)


@pytest.mark.parametrize(
    "keep",
    [1, 3, "positions", "per-sample", "mask"],
)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_logits_to_keep_gives_the_models_logits(family: str, keep: int | str) -> None:
    built = model(family, attn="eager")
    data = batch(1, size=6, length=8)
    value: object = keep
    if keep == "positions":
        value = torch.tensor([0, 2, 5])
    elif keep == "per-sample":
        value = torch.stack([torch.tensor([row % 8, 7]) for row in range(6)])
    elif keep == "mask":
        value = data["attention_mask"].bool()
    with torch.no_grad():
        expected = _logits(built, data, logits_to_keep=value)
        pipe = pipeline(built, balance=[1, 3], chunks=3)
        out = pipe(
            input_ids=data["input_ids"], attention_mask=data["attention_mask"],
            logits_to_keep=value,
        )  # fmt: skip
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() < TOLERANCE


def test_logits_to_keep_in_steps_loss_with_shift_labels() -> None:
    # The model's loss is over the logits it keeps: with shift_labels of their shape.
    built = model("qwen2")
    plain = copy.deepcopy(built)
    data = batch(2, size=6)
    positions = torch.tensor([1, 4, 8])
    shift = _shift_labels(data)[:, :3]
    logits = _logits(plain, data, logits_to_keep=positions)
    loss = _summed(logits, shift) / (shift != -100).sum()
    loss.backward()
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    losses = pipe.step(**data, logits_to_keep=positions, shift_labels=shift)
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain) < TOLERANCE


#: The keywords of a causal LM's forward that a pipeline honours, and the test that shows it.
HONOURED = {
    "input_ids": "test_transformers_exact",
    "attention_mask": "test_transformers_exact",
    "position_ids": "test_position_ids_and_a_length_that_changes_between_steps",
    "inputs_embeds": "passed to the base model's forward, as the family's own code",
    "token_type_ids": "passed to the base model's forward (GPT-2), as the family's own code",
    "encoder_hidden_states": "passed to the base model's forward (GPT-2, which refuses it "
    "without cross-attention layers)",
    "encoder_attention_mask": "as encoder_hidden_states",
    "labels": "step(): test_transformers_exact; refused by forward",
    "logits_to_keep": "test_logits_to_keep_gives_the_models_logits",
    "num_items_in_batch": "test_the_losss_keywords_give_the_models_loss_and_gradients",
    "shift_labels": "test_the_losss_keywords_give_the_models_loss_and_gradients",
    "use_cache": "False is the pipeline's own; True is refused (test below)",
}


def _keywords(built: torch.nn.Module) -> list[str]:
    """Every keyword of the causal LM's forward and of its base model's, and those their
    ``**kwargs`` take (transformers' ``TransformersKwargs``)."""
    from transformers.utils.generic import TransformersKwargs

    base = getattr(built, built.base_model_prefix)
    names: list[str] = []
    for forward in (type(built).forward, type(base).forward):
        for parameter in inspect.signature(forward).parameters.values():
            if parameter.name != "self" and parameter.kind not in (
                parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL,
            ):  # fmt: skip
                names.append(parameter.name)
    names.extend(TransformersKwargs.__annotations__)
    return list(dict.fromkeys(names))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_keyword_of_the_forward_is_honoured_or_refused_by_name(family: str) -> None:
    built = model(family)
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    data = batch(0)
    calls: list[int] = []
    built.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    names = _keywords(built)
    assert {"input_ids", "labels", "logits_to_keep", "num_items_in_batch"} <= set(names)
    refused = [name for name in names if name not in HONOURED] + ["use_cache", "no_such_keyword"]
    assert "cache" in refused or "past_key_values" in refused
    for name in refused:
        given = {name: True}
        with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
            pipe(input_ids=data["input_ids"], **given)
        with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
            pipe.step(**data, **given)
    # And the loss's keywords in forward, which returns the logits only.
    for name, value in (("num_items_in_batch", 10), ("shift_labels", data["labels"])):
        with pytest.raises(TypeError, match=rf"{name} .*step\(\)"):
            pipe(input_ids=data["input_ids"], **{name: value})
    assert calls == []  # refused before anything ran
    assert all(p.grad is None for p in built.parameters())
