"""The demo: train a small network pipelined over two partitions, and time it."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm  # type: ignore[import-untyped]

from gpipe_core import GPipe, TimelineSummary

__all__ = [
    "LAYERS",
    "Bound",
    "DemoConfig",
    "DemoReport",
    "build_model",
    "demo_balance",
    "demo_setup",
    "progress_disabled",
    "run_demo",
]

#: The number of layers of the demo's network (:func:`build_model`).
LAYERS = 10


@dataclass(frozen=True)
class DemoConfig:
    """Settings of :func:`run_demo`."""

    steps: int = 60
    batch_size: int = 512
    chunks: int = 4
    width: int = 1024
    #: Checkpointing: none by default, since the demo's network fits in memory and the
    #: recomputed forward passes would only slow it down.
    checkpoint: str = "never"
    seed: int = 0
    #: Show progress bars: True, False, or None (the default) for bars only when standard
    #: error is a terminal (tqdm's ``disable=None``), so that logs get no redraws.
    progress: bool | None = None
    #: The number of partitions (at most :data:`LAYERS`).
    partitions: int = 2
    #: The number of processes (``--processes``): more than 1 runs the demo across
    #: processes (:mod:`gpipe._demo_processes`), with the options below.
    processes: int = 1
    #: The schedule of each training step (:meth:`GPipe.step <gpipe_core.GPipe.step>`).
    schedule: str = "1f1b"
    #: Across processes: print the loss of every ``log_every``-th step (and the first, last).
    log_every: int = 10
    #: Across processes: the seconds any wait for another process may last.
    timeout: float = 300.0
    #: Across processes: the first and the last hidden layers share their weight (tied, in
    #: different partitions, as a language model's embedding and output head), and the
    #: gradients are clipped to a total norm of 1 (:meth:`GPipe.clip_grad_norm_
    #: <gpipe_core.GPipe.clip_grad_norm_>`).
    tied: bool = False
    #: Where to write the Chrome/Perfetto trace of one extra, recorded step (or None).
    trace: str | None = None
    #: Where to draw the timeline of that step (or None; needs matplotlib).
    plot: str | None = None


@dataclass(frozen=True)
class Bound:
    """The best throughput the pipeline's workers could reach on this machine.

    ``n`` partitions and ``m`` micro-batches fill and drain the pipeline: at best a step
    takes ``(m + n - 1) / (n m)`` of the time one worker would take for the whole step, with
    the resources one worker has. Each partition has a device of its own: that worker is
    the plain model on its device. The partitions share the CPU: each of them computes its
    micro-batches with its share of the intra-op threads, so the bound starts from the
    plain model's time on the micro-batches, one after the other, with that share, measured
    in the same run (smaller matrix products are slower per sample on a CPU: that cost is
    micro-batching's, and the bound includes it).
    """

    samples_per_s: float
    #: What each worker has, in words ("1 of 2 threads", "a device of its own").
    each: str
    #: The intra-op threads each worker computes with, on the CPU (None on devices).
    threads: int | None = None


@dataclass(frozen=True)
class DemoReport:
    """What :func:`run_demo` measured."""

    devices: list[str]
    first_loss: float
    final_loss: float
    pipelined_samples_per_s: float
    plain_samples_per_s: float
    #: The summary of the recorded step, when a trace or a plot was asked for.
    timeline: TimelineSummary | None = None
    #: The files written for it.
    written: tuple[str, ...] = ()
    #: The best throughput the workers could reach here (None: no bound, as with partitions
    #: sharing GPUs).
    bound: Bound | None = None
    #: The micro-batches of each step.
    chunks: int = 1
    #: The checkpointing mode of the pipeline.
    checkpoint: str = "never"

    def format(self) -> str:
        """The report as the command line prints it."""
        ratio = self.pipelined_samples_per_s / self.plain_samples_per_s
        lines = [
            f"devices:            {', '.join(self.devices)}",
            f"loss:               {self.first_loss:.4f} -> {self.final_loss:.4f}",
            f"throughput (gpipe): {self.pipelined_samples_per_s:,.0f} samples/s",
            f"throughput (plain): {self.plain_samples_per_s:,.0f} samples/s",
        ]
        if self.bound is not None:
            lines.append(
                f"throughput (bound): {self.bound.samples_per_s:,.0f} samples/s "
                f"(the best {len(self.devices)} workers can do here)"
            )
        lines.append(f"gpipe / plain:      {ratio:.2f}x")
        lines.append(f"why: {self.why()}")
        if self.timeline is not None:
            lines.append(str(self.timeline))
        lines.extend(f"wrote {path}" for path in self.written)
        return "\n".join(lines)

    def why(self) -> str:
        """One line on why the ratio is what it is."""
        n, m = len(self.devices), self.chunks
        fill = f"filling and draining {n} partitions with {m} micro-batches"
        if self.bound is None:
            return (
                f"the {n} partitions share {len(set(self.devices))} device(s), so they "
                "take turns on the same hardware; pipelining pays off with one device per "
                "partition"
            )
        reached = self.pipelined_samples_per_s / self.bound.samples_per_s
        if self.bound.threads is None:
            return (
                f"each partition has {self.bound.each}; {fill} leaves at best "
                f"{n * m / (m + n - 1):.2f}x plain, and gpipe reaches {reached:.0%} of that"
            )
        recompute = (
            ""
            if self.checkpoint == "never"
            else f" (checkpoint={self.checkpoint!r} recomputes forward passes on top)"
        )
        return (
            f"the {n} partitions share this CPU, each computing its micro-batches with "
            f"{self.bound.each} (plain computes the whole batch with all of them): with "
            f"{fill}, that allows at most "
            f"{self.bound.samples_per_s / self.plain_samples_per_s:.2f}x plain here, and "
            f"gpipe reaches {reached:.0%} of that{recompute}; one device per partition is "
            "what pipelining is for"
        )


def build_model(width: int, features: int = 32, classes: int = 10) -> nn.Sequential:
    """The demo's network: an MLP of ten layers, four of them ``width`` x ``width``.

    Split in two halves of five layers (:func:`demo_balance`), each half computes two of the
    four large layers: the two partitions take the same time, so that the pipeline's
    throughput shows what overlapping them gives, not an uneven split.

    Example:
        >>> [type(layer).__name__ for layer in build_model(8)][:5]
        ['Linear', 'ReLU', 'Linear', 'ReLU', 'Linear']
    """
    return nn.Sequential(
        nn.Linear(features, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.Linear(width, classes),
    )


def demo_balance(partitions: int) -> list[int]:
    """The demo network's :data:`LAYERS` layers split as evenly as can be, first ones larger.

    Example:
        >>> demo_balance(2), demo_balance(3)
        ([5, 5], [4, 3, 3])
    """
    if not 1 <= partitions <= LAYERS:
        raise ValueError(
            f"partitions must be between 1 and {LAYERS}, the demo network's layers "
            f"(partitions: {partitions})"
        )
    size, extra = divmod(LAYERS, partitions)
    return [size + (1 if j < extra else 0) for j in range(partitions)]


def demo_setup(config: DemoConfig) -> tuple[torch.Tensor, torch.Tensor, nn.Sequential]:
    """The synthetic data (batches of inputs, their labels) and the network, from the seed.

    The same for a config in every process: the demo across processes builds them on each
    rank, and its single-process run trains the same network on the same data.
    """
    torch.manual_seed(config.seed)
    features, classes, batches = 32, 10, 16
    teacher = nn.Linear(features, classes)
    data = torch.randn(batches, config.batch_size, features)
    with torch.no_grad():
        target = teacher(data).argmax(dim=-1)
    model = build_model(config.width, features, classes)
    if config.tied:
        model[8].weight = model[2].weight
    return data, target, model


def _devices(partitions: int) -> list[torch.device]:
    """One GPU per partition when there are enough, the GPUs shared in order when fewer,
    the CPU without CUDA."""
    count = torch.cuda.device_count()
    if count >= partitions:
        return [torch.device("cuda", j) for j in range(partitions)]
    if count:
        return [torch.device("cuda", j * count // partitions) for j in range(partitions)]
    return [torch.device("cpu")] * partitions


def _synchronize(devices: list[torch.device]) -> None:
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def progress_disabled(progress: bool | None) -> bool | None:
    """tqdm's ``disable`` for ``progress``: None (no bar unless the stream is a terminal)
    stays None.

    Example:
        >>> progress_disabled(None), progress_disabled(True), progress_disabled(False)
        (None, False, True)
    """
    return None if progress is None else not progress


def _train(
    model: nn.Module,
    steps: int,
    data: torch.Tensor,
    target: torch.Tensor,
    devices: list[torch.device],
    description: str,
    progress: bool | None,
    schedule: str = "1f1b",
) -> tuple[list[float], float]:
    """Train ``model`` for ``steps`` steps; the losses of every tenth step and the time.

    A :class:`~gpipe_core.GPipe` trains with :meth:`~gpipe_core.GPipe.step` in
    ``schedule``, the plain network with its forward and backward passes.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    in_device, out_device = devices[0], devices[-1]
    bar = tqdm(range(steps), desc=description, disable=progress_disabled(progress), unit="step")
    _synchronize(devices)
    start = time.perf_counter()
    for step in bar:
        index = step % data.size(0)
        x = data[index].to(in_device, non_blocking=True)
        y = target[index].to(out_device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        if isinstance(model, GPipe):
            loss = model.step(x, y, nn.functional.cross_entropy, schedule=schedule).reduced()
        else:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    _synchronize(devices)
    return losses, time.perf_counter() - start


def _record_step(
    model: GPipe, data: torch.Tensor, target: torch.Tensor, config: DemoConfig
) -> tuple[TimelineSummary, tuple[str, ...]]:
    """Record one training step of ``model`` (in the config's schedule); write the trace and
    the plot."""
    x = data[0].to(model.devices[0])
    y = target[0].to(model.devices[-1])
    with model.trace() as timeline:
        model.step(x, y, nn.functional.cross_entropy, schedule=config.schedule)
    for parameter in model.parameters():
        parameter.grad = None
    written = []
    if config.trace is not None:
        timeline.to_chrome_trace(config.trace)
        written.append(config.trace)
    if config.plot is not None:
        timeline.plot(config.plot)
        written.append(config.plot)
    return timeline.summary(), tuple(written)


def run_demo(config: DemoConfig) -> DemoReport:
    """Train the demo network with and without pipelining on the same synthetic data.

    The pipeline trains with :meth:`GPipe.step <gpipe_core.GPipe.step>` in
    ``config.schedule``, the plain network with its forward and backward passes.

    Example:
        >>> report = run_demo(DemoConfig(steps=4, batch_size=8, chunks=2, width=16, progress=False))
        >>> report.final_loss > 0
        True
    """
    data, target, plain = demo_setup(config)
    pipelined_model = copy.deepcopy(plain)
    devices = _devices(config.partitions)
    pipelined = GPipe(
        pipelined_model,
        balance=demo_balance(config.partitions),
        devices=devices,
        chunks=config.chunks,
        checkpoint=config.checkpoint,  # type: ignore[arg-type]
    )
    losses, elapsed = _train(
        pipelined,
        config.steps,
        data,
        target,
        devices,
        f"gpipe {config.schedule}",
        config.progress,
        config.schedule,
    )
    summary: TimelineSummary | None = None
    written: tuple[str, ...] = ()
    if config.trace is not None or config.plot is not None:
        summary, written = _record_step(pipelined, data, target, config)
    plain_device = [devices[0]]
    plain.to(devices[0])
    _, plain_elapsed = _train(
        plain, config.steps, data, target, plain_device, "plain", config.progress
    )
    samples = config.steps * config.batch_size
    plain_samples_per_s = samples / plain_elapsed
    return DemoReport(
        devices=[str(device) for device in devices],
        first_loss=losses[0],
        final_loss=losses[-1],
        pipelined_samples_per_s=samples / elapsed,
        plain_samples_per_s=plain_samples_per_s,
        timeline=summary,
        written=written,
        bound=_bound(plain, data, target, devices, config, plain_samples_per_s),
        chunks=config.chunks,
        checkpoint=config.checkpoint,
    )


def _bound(
    plain: nn.Module,
    data: torch.Tensor,
    target: torch.Tensor,
    devices: list[torch.device],
    config: DemoConfig,
    plain_samples_per_s: float,
) -> Bound | None:
    """The best throughput of the pipeline's workers here (see :class:`Bound`); None where
    partitions share GPUs."""
    n, m = len(devices), config.chunks
    fill = (m + n - 1) / (n * m)
    if any(device.type != "cpu" for device in devices):
        if len(set(devices)) < n:
            return None
        return Bound(plain_samples_per_s / fill, "a device of its own")
    caller = torch.get_num_threads()
    if caller < n:
        # Fewer threads than partitions: they cannot all compute at once, so they take
        # turns, and the work is the plain model's at best.
        return Bound(plain_samples_per_s, f"a turn on {_threads(caller)}", threads=caller)
    share = caller // n
    torch.set_num_threads(share)
    try:
        elapsed, steps = _time_microbatches(copy.deepcopy(plain), data, target, config)
    finally:
        torch.set_num_threads(caller)
    return Bound(
        steps * config.batch_size / elapsed / fill, f"{share} of {_threads(caller)}", share
    )


def _time_microbatches(
    model: nn.Module, data: torch.Tensor, target: torch.Tensor, config: DemoConfig
) -> tuple[float, int]:
    """Seconds for a few training steps of the plain model on the CPU, each on the
    micro-batches one after the other (the work the workers share), and how many steps."""
    steps = max(3, min(config.steps, 20))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = time.perf_counter()
    for step in range(steps):
        x, y = data[step % data.size(0)], target[step % data.size(0)]
        optimizer.zero_grad(set_to_none=True)
        pairs = zip(x.tensor_split(config.chunks), y.tensor_split(config.chunks), strict=True)
        for xs, ys in pairs:
            loss = nn.functional.cross_entropy(model(xs), ys) * (len(xs) / len(x))
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return time.perf_counter() - start, steps


def _threads(count: int) -> str:
    return f"{count} thread{'' if count == 1 else 's'}"
