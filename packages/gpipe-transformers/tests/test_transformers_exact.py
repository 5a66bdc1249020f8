"""A pipelined Hugging Face causal LM trains to the model's own numbers: its loss, its
gradients and its logits, in float64, for each family, attention, schedule and checkpoint
mode, in one process."""

from __future__ import annotations

import copy
from typing import get_args

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpipe_core import CheckpointMode
from gpipe_transformers import pipeline
from hf_support.models import (
    FAMILIES,
    batch,
    largest_grad_difference,
    model,
    reference,
    reference_loss,
)

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []
TOLERANCE = 1e-10
#: Every checkpoint mode of the pipeline.
MODES: tuple[str, ...] = get_args(CheckpointMode)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_step_and_logits_equal_the_models(family: str, attn: str) -> None:
    built = model(family, attn=attn)
    data = batch(0)
    plain, loss, logits = reference(built, data)
    pipe = pipeline(built, balance=[1, 3], chunks=3)
    losses = pipe.step(**data, schedule="1f1b")
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain, family) < TOLERANCE
    # transformers' own loss (computed in float32) agrees to float32's precision.
    own = plain(**data).loss
    assert abs(losses.reduced().item() - own.item()) < 1e-5
    out = pipe(input_ids=data["input_ids"], attention_mask=data["attention_mask"])
    assert (out - logits).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"])
def test_every_schedule_and_checkpoint_mode(schedule: str, checkpoint: str) -> None:
    built = model("llama", layers=4)
    data = batch(2, size=8)
    plain, loss, _ = reference(built, data)
    several = schedule in ("interleaved-1f1b", "zb-h1", "zbv")
    placement = "v" if schedule == "zbv" else "loop" if several else None
    pipe = pipeline(
        built, balance=[1, 1, 1, 1] if several else [2, 2], chunks=4, checkpoint=checkpoint,
        devices=["cpu", "cpu"] if several else None, placement=placement,
    )  # fmt: skip
    losses = pipe.step(**data, schedule=schedule)
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain) < TOLERANCE


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(FAMILIES),
    layers=st.integers(1, 5),
    parts=st.integers(1, 3),
    data=st.data(),
    chunks=st.integers(1, 6),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    checkpoint=st.sampled_from(MODES),
    tie=st.booleans(),
    attn=st.sampled_from(["eager", "sdpa"]),
    seed=st.integers(0, 2**16),
    size=st.integers(1, 7),
    length=st.integers(2, 12),
)
def test_random_models_splits_and_batches(
    family: str, layers: int, parts: int, data: st.DataObject, chunks: int, schedule: str,
    checkpoint: str, tie: bool, attn: str, seed: int, size: int, length: int,
) -> None:  # fmt: skip
    # Random models (layers, tied or not, attention), balances (empty partitions too),
    # micro-batches, checkpoint modes and padded batches.
    built = model(family, seed=seed, layers=layers, attn=attn, tie_word_embeddings=tie)
    cuts = sorted(
        data.draw(st.lists(st.integers(0, layers), min_size=parts - 1, max_size=parts - 1))
    )
    balance = [b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True)]
    assume(all(balance[1:-1]))  # a partition between the first and the last holds a layer
    batch_data = batch(seed, size=size, length=length)
    plain, loss, _ = reference(built, batch_data)
    pipe = pipeline(built, balance=balance, chunks=chunks, checkpoint=checkpoint)  # type: ignore[arg-type]
    losses = pipe.step(**batch_data, schedule=schedule)
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain, family) < TOLERANCE


def test_position_ids_and_a_length_that_changes_between_steps() -> None:
    built = model("qwen2")
    plain = copy.deepcopy(built)
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    for length in (5, 9, 3):
        data = batch(length, size=4, length=length)
        positions = torch.arange(length).repeat(4, 1) + 2
        logits = plain(
            input_ids=data["input_ids"],
            attention_mask=data["attention_mask"],
            position_ids=positions,
        ).logits
        loss = reference_loss(logits, data["labels"])
        loss.backward()
        losses = pipe.step(**data, position_ids=positions)
        assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
        assert largest_grad_difference(built, plain) < TOLERANCE


def test_dropout_is_replayed_under_checkpointing() -> None:
    # Every dropout on one worker (the head alone on the second partition) and one
    # micro-batch: the pipeline draws its masks in the plain model's order, and a
    # checkpointed forward's recomputation must draw the same ones again, so the gradients
    # equal the plain model's from the same seed.
    built = model("gpt2", dropout=0.3)
    plain = copy.deepcopy(built)
    data = batch(3)
    torch.manual_seed(7)
    logits = plain(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    reference_loss(logits, data["labels"]).backward()
    pipe = pipeline(built, balance=[4, 0], chunks=1, checkpoint="always")
    torch.manual_seed(7)
    pipe.step(**data)
    assert largest_grad_difference(built, plain) < TOLERANCE
    assert any(p.grad.abs().sum() > 0 for p in built.parameters() if p.grad is not None)


def test_eval_mode_drops_nothing_and_matches_the_model() -> None:
    built = model("gpt2", dropout=0.5)
    built.eval()
    data = batch(4)
    plain, loss, _ = reference(built, data)
    pipe = pipeline(built, balance=[3, 1], chunks=2)
    pipe.eval()
    losses = pipe.step(**data)
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain) < TOLERANCE
