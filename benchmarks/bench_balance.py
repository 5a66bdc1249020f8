"""Balance benchmark: the solver's bottleneck against the exact optimum and simple splits.

Run it as a script (``python benchmarks/bench_balance.py``, or ``nox -s bench``). It prints:

1. over many random cost sequences, the ratio of each method's bottleneck (its largest
   partition cost) to the exact optimum, found here by an independent dynamic program:
   ``solve``, a uniform split (the same number of layers per partition) and a running-sum
   split (cut where the running total crosses each multiple of total / partitions);
2. for a few model shapes profiled on the CPU with small inputs (a ResNet-like stack, a
   transformer stack, an AmoebaNet-like uneven stack), the per-layer costs by
   ``profile_sizes`` and ``profile_times`` and the same ratios.

A ratio of 1.00 is optimal; the solver's ratio is exactly 1 by construction, and this
script checks it. Ratios come from one run on one machine; no timing is compared across runs.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch
from torch import nn

from gpipe_balance import profile_sizes, profile_times, solve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _step_models import Bottleneck

Splitter = Callable[[Sequence[float], int], list[int]]


# --------------------------------------------------------------------------------------------
# Reference and simple splits
# --------------------------------------------------------------------------------------------


def exact_blocks(costs: Sequence[float], balance: Sequence[int]) -> list[Fraction]:
    exact = [Fraction(c) for c in costs]
    blocks, start = [], 0
    for count in balance:
        blocks.append(sum(exact[start : start + count], Fraction(0)))
        start += count
    return blocks


def bottleneck(costs: Sequence[float], balance: Sequence[int]) -> Fraction:
    return max(exact_blocks(costs, balance))


def optimum(costs: Sequence[float], partitions: int) -> Fraction:
    """The smallest bottleneck, by a plain O(partitions * layers^2) dynamic program."""
    exact = [Fraction(c) for c in costs]
    scale = math.lcm(*(c.denominator for c in exact))
    ints = [int(c * scale) for c in exact]
    prefix = [0]
    for c in ints:
        prefix.append(prefix[-1] + c)
    layers = len(ints)
    inf = prefix[-1] + 1
    best = [0] + [inf] * layers  # zero blocks: only the empty prefix
    for j in range(1, partitions + 1):
        best = [inf] * j + [
            min(max(best[s], prefix[i] - prefix[s]) for s in range(j - 1, i))
            for i in range(j, layers + 1)
        ]
    return Fraction(best[layers], scale)


def uniform(costs: Sequence[float], partitions: int) -> list[int]:
    """The same number of layers in each partition (the first ones take the remainder)."""
    base, extra = divmod(len(costs), partitions)
    return [base + (1 if i < extra else 0) for i in range(partitions)]


def running_sum(costs: Sequence[float], partitions: int) -> list[int]:
    """Cut after the layer whose running total first reaches each i * total / partitions."""
    total = math.fsum(costs)
    layers = len(costs)
    cuts: list[int] = []
    running = 0.0
    for index, cost in enumerate(costs):
        running += cost
        needed = partitions - 1 - len(cuts)
        if needed == 0:
            break
        # Cut here if the running total reached the next target, or if every remaining
        # layer must start a partition of its own.
        target = (len(cuts) + 1) * total / partitions
        if running >= target or layers - (index + 1) == needed:
            cuts.append(index + 1)
    bounds = [0, *cuts, layers]
    return [b - a for a, b in itertools.pairwise(bounds)]


METHODS: dict[str, Splitter] = {"solve": solve, "uniform": uniform, "running sum": running_sum}


# --------------------------------------------------------------------------------------------
# Random cost sequences
# --------------------------------------------------------------------------------------------


def random_costs(rng: random.Random, layers: int, kind: str) -> list[float]:
    if kind == "uniform":
        return [rng.random() for _ in range(layers)]
    if kind == "lognormal":
        return [rng.lognormvariate(0, 1.5) for _ in range(layers)]
    if kind == "small ints":
        return [float(rng.randint(0, 4)) for _ in range(layers)]
    # "spikes": mostly cheap layers with a few very expensive ones.
    return [rng.choice([0.1] * 8 + [5.0, 20.0]) for _ in range(layers)]


def summarize(ratios: list[float]) -> str:
    return (
        f"mean {statistics.fmean(ratios):5.3f}  median {statistics.median(ratios):5.3f}  "
        f"max {max(ratios):6.3f}  optimal {sum(r == 1 for r in ratios) / len(ratios):6.1%}"
    )


def random_section(trials: int, seed: int) -> None:
    print(f"Random cost sequences ({trials} per kind, 4 to 48 layers, 2 to 8 partitions)")
    print("bottleneck / exact optimum")
    rng = random.Random(seed)
    for kind in ("uniform", "lognormal", "small ints", "spikes"):
        ratios: dict[str, list[float]] = {name: [] for name in METHODS}
        for _ in range(trials):
            layers = rng.randint(4, 48)
            partitions = rng.randint(2, min(8, layers))
            costs = random_costs(rng, layers, kind)
            best = optimum(costs, partitions)
            for name, method in METHODS.items():
                balance = method(costs, partitions)
                assert len(balance) == partitions and min(balance) >= 1, (name, balance)
                got = bottleneck(costs, balance)
                ratios[name].append(1.0 if got == best else float(got / best))
        if any(r != 1.0 for r in ratios["solve"]):
            sys.exit(f"solve missed the optimum on {kind} costs")
        for name, values in ratios.items():
            print(f"  {kind:10s}  {name:11s}  {summarize(values)}")
    print()


# --------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------


def resnet_like() -> tuple[nn.Sequential, torch.Tensor]:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
    ]
    inplanes = 32
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for index in range(blocks):
            layers.append(Bottleneck(inplanes, planes, stride if index == 0 else 1))
            inplanes = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, 10)]
    return nn.Sequential(*layers), torch.randn(8, 3, 32, 32)


def transformer_like() -> tuple[nn.Sequential, torch.Tensor]:
    width = 128
    layers: list[nn.Module] = [nn.Linear(32, width)]
    for _ in range(8):
        layers.append(
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        )
    layers += [nn.LayerNorm(width), nn.Linear(width, 1000)]
    return nn.Sequential(*layers), torch.randn(8, 64, 32)


class Cell(nn.Module):
    """An uneven cell: branches of separable convolutions, summed."""

    def __init__(self, channels: int, out: int, stride: int, branches: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(
                nn.ReLU(),
                nn.Conv2d(channels, channels, 3, stride, 1, groups=channels, bias=False),
                nn.Conv2d(channels, out, 1, bias=False),
                nn.BatchNorm2d(out),
            )
            for _ in range(branches)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.branches[0](x)
        for branch in self.branches[1:]:
            result = result + branch(x)
        return result


def amoebanet_like() -> tuple[nn.Sequential, torch.Tensor]:
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1)]
    channels = 32
    for stage in range(3):
        for _ in range(4):
            layers.append(Cell(channels, channels, 1, branches=2 + stage))
        if stage < 2:  # a reduction cell: wider, more branches, half the resolution
            layers.append(Cell(channels, 2 * channels, 2, branches=5))
            channels *= 2
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers), torch.randn(8, 3, 32, 32)


def short(values: Sequence[float], scale: float, unit: str) -> str:
    return " ".join(f"{v / scale:.3g}" for v in values) + f" ({unit})"


def model_section(timeout: float) -> None:
    print("Model shapes (CPU, small inputs): bottleneck / solver's bottleneck")
    torch.manual_seed(0)
    for name, build in (
        ("resnet-like", resnet_like),
        ("transformer-like", transformer_like),
        ("amoebanet-like", amoebanet_like),
    ):
        model, sample = build()
        sizes = profile_sizes(model, sample, chunks=2)
        times = profile_times(model, sample, timeout=timeout)
        print(f"  {name}: {len(model)} layers")
        print(f"    sizes: {short(sizes, 2**20, 'MiB')}")
        print(f"    times: {short(times, 1e-3, 'ms')}")
        for cost_name, costs in (("size", sizes), ("time", times)):
            for partitions in (2, 4, 8):
                best = bottleneck(costs, solve(costs, partitions))
                assert best == optimum(costs, partitions)
                ratios = {
                    method: float(bottleneck(costs, METHODS[method](costs, partitions)) / best)
                    for method in ("uniform", "running sum")
                }
                row = "  ".join(f"{method} {ratio:5.2f}" for method, ratio in ratios.items())
                print(f"    by {cost_name}, {partitions} partitions: solve 1.00  {row}")
    print()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300, help="random instances per kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=0.5, help="profile_times timeout (s)")
    args, _ = parser.parse_known_args(argv)  # nox -s bench passes its arguments to every script
    torch.set_num_threads(1)
    random_section(args.trials, args.seed)
    model_section(args.timeout)


if __name__ == "__main__":
    main()
