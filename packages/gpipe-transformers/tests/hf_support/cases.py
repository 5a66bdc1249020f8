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


def passed_over(rank: int, world: int, *, skipped: list[int], balance: list[int]) -> dict[str, Any]:
    """Mllama's text model, its layers ``skipped`` (cross-attention layers, which its
    forward passes over without images), pipelined over the ranks: for each schedule, the
    difference of the loss from the float64 labels loss of the plain model's logits, of
    this rank's gradients from the plain model's, and the names of this rank's parameters
    whose gradient is None in one of them but not the other."""
    import copy

    from hf_support.sweep import build, labels_loss, padded_batch

    built = build("mllama", cross_attention_layers=skipped)
    data = padded_batch()
    plain = copy.deepcopy(built)
    inputs = {k: v for k, v in data.items() if k != "labels"}
    loss = labels_loss(plain(**inputs, use_cache=False).logits, data["labels"])
    loss.backward()
    theirs = dict(plain.named_parameters())
    pipe = pipeline(built, balance=balance, chunks=4, group=dist.group.WORLD)
    found: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        pipe.zero_grad(set_to_none=True)
        losses = pipe.step(**data, schedule=schedule)
        held = [(n, q.grad, theirs[n].grad) for n, q in pipe.named_parameters()]
        found[schedule] = (
            abs(losses.reduced().item() - loss.item()),
            max((abs(a - b).max().item() for _, a, b in held if a is not None and b is not None),
                default=0.0),
            sorted(n for n, a, b in held if (a is None) != (b is None)),
        )  # fmt: skip
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


def _grad_difference(pipe: Any, plain: Any, family: str) -> float:
    """The largest difference of this rank's gradients (the pipeline's, by the model's
    names) from ``plain``'s (a tied tensor found under either of its names)."""
    from hf_support.models import float32_inside

    theirs = dict(plain.named_parameters(remove_duplicate=False))
    largest = 0.0
    for name, parameter in pipe.named_parameters():
        if parameter.grad is None or parameter.is_meta:
            continue
        other = theirs[name].grad
        difference = (parameter.grad - other).abs().max().item()
        if float32_inside(family, name):
            assert difference <= 1e-6 * other.abs().max().item(), (name, difference)
            continue
        largest = max(largest, difference)
    return largest


def _read_by_ranks(folder: str, **options: Any) -> tuple[Any, list[str]]:
    """``from_pretrained(folder)`` at two micro-batches over the ranks, and the checkpoint
    keys this rank read."""
    from gpipe_transformers import _weights, from_pretrained

    read: list[str] = []
    reader = _weights.WeightFiles.read

    def reading(self: Any, key: str) -> torch.Tensor:
        read.append(key)
        return reader(self, key)

    _weights.WeightFiles.read = reading  # type: ignore[method-assign]
    try:
        pipe = from_pretrained(folder, chunks=2, group=dist.group.WORLD, **options)
    finally:
        _weights.WeightFiles.read = reader  # type: ignore[method-assign]
    return pipe, read


