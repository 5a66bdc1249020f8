"""What the step benchmarks share: models, cases, timing, output, and ranks in processes.

``bench_step.py``, ``bench_distributed.py`` and ``bench_schedules.py`` import from here:
the models and their cases (built by name, so that other processes can build them too),
the saved-activation counter, the interleaved timing of runners with medians, the tables
and the PASS/FAIL lines of targets, the ways a step runs (named ``'<step|dist|pipe>
<schedule>[ <placement>]'``, see :func:`parse_way`; :class:`Ways` builds them), and
:class:`Ranks`, one process per worker in a gloo group running
``torch.distributed.pipelining`` and gpipe across processes. Kept apart from the scripts
so that the spawned processes can import it (and so that ``nox -s bench`` does not run it:
it runs ``bench_*.py`` only).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import socket
import statistics
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
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


class _SleepThrough(torch.autograd.Function):
    """``x`` itself (a copy), whose forward sleeps ``before`` and backward ``after`` seconds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, before: float, after: float) -> torch.Tensor:
        if before:
            time.sleep(before)
        ctx.after = after
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.after)
        return grad, None, None


class SplitSleepStage(nn.Module):
    """A stage whose forward pass, input gradient and weight gradient each take ``seconds``
    per micro-batch: ``x + weight``, where the path from the input sleeps in its forward and
    backward, and the path from the parameter in its backward only. A split backward runs
    the first path at ``I``, the second at ``W``; a whole one runs both."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        through = _SleepThrough.apply(x, self.seconds, self.seconds)
        return through + _SleepThrough.apply(self.weight, 0.0, self.seconds)


def split_sleep_model(n: int, seconds: float) -> nn.Sequential:
    return nn.Sequential(*[SplitSleepStage(seconds) for _ in range(n)])


def mlp(
    n: int, width: int, layers_per_partition: int = 2, relu_first: bool = False
) -> nn.Sequential:
    """``n * layers_per_partition`` layers of ``Linear(width, width)`` and ``ReLU`` (in
    that order, or the other with ``relu_first``: then no tensor that one layer saves for
    backward is saved by the next one too)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n * layers_per_partition):
        pair: list[nn.Module] = [nn.Linear(width, width), nn.ReLU()]
        layers += pair[::-1] if relu_first else pair
    # One (Linear, ReLU) pair per "layer", so that the balance counts pairs.
    return nn.Sequential(*[nn.Sequential(*layers[i : i + 2]) for i in range(0, len(layers), 2)])


