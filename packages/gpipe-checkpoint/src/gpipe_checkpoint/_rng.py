"""Random number generator states, saved in the checkpoint phase and replayed in recompute."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "RNGStates",
    "device_rng_lock",
    "replay_rng_states",
    "restore_rng_states",
    "rng_moved",
    "save_rng_states",
]


class RNGStates(NamedTuple):
    """The CPU generator's state and, for a CUDA device, that device's generator state."""

    cpu: Tensor
    cuda: Tensor | None


def save_rng_states(device: torch.device) -> RNGStates:
    """Save the states of the generators that work on ``device`` draws from.

    Example:
        >>> states = save_rng_states(torch.device("cpu"))
        >>> a = torch.rand(2)
        >>> with restore_rng_states(torch.device("cpu"), states):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """
    with _state_lock:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return RNGStates(torch.default_generator.get_state(), cuda)


def rng_moved(device: torch.device, states: RNGStates) -> bool:
    """Whether the generators that work on ``device`` draws from have left ``states``
    (something drew from them, or set or seeded them, since ``states`` were saved).

    Exact: the whole states are compared. Cheap, as it runs after every forward pass of a
    checkpointed pipeline (a few microseconds on the CPU, about half of ``torch.equal``).

    Example:
        >>> states = save_rng_states(torch.device("cpu"))
        >>> rng_moved(torch.device("cpu"), states)
        False
        >>> _ = torch.rand(1)
        >>> rng_moved(torch.device("cpu"), states)
        True
    """
    with _state_lock:
        cpu = torch.default_generator.get_state()
        cuda = torch.cuda.get_rng_state(device) if states.cuda is not None else None
    if _differ(states.cpu, cpu):
        return True
    return cuda is not None and states.cuda is not None and _differ(states.cuda, cuda)


def _differ(saved: Tensor, now: Tensor) -> bool:
    """Whether a ``saved`` generator state differs from the state ``now`` (which torch
    just gave: contiguous bytes on the CPU)."""
    if (
        type(saved) is Tensor
        and saved.is_cpu
        and saved.dtype is torch.uint8
        and saved.is_contiguous()
    ):
        # One copy of each into bytes and a memcmp: several times cheaper than
        # torch.equal's dispatch on a few kilobytes.
        return ctypes.string_at(saved.data_ptr(), saved.nbytes) != ctypes.string_at(
            now.data_ptr(), now.nbytes
        )
    return not torch.equal(saved, now)


def _set_states(device: torch.device, states: RNGStates) -> None:
    with _state_lock:
        torch.set_rng_state(states.cpu)
        if states.cuda is not None:
            torch.cuda.set_rng_state(states.cuda, device)


def restore_rng_states(device: torch.device, states: RNGStates) -> AbstractContextManager[None]:
    """Run the body with the generators set to ``states``, then put back their states."""
    return _Restored(device, states)


class _Restored:
    """What :func:`restore_rng_states` returns (a class: it runs for every recomputation)."""

    __slots__ = ("before", "device", "states")

    def __init__(self, device: torch.device, states: RNGStates) -> None:
        self.device = device
        self.states = states
        self.before: RNGStates | None = None

    def __enter__(self) -> None:
        device = self.device if self.states.cuda is not None else torch.device("cpu")
        self.before = save_rng_states(device)
        _set_states(self.device, self.states)

    def __exit__(self, *exc_info: object) -> None:
        assert self.before is not None
        _set_states(self.device, self.before)
        self.before = None


# torch takes a generator's mutex while holding the GIL to get or set its state, and may
# run Python code (a garbage collection) while holding that mutex: two threads getting or
# setting states at once can deadlock, each holding what the other waits for. Threads
# wait for this lock instead, which releases the GIL while waiting.
_state_lock = threading.Lock()


_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()


def device_rng_lock(device: torch.device) -> threading.RLock:
    """A process-wide lock for the generator that work on ``device`` draws from.

    Work on the CPU draws from one generator, whatever the thread. Two threads that draw
    from it at once interleave their draws unpredictably, so a checkpoint phase could not
    replay its own draws. Threads hold this lock while they run work that draws random
    numbers under checkpointing. The lock is reentrant, so work that holds it may run
    nested work that takes it again in the same thread.
    """
    key = str(device) if device.type == "cuda" else "cpu"
    lock = _locks.get(key)
    if lock is None:
        with _locks_guard:
            lock = _locks.setdefault(key, threading.RLock())
    return lock


@contextmanager
def replay_rng_states(device: torch.device, states: RNGStates) -> Iterator[None]:
    """Run the body with the generators set to ``states``, holding the device's generator
    lock (:func:`device_rng_lock`), then put back their states.

    What a recomputation replays its random draws in: holding the lock, no other thread
    that draws under the lock (a checkpointed pipeline partition, another recomputation) can
    draw between the restore and the put-back, where its draws would be replayed or lost.

    Example:
        >>> states = save_rng_states(torch.device("cpu"))
        >>> a = torch.rand(2)
        >>> with replay_rng_states(torch.device("cpu"), states):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """
    with device_rng_lock(device), restore_rng_states(device, states):
        yield
