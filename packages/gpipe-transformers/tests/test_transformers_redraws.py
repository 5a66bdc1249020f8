"""A Hugging Face model's own gradient checkpointing, with dropout, through the pipeline:
each recomputation of a decoder layer (torch's, in the backward pass) draws the attention
dropout masks of its first pass, under every checkpoint mode of the pipeline and both schedules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gpipe_transformers import pipeline
from hf_support.models import batch, model

Passes = dict[tuple[int, bytes], list[Tensor]]


def record_passes(built: nn.Module) -> Passes:
    """Record every decoder layer's attention output (where the dropout is) for each sample,
    by the sample's input, at every pass: first passes and recomputations (transformers
    checkpoints a layer's ``forward``, inside its hooks, so the attention's hooks see both)."""
    passes: Passes = {}

    def hook(index: int) -> Any:
        def record(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            for row, row_out in zip(hidden.detach(), out.detach(), strict=True):
                passes.setdefault((index, row.numpy().tobytes()), []).append(row_out.clone())

        return record

    for index, layer in enumerate(built.model.layers):  # type: ignore[union-attr]
        layer.self_attn.register_forward_hook(hook(index), with_kwargs=True)
    return passes


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_gradient_checkpointing_replays_dropout(
    checkpoint: str, schedule: str, reentrant: bool
) -> None:
    built = model("llama", dropout=0.3)
    built.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    passes = record_passes(built)
    pipe = pipeline(built, balance=[2, 2], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    for seed in range(3):
        pipe.step(**batch(seed, size=8))
    recomputed = [outputs for outputs in passes.values() if len(outputs) > 1]
    assert len(recomputed) >= len(passes) // 2  # torch's checkpoint recomputed the layers
    for outputs in recomputed:
        for again in outputs[1:]:
            torch.testing.assert_close(again, outputs[0], rtol=0, atol=0)
