"""Pipelines on a device mesh, for ``bench_distributed.py``: four gloo processes, a
transformer of 8 encoder layers, one training step (AdamW's included) timed in each layout,
and each rank's bytes of parameters, gradients and optimizer state.

Layouts: ``pp4`` (four stages, ``group=``), ``pp2 x dp_replicate2`` and ``pp2 x dp_shard2``
(``GPipe(mesh=...)``, each data-parallel rank on its half of the mini-batch), ``pp2 x
dp_shard2 kept`` (``reshard_after_forward=False``: the gathered parameters kept between
micro-batches, as FSDP keeps a root unit's, the peer's stage module), none checkpointed, and
the peer:
``torch.distributed.pipelining`` with torchtitan's composition on the same ``pp2 x
dp_shard2`` mesh (each stage's module ``fully_shard``-ed over ``"dp_shard"``, a
``PipelineStage`` per rank, ``Schedule1F1B``). Every layout runs the 1F1B schedule at four
micro-batches, interleaved round by round, each step timed from a barrier to the last
rank's end. The processes are started here (``torch.multiprocessing`` spawn, gloo on
127.0.0.1); every wait is bounded and every process is ended and reaped.
"""

from __future__ import annotations

import os
import queue
import socket
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 4
LAYERS = 8
CHUNKS = 4
LAYOUTS = (
    "pp4",
    "pp2 x dp_replicate2",
    "pp2 x dp_shard2",
    "pp2 x dp_shard2 kept",
    "pipelining pp2 x dp_shard2",
)


def _model(d_model: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        )
    )


def _bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (a sharded tensor's
    local shard)."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    total = 0
    for parameter in module.parameters():
        if parameter.is_meta:
            continue
        tensors = [parameter, parameter.grad, *optimizer.state.get(parameter, {}).values()]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                held = local(tensor)
                total += held.numel() * held.element_size()
    return total


def _builders(rank: int, d_model: int) -> dict[str, Any]:
    """Each layout's step on this rank (a callable of the data) and its bytes."""
    from torch.distributed.device_mesh import init_device_mesh

    from gpipe_core import GPipe

    loss_fn = nn.MSELoss()
    made: dict[str, Any] = {}
    # No checkpointing, as the peer's stages (and every case of bench_distributed.py).
    pipe = GPipe(
        _model(d_model), [2] * 4, chunks=CHUNKS, group=dist.group.WORLD, checkpoint="never"
    )
    made["pp4"] = (pipe, torch.optim.AdamW(pipe.parameters()), None)
    kinds = (
        ("pp2 x dp_replicate2", "dp_replicate", {}),
        ("pp2 x dp_shard2", "dp_shard", {}),
        # The peer's stage module is FSDP's root unit, which keeps its gathered parameters
        # between micro-batches: the same choice.
        ("pp2 x dp_shard2 kept", "dp_shard", {"reshard_after_forward": False}),
    )
    for name, dim, options in kinds:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dim))
        pipe = GPipe(
            _model(d_model), [4, 4], chunks=CHUNKS, mesh=mesh, checkpoint="never", **options
        )
        made[name] = (pipe, torch.optim.AdamW(pipe.parameters()), mesh[dim].get_local_rank())
    made["pipelining pp2 x dp_shard2"] = _pipelining(d_model, loss_fn)
    return made