class Bottleneck(nn.Module):
    """A ResNet bottleneck block (1x1, 3x3, 1x1 convolutions and a shortcut)."""

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        width = planes // 4
        self.body = nn.Sequential(
            nn.Conv2d(inplanes, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, planes, 1, bias=False),
            nn.BatchNorm2d(planes),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inplanes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


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


class _Embedding(nn.Module):
    """Token and position embeddings of a GPT-like model."""

    def __init__(self, vocab: int, d_model: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.randn(seq, d_model) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions[: x.shape[1]]


class _Block(nn.Module):
    """A GPT block: causal self-attention and an MLP, each after a layer norm, residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class _Head(nn.Module):
    """The last layer norm and the logits over the vocabulary."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.logits = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(x))


def gpt(vocab: int, d_model: int, heads: int, layers: int, seq: int) -> nn.Sequential:
    """A small GPT: embeddings, ``layers`` blocks, head (``layers + 2`` layers)."""
    torch.manual_seed(0)
    return nn.Sequential(
        _Embedding(vocab, d_model, seq),
        *[_Block(d_model, heads) for _ in range(layers)],
        _Head(d_model, vocab),
    )


def tiny(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


BUILDERS: dict[str, Callable[..., nn.Sequential]] = {
    "sleep": sleep_model,
    "split-sleep": split_sleep_model,
    "mlp": mlp,
    "resnet": resnet,
    "transformer": transformer,
    "gpt": gpt,
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
    loss: str  # "mse", "cross_entropy" or "lm" (cross-entropy of next tokens)
    classes: int = 0
    output_shape: tuple[int, ...] = ()
    checkpoint: str = "never"
    ideal: float | None = None  # seconds of a step with no overhead, when known
    input_grad: bool = False  # the input requires grad (the first partition's I computes it)

    def model(self) -> nn.Sequential:
        return BUILDERS[self.builder](**self.kwargs)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        if self.loss == "lm":
            tokens = torch.randint(self.classes, self.input_shape, generator=generator)
            return tokens, torch.randint(self.classes, self.input_shape, generator=generator)
        x = torch.randn(self.input_shape, generator=generator).requires_grad_(self.input_grad)
        if self.loss == "cross_entropy":
            y = torch.randint(self.classes, (self.input_shape[0],), generator=generator)
        else:
            y = torch.randn(self.output_shape or self.input_shape, generator=generator)
        return x, y

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if self.loss == "lm":
            return _lm_loss
        return F.cross_entropy if self.loss == "cross_entropy" else F.mse_loss


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of (batch, seq, vocab) logits against (batch, seq) tokens."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@dataclass(frozen=True)
class Sizes:
    """The sizes of the benchmark models: the full run's, or the ``--quick`` run's."""

    sleep: float  # seconds per fixed-time stage and direction
    width: int  # MLP
    batch: int
    cnn_channels: int  # ResNet
    cnn_batch: int
    d_model: int  # transformer
    seq: int
    tokens_batch: int
    gpt_batch: int  # GPT: d_model and seq as the transformer's
    vocab: int

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(0.005, 512, 256, 16, 16, 128, 32, 8, 8, 512)
        # Micro-batches of 512 rows: smaller ones make each GEMM slower on this CPU (the
        # "plain mb" column of bench_step.py shows what micro-batching alone costs).
        return cls(0.020, 1024, 2048, 32, 32, 256, 64, 16, 32, 1024)

    def describe(
        self, cases: Sequence[str] = ("fixed-time", "MLP", "ResNet", "transformer", "GPT")
    ) -> str:
        """The models of ``cases`` (names among the default's) in words."""
        words = {
            "fixed-time": f"fixed-time t = {self.sleep * 1e3:g} ms per stage and direction",
            "MLP": f"MLP: 8 x (Linear({self.width}, {self.width}) + ReLU), batch {self.batch}",
            "ResNet": (
                f"ResNet: stem, 4 residual blocks of {self.cnn_channels}/"
                f"{2 * self.cnn_channels} channels, head, batch {self.cnn_batch} x 3 x 32 x 32"
            ),
            "transformer": (
                f"transformer: 4 encoder layers d_model {self.d_model}, 4 heads, batch "
                f"{self.tokens_batch} x {self.seq} tokens"
            ),
            "GPT": (
                f"GPT: embeddings, 4 causal blocks d_model {self.d_model}, 4 heads, head over "
                f"{self.vocab} tokens, batch {self.gpt_batch} x {self.seq} tokens"
            ),
        }
        return "; ".join(words[case] for case in cases) + "; no checkpointing in these cases"


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every step benchmark takes: ``--quick``, ``--rounds``, ``--threads``."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller models")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per way and case")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per process (default 1)"
    )
    return parser


def add_selection(parser: argparse.ArgumentParser, what: str, known: Sequence[str]) -> None:
    """``--<what>``: a comma-separated subset of ``known`` to run (default: all)."""
    parser.add_argument(
        f"--{what}",
        default=",".join(known),
        help=f"comma-separated {what} to run, among {', '.join(known)} (default: all)",
    )


def parse_bench(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    selection: tuple[str, Sequence[str]] | None = None,
) -> tuple[argparse.Namespace, int, Sizes, list[str]]:
    """The arguments (``nox -s bench`` passes its arguments to every script: the unknown
    ones are ignored), the rounds, the sizes, and the names chosen with ``selection``
    (``(what, known)`` as given to :func:`add_selection`; an unknown name is an error)."""
    args, _ = parser.parse_known_args(argv)
    rounds = args.rounds or (3 if args.quick else 10)
    chosen: list[str] = []
    if selection is not None:
        what, known = selection
        chosen = [name.strip() for name in getattr(args, what).split(",") if name.strip()]
        unknown = [name for name in chosen if name not in known]
        if unknown:
            parser.error(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return args, rounds, Sizes.of(args.quick), chosen


def sleep_case(n: int, m: int, seconds: float, sleep: float | None = None) -> Case:
    """``n`` fixed-time stages of ``t = seconds`` per direction, ``m`` micro-batches: the
    ideal step is ``2 (m + n - 1) t``. Each stage sleeps ``sleep`` (default ``t``; see
    :func:`calibrated_sleep`)."""
    return Case(
        f"fixed-time P{n} M{m}",
        "sleep",
        {"n": n, "seconds": seconds if sleep is None else sleep},
        [1] * n,
        m,
        (m, 4),
        "mse",
        ideal=2 * (m + n - 1) * seconds,
    )


def split_sleep_case(workers: int, m: int, seconds: float, sleep: float | None = None) -> Case:
    """``2 * workers`` fixed-time partitions (two per worker) whose forward pass, input
    gradient and weight gradient each take ``t = seconds`` (each sleeps ``sleep``, default
    ``t``), ``m`` micro-batches. The input requires grad, so that the first partition's
    input gradient takes ``t`` too. A schedule's ideal step is its :func:`simulate
    <gpipe_core.simulate>` makespan in units of ``t``."""
    return Case(
        f"fixed-time W{workers} M{m}",
        "split-sleep",
        {"n": 2 * workers, "seconds": seconds if sleep is None else sleep},
        [1] * (2 * workers),
        m,
        (m, 4),
        "mse",
        input_grad=True,
    )


def calibrated_sleep(t: float, rounds: int = 3, tries: int = 5) -> tuple[float, float]:
    """The sleep that makes a fixed-time stage take ``t`` here, and what a stage that
    sleeps ``t`` takes, over ``t``.

    A stage takes more than its sleep: the sleep overshoots, and the stage's own code (the
    autograd function, the product) runs after it on a core that has just woken; on this
    machine that adds 2 to 3 % to 20 ms, which no way of running the stages can avoid, so
    that the ideal ``2 (m + n - 1) t`` would be out of reach by that much. Measured as
    ``plain mb`` measures it, in this process (2 stages, 8 micro-batches, the forward and
    backward of each one after the other), the sleep is shortened by the excess, averaged
    over a few tries. The fixed-time tables show ``plain mb`` again in the same run: a stage's
    time over ``t`` there checks the calibration (about 1.00).
    """
    n, m = 2, 8
    sleep, excess = t, []  # what a stage took beyond its sleep, each try
    for _ in range(tries):
        run = plain_microbatched_runner(sleep_case(n, m, t, sleep))
        run()  # warm-up
        stage = statistics.median(run() for _ in range(rounds)) / (2 * n * m)
        excess.append(stage - sleep)
        sleep = max(0.0, t - statistics.fmean(excess))
    return sleep, 1 + excess[0] / t


def describe_sleep(t: float, sleep: float, alone: float) -> str:
    """The calibration of :func:`calibrated_sleep`, in words."""
    return (
        f"fixed-time stages sleep {sleep * 1e3:.2f} ms per direction, so that a stage takes "
        f"t = {t * 1e3:g} ms here (one that sleeps t takes {alone:.3f} t)"
    )


def mlp_case(sizes: Sizes) -> Case:
    # Four (Linear, ReLU) pairs per partition: the first partition's first layer computes no
    # input gradient, so its backward pass is one GEMM shorter; with four pairs a side that
    # is 11 : 12 GEMMs per micro-batch (with two, 5 : 6).
    return Case(
        "MLP P2 M4",
        "mlp",
        {"n": 2, "width": sizes.width, "layers_per_partition": 4},
        [4, 4],
        4,
        (sizes.batch, sizes.width),
        "mse",
    )


def cnn_case(sizes: Sizes) -> Case:
    return Case(
        "ResNet P2 M4",
        "resnet",
        {"channels": sizes.cnn_channels, "blocks": 4},
        [3, 4],
        4,
        (sizes.cnn_batch, 3, 32, 32),
        "cross_entropy",
        classes=10,
    )


def transformer_case(sizes: Sizes) -> Case:
    return Case(
        "transformer P2 M4",
        "transformer",
        {"d_model": sizes.d_model, "heads": 4, "layers": 4},
        [2, 2],
        4,
        (sizes.tokens_batch, sizes.seq, sizes.d_model),
        "mse",
    )


def gpt_case(sizes: Sizes) -> Case:
    """A small GPT (4 blocks), P2 M4: embeddings and 2 blocks, then 2 blocks and the head."""
    return Case(
        "GPT P2 M4",
        "gpt",
        {"vocab": sizes.vocab, "d_model": sizes.d_model, "heads": 4, "layers": 4, "seq": sizes.seq},
        [3, 3],
        4,
        (sizes.gpt_batch, sizes.seq),
        "lm",
        classes=sizes.vocab,
    )


def tiny_case() -> Case:
    """One ``Linear(4, 4)`` per partition, P2 M32: the step is almost all overhead."""
    return Case("tiny P2 M32", "tiny", {"n": 2}, [1, 1], 32, (32, 4), "mse")


# --------------------------------------------------------------------------------------------
# Saved-activation bytes
# --------------------------------------------------------------------------------------------


class SavedBytes:
    """Counts the bytes of the tensors autograd saves for backward, live and at the peak.

    Use ``with counter.hooks():`` around the forward (and backward, to see memory fall). Each
    storage counts once, however many saved tensors view it, while at least one of them is
    still held by autograd; parameters (``exclude``) are not counted. Works across threads
    when the saved-tensor hooks reach them (gpipe's workers run under the caller's hooks).
    Each storage also counts for the thread that saved it first (by the thread's name, in
    ``live_by`` and ``peak_by``): gpipe's worker ``w`` is the thread ``gpipe-worker-w``.
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._lock = threading.Lock()
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._owners: dict[int, str] = {}
        self.live = 0
        self.peak = 0
        self.live_by: dict[str, int] = {}
        self.peak_by: dict[str, int] = {}

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
                size = storage.nbytes()
                owner = self._owners[key] = threading.current_thread().name
                self._sizes[key] = size
                self.live += size
                self.peak = max(self.peak, self.live)
                live = self.live_by[owner] = self.live_by.get(owner, 0) + size
                self.peak_by[owner] = max(self.peak_by.get(owner, 0), live)
            self._refs[key] = count + 1
        holder = _Holder(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        with self._lock:
            count = self._refs[key] - 1
            if count == 0:
                del self._refs[key]
                size = self._sizes.pop(key)
                self.live -= size
                self.live_by[self._owners.pop(key)] -= size
            else:
                self._refs[key] = count

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Holder) else packed

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


def per_microbatch_bytes(case: Case, loss: bool = False) -> list[int]:
    """Saved bytes of one micro-batch on each partition: the plain layers on one micro-batch
    (and, with ``loss``, the loss on the last partition, where a step computes it).

    A storage saved by two partitions (one's output is the next one's input) counts for the
    first; the input and the target are not counted (the caller holds them anyway).
    """
    model = case.model()
    x, y = case.data()
    # A view would count all of x; ``first`` keeps the copy alive, so that no storage
    # counted later can take its (excluded) address.
    h = first = x.tensor_split(case.chunks)[0].detach().clone()
    layers = list(model.children())
    counter = SavedBytes([*model.parameters(), first, y])
    sizes = []
    start = 0
    with counter.hooks():
        for size in case.balance:
            before = counter.live
            h = nn.Sequential(*layers[start : start + size])(h)
            start += size
            if loss and start == len(layers):
                h = case.loss_fn()(h, y.tensor_split(case.chunks)[0])
            sizes.append(counter.live - before)
    return sizes


class _Holder:
    """What autograd keeps instead of a counted tensor; its end is the tensor's release.

    It holds the tensor detached (the same storage, no ``grad_fn``): a saved output held
    with its ``grad_fn`` would make a cycle through autograd (node, saved variable, this
    holder, the tensor, its ``grad_fn``) that only running the node without
    ``retain_graph`` breaks, so a graph kept with ``retain_graph=True`` (a split backward's
    input gradient) would count as saved for good.
    """

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()


# --------------------------------------------------------------------------------------------
# Timing in this process
# --------------------------------------------------------------------------------------------

Runner = Callable[[], float]


def timed(model: nn.Module, fn: Callable[[], object]) -> Runner:
    """A runner: zero ``model``'s grads, then time ``fn()``."""

    def run() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def plain_runner(case: Case) -> Runner:
    """The ``nn.Sequential`` itself on the whole batch, in this process."""
    model = case.model()
    x, y = case.data()
    loss_fn = case.loss_fn()
    return timed(model, lambda: loss_fn(model(x), y).backward())


def plain_microbatched_runner(case: Case) -> Runner:
    """The ``nn.Sequential`` on the micro-batches, one after the other, in this process
    (each loss scaled by its share of the batch, as the pipeline's are)."""
    model = case.model()
    x, y = case.data()
    loss_fn = case.loss_fn()
    pairs = list(zip(x.tensor_split(case.chunks), y.tensor_split(case.chunks), strict=True))

    def step() -> None:
        for xs, ys in pairs:
            (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()

    return timed(model, step)


def plain_microbatched_phases_runners(case: Case) -> dict[str, Runner]:
    """``plain mb``'s two phases, each timed alone: ``plain mb fwd`` (the forward passes and
    losses of the micro-batches, one after the other, building their graphs) and ``plain mb
    bwd`` (their backward passes, one after the other, after untimed forward passes): what
    ``fwd+bwd`` costs at least where autograd runs every backward pass in the calling
    thread (on the CPU) after the workers' forward passes."""
    model = case.model()
    x, y = case.data()
    loss_fn = case.loss_fn()
    pairs = list(zip(x.tensor_split(case.chunks), y.tensor_split(case.chunks), strict=True))

    def losses() -> list[torch.Tensor]:
        return [loss_fn(model(xs), ys) * (len(xs) / len(x)) for xs, ys in pairs]

    def forward() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        losses()
        return time.perf_counter() - start

    def backward() -> float:
        model.zero_grad(set_to_none=True)
        graphs = losses()
        start = time.perf_counter()
        for loss in graphs:
            loss.backward()
        return time.perf_counter() - start

    return {"plain mb fwd": forward, "plain mb bwd": backward}


def plain_cut_runner(case: Case) -> Runner:
    """The ``nn.Sequential`` on the micro-batches, one after the other, in this process, cut
    where the pipeline cuts it: each partition's output is detached into the next one's
    input, and each micro-batch's backward pass is one autograd call per partition, last
    first (the loss seeded with its share of the batch). No threads, messages or schedule:
    what any pipeline that runs each partition's micro-batch as its own autograd call pays
    at least."""
    model = case.model()
    x, y = case.data()
    loss_fn = case.loss_fn()
    bounds = [0, *itertools.accumulate(case.balance)]
    parts = [model[a:b] for a, b in itertools.pairwise(bounds)]
    pairs = list(zip(x.tensor_split(case.chunks), y.tensor_split(case.chunks), strict=True))

    def step() -> None:
        for xs, ys in pairs:
            inputs, outputs, value = [], [], xs
            for k, part in enumerate(parts):
                if k:
                    value = value.detach().requires_grad_()
                inputs.append(value)
                value = part(value)
                outputs.append(value)
            loss = loss_fn(value, ys)
            torch.autograd.backward(loss, torch.full_like(loss, len(xs) / len(x)))
            for k in range(len(parts) - 2, -1, -1):
                torch.autograd.backward(outputs[k], inputs[k + 1].grad)

    return timed(model, step)


def measure(runners: dict[str, Runner | str], rounds: int, warmup: int = 2) -> dict[str, Any]:
    """Median seconds per way (or the reason a way did not run), interleaved round by round
    (each way goes first in turn). A way that raises gets ``'failed: ...'``."""
    result: dict[str, Any] = {}
    live: dict[str, Runner] = {}
    for name, runner in runners.items():
        if isinstance(runner, str):
            result[name] = runner
            continue
        try:
            for _ in range(warmup):
                runner()
        except Exception as error:
            result[name] = failed(error)
            continue
        live[name] = runner
    times: dict[str, list[float]] = {name: [] for name in live}
    order = list(live)
    for k in range(rounds):
        for name in order[k % len(order) :] + order[: k % len(order)]:
            if name in result:  # failed in an earlier round
                continue
            try:
                times[name].append(live[name]())
            except Exception as error:
                result[name] = failed(error)
    for name in runners:
        if name not in result:
            result[name] = statistics.median(times[name])
    return result


def failed(error: Exception) -> str:
    """What a way that raised ``error`` shows instead of a time (its first line)."""
    first = (str(error).splitlines() or [""])[0]
    return f"failed: {type(error).__name__}: {first}"


def thread_round_trip(trips: int = 2000, rounds: int = 5) -> float:
    """Seconds for one round trip between two Python threads on this machine: a value put in
    a queue by one thread, taken by the other, which puts it back (median of ``rounds``
    runs of ``trips`` trips). The price of waking a thread per message, against which the
    pipeline's per-task overhead is read (it varies with the host far more than the code).
    """
    import queue

    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (value := there.get()) is not None:
            back.put(value)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            for k in range(trips):
                there.put(k)
                back.get()
            times.append((time.perf_counter() - start) / trips)
    finally:
        there.put(None)
        thread.join(10)
    return statistics.median(times)


def parallel_speedup(rounds: int = 5) -> float:
    """How much faster two threads run two equal loops of matmuls than one thread runs both.

    2.0 on two idle cores; near 1.0 (or below) when other processes keep the cores busy,
    which caps what any pipeline can gain on compute-bound cases. Medians of ``rounds``
    alternations of the two ways.
    """
    a, w = torch.randn(256, 1024), torch.randn(1024, 1024)

    def work() -> None:
        for _ in range(10):
            a @ w

    def serial() -> None:
        work()
        work()

    def parallel() -> None:
        threads = [threading.Thread(target=work) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    times: dict[Callable[[], None], list[float]] = {serial: [], parallel: []}
    for _ in range(rounds):
        for way, values in times.items():
            start = time.perf_counter()
            way()
            values.append(time.perf_counter() - start)
    return statistics.median(times[serial]) / statistics.median(times[parallel])


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], first: int = 18) -> None:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) + 2 for i, h in enumerate(header)]
    widths[0] = max(widths[0], first)
    print(
        f"{header[0]:<{widths[0]}}"
        + "".join(f"{h:>{w}}" for h, w in zip(header[1:], widths[1:], strict=True))
    )
    for row in rows:
        print(
            f"{row[0]:<{widths[0]}}"
            + "".join(f"{v:>{w}}" for v, w in zip(row[1:], widths[1:], strict=True))
        )


#: A target: its label, the measured value (None when not measured) and the limit.
Check = tuple[str, "float | None", float]


def print_unrun(reasons: dict[str, str]) -> None:
    """List the ways that did not run, and why (nothing when every way ran)."""
    if reasons:
        print("Ways that did not run:")
        for name, reason in reasons.items():
            print(f"  {name}: {reason}")
        print()


def ideal_checks(
    ideals: dict[str, float], results: dict[str, dict[str, Any]], kind: str, bound: float
) -> list[Check]:
    """For each fixed-time case and schedule: way ``'<kind> <schedule>'`` / ideal <= bound."""
    checks: list[Check] = []
    for case_name, ideal in ideals.items():
        for schedule in ("gpipe", "1f1b"):
            value = results[case_name].get(f"{kind} {schedule}")
            checks.append(
                (
                    f"{case_name}: {kind} {schedule} / ideal <= {bound:g}",
                    value / ideal if isinstance(value, float) else None,
                    bound,
                )
            )
    return checks


def print_fixed_time(
    cases: Sequence[Case], results: dict[str, dict[str, Any]], ways: Sequence[str]
) -> None:
    """The fixed-time cases against two ideals: ``2 (m + n - 1) t`` and the same with the
    time a stage takes on this machine, measured in the same run.

    ``plain mb`` runs the ``n m`` forwards and backwards of the stages one after the other,
    so it takes ``2 n m`` times a stage's time: its ratio to ``2 n m t`` checks the sleep's
    calibration (:func:`calibrated_sleep`): about 1.00, or what a stage takes beyond ``t``
    here, which no way can avoid; each way's time over the ideal scaled by that ratio is
    what the way adds.
    """
    rows = []
    for case in cases:
        r = results.get(case.name, {})
        serial = r.get("plain mb")
        if case.ideal is None or not isinstance(serial, float):
            continue
        n, m = len(case.balance), case.chunks
        stage = serial / (case.ideal * n * m / (m + n - 1))  # a stage's time over t
        for way in ways:
            value = r.get(way)
            if way == "plain mb" or not isinstance(value, float):
                continue
            ratio = value / case.ideal
            rows.append(
                [f"{case.name} {way}", f"{stage:.3f}", f"{ratio:.3f}", f"{ratio / stage:.3f}"]
            )
    if rows:
        print(
            "Fixed-time stages: a stage's time here / t (plain mb / 2 n m t), and each way / "
            "ideal, before and after scaling the ideal by it"
        )
        print_table(["case", "stage / t", "/ ideal", "/ ideal x stage/t"], rows, first=28)
        print()


def print_targets(checks: Sequence[Check]) -> None:
    """The targets as PASS or FAIL lines (a value not measured fails)."""
    print("Targets")
    for label, value, limit in checks:
        if value is None:
            print(f"  FAIL  {label}: not measured")
        else:
            verdict = "PASS" if value <= limit else "FAIL"
            print(f"  {verdict}  {label}: {value:.3f}")


# --------------------------------------------------------------------------------------------
# Ranks: one process per stage, in one gloo group
# --------------------------------------------------------------------------------------------


def finish(checks: Sequence[Check], problems: dict[str, str], ways: Any, elapsed: str = "") -> int:
    """The end of a benchmark across processes: the load, the targets, and the exit status
    (1 when a way failed to run: ``problems`` that say "failed", ranks that exited badly)."""
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"At the end, load average {load}; two threads run {parallel_speedup():.2f}x as fast as "
        f"one on independent matmuls{elapsed}"
    )
    print()
    print_targets(checks)
    failures = [name for name, value in problems.items() if value.startswith("failed")]
    failures += [f"{name}: ranks exited with codes {codes}" for name, codes in ways.bad_exits]
    if failures:
        print()
        print(f"{len(failures)} failure(s): {'; '.join(failures)}")
        return 1
    return 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: torch.distributed.pipelining's class for each of gpipe's schedules.
