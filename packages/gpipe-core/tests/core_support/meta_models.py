"""A model built as large models are, on the meta device: a norm without
``reset_parameters()`` (Hugging Face's RMSNorm) and a non-persistent buffer computed in the
constructor (RoPE's ``inv_freq``), between layers that have ``reset_parameters()``; and the
initialisers of the documented recipe (see 'Large models' in docs/distributed.rst)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WIDTH = 4


def inv_freq(width: int) -> torch.Tensor:
    """RoPE's inverse frequencies, as the constructor computes them (float32)."""
    return 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float32) / width))


class RMSNorm(nn.Module):
    """A norm whose weight its constructor sets to ones, without ``reset_parameters()``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """A rotation by angles from a non-persistent buffer computed in the constructor."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = self.inv_freq.repeat(2)
        return x * torch.cos(angles) + x.flip(-1) * torch.sin(angles)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = Rotary(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = RMSNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(self.rotary(x)))


def make_model() -> nn.Sequential:
    """Six float64 layers: a Block in each half (balance ``[3, 3]``)."""
    layers = [nn.Linear(WIDTH, WIDTH), Block(), nn.Tanh(), nn.Linear(WIDTH, WIDTH), Block()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, WIDTH)).double()


def plain_model(seed: int) -> nn.Sequential:
    """The model built on the CPU, initialised by its constructors."""
    torch.manual_seed(seed)
    return make_model()


def meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return make_model()


def rebuild_buffers(layer: nn.Module) -> None:
    """The recipe's ``init`` for non-persistent buffers: computed as the constructor does."""
    for module in layer.modules():
        if isinstance(module, Rotary):
            module.inv_freq.copy_(inv_freq(2 * module.inv_freq.numel()))


def seeded_init(module: nn.Sequential, seed: int) -> Callable[[nn.Module], None]:
    """An ``init`` that sets every tensor of a layer from a generator seeded by the layer's
    index in ``module``: the same numbers whichever rank, order or device initialises it."""

    def init(layer: nn.Module) -> None:
        index = next(k for k, candidate in enumerate(module) if candidate is layer)
        generator = torch.Generator().manual_seed(seed + index)
        with torch.no_grad():
            for parameter in layer.parameters():
                values = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.copy_(values)
        rebuild_buffers(layer)

    return init


def data(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(batch, WIDTH, generator=generator, dtype=torch.float64)
    return x, y
