"""Saved activations during GPipe.step: 1F1B keeps fewer micro-batches alive than GPipe.

A :func:`torch.autograd.graph.saved_tensors_hooks` pack hook, active around the step and
carried into the workers, counts the bytes of the tensors saved for backward while they
are alive. No timing is measured.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_core import GPipe

N, M, WIDTH, ROWS = 4, 8, 32, 4


class SavedBytes:
    """Live bytes of saved tensors, each memory region counted once; and their peak.

    Parameters (and views of them) are left out: they live as long as the model.
    """

    def __init__(self, model: nn.Module) -> None:
        self.lock = threading.Lock()
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.users: dict[tuple[int, int], int] = {}
        self.live = 0
        self.peak = 0
        self.threads: set[str] = set()

    def _release(self, key: tuple[int, int]) -> None:
        with self.lock:
            self.users[key] -= 1
            if self.users[key] == 0:
                del self.users[key]
                self.live -= key[1]

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() in self.skip:
            return tensor
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        with self.lock:
            self.threads.add(threading.current_thread().name)
            if key not in self.users:
                self.users[key] = 0
                self.live += key[1]
                self.peak = max(self.peak, self.live)
            self.users[key] += 1
        # The graph holds ``box`` as long as it needs the tensor.
        box = _Box([tensor])
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def unpack(box: Any) -> torch.Tensor:
        return box.items[0] if isinstance(box, _Box) else box


class _Box:
    """A weak-referenceable holder; see :meth:`SavedBytes.pack`."""

    __slots__ = ("__weakref__", "items")

    def __init__(self, items: list[torch.Tensor]) -> None:
        self.items = items


def model(partitions: int = N) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(partitions):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def peak_saved_bytes(schedule: str, partitions: int = N) -> tuple[int, int, set[str]]:
    pipe = GPipe(model(partitions), [2] * partitions, chunks=M, checkpoint="never")
    x, y = torch.randn(M * ROWS, WIDTH), torch.randn(M * ROWS, WIDTH)
    counter = SavedBytes(pipe)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    return counter.peak, counter.live, counter.threads


def test_pack_hook_counts_what_a_plain_backward_saves() -> None:
    plain = model()
    x = torch.randn(ROWS, WIDTH)
    counter = SavedBytes(plain)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = plain(x).square().mean()
    assert counter.peak == counter.live > 0
    loss.backward()
    assert counter.live == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hooks_reach_every_worker_and_everything_is_released(schedule: str) -> None:
    peak, live, threads = peak_saved_bytes(schedule)
    assert peak > 0
    assert live == 0
    assert threads == {f"gpipe-worker-{j}" for j in range(N)}


@pytest.mark.parametrize("partitions", [2, N])
def test_one_f_one_b_keeps_fewer_micro_batches_in_flight(partitions: int) -> None:
    gpipe, _, _ = peak_saved_bytes("gpipe", partitions)
    one_f_one_b, _, _ = peak_saved_bytes("1f1b", partitions)
    one_micro_batch = gpipe / M  # GPipe holds every micro-batch at its peak
    assert one_f_one_b <= partitions / M * gpipe + one_micro_batch, (one_f_one_b, gpipe)
    assert one_f_one_b < gpipe