def from_pretrained_exact(rank: int, world: int, *, folder: str, family: str) -> dict[str, Any]:
    """A pipeline read by ``from_pretrained(folder)`` on the ranks against the model
    ``AutoModelForCausalLM.from_pretrained(folder)`` loads: this rank's materialised
    parameters against the model's total, the first step's loss and gradients, and the
    largest difference of the buffers this rank holds (rotary ``inv_freq``, embedding
    scales), and the checkpoint keys it read."""
    from transformers import AutoModelForCausalLM

    pipe, read = _read_by_ranks(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    loaded.train()
    data = batch(1, size=8)
    plain, loss, _ = reference(loaded, data)
    losses = pipe.step(**data, schedule="1f1b")
    buffers = dict(plain.named_buffers())
    held = [(n, b) for n, b in pipe.causal_lm.named_buffers() if not b.is_meta]
    return {
        "numel": sum(p.numel() for p in pipe.parameters() if not p.is_meta),
        "total": sum(p.numel() for p in plain.parameters()),
        "held": sorted(n for n, p in pipe.causal_lm.named_parameters() if not p.is_meta),
        "dtype": str(next(pipe.parameters()).dtype),
        "read": read,
        "loss": abs(losses.reduced().item() - loss.item()),
        "grad": _grad_difference(pipe, plain, family),
        "buffers": {n: (b - buffers[n]).abs().max().item() for n, b in held},
        "nan": [
            n for n, t in pipe.state_dict().items() if t.is_floating_point() and t.isnan().any()
        ],
    }


def pretrained_round_trip(
    rank: int,
    world: int,
    *,
    source: str,
    out: str,
    steps: int = 2,
    lr: float = 0.1,
    whole: bool = False,
) -> list[str]:
    """Read ``source`` with ``from_pretrained`` on the ranks (``whole``: load the whole
    model with transformers and pipeline it), train ``steps`` SGD steps on batches 1, 2,
    ..., and ``save_pretrained(out)``; this rank's state-dict keys."""
    from transformers import AutoModelForCausalLM

    from gpipe_transformers import from_pretrained

    if whole:
        loaded = AutoModelForCausalLM.from_pretrained(source)
        loaded.train()
        pipe = pipeline(loaded, chunks=2, group=dist.group.WORLD)
    else:
        pipe = from_pretrained(source, chunks=2, group=dist.group.WORLD)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        pipe.step(**batch(step + 1, size=8))
        optimizer.step()
    pipe.save_pretrained(out)
    return list(pipe.state_dict())


def save_replica(rank: int, world: int, *, out: str) -> list[str]:
    """Each rank a replica of a whole pipeline in its process (``data_group``), each calling
    ``save_pretrained(out)``: the first replica writes; the names of the files there when
    this rank's call returned."""
    torch.set_default_dtype(torch.float64)
    pipe = pipeline(model("llama"), balance=[2, 2], data_group=dist.group.WORLD)
    pipe.save_pretrained(out)
    from pathlib import Path

    return sorted(p.name for p in Path(out).glob("*")) if rank == 0 else []


def keywords(rank: int, world: int) -> dict[str, Any]:
    """A step with the loss's keywords (``shift_labels`` of the kept logits'
    positions, ``num_items_in_batch`` as a 0-dimensional tensor, ``logits_to_keep`` as a
    tensor of positions) and a forward with ``logits_to_keep``, pipelined over the ranks:
    the differences of the loss, of this rank's gradients and of the logits (the last
    rank's) from the float64 reference."""
    import copy

    from torch.nn import functional as F

    from hf_support.models import VOCAB

    torch.set_default_dtype(torch.float64)
    built = model("llama")
    plain = copy.deepcopy(built)
    data = batch(1, size=8)
    positions = torch.tensor([0, 4, 7])
    shift = data["labels"][:, [1, 5, 8]]
    inputs = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
    logits = plain(**inputs, logits_to_keep=positions).logits
    total = F.cross_entropy(
        logits.reshape(-1, VOCAB), shift.reshape(-1), ignore_index=-100, reduction="sum"
    )
    loss = total / 50
    loss.backward()
    pipe = pipeline(built, chunks=2, group=dist.group.WORLD)
    losses = pipe.step(
        **inputs, shift_labels=shift, num_items_in_batch=torch.tensor(50),
        logits_to_keep=positions, schedule="1f1b",
    )  # fmt: skip
    with torch.no_grad():
        out = pipe(**inputs, logits_to_keep=2)
        expected = plain(**inputs, logits_to_keep=2).logits
    return {
        "loss": abs(losses.reduced().item() - loss.item()),
        "grad": largest_grad_difference(built, plain),
        "logits": None if out is None else (out - expected).abs().max().item(),
    }


def tie_differs(rank: int, world: int) -> str:
    """Rank 0 builds a model whose embeddings are tied, rank 1 one whose are not: the
    message of the error building the pipeline raises on this rank."""
    torch.set_default_dtype(torch.float64)
    built = model("llama", tie_word_embeddings=rank == 0)
    try:
        pipeline(built, chunks=2, group=dist.group.WORLD)
    except Exception as error:  # the refusal, reported to the test
        return f"{type(error).__name__}: {error}"
    return ""


def prompts(seed: int, size: int = 8, length: int = 7) -> dict[str, torch.Tensor]:
    """Left-padded prompts of different lengths (at least 2 tokens each)."""
    from hf_support.models import VOCAB

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (size, length), generator=generator)
    mask = torch.ones(size, length, dtype=torch.long)
    for row in range(size):
        pad = int(torch.randint(0, length - 1, (1,), generator=generator))
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def generated(
    rank: int, world: int, *, family: str, chunks: int, options: dict[str, Any], seed: int = 0
) -> dict[str, Any]:
    """The sequences the pipeline over the ranks generates (every rank gets them), then the
    difference of a training step's loss from the float64 reference on the same pipeline."""
    torch.set_default_dtype(torch.float64)
    built = model(family, seed)
    data = batch(1, size=8)
    _, loss, _ = reference(built, data)  # before the pipeline frees other ranks' layers
    pipe = pipeline(built, chunks=chunks, group=dist.group.WORLD)
    pipe.eval()
    tokens = pipe.generate(**prompts(seed), **options)
    pipe.train()
    losses = pipe.step(**data)
    return {"tokens": tokens.tolist(), "loss": abs(losses.reduced().item() - loss.item())}


