"""What the ranks of the mesh tests run (``GPipe(..., mesh=mesh)``), imported by
``distributed_cases.py`` into its cases.

The mesh is ``(pp, dp)`` over four ranks, ``pp`` outermost as torchtitan lays it out: rank
``r`` runs the partitions of pipeline rank ``r // dp`` and passes data-parallel share
``r % dp`` of each mini-batch. The meshes (their process groups) are made once per rank
process and shape, and reused by every case.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from gpipe_core import GPipe, NoChunk

#: The meshes made in this rank's process, by shape and names.
MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The mesh of ``shape`` and ``names`` over every rank, made once per process."""
    key = (tuple(shape), tuple(names))
    if key not in MESHES:
        MESHES[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return MESHES[key]


def full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor whole: a DTensor gathered (collective over its mesh), a tensor cloned."""
    if tensor is None:
        return None
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def data_share(rank: int, shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[int, int]:
    """Which data-parallel share of each mini-batch ``rank`` passes, and of how many: its
    coordinates along the mesh's ``"dp_"`` dimensions, in the mesh's order (the ranks of
    one ``"tp"`` group pass the same)."""
    coordinates = []
    for size in reversed(shape):
        coordinates.append(rank % size)
        rank //= size
    coordinates.reverse()
    index, count = 0, 1
    for name, size, coordinate in zip(names, shape, coordinates, strict=True):
        if name.startswith("dp_"):
            index, count = index * size + coordinate, count * size
    return index, count


def share(rank: int, shape: tuple[int, ...], names: tuple[str, ...], batch: int) -> slice:
    """The samples of a mini-batch of ``batch`` that ``rank`` passes (see
    :func:`data_share`)."""
    index, count = data_share(rank, shape, names)
    part = batch // count
    return slice(index * part, (index + 1) * part)


def tied_model(model: nn.Sequential, tie: tuple[int, int] | None) -> nn.Sequential:
    """``model`` with layer ``b``'s weight tied to layer ``a``'s (``tie = (a, b)``; None:
    as it is)."""
    if tie is not None:
        a, b = tie
        model[b].weight = model[a].weight
    return model


def tp_model(seed: int) -> nn.Sequential:
    """Two column- and row-parallel pairs (``4 -> 8 -> 4``, a tanh between), float64: one
    pair per partition of ``[3, 3]``, parallelized with :data:`TP_PLAN`."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)
    ).double()


