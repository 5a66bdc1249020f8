"""What the ranks of the distributed tests run, and the models they share with the tests.

Run as a script, this is one rank of a test cluster (see ``Cluster`` in cluster.py): it
joins a gloo process group, then runs the cases the test sends on its stdin, one at a
time, and writes each case's result (or error) on its stdout. The tests load this file by
path to build the same models and inputs as the ranks, and compare with the plain model.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import struct
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from core_support import meta_models
from core_support.mesh_cases import (  # noqa: F401 (the cases)
    case_mesh_error,
    case_mesh_load,
    case_mesh_steps,
    data_share,
    full,
    mesh_of,
)
from core_support.models import (
    DictToOutput,
    FromMapping,
    OutputToDict,
    Pop,
    Redraws,
    Stash,
    ToDict,
    redraws_model,
)
from gpipe_checkpoint import is_recomputing
from gpipe_core import Action, BatchMean, GPipe, NoChunk, Schedule, lane_state

WIDTH = 4


# -- framing on the pipes between a test and its ranks -------------------------------------


def write_frame(stream: BinaryIO, value: object) -> None:
    data = pickle.dumps(value)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


# -- models --------------------------------------------------------------------------------


class Fail(Exception):
    """Raised by a :class:`Trap` on purpose."""


class Trap(nn.Module):
    """The identity, which raises :class:`Fail` when armed for a phase.

    Phases: ``forward`` (the first forward pass of micro-batch ``when``: micro-batches go
    forward in order), ``recompute`` (the first recomputation), ``backward`` (the backward
    pass of the first graph it is part of).
    """

    def __init__(self) -> None:
        super().__init__()
        self.armed: tuple[str, int] | None = None
        self.calls = 0
        self.graphs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed is None:
            return x
        phase, when = self.armed
        if is_recomputing():
            if phase == "recompute":
                raise Fail("recompute")
        else:
            self.calls += 1
            if phase == "forward" and self.calls == when + 1:
                raise Fail(f"forward of micro-batch {when}")
        if phase == "backward" and torch.is_grad_enabled():
            self.graphs += 1
            if self.graphs == 1:
                return _RaiseInBackward.apply(x)  # type: ignore[no-any-return]
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise Fail("backward")


class Split(nn.Module):
    """A tuple with an integer tensor between partitions."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x.detach() > 0).long()


