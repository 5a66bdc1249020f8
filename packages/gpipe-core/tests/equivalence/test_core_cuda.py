"""GPipe on CUDA devices: equivalence, placement, streams, autocast and dropout.

Every test here needs a GPU: the ``cuda`` marker (skipped by the root conftest without
one) and the module-level ``skipif`` (for runs without that conftest) both apply.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES, Scale
from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    ).double()


@pytest.fixture
def assert_equivalent() -> Callable[..., None]:
    def check(devices: list[str], balance: list[int], checkpoint: str) -> None:
        net = model()
        plain = copy.deepcopy(net).to(devices[0])
        pipe = GPipe(net, balance, devices=devices, chunks=4, checkpoint=checkpoint)
        for partition, device in zip(pipe.partitions, pipe.devices):
            assert all(p.device == device for p in partition.parameters())
        assert pipe.devices[0] == torch.device(devices[0])

        x = torch.randn(10, 8, dtype=torch.float64)
        # Checks the grads' devices too, and compares on the plain model's device.
        output, _ = assert_matches_plain(pipe, plain, x, weighted=True, device=devices[0])
        assert output.device == pipe.devices[-1]

    return check


@pytest.mark.parametrize("checkpoint", MODES)
def test_two_partitions_on_one_gpu(checkpoint: str, assert_equivalent: Callable[..., None]) -> None:
    assert_equivalent(["cuda:0", "cuda:0"], [3, 2], checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_one_partition_on_a_gpu(checkpoint: str, assert_equivalent: Callable[..., None]) -> None:
    assert_equivalent(["cuda:0"], [5], checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_cpu_then_gpu(checkpoint: str, assert_equivalent: Callable[..., None]) -> None:
    # The copy between partitions crosses from the CPU to the GPU.
    assert_equivalent(["cpu", "cuda:0"], [2, 3], checkpoint)


@two_gpus
@pytest.mark.parametrize("checkpoint", MODES)
def test_two_gpus(checkpoint: str, assert_equivalent: Callable[..., None]) -> None:
    assert_equivalent(["cuda:0", "cuda:1"], [3, 2], checkpoint)


@two_gpus
@pytest.mark.parametrize("checkpoint", MODES)
def test_three_partitions_back_and_forth(
    checkpoint: str, assert_equivalent: Callable[..., None]
) -> None:
    assert_equivalent(["cuda:0", "cuda:1", "cuda:0"], [2, 2, 1], checkpoint)


def test_default_devices_are_the_cuda_devices() -> None:
    n = min(torch.cuda.device_count(), 3)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    pipe = GPipe(net, [1] * n)
    assert pipe.devices == [torch.device("cuda", i) for i in range(n)]
    for j, partition in enumerate(pipe.partitions):
        assert all(p.device == torch.device("cuda", j) for p in partition.parameters())
    output = pipe(torch.randn(4, 4, device="cuda:0"))
    assert output.device == torch.device("cuda", n - 1)


def test_device_names_are_normalized() -> None:
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=[0, "cuda"])
    current = torch.cuda.current_device()
    assert pipe.devices == [torch.device("cuda", 0), torch.device("cuda", current)]


def test_too_many_partitions_for_the_default_devices() -> None:
    n = torch.cuda.device_count()
    net = nn.Sequential(*[nn.Identity() for _ in range(n + 1)])
    message = (
        rf"too few devices.*\(devices: {n}, partitions: {n + 1}\): by default each partition "
        rf"gets a CUDA device of its own; pass devices= to put several on one "
        rf"\(devices=\['cuda:0'\] \* {n + 1}, say\)"
    )
    with pytest.raises(ValueError, match=message):
        GPipe(net, [1] * (n + 1))


def test_input_on_the_cpu_is_refused() -> None:
    pipe = GPipe(model(), [3, 2], devices=["cuda:0", "cuda:0"])
    message = r"input must be on the first partition's device \(devices\[0\]: cuda:0, input: cpu\)"
    with pytest.raises(ValueError, match=message):
        pipe(torch.randn(4, 8, dtype=torch.float64))


def test_moving_is_refused_on_cuda() -> None:
    pipe = GPipe(model(), [3, 2], devices=["cuda:0", "cuda:0"])
    for move in (lambda m: m.cpu(), lambda m: m.to("cpu"), lambda m: m.to(torch.zeros(1))):
        with pytest.raises(TypeError, match=r"would move every partition"):
            move(pipe)
    # Where every partition is already, nothing moves (issue 24).
    with torch.cuda.device(0):
        for stay in (lambda m: m.cuda(), lambda m: m.cuda(0), lambda m: m.to("cuda:0")):
            assert stay(pipe) is pipe
        assert pipe.to(0) is pipe
    assert pipe.to(torch.float32) is pipe
    assert all(p.dtype == torch.float32 and p.is_cuda for p in pipe.parameters())


class Probe(nn.Module):
    def __init__(self, log: list[tuple[str, torch.dtype, bool, bool]], lock: threading.Lock):
        super().__init__()
        self.log = log
        self.lock = lock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.log.append(
                (
                    threading.current_thread().name,
                    x.dtype,
                    torch.is_autocast_enabled("cuda"),
                    is_recomputing(),
                )
            )
        return x


@pytest.mark.parametrize("checkpoint", MODES)
def test_cuda_autocast_reaches_the_workers_and_the_recomputation(checkpoint: str) -> None:
    log: list[tuple[str, torch.dtype, bool, bool]] = []
    lock = threading.Lock()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(8, 8), Probe(log, lock), nn.Linear(8, 8), Probe(log, lock), nn.Linear(8, 2)
    )
    pipe = GPipe(net, [2, 3], devices=["cuda:0", "cuda:0"], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 8, device="cuda:0", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.float16):
        output = pipe(x)
    assert output.dtype == torch.float16
    assert len(log) == 2 * 3
    assert {name for name, *_ in log} == {"gpipe-worker-0", "gpipe-worker-1"}
    assert all(dtype == torch.float16 and autocast for _, dtype, autocast, _ in log)
    log.clear()
    output.float().sum().backward()
    recomputed = {"always": 3, "except_last": 2, "never": 0}[checkpoint]
    assert len(log) == 2 * recomputed
    assert all(dtype == torch.float16 and autocast and rec for _, dtype, autocast, rec in log)
    assert x.grad is not None and x.grad.dtype == torch.float32


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_dropout_masks_are_replayed_on_cuda(
    checkpoint: str,
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Dropout(0.5), Scale(2.0), nn.Dropout(0.5), Scale(3.0), nn.Dropout(0.5), Scale(0.5)
    )
    pipe = GPipe(net, [2, 2, 2], devices=["cuda:0"] * 3, chunks=4, checkpoint=checkpoint)
    for _ in range(4):
        x = (torch.rand(16, 64, device="cuda:0", dtype=torch.float64) + 0.5).requires_grad_()
        output = pipe(x)
        output.sum().backward()
        torch.testing.assert_close(x.grad, output.detach() / x.detach())


def test_large_activations_survive_stream_reuse() -> None:
    # Many chunks and repeated runs exercise the copy streams and the caching allocator.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU()).double()
    plain = copy.deepcopy(net).cuda()
    pipe = GPipe(net, [2, 2], devices=["cuda:0", "cuda:0"], chunks=8)
    for _ in range(3):
        x = torch.randn(64, 256, device="cuda:0", dtype=torch.float64)
        torch.testing.assert_close(pipe(x), plain(x))
