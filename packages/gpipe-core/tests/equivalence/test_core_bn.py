"""GPipe(deferred_batch_norm=True): running statistics equal those of whole mini-batches."""

from __future__ import annotations

import copy
import itertools
from functools import partial
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.models import MODES
from gpipe_bn import DeferredBatchNorm, convert_deferred_batch_norm, mini_batch
from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipe

# The statistics of a batch norm equal those of the whole mini-batch when its input does
# not depend on how the mini-batch is split: when no batch norm comes before it. So the
# models compared with whole mini-batches have one batch norm each; stacked batch norms are
# compared with the inputs they saw (see Seen).


def single(kind: int, momentum: float | None, affine: bool = True) -> nn.Sequential:
    """One ``nn.BatchNorm{kind}d`` between convolutions, on inputs of shape (N, 3, 4, 4)."""
    if kind == 1:
        reshape: list[nn.Module] = [nn.Flatten(2)]  # (N, 4, 16)
    elif kind == 2:
        reshape = []
    else:
        reshape = [nn.Unflatten(2, (1, 4))]  # (N, 4, 1, 4, 4)
    norm = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][kind - 1]
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        *reshape,
        norm(4, momentum=momentum, affine=affine),
        nn.Flatten(1),
        nn.Linear(64, 5),
    ).double()


