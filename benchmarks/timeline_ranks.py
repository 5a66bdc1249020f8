"""Both ranks' timelines of one training step across two processes, gpipe's ways and
torch.distributed.pipelining's side by side: where each rank computes and where it waits.

Run it as a script (``python benchmarks/timeline_ranks.py``); it is not one of ``nox -s
bench``'s benchmarks (it prints timelines, not ratios with targets). The case is one of
``bench_schedules.py``'s compute-bound models (``--case``, the transformer at M4 by
default), on 2 gloo ranks (127.0.0.1), one intra-op thread each; the ways are named as
there (``dist zbv v``: ``GPipe(..., group=WORLD)`` with ``placement="v"``; ``pipe zbv v``:
pipelining's ``ScheduleZBVZeroBubble`` with the same partitions on the same ranks). Each
way is warmed up, timed over ``--rounds`` steps (the ways interleaved, each step from a
barrier), then traced over one more step on every rank: gpipe's ways with
:meth:`gpipe_core.GPipe.trace`, pipelining's by timing its stages' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` (pipelining waits for its
messages inside these, so its waits are in its tasks' spans, not in its gaps).

For each way, each rank: how long its traced step call took and how much of it came before
its first task and after its last (the step's own work: checks, messages, the loss), the
span of its tasks, the time in them, the gaps between them, the time per kind of task
(``F`` forward, ``B`` whole backward, ``I`` input gradient, ``W`` weight gradient, ``L``
loss, ``C`` copy), then its tasks in order: ``[gap]`` before a task that started more than
0.3 ms after the one before ended, the task (kind, micro-batch, ``p`` and the partition)
and its milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

import _step_models as sm
import bench_schedules as bs

#: One task on a rank's timeline: start and end (ns), label, kind.
Task = tuple[int, int, str, str]

_KINDS = {
    "forward": "F",
    "recompute": "R",
    "backward": "B",
    "input-gradient": "I",
    "weight-gradient": "W",
    "copy": "C",
    "loss": "L",
}
DEFAULT_WAYS = ("dist 1f1b", "dist zbv v", "pipe 1f1b", "pipe zbv v")


@contextmanager
def _pipelining_tasks() -> Iterator[list[Task]]:
    """Time every pipelining stage's forward, backward and weight-gradient calls while the
    block runs."""
    from torch.distributed.pipelining import stage as stage_module

    tasks: list[Task] = []
    owner = stage_module._PipelineStageBase
    saved = {
        name: getattr(owner, name)
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    }

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return method(self, chunk, *args, **kwargs)
            finally:
                if name == "forward_one_chunk":
                    kind = "F"
                elif name == "backward_weight_one_chunk":
                    kind = "W"
                else:
                    kind = "B" if kwargs.get("full_backward", True) else "I"
                label = f"{kind}{chunk}p{self.stage_index}"
                tasks.append((start, time.perf_counter_ns(), label, kind))

        return run

    for name, method in saved.items():
        setattr(owner, name, timed(name, method))
    try:
        yield tasks
    finally:
        for name, method in saved.items():
            setattr(owner, name, method)


def _traced(way: str, step: tuple[Any, Callable[[], object]]) -> tuple[list[Task], int, int]:
    """One step of ``way`` on this rank: its tasks, and when the step's call started and
    ended, on the tasks' clock (gpipe's: from the recording's start, a few microseconds
    before the call)."""
    model, run = step
    if way.startswith("dist"):
        with model.trace() as timeline:
            start = time.perf_counter_ns()
            run()
            end = time.perf_counter_ns()
        tasks = [
            (
                e.start_ns,
                e.end_ns,
                f"{_KINDS[e.phase.value]}{e.microbatch}p{e.partition}",
                _KINDS[e.phase.value],
            )
            for e in timeline.events
        ]
        return tasks, 0, end - start
    with _pipelining_tasks() as recorded:
        start = time.perf_counter_ns()
        run()
        end = time.perf_counter_ns()
    return list(recorded), start, end


def describe(tasks: Sequence[Task], call: tuple[int, int]) -> list[str]:
    """A rank's lines: its step call and its totals, then its tasks in order with the gaps
    before them."""
    if not tasks:
        return [f"step call {(call[1] - call[0]) / 1e6:.1f} ms, no tasks"]
    tasks = sorted(tasks)
    first, last = tasks[0][0], max(end for _, end, _, _ in tasks)
    busy, kinds, line, reached = 0, {}, [], first
    for start, end, label, kind in tasks:
        busy += max(0, end - max(start, reached))
        kinds[kind] = kinds.get(kind, 0) + end - start
        gap = (start - reached) / 1e6
        line.append((f"[{gap:.1f}] " if gap > 0.3 else "") + f"{label} {(end - start) / 1e6:.1f}")
        reached = max(reached, end)
    span = last - first
    totals = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(kinds.items()))
    return [
        f"step call {(call[1] - call[0]) / 1e6:.1f} ms ({(first - call[0]) / 1e6:.1f} before its"
        f" first task, {(call[1] - last) / 1e6:.1f} after its last); tasks' span"
        f" {span / 1e6:.1f} ms, in tasks {busy / 1e6:.1f}, gaps {(span - busy) / 1e6:.1f};"
        f" {totals}",
        " | ".join(line),
    ]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        case = next(c for c in bs.compute_cases(sm.Sizes.of(args.quick)) if c.name == args.case)
        steps, unbuilt = sm._rank_steps(rank, world, case, args.ways, 120.0)
        times: dict[str, list[float]] = {way: [] for way in steps}
        for round_ in range(args.warmup + args.rounds):
            for way, (model, run) in steps.items():
                model.zero_grad(set_to_none=True)
                dist.barrier()
                start = time.perf_counter()
                run()
                if round_ >= args.warmup:
                    times[way].append(time.perf_counter() - start)
        if rank == 0:
            print(f"{case.name}, 2 ranks, {args.threads} intra-op thread(s) each", flush=True)
            for way, why in unbuilt.items():
                print(f"\n== {way}: {why}", flush=True)
        for way, step in steps.items():
            dist.barrier()
            tasks, *call = _traced(way, step)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (statistics.median(times[way]), tasks, call))
            if rank == 0:
                median = max(m for m, _, _ in gathered)
                print(f"\n== {way}: median step {median * 1e3:.1f} ms (the slowest rank's)")
                for r, (_, rank_tasks, rank_call) in enumerate(gathered):
                    head, *rest = describe(rank_tasks, rank_call)
                    print(f" rank {r}: {head}")
                    for text in rest:
                        print(f"   {text}")
                print(end="", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [c.name for c in bs.compute_cases(sm.Sizes.of(False))]
    parser.add_argument("--case", choices=names, default=names[0])
    parser.add_argument(
        "--ways", nargs="+", default=list(DEFAULT_WAYS), help="dist and pipe ways, as named"
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed steps of each way")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each way first")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--quick", action="store_true", help="the smaller sizes of --quick")
    args = parser.parse_args(argv)
    for way in args.ways:
        try:
            kind = sm.parse_way(way).kind
        except ValueError as error:
            parser.error(f"--ways: {error}")
        if kind not in ("dist", "pipe"):
            parser.error(f"--ways: {way!r} is not a way across processes (dist or pipe)")
    why = sm.pipelining_check()
    if why is not None:
        args.ways = [w for w in args.ways if not w.startswith("pipe")]
        print(f"pipelining's ways left out: {why}")
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, sm.free_port(), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
