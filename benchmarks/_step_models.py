"""Models, the saved-activation counter and the pipelining runner of ``bench_step.py``.

Kept apart from the script so that the processes spawned for ``torch.distributed.pipelining``
can import the model builders by name (and so that ``nox -s bench`` does not run it: it
runs ``bench_*.py`` only).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """``x * w``, whose forward and backward each sleep (releasing the GIL) a fixed time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        ctx.seconds = seconds
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        time.sleep(ctx.seconds)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None


class SleepStage(nn.Module):
    """A stage that takes ``seconds`` per micro-batch in forward and again in backward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.seconds)


def sleep_model(n: int, seconds: float) -> nn.Sequential:
    return nn.Sequential(*[SleepStage(seconds) for _ in range(n)])


def mlp(n: int, width: int, layers_per_partition: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n * layers_per_partition):
        layers += [nn.Linear(width, width), nn.ReLU()]
    # One (Linear, ReLU) pair per "layer", so that the balance counts pairs.
    return nn.Sequential(*[nn.Sequential(*layers[i : i + 2]) for i in range(0, len(layers), 2)])


class ResBlock(nn.Module):
    """A basic residual block: two 3x3 convolutions with batch norm, identity shortcut."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


def resnet(channels: int, blocks: int, classes: int = 10) -> nn.Sequential:
    """Stem, ``blocks`` residual blocks (downsampling once, halfway), then the head."""
    torch.manual_seed(0)
    half = blocks // 2
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
    ]
    layers += [ResBlock(channels) for _ in range(half)]
    layers.append(
        nn.Sequential(
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
        )
    )
    layers += [ResBlock(2 * channels) for _ in range(blocks - half)]
    layers.append(
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, classes))
    )
    return nn.Sequential(*layers)


def transformer(d_model: int, heads: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(
                d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
            )
            for _ in range(layers)
        ]
    )


def tiny(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


BUILDERS: dict[str, Callable[..., nn.Sequential]] = {
    "sleep": sleep_model,
    "mlp": mlp,
    "resnet": resnet,
    "transformer": transformer,
    "tiny": tiny,
}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model (built by name, so that other processes can build it too),
    how it is split, and its data."""

    name: str
    builder: str
    kwargs: dict[str, Any]
    balance: list[int]
    chunks: int
    input_shape: tuple[int, ...]
    loss: str  # "mse" or "cross_entropy"
    classes: int = 0
    output_shape: tuple[int, ...] = ()
    checkpoint: str = "never"
    ideal: float | None = None  # seconds of a step with no overhead, when known

    def model(self) -> nn.Sequential:
        return BUILDERS[self.builder](**self.kwargs)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(self.input_shape, generator=generator)
        if self.loss == "cross_entropy":
            y = torch.randint(self.classes, (self.input_shape[0],), generator=generator)
        else:
            y = torch.randn(self.output_shape or self.input_shape, generator=generator)
        return x, y

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return F.cross_entropy if self.loss == "cross_entropy" else F.mse_loss


# --------------------------------------------------------------------------------------------
# Saved-activation bytes
# --------------------------------------------------------------------------------------------


class SavedBytes:
    """Counts the bytes of the tensors autograd saves for backward, live and at the peak.

    Use ``with counter.hooks():`` around the forward (and backward, to see memory fall). Each
    storage counts once, however many saved tensors view it, while at least one of them is
    still held by autograd; parameters (``exclude``) are not counted. Works across threads
    when the saved-tensor hooks reach them (gpipe's workers run under the caller's hooks).
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._lock = threading.Lock()
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return tensor
        with self._lock:
            count = self._refs.get(key, 0)
            if count == 0:
                self._sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._refs[key] = count + 1
        holder = _Holder(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        with self._lock:
            count = self._refs[key] - 1
            if count == 0:
                del self._refs[key]
                self.live -= self._sizes.pop(key)
            else:
                self._refs[key] = count

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Holder) else packed

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class _Holder:
    """What autograd keeps instead of a counted tensor; its end is the tensor's release."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# --------------------------------------------------------------------------------------------
# torch.distributed.pipelining, one process per stage
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PIPELINING_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def _pipelining_worker(
    rank: int, world: int, port: int, case: Case, threads: int, commands: Any, results: Any
) -> None:
    """One stage: build the model, keep both schedules, run one step per command."""
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(threads)
        import torch.distributed as dist
        from torch.distributed import pipelining

        dist.init_process_group("gloo", rank=rank, world_size=world)
        layers = list(case.model().children())
        start = sum(case.balance[:rank])
        submodule = nn.Sequential(*layers[start : start + case.balance[rank]])
        x, y = case.data()
        loss_fn = case.loss_fn()
        micro = x.tensor_split(case.chunks)[0]
        with torch.no_grad():
            for i in range(rank):  # the input shape of this stage's micro-batch
                lo = sum(case.balance[:i])
                micro = nn.Sequential(*layers[lo : lo + case.balance[i]])(micro)
        device = torch.device("cpu")
        schedules = {}
        for name in PIPELINING_SCHEDULES:
            stage = pipelining.PipelineStage(submodule, rank, world, device, input_args=(micro,))
            schedules[name] = getattr(pipelining, name)(
                stage, n_microbatches=case.chunks, loss_fn=loss_fn
            )

        def run(name: str) -> None:
            schedule = schedules[name]
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()

        results.put((rank, "ready", 0.0))
        while True:
            command = commands.get()
            if command is None:
                break
            submodule.zero_grad(set_to_none=True)
            dist.barrier()
            begin = time.perf_counter()
            run(command)
            elapsed = time.perf_counter() - begin
            dist.barrier()
            if rank == 0:
                results.put((rank, "time", elapsed))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


class Pipelining:
    """A group of stage processes kept alive for one case, stepped from the parent."""

    def __init__(self, case: Case, threads: int, timeout: float = 120.0) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self.world = len(case.balance)
        self.timeout = timeout
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(self.world)]
        port = free_port()
        self.processes = [
            context.Process(
                target=_pipelining_worker,
                args=(rank, self.world, port, case, threads, self.commands[rank], self.results),
                daemon=True,
            )
            for rank in range(self.world)
        ]
        for process in self.processes:
            process.start()
        for _ in range(self.world):
            self._get("ready")

    def _get(self, kind: str) -> float:
        rank, got, value = self.results.get(timeout=self.timeout)
        if got == "error":
            self.close()
            raise RuntimeError(f"pipelining rank {rank} failed:\n{value}")
        if got != kind:
            raise RuntimeError(f"pipelining rank {rank}: expected {kind!r}, got {got!r}")
        return float(value)

    def step(self, schedule: str) -> float:
        """One training step; returns its time measured in rank 0."""
        for queue in self.commands:
            queue.put(schedule)
        return self._get("time")

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
