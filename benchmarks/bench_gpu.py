"""gpipe on one GPU: ResNet-101 throughput and memory beside torchgpipe, and a CPU+GPU pair.

Run it as a script on a machine with a CUDA GPU (``python benchmarks/bench_gpu.py``); without
one it says so and exits 0, so that ``nox -s bench`` can run it anywhere. ``--device cpu
--quick`` runs the same code on a small network on the CPU (to check the script, not to
measure anything).

Three parts, all in one process on one device, each time the median of ``--steps`` training
steps after ``--warmup`` steps (the device synchronized around each):

- **Throughput**, torchgpipe's "pipeline-1" experiment and its neighbours: a ResNet-101
  written as an ``nn.Sequential`` of 40 layers (the stem's four, 33 bottleneck blocks, pool,
  flatten and the classifier), trained with cross entropy on random 224 x 224 images. The
  plain model, then gpipe with 1, 2 and 4 partitions, all on the same GPU, at 1, 4 and 8
  micro-batches: ``fwd+bwd`` (``GPipe.forward()`` then ``loss.backward()``), ``step gpipe``
  and ``step 1f1b`` (:meth:`GPipe.step`), and torchgpipe 0.0.7 where it is installed, every
  one with its default checkpointing (``'except_last'``) and the same balance (the times of
  each layer measured once with :func:`gpipe_balance.profile_times`, then cut by
  :func:`gpipe_balance.solve`). Samples per second, and the ratio to the plain model. With
  every partition on one device nothing runs in parallel: the ratio shows what
  micro-batches and checkpointing cost, as torchgpipe's pipeline-1 row did.
- **Memory**: the peak memory a training step adds to what the model and its gradients
  hold (``torch.cuda.max_memory_allocated``), for the plain model and for gpipe (``fwd+bwd``,
  one partition and two) with each checkpoint mode, and torchgpipe beside it.
- **CPU + GPU**: a float64 MLP with its first partition on the CPU and its second on the
  GPU, then the other way round: the largest difference of the loss and of any gradient
  from the plain model's, and the step time beside the plain model on each device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _step_models import Bottleneck, print_table
from gpipe_balance import profile_times, solve
from gpipe_core import GPipe

MODES = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b")


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


def resnet(blocks: Sequence[int], width: int = 64, classes: int = 1000) -> nn.Sequential:
    """A ResNet as one flat ``nn.Sequential``: ``blocks=(3, 4, 23, 3)`` is ResNet-101."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    inputs = width
    for stage, count in enumerate(blocks):
        planes = width * 2**stage
        for index in range(count):
            stride = 2 if stage > 0 and index == 0 else 1
            layers.append(Bottleneck(inputs, planes * 4, stride))
            inputs = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


@dataclass
class Setting:
    blocks: tuple[int, ...]
    width: int
    image: int
    batch: int
    classes: int

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        return resnet(self.blocks, self.width, self.classes)

    def data(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(self.batch, 3, self.image, self.image, generator=generator)
        y = torch.randint(0, self.classes, (self.batch,), generator=generator)
        return x.to(device), y.to(device)


RESNET101 = Setting(blocks=(3, 4, 23, 3), width=64, image=224, batch=128, classes=1000)
QUICK = Setting(blocks=(1, 1, 2, 1), width=8, image=32, batch=16, classes=10)


# --------------------------------------------------------------------------------------------
# Timing and memory
# --------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_memory(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes a step allocates at its peak beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    fn()  # gradients exist from here on, as in training
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def training_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, way: str
) -> Callable[[], object]:
    loss_fn = nn.CrossEntropyLoss()

    def zero() -> None:
        for parameter in model.parameters():
            parameter.grad = None

    if way.startswith("step "):
        schedule = way.split()[1]

        def step() -> object:
            zero()
            return model.step(x, target=y, loss_fn=loss_fn, schedule=schedule)  # type: ignore[operator]

        return step

    def forward_backward() -> object:
        zero()
        output = model(x)
        loss = loss_fn(output, y.to(output.device))
        loss.backward()
        return loss

    return forward_backward


def torchgpipe_model(
    module: nn.Sequential, balance: list[int], devices: list[torch.device], chunks: int, mode: str
) -> nn.Module | str:
    try:
        import torchgpipe
    except ImportError as error:
        return f"not installed ({error})"
    try:
        return torchgpipe.GPipe(module, balance, devices=devices, chunks=chunks, checkpoint=mode)
    except Exception as error:  # a torchgpipe that does not work with this torch
        return f"does not work here: {error!r}"


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# The three parts
# --------------------------------------------------------------------------------------------


