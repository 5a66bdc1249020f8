"""The module API: the original layers, the attributes, the partitions and the schedule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from core_support.models import MODES
from gpipe_core import GPipe, clock_cycles


def layers() -> list[nn.Module]:
    return [nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)]


def test_len_indexing_and_iteration_give_the_original_layers() -> None:
    original = layers()
    pipe = GPipe(nn.Sequential(*original), [2, 2, 1])
    assert len(pipe) == 5
    for i, layer in enumerate(original):
        assert pipe[i] is layer
        assert pipe[i - 5] is layer
    assert list(pipe) == original
    assert all(a is b for a, b in zip(pipe, original))
    for bad in (5, 6, -6, 100):
        message = rf"layer index out of range \(index: {bad}, layers: 5\)"
        with pytest.raises(IndexError, match=message):
            pipe[bad]


def test_index_must_be_an_int() -> None:
    pipe = GPipe(nn.Sequential(*layers()), [2, 3])
    for bad in (slice(0, 2), 1.0, "0", True):
        with pytest.raises(TypeError, match=r"index must be an int"):
            pipe[bad]  # type: ignore[index]


def test_attributes() -> None:
    pipe = GPipe(
        nn.Sequential(*layers()), (1, 3, 1), devices=["cpu"] * 3, chunks=4, checkpoint="never"
    )
    assert pipe.balance == [1, 3, 1]
    assert pipe.devices == [torch.device("cpu")] * 3
    assert all(isinstance(d, torch.device) for d in pipe.devices)
    assert pipe.chunks == 4
    assert pipe.checkpoint == "never"
    text = repr(pipe)
    assert "balance=[1, 3, 1]" in text and "chunks=4" in text and "checkpoint='never'" in text


def test_defaults() -> None:
    pipe = GPipe(nn.Sequential(*layers()), [5])
    assert pipe.chunks == 1
    assert pipe.checkpoint == "except_last"


@pytest.mark.skipif(torch.cuda.is_available(), reason="default devices are the CUDA devices")
def test_default_devices_without_cuda_are_the_cpu() -> None:
    pipe = GPipe(nn.Sequential(*layers()), [2, 2, 1])
    assert pipe.devices == [torch.device("cpu")] * 3


@pytest.mark.parametrize("balance", [[5], [1, 4], [2, 2, 1], [1, 1, 1, 1, 1]])
def test_partitions(balance: list[int]) -> None:
    original = layers()
    pipe = GPipe(nn.Sequential(*original), balance)
    assert isinstance(pipe.partitions, nn.ModuleList)
    assert len(pipe.partitions) == len(balance)
    flat = []
    for partition, count in zip(pipe.partitions, balance):
        assert isinstance(partition, nn.Sequential)
        assert len(partition) == count
        flat.extend(partition)
    assert all(a is b for a, b in zip(flat, original))
    assert len(flat) == len(original)


def test_layers_keep_their_names() -> None:
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(2, 2))
    model.add_module("act", nn.ReLU())
    model.add_module("head", nn.Linear(2, 1))
    pipe = GPipe(model, [2, 1])
    names = [name for name, _ in pipe.named_modules()]
    assert names == ["", "embed", "act", "head"]  # the plain module's names
    assert pipe.partitions[1].head is model.head
    assert pipe.get_submodule("head") is model.head


def test_train_and_eval_reach_every_layer() -> None:
    pipe = GPipe(nn.Sequential(*layers()), [2, 3])
    pipe.eval()
    assert not any(layer.training for layer in pipe)
    pipe.train()
    assert all(layer.training for layer in pipe)


def test_output_is_on_the_last_device_and_has_the_plain_shape() -> None:
    pipe = GPipe(nn.Sequential(*layers()), [2, 3], chunks=3)
    output = pipe(torch.randn(7, 2))
    assert output.shape == (7, 2)
    assert output.device == pipe.devices[-1]


@pytest.mark.parametrize("checkpoint", MODES)
def test_empty_batch(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*layers())
    pipe = GPipe(model, [2, 3], chunks=4, checkpoint=checkpoint)
    x = torch.randn(0, 2, requires_grad=True)
    output = pipe(x)
    assert output.shape == (0, 2)
    output.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 2)


# -- the schedule ------------------------------------------------------------------------------


def brute_force_schedule(m: int, n: int) -> list[set[tuple[int, int]]]:
    clocks: list[set[tuple[int, int]]] = [set() for _ in range(m + n - 1)]
    for i in range(m):
        for j in range(n):
            clocks[i + j].add((i, j))
    return clocks


def test_clock_cycles_documented_example() -> None:
    assert list(clock_cycles(3, 2)) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    assert list(clock_cycles(1, 1)) == [[(0, 0)]]


@given(st.integers(1, 12), st.integers(1, 12))
def test_clock_cycles_is_the_fill_drain_schedule(m: int, n: int) -> None:
    schedule = list(clock_cycles(m, n))
    assert len(schedule) == m + n - 1
    assert [set(clock) for clock in schedule] == brute_force_schedule(m, n)
    for clock in schedule:
        assert len(clock) == len(set(clock))  # no task twice in a clock
        # One task per partition per clock, listed by partition.
        partitions = [j for _, j in clock]
        assert partitions == sorted(partitions)
        assert len(set(partitions)) == len(partitions)
    # Every (micro-batch, partition) runs exactly once, and after its predecessor.
    position = {task: k for k, clock in enumerate(schedule) for task in clock}
    assert len(position) == m * n
    for (i, j), k in position.items():
        if j > 0:
            assert position[(i, j - 1)] < k
        if i > 0:
            assert position[(i - 1, j)] < k