def stacked(momentum: float | None) -> nn.Sequential:
    """Batch norms of every kind, one after the other, on inputs of shape (N, 3, 4, 4)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=momentum, affine=False),
        nn.Flatten(2),  # (N, 4, 16)
        nn.BatchNorm1d(4, momentum=momentum),
        nn.Unflatten(2, (1, 4, 4)),  # (N, 4, 1, 4, 4)
        nn.BatchNorm3d(4, momentum=momentum),
        nn.Flatten(1),
        nn.Linear(64, 5),
    ).double()


def mlp(momentum: float | None) -> nn.Sequential:
    """BatchNorm1d on (N, C) inputs: every micro-batch needs two samples or more."""
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8, momentum=momentum),
        nn.Linear(8, 3),
    ).double()


def batch_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def assert_same_statistics(pipe: nn.Module, plain: nn.Module | list[nn.Module]) -> None:
    got = batch_norms(pipe)
    expected = plain if isinstance(plain, list) else batch_norms(plain)
    assert len(got) == len(expected) > 0
    assert all(isinstance(layer, DeferredBatchNorm) for layer in got)
    for index, (layer, reference) in enumerate(zip(got, expected)):
        assert layer.pending == 0
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(
                getattr(layer, name),
                getattr(reference, name),
                rtol=1e-7,
                atol=1e-12,
                msg=f"{name} of batch norm {index}",
            )
        assert int(layer.num_batches_tracked) == int(reference.num_batches_tracked)


def loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def train_both(pipe: GPipe, plain: nn.Module, inputs: list[torch.Tensor]) -> None:
    """Forward and backward each mini-batch through both models; parameters stay as they are."""
    for x in inputs:
        loss(plain(x)).backward()
        loss(pipe(x)).backward()
        assert_same_statistics(pipe, plain)


class Seen:
    """What ``nn.BatchNorm`` would hold after the inputs each deferred layer saw in a run.

    Forward hooks record the input of every counted call (not those of recomputation); after
    the run, a copy of each layer as it was, made an ``nn.BatchNorm1d``, takes the whole
    recorded mini-batch at once.
    """

    def __init__(self, pipe: GPipe) -> None:
        self.layers = batch_norms(pipe)
        self.before = [self._plain_copy(layer) for layer in self.layers]
        self.inputs: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self.handles = [
            layer.register_forward_hook(partial(self._record, index))
            for index, layer in enumerate(self.layers)
        ]

    @staticmethod
    def _plain_copy(layer: nn.Module) -> nn.BatchNorm1d:
        assert isinstance(layer, DeferredBatchNorm)
        plain = nn.BatchNorm1d(
            layer.num_features, layer.eps, layer.momentum, layer.affine, dtype=torch.float64
        )
        plain.load_state_dict(layer.state_dict())
        return plain

    def _record(self, index: int, layer: nn.Module, args: Any, output: Any) -> None:
        if layer.training and not is_recomputing():
            # Channels second, everything else flattened: the shape BatchNorm1d takes.
            self.inputs[index].append(
                args[0].detach().flatten(2) if args[0].dim() > 2 else args[0].detach()
            )

    def expected(self) -> list[nn.Module]:
        for handle in self.handles:
            handle.remove()
        for plain, inputs in zip(self.before, self.inputs):
            if inputs:
                plain(torch.cat(inputs))
        return list(self.before)


def assert_same_eval_output(pipe: GPipe, plain: nn.Sequential, x: torch.Tensor) -> None:
    """A plain model loaded with the pipeline's state gives the pipeline's eval output."""
    loaded = copy.deepcopy(plain)
    for target, layer in zip(loaded, pipe):
        target.load_state_dict(layer.state_dict())
    pipe.eval()
    loaded.eval()
    torch.testing.assert_close(pipe(x), loaded(x), rtol=1e-7, atol=1e-9)


def images(*sizes: int) -> list[torch.Tensor]:
    return [torch.randn(size, 3, 4, 4, dtype=torch.float64) * 2.0 + 5.0 for size in sizes]


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("kind", [1, 2, 3])
def test_statistics_match_whole_mini_batches(
    checkpoint: str, chunks: int, momentum: float | None, kind: int
) -> None:
    torch.manual_seed(chunks * 10 + kind)
    plain = single(kind, momentum, affine=kind != 3)
    pipe = GPipe(
        copy.deepcopy(plain),
        [2, 2, len(plain) - 4],
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=True,
    )
    # 13 and 9 leave an uneven last micro-batch; 3 gives fewer micro-batches than chunks.
    train_both(pipe, plain, images(16, 13, 9, 3))
    (x,) = images(5)
    plain.eval()
    expected = plain(x)
    assert_same_eval_output(pipe, plain, x)
    torch.testing.assert_close(pipe(x), expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_statistics_match_with_two_dimensional_input(checkpoint: str, chunks: int) -> None:
    torch.manual_seed(10 + chunks)
    plain = mlp(None)
    pipe = GPipe(
        copy.deepcopy(plain),
        [2, 3],
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=True,
    )
    # Micro-batches of two samples or more for every chunks; 12 and 20 give fewer than 8.
    inputs = [torch.randn(size, 6, dtype=torch.float64) * 3.0 - 7.0 for size in (16, 14, 12, 20)]
    train_both(pipe, plain, inputs)
    assert_same_eval_output(pipe, plain, torch.randn(4, 6, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_stacked_batch_norms(checkpoint: str, chunks: int, momentum: float | None) -> None:
    torch.manual_seed(20 + chunks)
    plain = stacked(momentum)
    pipe = GPipe(
        copy.deepcopy(plain),
        [3, 4, 4],
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=True,
    )
    for x in images(16, 13, 3):
        seen = Seen(pipe)
        loss(pipe(x)).backward()
        assert_same_statistics(pipe, seen.expected())
    assert_same_eval_output(pipe, plain, images(5)[0])


def test_ordinary_batch_norm_counts_micro_batches() -> None:
    # What deferred batch norm is for: without it, the statistics drift.
    torch.manual_seed(30)
    plain = mlp(0.1)
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    x = torch.randn(16, 6, dtype=torch.float64)
    plain(x)
    pipe(x)
    assert int(pipe[3].num_batches_tracked) == 4
    assert not torch.allclose(pipe[3].running_var, plain[3].running_var, rtol=1e-3)


def test_training_without_grad_updates_once() -> None:
    torch.manual_seed(31)
    plain = single(2, None)
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4, deferred_batch_norm=True)
    with torch.no_grad():
        for x in images(8, 7):
            plain(x)
            pipe(x)
    assert_same_statistics(pipe, plain)


def test_eval_mode_updates_nothing() -> None:
    torch.manual_seed(32)
    plain = stacked(0.1)
    pipe = GPipe(copy.deepcopy(plain), [5, 6], chunks=4, deferred_batch_norm=True)
    pipe.eval()
    plain.eval()
    (x,) = images(8)
    torch.testing.assert_close(pipe(x), plain(x))
    assert all(int(layer.num_batches_tracked) == 0 for layer in batch_norms(pipe))
    assert_same_statistics(pipe, plain)


class FailOnCall(nn.Module):
    """Raises on its ``n``-th call while armed."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.calls = 0
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.armed and self.calls == self.n:
            raise RuntimeError("failed on purpose")
        return x


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_failed_mini_batch_leaves_no_statistics(checkpoint: str, fail_at: int) -> None:
    torch.manual_seed(33)
    failing = FailOnCall(fail_at)
    # Partition 0 (two batch norms) runs ahead of the failing layer in partition 1, which
    # has batch norms after it.
    model = stacked(0.1)
    model = nn.Sequential(*model[:6], failing, *model[6:])
    pipe = GPipe(
        model,
        [6, 6],
        chunks=4,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=True,
    )
    x, y = images(12, 10)
    with pytest.raises(RuntimeError, match="failed on purpose"):
        pipe(x)
    for layer in batch_norms(pipe):
        assert isinstance(layer, DeferredBatchNorm)
        assert layer.pending == 0
        assert int(layer.num_batches_tracked) == 0
        assert torch.equal(layer.running_mean, torch.zeros_like(layer.running_mean))
    # The next mini-batch counts alone.
    failing.armed = False
    seen = Seen(pipe)
    loss(pipe(y)).backward()
    assert_same_statistics(pipe, seen.expected())