def generate_dies(rank: int, world: int, *, dying_rank: int) -> dict[str, Any]:
    """``dying_rank`` exits in the fourth new token; the other ranks must fail, not hang;
    what each raised."""
    import os

    torch.set_default_dtype(torch.float64)
    built = model("llama").eval()
    pipe = pipeline(built, chunks=2, group=dist.group.WORLD, timeout=30)
    if rank == dying_rank:
        calls = [0]

        def die(*_: object) -> None:
            calls[0] += 1
            if calls[0] > 6:
                os._exit(3)

        pipe.partitions[rank].register_forward_hook(die)
    try:
        pipe.generate(**prompts(0), max_new_tokens=8, do_sample=False)
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {}


def generate_disagrees(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 asks for other options: every rank is refused alike; then every rank generates
    alike, on the same pipeline."""
    torch.set_default_dtype(torch.float64)
    built = model("llama").eval()
    pipe = pipeline(built, chunks=2, group=dist.group.WORLD, timeout=30)
    found: dict[str, Any] = {}
    try:
        pipe.generate(**prompts(0), max_new_tokens=4, do_sample=False, top_k=3 + rank)
    except Exception as error:
        found["error"] = {"type": type(error).__name__, "message": str(error)}
    found["tokens"] = pipe.generate(**prompts(0), max_new_tokens=4, do_sample=False).tolist()
    return found


# Mixture-of-experts checkpoints (test_transformers_experts.py).


def experts_from_pretrained(
    rank: int, world: int, *, folder: str, out: str, lr: float = 0.1
) -> dict[str, Any]:
    """A pipeline read by ``from_pretrained(folder)`` on the ranks against the model
    ``AutoModelForCausalLM.from_pretrained(folder)`` loads (eager experts: float64): the
    largest difference of this rank's tensors from the model's, by the model's names, and
    those of another dtype; the checkpoint keys it read and the names it holds; the first
    step's loss and gradients against the model's; then one SGD step of ``lr`` and
    ``save_pretrained(out)``."""
    from transformers import AutoModelForCausalLM

    pipe, read = _read_by_ranks(folder, experts_implementation="eager")
    loaded = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    loaded.train()
    theirs = loaded.state_dict()
    held = {k: v for k, v in pipe.state_dict().items() if not v.is_meta}
    data = batch(1, size=8)
    plain, loss, _ = reference(loaded, data)
    losses = pipe.step(**data, schedule="1f1b")
    found = {
        "held": sorted(held),
        "read": read,
        "weights": max((v - theirs[k]).abs().max().item() for k, v in held.items()),
        "dtypes": [k for k, v in held.items() if v.dtype != theirs[k].dtype],
        "loss": abs(losses.reduced().item() - loss.item()),
        "grad": _grad_difference(pipe, plain, ""),
    }
    torch.optim.SGD(pipe.parameters(), lr=lr).step()
    pipe.save_pretrained(out)
    return found


# The router loss of mixtures of experts (test_transformers_router.py).


def router_exact(
    rank: int, world: int, *, family: str, chunks: tuple[int, ...] = (2, 4), replicas: bool = False
) -> dict[int, tuple[float | None, float | None, float]]:
    """A mixture of experts that trains to its router loss too (``output_router_logits``
    in its config, coefficient 0.5), pipelined over the ranks (``replicas``: a whole
    pipeline on each rank, stepping on its half of the batch): for each of ``chunks``, the
    differences of the step's loss and ``aux_loss`` and of this rank's gradients from the
    model's on the whole batch (with ``replicas``, the loss is the replica's labels loss
    plus the whole batch's router loss)."""
    from hf_support.models import experts_model, reference_loss, router_reference

    built = experts_model(family, router_aux_loss_coef=0.5, output_router_logits=True)
    data = batch(1, size=8)
    plain, loss, aux = router_reference(built, data)
    if replicas:
        pipe = pipeline(built, balance=[2, 2], chunks=2, data_group=dist.group.WORLD)
        data = {key: value[rank * 4 : rank * 4 + 4] for key, value in data.items()}
        with torch.no_grad():
            logits = plain(
                input_ids=data["input_ids"], attention_mask=data["attention_mask"]
            ).logits
        loss = reference_loss(logits, data["labels"]) + 0.5 * aux
    else:
        pipe = pipeline(built, chunks=2, group=dist.group.WORLD)
    found: dict[int, tuple[float | None, float | None, float]] = {}
    for count in chunks:
        pipe.chunks = count
        pipe.zero_grad(set_to_none=True)
        losses = pipe.step(**data)
        found[count] = (
            None if losses is None else abs(losses.reduced().item() - loss.item()),
            None if losses is None else abs(losses.aux_loss.item() - aux.item()),
            largest_grad_difference(built, plain),
        )
    return found


def router_recovers(rank: int, world: int) -> dict[str, Any]:
    """A step with the router loss that fails on the last rank (labels one position short,
    which its loss cannot take), then one that runs: every rank's error, and the second
    step's differences from the model's loss and gradients (the ranks' sums of router
    statistics stay paired after the failure)."""
    from hf_support.models import experts_model, router_reference

    built = experts_model("mixtral", router_aux_loss_coef=0.5, output_router_logits=True)
    data = batch(5, size=8)
    plain, loss, _ = router_reference(built, data)
    pipe = pipeline(built, chunks=4, group=dist.group.WORLD, timeout=60)
    found: dict[str, Any] = {}
    short = {**data, "labels": data["labels"][:, :-1]} if rank == world - 1 else data
    try:
        pipe.step(**short)
    except Exception as error:
        found["error"] = type(error).__name__
    pipe.zero_grad(set_to_none=True)
    losses = pipe.step(**data)
    found["loss"] = abs(losses.reduced().item() - loss.item())
    found["grad"] = largest_grad_difference(built, plain)
    return found


# Pipelines on a device mesh (test_transformers_mesh.py).


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _whole_grad_difference(pipe: Any, plain: Any) -> float:
    """The largest difference of this rank's gradients, each gathered whole (a DTensor's
    ``full_tensor()``: a collective of the ranks that shard it), from ``plain``'s."""
    from torch.distributed.tensor import DTensor

    theirs = dict(plain.named_parameters(remove_duplicate=False))
    largest = 0.0
    for name, parameter in pipe.named_parameters():
        grad = parameter.grad
        if grad is None:
            continue
        whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
        largest = max(largest, (whole - theirs[name].grad).abs().max().item())
    return largest


def mesh_exact(rank: int, world: int, *, folder: str, router: bool = False) -> dict[str, Any]:
    """A causal LM on a ``pp`` x ``dp_shard`` mesh of 2 x 2 (each pipeline stage's layers
    sharded with FSDP2 over two ranks, each stepping on its half of the batch): the loss
    and the gathered gradients against the plain model's on the whole batch, twice (with
    AdamW between, on both); then ``save_pretrained(folder)`` (the model as transformers
    loads it) and ``from_pretrained(folder, mesh=...)``'s first loss. ``router``: a
    mixture of experts training to its router loss too."""
    from hf_support.models import experts_model

    mesh = _mesh((2, 2), ("pp", "dp_shard"))
    share = mesh["dp_shard"].get_local_rank()
    if router:
        built = experts_model("mixtral", router_aux_loss_coef=0.5, output_router_logits=True)
    else:
        built = model("llama")
    data = batch(2, size=8)
    half = {key: value[share * 4 : share * 4 + 4] for key, value in data.items()}
    plain = copy_of(built)  # before the pipeline shards the model's own modules
    pipe = pipeline(built, chunks=2, mesh=mesh)
    found: dict[str, Any] = {"loss": [], "grad": []}
    optimizers = (
        torch.optim.AdamW(pipe.parameters(), lr=0.01),
        torch.optim.AdamW(plain.parameters(), lr=0.01),
    )
    for _ in range(2):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = _reference_step(plain, data, half, router)
        losses = pipe.step(**half)
        found["loss"].append(abs(losses.reduced().item() - loss.item()))
        found["grad"].append(_whole_grad_difference(pipe, plain))
        for optimizer in optimizers:
            optimizer.step()
    pipe.save_pretrained(folder)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager")
    found["saved"] = max(
        (value - plain.state_dict()[key]).abs().max().item()
        for key, value in loaded.state_dict().items()
    )
    again = from_pretrained_mesh(folder, mesh)
    found["reloaded"] = again.step(**half).reduced().item()
    found["reloaded off"] = abs(
        found["reloaded"] - _reference_step(plain, data, half, router).item()
    )
    return found


def _reference_step(
    plain: Any, data: dict[str, torch.Tensor], half: dict[str, torch.Tensor], router: bool
) -> torch.Tensor:
    """The plain model's backward on the whole batch (its float64 labels loss, plus its
    router loss with ``router``), and the loss a replica stepping on ``half`` reports: its
    own labels loss (plus the whole batch's router loss)."""
    from hf_support.models import reference_loss

    inputs = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
    out = plain(**inputs, output_router_logits=True) if router else plain(**inputs)
    extra = 0.5 * out.aux_loss.double() if router else torch.zeros((), dtype=torch.float64)
    (reference_loss(out.logits, data["labels"]) + extra).backward()
    with torch.no_grad():
        logits = plain(input_ids=half["input_ids"], attention_mask=half["attention_mask"]).logits
    return reference_loss(logits, half["labels"]) + extra.detach()


def copy_of(built: Any) -> Any:
    import copy

    return copy.deepcopy(built)


def from_pretrained_mesh(folder: str, mesh: Any) -> Any:
    from gpipe_transformers import from_pretrained

    pipe = from_pretrained(folder, chunks=2, mesh=mesh, experts_implementation="eager")
    pipe.train()
    return pipe
