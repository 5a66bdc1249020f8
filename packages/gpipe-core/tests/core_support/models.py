"""The test models that several of gpipe-core's test modules build.

``MODES`` (every checkpoint mode), ``PLANS`` (every built-in schedule), ``Scale`` and
``TrainableScale``, the ``Stash``/``Pop`` pair of one skip, the ``MaybeStash``/``MaybePop``
pair of a skip that may be ``None``, the U-Net's ``Encoder``/``Decoder`` pairs
(:func:`unet_layers`), and :func:`count_and_retain` for layers that count the hooks on an
activation and retain its gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

from gpipe_skip import Namespace, pop, skippable, stash

#: Every checkpoint mode of GPipe.
MODES = ("always", "except_last", "never")

#: Every built-in schedule as a test runs it on four partitions: (schedule, placement),
#: one partition per worker where the placement is None, two per worker otherwise (on
#: ``devices=["cpu", "cpu"]``; interleaved 1F1B then needs an even number of micro-batches,
#: or at most two).
PLANS: list[tuple[str, str | None]] = [
    ("gpipe", None),
    ("1f1b", None),
    ("zb-h1", None),
    ("interleaved-1f1b", "loop"),
    ("zb-h1", "loop"),
    ("zbv", "v"),
    ("1f1b", "v"),
]


def placed(placement: str | None) -> dict[str, Any]:
    """GPipe's keyword arguments for a plan's ``placement`` (see :data:`PLANS`)."""
    return {"devices": ["cpu", "cpu"], "placement": placement} if placement else {}


class Scale(nn.Module):
    """Multiplies its input by a constant ``factor``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class TrainableScale(nn.Module):
    """Multiplies its input by a trainable float64 scalar (1.5 at first); elementwise, so
    that gradients expose dropout masks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@skippable(stash=["skip"])
class Stash(nn.Module):
    """Stashes its input as ``skip`` and returns it."""

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class Pop(nn.Module):
    """Adds ``skip``, popped from its :class:`Stash`, to its input."""

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        skip = yield pop("skip")
        return x + skip


@skippable(stash=["maybe"])
class MaybeStash(nn.Module):
    """Stashes ``x * 2`` as ``maybe`` while ``active``, else ``None``; returns ``x + 1``."""

    def __init__(self, active: bool = True) -> None:
        super().__init__()
        self.active = active

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        yield stash("maybe", x * 2 if self.active else None)
        return x + 1


@skippable(pop=["maybe"])
class MaybePop(nn.Module):
    """Multiplies its input by ``maybe`` where that is not ``None``."""

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        skip = yield pop("maybe")
        return x if skip is None else x * skip


@skippable(stash=["skip"])
class Encoder(nn.Module):
    """The first half of a U-Net's pair: stashes its input as ``skip``, returns
    ``tanh(linear(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        yield stash("skip", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["skip"])
class Decoder(nn.Module):
    """The second half: ``tanh(linear(x)) * 0.5 + skip``, with its encoder's ``skip``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        skip = yield pop("skip")
        return torch.tanh(self.linear(x)) * 0.5 + skip


def unet_layers(depth: int, width: int, bottleneck: nn.Module | None = None) -> list[nn.Module]:
    """A U-Net's layers: ``depth`` encoders, the ``bottleneck`` (a linear layer and a ReLU
    by default), then the decoders in reverse order, every pair in its own namespace
    (made in that order, so that a seed set before gives the same weights)."""
    namespaces = [Namespace() for _ in range(depth)]
    encoders: list[nn.Module] = [Encoder(width).isolate(ns) for ns in namespaces]
    if bottleneck is None:
        bottleneck = nn.Sequential(nn.Linear(width, width), nn.ReLU())
    decoders: list[nn.Module] = [Decoder(width).isolate(ns) for ns in reversed(namespaces)]
    return [*encoders, bottleneck, *decoders]


def count_and_retain(
    y: torch.Tensor, count: Callable[[torch.Tensor], None], kept: list[torch.Tensor]
) -> None:
    """On an activation that needs grad: a hook that calls ``count``, and ``retain_grad()``
    (the activation goes into ``kept``, whose gradients a test compares)."""
    if y.requires_grad:
        y.register_hook(count)
        y.retain_grad()
        kept.append(y)