PIPELINING_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
#: The ways a :class:`Ranks` group runs: ``pipe`` (torch.distributed.pipelining) and
#: ``dist`` (gpipe's ``GPipe(..., group=...)``), each with a GPipe and a 1F1B schedule.
RANK_WAYS = ("dist gpipe", "dist 1f1b", "pipe gpipe", "pipe 1f1b")
#: ``dist`` ways with the ranks' agreement check of every run turned off, to measure it.
UNCHECKED_WAYS = ("dist gpipe unchecked", "dist 1f1b unchecked")
#: The placements a way may name (see :func:`parse_way`).
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Way:
    """A way of running a case's step, parsed from its name (see :func:`parse_way`)."""

    kind: str  # "step" (gpipe in this process), "dist" (gpipe across processes), "pipe"
    schedule: str  # gpipe's name of the schedule
    placement: str | None  # "loop", "v", or None: one partition per worker
    checked: bool = True  # the ranks' agreement check of every run (dist ways)


def parse_way(way: str) -> Way:
    """``'<kind> <schedule>[ <placement>][ unchecked]'``: ``kind`` is ``step`` (``GPipe``
    in this process, one worker per ``"cpu"`` entry of ``devices``), ``dist``
    (``GPipe(..., group=WORLD)``, one rank per worker) or ``pipe``
    (``torch.distributed.pipelining``'s class of the same schedule, see
    :data:`PIPELINING_SCHEDULES`). With a placement (``loop`` or ``v``), the case's
    partitions are placed that way on the workers, several per worker; without one, the
    partitions are merged into one per worker (see :func:`merged_balance`), as when there
    are as many as workers.

    Example:
        >>> parse_way("dist zbv v")
        Way(kind='dist', schedule='zbv', placement='v', checked=True)
    """
    words = way.split()
    rest = words[2:]
    placements = [word for word in rest if word in PLACEMENTS]
    unknown = [word for word in rest if word not in (*PLACEMENTS, "unchecked")]
    if len(words) < 2 or words[0] not in ("step", "dist", "pipe") or unknown or len(placements) > 1:
        raise ValueError(
            f"a way is '<step|dist|pipe> <schedule>[ <loop|v>][ unchecked]' (way: {way!r})"
        )
    if words[0] == "pipe" and words[1] not in PIPELINING_SCHEDULES:
        raise ValueError(
            f"pipelining has no schedule like {words[1]!r} (known: {list(PIPELINING_SCHEDULES)})"
        )
    return Way(words[0], words[1], placements[0] if placements else None, "unchecked" not in rest)