def balances(setting: Setting, device: torch.device, counts: Sequence[int]) -> dict[int, list[int]]:
    module = setting.model().to(device)
    x, _ = setting.data(device)
    times = profile_times(module, x[: max(1, setting.batch // 8)], passes=3, progress=False)
    del module
    release(device)
    return {n: solve(times, n) for n in counts}


def throughput(
    setting: Setting,
    device: torch.device,
    splits: dict[int, list[int]],
    chunk_counts: Sequence[int],
    steps: int,
    warmup: int,
) -> None:
    x, y = setting.data(device)
    plain = setting.model().to(device)
    base = median_time(training_step(plain, x, y, "plain"), device, steps, warmup)
    del plain
    release(device)
    rows = [["plain", "", "", f"{base * 1e3:.1f}", f"{setting.batch / base:.0f}", "1.000"]]
    ways = ("fwd+bwd", *(f"step {s}" for s in SCHEDULES), "torchgpipe")
    unrun: dict[str, str] = {}
    for n, balance in splits.items():
        for chunks in chunk_counts:
            devices = [device] * n
            for way in ways:
                if way == "torchgpipe":
                    model = torchgpipe_model(
                        setting.model(), balance, devices, chunks, "except_last"
                    )
                else:
                    model = GPipe(setting.model(), balance, devices=devices, chunks=chunks)
                if isinstance(model, str):
                    unrun[way] = model
                    continue
                try:
                    seconds = median_time(training_step(model, x, y, way), device, steps, warmup)
                except Exception as error:  # say it, and go on with the other ways
                    unrun[f"{way} n={n} m={chunks}"] = repr(error)
                    continue
                finally:
                    del model
                    release(device)
                rows.append(
                    [
                        way,
                        str(balance),
                        str(chunks),
                        f"{seconds * 1e3:.1f}",
                        f"{setting.batch / seconds:.0f}",
                        f"{base / seconds:.3f}",
                    ]
                )
    print_table(["way", "balance", "chunks", "ms/step", "samples/s", "x plain"], rows)
    for way, reason in unrun.items():
        print(f"  {way} did not run: {reason}")
    print()


def memory(
    setting: Setting, device: torch.device, splits: dict[int, list[int]], chunks: int
) -> None:
    if device.type != "cuda":
        print("Memory: measured on a CUDA device only\n")
        return
    x, y = setting.data(device)
    plain = setting.model().to(device)
    base = step_memory(training_step(plain, x, y, "plain"), device)
    assert base is not None
    del plain
    release(device)
    rows = [["plain", "", "", f"{base / 2**20:.0f}", "1.000"]]
    for n, balance in splits.items():
        devices = [device] * n
        for mode in MODES:
            for way in ("fwd+bwd", "torchgpipe"):
                if way == "torchgpipe":
                    model = torchgpipe_model(setting.model(), balance, devices, chunks, mode)
                else:
                    model = GPipe(
                        setting.model(), balance, devices=devices, chunks=chunks, checkpoint=mode
                    )
                if isinstance(model, str):
                    continue
                peak = step_memory(training_step(model, x, y, way), device)
                del model
                release(device)
                assert peak is not None
                rows.append(
                    [f"{way} {mode}", str(balance), str(chunks), f"{peak / 2**20:.0f}",
                     f"{peak / base:.3f}"]
                )  # fmt: skip
    print_table(["way / checkpoint", "balance", "chunks", "MiB at peak", "x plain"], rows)
    print()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
    ).double()  # fmt: skip


def cpu_and_gpu(device: torch.device, steps: int, warmup: int) -> None:
    if device.type != "cuda":
        print("CPU + GPU: needs a CUDA device\n")
        return
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(256, 256, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 10, (256,), generator=generator)
    loss_fn = nn.CrossEntropyLoss()

    reference = mlp()
    expected = loss_fn(reference(x), y)
    expected.backward()
    grads = [p.grad for p in reference.parameters()]

    rows = []
    for where in (cpu, device):
        plain = mlp().to(where)
        seconds = median_time(
            training_step(plain, x.to(where), y.to(where), "plain"), where, steps, warmup
        )
        rows.append([f"plain on {where}", "", "", f"{seconds * 1e3:.2f}"])
    for devices in ([cpu, device], [device, cpu]):
        for way in ("fwd+bwd", "step 1f1b"):
            model = GPipe(mlp(), [4, 3], devices=devices, chunks=4)
            first, last = model.devices[0], model.devices[-1]
            run = training_step(model, x.to(first), y.to(last), way)
            result: Any = run()
            loss = result.reduced() if way.startswith("step") else result
            loss_error = (loss.detach().cpu() - expected.detach()).abs().item()
            grad_error = max(
                (p.grad.cpu() - g).abs().max().item()  # type: ignore[union-attr]
                for p, g in zip(model.parameters(), grads, strict=True)
            )
            seconds = median_time(run, device, steps, warmup)
            rows.append(
                [f"{way} {devices[0].type}+{devices[1].type}", f"{loss_error:.1e}",
                 f"{grad_error:.1e}", f"{seconds * 1e3:.2f}"]
            )  # fmt: skip
    print_table(["way", "loss error", "grad error", "ms/step"], rows)
    print()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="the device (default: cuda)")
    parser.add_argument("--quick", action="store_true", help="a small network, few steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per way")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing")
    parser.add_argument("--batch", type=int, default=None, help="the mini-batch size")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA GPU here (torch.cuda.is_available() is False); skipped")
        return 0
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    setting = QUICK if args.quick else RESNET101
    if args.batch is not None:
        setting = replace(setting, batch=args.batch)
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    try:
        import torchgpipe

        peer = f"torchgpipe {torchgpipe.__version__}"
    except ImportError:
        peer = "torchgpipe not installed"
    print(
        f"bench_gpu.py on {name}, torch {torch.__version__}, {peer}; "
        f"ResNet blocks {setting.blocks}, batch {setting.batch}, image {setting.image}, "
        f"median of {steps} steps after {args.warmup}\n"
    )
    started = time.perf_counter()
    splits = balances(setting, device, (1, 2, 4))
    print("Throughput, every partition on the one device (checkpoint 'except_last'):")
    throughput(setting, device, splits, (1, 4, 8), steps, args.warmup)
    print("Memory of one training step beyond the model and its gradients (chunks 8):")
    memory(setting, device, {n: splits[n] for n in (1, 2)}, chunks=8)
    print("CPU + GPU: a float64 MLP, balance [4, 3], chunks 4, against the plain model:")
    cpu_and_gpu(device, steps, args.warmup)
    print(f"bench_gpu.py: {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
