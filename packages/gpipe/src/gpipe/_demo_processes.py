"""The demo across processes: ``python -m gpipe demo --processes N``.

Every rank of a gloo group builds the demo's network and data from the seed, and trains
it with :class:`~gpipe_core.GPipe` across the group (``group=``, partition ``j`` on rank
``j % N``) with :meth:`~gpipe_core.GPipe.step`; the first rank prints the loss as it goes.
Then the first rank trains the same network on the same data with the same pipeline in
one process, and prints both throughputs side by side. The ranks are those
:func:`gpipe._launch.launch` starts, or ``torchrun``'s.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch
import torch.distributed as dist
from torch import nn

from gpipe_core import GPipe

from ._demo import DemoConfig, demo_balance, demo_setup
from ._launch import report_error, watch_launcher

__all__ = ["ProcessesReport", "rank_main", "run_rank"]


@dataclass(frozen=True)
class ProcessesReport:
    """What the demo across processes measured (on the first rank)."""

    processes: int
    balance: list[int]
    partition_ranks: list[int]
    #: The loss of each step, across processes.
    losses: list[float]
    #: The loss of each step of the same pipeline in one process.
    single_losses: list[float]
    samples_per_s: float
    single_samples_per_s: float
    #: Whether every process runs on this host (``LOCAL_WORLD_SIZE`` is the world's size).
    one_host: bool = True

    def format(self) -> str:
        """The report as the command line prints it."""
        n = self.processes
        ranks = ", ".join(f"{j} -> rank {r}" for j, r in enumerate(self.partition_ranks))
        rows = [
            ("processes", f"{n} (gloo), partition {ranks}"),
            ("loss", f"{self.losses[0]:.4f} -> {self.losses[-1]:.4f}"),
            ("loss (1 process)", f"{self.single_losses[0]:.4f} -> {self.single_losses[-1]:.4f}"),
            (f"throughput ({n} processes)", f"{self.samples_per_s:,.0f} samples/s"),
            ("throughput (1 process)", f"{self.single_samples_per_s:,.0f} samples/s"),
            (
                f"{n} processes / 1 process",
                f"{self.samples_per_s / self.single_samples_per_s:.2f}x",
            ),
        ]
        width = max(len(label) for label, _ in rows) + 2
        lines = [f"{label + ':':<{width}}{value}" for label, value in rows]
        if self.one_host:
            cores = os.cpu_count() or 1
            if n > cores:
                lines.append(
                    f"note: {n} processes share {cores} CPU cores here, so they cannot all "
                    "work at once"
                )
            lines.append(
                "note: the processes share this host's CPU, where one process's worker "
                "threads already overlap the partitions; processes pay off when each has a "
                "device or a host of its own"
            )
        return "\n".join(lines)


def _train(
    pipe: GPipe,
    rank: int,
    config: DemoConfig,
    data: torch.Tensor,
    target: torch.Tensor,
    log: Callable[[int, float], None] | None,
) -> tuple[list[float], float]:
    """Train ``pipe`` for ``config.steps`` steps on this rank; each step's loss and the
    seconds the steps took."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    first, last = pipe.partition_ranks[0] == rank, pipe.partition_ranks[-1] == rank
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        index = step % data.size(0)
        optimizer.zero_grad(set_to_none=True)
        # Across processes, the input is used on the first partition's rank only, the target
        # on the last one's: the others give None.
        step_losses = pipe.step(
            data[index] if first else None,
            target[index] if last else None,
            loss_fn,
            schedule=config.schedule,
        )
        if config.tied:
            pipe.clip_grad_norm_(1.0)  # the whole pipeline's norm, the same on every rank
        optimizer.step()
        losses.append(step_losses.reduced().item())  # the same on every rank
        if log is not None:
            log(step, losses[-1])
    return losses, time.perf_counter() - start


def _logger(config: DemoConfig, out: TextIO) -> Callable[[int, float], None]:
    """Print the loss of the first step, of every ``log_every``-th and of the last."""
    digits = len(str(config.steps))

    def log(step: int, loss: float) -> None:
        number = step + 1
        if number == 1 or number % config.log_every == 0 or number == config.steps:
            print(f"step {number:>{digits}}/{config.steps}  loss {loss:.4f}", file=out, flush=True)

    return log


def run_rank(
    config: DemoConfig, rank: int, world: int, out: TextIO | None = None
) -> ProcessesReport | None:
    """Run the demo as ``rank`` of ``world`` processes; the report on rank 0.

    Joins the gloo group from the environment (``MASTER_ADDR``, ``MASTER_PORT``), trains
    across it, leaves it, then (rank 0) trains the same pipeline in one process. Every wait
    for another process lasts at most ``config.timeout`` seconds.
    """
    out = sys.stdout if out is None else out
    torch.set_num_threads(1)
    balance = demo_balance(config.partitions)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=config.timeout),
    )
    try:
        data, target, model = demo_setup(config)
        pipe = GPipe(
            model,
            balance,
            devices=["cpu"] * (config.partitions // world),
            chunks=config.chunks,
            checkpoint=config.checkpoint,  # type: ignore[arg-type]
            group=dist.group.WORLD,
            timeout=config.timeout,
        )
        partition_ranks = list(pipe.partition_ranks)
        if rank == 0:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            print(
                f"gpipe across {world} processes (gloo, {where}): balance {balance}, "
                f"{config.chunks} micro-batches, schedule {config.schedule}, one intra-op "
                "thread per process"
                + (", layers 2 and 8 tied, gradients clipped to norm 1" if config.tied else ""),
                file=out,
                flush=True,
            )
        losses, elapsed = _train(
            pipe, rank, config, data, target, _logger(config, out) if rank == 0 else None
        )
        del pipe  # its transport's threads end before the group does
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None

    print("the same pipeline in one process, for comparison", file=out, flush=True)
    _, _, model = demo_setup(config)  # the same initial network
    with warnings.catch_warnings():
        # One process on purpose, after the group is gone: not the pipeline across the
        # processes that torchrun's environment would otherwise warn about.
        warnings.filterwarnings("ignore", "this process is one of", UserWarning)
        single = GPipe(
            model,
            balance,
            devices=["cpu"] * config.partitions,
            chunks=config.chunks,
            checkpoint=config.checkpoint,  # type: ignore[arg-type]
        )
    single_losses, single_elapsed = _train(single, 0, config, data, target, None)
    samples = config.steps * config.batch_size
    return ProcessesReport(
        processes=world,
        balance=balance,
        partition_ranks=partition_ranks,
        losses=losses,
        single_losses=single_losses,
        samples_per_s=samples / elapsed,
        single_samples_per_s=samples / single_elapsed,
        one_host=os.environ.get("LOCAL_WORLD_SIZE", str(world)) == str(world),
    )


def rank_main(config: DemoConfig, rank: int, world: int) -> int:
    """The demo on one rank, as the command line runs it; the exit status.

    Under :func:`gpipe._launch.launch` or ``torchrun``, an error is written to torch's
    error file (the launcher prints the failing rank's error, ``torchrun`` its summary)
    and the status is 1; elsewhere it is raised.
    Ctrl-C ends the rank quietly (status 130).
    """
    watch_launcher()
    try:
        report = run_rank(config, rank, world)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        if not report_error(error):
            raise
        return 1
    if report is not None:
        print(report.format(), flush=True)
    return 0