def merged_balance(balance: Sequence[int], workers: int) -> list[int]:
    """``balance`` with each run of ``len(balance) // workers`` partitions made one: the
    same layers, one partition per worker.

    Example:
        >>> merged_balance([1, 2, 3, 4], 2)
        [3, 7]
    """
    if len(balance) % workers:
        raise ValueError(
            f"{len(balance)} partitions cannot be merged into {workers} (balance: {balance})"
        )
    k = len(balance) // workers
    return [sum(balance[i : i + k]) for i in range(0, len(balance), k)]


def placed_balance(case: Case, way: Way, workers: int) -> tuple[list[int], list[int]]:
    """The balance ``way`` runs ``case`` with on ``workers`` workers, and the worker of
    each of its partitions."""
    from gpipe_core import place_partitions

    if way.placement is None:
        balance = merged_balance(case.balance, workers)
        return balance, list(range(workers))
    balance = list(case.balance)
    return balance, place_partitions(way.placement, len(balance), workers)


def step_models(case: Case, ways: Sequence[str], workers: int) -> dict[str, tuple[Any, str]]:
    """The ``step`` ways of ``case`` in this process, ``workers`` ``"cpu"`` workers: each
    way's ``GPipe`` and schedule. One ``GPipe`` per placement, shared by the ways that
    name it."""
    from gpipe_core import GPipe

    models: dict[str | None, GPipe] = {}
    result: dict[str, tuple[Any, str]] = {}
    for name in ways:
        way = parse_way(name)
        if way.kind != "step":
            raise ValueError(f"not a way of this process: {name!r}")
        model = models.get(way.placement)
        if model is None:
            balance, _ = placed_balance(case, way, workers)
            model = models[way.placement] = GPipe(
                case.model(),
                balance,
                chunks=case.chunks,
                checkpoint=case.checkpoint,  # type: ignore[arg-type]
                devices=["cpu"] * workers,
                placement=way.placement,
            )
        result[name] = (model, way.schedule)
    return result


