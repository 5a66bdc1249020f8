"""What each rank of a test cluster runs (see :mod:`hf_support.ranks`): every case builds the
same tiny model on each rank, pipelines it over the ranks, and returns numbers to compare."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gpipe_transformers import pipeline
from hf_support.models import batch, largest_grad_difference, model, reference


def exact(
    rank: int,
    world: int,
    *,
    family: str,
    schedules: tuple[str, ...] = ("gpipe", "1f1b"),
    checkpoint: str = "except_last",
    chunks: int = 3,
    attn: str = "sdpa",
    placement: str | None = None,
    balance: list[int] | None = None,
    layers: int = 4,
) -> dict[str, Any]:
    """For each schedule, the difference of the pipeline's loss from the float64 reference
    (every rank gets it) and of this rank's gradients from the reference's; the last
    rank also the difference of the logits under ``torch.no_grad``."""
    torch.set_default_dtype(torch.float64)
    built = model(family, attn=attn, layers=layers)
    data = batch(1, size=8)
    plain, loss, logits = reference(built, data)
    pipe = pipeline(
        built, chunks=chunks, checkpoint=checkpoint,  # type: ignore[arg-type]
        group=dist.group.WORLD, placement=placement, balance=balance,
    )  # fmt: skip
    found: dict[str, Any] = {}
    for schedule in schedules:
        pipe.zero_grad(set_to_none=True)
        losses = pipe.step(**data, schedule=schedule)
        found[schedule] = (
            abs(losses.reduced().item() - loss.item()),
            largest_grad_difference(built, plain, family),
        )
    with torch.no_grad():
        out = pipe(input_ids=data["input_ids"], attention_mask=data["attention_mask"])
    found["logits"] = (out - logits).abs().max().item() if out is not None else None
    found["parameters"] = sum(p.numel() for p in pipe.parameters())
    return found


def names(rank: int, world: int, *, family: str) -> dict[str, Any]:
    """This rank's names of parameters and state-dict keys, the model's names of the
    tensors it holds (not on the meta device), how many elements it holds against the
    model's total, and whether a state dict of the whole model loads strictly."""
    torch.set_default_dtype(torch.float64)
    built = model(family)
    total = sum(p.numel() for p in built.parameters())
    whole = {key: value.clone() for key, value in built.state_dict().items()}
    pipe = pipeline(built, chunks=2, group=dist.group.WORLD)
    held = [n for n, p in built.named_parameters(remove_duplicate=False) if p.device.type != "meta"]
    loaded = pipe.load_state_dict(whole, strict=True)
    return {
        "parameters": [n for n, _ in pipe.named_parameters()],
        "state_dict": list(pipe.state_dict()),
        "held": held,
        "numel": sum(p.numel() for p in pipe.parameters()),
        "total": total,
        "loaded": (loaded.missing_keys, loaded.unexpected_keys),
        "drift": pipe.shared_drift(),
    }


def data_parallel(rank: int, world: int, *, family: str) -> dict[str, Any]:
    """Each rank a replica of a whole pipeline in its process, stepping on its half of a
    padded batch (different label counts): the loss and gradients of the step equal the
    plain model's on the whole batch (the token mean over both halves)."""
    torch.set_default_dtype(torch.float64)
    built = model(family)
    data = batch(3, size=8)
    data["labels"][:4, 3:] = -100  # the first half counts far fewer labels
    plain, loss, _ = reference(built, data)
    pipe = pipeline(built, balance=[2, 2], chunks=2, data_group=dist.group.WORLD)
    half = {key: value[rank * 4 : rank * 4 + 4] for key, value in data.items()}
    losses = pipe.step(**half, schedule="1f1b")
    total = torch.tensor([losses.reduced().item()])
    return {
        "loss": abs(total.item() - loss.item()),
        "grad": largest_grad_difference(built, plain, family),
    }