def test_a_mini_batch_over_several_calls() -> None:
    # Gradient accumulation: two pipeline runs make one mini-batch.
    torch.manual_seed(34)
    plain = single(2, 0.1)
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=2, deferred_batch_norm=True)
    (x,) = images(16)
    loss(plain(x)).backward()
    with mini_batch(pipe):
        for half in x.chunk(2):
            loss(pipe(half)).backward()
    assert_same_statistics(pipe, plain)


def test_layers_converted_by_hand() -> None:
    # Converted with another chunks, without deferred_batch_norm: still one update per run.
    torch.manual_seed(35)
    plain = single(2, None)
    model = convert_deferred_batch_norm(copy.deepcopy(plain), chunks=7)
    assert isinstance(model, nn.Sequential)
    pipe = GPipe(model, [2, 3], chunks=4)
    train_both(pipe, plain, images(8, 6))


def test_the_original_layers_are_converted_in_place() -> None:
    model = stacked(0.1)
    weight, running_mean = model[1].weight, model[1].running_mean
    pipe = GPipe(model, [5, 6], chunks=3, deferred_batch_norm=True)
    assert pipe[1] is model[1]
    assert isinstance(model[1], DeferredBatchNorm)
    assert model[1].chunks == 3 and model[1].dim == 2
    assert model[1].weight is weight and model[1].running_mean is running_mean
    assert [type(layer) for layer in pipe].count(DeferredBatchNorm) == 4


@st.composite
def models(draw: st.DrawFn) -> tuple[nn.Sequential, list[int], int]:
    """A random model of Linear, Tanh and BatchNorm1d layers (one at least), and a balance."""
    width = draw(st.integers(2, 5))
    momentum = draw(st.sampled_from([0.1, 0.7, None]))
    affine = draw(st.booleans())
    kinds = draw(st.lists(st.sampled_from(["linear", "bn", "tanh"]), min_size=1, max_size=6))
    kinds.insert(draw(st.integers(0, len(kinds))), "bn")
    layers: list[nn.Module] = []
    for kind in kinds:
        if kind == "linear":
            layers.append(nn.Linear(width, width))
        elif kind == "bn":
            layers.append(nn.BatchNorm1d(width, momentum=momentum, affine=affine))
        else:
            layers.append(nn.Tanh())
    partitions = draw(st.integers(1, min(3, len(layers))))
    cuts = draw(st.sets(st.integers(1, len(layers) - 1), min_size=partitions - 1,
                        max_size=partitions - 1))  # fmt: skip
    bounds = [0, *sorted(cuts), len(layers)]
    balance = [b - a for a, b in itertools.pairwise(bounds)]
    return nn.Sequential(*layers).double(), balance, width