def step_runners(case: Case, ways: Sequence[str], workers: int) -> dict[str, Runner]:
    """The runners of :func:`step_models`: one ``GPipe.step`` each."""
    x, y = case.data()
    loss_fn = case.loss_fn()
    return {
        name: timed(
            model,
            lambda model=model, schedule=schedule: model.step(x, y, loss_fn, schedule=schedule),  # type: ignore[misc]
        )
        for name, (model, schedule) in step_models(case, ways, workers).items()
    }


def pipelining_check() -> str | None:
    """Why ``torch.distributed.pipelining`` cannot run here, or None."""
    try:
        import numpy  # noqa: F401  (pipelining's stage shape inference needs it)
        import torch.distributed as dist
        from torch.distributed import pipelining  # noqa: F401
    except ImportError as error:
        return f"not installed: {error}"
    if not dist.is_available() or not dist.is_gloo_available():
        return "not installed: torch.distributed with gloo is not available"
    return None


#: One way's step on one rank: the module whose grads are zeroed first, and the step.
RankStep = tuple[nn.Module, Callable[[], object]]


def _pipelining_step(rank: int, world: int, case: Case, way: Way) -> RankStep:
    """This rank's stages of ``case`` under pipelining's schedule of ``way``: one
    ``PipelineStage`` per partition of the way's balance on this rank."""
    from torch.distributed import pipelining

    x, y = case.data()
    balance, workers = placed_balance(case, way, world)
    layers = list(case.model().children())
    bounds = [sum(balance[:j]) for j in range(len(balance) + 1)]
    mine = [j for j, worker in enumerate(workers) if worker == rank]
    submodules, stages = [], []
    for j in mine:
        submodule = nn.Sequential(*layers[bounds[j] : bounds[j + 1]])
        with torch.no_grad():  # the input of this stage's micro-batch
            micro = nn.Sequential(*layers[: bounds[j]])(x.tensor_split(case.chunks)[0])
        stage = pipelining.PipelineStage(
            submodule, j, len(balance), torch.device("cpu"), input_args=(micro.detach(),)
        )
        submodules.append(submodule)
        stages.append(stage)
    schedule_class = getattr(pipelining, PIPELINING_SCHEDULES[way.schedule])
    several = issubclass(schedule_class, pipelining.schedules.PipelineScheduleMulti)
    schedule = schedule_class(
        stages if several else stages[0], n_microbatches=case.chunks, loss_fn=case.loss_fn()
    )
    args = (x,) if 0 in mine else ()
    last = len(balance) - 1 in mine

    def run() -> None:
        if last:
            schedule.step(*args, target=y, losses=[])
        else:
            schedule.step(*args)

    return nn.ModuleList(submodules), run


