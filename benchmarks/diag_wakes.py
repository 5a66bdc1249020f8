"""Diagnostic: how often threads sleep per task, counted rather than timed.

Counts the voluntary context switches of every thread of this process (Linux's
``/proc/self/task/*/status``: one each time a thread blocks, on a lock, a condition, a
queue or the GIL) over many runs of the tiny P2 M32 model, and prints them per task
(``n * m`` tasks per run) for ``step()`` with each schedule and ``forward()`` +
``backward()``. A wake costs about half a thread round trip, so these counts are what
``bench_step.py``'s overhead lines in round trips come from, without its timing noise.
Beside them, how many of those blocks were a worker waiting for a message (``message
waits``): the rest are the workers handing each other the interpreter lock, which every
PyTorch operator releases and takes again.

Run: ``python benchmarks/diag_wakes.py [--checkpoint never|except_last|always] [--runs N]``
(Linux only; not run by ``nox -s bench``, which runs ``bench_*.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpipe_core import GPipe
from gpipe_core.transport._transport import LocalTransport, Message, MessageKey

#: Receives that found no message yet (so waited), since the last reset.
message_waits = {"waits": 0}
_receive = LocalTransport.receive


def _counting_receive(self: LocalTransport, key: MessageKey) -> Message:
    if key not in self.messages:  # read without the lock: a count, not a decision
        message_waits["waits"] += 1
    return _receive(self, key)


LocalTransport.receive = _counting_receive  # type: ignore[method-assign]


def switches() -> dict[int, int]:
    """Voluntary context switches of each thread of this process, by thread id."""
    counts = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches"):
                        counts[int(tid)] = int(line.split()[1])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return counts


def names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def count(fn: Callable[[], object], runs: int, tasks: int) -> tuple[dict[str, float], float, float]:
    for _ in range(3):
        fn()
    message_waits["waits"] = 0
    before = switches()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(runs):
        fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = switches()
    named = names()
    result: dict[str, float] = {}
    for tid, value in after.items():
        delta = value - before.get(tid, 0)
        if delta:
            name = named.get(tid, str(tid))
            result[name] = result.get(name, 0.0) + delta / (runs * tasks)
    result["(message waits)"] = message_waits["waits"] / (runs * tasks)
    return result, wall / (runs * tasks), cpu / (runs * tasks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="never")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument(
        "--serial",
        action="store_true",
        help="every partition in the calling thread: the code's own cost",
    )
    args = parser.parse_args()
    if args.serial:
        from gpipe_core import _placement

        _placement.Placement.threaded = lambda self, nested: False  # type: ignore[method-assign]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = GPipe(layers, [1, 1], chunks=args.chunks, checkpoint=args.checkpoint)
    x, y = torch.randn(32, 4), torch.randn(32, 4)
    loss_fn = nn.MSELoss()
    tasks = 2 * args.chunks
    ways: dict[str, Callable[[], object]] = {
        "plain": lambda: loss_fn(layers(x), y).backward(),
        # The micro-batches one after the other, one backward pass each: micro-batching's
        # own cost, which the pipeline's ways pay too.
        "plain mb": lambda: [
            (loss_fn(layers(xi), yi) * (len(xi) / len(x))).backward()
            for xi, yi in zip(x.tensor_split(args.chunks), y.tensor_split(args.chunks), strict=True)
        ],
        "fwd+bwd": lambda: loss_fn(model(x), y).backward(),
        "step gpipe": lambda: model.step(x, y, loss_fn, schedule="gpipe"),
        "step 1f1b": lambda: model.step(x, y, loss_fn, schedule="1f1b"),
    }
    print(f"voluntary context switches per task, tiny P2 M{args.chunks} {args.checkpoint}")
    for way, fn in ways.items():
        counted, wall, cpu = count(fn, args.runs, tasks)
        waits = counted.pop("(message waits)")
        total = sum(counted.values())
        detail = ", ".join(
            [f"{name} {value:.2f}" for name, value in sorted(counted.items())]
            + [f"message waits {waits:.2f}"]
        )
        print(
            f"  {way:11} {total:5.2f}  ({detail})"
            f"  [rough, noisy: wall {wall * 1e6:.0f} us, "
            f"cpu {cpu * 1e6:.0f} us per task]"
        )


if __name__ == "__main__":
    main()
