"""Worker threads: started once, reused for every pass, stopped with the module; copies."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
import time

import pytest
import torch
from torch import nn

from gpipe_core import GPipe


def settle() -> int:
    """Collect garbage (stopping the workers of dead modules) and return the thread count."""
    gc.collect()
    return threading.active_count()


def wait_for_count(expected: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    count = threading.active_count()
    while count != expected and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
        count = threading.active_count()
    return count


def tiny() -> GPipe:
    torch.manual_seed(0)
    return GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)


def test_thread_count_is_stable_and_returns_after_deletion() -> None:
    before = settle()
    model = tiny()
    x = torch.randn(2, 2)
    model(x)
    ours = [t for t in threading.enumerate() if t.name.startswith("gpipe-worker-")]
    after_first = threading.active_count()
    assert after_first == before + 2
    for _ in range(999):
        model(x)
    assert threading.active_count() == after_first
    # Backward passes use no new threads either.
    for _ in range(20):
        model(x.requires_grad_()).sum().backward()
    assert threading.active_count() == after_first

    del model
    gc.collect()
    assert wait_for_count(before) == before
    assert not any(t.is_alive() for t in ours if t.name.startswith("gpipe-worker-"))


def test_no_threads_for_one_partition_or_before_the_first_pass() -> None:
    before = settle()
    single = GPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [2], chunks=3)
    single(torch.randn(6, 2))
    assert threading.active_count() == before
    two = tiny()
    assert threading.active_count() == before
    two(torch.randn(2, 2))
    assert threading.active_count() == before + 2
    del single, two
    assert wait_for_count(before) == before


class Boom(Exception):
    pass


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise Boom("no")


def test_thread_count_unchanged_after_exceptions() -> None:
    before = settle()
    model = GPipe(nn.Sequential(nn.Linear(2, 2), Fails(), nn.Linear(2, 2)), [1, 1, 1], chunks=3)
    with pytest.raises(Boom):
        model(torch.randn(6, 2))
    after_first = threading.active_count()
    assert after_first == before + 3
    for _ in range(20):
        with pytest.raises(Boom):
            model(torch.randn(6, 2))
    assert threading.active_count() == after_first
    del model
    assert wait_for_count(before) == before


def test_threads_stop_when_the_output_outlives_the_module() -> None:
    # The autograd graph of an output holds the layers, not the GPipe module: deleting
    # the module stops its workers, and backward still works.
    before = settle()
    model = tiny()
    x = torch.randn(4, 2, requires_grad=True)
    output = model(x)
    del model
    assert wait_for_count(before) == before
    output.sum().backward()
    assert x.grad is not None and x.grad.shape == (4, 2)


def test_workers_are_daemons_named_after_partitions() -> None:
    before = {t.ident for t in threading.enumerate()}
    model = GPipe(nn.Sequential(*[nn.Identity() for _ in range(3)]), [1, 1, 1])
    model(torch.zeros(2, 2))
    new = [t for t in threading.enumerate() if t.ident not in before]
    assert sorted(t.name for t in new) == ["gpipe-worker-0", "gpipe-worker-1", "gpipe-worker-2"]
    assert all(t.daemon for t in new)


def test_two_models_run_alternately() -> None:
    torch.manual_seed(0)
    a = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), [1, 1], chunks=2)
    b = GPipe(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), [1, 1], chunks=3)
    x = torch.randn(6, 3)
    for _ in range(5):
        torch.testing.assert_close(a(x), a[1](a[0](x)))
        torch.testing.assert_close(b(x), b[1](b[0](x)))


def test_concurrent_callers_of_one_model() -> None:
    # Two threads share one GPipe: runs are serialized and each gets its own result.
    torch.manual_seed(0)
    model = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)), [1, 1, 1], chunks=3)
    inputs = [torch.randn(6, 3) for _ in range(2)]
    expected = [model[2](model[1](model[0](x))).detach() for x in inputs]
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(30):
                    results[k].append(model(inputs[k]))
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    for k in range(2):
        assert len(results[k]) == 30
        for output in results[k]:
            torch.testing.assert_close(output, expected[k])


# -- copies ----------------------------------------------------------------------------------


def assert_same_model(original: GPipe, twin: GPipe) -> None:
    assert twin is not original
    assert twin.balance == original.balance
    assert twin.devices == original.devices
    assert twin.chunks == original.chunks
    assert twin.checkpoint == original.checkpoint
    for p, q in zip(original.parameters(), twin.parameters()):
        assert p is not q
        assert torch.equal(p, q)
    x = torch.randn(6, 3, requires_grad=True)
    torch.testing.assert_close(twin(x), original(x))
    twin(x).sum().backward()
    assert all(q.grad is not None for q in twin.parameters())


def copy_source() -> GPipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return GPipe(model, [2, 1], chunks=3, checkpoint="always")


@pytest.mark.parametrize("used", [False, True], ids=["fresh", "after-a-pass"])
def test_deepcopy(used: bool) -> None:
    original = copy_source()
    if used:
        original(torch.randn(6, 3)).sum().backward()
    original(torch.randn(3, 3))  # the original's workers exist from here on
    others = set(threading.enumerate())
    twin = copy.deepcopy(original)
    assert_same_model(original, twin)
    # Each has its own workers: both keep running after the other is gone. The twin's are
    # told by identity, since threads that earlier tests left may end meanwhile.
    twins = set(threading.enumerate()) - others
    assert len(twins) == 2, twins
    del twin
    deadline = time.monotonic() + 5.0
    while any(thread.is_alive() for thread in twins) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert not any(thread.is_alive() for thread in twins)
    assert original(torch.randn(3, 3)).shape == (3, 2)


def test_pickle_round_trip() -> None:
    original = copy_source()
    original(torch.randn(6, 3))
    twin = pickle.loads(pickle.dumps(original))
    assert isinstance(twin, GPipe)
    assert_same_model(original, twin)


def test_torch_save_round_trip() -> None:
    original = copy_source()
    original(torch.randn(6, 3))
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    twin = torch.load(buffer, weights_only=False)
    assert isinstance(twin, GPipe)
    assert_same_model(original, twin)


def test_state_dict_round_trip() -> None:
    original = copy_source()
    state = original.state_dict()
    # The plain module's keys (see test_core_state_dict.py).
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    torch.manual_seed(1)
    other = GPipe(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), [2, 1], chunks=3)
    other.load_state_dict(state)
    x = torch.randn(5, 3)
    torch.testing.assert_close(other(x), original(x))