class Join(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = pair
        return x * mask.to(x.dtype) + x


#: A value too long for a message's header: its metadata follows the header.
TAG = "tag" * 2000


class Masked(nn.Module):
    """Several positional inputs; a tuple with values that are not tensors out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, float, None, str]:
        return self.linear(x) * mask * scale, scale, None, TAG


class Unmask(nn.Module):
    def forward(self, value: tuple[torch.Tensor, float, None, str]) -> torch.Tensor:
        x, scale, nothing, tag = value
        assert nothing is None and tag == TAG
        return x / scale


#: Weak references to what :class:`Watch` layers returned (see :func:`case_failure_frees`).
WATCHED: list[weakref.ref[torch.Tensor]] = []


class Watch(nn.Module):
    """Scales its input, keeping a weak reference to its output (an activation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.5
        WATCHED.append(weakref.ref(y))
        return y


class NamedPair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class ToMax(nn.Module):
    """A tensor in, ``torch.return_types.max`` out."""

    def forward(self, x: torch.Tensor) -> Any:
        return torch.stack([x, -x], dim=2).max(dim=2)


class FromMax(nn.Module):
    """``torch.return_types.max`` in, read by name; a namedtuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, result: Any) -> NamedPair:
        return NamedPair(self.linear(result.values), result.indices.to(result.values.dtype))


class MixPair(nn.Module):
    """A namedtuple in and out, read by name."""

    def forward(self, pair: NamedPair) -> NamedPair:
        return NamedPair(pair.a + pair.b, pair.b)


def tuples_model(seed: int) -> nn.Sequential:
    """Tuple subclasses between partitions 1, 2 and 3 of ``[1, 1, 1, 1]`` (on ranks 1, 0,
    1 of two) and at the output."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), ToMax(), FromMax(), MixPair()).double()


class ToSparse(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse()


class ToDense(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_dense()


def inputs_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Masked(), Unmask(), nn.Linear(WIDTH, WIDTH)).double()


def build(layers: tuple[str, ...], seed: int) -> nn.Sequential:
    """A float64 model of ``layers`` kinds, the same for a seed on every process."""
    torch.manual_seed(seed)
    made: list[nn.Module] = []
    for kind in layers:
        if kind == "linear":
            made.append(nn.Linear(WIDTH, WIDTH))
        elif kind == "tanh":
            made.append(nn.Tanh())
        elif kind == "relu":
            made.append(nn.ReLU())
        elif kind == "bn":
            made.append(nn.BatchNorm1d(WIDTH))
        elif kind == "stash":
            made.append(Stash())
        elif kind == "pop":
            made.append(Pop())
        elif kind == "split":
            made.append(Split())
        elif kind == "join":
            made.append(Join())
        elif kind == "trap":
            made.append(Trap())
        elif kind == "watch":
            made.append(Watch())
        elif kind == "todict":  # a tensor (or keyword inputs) in, a dict out
            made.append(ToDict(WIDTH))
        elif kind == "dict2out":  # a dict in, a ModelOutput-like OrderedDict out
            made.append(DictToOutput(WIDTH))
        elif kind == "out2dict":
            made.append(OutputToDict())
        elif kind == "frommap":  # a mapping in, a tensor out
            made.append(FromMapping(WIDTH))
        else:
            raise ValueError(f"unknown layer kind: {kind}")
    return nn.Sequential(*made).double()


def data(seed: int, batch: int, outputs: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """An input and a target of ``batch`` samples."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(batch, outputs, generator=generator, dtype=torch.float64)
    return x, y


def local_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


class InOrderSchedule(Schedule):
    """A schedule of the user's: every forward pass, then every backward pass in the
    micro-batches' order (the built-in fill-drain runs them last first)."""

    name = "in-order"

    def __init__(self) -> None:
        self.asked = 0  # how many times a step asked for the actions

    def actions(self, microbatches: int, partitions: int) -> list[list[Action]]:
        self.asked += 1
        order = [Action("forward", i) for i in range(microbatches)]
        order += [Action("backward", i) for i in range(microbatches)]
        return [list(order) for _ in range(partitions)]


#: Schedules by name, beside the built-in ones (every rank makes its own instance).
SCHEDULES: dict[str, Schedule] = {"in-order": InOrderSchedule()}


def every_rank(backend: str | None) -> dist.ProcessGroup:
    """WORLD, or (with ``backend``) a new group of every rank with that backend."""
    if backend is None:
        group = dist.group.WORLD
    else:
        group = dist.new_group(list(range(dist.get_world_size())), backend=backend)
        assert str(dist.get_backend(group)) == backend
    assert isinstance(group, dist.ProcessGroup)
    return group


# -- a language model with tied embeddings ---------------------------------------------------

VOCAB, DIM, TOKENS = 11, 6, 5


class Block(nn.Module):
    """A residual block: ``x + linear(tanh(norm(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(torch.tanh(self.norm(x)))


def language_model(seed: int, blocks: int = 3) -> nn.Sequential:
    """GPT-style, float64: token embedding, blocks, norm, and an output head that shares
    the embedding's weight."""
    torch.manual_seed(seed)
    embedding = nn.Embedding(VOCAB, DIM)
    head = nn.Linear(DIM, VOCAB, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(
        embedding, *[Block() for _ in range(blocks)], nn.LayerNorm(DIM), head
    ).double()


class TokenLoss(nn.Module):
    """Cross-entropy over every token of the micro-batch."""

    reduction = "mean"

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def tokens(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input tokens and next tokens of ``batch`` sequences."""
    generator = torch.Generator().manual_seed(seed)
    sequence = torch.randint(VOCAB, (batch, TOKENS + 1), generator=generator)
    return sequence[:, :-1], sequence[:, 1:]


#: The optimizer state of torch.distributed.checkpoint with a key per parameter, which
#: moves between layouts.
def flat_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def lm_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    seed: int,
    first: int,
    steps: int,
    batch: int,
    chunks: int,
    max_norm: float,
    schedule: str = "gpipe",
    replica: tuple[int, int] = (0, 1),
) -> list[dict[str, Any]]:
    """Train ``steps`` steps with clipping (``model`` is a pipeline, or the plain model, whose
    micro-batches' gradients are then accumulated as a step does); each step's loss, total
    norm and state. ``replica``: (which, how many) data-parallel replicas share the batch."""
    record = []
    for k in range(first, first + steps):
        x, y = (
            whole.chunk(replica[1])[replica[0]] for whole in tokens(seed + k, batch * replica[1])
        )
        optimizer.zero_grad(set_to_none=True)
        if isinstance(model, GPipe):
            loss = model.step(x, y, TokenLoss(), schedule=schedule).reduced().item()
            norm = model.clip_grad_norm_(max_norm)
        else:
            loss = 0.0
            for xi, yi in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
                part = TokenLoss()(model(xi), yi) * len(xi) / batch
                part.backward()
                loss += part.item()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        state = {key: value.detach().clone() for key, value in model.state_dict().items()}
        record.append({"loss": loss, "norm": norm.item(), "state": state})
    return record


def case_clip(rank: int, *, norm_type: float, max_norm: float, poison: bool) -> dict[str, Any]:
    """One step of the tied language model on two ranks, then its gradients clipped (with
    ``poison``, after rank 1 made one of its gradients infinite): the total, each rank's
    gradients after, or the error of ``error_if_nonfinite=True``."""
    pipe = GPipe(language_model(7), [3, 3], chunks=2, group=dist.group.WORLD, timeout=60)
    x, y = tokens(7, 4)
    pipe.step(x, y, TokenLoss())
    if poison and rank == 1:
        grad = pipe.get_parameter("4.bias").grad
        assert grad is not None
        grad[0] = float("inf")
    returned: list[float] = []
    outcome = _timed(
        lambda: returned.append(
            pipe.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=poison).item()
        )
    )
    if not returned:  # refused: the gradients are unchanged, and clipping anyway works
        returned.append(pipe.clip_grad_norm_(max_norm, norm_type).item())
    return {
        **outcome,
        "total": returned[0],
        "grads": {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()},
    }


def case_clip_disagree(rank: int) -> dict[str, Any]:
    """Rank 1 clips with another ``max_norm``: every rank raises, no gradient changes, and
    the next clip runs."""
    pipe = GPipe(language_model(7), [3, 3], chunks=2, group=dist.group.WORLD, timeout=30)
    pipe.step(*tokens(7, 4), TokenLoss())
    before = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    outcome = _timed(lambda: pipe.clip_grad_norm_(1.0 if rank == 0 else 2.0))
    unchanged = all(torch.equal(before[name], p.grad) for name, p in pipe.named_parameters())
    return {**outcome, "unchanged": unchanged, "total": pipe.clip_grad_norm_(1.0).item()}


def case_lm_accumulate(rank: int, *, checkpoint: str) -> dict[str, Any]:
    """The tied language model on two ranks: a step under torch.no_grad (no gradients),
    then two training steps whose gradients accumulate (no zeroing between them)."""
    pipe = GPipe(
        language_model(8), [2, 4], chunks=2, checkpoint=checkpoint,  # type: ignore[arg-type]
        group=dist.group.WORLD, timeout=60,
    )  # fmt: skip
    with torch.no_grad():
        pipe.step(*tokens(8, 4), TokenLoss())
    untouched = all(p.grad is None for p in pipe.parameters())
    for k in range(2):
        pipe.step(*tokens(9 + k, 4), TokenLoss())
    return {"untouched": untouched, "grads": {k: v.clone() for k, v in local_grads(pipe).items()}}


def case_lm(
    rank: int,
    *,
    balance: list[int],
    seed: int,
    steps: int,
    first: int = 0,
    batch: int = 6,
    chunks: int = 3,
    max_norm: float = 0.5,
    schedule: str = "gpipe",
    checkpoint: str = "except_last",
    save: str | None = None,
    load: str | None = None,
    data_parallel: bool = False,
    assign: bool = False,
) -> dict[str, Any]:
    """Train the tied language model across the ranks with Adam and clipping; with
    ``load``, from a torch.distributed.checkpoint of model and optimizer first, with
    ``save``, into one after. With ``data_parallel``, on four ranks: pipelines {0, 1} and
    {2, 3}, each on its half of a batch twice as large, replicas {0, 2} and {1, 3}. With
    ``assign``, the pipeline's own state is loaded first with ``assign=True`` (new tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    group, data_group, replica = dist.group.WORLD, None, (0, 1)
    if data_parallel:
        pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group, data_group, replica = pipelines[rank // 2], replicas[rank % 2], (rank // 2, 2)
    pipe = GPipe(
        language_model(seed if load is None else seed + 100),
        balance,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        group=group,
        data_group=data_group,
        timeout=60,
    )
    if assign:
        pipe.load_state_dict({k: v.clone() for k, v in pipe.state_dict().items()}, assign=True)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    if load is not None:
        model_state, optim_state = get_state_dict(pipe, optimizer, options=flat_options())
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=load)
        set_state_dict(
            pipe,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=flat_options(),
        )
    record = lm_steps(
        pipe, optimizer, seed=seed, first=first, steps=steps, batch=batch, chunks=chunks,
        max_norm=max_norm, schedule=schedule, replica=replica,
    )  # fmt: skip
    if save is not None:
        model_state, optim_state = get_state_dict(pipe, optimizer, options=flat_options())
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=save)
    return {
        "steps": record,
        "drift": pipe.shared_drift(),
        "names": [name for name, _ in pipe.named_parameters()],
    }


#: Whether each :class:`Gate` runs its layer, by the gate's name (a case sets them before
#: each step, alike on every rank; a missing name is on).
GATES: dict[str, bool] = {}


class Gate(nn.Module):
    """Its layer, or the identity where ``GATES[name]`` is off (LayerDrop-style): a step in
    which every use of a tied weight is skipped computes no gradient for it."""

    def __init__(self, name: str, layer: nn.Module) -> None:
        super().__init__()
        self.name = name
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) if GATES.get(self.name, True) else x  # type: ignore[no-any-return]


def gated_tied_model(seed: int) -> nn.Sequential:
    """Three gated uses of one weight (``0.layer.weight``, layers 0, 2 and 5) and an untied
    linear layer, float64: balance ``[3, 3]`` on two ranks, ``[2, 2, 2]`` on three."""
    torch.manual_seed(seed)
    first, middle, last = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
    middle.weight = last.weight = first.weight
    return nn.Sequential(
        Gate("first", first), nn.Tanh(), Gate("middle", middle),
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), Gate("last", last),
    ).double()  # fmt: skip


def gated_steps(
    model: nn.Module, plan: list[tuple[dict[str, bool], bool]], seed: int
) -> list[dict[str, Any]]:
    """Steps of SGD with momentum on ``model`` (a pipeline, or the plain model, whose
    micro-batches' gradients are accumulated as a step does), each with its gates and
    whether the gradients are zeroed (set to None) first; each parameter's gradient (None
    where there is none) and value after each step, under its name."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record = []
    for k, (gates, zero) in enumerate(plan):
        GATES.clear()
        GATES.update(gates)
        if zero:
            optimizer.zero_grad(set_to_none=True)
        x, y = data(seed + k, 4)
        if isinstance(model, GPipe):
            model.step(x, y, nn.MSELoss())
        else:
            for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
                (nn.MSELoss()(model(xi), yi) * len(xi) / len(x)).backward()
        grads = {
            name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
        }
        optimizer.step()
        values = {name: p.detach().clone() for name, p in model.named_parameters()}
        record.append({"grads": grads, "values": values})
    GATES.clear()
    return record


def case_gated_tied(rank: int, *, plan: list[tuple[dict[str, bool], bool]]) -> dict[str, Any]:
    """:func:`gated_steps` of :func:`gated_tied_model` across every rank."""
    balance = {2: [3, 3], 3: [2, 2, 2]}[dist.get_world_size()]
    pipe = GPipe(gated_tied_model(3), balance, chunks=2, group=dist.group.WORLD, timeout=60)
    return {"steps": gated_steps(pipe, plan, seed=3), "drift": pipe.shared_drift()}


# -- cases ---------------------------------------------------------------------------------


def case_step(rank: int, *, inline_limit: int | None = None, **spec: Any) -> dict[str, Any]:
    """:func:`steps` with ``spec``. With ``inline_limit``, the largest buffer posted for a
    message is that, and each message sent is recorded, as ``(layout, bytes of its first
    part, size of the buffer posted for it)``."""
    if inline_limit is None:
        return steps(rank, **spec)
    import gpipe_core.transport._wire as wire

    sent: list[tuple[str, int, int]] = []
    real, limit = wire.message, wire.INLINE_LIMIT

    def message(encoded: bytes, data: Any, capacity: int, **options: Any) -> list[torch.Tensor]:
        parts = real(encoded, data, capacity, **options)
        sent.append((wire.LAYOUTS[int(parts[0][4])], len(parts[0]), capacity))
        return parts

    wire.message, wire.INLINE_LIMIT = message, inline_limit
    try:
        result = steps(rank, **spec)
    finally:
        wire.message, wire.INLINE_LIMIT = real, limit
    return {**result, "sent": sent}


def steps(
    rank: int,
    *,
    layers: tuple[str, ...],
    balance: list[int],
    seed: int,
    batches: list[int],
    chunks: int,
    checkpoint: str = "except_last",
    schedule: str = "gpipe",
    deferred_batch_norm: bool = False,
    give_all: bool = False,
    backend: str | None = None,
    placement: str | list[int] | None = None,
    record_wire: bool = False,
    keywords: bool = False,
    pipeline_timeout: float | datetime.timedelta | None = 60,
) -> dict[str, Any]:
    """Steps of a pipeline across the group (WORLD, or a group of every rank with
    ``backend``); each rank's losses, gradients and buffers. With ``record_wire``, the
    ``(kind, source, target)`` of every message handed to the transport, as ``"wire"``.
    With ``keywords``, the input is given by keyword to a first layer ``"todict"``
    (``x=``, a ``NoChunk`` mask of ones and a scale of 1: the plain model's numbers), by
    the first partition's rank only (every rank with ``give_all``). ``pipeline_timeout`` is
    the pipeline's ``timeout``."""
    if record_wire:
        from gpipe_core.transport._distributed import DistributedTransport

        wire: list[tuple[str, int, int]] = []
        real = DistributedTransport.send

        def send(self: DistributedTransport, key: Any, *args: Any, **kwargs: Any) -> None:
            wire.append((key.contents, key.source, key.target))
            real(self, key, *args, **kwargs)

        DistributedTransport.send = send  # type: ignore[method-assign]
        try:
            result = steps(rank, layers=layers, balance=balance, seed=seed, batches=batches,
                           chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                           deferred_batch_norm=deferred_batch_norm, give_all=give_all,
                           backend=backend, placement=placement,
                           keywords=keywords, pipeline_timeout=pipeline_timeout)  # fmt: skip
        finally:
            DistributedTransport.send = real  # type: ignore[method-assign]
        return {**result, "wire": wire}
    model = build(layers, seed)
    group = every_rank(backend)
    custom = SCHEDULES.get(schedule)
    asked = custom.asked if isinstance(custom, InOrderSchedule) else 0
    pipe = GPipe(
        model,
        balance,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=deferred_batch_norm,
        group=group,
        timeout=pipeline_timeout,
        placement=placement,
    )
    first, last = pipe.partition_ranks[0] == rank, pipe.partition_ranks[-1] == rank
    results = []
    for k, batch in enumerate(batches):
        x, y = data(seed + k, batch)
        x.requires_grad_(True)
        if keywords:
            ones = NoChunk(torch.ones(WIDTH, dtype=torch.float64))
            given = {"x": x, "mask": ones, "scale": 1.0} if first or give_all else {}
            losses = pipe.step(
                **given,
                target=y if last or give_all else None,
                loss_fn=nn.MSELoss(),
                schedule=SCHEDULES.get(schedule, schedule),
            )
        else:
            losses = pipe.step(
                x if first or give_all else None,
                y if last or give_all else None,
                nn.MSELoss(),
                schedule=SCHEDULES.get(schedule, schedule),
            )
        results.append(
            {
                "losses": [loss.item() for loss in losses],
                "reduced": losses.reduced().item(),
                "grads": {
                    k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()
                },
                "input_grad": x.grad.clone() if x.grad is not None else None,
            }
        )
        for p in pipe.parameters():
            p.grad = None
    if isinstance(custom, InOrderSchedule):
        asked = custom.asked - asked  # by these steps
    return {"steps": results, "buffers": dict(pipe.state_dict()), "schedule_asked": asked}


def case_forward(
    rank: int,
    *,
    layers: tuple[str, ...],
    balance: list[int],
    seed: int,
    batch: int,
    chunks: int,
    keywords: bool = False,
) -> Any:
    """Inference across the group: the output on the last partition's rank. With
    ``keywords``, the input by keyword (``x=``, a ``NoChunk`` mask of ones and a scale of
    1) on every rank."""
    pipe = GPipe(build(layers, seed), balance, chunks=chunks, group=dist.group.WORLD, timeout=60)
    pipe.eval()
    x, _ = data(seed, batch)
    if keywords:
        ones = NoChunk(torch.ones(WIDTH, dtype=torch.float64))
        return pipe(x=x, mask=ones, scale=1.0)
    output = pipe(x if pipe.partition_ranks[0] == rank else None)
    return output


def case_inputs(rank: int, *, seed: int, chunks: int) -> dict[str, Any]:
    """Several positional inputs, a NoChunk mask and a float for the first layer; a tuple
    with a float, None and a string between the ranks."""
    pipe = GPipe(inputs_model(seed), [1, 2], chunks=chunks, group=dist.group.WORLD, timeout=60)
    x, y = data(seed, 6)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    first = pipe.partition_ranks[0] == rank
    # Only the first partition's rank passes the inputs; the others give none.
    inputs = (x, NoChunk(mask), 0.5) if first else ()
    losses = pipe.step(*inputs, target=y, loss_fn=nn.MSELoss())
    grads = {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()}
    pipe.eval()
    output = pipe(x, NoChunk(mask), 0.5) if first else pipe()
    return {"reduced": losses.reduced().item(), "grads": grads, "output": output}


def case_tuple_types(rank: int, *, checkpoint: str, schedule: str) -> dict[str, Any]:
    """A step and inference with tuple subclasses between the ranks and at the output."""
    pipe = GPipe(
        tuples_model(0),
        [1, 1, 1, 1],
        chunks=3,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        group=dist.group.WORLD,
        timeout=60,
    )
    x, y = data(0, 6)
    seen: list[str] = []

    def loss_fn(output: NamedPair, target: torch.Tensor) -> torch.Tensor:
        seen.append(type(output).__name__)
        return nn.functional.mse_loss(output.a, target)

    loss_fn.reduction = "mean"  # type: ignore[attr-defined]
    losses = pipe.step(x, y, loss_fn, schedule=schedule)
    grads = {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()}
    pipe.eval()
    with torch.no_grad():
        output = pipe(x)
    return {
        "reduced": losses.reduced().item(),
        "grads": grads,
        "seen": seen,
        "output": None if output is None else (type(output).__name__, output.a.clone()),
    }


def case_redraws(
    rank: int,
    *,
    hows: list[str | None],
    balance: list[int],
    chunks: int,
    checkpoint: str,
    schedule: str,
    placement: str | None,
    seed: int,
) -> dict[str, Any]:
    """Two steps of :func:`~core_support.models.redraws_model` on two ranks (four
    partitions with a ``placement``, else two), on ``data(seed + k, 8)``: each step's loss
    and this rank's gradients, and the masks its :class:`~core_support.models.Redraws`
    layers drew, by the layer's name."""
    pipe = GPipe(
        redraws_model(WIDTH, hows, seed), balance, chunks=chunks, group=dist.group.WORLD,
        placement=placement, checkpoint=checkpoint, timeout=60,  # type: ignore[arg-type]
    )  # fmt: skip
    steps = []
    for k in range(2):
        x, y = data(seed + k, 8)
        losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        grads = {name: v.clone() for name, v in local_grads(pipe).items() if v is not None}
        steps.append({"reduced": losses.reduced().item(), "grads": grads})
        pipe.zero_grad(set_to_none=True)
    masks = {
        name: module.masks for name, module in pipe.named_modules() if isinstance(module, Redraws)
    }
    return {"steps": steps, "masks": masks}


def case_sparse(rank: int) -> dict[str, Any]:
    """A sparse tensor from partition 0 (rank 0) to partition 1 (rank 1): the error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), ToSparse(), ToDense(), nn.Linear(WIDTH, WIDTH))
    pipe = GPipe(model.double(), [2, 2], chunks=2, group=dist.group.WORLD, timeout=30)
    x, y = data(0, 4)
    try:
        pipe.step(x, y, nn.MSELoss())
    except Exception as caught:
        return {"type": type(caught).__name__, "message": str(caught)}
    return {"type": None, "message": ""}


def case_forward_in_training(rank: int) -> str:
    pipe = GPipe(build(("linear", "linear"), 0), [1, 1], group=dist.group.WORLD, timeout=60)
    try:
        pipe(torch.randn(2, WIDTH, dtype=torch.float64))
    except RuntimeError as error:
        return str(error)
    return "no error"


def case_failure(
    rank: int,
    *,
    layers: tuple[str, ...],
    balance: list[int],
    seed: int,
    chunks: int,
    trap_rank: int,
    phase: str,
    microbatch: int,
    checkpoint: str = "always",
    schedule: str = "gpipe",
    placement: str | None = None,
) -> dict[str, Any]:
    """A step that fails on ``trap_rank``, then a step that must run normally."""
    pipe = GPipe(
        build(layers, seed),
        balance,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        group=dist.group.WORLD,
        timeout=30,
        placement=placement,
    )
    traps = [m for m in pipe.modules() if isinstance(m, Trap)]
    if rank == trap_rank:
        for trap in traps:
            trap.armed = (phase, microbatch)
    x, y = data(seed, 2 * chunks)
    error: dict[str, Any] = {}
    calls = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(len(calls))
        if phase == "loss" and rank == trap_rank and len(calls) == microbatch + 1:
            raise Fail(f"loss of micro-batch {microbatch}")
        return nn.functional.mse_loss(output, target)

    loss_fn.reduction = "mean"  # type: ignore[attr-defined]
    try:
        pipe.step(x, y, loss_fn, schedule=schedule)
    except Exception as caught:
        error = {
            "type": type(caught).__name__,
            "message": str(caught),
            "rank": getattr(caught, "rank", None),
            "where": getattr(caught, "where", None),
            "notes": getattr(caught, "__notes__", []),
        }
    after = payloads_state(pipe)
    for trap in traps:
        trap.armed = None
    for p in pipe.parameters():
        p.grad = None
    x, y = data(seed + 1, 2 * chunks)
    losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    return {
        "error": error,
        "after_failure": after,
        "reduced": losses.reduced().item(),
        "grads": {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()},
    }


def payloads_state(pipe: GPipe) -> dict[str, Any]:
    """The payload channel of ``pipe``'s transport: its mode, the point-to-point operations
    still pending, and how many payloads it sent to and received from each peer."""
    transport = pipe._placement.transport()
    payloads = transport.payloads  # type: ignore[attr-defined]
    return {
        "mode": payloads.mode,
        "pending": transport.pending(),  # type: ignore[attr-defined]
        "sent": dict(payloads.sent),
        "received": dict(payloads.received),
    }


def case_payloads(rank: int) -> dict[str, Any]:
    """The payload channel of a pipeline across the ranks, after a step."""
    pipe = GPipe(
        build(("linear", "tanh", "linear"), 0), [2, 1], chunks=2, group=dist.group.WORLD, timeout=30
    )
    x, y = data(0, 4)
    pipe.step(x, y, nn.MSELoss())
    return payloads_state(pipe)


def _fail_once(pipe: GPipe, path: str, phase: str, rank: int, trap_rank: int) -> str:
    """Run ``pipe`` once, failing in ``phase`` on ``trap_rank``; the error's type. Keeps
    no reference to the input or to the error."""
    x, y = data(0, 8)
    x.requires_grad_(path != "forward")
    WATCHED.append(weakref.ref(x))

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if phase == "loss" and rank == trap_rank:
            raise Fail("loss")
        return nn.functional.mse_loss(output, target)

    loss_fn.reduction = "mean"  # type: ignore[attr-defined]
    try:
        if path == "forward":
            with torch.no_grad():
                pipe(x)
        else:
            pipe.step(x, y, loss_fn, schedule=path)
    except Exception as error:
        return type(error).__name__
    return "no error"


def case_failure_frees(
    rank: int, *, path: str, phase: str, trap_rank: int, checkpoint: str
) -> dict[str, Any]:
    """A run that fails on ``trap_rank``, with the cycle collector off: how many of the
    input and the activations (:class:`Watch`) each rank still holds right after."""
    layers = ("linear", "watch", "trap", "linear", "watch", "trap")
    pipe = GPipe(
        build(layers, 0),
        [3, 3],
        chunks=4,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        group=dist.group.WORLD,
        timeout=30,
    )
    if rank == trap_rank and phase != "loss":
        for trap in pipe.modules():
            if isinstance(trap, Trap):
                trap.armed = (phase, 1)
    gc.collect()
    WATCHED.clear()
    gc.disable()
    try:
        error = _fail_once(pipe, path, phase, rank, trap_rank)
        alive = sum(ref() is not None for ref in WATCHED)
    finally:
        gc.enable()
    watched, _ = len(WATCHED), WATCHED.clear()
    return {"error": error, "alive": alive, "watched": watched}


def case_die(rank: int, *, dying_rank: int) -> dict[str, Any]:
    """``dying_rank`` exits in the middle of a step; the others must fail, not hang."""
    pipe = GPipe(
        build(("linear", "tanh", "linear"), 0), [2, 1], chunks=4, group=dist.group.WORLD, timeout=30
    )
    if rank == dying_rank:

        def die(*_: object) -> None:
            os._exit(3)

        pipe[0].register_forward_hook(die)  # type: ignore[arg-type]
    x, y = data(0, 8)
    try:
        pipe.step(x, y, nn.MSELoss())
    except Exception as caught:
        first = {"type": type(caught).__name__, "message": str(caught)}
    else:
        first = {}
    try:
        pipe.step(x, y, nn.MSELoss())
    except Exception as caught:
        second = {"type": type(caught).__name__, "message": str(caught)}
    else:
        second = {}
    return {"first": first, "second": second}


def case_data_parallel(
    rank: int, *, layers: tuple[str, ...], balance: list[int], seed: int, batch: int, chunks: int
) -> dict[str, Any]:
    """Two partitions x two replicas on four ranks: pipelines {0, 1} and {2, 3}, replicas of
    each partition {0, 2} and {1, 3}. Each replica trains on its half of the batch."""
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe = GPipe(
        build(layers, seed),
        balance,
        chunks=chunks,
        group=pipelines[rank // 2],
        data_group=replicas[rank % 2],
        timeout=60,
    )
    x, y = data(seed, batch)
    half = batch // 2
    part = slice((rank // 2) * half, (rank // 2 + 1) * half)
    reduces = []
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        reduces.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        losses = pipe.step(x[part], y[part], nn.MSELoss())
    finally:
        dist.all_reduce = all_reduce
    return {
        "reduced": losses.reduced().item(),
        "grads": {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()},
        "all_reduces": len(reduces),
    }


CLASSES = 5


def classifier(seed: int) -> nn.Sequential:
    """Five layers ending in the logits of :data:`CLASSES` classes, float64."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, CLASSES)
    ).double()


def ignored_targets(
    seed: int, batch: int, ignored: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class targets, those at ``ignored`` ignored (-100). By default samples 2
    and 3 (a micro-batch of 2 that keeps none), 1 and, from a batch of 16, 9 to 13 (the
    second half keeps fewer)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, WIDTH, dtype=torch.float64, generator=generator)
    y = torch.randint(CLASSES, (batch,), generator=generator)
    if ignored is None:
        ignored = [i for i in (1, 2, 3, 9, 10, 11, 12, 13) if i < batch]
    y[ignored] = -100
    return x, y


def mean_losses(variant: str) -> tuple[nn.Module, BatchMean]:
    """A torch loss of ``variant`` and its :class:`BatchMean`: ``"ce"`` (ignore_index only),
    ``"weighted"`` (class weights and label smoothing too), ``"nll"`` (log-softmax first)."""
    if variant == "weighted":
        weight = torch.linspace(0.5, 2.0, CLASSES, dtype=torch.float64)
        loss: nn.Module = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    elif variant == "nll":  # on logits: the log-softmax inside the loss
        nll = BatchMean.from_module(nn.NLLLoss())
        return _LogSoftmaxNLL(nn.NLLLoss()), BatchMean(
            lambda output, target: nll.total(output.log_softmax(dim=1), target), nll.count
        )
    else:
        loss = nn.CrossEntropyLoss()
    return loss, BatchMean.from_module(loss)  # type: ignore[arg-type]


class _LogSoftmaxNLL(nn.Module):
    def __init__(self, nll: nn.NLLLoss) -> None:
        super().__init__()
        self.nll = nll

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.nll(output.log_softmax(dim=1), target)


def case_batch_mean(
    rank: int,
    *,
    schedule: str,
    placement: str | None,
    seed: int,
    balance: list[int] | None = None,
    chunks: int = 4,
    batch: int = 8,
    ignored: list[int] | None = None,
    variant: str = "ce",
    checkpoint: str = "except_last",
    data_parallel: bool = False,
    bad_rank: int | None = None,
    mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """A step of :func:`classifier` with :func:`ignored_targets` and the :class:`BatchMean`
    of :func:`mean_losses`, on two ranks (four partitions with a ``placement``, else two).
    With ``data_parallel``, on four ranks: pipelines {0, 1} and {2, 3}, each on its half of
    a batch twice as large, replicas {0, 2} and {1, 3}. With ``bad_rank``, a first step in
    which that rank's target is one sample short (each rank's error as ``"failed"``), then
    the step. With ``mesh`` (a shape and names, ``"pp"`` first), on the mesh of every rank:
    rank ``r`` passes data-parallel share ``r % dp``; the gradients are gathered whole."""
    group, data_group, replica = dist.group.WORLD, None, (0, 1)
    on: dict[str, Any] = {}
    if mesh is not None:
        group, data_group, replica = None, None, data_share(rank, *mesh)
        on["mesh"] = mesh_of(*mesh)
    elif data_parallel:
        pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group, data_group, replica = pipelines[rank // 2], replicas[rank % 2], (rank // 2, 2)
    if balance is None:
        balance = [2, 1, 1, 1] if placement else [3, 2]
    pipe = GPipe(
        classifier(seed), balance, chunks=chunks, group=group, data_group=data_group,
        placement=placement, checkpoint=checkpoint, timeout=60, **on,  # type: ignore[arg-type]
    )  # fmt: skip
    x, y = ignored_targets(seed, batch * replica[1], ignored)
    part = slice(replica[0] * batch, (replica[0] + 1) * batch)
    _, loss_fn = mean_losses(variant)
    failed = None
    if bad_rank is not None:
        try:
            short = y[part][:-1] if rank == bad_rank else y[part]
            pipe.step(x[part], short, loss_fn, schedule=schedule)
        except Exception as error:
            failed = f"{type(error).__name__}: {error}"
        pipe.zero_grad(set_to_none=True)
    losses = pipe.step(x[part], y[part], loss_fn, schedule=schedule)
    return {
        "failed": failed,
        "reduced": losses.reduced().item(),
        "counts": losses.counts,
        "grads": {k: full(v) for k, v in local_grads(pipe).items()},
    }


def case_save(
    rank: int, *, layers: tuple[str, ...], balance: list[int], seed: int, path: str
) -> dict[str, torch.Tensor]:
    """Train a step, save the pipeline with torch.distributed.checkpoint; each rank's
    state under the plain keys."""
    import torch.distributed.checkpoint as dcp

    pipe = GPipe(build(layers, seed), balance, chunks=2, group=dist.group.WORLD, timeout=60)
    x, y = data(seed, 4)
    pipe.step(x, y, nn.MSELoss())
    with torch.no_grad():
        for p in pipe.parameters():
            p -= 0.1 * p.grad  # type: ignore[operator]
    state = pipe.state_dict()
    dcp.save(state, checkpoint_id=path)
    return {key: value.clone() for key, value in state.items()}


def case_load(
    rank: int, *, layers: tuple[str, ...], balance: list[int], path: str, batch: int
) -> dict[str, Any]:
    """Build the model on the meta device, keep this rank's layers, load the checkpoint;
    the state and the inference output."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        module = build(layers, 0)
    pipe = GPipe(module, balance, chunks=2, group=dist.group.WORLD, timeout=60)
    state = pipe.state_dict()
    dcp.load(state, checkpoint_id=path)
    pipe.load_state_dict(state)
    pipe.eval()
    x, _ = data(1, batch)
    output = pipe(x if pipe.partition_ranks[0] == rank else None)
    return {
        "state": {key: value.clone() for key, value in pipe.state_dict().items()},
        "output": output,
        "devices": [str(device) for device in pipe.devices],
    }


def _error(caught: BaseException) -> dict[str, Any]:
    try:
        message = str(caught)
    except Exception as unprintable:  # an Unprintable raised on this rank
        message = f"(str() raised {type(unprintable).__name__})"
    return {"type": type(caught).__name__, "message": message}


def case_bad_balance(rank: int) -> dict[str, Any]:
    """Three partitions on two ranks are refused on every rank; a pipeline made next on
    the group steps."""
    outcome: dict[str, Any] = {}
    try:
        GPipe(build(("linear",) * 3, 0), [1, 1, 1], group=dist.group.WORLD, timeout=60)
    except Exception as caught:
        outcome = _error(caught)
    pipe = GPipe(build(("linear",) * 2, 0), [1, 1], chunks=2, group=dist.group.WORLD, timeout=60)
    x, y = data(0, 4)
    return {"error": outcome, "reduced": pipe.step(x, y, nn.MSELoss()).reduced().item()}


def case_mismatch(rank: int) -> dict[str, Any]:
    """Rank 0 calls step(), rank 1 runs inference: neither waits forever; then both step."""
    pipe = GPipe(
        build(("linear", "linear"), 0), [1, 1], chunks=2, group=dist.group.WORLD, timeout=60
    )
    x, y = data(0, 4)
    outcome: dict[str, Any] = {}
    try:
        if rank == 0:
            pipe.step(x, y, nn.MSELoss())
        else:
            with torch.no_grad():
                pipe(None)  # type: ignore[arg-type]
    except Exception as caught:
        outcome = _error(caught)
    losses = pipe.step(x, y, nn.MSELoss())
    return {"error": outcome, "reduced": losses.reduced().item()}


def case_stall(rank: int, *, late_rank: int, seconds: float) -> dict[str, Any]:
    """``late_rank`` starts its step after the others' timeout (``seconds``): they say
    who waits for what."""
    pipe = GPipe(
        build(("linear", "linear"), 0), [1, 1], chunks=2, group=dist.group.WORLD, timeout=seconds
    )
    x, y = data(0, 4)
    if rank == late_rank:
        time.sleep(3 * seconds)
    try:
        pipe.step(x, y, nn.MSELoss())
    except Exception as caught:
        return _error(caught)
    return {}


def case_cuda(
    rank: int, *, layers: tuple[str, ...], balance: list[int], seed: int, backend: str = "gloo"
) -> dict[str, Any]:
    """A step with the partitions on CUDA, on a group of every rank with ``backend`` (gloo
    carries the tensors through host memory, on a gloo group of its own for NCCL)."""
    group = every_rank(None if backend == "gloo" else backend)
    pipe = GPipe(build(layers, seed), balance, chunks=2, group=group, timeout=60)
    x, y = data(seed, 4)
    losses = pipe.step(
        x.to(pipe.devices[0]) if pipe.partition_ranks[0] == rank else None,
        y.to("cuda") if pipe.partition_ranks[-1] == rank else None,
        nn.MSELoss(),
    )
    return {
        "reduced": losses.reduced().item(),
        "devices": [str(d) for d in pipe.devices],
        "grads": {k: v.cpu() if v is not None else None for k, v in local_grads(pipe).items()},
    }


# -- ranks that disagree, and the other ways a run across processes goes wrong --------------

AGREE_LAYERS = ("linear", "tanh", "linear", "bn", "linear", "linear")
AGREE_BALANCE = {2: [3, 3], 3: [2, 2, 2], 4: [2, 1, 1, 2]}


def _timed(call: Callable[[], Any]) -> dict[str, Any]:
    """``call()``'s error (type, message, the failing rank for a RemoteStageError) and how
    long it took; an empty error when it returned."""
    start = time.monotonic()
    try:
        call()
    except Exception as caught:
        outcome = _error(caught)
        outcome["rank"] = getattr(caught, "rank", None)
        outcome["is_value_error"] = isinstance(caught, ValueError)
    else:
        outcome = {}
    return {"error": outcome, "seconds": time.monotonic() - start}


def _step_again(pipe: GPipe, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The step after a failure, from zeroed gradients: its loss and gradients."""
    for p in pipe.parameters():
        p.grad = None
    losses = pipe.step(x, y, nn.MSELoss())
    return {
        "reduced": losses.reduced().item(),
        "grads": {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()},
    }


def _train_alike(seed: int, timeout: float = 60) -> dict[str, Any]:
    """A pipeline built alike on every rank, one step: its losses and gradients."""
    world = dist.get_world_size()
    pipe = GPipe(
        build(AGREE_LAYERS, seed),
        AGREE_BALANCE[world],
        chunks=2,
        group=dist.group.WORLD,
        timeout=timeout,
    )
    x, y = data(seed, 4)
    losses = pipe.step(x, y, nn.MSELoss())
    return {
        "reduced": losses.reduced().item(),
        "grads": {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()},
    }


# -- groups the program made before, ties across pairs of ranks, interrupted runs -------------


def two_ties_model(seed: int) -> nn.Sequential:
    """The language model with two blocks, whose linear layers share their weight too: on
    three ranks with balance ``[1, 1, 3]``, the embedding and the head are tied across
    ranks 0 and 2, the blocks' weight across ranks 1 and 2."""
    model = language_model(seed, blocks=2)
    model[2].linear.weight = model[1].linear.weight
    return model


def tied(world: int, seed: int) -> tuple[nn.Sequential, list[int]]:
    """A model with weights tied across ranks, and its balance on ``world`` ranks."""
    if world == 3:
        return two_ties_model(seed), [1, 1, 3]
    return language_model(seed), [3, 3]


def case_groups_first(rank: int, *, before: str, steps: int) -> dict[str, Any]:
    """On three ranks, a group made ``before`` the pipelines (``'new_group'``: the user's
    ``new_group([0, 2])``; ``'local'``: the same with local synchronization, on ranks 0 and
    2 only; ``'pipeline'``: a pipeline with tied weights on that group, stepped on ranks 0
    and 2 only), then two pipelines of :func:`two_ties_model` on every rank, one after the
    other, each trained ``steps`` steps; each one's steps (see :func:`lm_steps`) and drift."""
    if before == "new_group":
        dist.new_group([0, 2])
    elif rank in (0, 2):
        sub = dist.new_group([0, 2], use_local_synchronization=True)
        if before == "pipeline":
            first = GPipe(language_model(3), [3, 3], chunks=2, group=sub, timeout=30)
            first.step(*tokens(3, 4), TokenLoss())
    trained = []
    for _ in range(2):
        pipe = GPipe(two_ties_model(4), [1, 1, 3], chunks=2, group=dist.group.WORLD, timeout=30)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        record = lm_steps(
            pipe, optimizer, seed=4, first=0, steps=steps, batch=4, chunks=2, max_norm=1e9
        )
        trained.append({"steps": record, "drift": pipe.shared_drift()})
    return {"pipelines": trained}


def case_late_builder(rank: int, *, late_rank: int, seconds: float) -> dict[str, Any]:
    """``late_rank`` builds a pipeline with tied weights after the others' timeout
    (``seconds``): each says which ranks it did not hear from; then every rank builds one
    alike and steps."""
    model, balance = tied(dist.get_world_size(), 7)
    if rank == late_rank:
        time.sleep(2 * seconds)
    outcome = _timed(
        lambda: GPipe(model, balance, chunks=2, group=dist.group.WORLD, timeout=seconds)
    )
    model, balance = tied(dist.get_world_size(), 7)
    pipe = GPipe(model, balance, chunks=2, group=dist.group.WORLD, timeout=30)
    return {**outcome, "reduced": pipe.step(*tokens(7, 4), TokenLoss()).reduced().item()}


def case_drift_alone(rank: int, *, odd_rank: int) -> dict[str, Any]:
    """``odd_rank`` calls shared_drift() while the others step: every rank raises at once;
    then every rank steps, and calls shared_drift()."""
    model, balance = tied(dist.get_world_size(), 7)
    pipe = GPipe(model, balance, chunks=2, group=dist.group.WORLD, timeout=30)
    x, y = tokens(7, 4)
    outcome = _timed(
        lambda: pipe.shared_drift() if rank == odd_rank else pipe.step(x, y, TokenLoss())
    )
    for p in pipe.parameters():
        p.grad = None
    losses = pipe.step(x, y, TokenLoss())
    return {
        **outcome,
        "reduced": losses.reduced().item(),
        "grads": {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()},
        "drift": pipe.shared_drift(),
    }


def _interrupt_in_run(
    pipe: GPipe, fired: list[bool], timers: list[threading.Timer], landed: list[str]
) -> Callable[[int, Any], None]:
    """A SIGINT handler that raises KeyboardInterrupt once, inside a call of gpipe_core
    while a run of ``pipe`` lasts (else it tries again a moment later, with a timer kept in
    ``timers``), and records that it did (or must not any more) in ``fired``, and the
    gpipe_core function it interrupted in ``landed``.

    An interrupt before the run has begun on a rank (in the first instructions of
    ``step()``) is one step less on that rank: the others' step pairs with its next one."""
    import signal

    transport = pipe._placement.transport()

    def handler(signum: int, frame: Any) -> None:
        if fired[0]:
            return
        inside = frame
        while inside is not None and "gpipe_core" not in inside.f_code.co_filename:
            inside = inside.f_back
        if inside is None or not transport.active:  # type: ignore[attr-defined]
            timers.append(threading.Timer(0.001, os.kill, (os.getpid(), signal.SIGINT)))
            timers[-1].start()
            return
        fired[0] = True
        landed.append(f"{inside.f_code.co_name} ({os.path.basename(inside.f_code.co_filename)})")
        raise KeyboardInterrupt

    return handler


def case_interrupted(rank: int, *, odd_rank: int, delays: list[float]) -> dict[str, Any]:
    """For each of ``delays``: ``odd_rank`` is interrupted (SIGINT, a KeyboardInterrupt
    raised inside gpipe) that many seconds into a few steps of a model with weights tied
    across ranks, and every rank goes on stepping; then each rank makes two more steps.
    Each phase's outcomes, and the last steps' losses and gradients."""
    import signal

    model, balance = tied(dist.get_world_size(), 7)
    pipe = GPipe(model, balance, chunks=2, group=dist.group.WORLD, timeout=10)
    x, y = tokens(7, 4)
    phases = []
    for delay in delays:
        fired, timers, landed = [rank != odd_rank], [], []
        handler = _interrupt_in_run(pipe, fired, timers, landed)
        previous = signal.signal(signal.SIGINT, handler)
        if rank == odd_rank:
            timers.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)))
            timers[0].start()
        outcomes = []
        try:
            for _ in range(4):
                try:
                    pipe.step(x, y, TokenLoss())
                    outcomes.append("ok")
                except KeyboardInterrupt:
                    outcomes.append("interrupted")
                except Exception as caught:
                    outcomes.append(f"{type(caught).__name__}: {caught}")
        finally:
            fired[0] = True  # no more interrupts (the steps ended first: none at all)
            while timers:
                timers.pop().join()
            signal.signal(signal.SIGINT, previous)
        after = []
        for _ in range(2):
            for p in pipe.parameters():
                p.grad = None
            losses = pipe.step(x, y, TokenLoss())
            after.append(
                {
                    "reduced": losses.reduced().item(),
                    "grads": {
                        k: v.clone() if v is not None else None
                        for k, v in local_grads(pipe).items()
                    },
                }
            )
        phases.append({"outcomes": outcomes, "after": after, "landed": landed})
    return {"phases": phases}


def case_disagree_build(rank: int, *, field: str, odd_rank: int) -> dict[str, Any]:
    """``odd_rank`` builds the pipeline with another ``field``; then every rank builds it
    alike and steps."""
    world = dist.get_world_size()
    layers, balance = AGREE_LAYERS, list(AGREE_BALANCE[world])
    kwargs: dict[str, Any] = {"chunks": 2, "checkpoint": "except_last"}
    odd = rank == odd_rank
    if odd and field == "balance":
        balance = [1, 2, 1, 2] if world == 4 else [2, 4]
    elif odd and field == "layers":
        layers = ("linear", "relu", *AGREE_LAYERS[2:])
    elif odd and field == "chunks":
        kwargs["chunks"] = 4
    elif odd and field == "checkpoint":
        kwargs["checkpoint"] = "never"
    elif odd and field == "deferred_batch_norm":
        kwargs["deferred_batch_norm"] = True
    model = build(layers, 0)
    before = [type(layer) for layer in model]
    outcome = _timed(lambda: GPipe(model, balance, group=dist.group.WORLD, timeout=30, **kwargs))
    # Nothing was changed before the ranks agreed: no layer converted or released.
    outcome["unchanged"] = [type(layer) for layer in model] == before
    return {**outcome, **_train_alike(9)}


def case_disagree_run(rank: int, *, field: str, odd_rank: int) -> dict[str, Any]:
    """``odd_rank`` runs a step with another ``field``; then every rank steps alike, on the
    same pipeline."""
    world = dist.get_world_size()
    pipe = GPipe(
        build(AGREE_LAYERS, 9),
        AGREE_BALANCE[world],
        chunks=2,
        group=dist.group.WORLD,
        timeout=30,
    )
    x, y = data(9, 4)
    odd = rank == odd_rank
    kwargs: dict[str, Any] = {}
    grad: contextlib.AbstractContextManager[Any] = torch.enable_grad()
    method = "step"
    if odd and field == "schedule":
        kwargs["schedule"] = "1f1b"
    elif odd and field == "training mode":
        pipe.eval()
    elif odd and field == "grad mode":
        grad = torch.no_grad()
    elif odd and field == "autocast":
        grad = torch.autocast("cpu", dtype=torch.bfloat16)
    elif odd and field == "reduction":
        kwargs["reduction"] = "sum"
    elif odd and field == "chunks":
        pipe.chunks = 4  # changed on one rank only, after the pipeline was built
    elif odd and field == "the method called":
        method = "clip_grad_norm_"
    loss_fn = nn.MSELoss(reduction=kwargs.get("reduction", "mean"))

    def step() -> None:
        with grad:
            if method == "step":
                pipe.step(x, y, loss_fn, **kwargs)
            else:
                pipe.clip_grad_norm_(1.0)

    outcome = _timed(step)
    grads = [p.grad for p in pipe.parameters()]
    outcome["no_grads_changed"] = all(g is None for g in grads)
    pipe.train()
    pipe.chunks = 2
    return {**outcome, **_step_again(pipe, x, y)}


def case_disagree_placement(rank: int, *, field: str, odd_rank: int) -> dict[str, Any]:
    """Four partitions on two ranks: ``odd_rank`` builds them with another placement, or
    steps with another schedule; then every rank steps alike."""
    layers, balance = AGREE_LAYERS, [2, 1, 1, 2]
    odd = rank == odd_rank
    placement, schedule = "loop", "interleaved-1f1b"
    if odd and field == "placement":
        placement = "v"
    elif odd and field == "no placement":
        placement = None  # type: ignore[assignment]
    elif odd and field == "schedule":
        schedule = "zb-h1"
    model = build(layers, 9)
    outcome: dict[str, Any] = {}

    def build_and_step() -> None:
        pipe = GPipe(model, balance, chunks=2, group=dist.group.WORLD, timeout=30,
                     placement=placement)  # fmt: skip
        outcome["built"] = True
        x, y = data(9, 4)
        pipe.step(x, y, nn.MSELoss(), schedule=schedule)

    outcome.update(_timed(build_and_step))
    return {**outcome, **_train_alike(9)}


class Unprintable(Exception):
    """An exception whose message cannot be printed."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


class Refuse(nn.Module):
    """The identity, which raises when armed (``to``: when moved; ``forward``: when run),
    with an exception that cannot be printed for ``unprintable``."""

    def __init__(self, armed: str | None = None) -> None:
        super().__init__()
        self.armed = armed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed == "forward":
            raise Fail("forward")
        if self.armed == "unprintable":
            raise Unprintable
        return x

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        if self.armed == "to":
            raise Fail("moving the layer")
        return super()._apply(fn, recurse)


def case_fail_build(rank: int, *, how: str, odd_rank: int) -> dict[str, Any]:
    """The constructor fails on ``odd_rank`` only: on a bad argument, or in moving a layer
    (after the ranks agreed); then every rank builds a pipeline alike and steps."""
    layers = build(("linear", "tanh", "linear", "linear"), 0)
    refuse = Refuse("to" if rank == odd_rank and how == "to" else None)
    model = nn.Sequential(*layers[:3], refuse, *layers[3:])
    chunks = 0 if rank == odd_rank and how == "argument" else 2
    outcome = _timed(
        lambda: GPipe(model, [2, 3], chunks=chunks, group=dist.group.WORLD, timeout=30)
    )
    return {**outcome, **_train_alike(9)}


def case_fail_unprintable(rank: int, *, odd_rank: int) -> dict[str, Any]:
    """A layer on ``odd_rank`` raises an exception whose ``str()`` raises; then a step."""
    layers = build(("linear", "tanh", "linear", "linear"), 0)
    refuse = Refuse("unprintable" if rank == odd_rank else None)
    pipe = GPipe(
        nn.Sequential(*layers[:3], refuse, *layers[3:]),
        [2, 3],
        chunks=2,
        group=dist.group.WORLD,
        timeout=30,
    )
    x, y = data(0, 4)
    outcome = _timed(lambda: pipe.step(x, y, nn.MSELoss()))
    outcome["type_name"] = outcome["error"].get("type")
    refuse.armed = None
    return {**outcome, **_step_again(pipe, x, y)}


def case_concurrent(rank: int) -> dict[str, Any]:
    """A second thread calls step() while the first thread's step runs; then a step."""
    pipe = GPipe(build(AGREE_LAYERS, 9), [3, 3], chunks=2, group=dist.group.WORLD, timeout=30)
    x, y = data(9, 4)
    other: dict[str, Any] = {}

    def second() -> None:
        other.update(_timed(lambda: pipe.step(x, y, nn.MSELoss())))

    def hook(*_: object) -> None:
        if not other:
            thread = threading.Thread(target=second)
            thread.start()
            thread.join()

    handle = next(iter(pipe)).register_forward_hook(hook)
    first = pipe.step(x, y, nn.MSELoss()).reduced().item()
    handle.remove()
    return {"other": other, "first": first, **_step_again(pipe, x, y)}


def case_reentrant(rank: int, *, odd_rank: int) -> dict[str, Any]:
    """A layer's hook on ``odd_rank`` calls the pipeline's step() again; then a step."""
    pipe = GPipe(build(AGREE_LAYERS, 9), [3, 3], chunks=2, group=dist.group.WORLD, timeout=30)
    x, y = data(9, 4)

    def hook(*_: object) -> None:
        pipe.step(x, y, nn.MSELoss())

    handle = next(iter(pipe)).register_forward_hook(hook) if rank == odd_rank else None
    outcome = _timed(lambda: pipe.step(x, y, nn.MSELoss()))
    if handle is not None:
        handle.remove()
    return {**outcome, **_step_again(pipe, x, y)}


def case_copy(rank: int) -> dict[str, Any]:
    """copy.deepcopy and pickling of a pipeline across processes; a copy of its layers."""
    import copy
    import io

    pipe = GPipe(build(AGREE_LAYERS, 9), [3, 3], chunks=2, group=dist.group.WORLD, timeout=30)
    outcomes = {
        "deepcopy": _timed(lambda: copy.deepcopy(pipe)),
        "save": _timed(lambda: torch.save(pipe, io.BytesIO())),
    }
    layers = copy.deepcopy(pipe.unwrap())
    return {**outcomes, "layers": len(layers)}


def case_never_steps(rank: int, *, late_rank: int, seconds: float) -> dict[str, Any]:
    """``late_rank`` never calls step(): the others raise within the timeout (``seconds``)
    and a little more, not twice it."""
    pipe = GPipe(
        build(("linear", "linear"), 0), [1, 1], chunks=2, group=dist.group.WORLD, timeout=seconds
    )
    x, y = data(0, 4)
    if rank == late_rank:
        time.sleep(2.5 * seconds)
        return {}
    return _timed(lambda: pipe.step(x, y, nn.MSELoss()))


def case_strict_load(rank: int) -> dict[str, Any]:
    """A checkpoint without a batch norm's ``num_batches_tracked``, and the keys of a layer
    named ``partitions``, across ranks."""
    from collections import OrderedDict

    layers = build(AGREE_LAYERS, 9)
    named = nn.Sequential(
        OrderedDict(
            (("partitions" if k == 0 else f"l{k}"), layer) for k, layer in enumerate(layers)
        )
    )
    pipe = GPipe(named, [3, 3], chunks=2, group=dist.group.WORLD, timeout=30)
    state = pipe.state_dict()
    keys = list(state)
    state.pop("l3.num_batches_tracked", None)
    outcome = _timed(lambda: pipe.load_state_dict(state))
    return {**outcome, "keys": keys}


#: Pipelines dropped only when the process ends (see :func:`case_leave`).
LEFT: list[GPipe] = []


def case_leave(rank: int) -> None:
    """A step on a pipeline that lives until the process ends, as a script's model that
    its ``main()`` drops when it returns, right before the interpreter exits."""
    pipe = GPipe(build(("linear", "linear"), 0), [1, 1], chunks=2, group=dist.group.WORLD)
    x, y = data(0, 4)
    pipe.step(x, y, nn.MSELoss())
    LEFT.append(pipe)


def case_meta_init(rank: int, *, how: str, seed: int) -> dict[str, Any]:
    """Build meta_models' model on the meta device, keep this rank's layers, initialised by
    ``init=`` (``how``: ``"state"``, the plain model's state dict and the buffers rebuilt;
    ``"seeded"``, a seeded init of each layer; ``"refused"``, only rank 0 rebuilds its
    buffers); a step's loss, this rank's gradients and the inference output. A refusal is
    returned as an error, with the loss of a pipeline built next on the group."""
    module = meta_models.meta_model()
    state = meta_models.plain_model(seed).state_dict()
    if how == "seeded":
        init: Any = meta_models.seeded_init(module, seed)
    elif how == "state" or rank == 0:
        init = [state, meta_models.rebuild_buffers]
    else:
        init = state
    try:
        pipe = GPipe(module, [3, 3], chunks=2, group=dist.group.WORLD, timeout=60, init=init)
    except Exception as caught:
        again = GPipe(build(("linear",) * 2, 0), [1, 1], group=dist.group.WORLD, timeout=60)
        x, y = data(0, 4)
        reduced = again.step(x, y, nn.MSELoss()).reduced().item()
        return {"error": _error(caught), "reduced": reduced}
    x, y = meta_models.data(seed, 6)
    losses = pipe.step(x, y, nn.MSELoss())
    grads = {k: v.clone() if v is not None else None for k, v in local_grads(pipe).items()}
    pipe.eval()
    with torch.no_grad():
        output = pipe(x if pipe.partition_ranks[0] == rank else None)
    return {"reduced": losses.reduced().item(), "grads": grads, "output": output}


# -- decode runs ---------------------------------------------------------------------------


class Cached(nn.Module):
    """Mixes its input with the mean of every input its lane has seen (a decode run's
    cache, in :func:`gpipe_core.lane_state`)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = lane_state(self)
        if state is None:  # outside a decode run: no cache
            return x + self.mix(x)
        past = state.get("cache")
        cache = x[:, None] if past is None else torch.cat([past, x[:, None]], dim=1)
        state["cache"] = cache
        return x + self.mix(cache.mean(dim=1))


def cached_model(seed: int, layers: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(Cached() if k % 2 == 0 else nn.Tanh() for k in range(layers)))


class Halving:
    """A decode run's feedback: each lane's next input is its output halved, until its round
    ``stops[lane]``; it keeps every output."""

    def __init__(self, stops: list[int]) -> None:
        self.stops = stops
        self.outputs: dict[tuple[int, int], list[list[float]]] = {}

    def __call__(self, lane: int, round: int, output: torch.Tensor) -> torch.Tensor | None:
        self.outputs[lane, round] = output.tolist()
        return None if round + 1 >= self.stops[lane] else output * 0.5


def decode_input(seed: int, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDTH, generator=generator, dtype=torch.float64)


def case_decode(
    rank: int, *, balance: list[int], chunks: int, rounds: int, stops: list[int]
) -> dict[str, Any]:
    """A decode run across the ranks (the last one's outputs given to every rank by the
    run's result), then a step on the same pipeline (its layers without a cache)."""
    pipe = GPipe(
        cached_model(0, sum(balance)), balance, chunks=chunks, group=dist.group.WORLD, timeout=60
    )
    feedback = Halving(stops)
    outputs = pipe.decode(
        decode_input(1, 2 * chunks), feedback=feedback, rounds=rounds,
        result=lambda: feedback.outputs,
    )  # fmt: skip
    x, y = data(0, 4)
    return {"outputs": outputs, "reduced": pipe.step(x, y, nn.MSELoss()).reduced().item()}


def case_decode_die(rank: int, *, dying_rank: int) -> dict[str, Any]:
    """``dying_rank`` exits in the third round of a decode run; the others must fail, not
    hang."""
    pipe = GPipe(cached_model(0), [2, 2], chunks=2, group=dist.group.WORLD, timeout=30)
    if rank == dying_rank:
        calls = [0]

        def die(*_: object) -> None:
            calls[0] += 1
            if calls[0] > 4:
                os._exit(3)

        pipe[0].register_forward_hook(die)  # type: ignore[arg-type]
    try:
        pipe.decode(decode_input(1, 4), feedback=Halving([5, 5]), rounds=5)
    except Exception as caught:
        return _error(caught)
    return {}


def case_decode_disagree(rank: int, *, odd_rank: int) -> dict[str, Any]:
    """``odd_rank`` asks for other rounds, then another agreed value: every rank is refused
    alike; then every rank decodes alike, on the same pipeline."""
    pipe = GPipe(cached_model(0), [2, 2], chunks=2, group=dist.group.WORLD, timeout=30)
    odd = rank == odd_rank
    found: dict[str, Any] = {}
    for name, rounds, agree in (
        ("rounds", 4 if odd else 3, {}),
        ("agree", 3, {"options": "a" if odd else "b"}),
    ):
        try:
            pipe.decode(decode_input(1, 4), feedback=Halving([9, 9]), rounds=rounds, agree=agree)
        except Exception as caught:
            found[name] = _error(caught)
    feedback = Halving([3, 3])
    found["outputs"] = pipe.decode(
        decode_input(1, 4), feedback=feedback, rounds=3, result=lambda: feedback.outputs
    )
    return found


CASES: dict[str, Callable[..., Any]] = {
    name[len("case_") :]: value for name, value in globals().items() if name.startswith("case_")
}


def join_store(port: int, seconds: float) -> dist.TCPStore:
    """The store the test's process holds (``meeting_store`` in cluster.py), as a client."""
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=seconds)
    )


def main() -> None:
    rank, world, port = (int(arg) for arg in sys.argv[1:4])
    torch.set_num_threads(1)
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # prints must not mix with the replies
    dist.init_process_group(
        "gloo",
        store=join_store(port, 60),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        while True:
            try:
                name, kwargs = read_frame(requests)
            except EOFError:
                break
            try:
                reply: tuple[Any, ...] = ("ok", CASES[name](rank, **kwargs))
            except BaseException as error:
                reply = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
            write_frame(replies, reply)
    finally:
        LEFT.clear()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
