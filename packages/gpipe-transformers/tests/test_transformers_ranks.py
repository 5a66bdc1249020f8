"""A Hugging Face causal LM pipelined over two gloo ranks trains to the model's own loss
and gradients, for each family and every schedule."""

from __future__ import annotations

import pytest

from hf_support.models import FAMILIES
from hf_support.ranks import run

TOLERANCE = 1e-10


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_equal_the_model(family: str) -> None:
    results = run(
        "exact",
        family=family,
        schedules=("gpipe", "1f1b"),
        attn="eager" if family == "gpt2" else "sdpa",
    )
    for rank, found in enumerate(results):
        for schedule in ("gpipe", "1f1b"):
            loss, grad = found[schedule]
            assert loss < TOLERANCE, (rank, schedule, loss)
            assert grad < TOLERANCE, (rank, schedule, grad)
    assert results[-1]["logits"] < TOLERANCE


@pytest.mark.parametrize(
    ("schedules", "placement", "checkpoint"),
    [
        (("interleaved-1f1b", "zb-h1"), "loop", "always"),
        (("zbv",), "v", "never"),
        (("gpipe", "1f1b"), None, "never"),
    ],
)
def test_two_ranks_several_partitions_each(
    schedules: tuple[str, ...], placement: str | None, checkpoint: str
) -> None:
    results = run(
        "exact", family="llama", schedules=schedules, placement=placement,
        checkpoint=checkpoint, chunks=4,
    )  # fmt: skip
    for rank, found in enumerate(results):
        for schedule in schedules:
            loss, grad = found[schedule]
            assert loss < TOLERANCE and grad < TOLERANCE, (rank, schedule, loss, grad)


@pytest.mark.parametrize(("skipped", "balance"), [([1], [2, 2]), ([2, 3], [3, 1])])
def test_two_ranks_pass_over_the_layers_the_family_passes_over(
    skipped: list[int], balance: list[int]
) -> None:
    # Mllama's cross-attention layers, without images: one in the middle of the first
    # rank's partition; the last rank's whole partition and the layer before it. Its head
    # casts the logits to float32, so the loss (a sum over micro-batches) differs from the
    # whole batch's at float32's rounding; the gradients are float64's.
    results = run("passed_over", skipped=skipped, balance=balance)
    for rank, found in enumerate(results):
        for schedule in ("gpipe", "1f1b"):
            loss, grad, unlike = found[schedule]
            assert loss < 1e-6 and grad < TOLERANCE, (rank, schedule, loss, grad)
            assert unlike == [], (rank, schedule, unlike)


def test_data_parallel_replicas_average_over_the_whole_batchs_labels() -> None:
    # The replicas' label counts differ; the step's gradients are the whole batch's token
    # mean's only if the count is summed over the replicas before any gradient is scaled.
    results = run("data_parallel", family="llama")
    for found in results:
        assert found["grad"] < TOLERANCE, found


def test_two_ranks_take_the_models_loss_and_head_keywords() -> None:
    # logits_to_keep travels from the first rank's embeddings to the last rank's head;
    # the loss's keywords are the last rank's.
    results = run("keywords")
    for found in results:
        assert found["loss"] < TOLERANCE and found["grad"] < TOLERANCE, found
    assert results[-1]["logits"] < TOLERANCE