def _gpipe_step(case: Case, way: Way, timeout: float, models: dict[str | None, Any]) -> RankStep:
    """This rank's partitions of ``case`` in ``GPipe(..., group=WORLD)`` with the placement
    of ``way``: one ``GPipe`` per placement (in ``models``), shared by the ways that name
    it."""
    import torch.distributed as dist

    from gpipe_core import GPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.get(way.placement)
    if model is None:
        balance, _ = placed_balance(case, way, world)
        model = models[way.placement] = GPipe(
            case.model(),
            balance,
            chunks=case.chunks,
            checkpoint=case.checkpoint,  # type: ignore[arg-type]
            group=dist.group.WORLD,
            timeout=timeout,
            placement=way.placement,
        )
    x, y = case.data()
    first, last = model.partition_ranks[0] == rank, model.partition_ranks[-1] == rank
    inputs = (x if first else None), (y if last else None)
    loss_fn = case.loss_fn()

    def run() -> object:
        # Whether the ranks compare their run fields: a setting of this pipeline's placement.
        model._placement.check_runs = way.checked
        return model.step(*inputs, loss_fn, schedule=way.schedule)

    return model, run


def _rank_steps(
    rank: int, world: int, case: Case, ways: Sequence[str], timeout: float
) -> tuple[dict[str, RankStep], dict[str, str]]:
    """This rank's step of each of ``ways``, and why each way that could not be built was
    not (``'failed: ...'``), so that the other ways still run."""
    steps: dict[str, RankStep] = {}
    unbuilt: dict[str, str] = {}
    models: dict[str | None, Any] = {}
    for name in ways:
        way = parse_way(name)
        try:
            if way.kind == "dist":
                steps[name] = _gpipe_step(case, way, timeout, models)
            else:
                steps[name] = _pipelining_step(rank, world, case, way)
        except Exception as error:
            unbuilt[name] = failed(error)
    return steps, unbuilt


