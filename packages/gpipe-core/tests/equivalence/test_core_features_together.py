"""Skips, deferred batch norm, checkpointing and tracing in one pipeline.

Each feature has its own tests; these check that they compose: a traced U-Net with
cross-partition skips and deferred batch norm gives the plain model's gradients, the
timeline has one task of each kind per (partition, micro-batch), and the running statistics
are those of whole mini-batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES, unet_layers
from gpipe_bn import DeferredBatchNorm
from gpipe_core import GPipe, Phase


def unet(depth: int, width: int = 6) -> nn.Sequential:
    """A U-Net whose first layer is a batch norm (the only one, so that its statistics are
    those of the raw input, the same with or without micro-batches)."""
    torch.manual_seed(depth)
    return nn.Sequential(
        nn.BatchNorm1d(width),
        *unet_layers(depth, width, bottleneck=nn.Linear(width, width)),
        nn.Linear(width, 1),
    ).double()


@st.composite
def setups(draw: st.DrawFn) -> tuple[int, list[int], int, str, int]:
    depth = draw(st.integers(2, 3))
    layers = 2 * depth + 3
    partitions = draw(st.integers(2, 4))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=partitions - 1,
                               max_size=partitions - 1)))  # fmt: skip
    balance = [b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True)]
    chunks = draw(st.sampled_from([1, 2, 4]))
    mode = draw(st.sampled_from(MODES))
    # Every micro-batch needs two rows: batch norm refuses one value per channel in training.
    batch = draw(
        st.integers(2, 11).filter(
            lambda b: min(len(c) for c in torch.chunk(torch.empty(b), chunks)) >= 2
        )
    )
    return depth, balance, chunks, mode, batch


def run(model: nn.Module, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    grads: list[torch.Tensor] = []
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        model(x).pow(2).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return grads


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_traced_unet_with_deferred_batch_norm_matches_plain(
    setup: tuple[int, list[int], int, str, int],
) -> None:
    depth, balance, chunks, mode, batch = setup
    plain = unet(depth)
    pipe = GPipe(copy.deepcopy(plain), balance, chunks=chunks, checkpoint=mode,
                 deferred_batch_norm=True)  # fmt: skip
    assert isinstance(pipe[0], DeferredBatchNorm)
    x = torch.randn(batch, 6, dtype=torch.float64)

    # Eval mode: the batch norm uses running statistics, so outputs and gradients are the
    # plain model's whatever the micro-batches.
    plain.eval()
    pipe.eval()
    expected = run(plain, x, 1)
    with pipe.trace() as timeline:
        got = run(pipe, x, 1)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    micro = len(torch.chunk(x, chunks))
    tasks = {(e.phase, e.partition, e.microbatch) for e in timeline.events}
    every = {(j, i) for j in range(len(balance)) for i in range(micro)}
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert {(j, i) for p, j, i in tasks if p is phase} == every
    assert not [e for e in timeline.events if e.phase is Phase.RECOMPUTE]  # eval: none

    # Training: the running statistics are those of whole mini-batches.
    plain.train()
    pipe.train()
    run(plain, x, 3)
    with pipe.trace() as timeline:
        run(pipe, x, 3)
    bn_plain, bn_pipe = plain[0], pipe[0]
    torch.testing.assert_close(bn_pipe.running_mean, bn_plain.running_mean, rtol=1e-7, atol=0)
    torch.testing.assert_close(bn_pipe.running_var, bn_plain.running_var, rtol=1e-7, atol=0)
    assert int(bn_pipe.num_batches_tracked) == int(bn_plain.num_batches_tracked) == 3
    stop = {"always": micro, "except_last": micro - 1, "never": 0}[mode]
    recomputed = {
        (e.partition, e.microbatch) for e in timeline.events if e.phase is Phase.RECOMPUTE
    }
    assert recomputed == {(j, i) for j, i in every if i < stop}


def test_features_together_survive_an_error() -> None:
    plain = unet(2).eval()
    pipe = GPipe(copy.deepcopy(plain), [3, 2, 2], chunks=2, deferred_batch_norm=True).eval()
    with pytest.raises(RuntimeError), pipe.trace():
        pipe(torch.randn(4, 5, dtype=torch.float64))  # wrong width
    assert_matches_plain(pipe, plain, torch.randn(4, 6, dtype=torch.float64))