@settings(max_examples=25, deadline=None)
@given(
    model=models(),
    chunks=st.sampled_from([1, 2, 4, 8]),
    checkpoint=st.sampled_from(MODES),
    sizes=st.lists(st.sampled_from([16, 14, 12, 18, 20]), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_random_models(
    model: tuple[nn.Sequential, list[int], int],
    chunks: int,
    checkpoint: str,
    sizes: list[int],
    seed: int,
) -> None:
    plain, balance, width = model
    torch.manual_seed(seed)
    pipe = GPipe(
        copy.deepcopy(plain),
        balance,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=True,
    )
    # Micro-batches of two samples or more for every chunks.
    inputs = [
        (torch.randn(size, width, dtype=torch.float64) * 4.0 + 3.0).requires_grad_()
        for size in sizes
    ]
    if len(batch_norms(plain)) == 1:
        train_both(pipe, plain, inputs)  # the whole mini-batch, as the plain model sees it
    else:
        for x in inputs:
            seen = Seen(pipe)
            loss(pipe(x)).backward()
            assert_same_statistics(pipe, seen.expected())
    assert_same_eval_output(pipe, plain, torch.randn(3, width, dtype=torch.float64))


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", MODES)
def test_statistics_match_on_cuda(checkpoint: str) -> None:
    torch.manual_seed(40)
    device = torch.device("cuda", 0)
    plain = single(2, None).to(device)
    pipe = GPipe(
        copy.deepcopy(plain),
        [2, 3],
        devices=[device, device],
        chunks=4,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=True,
    )
    train_both(pipe, plain, [x.to(device) for x in images(16, 13, 3)])
    assert_same_eval_output(pipe, plain, images(5)[0].to(device))


@pytest.mark.parametrize("checkpoint", MODES)
def test_nested_pipelines_update_once(checkpoint: str) -> None:
    # The outer pipeline's call is the mini-batch; the inner calls are parts of it.
    torch.manual_seed(41)
    block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=None), nn.Tanh()).double()
    plain = nn.Sequential(nn.Linear(6, 6).double(), block, nn.Linear(6, 2).double())
    inner = GPipe(
        copy.deepcopy(block),
        [1, 2],
        chunks=2,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        deferred_batch_norm=True,
    )
    outer = GPipe(
        nn.Sequential(copy.deepcopy(plain[0]), inner, copy.deepcopy(plain[2])),
        [1, 2],
        chunks=2,
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )
    inputs = [torch.randn(size, 6, dtype=torch.float64) for size in (16, 12)]
    train_both(outer, plain, inputs)


def test_one_batch_norm_at_two_places_is_refused() -> None:
    # nn.BatchNorm counts two updates per mini-batch there; deferred statistics cannot.
    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(shared, nn.Linear(4, 4), shared, nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"used at several places .*\['0', '2'\]"):
        GPipe(model, [2, 2], chunks=2, deferred_batch_norm=True)
    assert model[0] is shared and model[2] is shared  # unchanged
    # Without deferred batch norm it runs, as nn.BatchNorm would.
    GPipe(model, [2, 2], chunks=2)(torch.randn(4, 4))


class BNBlock(nn.Module):
    """A layer holding a batch norm (unwrap must reach it without changing the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(x))


def test_unwrap_gives_plain_batch_norm_with_the_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), BNBlock())
    pipe = GPipe(model, [2, 1], chunks=4, deferred_batch_norm=True)
    pipe(torch.randn(16, 3)).sum().backward()
    plain = pipe.unwrap()
    # Plain layers, on the deferred layers' very parameters and statistics.
    assert type(plain[1]) is nn.BatchNorm1d and type(plain[2].bn) is nn.BatchNorm1d
    assert plain[1].weight is pipe[1].weight and plain[2].bn.bias is pipe[2].bn.bias
    assert plain[1].running_mean is pipe[1].running_mean
    assert int(plain[1].num_batches_tracked) == 1
    assert plain[2].linear is pipe[2].linear
    assert list(plain.state_dict()) == list(pipe.state_dict())
    # The pipeline keeps its deferred layers.
    assert isinstance(pipe[1], DeferredBatchNorm) and isinstance(pipe[2].bn, DeferredBatchNorm)
    # A copy trained alone updates its statistics on every call, as nn.BatchNorm does.
    alone = copy.deepcopy(plain)
    reference = copy.deepcopy(alone)
    x = torch.randn(8, 3)
    alone(x)
    assert int(alone[1].num_batches_tracked) == 2
    expected = nn.BatchNorm1d(3)
    expected.load_state_dict(reference[1].state_dict())
    expected(reference[0](x))
    torch.testing.assert_close(alone[1].running_mean, expected.running_mean)
    assert int(pipe[1].num_batches_tracked) == 1  # the copy is a model of its own