def _rank_main(
    rank: int,
    world: int,
    port: int,
    case: Case,
    ways: Sequence[str],
    threads: int,
    timeout: float,
    commands: Any,
    results: Any,
    build: RankBuild | None = None,
) -> None:
    """One rank: join the group, build the ways' stages (with ``build``, default
    :func:`_rank_steps`), run one timed step per command.

    Each step starts right after a barrier; the rank reports when it started and ended
    (``time.perf_counter``, one clock for all processes of the machine).
    """
    import datetime
    import queue

    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        steps, unbuilt = (build or _rank_steps)(rank, world, case, ways, timeout)
        results.put((rank, "ready", unbuilt))
        parent = os.getppid()
        while True:
            try:
                command = commands.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the parent is gone: nobody will ask again
                    break
                continue
            if command is None:
                break
            module, run = steps[command]
            module.zero_grad(set_to_none=True)
            dist.barrier()
            begin = time.perf_counter()
            try:
                run()
            except Exception:  # reported; the parent decides whether the group goes on
                results.put((rank, "failed", traceback.format_exc()))
                continue
            end = time.perf_counter()
            results.put((rank, "time", (begin, end)))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


#: What builds one rank's steps of the ways: ``(rank, world, case, ways, timeout)`` to the
#: steps and the reasons of the ways not built (:func:`_rank_steps` is one). A function of a
#: module the spawned processes import (or of the script that starts them), so that it
#: pickles by name.
RankBuild = Callable[
    [int, int, Any, Sequence[str], float], tuple[dict[str, RankStep], dict[str, str]]
]


class RankError(RuntimeError):
    """A rank of a :class:`Ranks` group raised, died, or did not answer in time."""


