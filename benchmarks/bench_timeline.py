"""Timeline benchmark: what recording costs, and what it costs when it is off.

Run it as a script (``python benchmarks/bench_timeline.py``, or ``nox -s bench``). For a
pipelined MLP on the CPU (4 partitions, 8 micro-batches), it prints:

1. the time of the check a forward pass makes when nothing records it (no ``model.trace()``
   block, no profiler), beside the time of one training step: the cost of recording off;
2. the median step time with recording off, inside ``with model.trace()``, and under
   ``torch.profiler.profile`` (all threads), as ratios to recording off.

The three ways are interleaved step by step, so that the machine's load affects them alike.
Ratios come from one run on one machine; no timing is compared across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from gpipe_core import GPipe, tracing


def _profile() -> AbstractContextManager[object]:
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    return torch.profiler.profile(experimental_config=config)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per way")
    parser.add_argument("--width", type=int, default=256, help="hidden width")
    args, _ = parser.parse_known_args(argv)  # nox -s bench passes its arguments to every script
    torch.set_num_threads(1)
    torch.manual_seed(0)
    partitions, chunks = 4, 8
    layers = [m for _ in range(partitions) for m in (nn.Linear(args.width, args.width), nn.Tanh())]
    model = GPipe(nn.Sequential(*layers), [2] * partitions, chunks=chunks)
    x = torch.randn(chunks * 32, args.width)

    def step() -> None:
        model(x).sum().backward()

    for _ in range(3):  # warm up: start the workers, allocate
        step()

    ways: dict[str, Callable[[], AbstractContextManager[object]]] = {
        "off": nullcontext,
        "trace": model.trace,
        "profiler": _profile,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.steps):
        for name, way in ways.items():
            with way():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}

    number = 100_000
    check = timeit.timeit(lambda: tracing.tracer_for(model, chunks), number=number) / number
    print(f"timeline benchmark: {partitions} partitions, {chunks} micro-batches, CPU")
    print(f"  recording off: the check of a forward pass takes {check * 1e6:.3f} us, "
          f"{check / median['off']:.1e} of a step ({median['off'] * 1e3:.2f} ms)")  # fmt: skip
    for name in ways:
        print(f"  step time, {name:<8}: {median[name] / median['off']:.2f} x off")


if __name__ == "__main__":
    main()
