"""Tests of the phase flags and of the generator state helpers."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe_checkpoint import (
    RNGStates,
    device_rng_lock,
    enable_checkpointing,
    enable_recomputing,
    is_checkpointing,
    is_recomputing,
    restore_rng_states,
    rng_moved,
    save_rng_states,
)

CPU = torch.device("cpu")

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- phase flags ----------------------------------------------------------------------------


def test_flags_are_false_by_default() -> None:
    assert is_checkpointing() is False
    assert is_recomputing() is False


def test_enable_checkpointing_nests_and_restores() -> None:
    with enable_checkpointing():
        assert is_checkpointing()
        assert not is_recomputing()
        with enable_checkpointing():
            assert is_checkpointing()
        assert is_checkpointing()
    assert not is_checkpointing()


def test_enable_recomputing_restores_after_an_error() -> None:
    with pytest.raises(KeyError), enable_recomputing():
        assert is_recomputing()
        assert not is_checkpointing()
        raise KeyError
    assert not is_recomputing()
    with pytest.raises(KeyError), enable_checkpointing():
        raise KeyError
    assert not is_checkpointing()


def test_flags_are_thread_local() -> None:
    seen: dict[str, bool] = {}

    def probe() -> None:
        seen["checkpointing"] = is_checkpointing()
        seen["recomputing"] = is_recomputing()

    with enable_checkpointing(), enable_recomputing():
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        assert is_checkpointing() and is_recomputing()
    assert seen == {"checkpointing": False, "recomputing": False}


# -- generator states ------------------------------------------------------------------------


def test_save_rng_states_on_cpu() -> None:
    states = save_rng_states(CPU)
    assert isinstance(states, RNGStates)
    assert states.cuda is None
    assert torch.equal(states.cpu, torch.get_rng_state())


def test_restore_rng_states_replays_and_puts_back() -> None:
    torch.manual_seed(42)
    first = torch.rand(4)
    second = torch.rand(4)

    torch.manual_seed(42)
    states = save_rng_states(CPU)
    a = torch.rand(4)
    with restore_rng_states(CPU, states):
        replayed = torch.rand(4)
    after = torch.rand(4)
    assert torch.equal(a, first)
    assert torch.equal(replayed, first)
    # The state after the body is the one before it: the draws go on where they were.
    assert torch.equal(after, second)


def test_restore_rng_states_puts_back_after_an_error() -> None:
    torch.manual_seed(3)
    states = save_rng_states(CPU)
    torch.rand(10)
    before = torch.get_rng_state()
    with pytest.raises(KeyError), restore_rng_states(CPU, states):
        torch.rand(3)
        raise KeyError
    assert torch.equal(torch.get_rng_state(), before)


# What a layer may draw: uniform, normal (whose second sample torch caches in the
# generator's state, so a draw may consume the cache alone), integers, and a Bernoulli mask.
DRAWS = {
    "rand": lambda k: torch.rand(k),
    "randn": lambda k: torch.randn(k),
    "randint": lambda k: torch.randint(0, 2**31 - 1, (k,)),
    "bernoulli": lambda k: torch.bernoulli(torch.full((k,), 0.5)),
    "normal_1": lambda k: [torch.normal(0.0, 1.0, (1,)) for _ in range(k)],
}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    warmup=st.integers(0, 700),
    draws=st.lists(st.tuples(st.sampled_from(sorted(DRAWS)), st.integers(1, 1300)), max_size=3),
)
def test_rng_moved_exactly_when_something_drew(
    seed: int, warmup: int, draws: list[tuple[str, int]]
) -> None:
    # Any draw moves the generator, 624 32-bit draws included (the Mersenne twister's
    # counters come back then, its state array does not); no draw leaves it.
    torch.manual_seed(seed)
    torch.randint(0, 2**31 - 1, (warmup,))
    states = save_rng_states(CPU)
    assert not rng_moved(CPU, states)
    for kind, k in draws:
        DRAWS[kind](k)
    after = torch.get_rng_state()
    assert rng_moved(CPU, states) == (not torch.equal(states.cpu, after)) == bool(draws)


def test_rng_moved_by_exactly_624_draws_and_a_cached_normal() -> None:
    torch.manual_seed(0)
    states = save_rng_states(CPU)
    torch.randint(0, 2**31 - 1, (624,))
    assert rng_moved(CPU, states)
    torch.randn(1)  # leaves a second normal sample cached (or not) in the state
    states = save_rng_states(CPU)
    torch.normal(0.0, 1.0, (1,))
    assert rng_moved(CPU, states)


def test_rng_moved_compares_states_of_any_layout() -> None:
    # A state that is not contiguous bytes (a caller's copy) is compared as torch.equal does.
    states = save_rng_states(CPU)
    strided = torch.empty(2 * len(states.cpu), dtype=torch.uint8)[::2]
    strided.copy_(states.cpu)
    copied = RNGStates(strided, None)
    assert not rng_moved(CPU, copied)
    torch.rand(1)
    assert rng_moved(CPU, copied)


def test_device_rng_lock_is_shared_per_device() -> None:
    lock = device_rng_lock(CPU)
    assert lock is device_rng_lock(torch.device("cpu"))
    assert hasattr(lock, "acquire") and hasattr(lock, "release")

    def free_elsewhere() -> bool:
        # Whether another thread can take the lock right now.
        seen: list[bool] = []

        def probe() -> None:
            taken = lock.acquire(blocking=False)
            if taken:
                lock.release()
            seen.append(taken)

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return seen[0]

    with lock:
        assert not free_elsewhere()
        with lock:  # reentrant in the thread that holds it
            assert not free_elsewhere()
        assert not free_elsewhere()
    assert free_elsewhere()
    cuda0 = device_rng_lock(torch.device("cuda", 0))
    assert cuda0 is device_rng_lock(torch.device("cuda:0"))
    assert cuda0 is not lock
    assert cuda0 is not device_rng_lock(torch.device("cuda", 1))


def test_device_rng_lock_is_the_same_in_every_thread() -> None:
    locks: list[object] = []
    barrier = threading.Barrier(8)

    def get() -> None:
        barrier.wait()
        locks.append(device_rng_lock(torch.device("cuda", 7)))

    threads = [threading.Thread(target=get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(locks) == 8
    assert all(lock is locks[0] for lock in locks)


@cuda
@needs_cuda
def test_save_and_restore_cuda_rng_states() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(5)
    states = save_rng_states(device)
    assert states.cuda is not None
    first_cuda = torch.rand(4, device=device)
    first_cpu = torch.rand(4)
    next_cuda = torch.rand(4, device=device)
    with restore_rng_states(device, states):
        assert torch.equal(torch.rand(4, device=device), first_cuda)
        assert torch.equal(torch.rand(4), first_cpu)
    torch.manual_seed(5)
    torch.rand(4, device=device)
    torch.rand(4, device=device)
    expected = torch.rand(4, device=device)
    torch.manual_seed(5)
    torch.rand(4, device=device)
    torch.rand(4, device=device)
    with restore_rng_states(device, states):
        torch.rand(4, device=device)
    assert torch.equal(torch.rand(4, device=device), expected)
    assert next_cuda.device == device


@cuda
@needs_cuda
def test_checkpoint_replays_cuda_dropout() -> None:
    from gpipe_checkpoint import checkpoint

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(64, device=device, requires_grad=True)
    y = checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5, training=True), x)
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad == 0, y.detach() == 0)


@pytest.mark.parametrize("use", ["save", "restore"])
def test_generator_states_are_read_and_written_under_one_lock(use: str) -> None:
    # torch can deadlock two threads that get or set a generator's state at once (its
    # mutex against the GIL); gpipe's own reads and writes wait for one Python lock.
    from gpipe_checkpoint import _rng as rng

    cpu = torch.device("cpu")
    states = save_rng_states(cpu)
    done = threading.Event()

    def touch() -> None:
        if use == "save":
            save_rng_states(cpu)
        else:
            with restore_rng_states(cpu, states):
                pass
        done.set()

    with rng._state_lock:
        thread = threading.Thread(target=touch)
        thread.start()
        blocked = not done.wait(0.2)
    thread.join(10)
    assert blocked and done.is_set()