class Ranks:
    """``world`` processes in one gloo group (default: one per partition of ``case``), kept
    alive for one case and stepped from this process.

    ``build`` builds each rank's steps (default :func:`_rank_steps`: the ways of
    :func:`parse_way` on ``case``'s model); another one runs other models under the same
    ways' names (``bench_transformers.py``).

    Each rank builds the ``ways`` it is given (``dist`` and ``pipe`` ways, see
    :func:`parse_way`) with ``torch.set_num_threads(threads)``; :meth:`step` runs one step
    of a way on every rank and returns its time, from the barrier that starts it to the
    last rank's end. Every wait is bounded by ``timeout`` seconds; a rank that raises, dies
    or does not answer in time raises :class:`RankError` here, after every process has been
    ended and reaped. Two failures leave the group running for the other ways: a way that
    some rank cannot build (listed in :attr:`unbuilt`, never stepped), and a step that
    raises the same error on every rank (a refusal before any message).
    """

    def __init__(
        self,
        case: Case,
        ways: Sequence[str],
        threads: int = 1,
        timeout: float = 120.0,
        world: int | None = None,
        build: RankBuild | None = None,
    ) -> None:
        import torch.multiprocessing as mp

        for way in ways:
            if parse_way(way).kind == "step":
                raise ValueError(f"not a way of the ranks: {way!r} (step ways run here)")
        context = mp.get_context("spawn")
        self.world = len(case.balance) if world is None else world
        self.timeout = timeout
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(self.world)]
        #: The ways some rank could not build, and why (they are not stepped).
        self.unbuilt: dict[str, str] = {}
        port = free_port()
        self.processes = [
            context.Process(
                target=_rank_main,
                args=(
                    rank,
                    self.world,
                    port,
                    case,
                    tuple(ways),
                    threads,
                    timeout,
                    self.commands[rank],
                    self.results,
                    build,
                ),
                name=f"rank-{rank}",
                daemon=True,
            )
            for rank in range(self.world)
        ]
        try:
            for process in self.processes:
                process.start()
            for unbuilt in self._collect("ready"):
                for way, reason in unbuilt.items():
                    self.unbuilt.setdefault(way, reason)
        except BaseException:
            self.close()
            raise

    def _collect(self, kind: str) -> list[Any]:
        """Each rank's next report of ``kind``, waiting at most ``timeout`` seconds."""
        import queue

        values: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(values) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = [rank for rank in range(self.world) if rank not in values]
                self.close()
                raise RankError(f"ranks {late} did not report {kind!r} in {self.timeout:g} s")
            try:
                rank, got, value = self.results.get(timeout=min(1.0, remaining))
            except queue.Empty:
                dead = [
                    (rank, process.exitcode)
                    for rank, process in enumerate(self.processes)
                    if process.exitcode is not None
                ]
                if dead:
                    self.close()
                    raise RankError(
                        f"rank {dead[0][0]} exited (exit code {dead[0][1]}) before reporting "
                        f"{kind!r}"
                    ) from None
                continue
            if got == "error":
                self.close()
                raise RankError(f"rank {rank} failed:\n{value}")
            if got == "failed" and kind == "time":  # the step raised: see step()
                values[rank] = RankError(value)
                continue
            if got != kind:
                self.close()
                raise RankError(f"rank {rank}: expected {kind!r}, got {got!r}")
            values[rank] = value
        return [values[rank] for rank in range(self.world)]

    def step(self, way: str) -> float:
        """One training step of ``way`` on every rank; its time in seconds."""
        if not self.processes:
            raise RankError("the ranks were closed (an earlier step failed)")
        for queue in self.commands:
            queue.put(way)
        spans = self._collect("time")
        errors = [span for span in spans if isinstance(span, RankError)]
        if errors:
            # Every rank refusing alike (a check before any message) leaves nothing on the
            # wire: the group goes on with the other ways. Otherwise it is ended.
            last_lines = {str(error).strip().splitlines()[-1] for error in errors}
            if len(errors) < self.world or len(last_lines) > 1:
                self.close()
            raise RankError(
                f"the step of {way!r} raised on {len(errors)} rank(s): {last_lines.pop()}"
            )
        return float(max(end for _, end in spans) - min(begin for begin, _ in spans))

    def close(self) -> list[int | None]:
        """End every rank (killing it if it does not stop) and reap it (idempotent).

        Returns:
            The exit code of each rank ended by this call (negative: the signal that ended
            it), none after the first call.
        """
        for queue in self.commands:
            with contextlib.suppress(Exception):
                queue.put(None)
        deadline = time.monotonic() + 10
        for process in self.processes:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(10)
        codes = [process.exitcode for process in self.processes]
        self.processes = []
        return codes


class Ways:
    """Builds the runners of one case (see :meth:`build`); keeps the case's ranks until
    :meth:`close`."""

    def __init__(self, threads: int, timeout: float = 120.0) -> None:
        self.threads = threads
        self.timeout = timeout
        self.groups: list[tuple[str, Ranks]] = []
        #: Ranks that exited with a non-zero code after their case: (case, exit codes).
        self.bad_exits: list[tuple[str, list[int | None]]] = []

    def build(
        self, case: Case, ways: Sequence[str], workers: int | None = None
    ) -> dict[str, Runner | str]:
        """The runners of ``ways`` on ``workers`` workers (default: one per partition):
        ``plain``, ``plain mb``, and the ways of :func:`parse_way`, ``step`` ways in this
        process, ``dist`` and ``pipe`` ways on one :class:`Ranks` group. A way that cannot
        run gets the reason (``'failed: ...'`` when it raised)."""
        workers = len(case.balance) if workers is None else workers
        runners: dict[str, Runner | str] = {}
        if "plain" in ways:
            runners["plain"] = plain_runner(case)
        if "plain mb" in ways:
            runners["plain mb"] = plain_microbatched_runner(case)
        local = [way for way in ways if way.startswith("step ")]
        if local:
            try:
                runners.update(step_runners(case, local, workers))
            except Exception as error:
                runners.update(dict.fromkeys(local, failed(error)))
        remote = [way for way in ways if way.startswith(("dist ", "pipe "))]
        reason = pipelining_check()
        if reason is not None:
            for way in remote:
                if way.startswith("pipe "):
                    runners[way] = reason
            remote = [way for way in remote if not way.startswith("pipe ")]
        if remote:
            try:
                group = Ranks(case, remote, self.threads, self.timeout, world=workers)
            except Exception as error:
                for way in remote:
                    runners[way] = failed(error)
            else:
                self.groups.append((case.name, group))
                for way in remote:
                    runners[way] = group.unbuilt.get(way) or (
                        lambda group=group, way=way: group.step(way)  # type: ignore[misc]
                    )
        return {way: runners[way] for way in ways}

    def close(self) -> None:
        """End the ranks of the case; note those that do not exit with 0."""
        for name, group in self.groups:
            alive = bool(group.processes)  # not closed after a failure already reported
            codes = group.close()
            if alive and any(code != 0 for code in codes):
                self.bad_exits.append((name, codes))
        self.groups.clear()
