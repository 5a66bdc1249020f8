"""Timeline benchmark: what recording costs, and what it costs when it is off.

Run it as a script (``python benchmarks/bench_timeline.py``, or ``nox -s bench``). One
training step (forward and backward) of a small MLP through ``GPipe`` on the CPU is timed
four ways, interleaved round by round so that the machine's load affects them alike:

- ``no hook``: the tracing hook replaced by a function that returns None: the pipeline as it
  would be without the timeline feature;
- ``off``: the default: the hook finds that no trace and no profiler is active;
- ``trace``: inside ``with model.trace()``, every task recorded;
- ``profiler``: under ``torch.profiler.profile`` with all threads, every task labelled.

It prints the median step time of each way and the ratios ``off / no hook`` (the cost of the
feature when unused: 1.00 within noise), ``trace / off`` and ``profiler / off``, and the
time of the hook's check itself. The ways take turns going first. Only ratios within this
run are meaningful.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

import gpipe_core.run._run as run_module
from gpipe_core import GPipe
from gpipe_core.trace import _tracing as tracing


def mlp(width: int, partitions: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[m for _ in range(partitions) for m in (nn.Linear(width, width), nn.Tanh())]
    )


@contextmanager
def no_hook() -> Iterator[None]:
    real = run_module.tracer_for  # where a run looks its tracer up
    run_module.tracer_for = lambda module, microbatches: None  # type: ignore[assignment]
    try:
        yield
    finally:
        run_module.tracer_for = real


def all_threads_profiler() -> AbstractContextManager[object]:
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    return torch.profiler.profile(experimental_config=config)


def measure(partitions: int, chunks: int, width: int, rounds: int) -> dict[str, float]:
    model = GPipe(mlp(width, partitions), [2] * partitions, chunks=chunks)
    x = torch.randn(8 * chunks, width)

    def step() -> None:
        model(x).sum().backward()

    ways: dict[str, Callable[[], AbstractContextManager[object]]] = {
        "no hook": no_hook,
        "off": nullcontext,
        "trace": model.trace,
        "profiler": all_threads_profiler,
    }
    for way in ways.values():  # warm up: start the workers, allocate
        with way():
            step()
    times: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    for k in range(rounds):
        # Each way goes first in turn, so that no way always follows the same one.
        for name in order[k % len(order) :] + order[: k % len(order)]:
            way = ways[name]
            with way():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(values) for name, values in times.items()}
    number = 100_000
    result["check"] = (
        timeit.timeit(lambda: tracing.tracer_for(model, chunks), number=number) / number
    )
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per way and case")
    parser.add_argument("--width", type=int, default=256, help="width of the MLP")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args, _ = parser.parse_known_args(argv)  # nox -s bench passes its arguments to every script
    torch.set_num_threads(args.threads)

    print(
        f"Timeline overhead: MLP width {args.width}, two layers per partition, 8 rows per "
        f"micro-batch, {args.rounds} rounds, torch threads {torch.get_num_threads()}"
    )
    header = (
        "case",
        "no hook ms",
        "off ms",
        "off/no hook",
        "trace/off",
        "profiler/off",
        "check us",
    )
    print(f"{header[0]:<8}" + "".join(f"{h:>14}" for h in header[1:]))
    for partitions, chunks in [(2, 4), (2, 8), (4, 8)]:
        t = measure(partitions, chunks, args.width, args.rounds)
        row = [
            f"{t['no hook'] * 1e3:.2f}",
            f"{t['off'] * 1e3:.2f}",
            f"{t['off'] / t['no hook']:.3f}",
            f"{t['trace'] / t['off']:.3f}",
            f"{t['profiler'] / t['off']:.3f}",
            f"{t['check'] * 1e6:.3f}",
        ]
        print(f"{f'P{partitions} M{chunks}':<8}" + "".join(f"{v:>14}" for v in row))


if __name__ == "__main__":
    main()
