"""Several threads training at once, with dropout under checkpointing.

Every CPU worker draws from one generator. A recomputation replays its micro-batch's draws
by restoring the generator's state; another thread drawing between the restore and the
put-back would change the replayed mask, or lose its own draws. The recomputation holds
the device's generator lock, as drawing partitions do, so both paths replay exactly: here two
models are trained in two threads for hundreds of steps, and every gradient equals the
one the plain model gives with the masks the forward pass drew.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipe

STEPS = 300
TIMEOUT = 600.0


class MaskDropout(nn.Module):
    """Dropout that records the masks it draws, or applies given masks in order."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.drawn: list[torch.Tensor] = []
        self.replayed: list[torch.Tensor] = []
        self.given: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.given is not None:
            mask = self.given.pop(0)
        else:
            mask = (torch.rand_like(x) >= self.p).to(x.dtype) / (1 - self.p)
            (self.replayed if is_recomputing() else self.drawn).append(mask)
        return x * mask


def model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 6), MaskDropout(), nn.Tanh(), nn.Linear(6, 6), MaskDropout(), nn.Linear(6, 2)
    ).double()


def expected_grads(plain: nn.Sequential, pipe: GPipe, x: torch.Tensor, chunks: int) -> list:
    """The plain model's gradients on the micro-batches, with the masks ``pipe`` drew."""
    plain.zero_grad()
    for layer, used in zip(plain, pipe, strict=True):
        if isinstance(layer, MaskDropout):
            assert isinstance(used, MaskDropout)
            layer.given = list(used.drawn)  # micro-batch order: each partition runs them in order
    for micro in x.chunk(chunks):
        plain(micro).sum().backward()
    return [p.grad.clone() for p in plain.parameters()]


def pipelines(seeds: tuple[int, ...], chunks: int) -> list[tuple[nn.Sequential, GPipe]]:
    """The plain model and its pipeline of each seed, made in this thread: building a model
    seeds and draws from the shared generator, which no thread may do while another's
    pipeline draws (only gpipe's own draws take the generator lock)."""
    made = []
    for seed in seeds:
        plain = model(seed)
        made.append(
            (plain, GPipe(copy.deepcopy(plain), [3, 3], chunks=chunks, checkpoint="always"))
        )
    return made


def train(
    seed: int, plain: nn.Sequential, pipe: GPipe, chunks: int, path: str, failures: list[str]
) -> None:
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(9, 2, dtype=torch.float64, generator=generator)
    for step in range(STEPS):
        for layer in pipe:
            if isinstance(layer, MaskDropout):
                layer.drawn.clear()
                layer.replayed.clear()
        pipe.zero_grad()
        x = torch.randn(9, 6, dtype=torch.float64, generator=generator)
        if path == "forward":
            pipe(x).sum().backward()
        else:
            pipe.step(x, target, lambda output, _: output.sum(), reduction="sum")
        for index, layer in enumerate(pipe):
            if isinstance(layer, MaskDropout):
                replayed_ok = len(layer.replayed) == chunks and all(
                    any(torch.equal(again, first) for first in layer.drawn)
                    for again in layer.replayed
                )
                if not replayed_ok:
                    failures.append(f"step {step}: layer {index} replayed other masks")
        got = [p.grad for p in pipe.parameters()]
        for mine, theirs in zip(got, expected_grads(plain, pipe, x, chunks), strict=True):
            if mine is None or not torch.allclose(mine, theirs, rtol=1e-9, atol=1e-12):
                failures.append(f"step {step}: a gradient differs from the plain model's")
                break


def run_threads(targets: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "training threads hang"


@pytest.mark.parametrize("path", ["forward", "step"])
def test_two_dropout_models_trained_in_two_threads_have_exact_gradients(path: str) -> None:
    failures: list[str] = []
    chunks, seeds = 3, (1, 2)
    made = pipelines(seeds, chunks)
    run_threads(
        [
            lambda seed=seed, plain=plain, pipe=pipe: train(
                seed, plain, pipe, chunks, path, failures
            )
            for seed, (plain, pipe) in zip(seeds, made)
        ]
    )
    assert failures == []
