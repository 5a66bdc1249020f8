"""Timeline benchmark: what recording costs, and what it costs when it is off.

Run it as a script (``python benchmarks/bench_timeline.py``, or ``nox -s bench``). One
training step (forward and backward) of a small MLP through ``GPipe`` is timed, in one
process and interleaved round by round, three ways:

- ``no hook``: the pipeline with the tracing hook replaced by a function that returns None,
  the pipeline as it would be without the timeline feature;
- ``off``: the default, the hook asks whether a trace or a profiler is active, and nothing is;
- ``on``: inside ``model.trace()``, every task recorded.

It prints the median step time of each and the ratios ``off / no hook`` (the cost of the
feature when unused: it should be 1.00 within noise) and ``on / off`` (the cost of
recording). Only ratios within this run are meaningful; the machine may be shared.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import gpipe_core.gpipe as gpipe_module
from gpipe_core import GPipe


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    )


def step(model: GPipe, x: torch.Tensor) -> None:
    model(x).sum().backward()


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(partitions: int, chunks: int, width: int, rounds: int) -> dict[str, float]:
    model = GPipe(mlp(width, 2 * partitions), [2] * partitions, chunks=chunks)
    x = torch.randn(8 * chunks, width)
    real_hook = gpipe_module.tracer_for
    samples: dict[str, list[float]] = {"no hook": [], "off": [], "on": []}

    def without_hook() -> None:
        gpipe_module.tracer_for = lambda module, microbatches: None  # type: ignore[assignment]
        try:
            step(model, x)
        finally:
            gpipe_module.tracer_for = real_hook

    def traced() -> None:
        with model.trace():
            step(model, x)

    runs: dict[str, Callable[[], None]] = {
        "no hook": without_hook,
        "off": lambda: step(model, x),
        "on": traced,
    }
    for fn in runs.values():  # warm up the workers and the allocator
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--width", type=int, default=256, help="width of the MLP")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args, _ = parser.parse_known_args()  # nox -s bench passes the same arguments to every script
    torch.set_num_threads(args.threads)

    print(f"Timeline overhead: MLP width {args.width}, {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print(
        f"{'case':<10}{'no hook ms':>12}{'off ms':>10}{'on ms':>10}{'off/no hook':>13}{'on/off':>9}"
    )
    for partitions, chunks in [(2, 4), (2, 8), (4, 8)]:
        t = measure(partitions, chunks, args.width, args.rounds)
        print(
            f"{f'P{partitions} M{chunks}':<10}{t['no hook'] * 1e3:>12.2f}{t['off'] * 1e3:>10.2f}"
            f"{t['on'] * 1e3:>10.2f}{t['off'] / t['no hook']:>13.3f}{t['on'] / t['off']:>9.3f}"
        )


if __name__ == "__main__":
    main()