def parallelized(model: nn.Sequential, mesh: DeviceMesh) -> nn.Sequential:
    """:func:`tp_model` with each pair column- then row-parallel over ``mesh["tp"]``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(),
            "5": RowwiseParallel()}  # fmt: skip
    return parallelize_module(model, mesh["tp"], plan)  # type: ignore[arg-type,return-value]


def fsdp_in_tasks(profiler: Any) -> dict[str, list[str]]:
    """Each FSDP collective event of a profile (its name: ``FSDP::all_gather``,
    ``FSDP::post_backward_reduce``) and the gpipe task labels (``gpipe/...``) of the same
    thread whose interval holds it: what the trace shows of the collectives."""
    events = profiler.events()
    tasks = [e for e in events if e.name.startswith("gpipe/")]
    found: dict[str, list[str]] = {}
    for event in events:
        if event.name not in ("FSDP::all_gather", "FSDP::post_backward_reduce"):
            continue
        start, end = event.time_range.start, event.time_range.end
        around = [
            task.name
            for task in tasks
            if task.thread == event.thread
            and task.time_range.start <= start
            and end <= task.time_range.end
        ]
        found.setdefault(event.name, []).append(",".join(sorted(around)))
    return found


def case_mesh_steps(
    rank: int,
    *,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    layers: tuple[str, ...],
    balance: list[int],
    seed: int,
    batch: int,
    chunks: int,
    checkpoint: str = "except_last",
    schedule: str = "gpipe",
    placement: str | None = None,
    steps: int = 3,
    reshard_after_forward: bool | None = None,
    clip: float | None = None,
    count: bool = False,
    profiled: bool = False,
    keywords: bool = False,
    tie: tuple[int, int] | None = None,
    fail_first: bool = False,
    infer: bool = False,
    save: str | None = None,
    tp: bool = False,
    save_all: str | None = None,
    resume: str | None = None,
    first_step: int = 0,
) -> dict[str, Any]:
    """``steps`` steps of AdamW on the pipeline over the mesh, each rank on its share of
    each mini-batch: per step its losses, the full gradients (gathered) and, after the
    optimizer's step, the full parameters, under the plain names; with ``clip``, the norm
    ``clip_grad_norm_`` returned and the gradients it left, before the optimizer's step;
    with ``count``, the reduce-scatters, all-gathers and all-reduces each step made. With
    ``keywords``, the input goes by keyword to a first layer ``"todict"`` (``x=``, a
    ``NoChunk`` mask of ones and a scale of 1: the plain model's numbers). With ``tie``
    ``(a, b)``, layer ``b``'s weight is layer ``a``'s (see :func:`tied_model`). With
    ``fail_first``, a first step in which each ``"trap"`` layer raises in the backward
    pass of its first graph (its error, or another rank's, as ``"failed"``), before the
    steps. With ``infer``, then ``forward()`` in eval mode without grad on the share of the
    last step's mini-batch (the output on the last partition's rank, None elsewhere). With
    ``save``, the state dict (DTensors) saved there by ``torch.distributed.checkpoint``;
    with ``save_all``, the model's and the optimizer's (``get_state_dict``), which
    ``resume`` loads before the steps (``set_state_dict``); the steps' data from step
    ``first_step`` on. With ``tp``, the model is :func:`tp_model`, parallelized over
    ``mesh["tp"]`` before the pipeline is built (``layers`` unused)."""
    from __main__ import build, data  # the rank script's own models and data

    mesh = mesh_of(shape, names)
    model = parallelized(tp_model(seed), mesh) if tp else tied_model(build(layers, seed), tie)
    pipe = GPipe(
        model, balance, chunks=chunks, checkpoint=checkpoint,  # type: ignore[arg-type]
        placement=placement, mesh=mesh, timeout=60, reshard_after_forward=reshard_after_forward,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    if resume is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(pipe, optimizer)
        both = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(both, checkpoint_id=resume)
        set_state_dict(
            pipe, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"]
        )
    part = share(rank, shape, names, batch)
    kinds = ("reduce_scatter_single", "all_gather_single", "all_reduce")
    counts = dict.fromkeys(kinds, 0)
    real = {kind: getattr(dist, kind) for kind in kinds}

    def counted(kind: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += 1
            return real[kind](*args, **kwargs)

        return call

    failed = None
    if fail_first:
        from __main__ import Trap

        traps = [layer for layer in pipe.modules() if isinstance(layer, Trap)]
        for trap in traps:
            trap.armed = ("backward", 0)
        x, y = data(seed - 1, batch)
        try:
            pipe.step(x[part], y[part], nn.MSELoss(), schedule=schedule)
        except Exception as error:
            failed = f"{type(error).__name__}: {error}"
        for trap in traps:
            trap.armed = None
        optimizer.zero_grad()
    results = []
    for k in range(first_step, first_step + steps):
        x, y = data(seed + k, batch)
        if count:
            for kind in kinds:
                setattr(dist, kind, counted(kind))
        cpu = [torch.profiler.ProfilerActivity.CPU]
        profiler = torch.profiler.profile(activities=cpu) if profiled else None
        if profiler is not None:
            profiler.start()
        try:
            if keywords:
                ones = NoChunk(torch.ones(x.shape[1], dtype=x.dtype))
                losses = pipe.step(
                    x=x[part], mask=ones, scale=1.0, target=y[part], loss_fn=nn.MSELoss(),
                    schedule=schedule,
                )  # fmt: skip
            else:
                losses = pipe.step(x[part], y[part], nn.MSELoss(), schedule=schedule)
        finally:
            for kind in kinds:
                setattr(dist, kind, real[kind])
            if profiler is not None:
                profiler.stop()
        step: dict[str, Any] = {
            "losses": [loss.item() for loss in losses],
            "grads": {name: full(p.grad) for name, p in pipe.named_parameters()},
            "counts": dict(counts),
            "sharded": {
                name: list(p.to_local().shape) if isinstance(p, DTensor) else None
                for name, p in pipe.named_parameters()
            },
        }
        if profiler is not None:
            step["collectives"] = fsdp_in_tasks(profiler)
            labels = [e for e in profiler.events() if e.name.startswith("gpipe/")]
            step["labels"] = [e.name for e in sorted(labels, key=lambda e: e.time_range.start)]
        counts.update(dict.fromkeys(kinds, 0))
        if clip is not None:
            step["norm"] = pipe.clip_grad_norm_(clip).item()
            step["clipped"] = {name: full(p.grad) for name, p in pipe.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        step["values"] = {name: full(p) for name, p in pipe.named_parameters()}
        results.append(step)
    if save is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(pipe.state_dict(), checkpoint_id=save)
    if save_all is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(pipe, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=save_all)
    output = None
    if infer:
        pipe.eval()
        with torch.no_grad():
            output = pipe(x[part])
        pipe.train()
    return {"steps": results, "drift": pipe.shared_drift(), "failed": failed, "output": output}


def case_mesh_load(
    rank: int,
    *,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    layers: tuple[str, ...],
    balance: list[int],
    path: str,
    placement: str | None = None,
) -> dict[str, Any]:
    """A pipeline on the mesh, its layers built on the meta device, loads the checkpoint
    at ``path`` (``torch.distributed.checkpoint``, into its DTensors); its parameters,
    gathered."""
    import torch.distributed.checkpoint as dcp

    from __main__ import build

    with torch.device("meta"):
        module = build(layers, 0)
    pipe = GPipe(module, balance, chunks=2, mesh=mesh_of(shape, names), placement=placement,
                 timeout=60)  # fmt: skip
    state = pipe.state_dict()
    dcp.load(state, checkpoint_id=path)
    pipe.load_state_dict(state)
    return {"values": {name: full(p) for name, p in pipe.named_parameters()}}


def case_mesh_error(rank: int, *, how: str) -> dict[str, Any]:
    """The error (type and message) of a pipeline built on a mesh gpipe refuses, and
    whether the module was left as it was."""
    from __main__ import build

    model = build(("linear", "tanh", "linear", "linear"), 1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    kwargs: dict[str, Any] = {}
    balance = [2, 2]
    if how == "no_pp":
        mesh = mesh_of((4,), ("dp_shard",))
    elif how == "unknown":
        mesh = mesh_of((2, 2), ("pp", "fsdp"))
    elif how == "cp":
        mesh = mesh_of((2, 2), ("pp", "cp"))
    elif how == "dtensor_elsewhere":  # parallelized over a "tp" the mesh given lacks
        model = parallelized(tp_model(1), mesh_of((2, 2), ("pp", "tp")))
        before = {name: full(p) for name, p in model.named_parameters()}
        balance = [3, 3]
        mesh = mesh_of((2, 2), ("pp", "dp_shard"))
    elif how == "pp_size":
        mesh = mesh_of((2, 2), ("pp", "dp_shard"))
        balance = [1, 1, 1, 1]
    elif how == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        mesh = mesh_of((2, 2), ("pp", "dp_shard"))
        # FSDP1 needs an accelerator to be built: a wrapper made without its __init__,
        # holding the layer as FSDP1 does, is one all the same.
        wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
        nn.Module.__init__(wrapper)
        wrapper._modules["_fsdp_wrapped_module"] = model[2]
        model[2] = wrapper
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
    elif how == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        mesh = mesh_of((2, 2), ("pp", "dp_shard"))
        fully_shard(model[2], mesh=mesh["dp_shard"])
        before = {name: full(p) for name, p in model.named_parameters()}
    elif how == "group":
        mesh = mesh_of((2, 2), ("pp", "dp_shard"))
        kwargs["group"] = dist.group.WORLD
    elif how == "data_group":
        mesh = mesh_of((2, 2), ("pp", "dp_shard"))
        kwargs["data_group"] = dist.group.WORLD
    elif how == "tied":  # partitions 0 and 3 on rank 0
        mesh = mesh_of((2, 2), ("pp", "dp_shard"))
        balance, kwargs["placement"] = [1, 1, 1, 1], "v"
        model[3].weight = model[0].weight
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
    elif how == "not_a_mesh":
        mesh = ("pp", "dp_shard")  # type: ignore[assignment]
    elif how == "order":
        mesh = mesh_of((1, 2, 2), ("pp", "dp_shard", "dp_replicate"))
    elif how == "reshard_without_shard":
        mesh = mesh_of((2, 2), ("pp", "dp_replicate"))
        kwargs["reshard_after_forward"] = False
    else:
        raise ValueError(how)
    try:
        GPipe(model, balance, chunks=2, mesh=mesh, timeout=60, **kwargs)
    except Exception as error:
        after = {name: full(p) for name, p in model.named_parameters()}
        unchanged = before.keys() == after.keys() and all(
            torch.equal(full(before[name]), after[name])  # type: ignore[arg-type]
            for name in before
        )
        return {"type": type(error).__name__, "message": str(error), "unchanged": unchanged}
    return {"type": None, "message": "", "unchanged": True}