def _pipelining(d_model: int, loss_fn: nn.Module) -> tuple[Any, Any, int]:
    """torchtitan's composition: this pp rank's layers ``fully_shard``-ed over
    ``"dp_shard"``, a ``PipelineStage``, ``Schedule1F1B``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    stage_index = mesh["pp"].get_local_rank()
    layers = list(_model(d_model))[stage_index * 4 : stage_index * 4 + 4]
    module = nn.Sequential(*layers)
    fully_shard(module, mesh=mesh["dp_shard"])
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=CHUNKS, loss_fn=loss_fn)
    return (schedule, torch.optim.AdamW(module.parameters()), mesh["dp_shard"].get_local_rank())


def _step(layout: str, made: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    target, optimizer, share = made
    if share is not None:
        half = x.shape[0] // 2
        x, y = x[share * half : share * half + half], y[share * half : share * half + half]
    optimizer.zero_grad(set_to_none=True)
    if layout.startswith("pipelining"):
        stage = target._stage  # the schedule's stage: first takes x, last the target
        if stage.is_first:
            target.step(x)
        elif stage.is_last:
            target.step(target=y)
        else:
            target.step()
    else:
        target.step(x, y, nn.MSELoss(), schedule="1f1b")
    optimizer.step()


def _rank(
    rank: int, port: int, d_model: int, shape: tuple[int, ...], rounds: int, out: Any
) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        made = _builders(rank, d_model)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(*shape, generator=generator)
        y = torch.randn(*shape, generator=generator)
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for layout in LAYOUTS:  # warm-up
            for _ in range(2):
                _step(layout, made[layout], x, y)
        for k in range(rounds):
            order = LAYOUTS[k % len(LAYOUTS) :] + LAYOUTS[: k % len(LAYOUTS)]
            for layout in order:
                dist.barrier()
                start = time.perf_counter()
                _step(layout, made[layout], x, y)
                times[layout].append(time.perf_counter() - start)
        held = {}
        for layout in LAYOUTS:
            target, optimizer, _ = made[layout]
            module = target._stage.submod if layout.startswith("pipelining") else target
            held[layout] = _bytes(module, optimizer)
        out.put((rank, True, {"times": times, "bytes": held}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_mesh(quick: bool, rounds: int, timeout: float = 600.0) -> dict[str, Any] | str:
    """Each layout's step time (per round, the slowest rank's; the median) and each rank's
    bytes; or why it did not run."""
    d_model = 64 if quick else 128
    shape = (8, 16, d_model) if quick else (16, 32, d_model)
    context = mp.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_rank, args=(rank, port, d_model, shape, rounds, out))
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    replies: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(replies) < WORLD:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"not every rank answered within {timeout:.0f} s"
            try:
                rank, ok, value = out.get(timeout=min(left, 5.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    return "a rank died"
                continue
            if not ok:
                return f"rank {rank} raised: {value.strip().splitlines()[-1]}"
            replies[rank] = value
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
    steps = {
        layout: statistics.median(
            max(replies[r]["times"][layout][k] for r in range(WORLD)) for k in range(rounds)
        )
        for layout in LAYOUTS
    }
    held = {layout: [replies[r]["bytes"][layout] for r in range(WORLD)] for layout in LAYOUTS}
    return {"steps": steps, "bytes": held, "d_model": d_model, "shape": shape}


def report(found: dict[str, Any] | str) -> list[tuple[str, float | None, float]]:
    """Print the mesh table and return its targets."""
    if isinstance(found, str):
        print(f"Pipelines on a device mesh: not measured ({found})\n")
        return []
    steps, held = found["steps"], found["bytes"]
    print(
        f"Pipelines on a device mesh: {WORLD} gloo processes, {LAYERS} encoder layers of "
        f"d_model {found['d_model']}, batch {tuple(found['shape'])}, 1F1B at {CHUNKS} "
        "micro-batches, AdamW; step time (the slowest rank's, median) and each rank's "
        "parameter + gradient + optimizer bytes"
    )
    rows = []
    for layout in LAYOUTS:
        largest = max(held[layout])
        rows.append(
            [
                layout, f"{steps[layout] * 1e3:.1f}", f"{largest / 2**20:.2f}",
                " ".join(f"{b / 2**20:.2f}" for b in held[layout]),
            ]
        )  # fmt: skip
    width = max(len(row[0]) for row in rows)
    print(f"  {'layout':<{width}}  step ms  largest MiB  per rank MiB")
    for row in rows:
        print(f"  {row[0]:<{width}}  {row[1]:>7}  {row[2]:>11}  {row[3]}")
    print()
    shard, replicate = max(held["pp2 x dp_shard2"]), max(held["pp2 x dp_replicate2"])
    return [
        (
            "mesh: pp2 x dp_shard2 bytes per rank / pp2 x dp_replicate2's <= 0.55",
            shard / replicate,
            0.55,
        ),
        (
            "mesh: pp2 x dp_shard2 step (parameters kept gathered between micro-batches, as "
            "the peer's root unit keeps them) / pipelining's with FSDP on the same mesh <= 1",
            steps["pp2 x dp_shard2 kept"] / steps["pipelining pp2 x dp_shard2"],
            1.0,
        ),
    ]
